"""Tests for world.py (the shapes world), the `shapes` reward and tools/train_tiny.py, on CPU.

    python -m pytest -q tests/test_world.py
"""

import dataclasses
import json
import math
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import grpo
from helpers import trainer, user_input
from helpers import rewards
from helpers import world

from conftest import picture, sample_group

ROOT = Path(__file__).resolve().parent.parent  # the repository: grpo.py, tools/, examples/


def test_captions_and_split():
    """Five kinds; the held-out captions never occur in training, nor does a caption that says the same thing in other
    words; every word and every object of the held-out captions occurs in training."""
    captions = world.all_captions()
    assert {k: len(v) for k, v in captions.items()} == {"single": 12, "position": 108, "counting": 24,
                                                         "two_objects": 132, "relation": 528}
    train, held = world.caption_split()
    assert len(train) + len(held) == 804 and not set(train) & set(held) and 0.15 < len(held) / 804 < 0.25
    assert world.caption_split() == (train, held) and world.caption_split(seed=1) != (train, held)  # seeded
    assert ("a red circle and a blue square" in held) == ("a blue square and a red circle" in held)
    assert ("a red circle left of a blue square" in held) == ("a blue square right of a red circle" in held)
    words = {w for c in train for w in c.split()}
    assert all(w in words for c in held for w in c.split())
    for kind in world.KINDS:
        assert any(world.parse_caption(c)["kind"] == kind for c in held)


def test_parse_caption():
    assert world.parse_caption("Two red circles.") == {"kind": "counting", "relation": None,
                                                       "objects": [("red", "circle", None)] * 2}
    assert world.parse_caption("a blue square at the top left")["objects"] == [("blue", "square", (0, 0))]
    assert world.parse_caption("a green circle on the right")["objects"] == [("green", "circle", (1, 2))]
    spec = world.parse_caption("a red circle left of a blue square")
    assert spec["relation"] == (0, "left of", 1) and spec["objects"][1] == ("blue", "square", None)
    assert world.parse_caption("a cat on a mat") is None and world.parse_caption("four red circles") is None
    for captions in world.all_captions().values():
        assert all(world.parse_caption(c) is not None for c, _ in captions)


def test_sample_scene_and_corrupt():
    """Scenes drawn for a caption satisfy it; a corrupted one never does; labels round-trip."""
    rng = random.Random(0)
    train, _ = world.caption_split()
    for caption in rng.sample(train, 200):
        scene = world.sample_scene(caption, rng)
        spec = world.parse_caption(caption)
        assert world.satisfies(scene, spec) and len(scene) == len(spec["objects"])
        assert world.scene_of_labels(world.labels(scene)) == scene
        assert not world.satisfies(world.corrupt(scene, caption, rng), spec)
    with pytest.raises(ValueError, match="not a caption"):
        world.sample_scene("a cat", rng)


def test_valid_scenes_and_the_diversity_ceiling():
    """Right layouts by hand: one object anywhere 9, two alike 36, three 84, two different 72, "A left of B" 27 (a
    column left, any rows), "at the top left" 1. Distinct values among 8 uniform draws over m: 1 for m 1,
    m (1 - (1 - 1/m)^8), at most 8, and no distribution over 9 values beats uniform's."""
    assert [world.valid_scenes(c) for c in ("a red circle", "two red circles", "three red circles",
                                            "a red circle and a blue square", "a red circle left of a blue square",
                                            "a red circle at the top left")] == [9, 36, 84, 72, 27, 1]
    assert world.expected_distinct(1) == 1 and world.expected_distinct(9) == pytest.approx(5.4923, abs=1e-4)
    assert 7.9 < world.expected_distinct(10 ** 6) < 8
    rng = np.random.default_rng(0)
    skewed = rng.choice(9, size=(20000, 8), p=np.r_[0.2, [0.1] * 8])
    assert np.mean([len(set(row)) for row in skewed]) < world.expected_distinct(9)


def test_components():
    mask = np.zeros((6, 6), bool)
    mask[0:2, 0:2] = mask[4:6, 3:6] = True
    mask[3, 0] = True  # touches (2, 0)? no: row 2 is empty, so a third region
    labels, n = world.components(mask)
    assert n == 3 and len({labels[0, 0], labels[5, 5], labels[3, 0]}) == 3 and labels[0, 0] == labels[1, 1]
    assert world.components(np.zeros((3, 3), bool))[1] == 0


def test_read_scene_on_rendered_pictures():
    """Every rendered scene (random sizes and offsets) is read back exactly, also scaled to another size."""
    rng = random.Random(1)
    train, _ = world.caption_split()
    for caption in rng.sample(train, 150):
        scene = world.sample_scene(caption, rng)
        image = world.render(scene, rng)
        assert {(r, c): o for r, c, o in world.read_scene(np.asarray(image))} == scene
    scene = {(0, 0): ("red", "triangle"), (2, 2): ("blue", "circle"), (1, 1): ("yellow", "square")}
    big = world.render(scene).resize((192, 192))
    assert {(r, c): o for r, c, o in world.read_scene(np.asarray(big))} == scene
    assert world.read_scene(np.full((96, 96, 3), 255, np.uint8)) == []


def test_check_scene_partial_credit():
    """Hand-computed scores: half for fully right, half the mean of count, per-object colour / shape / cell and
    relation."""
    def score(partial):  # a picture that is not fully right
        return 0.5 * partial

    spec = world.parse_caption("a red circle at the top left")
    assert world.check_scene([(0, 0, ("red", "circle"))], spec) == 1.0
    assert world.check_scene([(0, 1, ("red", "circle"))], spec) == pytest.approx(score((1 + 2 / 3) / 2))  # wrong cell
    assert world.check_scene([(0, 0, ("red", "circle")), (2, 2, ("blue", "square"))], spec) == score(0.5)  # one extra
    assert world.check_scene([], spec) == 0.0
    spec = world.parse_caption("two blue squares")
    assert world.check_scene([(0, 0, ("blue", "square"))], spec) == pytest.approx(score((0.5 + 0.5) / 2))
    assert world.check_scene([(0, 0, ("blue", "square")), (1, 1, ("blue", "circle"))], spec) == pytest.approx(
        score((1 + (1 + 0.5) / 2) / 2))
    spec = world.parse_caption("a red circle left of a blue square")
    assert world.check_scene([(0, 0, ("red", "circle")), (2, 1, ("blue", "square"))], spec) == 1.0
    assert world.check_scene([(0, 2, ("red", "circle")), (2, 1, ("blue", "square"))], spec) == pytest.approx(
        score(2 / 3))
    assert world.check_scene([(0, 1, ("red", "circle")), (2, 1, ("blue", "square"))], spec) == pytest.approx(
        score(2 / 3))
    # every picture that is not fully right scores below every fully right one by at least 0.5
    assert max(world.check_scene([(r, c, ("red", "circle")), (2, 2, ("blue", "square"))], spec)
               for r in range(3) for c in range(3) if c >= 2) < 0.5


def test_shapes_reward():
    """The world's own pictures score >= 0.98 on average (here: all 1.0); the same pictures against a caption of
    another scene score clearly lower; one score per image, in [0, 1]."""
    rng = random.Random(2)
    train, _ = world.caption_split()
    captions = rng.sample(train, 60)
    scenes = [world.sample_scene(c, rng) for c in captions]
    images = torch.stack([picture(s, rng) for s in scenes])
    right = torch.cat([rewards.shapes_reward(images[i:i + 1], {"prompt": c}) for i, c in enumerate(captions)])
    shuffled = captions[1:] + captions[:1]
    wrong = torch.cat([rewards.shapes_reward(images[i:i + 1], {"prompt": c}) for i, c in enumerate(shuffled)])
    assert right.mean() >= 0.98 and right.min() == 1.0
    assert wrong.mean() < 0.5 and (wrong < 1).float().mean() > 0.9
    group = rewards.shapes_reward(images[:4], {"prompt": captions[0]})
    assert group.shape == (4,) and group[0] == 1.0 and ((group >= 0) & (group <= 1)).all()
    assert rewards.shapes_reward(torch.full((2, 3, 96, 96), 0.5), {"prompt": "a red circle"}).tolist() == [0.0, 0.0]


def test_shapes_exact_reward():
    """1 exactly where shapes is 1 (fully right), else 0: GenEval's accuracy."""
    rng = random.Random(3)
    caption = "two red circles"
    right = picture(world.sample_scene(caption, rng), rng)
    wrong = picture(world.sample_scene("a blue square", rng), rng)
    images = torch.stack([right, wrong, torch.full((3, 96, 96), 0.5)])
    partial = rewards.shapes_reward(images, {"prompt": caption})
    assert partial[0] == 1.0 and 0 < partial[1] < 1
    assert rewards.shapes_exact_reward(images, {"prompt": caption}).tolist() == [1.0, 0.0, 0.0]


def test_size_reward():
    """The share of a 26-pixel disc each asked object covers, on world.render's anti-aliased pictures: 20- and
    24-pixel discs (20/26)^2 and (24/26)^2 within 0.02, 26 pixels ~1, larger capped at 1, a blank picture 0; counted
    per object asked (one of two drawn: half), and the same at twice the resolution."""
    class Width:  # world.render's rng: the width asked for, centred (the offsets are 0)
        def __init__(self, width):
            self.width = width

        def randint(self, low, high):
            return self.width if low == 20 else 0

    def drawn(scene, width, size=96):
        image = world.render(scene, Width(width)).resize((size, size))
        return torch.from_numpy(np.array(image)).permute(2, 0, 1).float()[None] / 255

    one, two, disc = {"prompt": "a red circle"}, {"prompt": "two red circles"}, ("red", "circle")
    for width in (20, 24, 26):
        got = rewards.size_reward(drawn({(1, 1): disc}, width), one).item()
        assert got == pytest.approx(min(1.0, (width / 26) ** 2), abs=0.02), width
    assert rewards.size_reward(drawn({(1, 1): disc}, 31), one).item() == 1.0
    assert rewards.size_reward(torch.ones(1, 3, 96, 96), one).item() == 0.0
    both = rewards.size_reward(drawn({(0, 0): disc, (2, 2): disc}, 24), two).item()
    half = rewards.size_reward(drawn({(0, 0): disc}, 24), two).item()
    assert both == pytest.approx((24 / 26) ** 2, abs=0.02) and half == pytest.approx(both / 2, abs=1e-6)
    big = rewards.size_reward(drawn({(1, 1): disc}, 24, size=192), one).item()
    assert big == pytest.approx((24 / 26) ** 2, abs=0.02)


def test_shapes_reward_bad_prompt(tmp_path, capsys):
    """A prompt outside the world's grammar stops the run before anything is written, naming its line."""
    prompts = tmp_path / "p.txt"
    prompts.write_text("a red circle\na cat on a mat\n")
    with pytest.raises(SystemExit) as stop:
        grpo.main(["--prompts", str(prompts), "--reward", "shapes=1", "--out", str(tmp_path / "run")])
    assert stop.value.code == 2
    assert "p.txt:2: reward 'shapes': 'a cat on a mat' is not a caption of the shapes world" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_demo_files():
    """prompts.txt holds world captions with their rendered targets (each read back as its caption says); the shapes
    demo trains on training captions only and the held-out file holds the rest."""
    examples = user_input.read_prompts(str(ROOT / "prompts.txt"))
    assert len(examples) >= 3
    for example in examples:
        target = user_input.load_image(example["target"], world.SIZE, world.SIZE)
        assert rewards.shapes_reward(target[None], example).item() == 1.0
    train, held = world.caption_split()
    shapes = [e["prompt"] for e in user_input.read_prompts(str(ROOT / "examples" / "shapes.txt"))]
    held_file = [e["prompt"] for e in user_input.read_prompts(str(ROOT / "examples" / "shapes_heldout.jsonl"))]
    assert sorted(shapes) == sorted(train) and sorted(held_file) == sorted(held)
    kinds = {e["category"] for e in user_input.read_prompts(str(ROOT / "examples" / "shapes_heldout.jsonl"))
             if e["category"] == world.parse_caption(e["prompt"])["kind"]}
    assert kinds == set(world.KINDS)  # every line's category is its caption's kind, and every kind is there
    assert all(e["prompt"] in train for e in examples)


def test_train_tiny_quick(tmp_path):
    """tools/train_tiny.py runs every stage for a few steps and writes a checkpoint folder that
    GlmImagePipeline.from_pretrained loads, as --model tiny loads tiny_glm_image/."""
    out = tmp_path / "tiny"
    result = subprocess.run([sys.executable, str(ROOT / "tools" / "train_tiny.py"), "--quick", "--out", str(out)],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "6. saved" in result.stdout and not (tmp_path / "tiny.tmp").exists()
    report = json.loads((out / "training_report.json").read_text())
    assert set(report["seconds"]) == {"data", "vae", "vq", "dit", "ar", "check"}
    pipe = grpo.load_glm_image(str(out))
    rollout = sample_group(pipe, "a red circle", 2, 96, 96, 0.9, seed=0)
    assert rollout.tokens.shape == (2, 256 + 9)


def test_tiny_model_draws_what_it_is_asked():
    """The shipped tiny_glm_image/ is the pre-trained model: it draws held-out captions of the easier kinds fully
    right far more often than by chance (a random model: never), and its training report says how it was made."""
    sys.path.insert(0, str(ROOT / "tools"))
    from bench_learning import shapes_accuracy
    held = world.caption_split()[1]  # the held-out captions (examples/shapes_heldout.jsonl deals them by kind)
    easy = [c for c in held if world.parse_caption(c)["kind"] in ("single", "position")][:8]
    result = shapes_accuracy(grpo.load_glm_image("tiny"), easy, samples=4)
    assert result["accuracy"] >= 0.4, result
    report = json.loads((ROOT / "tiny_glm_image" / "training_report.json").read_text())
    assert report["held_out"]["accuracy"] > 0.3 and report["size_mb"] < 30


def test_optimum_of_draws():
    """tools/bench_learning.py's estimate of G = ref exp(R / beta) / Z from the reference's draws, by hand: each draw
    weighs exp(R / beta) within its caption; G's right share; the expected distinct grids of 8 draws from G over the
    free-place captions (a grid drawn twice holds both draws' mass); beta inf: the draws' own shares."""
    sys.path.insert(0, str(ROOT / "tools"))
    from bench_learning import optimum_of_draws
    reward = torch.tensor([[1.0, 0.5, 1.0, 0.0], [0.5, 0.5, 0.0, 0.0]])
    right = (reward == 1).float()
    grids = [[(1,), (2,), (1,), (3,)], [(1,), (2,), (3,), (4,)]]
    free = torch.tensor([True, False])
    got = optimum_of_draws(reward, right, grids, free, [math.inf, 0.5])
    w = [math.exp(r / 0.5) for r in (1.0, 0.5, 1.0, 0.0)]
    p1 = [w[0] + w[2], w[1], w[3]]  # caption 0's grids (1,), (2,), (3,)
    z = [sum(w) / 4, 2 * math.exp(0.5 / 0.5) / 4 + 2 / 4]  # each caption's Z = E_ref[exp(R / beta)]
    assert got[0] == pytest.approx({"beta": None, "right": (0.5 + 0.0) / 2,
                                    "layouts": 1 - 0.5 ** 8 + 2 * (1 - 0.75 ** 8), "objective": 3.5 / 8})
    assert got[1] == pytest.approx({"beta": 0.5, "right": (w[0] + w[2]) / sum(w) / 2,
                                    "layouts": sum(1 - (1 - m / sum(w)) ** 8 for m in p1),
                                    "objective": 0.5 * (math.log(z[0]) + math.log(z[1])) / 2})


def test_objective_gap():
    """tools/bench_learning.py's KL(pi || G) from a run's record, by hand on a two-answer bandit: ref (1/2, 1/2),
    rewards (1, 0), beta 0.5, so G = (e^2, 1) / (e^2 + 1) and J(G) = beta log Z = 0.5 log((e^2 + 1) / 2), which
    optimum_of_draws gives from the two draws. Two windows: pi = (0.3, 0.7), then G itself; each logs E_pi[R] and its
    KL(pi || ref) spread over 3 tokens (the per-token kl a third of it). The gaps are KL(pi || G) computed directly,
    and 0 at G."""
    sys.path.insert(0, str(ROOT / "tools"))
    from bench_learning import objective_gap, optimum_of_draws
    beta = 0.5
    reading, = optimum_of_draws(torch.tensor([[1.0, 0.0]]), torch.tensor([[1.0, 0.0]]), [[(0,), (1,)]],
                                torch.tensor([True]), [beta])
    assert reading["objective"] == pytest.approx(beta * math.log((math.e ** 2 + 1) / 2))
    g = [math.e ** 2 / (math.e ** 2 + 1), 1 / (math.e ** 2 + 1)]
    policies = ([0.3, 0.7], g)
    curves = {"reward_mean": [pi[0] for pi in policies],
              "kl": [sum(p * math.log(p / 0.5) for p in pi) / 3 for pi in policies]}
    gaps = objective_gap(curves, beta, 3, reading["objective"])
    direct = [sum(p * math.log(p / q) for p, q in zip(pi, g)) for pi in policies]
    assert gaps == pytest.approx(direct, abs=1e-6)
    assert gaps[1] == pytest.approx(0.0, abs=1e-6) and gaps[0] > 0.1


def test_bench_learning_gap_refuses_in_one_line(tmp_path):
    """tools/bench_learning.py --gap without runs recorded, or without --optimum's reading on the training captions,
    and --captions without --optimum: each a one-line error, a non-zero exit, no traceback, nothing written."""
    results, gap = tmp_path / "bench_learning.jsonl", ["--gap", str(tmp_path / "gap.png")]

    def refused(argv, says):
        done = subprocess.run([sys.executable, str(ROOT / "tools" / "bench_learning.py"), *argv], capture_output=True,
                              text=True, cwd=tmp_path)
        assert done.returncode != 0 and says in done.stderr and "Traceback" not in done.stderr, done.stderr
    refused([*gap, "--results", str(results)], "does not exist")
    results.write_text("")  # runs recorded, no reading of G beside them
    refused([*gap, "--results", str(results)], "no reading on the training captions")
    refused(["--captions", "training"], "give --optimum BETA")
    assert not (tmp_path / "gap.png").exists()


def test_bench_learning_continues_its_shorter_runs(tmp_path):
    """tools/bench_learning.py's --steps N continues the longest shorter run of the same row, flags and seed that saved
    its end checkpoint (a 400-step run's folder has no suffix); another seed's, or one without that checkpoint, never."""
    sys.path.insert(0, str(ROOT / "tools"))
    from bench_learning import same_settings, shorter_run
    for name, step in [("clusters_seed2", 400), ("clusters_seed2_800steps", 800), ("clusters_seed2_3200steps", 3200),
                       ("clusters_seed20", 400), ("clusters_seed20_1200steps", 1200), ("clusters_seed2_1000steps", None)]:
        (tmp_path / name / "checkpoints" / f"step-{step or 10}").mkdir(parents=True)
    assert shorter_run(tmp_path, "clusters_seed2", 1600) == (tmp_path / "clusters_seed2_800steps", 800)
    assert shorter_run(tmp_path, "clusters_seed2", 800) == (tmp_path / "clusters_seed2", 400)
    assert shorter_run(tmp_path, "clusters_seed2", 400) is None
    assert shorter_run(tmp_path, "default_seed2", 1600) is None
    argv = ["--prompts", str(ROOT / "examples" / "shapes.txt"), "--reward", "shapes=1", "--seed", "2"]
    saved = tmp_path / "clusters_seed2"
    for flags, same in [([], True), (["--lr", "2e-4"], False), (["--lr-scheduler", "linear"], False), (None, True)]:
        cfg = trainer.parse_config(grpo, [*argv, "--steps", "400", "--out", str(saved), *(flags or [])])
        config = dataclasses.asdict(cfg)  # as the run saved it; None: saved before --reference-reset-kl existed
        (saved / "config.json").write_text(json.dumps(config if flags is not None else
                                                      {k: v for k, v in config.items() if k != "reference_reset_kl"}))
        assert same_settings(saved, [*argv, "--steps", "1600", "--out", str(tmp_path / "x"), "--overwrite",
                                     *(flags if "--lr-scheduler" in (flags or []) else [])]) == same, flags
