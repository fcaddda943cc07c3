"""Tests for editing that learns: world.py's edits, the `edit` reward, tools/train_tiny_edit.py and the tiny editing
model (tiny_glm_image_edit/), on CPU.

    python -m pytest -q tests/test_edit.py
"""

import json
import random
import subprocess
import sys

import pytest
import torch

import grpo
from helpers import rewards, trainer, user_input
from helpers import run
from helpers import world
from conftest import ROOT, TINY, picture, run_record, sample_group


def test_edit_grammar_and_split():
    """Every edit's instruction parses back to its key; text outside the grammar is None; the held-out combinations
    never occur in training, and every word of a held-out instruction does."""
    edits = world.all_edits()
    assert {k: len(v) for k, v in edits.items()} == {"recolour": 36, "move": 108, "remove": 12, "add": 108}
    for keys in edits.values():
        for key in keys:
            assert world.parse_edit(world.edit_of(*key)) == key
    assert world.edit_of("add", ("red", "circle"), (1, 1)) == "add a red circle in the center"
    assert world.parse_edit("Make the red circle blue.") == ("recolour", ("red", "circle"), "blue")
    for text in ("make the red circle purple", "move it back into place", "remove the red circles", "a red circle"):
        assert world.parse_edit(text) is None
    train, held = world.edit_split()
    assert not set(train) & set(held) and len(train) + len(held) == 264
    assert all(any(k[0] == kind for k in held) for kind in world.EDIT_KINDS)
    words = {w for k in train for w in world.edit_of(*k).split()}
    assert all(w in words for k in held for w in world.edit_of(*k).split())


def test_apply_edit():
    """Each kind changes exactly what it says; an edit that does not apply (the object absent or there twice, the
    cell taken, a recolour that makes a second object alike) gives None."""
    red, blue = ("red", "circle"), ("blue", "square")
    scene = {(0, 0): red, (2, 2): blue}
    assert world.apply_edit(scene, ("recolour", red, "green")) == {(0, 0): ("green", "circle"), (2, 2): blue}
    assert world.apply_edit(scene, ("move", red, (1, 1))) == {(1, 1): red, (2, 2): blue}
    assert world.apply_edit(scene, ("remove", blue, None)) == {(0, 0): red}
    assert world.apply_edit(scene, ("add", ("yellow", "triangle"), (0, 1))) == {**scene, (0, 1): ("yellow", "triangle")}
    assert scene == {(0, 0): red, (2, 2): blue}  # the source is left alone
    assert world.apply_edit(scene, ("remove", ("green", "circle"), None)) is None  # not there
    assert world.apply_edit({(0, 0): red, (0, 1): red}, ("remove", red, None)) is None  # which one?
    assert world.apply_edit(scene, ("move", red, (2, 2))) is None  # taken
    assert world.apply_edit(scene, ("add", red, (1, 1))) is None  # already there
    assert world.apply_edit(scene, ("add", ("green", "circle"), (0, 0))) is None  # taken
    assert world.apply_edit({(0, 0): red, (1, 1): ("blue", "circle")}, ("recolour", red, "blue")) is None
    rng = random.Random(0)
    for key in [k for keys in world.all_edits().values() for k in keys[::7]]:
        source = world.edit_source(key, rng)
        assert 1 <= len(source) <= 3 and world.apply_edit(source, key) not in (None, source)


def test_check_edit():
    """1.0 exactly when every cell is as asked; one cell off scores below 0.5 (GRPO prefers a right edit to any near
    miss); two objects seen in one cell make it wrong."""
    want = {(0, 0): ("red", "circle"), (1, 1): ("blue", "square")}
    seen = [(r, c, o) for (r, c), o in want.items()]
    assert world.check_edit(seen, want) == 1.0
    off = world.check_edit(seen[:1], want)
    assert off == pytest.approx(0.5 * 8 / 9) and off < 0.5
    assert world.check_edit(seen + [(1, 1, ("blue", "square"))], want) < 0.5
    assert world.check_edit([], {}) == 1.0 and world.check_edit(seen, {}) == pytest.approx(0.5 * 7 / 9)


def test_edit_reward():
    """The edit reward reads the source and the results with the world's reader: the edit done scores 1 (edit_exact
    1), the source unchanged and a wrong edit score below 0.5. Bad lines are refused before a run, in one line."""
    rng = random.Random(1)
    key = ("move", ("red", "circle"), (2, 0))
    source = {(0, 0): ("red", "circle"), (1, 2): ("green", "triangle")}
    done, wrong = world.apply_edit(source, key), {(2, 1): ("red", "circle"), (1, 2): ("green", "triangle")}
    images = torch.stack([picture(done, rng), picture(source, rng), picture(wrong, rng)])
    example = {"prompt": world.edit_of(*key), "source": picture(source, rng)}
    score = rewards.edit_reward(images, example)
    assert score[0] == 1.0 and (score[1:] < 0.5).all() and score[1] > 0
    assert rewards.edit_exact_reward(images, example).tolist() == [1.0, 0.0, 0.0]
    assert set(rewards.edit_reward.needs) == {"prompt", "source"}


def test_edit_reward_refuses_bad_lines(tmp_path):
    """Before anything is written: an instruction outside the grammar, or one that does not apply to its source, is one
    line naming the fix."""
    world.render({(0, 0): ("red", "circle")}).save(tmp_path / "s.png")
    for prompt, words in (("make it night", "not an edit of the shapes world"),
                          ("remove the blue square", "does not apply to its source")):
        example = {"prompt": prompt, "source": user_input.load_image(tmp_path / "s.png", 96, 96, "source")}
        assert words in rewards.not_a_world_edit(example)
    source = user_input.load_image(tmp_path / "s.png", 96, 96, "source")
    assert rewards.not_a_world_edit({"prompt": "remove the red circle", "source": source}) is None


def test_edit_examples():
    """examples/edits_train.jsonl and edits_heldout.jsonl: every line's instruction applies to its source as the
    reader sees it; the held-out pairs use held-out combinations only, the training pairs training ones; every kind in
    both."""
    train, held = world.edit_split()
    for split, keys in (("train", set(train)), ("heldout", set(held))):
        lines = [json.loads(x) for x in (ROOT / "examples" / f"edits_{split}.jsonl").read_text().splitlines()]
        assert {x["category"] for x in lines} == set(world.EDIT_KINDS)
        for x in lines:
            assert world.parse_edit(x["prompt"]) in keys
            source = user_input.load_image(ROOT / "examples" / x["source"], world.SIZE, world.SIZE, "source")
            assert rewards.not_a_world_edit({**x, "source": source}) is None


def test_train_tiny_edit_quick(tmp_path):
    """tools/train_tiny_edit.py --quick: a few AR steps, a folder GlmImagePipeline loads (the AR written, the other
    parts linked to tiny_glm_image/'s) with its report, nothing left half-written."""
    out = tmp_path / "e"
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "train_tiny_edit.py"), "--quick", "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "3. saved" in done.stdout and not (tmp_path / "e.tmp").exists()
    assert (out / "vision_language_encoder").is_dir() and (out / "transformer").is_symlink()
    assert set(json.loads((out / "training_report.json").read_text())["held_out"]) >= {"accuracy", *world.EDIT_KINDS}
    pipe = grpo.load_glm_image(str(out))
    source = picture({(0, 0): ("red", "circle")})
    rollout = sample_group(pipe, "remove the red circle", 2, 96, 96, 0.9, 0, source)
    assert rollout.tokens.shape == (2, 9) and rollout.prompt.source.codes.tolist() == [1] + [0] * 8


def test_tiny_edit_model():
    """The shipped editing model: `--model tiny-edit` loads it with the tiny defaults; its DiT, VAE, T5 are
    tiny_glm_image/'s; its AR differs from the drawing one. Its report says it edits some held-out pairs right and
    gets others wrong (room for GRPO)."""
    cfg = trainer.parse_config(grpo, ["--model", "tiny-edit"])
    assert (cfg.height, cfg.num_inference_steps, cfg.kl_beta, cfg.mu) == (96, 2, 0.1, 2)
    folder = grpo.TINY_MODELS["tiny-edit"]
    for part in ("transformer", "vae", "text_encoder"):
        assert (folder / part).resolve() == (grpo.TINY / part).resolve()
    report = json.loads((folder / "training_report.json").read_text())
    assert 0.2 < report["held_out"]["accuracy"] < 0.8 and report["dit_decoded_right"] > 0.9
    assert run.compute_settings("cpu", "auto", "tiny-edit") == torch.float32


def test_grpo_on_edits(tmp_path):
    """grpo.py on the editing demo's files with the editing model: the edit reward is logged in [0, 1], the first
    ratio is exactly 1 and sampler and trainer agree (float32); the eval line reports edit_exact per kind."""
    lines = [json.loads(x) for x in (ROOT / "examples" / "edits_train.jsonl").read_text().splitlines()][:2]
    held = [json.loads(x) for x in (ROOT / "examples" / "edits_heldout.jsonl").read_text().splitlines()][:2]
    for name, rows in (("train.jsonl", lines), ("held.jsonl", held)):  # sources by absolute path
        (tmp_path / name).write_text("".join(json.dumps({**x, "source": str(ROOT / "examples" / x["source"])}) + "\n"
                                             for x in rows))
    argv = [*TINY, "--model", "tiny-edit", "--height", "96", "--width", "96",
            "--prompts", str(tmp_path / "train.jsonl"),
            "--reward", "edit", "--eval-prompts", str(tmp_path / "held.jsonl"), "--eval-every", "0", "--eval-samples",
            "2", "--eval-reward", "edit_exact", "--steps", "2", "--kl-beta", "0.1", "--out", str(tmp_path / "run"),
            "--image-every", "0"]
    grpo.main(argv)
    record = run_record(tmp_path / "run")
    steps, evals = [x for x in record if not x.get("eval")], [x for x in record if x.get("eval")]
    assert len(steps) == 2 and all(0 <= x["reward/edit"] <= 1 for x in steps)
    assert all(x["ratio_min"] == x["ratio_max"] == 1.0 and x["sampler_gap"] <= 1e-5 for x in steps)
    kinds = {held[0]["category"], held[1]["category"]}
    assert len(evals) == 2 and all({f"eval/edit_exact/{k}" for k in kinds} <= set(x) for x in evals)
