"""Tests for run.py, the plumbing of a run (grpo.py's and dit_grpo.py's): input files and their checks, bad input
(one line, exit 2), --resume, Ctrl-C, out of memory, a full disk, checkpoints that survive a kill, the metrics and
pictures a run writes. The input functions have a test_<function> each; the loop's helpers (start, open_run, timed,
training, steps, log_step, after_step, show, run_evaluation, finish, summarize) run in every test of main, and the
tests below are named after the behaviour of a run they guard.

    python -m pytest -q tests/test_run.py
"""

import dataclasses
import json
import math
import os
import re
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import grpo
from helpers import fast_decode, trainer
from helpers import user_input
from helpers import parallel
from helpers import run
from helpers import run as helpers_run  # the tests' `run` is often a run directory
from helpers import run_io
from helpers import setup
from conftest import (DEVICE, ROOT, TINY, TINY_CPU, assert_same_metrics, assert_same_weights, error_lines,
                      expect_exit, fresh_pipe, latest_state, one_process, run_cli, run_record, snapshot, tiny_run,
                      torchrun, write_evals, write_example)  # shared helpers and settings

STEPS = (grpo.sample_groups, grpo.decode_images, grpo.group_rewards)  # what grpo.main passes run.evaluate


def test_validate():
    """Sizes not multiple of 32, G < 2, micro-batches that do not divide G, bad ranges and values outside a field's
    choices are refused, each with a message naming the flag and its value."""
    good = trainer.parse_config(grpo, ["--model", "tiny"])
    run.validate(good)
    for change, needle in [(dict(height=48), "--height 48 is out of range; it must be a positive multiple of 32"),
                           (dict(width=0), "--width 0 is out"), (dict(group_size=1), "--group-size 1 is out of range; it "
                                                                  "must be >= 2 (GRPO compares"),
                           (dict(micro_batch_size=3), "--micro-batch-size 3 must divide --group-size 8"),
                           (dict(clip_eps=0.0), "--clip-eps 0.0 is out of range"),
                           (dict(kl_beta=-1.0), "--kl-beta -1.0 is out of range"), (dict(lr=0.0), "--lr 0.0 is out"),
                           (dict(train_tokens="some"), "--train-tokens some"),
                           (dict(sampler_correction="tis"), "--sampler-correction tis: use token_truncate, token_mask, "
                            "sequence_truncate, sequence_mask or none"),
                           (dict(sampler_cap=0.5), "--sampler-cap 0.5 is out of range; it must be >= 1"),
                           (dict(train="vae"), "--train vae: use ar or dit"),
                           (dict(dtype="fp16"), "--dtype fp16: use auto, float32 or bfloat16"),
                           (dict(device="tpu"), "--device tpu: use auto, cpu or cuda"),
                           (dict(scale_rewards="mean"), "--scale-rewards mean: use group, batch or none"),
                           (dict(policy_dist="nucleus"), "--policy-dist nucleus: use full or truncated"),
                           (dict(diversity=-1.0), "--diversity -1.0 is out of range"),
                           (dict(unlikeliness=-0.5), "--unlikeliness -0.5 is out of range"),
                           (dict(steps=0), "--steps 0 is out of range; it must be >= 1")]:
        with pytest.raises(ValueError, match=re.escape(needle)):
            run.validate(dataclasses.replace(good, **change))


def test_plot_curves(tmp_path):
    """curves.png from training and eval lines (and from training lines alone); a run without lines is refused, by
    tools/plot_run.py with one line."""
    lines = [{"step": s, "prompts": [0, 1], "reward_mean": 0.1 * s, "reward_std": 0.05, "kl": 0.01 * s,
              "clip_frac": 0.0, "zero_std_groups": s % 2} for s in range(6)]
    lines[3:3] = [{"step": 0, "eval": True, "eval/reward": 0.3, "eval/reward/a": 0.2},
                  {"step": 5, "eval": True, "eval/reward": 0.5, "eval/reward/a": 0.4}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert Image.open(run_io.plot_curves(tmp_path)).size == (1600, 600)
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines if "eval" not in x))
    assert Image.open(run_io.plot_curves(tmp_path)).size == (1600, 600)
    (tmp_path / "metrics.jsonl").write_text("")
    with pytest.raises(ValueError, match="no steps yet"):
        run_io.plot_curves(tmp_path)
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "plot_run.py"), str(tmp_path / "nope")],
                          capture_output=True, text=True)
    assert proc.returncode != 0 and proc.stderr.strip().count("\n") == 0 and "no metrics.jsonl" in proc.stderr


def test_image_grid():
    """One row per prompt (label strip under each), reference tiles first (None: blank), rewards under the samples;
    tiles below 128 pixels are enlarged; titles (the prompt, the step) go in a strip above each row."""
    rows = [[("target", torch.zeros(3, 32, 32))] + [("", torch.full((3, 32, 32), 0.5))] * 3,
            [("target", None)] + [("", torch.full((3, 32, 32), 0.5))] * 3]
    grid = run_io.image_grid(rows, torch.tensor([[0.1, 0.2, 0.3], [0.4, 0.5, 0.6]]))
    assert grid.size == (4 * 128, 2 * (128 + 14))  # 32-pixel tiles shown at 128
    pixels = np.asarray(grid)
    assert (pixels[128:142, 128:256] < 128).any()  # a reward written under the first sample
    assert (pixels[:128, :128] == 0).all() and (pixels[142:270, :128] == 255).all()  # the target; a blank tile
    titled = np.asarray(run_io.image_grid(rows, torch.zeros(2, 3), titles=["step 0: a red circle", "another"]))
    assert titled.shape[:2] == (2 * (14 + 128 + 14), 4 * 128)
    assert (titled[:14] < 128).any() and (titled[14:142, :128] == 0).all()  # the title above the target tile


def test_main_before_after(tmp_path):
    """--before-after N samples the first N prompts with fixed seeds before and after training: the same weights give
    the same images (a negligible lr), the grids sit side by side, and the summary gives both mean rewards."""
    prompts = write_example(tmp_path, ["a red circle | t.png", "two blue squares | t.png", "a third | t.png"])
    common = [*TINY, "--prompts", str(prompts), "--steps", "2", "--image-every", "0", "--before-after", "2"]
    still = grpo.main([*common, "--out", str(tmp_path / "still"), "--lr", "1e-12"])
    images = tmp_path / "still" / "images"
    assert sorted(p.name for p in images.iterdir()) == ["after.json", "after.png", "before.json", "before.png",
                                                        "before_after.png"]
    before, after = np.asarray(Image.open(images / "before.png")), np.asarray(Image.open(images / "after.png"))
    assert before.shape == after.shape == (2 * (14 + 128 + 14), (1 + 4) * 128, 3)  # 2 prompts: target + G samples
    tiles = np.ones(before.shape[0], bool)
    tiles[[p * 156 + r for p in range(2) for r in range(14)]] = False  # each prompt's title strip names the step
    assert (before[tiles] == after[tiles]).all() and still["shown_before"] == still["shown_after"]
    assert Image.open(images / "before_after.png").size == (2 * before.shape[1] + 16, before.shape[0])
    moved = grpo.main([*common, "--out", str(tmp_path / "moved"), "--lr", "0.05"])
    assert moved["shown_before"] == still["shown_before"] and moved["shown_after"] != moved["shown_before"]


def test_eval_record():
    """Means over prompts and samples per reward, and per category over the examples that have one; the diversity of
    the prompts that leave the layout free (not "free_layout": false): mean distinct layouts, share with one."""
    examples = [{"category": "a"}, {"category": "b"}, {"category": "a", "free_layout": False}, {}]
    total = torch.tensor([[1.0, 0.0], [0.5, 0.5], [0.0, 0.0], [2.0, 2.0]])
    layouts = torch.tensor([2.0, 1.0, 1.0, 1.0])
    record = run.eval_record(5, examples, total, {"x": total * 2}, layouts, 1.5)
    assert record["step"] == 5 and record["eval"] is True and record["sec_eval"] == 1.5
    assert record["eval/reward"] == pytest.approx(0.75) and record["eval/x"] == pytest.approx(1.5)
    assert record["eval/reward/a"] == pytest.approx(0.25) and record["eval/x/b"] == pytest.approx(1.0)
    assert record["eval/distinct_layouts"] == pytest.approx(4 / 3) and record["eval/one_layout"] == pytest.approx(2 / 3)
    assert record["eval/distinct_layouts/a"] == 2.0 and record["eval/one_layout/a"] == 0.0  # the fixed one left out
    assert record["eval/one_layout/b"] == 1.0
    assert not any(k.endswith("/None") for k in record)


def test_evaluate(random_pipe, tmp_path):
    """Example i is sampled with seeds[i] whatever else is evaluated or the global RNG: the same weights give the same
    images, rewards and layout counts; an example's distinct large grids are counted (K where every sample differs, 1
    for one layout); no examples (a process with no share): empty results of the right shapes."""
    pipe = random_pipe
    cfg = trainer.parse_config(grpo, [*TINY, "--num-inference-steps", "1"])
    examples = user_input.load_examples(user_input.read_prompts(write_evals(tmp_path)), {"ssim": (grpo.ssim_reward, 1.0)}, 64, 64)
    examples = [{**e, "target": e["target"].to(DEVICE)} for e in examples]  # as main moves them
    rewards = {"ssim": (grpo.ssim_reward, 1.0), "mse": (grpo.mse_reward, 0.0)}
    images, total, each, layouts = run.evaluate(pipe, examples, [7, 8, 9], rewards, 3, cfg, STEPS)
    torch.manual_seed(123)  # the global RNG must not matter
    again_images, again, _, again_layouts = run.evaluate(pipe, examples, [7, 8, 9], rewards, 3, cfg, STEPS)
    assert total.shape == (3, 3) and torch.equal(total, again) and torch.equal(total, each["ssim"])
    assert len(images) == 3 and all(torch.equal(a, b) for a, b in zip(images, again_images))
    assert layouts.tolist() == again_layouts.tolist() == [3.0, 3.0, 3.0]  # the random model: every sample differs
    _, last, last_each, last_layouts = run.evaluate(pipe, examples[2:], [9], rewards, 3, cfg, STEPS)  # example 2 alone
    assert torch.equal(last[0], total[2]) and torch.equal(last_each["mse"][0], each["mse"][2])
    _, other, _, _ = run.evaluate(pipe, examples, [7, 8, 10], rewards, 3, cfg, STEPS)
    assert torch.equal(other[:2], total[:2]) and not torch.equal(other[2], total[2])  # another seed, other samples
    none = run.evaluate(pipe, [], [], rewards, 3, cfg, STEPS)
    assert none[0] == [] and none[1].shape == (0, 3) and none[2]["mse"].shape == (0, 3) and none[3].shape == (0,)
    sample_groups = grpo.sample_groups

    def repeats(*args, **kw):  # the large grids of example 0: three copies of one; 1: two of one, one other; 2: as
        rollouts = sample_groups(*args, **kw)  # drawn. Previews untouched: they differ, and are not the layout
        for r, rows in zip(rollouts, ([0, 0, 0], [1, 1, 2], [0, 1, 2])):
            n = r.prompt.large_hw[0] * r.prompt.large_hw[1]
            r.tokens[:, -n:] = r.tokens[rows, -n:]
        return rollouts
    cfg1 = dataclasses.replace(cfg, prompts_per_step=3, group_size=3)  # the three examples in one decode
    steps = (repeats, grpo.decode_images, grpo.group_rewards)
    assert run.evaluate(pipe, examples, [7, 8, 9], rewards, 3, cfg1, steps)[3].tolist() == [1.0, 2.0, 3.0]


def test_merge_parts():
    """Micro-batches' metrics -> one dict (parallel.merge_parts): extremes by min / max, counts summed, the rest weighted by each part's
    share of the sequences, over the parts that have the metric (an editing group has no preview region)."""
    parts = [({"loss": 1.0, "ratio_min": 0.9, "ratio_max": 1.1, "outside_truncation": 2, "x/max": 3.0,
               "preview/kl": 0.5}, 0.25),
             ({"loss": 3.0, "ratio_min": 0.8, "ratio_max": 1.0, "outside_truncation": 1, "x/max": 1.0}, 0.75)]
    assert parallel.merge_parts(parts) == {"loss": 2.5, "ratio_min": 0.8, "ratio_max": 1.1, "outside_truncation": 3,
                                         "x/max": 3.0, "preview/kl": 0.5}


def test_trainable_state_before_any_update():
    """A checkpoint written before any update (a stop in step 1, a first step whose updates were all skipped) saves
    a fresh AdamW and leaves the running one fresh: get_state_dict steps the optimizer once at lr 0 to build its
    state, whose step count 1 would otherwise reach the next update's bias correction (its step then off by one)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    _, saved = parallel.trainable_state(model, opt)
    assert saved["state"] == {} and not opt.state  # fresh, saved and running
    twin = torch.nn.Linear(3, 2)
    twin.load_state_dict(model.state_dict())
    twin_opt = torch.optim.AdamW(twin.parameters(), lr=0.1)
    for m, o in ((model, opt), (twin, twin_opt)):  # the next update: as if nothing had been saved
        m(torch.ones(1, 3)).sum().backward()
        o.step()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters()))


def test_merge_metrics():
    """train_step's mu updates -> the last update's means, extremes over every update, the sampler's readings from
    the first update only (later updates read the changed policy), the largest update's kl as kl_peak (mu > 1)."""
    first = [({"loss": 1.0, "ratio_min": 1.0, "sampler_gap": 1e-7, "outside_truncation": 0}, 1.0)]
    last = [({"loss": 3.0, "ratio_min": 0.7, "sampler_gap": 0.5, "outside_truncation": 4}, 1.0)]
    assert parallel.merge_metrics([first, last]) == {"loss": 3.0, "ratio_min": 0.7, "sampler_gap": 1e-7,
                                                     "outside_truncation": 0}
    first[0][0]["kl"], last[0][0]["kl"] = 0.5, 0.25  # with a KL: the last update's, and the largest (kl_peak)
    merged = parallel.merge_metrics([first, last])
    assert merged["kl"] == 0.25 and merged["kl_peak"] == 0.5
    assert "kl_peak" not in parallel.merge_metrics([last])  # one update: its kl
    first[0][0]["kl"] = math.nan  # a non-finite update's KL: the others' peak
    assert parallel.merge_metrics([first, last])["kl_peak"] == 0.25


def test_extreme():
    """How a metric combines: min / max by name or by its /min, /max suffix, counts summed, None (a mean) otherwise."""
    assert parallel.extreme("ratio_min") is min and parallel.extreme("sampler_gap") is max
    assert parallel.extreme("sampling/importance_sampling_ratio/max") is max and parallel.extreme("x/min") is min
    assert parallel.extreme("outside_truncation") is sum and parallel.extreme("loss") is None


def test_evaluate_shared():
    """Process r of w evaluates examples r, r + w, ... with seed + i (r.evaluate is called even with no share: FSDP
    gathers in every process); rows come back in example order; only the first keep_images examples' images, rounded
    to 8 bits."""
    calls = []

    def fake(examples, seeds, rewards, n_samples):  # images that are not 8-bit exact; rewards = the seeds
        calls.append(seeds)
        total = torch.tensor([[float(s)] * n_samples for s in seeds]).reshape(-1, n_samples)
        return ([torch.full((3, 2, 2), 0.3) for _ in seeds], total, {"r": total * 2},
                torch.tensor([float(s) for s in seeds]))
    examples = [{"prompt": str(i)} for i in range(5)]
    images, total, each, layouts = run.evaluate_shared(fake, examples, {}, 2, 100, 4, rank=1, world=2)
    assert calls == [[101, 103]]  # process 1 of 2: examples 1 and 3
    assert total.tolist() == [[101.0] * 2, [103.0] * 2] and each["r"].tolist() == [[202.0] * 2, [206.0] * 2]
    assert layouts.tolist() == [101.0, 103.0] and len(images) == 2  # example 3 < keep_images 4: both kept
    assert all(torch.equal(im, torch.full((3, 2, 2), round(0.3 * 255) / 255)) for im in images)
    assert len(run.evaluate_shared(fake, examples, {}, 2, 100, 3, rank=1, world=2)[0]) == 1  # example 3 not kept
    # more processes than examples: rank 0's share is example 0, rank 3 has none and still takes part
    assert run.evaluate_shared(fake, examples[:1], {}, 2, 100, 1, rank=0, world=9)[1].tolist() == [[100.0] * 2]
    assert run.evaluate_shared(fake, examples[:1], {}, 2, 100, 1, rank=3, world=9)[1].shape == (0, 2)
    assert calls[-1] == []


def test_main_report_to(tmp_path, monkeypatch):
    """--report-to tensorboard sends every metrics line's numbers at its step (training and eval) and the image grids,
    and closes the writer (a stand-in SummaryWriter records the calls: the package is optional); the metrics file is
    the same as without it."""
    import sys
    import types
    calls = []

    class Writer:
        def __init__(self, log_dir, purge_step):
            calls.append(("open", log_dir, purge_step))

        def add_text(self, *args):
            calls.append(("text", args[0]))

        def add_scalar(self, key, value, step):
            calls.append(("scalar", key, step))

        def add_image(self, name, pixels, step, dataformats):
            calls.append(("image", name, step, pixels.shape[-1], dataformats))

        def close(self):
            calls.append(("close",))

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", types.SimpleNamespace(SummaryWriter=Writer))
    monkeypatch.setattr(run, "check_reporter", lambda kind: None)  # the real one asks for the installed package
    evals = ["--eval-prompts", str(write_evals(tmp_path)), "--eval-every", "1", "--eval-samples", "2"]
    tiny_run(tmp_path, tmp_path / "tb", "--steps", "2", "--report-to", "tensorboard", "--image-every", "1", *evals)
    assert calls[0] == ("open", str(tmp_path / "tb" / "tensorboard"), 1) and calls[-1] == ("close",)
    scalars = {(c[1], c[2]) for c in calls if c[0] == "scalar"}
    # steps count from 1: the training lines at 1 and 2, the evaluations after 0 and 2 updates
    assert {("reward_mean", 1), ("reward_mean", 2), ("eval/reward", 0), ("eval/reward", 2), ("loss", 2),
            ("sampling/k3_kl", 1)} <= scalars
    assert {(c[1], c[2]) for c in calls if c[0] == "image"} == {("samples", 1), ("samples", 2), ("eval", 0),
                                                                 ("eval", 1), ("eval", 2)}
    tiny_run(tmp_path, tmp_path / "plain", "--steps", "2", "--image-every", "1", *evals)
    assert run_record(tmp_path / "tb") == run_record(tmp_path / "plain")


def test_trackers_resume(tmp_path, monkeypatch):
    """--report-to tensorboard,wandb with the trackers themselves (wandb offline, as WANDB_MODE says): a resume
    continues both: TensorBoard's reward_mean at steps 1-3 once each (a resume from step 1 after a run to 2 purges the
    first try's step 2), and one wandb run id for all three invocations (kept in the run folder), named --run-name in
    --wandb-project."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / "tracked"
    tiny_run(tmp_path, out, "--steps", "2", "--save-every", "1", "--report-to", "tensorboard,wandb", "--run-name",
             "lab-1", "--wandb-project", "glm-tests")
    grpo.main(["--resume", str(out / "checkpoints" / "step-1"), "--overwrite"])  # back to step 1, to step 2 again
    grpo.main(["--resume", str(out), "--steps", "3"])
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("reward_mean")] == [1, 2, 3]
    assert [e.step for e in events.Scalars("lr")] == [1, 2, 3]
    run_id = (out / "wandb_run_id.txt").read_text()
    runs = sorted((out / "wandb").glob("offline-run-*"))
    assert len(runs) == 3 and all(r.name.endswith("-" + run_id) for r in runs), runs
    settings = json.loads((out / "config.json").read_text())
    assert (settings["run_name"], settings["wandb_project"], settings["report_to"]) == ("lab-1", "glm-tests",
                                                                                        "tensorboard,wandb")


def test_tracker_without_network(tmp_path, monkeypatch, capsys):
    """--report-to wandb online with an API key and no network (its server refuses): the run goes on with wandb
    offline, said in one line with the command that uploads it later (it was a raw traceback after wandb's wait, and a
    directory only --overwrite could start again)."""
    monkeypatch.setenv("WANDB_MODE", "online")
    monkeypatch.setenv("WANDB_API_KEY", "0" * 40)
    monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{free_port()}")  # nothing listens there
    monkeypatch.setenv("WANDB_INIT_TIMEOUT", "5")
    monkeypatch.setenv("WANDB_SILENT", "true")
    import wandb
    wandb.teardown()  # wandb's settings are read once a process: another test's offline mode would hold
    out = tmp_path / "offline"
    try:
        tiny_run(tmp_path, out, "--steps", "1", "--report-to", "wandb")
    finally:
        wandb.teardown()
    err = capsys.readouterr().err
    assert "warning: wandb could not start online" in err and f"wandb sync {out / 'wandb'}/offline-run-*" in err
    assert "Traceback" not in err and len(run_record(out)) == 1
    assert len(list((out / "wandb").glob("offline-run-*"))) == 1


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_check_reporter(monkeypatch):
    """--report-to: an unknown name, a package that is not installed, or wandb online without an API key is refused
    with the fix."""
    import types

    run_io.check_reporter("none")
    monkeypatch.setenv("WANDB_MODE", "offline")
    run_io.check_reporter("tensorboard,wandb")
    monkeypatch.setenv("WANDB_MODE", "online")  # online: an API key, or one line before anything loads
    monkeypatch.setenv("HOME", "/nonexistent")  # no ~/.netrc
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    with pytest.raises(ValueError, match="no wandb API key: run wandb login .* WANDB_MODE=offline"):
        run_io.check_reporter("wandb")
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    run_io.check_reporter("wandb")
    with pytest.raises(ValueError, match="--report-to mlflow: use none, tensorboard, wandb"):
        run_io.check_reporter("tensorboard,mlflow")
    missing = types.SimpleNamespace(util=types.SimpleNamespace(find_spec=lambda name: None))
    monkeypatch.setattr(run_io, "importlib", missing)
    for kind in ("tensorboard", "wandb"):
        with pytest.raises(ValueError, match=f"needs the {kind} package.*pip install {kind}"):
            run_io.check_reporter(kind)


def test_main_custom_reward_without_targets(tmp_path, monkeypatch):
    """A user reward from an import path on examples without any target: the run trains, and every reward is
    logged on its own (reward/<name>) besides the weighted sum."""
    (tmp_path / "brightness.py").write_text("def reward(images, example):\n    return images.mean(dim=(1, 2, 3))\n")
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "a bright square"}\n{"prompt": "another", "mood": "dark"}\n')
    monkeypatch.chdir(tmp_path)
    summary = grpo.main([*TINY, "--prompts", "prompts.jsonl", "--out", "run", "--steps", "2",
                         "--reward", "brightness:reward=2", "--image-every", "1"])
    lines = run_record(tmp_path / "run")
    assert [x["prompts"] for x in lines] == [[0], [1]] and summary["skipped"] == 0
    assert all(abs(x["reward_mean"] - 2 * x["reward/brightness:reward"]) < 1e-6 for x in lines)
    assert sorted(p.name for p in (tmp_path / "run" / "images").iterdir()) == ["step_00001.png", "step_00002.png"]


def test_prepare_bad_input(tmp_path, capsys, monkeypatch):
    """Every bad input: exit code 2, one line naming the problem and the fix, nothing written to --out."""
    good = write_example(tmp_path, ["a | t.png"])
    (tmp_path / "missing_source.jsonl").write_text('{"prompt": "add a red circle at the top left", "source": '
                                                   '"nope.png"}\n')

    def unreachable(*args, **kwargs):  # the hub, from a machine without a network
        raise OSError("network is unreachable")

    monkeypatch.setattr("socket.create_connection", unreachable)
    (tmp_path / "bad_line.txt").write_text("# c\nfine | t.png\nno target\n")
    (tmp_path / "empty.txt").write_text("\n# nothing\n")
    (tmp_path / "binary.txt").write_bytes(b"\x80\x81\x00bad")
    (tmp_path / "notimage.png").write_text("hello")
    Image.fromarray(np.zeros((64, 64, 3), np.uint8)).save(tmp_path / "full.png")
    (tmp_path / "corrupt.png").write_bytes((tmp_path / "full.png").read_bytes()[:60])
    (tmp_path / "no_target.txt").write_text("a prompt alone\n")
    for name in ["missing_target", "notimage", "corrupt"]:
        target = {"missing_target": "nope.png", "notimage": "notimage.png", "corrupt": "corrupt.png"}[name]
        (tmp_path / f"{name}.txt").write_text(f"a prompt | {target}\n")
    out = tmp_path / "out"
    P = lambda name: ["--prompts", str(tmp_path / name)]  # noqa: E731
    cases = [(P("nothere.txt"), "nothere.txt"), (["--prompts", str(tmp_path)], "--prompts"),
             (P("empty.txt"), "no examples"), (P("bad_line.txt"), "bad_line.txt:3"), (P("binary.txt"), "UTF-8"),
             (P("missing_target.txt"), "missing_target.txt:1: target .*nope.png does not exist"),
             ([*P("missing_source.jsonl"), "--reward", "edit"], "missing_source.jsonl:1: source .*nope.png does not "
                                                               "exist"),
             (["--model", "someone/not-a-model"], "--model someone/not-a-model is not in the hub cache and .* cannot "
                                                  "be reached"),
             (["--model", str(tmp_path)], "no pipeline folder there"),
             (P("notimage.txt"), "notimage.txt:1: target .*not a readable image"),
             (P("corrupt.txt"), "corrupt.txt:1: target .*not a readable image"),
             (["--height", "50"], "multiple of 32"), (["--width", "-32"], "multiple of 32"),
             (["--group-size", "1"], "must be >= 2"), (["--micro-batch-size", "3"], "must divide"),
             (["--clip-eps", "1.5"], "--clip-eps"), (["--kl-beta", "-0.1"], "--kl-beta"), (["--lr", "0"], "--lr"),
             (["--clip-eps-high", "0"], "--clip-eps-high"), (["--scale-rewards", "mean"], "group, batch or none"),
             (["--top-p", "0"], "--top-p"), (["--top-k", "-1"], "--top-k"),
             (["--reward", "clipscore=1"], "unknown reward"), (["--reward", "ssim=-1"], "negative"),
             (["--steps", "0"], "--steps"), (["--resume", str(tmp_path / "none")], "no checkpoint there"),
             (P("no_target.txt"), "no_target.txt:1: reward 'ssim' needs a target"),
             (["--reward", "nosuchmodule:f=1"], "cannot import"),
             (["--eval-prompts", str(tmp_path / "nothere.jsonl")], "cannot read --eval-prompts .*nothere.jsonl"),
             (["--eval-prompts", str(tmp_path / "no_target.txt")], "no_target.txt:1: reward 'ssim' needs a target"),
             (["--eval-prompts", str(good), "--eval-reward", "clipscore"], "unknown reward 'clipscore' in --eval-reward"),
             (["--eval-prompts", str(good), "--eval-reward", "ocr"], "reward 'ocr' needs a text"),
             (["--eval-reward", "mse"], "--eval-reward is measured on --eval-prompts"),
             (["--eval-every", "-1"], "--eval-every -1 is out of range; it must be >= 0"), (["--eval-samples", "0"], "--eval-samples")]
    if not torch.cuda.is_available():
        cases.append((["--device", "cuda"], "--device cuda, but torch .* sees no CUDA GPU here; use --device cpu"))
    for args, needle in cases:
        with pytest.raises(SystemExit) as exit_info:
            grpo.main([*TINY, "--out", str(out), *(args if "--prompts" in args else ["--prompts", str(good), *args])])
        err = capsys.readouterr().err
        assert exit_info.value.code == 2, args
        assert re.search(needle, err) and len(error_lines(err)) == 1 and "Traceback" not in err, (args, err)
        assert not out.exists(), args


def test_main_bad_input_cli(tmp_path):
    """Through the command line: exit code 2, one line, no traceback, nothing written; a run is never clobbered."""
    good = write_example(tmp_path, ["a | t.png"])
    (tmp_path / "bad.txt").write_text("fine | t.png\nno target\n")
    out = tmp_path / "out"
    for args, needle in [(["--prompts", str(tmp_path / "bad.txt"), *TINY], "bad.txt:2"),
                         (["--prompts", str(good), "--model", str(tmp_path / "no-such-model")], "no-such-model")]:
        proc = run_cli(*args, "--out", str(out))
        assert proc.returncode == 2, (args, proc.stderr)
        assert needle in proc.stderr and "Traceback" not in proc.stderr + proc.stdout
        assert len(error_lines(proc.stderr)) == 1, proc.stderr
        assert not out.exists()
    out.mkdir()
    (out / "metrics.jsonl").write_text("precious\n")
    proc = run_cli("--prompts", str(good), *TINY, "--out", str(out), "--steps", "1")
    assert proc.returncode == 2 and "--resume" in proc.stderr and "--overwrite" in proc.stderr
    assert (out / "metrics.jsonl").read_text() == "precious\n"


def test_checkpoints_roll_back(tmp_path, capsys):
    """checkpoints/step-N/ each hold the trainer state and a model that loads alone; --save-total-limit keeps the
    latest K; --resume RUN/checkpoints/step-N goes back only with --overwrite (the later checkpoints and final/ would
    be replaced) and then continues exactly as the uninterrupted run; the bookkeeping flags may change on resume."""
    from transformers import GlmImageForConditionalGeneration
    tiny_run(tmp_path, tmp_path / "whole", "--steps", "5", "--kl-beta", "0.04")
    out = tmp_path / "run"
    tiny_run(tmp_path, out, "--steps", "5", "--kl-beta", "0.04", "--save-every", "1", "--save-total-limit", "3",
             "--image-every", "1")
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-3", "step-4", "step-5"]  # 5 saves, 3 kept
    assert run_record(out) == run_record(tmp_path / "whole")
    ar = GlmImageForConditionalGeneration.from_pretrained(out / "checkpoints" / "step-5")
    assert all(torch.equal(p, q) for p, q in zip(ar.parameters(), GlmImageForConditionalGeneration.from_pretrained(
        out / "final").parameters()))
    before = snapshot(out)
    back = ["--resume", str(out / "checkpoints" / "step-3")]
    err = expect_exit(back, 2, "has later checkpoints (step-4, step-5) and final/", capsys)
    assert "goes back to step 3" in err and "--overwrite" in err
    assert snapshot(out) == before
    grpo.main([*back, "--overwrite", "--save-every", "2", "--image-every", "2", "--eval-every", "3"])
    assert run_record(out) == run_record(tmp_path / "whole")
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-3", "step-4", "step-5"]
    # the steps up to 3 keep their grids; the discarded step 4's goes, and the redone step 5 draws its own
    assert sorted(p.name for p in (out / "images").iterdir()) == [f"step_0000{s}.png" for s in (1, 2, 3, 5)]
    again = GlmImageForConditionalGeneration.from_pretrained(out / "final")
    assert all(torch.equal(p, q) for p, q in zip(ar.parameters(), again.parameters()))
    assert json.loads((out / "config.json").read_text())["save_every"] == 2  # bookkeeping: changed
    expect_exit(["--resume", str(out), "--steps", "6", "--kl-beta", "0"], 2, "cannot take --kl-beta", capsys)
    tiny_run(tmp_path, out, "--steps", "1", "--overwrite")  # a new run in its place: the old one's files go
    assert len(run_record(out)) == 1 and sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-1"]


def test_resume_keeps_the_checkpoints_batch(tmp_path):
    """A resumed step trains the groups of the checkpoint it resumes (its prompts per step x its processes), even
    when a later launch on another number of processes rewrote config.json's per-process count (a Ctrl-C right after
    such a resume keeps the older checkpoint: the review of issue 58 found the batch shrinking silently there)."""
    out = tmp_path / "run"
    tiny_run(tmp_path, out, "--steps", "1", "--prompts-per-step", "2")
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "prompts_per_step": 1}))  # as 2 processes save it
    grpo.main(["--resume", str(out), "--steps", "2"])
    assert [len(x["prompts"]) for x in run_record(out)] == [2, 2]


def test_inner_bars(tmp_path, monkeypatch, capsys):
    """In a terminal, work that runs longer than parallel.INNER_DELAY (the real model's) shows bars under the step's:
    the token draws, the DiT steps, an evaluation's prompts; the tiny model's steps end before (its terminal output
    as it was). In a log file no bar at all, however slow: a plain line a step."""
    evals = ["--eval-prompts", str(write_evals(tmp_path)), "--eval-samples", "2"]
    monkeypatch.setattr(parallel, "INNER_DELAY", 0)  # every phase counts as slow
    tiny_run(tmp_path, tmp_path / "logged", "--steps", "2", *evals)
    err = capsys.readouterr().err  # (captured: not a terminal)
    assert "\r" not in err and not any(bar in err for bar in ("tokens:", "DiT steps:", "evaluation:", "grpo:")), err
    assert [line.split(":")[0] for line in err.splitlines() if line.startswith("step ")] == ["step 1/2", "step 2/2"]
    monkeypatch.setattr(parallel, "INNER_DELAY", 1e9)
    for module in (parallel, helpers_run):
        monkeypatch.setattr(module, "bars_shown", lambda: True)  # a terminal
    tiny_run(tmp_path, tmp_path / "quick", "--steps", "1", *evals)
    err = capsys.readouterr().err
    assert not any(bar in err for bar in ("tokens:", "DiT steps:", "evaluation:")), err
    monkeypatch.setattr(parallel, "INNER_DELAY", 0)  # every phase counts as slow
    tiny_run(tmp_path, tmp_path / "slow", "--steps", "1", *evals)
    err = capsys.readouterr().err
    assert all(bar in err for bar in ("tokens:", "DiT steps:", "evaluation:")), err


def test_main_interrupt_twice(tmp_path, monkeypatch, capsys):
    """A second Ctrl-C while a step lands stops at once: no checkpoint is written (the step's update is applied in
    memory, its line not written), the last one is kept, exit 130, and the printed command resumes from it to the
    uninterrupted run. (One Ctrl-C in every phase of a step: tests/test_stops.py.)"""
    import signal
    tiny_run(tmp_path, tmp_path / "whole", "--steps", "3", "--kl-beta", "0.04")
    original, out = trainer.train_step, tmp_path / "twice"

    def twice(*args, **kwargs):
        result = original(*args, **kwargs)
        if len(run_record(out)) == 1:  # in step 2, after its update
            signal.raise_signal(signal.SIGINT)
            signal.raise_signal(signal.SIGINT)
        return result

    monkeypatch.setattr(trainer, "train_step", twice)
    with pytest.raises(SystemExit) as exit_info:
        tiny_run(tmp_path, out, "--steps", "3", "--kl-beta", "0.04", "--save-every", "1")
    monkeypatch.undo()
    assert exit_info.value.code == 130 and len(run_record(out)) == 1 and latest_state(out)["step"] == 1
    assert f"interrupted: checkpoint at step 1 in {out}: continue it with: python grpo.py --resume {out}" in \
        capsys.readouterr().err
    grpo.main(["--resume", str(out)])
    assert run_record(out) == run_record(tmp_path / "whole")
    capsys.readouterr()
    monkeypatch.setattr(trainer, "train_step", twice)  # issue 84's case: in step 2 with --save-every 0, no checkpoint yet
    with pytest.raises(SystemExit) as exit_info:
        tiny_run(tmp_path, out, "--steps", "3", "--kl-beta", "0.04", "--save-every", "0", "--overwrite")
    monkeypatch.undo()
    err = capsys.readouterr().err
    assert exit_info.value.code == 130 and "--resume" not in err
    assert "interrupted: nothing saved yet (no checkpoint of the 1 step logged in" in err and "--overwrite" in err
    with pytest.raises(SystemExit):  # a logged step is the run's: a new start without --overwrite is refused
        tiny_run(tmp_path, out, "--steps", "3", "--kl-beta", "0.04")
    assert "holds another run" in capsys.readouterr().err


def test_failed_start_starts_again(tmp_path, monkeypatch, capsys):
    """Two Ctrl-C in step 1's landing, nothing landed or saved yet: the line says so and to start again, and the same
    command starts the run again in that --out (no --overwrite needed: it holds only a failed start), to the
    uninterrupted run's numbers."""
    import signal
    tiny_run(tmp_path, tmp_path / "whole", "--steps", "2")
    original, out = trainer.train_step, tmp_path / "failed"

    def twice(*args, **kwargs):
        result = original(*args, **kwargs)
        signal.raise_signal(signal.SIGINT)
        signal.raise_signal(signal.SIGINT)
        return result

    monkeypatch.setattr(trainer, "train_step", twice)
    with pytest.raises(SystemExit) as exit_info:
        tiny_run(tmp_path, out, "--steps", "2", "--save-every", "0")
    monkeypatch.undo()
    err = capsys.readouterr().err
    assert exit_info.value.code == 130 and "interrupted: nothing saved yet: start the run again (into the same --out)" \
        in err and (out / "config.json").exists() and not run_record(out)
    tiny_run(tmp_path, out, "--steps", "2", "--save-every", "0")
    assert run_record(out) == run_record(tmp_path / "whole")


@pytest.mark.parametrize("phase", ["sample_groups", "decode_images", "train_step"])
def test_main_out_of_memory(tmp_path, monkeypatch, capsys, phase):
    """A CUDA out-of-memory error (simulated) in a phase of step 2: exit 2, one line naming the phase and the levers
    this run does not use yet, no traceback; the checkpoint of step 2 stays loadable and the run resumes to its end."""
    owner = grpo if phase == "decode_images" else trainer  # where main reaches it
    original, calls = getattr(owner, phase), []

    def runs_out(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:  # step 2 (one group a step)
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, phase, runs_out)
    with pytest.raises(SystemExit) as exit_info:  # tiny_run: full fine-tuning, micro-batches of 2
        tiny_run(tmp_path, tmp_path / "run", "--steps", "4", "--save-every", "1", "--offload")
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("grpo.py: error:")]
    assert exit_info.value.code == 2 and len(lines) == 1 and "Traceback" not in err, err
    where = {"sample_groups": "sampling", "decode_images": "decoding", "train_step": "the update"}[phase]
    assert f"out of memory while {where}" in lines[0] and "--offload" not in lines[0]  # it uses --offload already
    if phase == "train_step":
        assert all(lever in lines[0] for lever in ("--gradient-checkpointing", "--lora-rank 16", "--micro-batch-size 1"))
    else:
        assert "--lora-rank" not in lines[0] and "--gradient-checkpointing" not in lines[0]  # no help there
    assert latest_state(tmp_path / "run")["step"] == 2 and len(run_record(tmp_path / "run")) == 2
    monkeypatch.setattr(owner, phase, original)
    grpo.main(["--resume", str(tmp_path / "run")])
    assert len(run_record(tmp_path / "run")) == 4


@pytest.mark.parametrize("where", ["load_glm_image", "reference_model", "trained_model", "load_trainable_state"])
def test_main_out_of_memory_setup(tmp_path, monkeypatch, capsys, where):
    """Out of memory (simulated) before any phase: loading the model, building the KL reference (full fine-tuning's
    copy), injecting LoRA, loading a checkpoint to resume: one line naming the step and only levers this run does not
    use, exit 2, no traceback; a run's checkpoint is left as it was."""
    resume = where == "load_trainable_state"
    if resume:
        tiny_run(tmp_path, tmp_path / "run", "--steps", "2", "--kl-beta", "0.04", "--lora-rank", "4")
    before = snapshot(tmp_path / "run") if resume else None

    def runs_out(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 40.00 GiB")

    owner = {"load_trainable_state": run}.get(where, grpo)  # where main reaches it
    monkeypatch.setattr(owner, where, runs_out)
    flags = {"reference_model": ["--kl-beta", "0.04"], "trained_model": ["--lora-rank", "4"]}.get(where, [])
    with pytest.raises(SystemExit) as exit_info:
        if resume:
            grpo.main(["--resume", str(tmp_path / "run"), "--steps", "3"])
        else:
            tiny_run(tmp_path, tmp_path / "new", "--steps", "2", *flags)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("grpo.py: error:")]
    assert exit_info.value.code == 2 and len(lines) == 1 and "Traceback" not in err, err
    step = "loading the model" if where == "load_glm_image" else "setting up training"
    assert f"out of memory while {step}" in lines[0] and "a GPU with more memory" in lines[0]
    if where == "reference_model":  # full fine-tuning with a KL term: LoRA or no reference would help
        assert "--lora-rank 16" in lines[0] and "--kl-beta 0" in lines[0]
    if where == "trained_model":  # it has LoRA already
        assert "--lora-rank" not in lines[0]
    if resume:
        assert snapshot(tmp_path / "run") == before


def test_parameter_counts():
    """The parameters of --model told without loading it: a folder's from its safetensors headers (the tiny model's
    equal its loaded modules'), 'random:L' from the meta device (no memory), 'tiny' and an id not downloaded: None."""
    folder = fresh_pipe()
    counts = run.parameter_counts(str(grpo.TINY))
    ar = folder.vision_language_encoder
    parts = (ar, folder.transformer, folder.vae, folder.text_encoder)
    assert counts["total"] == sum(p.numel() for part in parts for p in part.parameters())
    assert counts["ar"] == sum(p.numel() for p in ar.parameters())
    assert counts["ar_trained"] == sum(p.numel() for p in ar.model.language_model.parameters()) + ar.lm_head.weight.numel()
    assert counts["dit"] == sum(p.numel() for p in folder.transformer.parameters())
    random1 = run.parameter_counts("random:1")  # the published widths: a 168064 x 4096 embedding alone is 0.69B
    assert 1.5e9 < random1["total"] < 2.5e9 and random1["ar_trained"] > 0.7e9
    assert run.parameter_counts("tiny") is None and run.parameter_counts("nobody/not-downloaded") is None


def test_main_host_memory(tmp_path, monkeypatch, capsys):
    """A model the host cannot hold stops in one line before it is built or loaded (what it needs, what is free, the
    levers), exit 2, nothing written; the published model in float32 on this CPU needs about 71 GB."""
    prompts = write_example(tmp_path, ["a gray square | t.png"])
    monkeypatch.setattr(run, "available_host_memory", lambda: 2 * 10 ** 9)
    monkeypatch.setattr(grpo, "load_glm_image", lambda *a, **k: pytest.fail("built the model anyway"))
    args = ["--prompts", str(prompts), "--out", str(tmp_path / "run"), "--device", "cpu", "--steps", "1"]
    err = expect_exit([*args, "--model", "random:1"], 2, "of host memory", capsys)
    assert "and this machine has 2.0 GB free" in err and "--model random:2" in err and "--dtype bfloat16" in err
    assert not (tmp_path / "run").exists()
    need = float(re.search(r"needs about ([\d.]+) GB", expect_exit([*args, "--model", "random"], 2, "", capsys))[1])
    assert 65 < need < 75  # 17.7B parameters x 4 bytes
    full = expect_exit([*args, "--model", "random:1", "--lora-rank", "0", "--kl-beta", "0.1"], 2, "AdamW", capsys)
    assert "--lora-rank 16" in full
    monkeypatch.setattr(run, "available_host_memory", lambda: 10 ** 12)
    assert run.host_memory_problem(trainer.parse_config(grpo, ["--model", "random:1"]), "cpu", torch.float32) is None


def test_resume_damaged_run(tmp_path, capsys):
    """--resume with a truncated or foreign trainer_state.pt or config.json, a damaged metrics line, or metrics whose
    steps count from 0 (an older grpo.py's): exit 2, one line naming the file, nothing changed. --steps equal to the steps done: nothing to do (exit 0); below: refused; a
    flag that would change the run (--lr, --prompts, ...): refused."""
    prompts = write_example(tmp_path, ["a | t.png"])
    run = tmp_path / "run"
    tiny_run(tmp_path, run, "--steps", "2", "--image-every", "1")
    good = snapshot(run)
    resume = ["--resume", str(run), "--steps", "4"]
    state = "checkpoints/step-2/trainer_state.pt"
    damages = [(state, good[run / state][:3000], "trainer_state.pt is truncated or not"),
               (state, b"not a checkpoint", "trainer_state.pt is truncated or not"),
               ("config.json", good[run / "config.json"][:40], "config.json is truncated or not"),
               ("config.json", b'{"learning_rate": 3}', "config.json is not a grpo.py config"),
               ("metrics.jsonl", b"garbage\n" + good[run / "metrics.jsonl"], "metrics.jsonl:1 is not a JSON line")]
    torch.save({"weights": {}}, tmp_path / "foreign.pt")
    damages.append((state, (tmp_path / "foreign.pt").read_bytes(), "trainer_state.pt is truncated or not"))
    older = "".join(json.dumps({**line, "step": line["step"] - 1}) + "\n" for line in run_record(run))
    damages.append(("metrics.jsonl", older.encode(), "counts its steps from 0"))  # written when steps began at 0
    for name, content, needle in damages:
        (run / name).write_bytes(content)
        damaged = snapshot(run)
        expect_exit(resume, 2, needle, capsys)
        assert snapshot(run) == damaged, name
        (run / name).write_bytes(good[run / name])
    with pytest.raises(SystemExit) as exit_info:
        grpo.main(["--resume", str(run), "--steps", "2"])
    assert exit_info.value.code == 0 and "nothing to do" in capsys.readouterr().out
    expect_exit(["--resume", str(run), "--steps", "1"], 2, "below the 2 steps", capsys)
    # a resumed run goes on as it was saved: other flags are refused, not silently dropped
    expect_exit([*resume, "--prompts", str(prompts), "--lr", "0.5"], 2, "cannot take --lr, --prompts", capsys)
    assert snapshot(run) == good
    # a last metrics line cut off by a kill is dropped, and the run continues
    (run / "metrics.jsonl").write_bytes(good[run / "metrics.jsonl"] + b'{"step": 2, "rew')
    grpo.main(["--resume", str(run), "--steps", "3"])
    assert [r["step"] for r in run_record(run)] == [1, 2, 3]


def test_out_not_usable(tmp_path, capsys, monkeypatch):
    """--out that is a file, lies under a file, or cannot be written: exit 2, one line, the file untouched."""
    prompts = write_example(tmp_path, ["a | t.png"])
    (tmp_path / "afile").write_text("mine")
    base = [*TINY, "--prompts", str(prompts), "--steps", "1"]
    expect_exit([*base, "--out", str(tmp_path / "afile")], 2, "is a file", capsys)
    expect_exit([*base, "--out", str(tmp_path / "afile" / "run")], 2, "which is a file", capsys)
    assert (tmp_path / "afile").read_text() == "mine"

    def no_permission(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(run_io.tempfile, "mkstemp", no_permission)  # root may write anywhere: simulate a read-only dir
    expect_exit([*base, "--out", str(tmp_path / "ro")], 2, "not writable (Permission denied)", capsys)
    assert not (tmp_path / "ro").exists()


def test_main_disk_full(tmp_path, capsys, monkeypatch):
    """A full disk: while saving a checkpoint or final/ the run stops with one line (exit 1) and the previous file
    stays good, with no temporary file left; while saving an image grid it warns and goes on."""
    import errno
    prompts = write_example(tmp_path, ["a | t.png"])
    run = tmp_path / "run"
    base = [*TINY, "--prompts", str(prompts), "--micro-batch-size", "2", "--image-every", "1"]
    grpo.main([*base, "--out", str(run), "--steps", "2", "--save-every", "1"])
    good = snapshot(run)
    full = OSError(errno.ENOSPC, "No space left on device")

    def no_space(*args, **kwargs):
        raise full

    # a checkpoint (every step) on a full disk
    monkeypatch.setattr(torch, "save", lambda obj, f, *a, **k: (f.write(b"partial"), no_space()))
    expect_exit(["--resume", str(run), "--steps", "3"], 1, "No space left on device", capsys)
    monkeypatch.undo()
    assert latest_state(run)["step"] == 2 and not (run / "checkpoints" / "step-3.tmp").exists()
    assert not (run / "checkpoints" / "step-3").exists()
    assert snapshot(run / "final") == {p: b for p, b in good.items() if "final" in p.parts}
    # final/ on a full disk (its checkpoint written): the previous final/ survives
    real_save = helpers_run.save_trained

    def final_fails(model, folder, *args):
        (no_space if folder.name == "final.tmp" else real_save)(model, folder, *args)

    monkeypatch.setattr(helpers_run, "save_trained", final_fails)
    expect_exit(["--resume", str(run), "--steps", "3"], 1, "No space left on device", capsys)
    monkeypatch.undo()
    assert latest_state(run)["step"] == 3
    assert snapshot(run / "final") == {p: b for p, b in good.items() if "final" in p.parts}
    assert not (run / "final.tmp").exists()
    # the command the line gives: no step to do, only the end again (final/ of step 3)
    grpo.main(["--resume", str(run), "--steps", "3"])
    assert len(run_record(run)) == 3 and helpers_run.finished(run) == 3
    assert snapshot(run / "final") != {p: b for p, b in good.items() if "final" in p.parts}
    # an image grid on a full disk: a warning, and the run goes on to its end
    monkeypatch.setattr(run_io.Image.Image, "save", lambda self, f, *a, **k: (f.write(b"partial"), no_space()))
    grpo.main(["--resume", str(run), "--steps", "4"])
    monkeypatch.undo()
    assert "could not write" in capsys.readouterr().err and len(run_record(run)) == 4
    assert not any(p.name.endswith(".tmp") for p in run.rglob("*"))


KILLED_SAVE = """
import os, sys, time, torch
sys.path.insert(0, {here!r})
import grpo
from helpers import parallel, run_io, trainer
from pathlib import Path
policy = grpo.load_glm_image("tiny").vision_language_encoder
opt = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad])
cfg, path = trainer.parse_config(grpo, ["--model", "tiny"]), Path({path!r})
run_io.save_checkpoint(path / "step-1", policy, None, *parallel.trainable_state(policy, opt), 1, cfg)
real_save = torch.save

def slow_save(obj, f, *args, **kwargs):
    f.write(b"x" * 100000)
    f.flush()
    print("writing", flush=True)
    time.sleep(60)  # killed here, half-way through the file

torch.save = slow_save
run_io.save_checkpoint(path / "step-2", policy, None, *parallel.trainable_state(policy, opt), 2, cfg)
"""


def test_checkpoint_survives_kill(tmp_path):
    """kill -9 while a checkpoint is being written (a real process, killed half-way): the previous one is the latest
    and loads."""
    path = tmp_path / "checkpoints"
    proc = subprocess.Popen([sys.executable, "-c", KILLED_SAVE.format(here=str(ROOT), path=str(path))],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "writing"
    proc.kill()  # SIGKILL: no handler, no cleanup
    proc.wait(timeout=30)
    assert (path / "step-2.tmp" / "trainer_state.pt.tmp").stat().st_size >= 100000  # the half-written new one
    assert run_io.resume_point(tmp_path) == (tmp_path, path / "step-1" / "trainer_state.pt")
    state = latest_state(tmp_path)
    policy, opt = fresh_policy_and_optimizer()
    parallel.load_trainable_state(policy, opt, state)
    assert state["step"] == 1


def checkpoint_of(policy, opt, path, step, cfg):
    run_io.save_checkpoint(path, policy, None, *parallel.trainable_state(policy, opt), step, cfg)


def fresh_policy_and_optimizer():
    policy = fresh_pipe().vision_language_encoder
    return policy, torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad])


def test_save_checkpoint(tmp_path, monkeypatch):
    """Saves are atomic: a crash or a full disk in the middle of writing a new checkpoint, or of writing one again,
    leaves the previous checkpoint intact, the latest and loadable, and no temporary folder behind."""
    policy, opt = fresh_policy_and_optimizer()
    cfg = trainer.parse_config(grpo, ["--model", "tiny"])
    folder = tmp_path / "checkpoints"
    checkpoint_of(policy, opt, folder / "step-7", 7, cfg)
    saved = policy.lm_head.weight.detach().clone()
    real_save = torch.save
    for failure in (KeyboardInterrupt(), OSError(28, "No space left on device")):

        def dies_half_way(obj, f, *a, **k):
            f.write(b"partial garbage")
            raise failure  # killed or out of space while writing

        monkeypatch.setattr(torch, "save", dies_half_way)
        with torch.no_grad():
            policy.lm_head.weight.add_(1.0)
        for name, step in (("step-8", 8), ("step-7", 7)):
            with pytest.raises(type(failure)):
                checkpoint_of(policy, opt, folder / name, step, cfg)
        monkeypatch.setattr(torch, "save", real_save)
        assert sorted(p.name for p in folder.iterdir()) == ["step-7"]
        fresh, opt2 = fresh_policy_and_optimizer()
        state = latest_state(tmp_path)
        parallel.load_trainable_state(fresh, opt2, state)
        assert state["step"] == 7 and torch.equal(fresh.lm_head.weight, saved)


def test_target_resized_with_notice(tmp_path, capsys):
    """A target of another size is resized with a one-line notice, never a crash."""
    prompts = write_example(tmp_path, ["a | t.png"], size=40)
    grpo.main([*TINY, "--prompts", str(prompts), "--out", str(tmp_path / "o"), "--steps", "1"])
    assert "resized to 64x64" in capsys.readouterr().err


def test_torchrun_bad_input(tmp_path):
    """A bad prompts file under torchrun: every process exits non-zero at once, our one line printed once."""
    (tmp_path / "bad.txt").write_text("fine | nope.png\n")
    proc = torchrun(*TINY_CPU, "--prompts", str(tmp_path / "bad.txt"), "--out", str(tmp_path / "out"),
                    timeout=120)
    assert proc.returncode != 0 and proc.stderr.count("grpo.py: error:") == 1, proc.stderr[-3000:]
    assert "nope.png does not exist" in proc.stderr and not (tmp_path / "out").exists()


RANK_DIES = """
import os, sys
sys.path.insert(0, {here!r})
import grpo
from helpers import trainer
real = trainer.train_step

def dies(*args, **kwargs):
    if os.environ["RANK"] == "1" and len(open({metrics!r}).read().splitlines()) == 2:
        os._exit(1)  # killed in the middle of step 2
    return real(*args, **kwargs)

trainer.train_step = dies
grpo.main(sys.argv[1:])
"""


def test_torchrun_stopped_resumes_exactly(tmp_path):
    """Under 2 processes, with a warmup and cosine schedule, mu 2 and the reference reset: SIGTERM to torchrun (a
    cluster's preemption; Ctrl-C reaches the processes so too) makes every process land the same step, rank 0 save it
    and print the command to continue (exit non-zero), and resumed with it the run equals the uninterrupted one (one
    process training the same groups: within the torchrun tests' float32 tolerance); a process that dies mid-step
    takes the others down (no hang), rank 0's checkpoint of the last landed step stays loadable, and resumed in one
    process (2 prompts a step: the same groups) the run goes on as the uninterrupted one."""
    import os
    import signal
    import time
    prompts = write_example(tmp_path, ["a gray square | t.png", "another | t.png"])
    common = [*TINY_CPU, "--prompts", str(prompts), "--image-every", "0", "--kl-beta", "0.04", "--micro-batch-size",
              "2", "--steps", "3", "--mu", "2", "--lr-scheduler", "cosine", "--warmup-steps", "1",
              "--reference-reset-every", "2", "--lora-rank", "4", "--save-every", "1"]
    one_process(*common, "--out", str(tmp_path / "whole"), "--prompts-per-step", "2")  # the same groups a step
    out = tmp_path / "stopped"
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                             str(ROOT / "grpo.py"), *common, "--out", str(out)], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    while not (out / "metrics.jsonl").exists() or len(run_record(out)) < 1:
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode != 0 and err.count("interrupted: checkpoint at step") == 1, err[-3000:]
    assert f"continue it with: torchrun --nproc-per-node 2 grpo.py --resume {out}" in err
    done = latest_state(out)["step"]
    assert 1 <= done == len(run_record(out)) < 3
    assert torchrun("--resume", str(out)).returncode == 0
    assert_same_metrics(tmp_path / "whole", out)
    assert_same_weights(tmp_path / "whole" / "final", out / "final")
    died, script = tmp_path / "died", tmp_path / "dies.py"
    script.write_text(RANK_DIES.format(here=str(ROOT), metrics=str(died / "metrics.jsonl")))
    proc = torchrun(*common, "--out", str(died), script=script, timeout=300)
    assert proc.returncode != 0
    assert latest_state(died)["step"] == 2 and len(run_record(died)) == 2
    grpo.main(["--resume", str(died)])  # one process: both groups a step
    assert json.loads((died / "config.json").read_text())["prompts_per_step"] == 2
    assert_same_metrics(tmp_path / "whole", died)
    assert_same_weights(tmp_path / "whole" / "final", died / "final")


def test_decoder_on():
    """--offload: the T5, DiT and VAE come to the device inside the block and go back to the CPU after it, also when
    the block fails; without --offload they are not moved."""
    class Part:
        def __init__(self):
            self.moves = []

        def to(self, device):
            self.moves.append(device)
            return self

    bars = []  # the pipeline's own bar of DiT steps: set up for a slow decode (test_inner_bars shows it)
    pipe = types.SimpleNamespace(text_encoder=Part(), transformer=Part(), vae=Part(),
                                 set_progress_bar_config=lambda **config: bars.append(config))
    parts = (pipe.text_encoder, pipe.transformer, pipe.vae)
    with run.decoder_on(pipe, "cuda:0", offload=True):
        assert [p.moves for p in parts] == [["cuda:0"]] * 3
    assert [p.moves for p in parts] == [["cuda:0", "cpu"]] * 3
    with pytest.raises(RuntimeError), run.decoder_on(pipe, "cuda:0", offload=True):
        raise RuntimeError("a decode that fails")
    assert [p.moves for p in parts] == [["cuda:0", "cpu"] * 2] * 3
    with run.decoder_on(pipe, "cuda:0", offload=False):
        pass
    assert [p.moves for p in parts] == [["cuda:0", "cpu"] * 2] * 3
    assert bars[-1]["desc"] == "DiT steps" and bars[-1]["leave"] is False


def test_code_health():
    """The rollout's codes: distinct codes per image (mean, min) and the fewest a group used in all its images, by
    hand; a group whose images together hold at most max(1, hw / 64) codes counts as collapsed (a 1024-cell grid of 16
    codes: yes, of 17: no; a 9-cell grid of one code: yes)."""
    grids = [torch.tensor([[1, 1, 2], [3, 4, 5]]), torch.tensor([[7, 7, 7], [7, 7, 7]])]
    m = run.code_health(grids)
    assert m == {"rollout/unique_codes": 1.75, "rollout/unique_codes_min": 1, "rollout/group_codes_min": 1,
                 "rollout/collapsed_groups": 1}
    g = torch.Generator().manual_seed(0)
    sixteen, seventeen = (torch.randint(0, k, (4, 1024), generator=g) for k in (16, 17))
    assert run.code_health([sixteen])["rollout/collapsed_groups"] == 1
    assert run.code_health([seventeen])["rollout/collapsed_groups"] == 0
    assert run.code_health([torch.tensor([[2, 2, 2, 2, 2, 2, 2, 2, 3]])])["rollout/collapsed_groups"] == 0


def test_collapse_warning(tmp_path, monkeypatch, capsys):
    """A sampler that draws one code everywhere (as a bypassed processor did, giving white pictures): every step's
    line logs the distinct codes, and one warning line per step names the collapse."""
    decode = fast_decode.decode

    def one_code(*args, **kw):
        tokens, *rest = decode(*args, **kw)
        return (torch.zeros_like(tokens), *rest)
    monkeypatch.setattr(fast_decode, "decode", one_code)
    tiny_run(tmp_path, tmp_path / "out", "--steps", "2")
    lines = run_record(tmp_path / "out")
    assert [x["rollout/unique_codes"] for x in lines] == [1.0, 1.0] and lines[0]["rollout/collapsed_groups"] == 1
    warnings = [x for x in capsys.readouterr().err.splitlines() if "collapsed to a few codes" in x]
    assert len(warnings) == 2 and "the fewest: 1 distinct codes" in warnings[0]


def test_quiet_libraries_keeps_download_bars():
    """quiet_libraries silences transformers' and diffusers' own bars and logs, not the hub's download bars (issue 58:
    the first download of the real model is about 40 GB)."""
    import diffusers
    import transformers
    from huggingface_hub.utils import are_progress_bars_disabled
    run.quiet_libraries()
    assert not are_progress_bars_disabled()
    assert not transformers.utils.logging.is_progress_bar_enabled()
    assert not diffusers.utils.logging.is_progress_bar_enabled()


def test_main_lab_run(tmp_path):
    """A run as a lab starts one: flags from a YAML file (YAML's 5e-4 read as a number), the command line overriding
    it, a cosine schedule after a warmup, a checkpoint every step, stderr to a file. config.json holds the file's
    settings; stderr starts with a start-up summary, then a plain line a step and no carriage return; the rate is
    logged each step and moves (0 in the warmup's first step, as transformers' schedules start); the final card is a
    hub card; no checkpoint carries peft's template card."""
    prompts = write_example(tmp_path, ["a gray square | t.png", "another | t.png"])
    config = tmp_path / "lab.yaml"
    config.write_text(f"prompts: {prompts}\ngroup_size: 4\nheight: 64\nwidth: 64\nsteps: 5\nlr: 5e-4\n"
                      "lr_scheduler: cosine\nwarmup_steps: 1\nsave_every: 1\nlora_rank: 4\nimage_every: 0\n")
    out = tmp_path / "lab"
    with open(tmp_path / "stderr.log", "w") as log:
        done = subprocess.run([sys.executable, str(ROOT / "grpo.py"), "--config", str(config), "--steps", "3", "--out",
                               str(out), "--device", "cpu"], stdout=subprocess.PIPE, stderr=log, text=True, cwd=ROOT,
                              timeout=300)
    err = (tmp_path / "stderr.log").read_text()
    assert done.returncode == 0, err[-3000:]
    saved = json.loads((out / "config.json").read_text())
    assert (saved["lr"], saved["lr_scheduler"], saved["group_size"], saved["steps"]) == (5e-4, "cosine", 4, 3)
    assert err.startswith("grpo.py: --model tiny on cpu, float32, 1 process\n  trains the AR, LoRA r=4: ")
    assert "\r" not in err and [line.split(":")[0] for line in err.splitlines() if line.startswith("step ")] == [
        "step 1/3", "step 2/3", "step 3/3"]
    lines = run_record(out)
    assert [x["step"] for x in lines] == [1, 2, 3] and lines[0]["lr"] == 0.0 and lines[1]["lr"] == 5e-4
    assert 0 < lines[2]["lr"] < 5e-4
    card = (out / "final" / "README.md").read_text()
    assert "pipeline_tag: text-to-image" in card and "library_name: peft" in card and str(ROOT) not in card
    assert 'from_pretrained("tiny_glm_image"' in card
    cards = [folder / "README.md" for folder in (out / "checkpoints").iterdir()]
    assert len(cards) == 3 and not any("Model Card for" in c.read_text() for c in cards)
    again = trainer.parse_config(grpo, ["--config", str(out / "config.json"), "--out", str(tmp_path / "again")])
    assert {k: v for k, v in dataclasses.asdict(again).items() if k != "out"} == \
        {k: v for k, v in saved.items() if k != "out"}  # a run's config.json is a config
    help_text = run_cli("--help").stdout
    for flag in ("--config", "--revision", "--lr-scheduler", "--warmup-steps", "--push-to-hub", "--hub-model-id"):
        assert flag in help_text, flag


def test_lr_schedule(tmp_path, capsys):
    """--lr-scheduler / --warmup-steps: transformers' schedules, one rate a step; a resume from any checkpoint logs the
    same rates as the uninterrupted run (the schedule's state is in the checkpoint)."""
    common = ["--steps", "4", "--lr-scheduler", "linear", "--warmup-steps", "2", "--save-every", "1", "--lr", "1e-3"]
    tiny_run(tmp_path, tmp_path / "whole", *common)
    rates = [x["lr"] for x in run_record(tmp_path / "whole")]
    assert rates == pytest.approx([0.0, 5e-4, 1e-3, 5e-4])
    grpo.main(["--resume", str(tmp_path / "whole" / "checkpoints" / "step-2"), "--overwrite"])
    assert [x["lr"] for x in run_record(tmp_path / "whole")] == rates
    state = latest_state(tmp_path / "whole")
    assert state["scheduler"]["last_epoch"] == 4
    expect_exit(["--resume", str(tmp_path / "whole"), "--steps", "6"], 2, "--lr-scheduler linear runs over its 4 steps",
                capsys)  # a longer schedule would make the rate jump
    prompts = write_example(tmp_path, ["a gray square | t.png"])
    expect_exit([*TINY, "--prompts", str(prompts), "--out", str(tmp_path / "long"), "--steps", "3", "--warmup-steps",
                 "3"], 2, "--warmup-steps 3 must be below --steps 3", capsys)


def test_lr_schedule_steps_once_an_update(tmp_path, monkeypatch):
    """The schedule moves after every optimizer update, as transformers' Trainer and TRL step it (not once a sampling
    step, which gave every --mu update of a step one rate): at mu 2 the updates run at the rates transformers'
    get_scheduler gives over --steps x --mu updates, --warmup-steps x --mu of them warming up; the step's line logs
    its first update's rate."""
    from transformers import get_scheduler
    used = []
    original = trainer.optimizer_step
    monkeypatch.setattr(trainer, "optimizer_step", lambda opt, *a: used.append(opt.param_groups[0]["lr"])
                        or original(opt, *a))
    tiny_run(tmp_path, tmp_path / "run", "--steps", "3", "--mu", "2", "--lr-scheduler", "linear", "--warmup-steps",
             "1", "--lr", "1e-3", "--save-every", "0")
    reference = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1e-3)
    schedule = get_scheduler("linear", reference, num_warmup_steps=2, num_training_steps=6)
    want = []
    for _ in range(6):
        want.append(reference.param_groups[0]["lr"])
        reference.step()
        schedule.step()
    assert used == pytest.approx(want) and want == pytest.approx([0, 5e-4, 1e-3, 7.5e-4, 5e-4, 2.5e-4])
    assert [x["lr"] for x in run_record(tmp_path / "run")] == pytest.approx(want[::2])


def test_push_to_hub(tmp_path, monkeypatch, capsys):
    """--push-to-hub uploads final/ (the card and the adapter) to --hub-model-id through huggingface_hub, the upload
    replaced here by a recorder (not run against the real hub): a new repository private unless --no-hub-private, and
    the card names no path of this machine; the card's usage loads from the hub id. Without a
    token, or with --push-to-hub and no id, it stops before training in one line; a failed upload is one line, exit 1,
    and the run stays saved."""
    import huggingface_hub
    calls = []
    monkeypatch.setattr(huggingface_hub.HfApi, "create_repo", lambda self, repo, **kw: calls.append(
        ("create", repo, kw["private"])))
    monkeypatch.setattr(huggingface_hub.HfApi, "upload_folder", lambda self, **kw: calls.append(
        ("upload", kw["repo_id"], sorted(p.name for p in Path(kw["folder_path"]).iterdir()), kw["delete_patterns"])))
    monkeypatch.setattr(huggingface_hub, "get_token", lambda: "hf_test")
    out = tmp_path / "pushed"
    tiny_run(tmp_path, out, "--steps", "1", "--lora-rank", "4", "--push-to-hub", "--hub-model-id", "me/tiny-grpo")
    assert calls[0] == ("create", "me/tiny-grpo", True) and calls[1][:2] == ("upload", "me/tiny-grpo")
    assert calls[1][3] == "*"  # files an earlier push left go: the repository holds this final/
    assert {"README.md", "adapter_config.json", "adapter_model.safetensors"} <= set(calls[1][2])
    card = (out / "final" / "README.md").read_text()
    assert 'load_adapter("me/tiny-grpo")' in card and str(tmp_path) not in card
    prompts = write_example(tmp_path, ["a gray square | t.png"])
    common = [*TINY, "--prompts", str(prompts), "--steps", "1", "--image-every", "0"]
    expect_exit([*common, "--out", str(tmp_path / "no_id"), "--push-to-hub"], 2, "is not a hub repository id", capsys)
    monkeypatch.setattr(huggingface_hub, "get_token", lambda: None)
    expect_exit([*common, "--out", str(tmp_path / "no_token"), "--push-to-hub", "--hub-model-id", "me/x"], 2,
                "needs a hub token", capsys)
    assert not (tmp_path / "no_token").exists()
    monkeypatch.setattr(huggingface_hub, "get_token", lambda: "hf_test")

    def refused(self, **kw):
        raise PermissionError("403 Forbidden: no write access\nmore")
    monkeypatch.setattr(huggingface_hub.HfApi, "upload_folder", refused)
    expect_exit([*common, "--out", str(tmp_path / "refused"), "--push-to-hub", "--hub-model-id", "me/x"], 1,
                "could not push", capsys)
    assert (tmp_path / "refused" / "final" / "run.json").exists()


# ---- The run and its surroundings: the files it reads, a directory that is its alone ---------------------------------

def test_resume_reads_its_own_inputs(tmp_path, monkeypatch, capsys):
    """A run started in one directory and resumed from another that holds its own prompts.txt and reward file trains
    on its own (issue 85: step 3 trained on the other directory's prompts), to the uninterrupted run's numbers:
    config.json keeps the prompts absolute, inputs.json the start directory, where a reward file named relative to it
    is found. An input changed since the start, or gone, is refused in one line naming it."""
    start, other = tmp_path / "start", tmp_path / "other"
    for folder, scale in ((start, 1), (other, -1)):
        folder.mkdir()
        write_example(folder, ["a gray square | t.png", "another | t.png"] if scale == 1 else ["other | t.png"])
        (folder / "bright.py").write_text(f"def reward(images, example):\n    return {scale} * images.mean(dim=(1, 2, "
                                          "3))\n")
    common = [*TINY, "--prompts", "prompts.txt", "--reward", "ssim=1,bright.py:reward=0", "--image-every", "0",
              "--micro-batch-size", "2", "--save-every", "1"]
    monkeypatch.chdir(start)
    grpo.main([*common, "--steps", "3", "--out", str(tmp_path / "whole")])
    grpo.main([*common, "--steps", "2", "--out", str(tmp_path / "resumed")])
    monkeypatch.chdir(other)
    grpo.main(["--resume", str(tmp_path / "resumed"), "--steps", "3"])
    assert run_record(tmp_path / "resumed") == run_record(tmp_path / "whole")
    saved = json.loads((tmp_path / "resumed" / "config.json").read_text())
    assert saved["prompts"] == str(start / "prompts.txt") and saved["reward"] == "ssim=1,bright.py:reward=0"
    assert json.loads((tmp_path / "resumed" / "inputs.json").read_text())["cwd"] == str(start)
    (start / "prompts.txt").write_text("a gray square | t.png\n")
    with pytest.raises(SystemExit):
        grpo.main(["--resume", str(tmp_path / "resumed"), "--steps", "4"])
    assert f"{start / 'prompts.txt'} changed since the run started" in capsys.readouterr().err
    (start / "prompts.txt").write_text("a gray square | t.png\nanother | t.png\n")
    (start / "t.png").unlink()
    with pytest.raises(SystemExit):
        grpo.main(["--resume", str(tmp_path / "resumed"), "--steps", "4"])
    assert f"{start / 't.png'} no longer exists" in capsys.readouterr().err


def test_one_run_a_directory(tmp_path, capsys):
    """While a run lives, every other run that would write into its --out is refused in one line naming the process,
    --overwrite and --resume included, and writes nothing; the hold goes with the process (kill -9 leaves nothing to
    clean). Issue 85's case: two runs started at once into one --out: one trains (3 metrics lines, its seed), the
    other exits 2."""
    out = tmp_path / "run"
    tiny_run(tmp_path, out, "--steps", "1")
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; sys.path.insert(0, sys.argv[1]); "
                               "from pathlib import Path; from helpers import run_io; "
                               "run_io.hold_run_dir(Path(sys.argv[2])); print('held', flush=True); time.sleep(300)",
                               str(ROOT), str(out)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        before = sorted(p.relative_to(out) for p in out.rglob("*"))
        for extra in (["--overwrite"], ["--resume", str(out), "--steps", "2"]):
            argv = ["--resume", str(out), "--steps", "2"] if "--resume" in extra else \
                [*TINY, "--prompts", str(tmp_path / "prompts.txt"), "--out", str(out), *extra]
            expect_exit(argv, 2, f"--out {out} is in use by a live run (process {holder.pid})", capsys)
        assert sorted(p.relative_to(out) for p in out.rglob("*")) == before
    finally:
        holder.kill()
        holder.wait(10)
    grpo.main(["--resume", str(out), "--steps", "2"])  # the killed holder left nothing behind
    assert len(run_record(out)) == 2
    prompts = write_example(tmp_path, ["a gray square | t.png", "another | t.png"])
    both = [subprocess.Popen([sys.executable, str(ROOT / "grpo.py"), *TINY, "--prompts", str(prompts), "--out",
                              str(tmp_path / "together"), "--steps", "3", "--image-every", "0", "--seed", str(seed)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env={**os.environ, "OMP_NUM_THREADS": "1"}) for seed in (1, 2)]
    results = [(p.wait(300), p.stderr.read()) for p in both]
    assert sorted(code for code, _ in results) == [0, 2], results
    refused = next(err for code, err in results if code == 2)
    # (refused for the live run, or, should the first have finished before the second looked, for its files)
    assert ("is in use by a live run" in refused or "holds another run" in refused) and \
        len(error_lines(refused)) == 1, refused
    winner = 1 + [code for code, _ in results].index(0)
    assert len(run_record(tmp_path / "together")) == 3
    assert json.loads((tmp_path / "together" / "config.json").read_text())["seed"] == winner
