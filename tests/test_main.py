"""Whole runs of grpo.py's `main` on the tiny model (test_grpo.py has one): the defaults, evaluation, editing,
resume, faults inside the loop, the sampler's mismatch, rejection sampling, and many processes under torchrun
(gloo on the CPU, 2 processes of 1 thread each). Minutes on 2 cores: `python -m pytest -q tests/test_main.py`."""

import json
import math
import re

import numpy as np
import pytest
import torch
from PIL import Image

import grpo
from helpers import fast_decode, trainer
from tests.conftest import (DEVICE, ROOT, T, TINY, TINY_CPU, as_line, assert_same_metrics, assert_same_weights,
                            eval_lines, fresh_pipe, one_process, run_record, sample_group, smooth_source, tiny_run,
                            torchrun, write_evals, write_example)
from tools import rejection_sampling  # the baseline GRPO has to beat, from grpo.py's own pieces

def test_main_end_to_end(tmp_path):
    """A short tiny run writes metrics, image grids and a checkpoint that loads back with the trained weights."""
    prompts = write_example(tmp_path, ["a gray square | t.png", "another | t.png"])
    out = tmp_path / "run"
    summary = grpo.main([*TINY, "--prompts", str(prompts), "--out", str(out), "--steps", "3",
                         "--image-every", "2", "--kl-beta", "0.04", "--micro-batch-size", "2"])
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2, 3] and [x["prompts"] for x in lines] == [[0], [1], [0]]
    for key in ["reward_mean", "reward_std", "loss", "kl", "clip_frac", "ratio_min", "ratio_max", "sec_sample",
                "sec_decode", "sec_train", "distinct_in_group", "sampler_gap"]:
        assert all(math.isfinite(x[key]) for x in lines), key
    assert lines[0]["ratio_min"] == lines[0]["ratio_max"] == 1.0
    assert sorted(p.name for p in (out / "images").iterdir()) == ["step_00001.png", "step_00003.png"]
    # 3 steps: a quarter is 1 step, shorter than a pass over the 2 prompts, so the first and the last step's rewards
    assert summary == {"reward_first": lines[0]["reward_mean"], "reward_last": lines[-1]["reward_mean"], "skipped": 0}
    from transformers import GlmImageForConditionalGeneration
    loaded = GlmImageForConditionalGeneration.from_pretrained(out / "final")
    fresh = grpo.load_glm_image("tiny", DEVICE).vision_language_encoder
    assert not torch.equal(loaded.lm_head.weight, fresh.lm_head.weight.cpu())  # trained weights, not the initial ones
    assert json.loads((out / "config.json").read_text())["steps"] == 3


def test_main_defaults(tmp_path):
    """The tiny defaults run the whole loss (beta 0.1, mu 2; the diversity bonus is off): the reference is built and the KL
    grows from 0 once the policy moves, the second update's ratios leave 1, and the clip acts (here at lr 1e-3, so
    that it shows within 3 steps; the demo's 100 steps show it at the default lr)."""
    cfg = trainer.parse_config(grpo, ["--model", "tiny"])
    assert (cfg.kl_beta, cfg.mu, cfg.diversity) == (0.1, 2, 0.0)  # the variants' flags: off
    defaults = TINY[:TINY.index("--mu")]  # TINY without the tests' pinned algorithm
    prompts = write_example(tmp_path, ["a red circle", "two blue squares"])
    grpo.main([*defaults, "--prompts", str(prompts), "--out", str(tmp_path / "run"), "--steps", "3", "--reward",
               "shapes", "--lr", "1e-3", "--image-every", "0"])
    lines = run_record(tmp_path / "run")
    assert lines[0]["kl"] > 0 and all(x["kl"] >= 0 for x in lines)
    assert all(x["ratio_max"] > x["ratio_min"] for x in lines) and max(x["clip_frac"] for x in lines) > 0
    assert all(x["sampler_gap"] <= 1e-5 for x in lines)  # the sampler's weights: not the second update's drift


def test_main_offload(tmp_path):
    """--offload changes where the frozen parts wait, not what is computed: the same metrics as without it."""
    common = ["--steps", "2", "--save-every", "0"]
    tiny_run(tmp_path, tmp_path / "plain", *common)
    tiny_run(tmp_path, tmp_path / "offload", *common, "--offload")
    assert run_record(tmp_path / "offload") == run_record(tmp_path / "plain")


@pytest.mark.parametrize("flags", [["--top-p", "0.75"], ["--top-k", "5", "--top-p", "0.9"]], ids=["top-p", "top-k"])
def test_main_truncated_sampling(tmp_path, flags):
    """The CLI with GLM-Image's deployed sampling: the first step's ratio is exactly [1, 1], the sampler and the
    trainer agree within 1e-5, no sampled token falls outside the trainer's truncation, and the run trains (LoRA,
    KL, 2 updates per batch: the later updates see ratios move)."""
    prompts = write_example(tmp_path, ["a red circle on the left | t.png", "two blue squares | t.png"], size=96)
    out = tmp_path / "run"
    grpo.main([*TINY, "--height", "96", "--width", "96", "--prompts", str(prompts), "--out", str(out), "--steps", "2",
               "--lora-rank", "4", "--kl-beta", "0.04", "--lr", "1e-3", "--mu", "2", *flags])
    lines = run_record(out)
    assert lines[0]["sampler_gap"] <= 1e-5 and lines[0]["outside_truncation"] == 0
    # a second update sees the first one's change (where a group has spread: at top-p 0.75 the pre-trained model's
    # first group here is 4 copies of one picture, every large-grid token a one-code nucleus)
    assert max(x["ratio_max"] - x["ratio_min"] for x in lines) > 1e-3
    assert all(math.isfinite(x["loss"]) and x["skipped"] == 0 for x in lines)
    single = tmp_path / "single"
    grpo.main([*TINY, "--height", "96", "--width", "96", "--prompts", str(prompts), "--out", str(single), "--steps", "1",
               "--kl-beta", "0.04", *flags])
    first = run_record(single)[0]
    assert first["ratio_min"] == first["ratio_max"] == 1.0 and first["sampler_gap"] <= 1e-5


def test_main_sampler_correction(tmp_path, monkeypatch):
    """The CLI with a sampler that is 0.5 nats off on every token (injected into decode): the metrics lines carry
    TRL's names, the weights logged after the cap (e^0.5 cut to --sampler-cap 1.2) and the ratio before it, the
    capped share, and the k3 KL of the gap (the gradients each mode gives: test_train_step_correction)."""
    decode = fast_decode.decode

    def off_by_half(*args, **kw):
        tokens, q_logprobs, p_logprobs, support = decode(*args, **kw)
        return tokens, q_logprobs - 0.5, p_logprobs - 0.5, support

    monkeypatch.setattr(fast_decode, "decode", off_by_half)
    for mode in ("token_truncate", "none"):
        tiny_run(tmp_path, tmp_path / mode, "--steps", "1", "--sampler-correction", mode, "--sampler-cap", "1.2")
        line = run_record(tmp_path / mode)[0]
        assert line["sampling/sampling_logp_difference/max"] == pytest.approx(0.5, abs=1e-5)
        assert line["sampling/raw_importance_sampling_ratio/max"] == pytest.approx(math.exp(0.5), rel=1e-4)
        assert line["sampling/k3_kl"] == pytest.approx(math.exp(0.5) - 1.5, rel=1e-4)
        want = 1.2 if mode == "token_truncate" else 1.0
        assert line["sampling/importance_sampling_ratio/max"] == pytest.approx(want, rel=1e-5)
        assert line["sampling/capped_frac"] == (1.0 if mode == "token_truncate" else 0.0)


def test_main_eval(tmp_path):
    """--eval-prompts: eval lines at step 0, every --eval-every and at the end, with per-category means, an image grid
    each time and curves.png; identical at step 0 for two training seeds (fixed eval seeds); tools/compare.py's base and
    trained numbers equal the run's first and last eval lines, from checkpoint.pt and from final/."""
    prompts = write_example(tmp_path, ["a gray square | t.png", "another | t.png"])
    evals = write_evals(tmp_path)
    common = [*TINY, "--prompts", str(prompts), "--steps", "3", "--image-every", "0", "--eval-prompts", str(evals),
              "--eval-every", "2", "--eval-samples", "2", "--eval-reward", "mse", "--lr", "1e-3"]
    grpo.main([*common, "--out", str(tmp_path / "a")])
    lines = eval_lines(tmp_path / "a")
    assert [x["step"] for x in lines] == [0, 2, 3]
    assert {"eval/reward", "eval/ssim", "eval/mse", "eval/reward/single", "eval/mse/counting"} <= set(lines[0])
    assert not any("/None" in k for k in lines[0]) and lines[0]["eval/reward"] == lines[0]["eval/ssim"]  # mse: weight 0
    raw = [json.loads(x) for x in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    assert all(x["sec_eval"] > 0 for x in raw if x.get("eval"))
    assert len([x for x in run_record(tmp_path / "a") if not x.get("eval")]) == 3
    images = sorted(p.name for p in (tmp_path / "a" / "images").iterdir())
    assert images == ["eval_00000.png", "eval_00002.png", "eval_00003.png"]
    assert Image.open(tmp_path / "a" / "curves.png").size[0] > 500
    grpo.main([*common, "--out", str(tmp_path / "b"), "--seed", "1"])
    assert eval_lines(tmp_path / "b")[0] == lines[0]  # another training seed: other training samples, same evaluation
    train = [[x["reward_mean"] for x in run_record(tmp_path / d) if not x.get("eval")] for d in ("a", "b")]
    assert train[0] != train[1]
    import tools.compare as compare
    for path in (tmp_path / "a", tmp_path / "a" / "final"):
        result = compare.main([str(path)])
        assert as_line(result["base"], 0) == lines[0] and as_line(result["trained"], 3) == lines[-1], path
    assert Image.open(tmp_path / "a" / "images" / "compare.png").size[0] > 2 * 128 * 3


def test_main_eval_lora_compare(tmp_path):
    """tools/compare.py also reads a LoRA run's final/ (the adapter alone), with the run's last eval numbers."""
    prompts = write_example(tmp_path, ["a gray square | t.png"])
    grpo.main([*TINY, "--prompts", str(prompts), "--steps", "2", "--image-every", "0", "--lora-rank", "4",
               "--lr", "0.1", "--eval-prompts", str(write_evals(tmp_path)), "--eval-samples", "2",
               "--out", str(tmp_path / "run")])
    lines = eval_lines(tmp_path / "run")
    import tools.compare as compare
    result = compare.main([str(tmp_path / "run" / "final")])
    assert result["step"] is None and as_line(result["trained"], 2) == lines[-1]
    assert as_line(result["base"], 0) == lines[0] and lines[0]["eval/reward"] != lines[-1]["eval/reward"]


def test_main_editing(tmp_path):
    """A .jsonl mixing an edit (source image) and a text-to-image example trains with LoRA, KL and micro-batches:
    first-step ratio exactly 1, sampler and trainer agree, the grid shows the source, and a resumed run equals
    the uninterrupted one."""
    Image.fromarray((smooth_source().permute(1, 2, 0).numpy() * 255).astype(np.uint8)).save(tmp_path / "day.png")
    Image.fromarray(np.full((64, 64, 3), 128, np.uint8)).save(tmp_path / "night.png")
    (tmp_path / "edits.jsonl").write_text('{"prompt": "make it night", "source": "day.png", "target": "night.png"}\n'
                                          '{"prompt": "a gray square", "target": "night.png"}\n')
    common = [*TINY, "--prompts", str(tmp_path / "edits.jsonl"), "--prompts-per-step", "2",
              "--lora-rank", "4", "--kl-beta", "0.04", "--micro-batch-size", "2", "--image-every", "2"]
    grpo.main([*common, "--out", str(tmp_path / "whole"), "--steps", "3"])
    first = run_record(tmp_path / "whole")[0]
    assert first["ratio_min"] == first["ratio_max"] == 1.0 and first["sampler_gap"] <= 1e-5
    grid = Image.open(tmp_path / "whole" / "images" / "step_00001.png")
    # per prompt a title strip, then source, target and the 4 samples (64 pixels shown at 128), then the rewards
    assert grid.size == ((2 + 4) * 128, 2 * (14 + 128 + 14))
    shown = np.asarray(grid)[14:142:2, :128:2].astype(float)  # the first tile, back at 64x64
    assert np.abs(shown - np.asarray(Image.open(tmp_path / "day.png"))).max() <= 1
    grpo.main([*common, "--out", str(tmp_path / "half"), "--steps", "2"])
    grpo.main(["--resume", str(tmp_path / "half"), "--steps", "3"])
    assert run_record(tmp_path / "half") == run_record(tmp_path / "whole")


def test_main_nan_injection(tmp_path, monkeypatch):
    """A NaN advantage in one step is skipped with a warning and counted; training goes on, weights finite."""
    original, calls = grpo.group_advantages, []

    def poisoned(rewards, **kwargs):
        calls.append(1)
        adv = original(rewards, **kwargs)
        return adv * float("nan") if len(calls) == 2 else adv

    monkeypatch.setattr(grpo, "group_advantages", poisoned)
    summary = tiny_run(tmp_path, tmp_path / "nan", "--steps", "3")
    lines = run_record(tmp_path / "nan")
    assert [x["skipped"] for x in lines] == [0, 1, 0] and lines[-1]["skipped_total"] == 1 and summary["skipped"] == 1
    from transformers import GlmImageForConditionalGeneration
    final = GlmImageForConditionalGeneration.from_pretrained(tmp_path / "nan" / "final")
    assert all(torch.isfinite(p).all() for p in final.parameters())


def test_main_nonfinite_reward(tmp_path, monkeypatch, capsys):
    """A NaN in one sample's reward drops its group from the step, with one warning line naming the reward and the
    prompt; the other group trains, and the metrics line counts the dropped group and averages the kept ones. A step
    left with no group is skipped (its updates counted) and training goes on."""
    def flaky(images, example):  # NaN for the second sample of one prompt, or of every prompt once asked
        values = images.mean(dim=(1, 2, 3))
        if example["prompt"] == "two blue squares" or flaky.everywhere:
            values[1] = math.nan
        return values

    flaky.everywhere = False
    monkeypatch.setitem(grpo.REWARDS, "flaky", flaky)
    prompts = write_example(tmp_path, ["a red circle | t.png", "two blue squares | t.png"])
    common = [*TINY, "--prompts", str(prompts), "--prompts-per-step", "2", "--reward", "ssim=1,flaky=0.5",
              "--image-every", "0", "--temperature", "2.0"]  # T 2: a group that spreads
    grpo.main([*common, "--out", str(tmp_path / "one"), "--steps", "1"])
    line, = run_record(tmp_path / "one")
    warnings = [w for w in capsys.readouterr().err.splitlines() if "not finite" in w]
    assert warnings == ["warning: step 1: reward 'flaky' is not finite for 'two blue squares' (" + str(prompts) +
                        ":2); its group is left out of this step's loss"]
    assert line["dropped_groups"] == 1 and line["skipped"] == 0 and math.isfinite(line["reward_mean"])
    assert math.isfinite(line["loss"]) and line["zero_std_groups"] == 0  # the good group alone, with its spread
    flaky.everywhere = True  # and with a KL: its progress bar shows the KL of a step that has none
    grpo.main([*common, "--out", str(tmp_path / "none"), "--steps", "2", "--mu", "2", "--kl-beta", "0.1"])
    lines = run_record(tmp_path / "none")
    assert [x["dropped_groups"] for x in lines] == [2, 2] and [x["skipped"] for x in lines] == [2, 2]
    printed = capsys.readouterr()
    assert lines[-1]["skipped_total"] == 4 and "no group left" in printed.err
    assert "reward: no step had a finite reward (every group was left out)" in printed.out and "nan" not in printed.out
    # with every advantage variant on, a step with no group is skipped as cleanly (no torch.stack of nothing)
    every = ["--diversity", "0.2", "--unlikeliness", "0.5", "--entropy-bonus", "0.1", "--clip-eps-high", "0.28",
             "--kl-on", "above_mean", "--mu", "2", "--kl-beta", "0.1"]
    for variant in (["--scale-rewards", "batch"], ["--reward-aggregation", "normalize"]):
        grpo.main([*common, "--out", str(tmp_path / f"variants{variant[0]}"), "--steps", "1", *every, *variant])
        line, = run_record(tmp_path / f"variants{variant[0]}")
        assert line["dropped_groups"] == 2 and line["skipped"] == 2, variant
    # a reward of weight 0 is only logged: its NaN is named, and every group trains
    flaky.everywhere = False
    capsys.readouterr()
    grpo.main([*common, "--reward", "ssim=1,flaky=0", "--out", str(tmp_path / "logged"), "--steps", "1"])
    line, = run_record(tmp_path / "logged")
    assert line["dropped_groups"] == 0 and line["skipped"] == 0 and math.isfinite(line["loss"])
    assert math.isnan(line["reward/flaky"]) and math.isfinite(line["reward_mean"])
    warnings = [w for w in capsys.readouterr().err.splitlines() if "not finite" in w]
    assert warnings == ["warning: step 1: reward 'flaky' (weight 0, logged only) is not finite for 'two blue squares' "
                        f"({prompts}:2); the group trains on the others"]


def test_main_zero_spread_group(tmp_path, monkeypatch):
    """A group whose rewards are all equal gets zero advantages, is counted, and never produces NaN."""
    monkeypatch.setitem(grpo.REWARDS, "ssim", lambda images, target: torch.zeros(images.shape[0]))
    tiny_run(tmp_path, tmp_path / "flat", "--steps", "2")
    lines = run_record(tmp_path / "flat")
    assert [x["zero_std_groups"] for x in lines] == [1, 1] and all(math.isfinite(x["loss"]) for x in lines)
    assert all(x["loss"] == 0 for x in lines)


def test_rejection_sampling(tmp_path):
    """tools/rejection_sampling.py: advantage 1 for each group's best sample (the first of a tie), 0 for the others;
    through grpo.main it trains with those advantages (one update, no KL, no clip: a supervised step on the best of
    G), and leaves grpo.group_advantages as it was."""
    r = torch.tensor([[0.1, 0.9, 0.3, 0.9], [0.5, 0.5, 0.5, 0.5]])
    assert torch.equal(rejection_sampling.best_of_group(r), torch.tensor([[0.0, 1, 0, 0], [1.0, 0, 0, 0]]))
    advantages = grpo.group_advantages
    rejection_sampling.main([*TINY, "--prompts", str(write_example(tmp_path, ["a gray square | t.png"])), "--out",
                             str(tmp_path / "rs"), "--steps", "2", "--image-every", "0", "--kl-beta", "0.1"])
    assert grpo.group_advantages is advantages
    lines = run_record(tmp_path / "rs")
    assert all(x["advantage/max"] == 1.0 and x["advantage/min"] == 0.0 for x in lines)
    assert all(x["advantage/abs_mean"] == pytest.approx(1 / 4) for x in lines)  # one sample of G = 4
    assert all(x["kl"] == 0.0 and x["clip_frac"] == 0.0 and x["ratio_max"] == 1.0 for x in lines)


def test_readme_commands():
    """Every grpo.py and dit_grpo.py command in the code blocks of the README and docs/ parses (each with its own
    flags); those that run as written here (the tiny model on the shipped prompts) write to different --out
    directories, so they run in any order."""
    import shlex
    import dit_grpo
    text = "\n".join(p.read_text() for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))])
    blocks = re.findall(r"```bash\n(.*?)```", text.replace("\\\n", " "), flags=re.S)
    code = [line.split("#")[0] for block in blocks for line in block.splitlines()]  # continued lines joined
    commands = [re.split(r"\b(dit_grpo|grpo)\.py", line, maxsplit=1)[1:] for line in code
                if "grpo.py" in line and "..." not in line]
    commands = list(dict.fromkeys((s, " ".join(shlex.split(c))) for s, c in commands))  # pages repeat each other
    assert len(commands) >= 8 and {s for s, _ in commands} == {"grpo", "dit_grpo"}
    outs = []
    for script, command in commands:
        argv = shlex.split(command)
        cfg = dit_grpo.parse_config(argv) if script == "dit_grpo" else trainer.parse_config(grpo, argv)  # a bad
        # flag would exit 2 here
        if cfg.model == "tiny" and not cfg.resume and (ROOT / cfg.prompts).is_file():
            outs.append(cfg.out)
    assert len(outs) >= 3 and len(set(outs)) == len(outs), outs


# ---- many processes: torchrun + FSDP2 ------------------------------------------------------------


@pytest.mark.parametrize("extra", [["--kl-beta", "0.04", "--eval-prompts", "EVALS", "--eval-samples", "2"],
                                   ["--lora-rank", "4", "--kl-beta", "0.04", "--kl-on", "uncertain", "--reward",
                                    "ssim,mse=0", "--reference-reset-every", "2", "--gardo-diversity", "tokens",
                                    "--cluster-bonus", "0.2", "--scale-rewards", "batch", "--top-p", "0.9",
                                    "--policy-dist", "truncated", "--entropy-bonus", "0.1", "--steps", "3"]],
                         # LoRA with every variant whose numbers are step-wide, over both processes: GARDO's gate over
                         # both processes' samples, the reset adapter swapped into FSDP's shards at step 3, the
                         # batch's std, the entropy's threshold, the nucleus' codes
                         ids=["full-kl-eval", "lora-variants"])
def test_torchrun_equals_one_process(tmp_path, extra):
    """2 processes x 1 prompt per step make the same updates as 1 process x 2 prompts: same prompts and samples,
    the same per-step metrics and the same final/ weights within 1e-5 (float32), and final models that score
    tokens alike; with --eval-prompts the evaluations (3 prompts spread over 2 processes) equal one process's too.
    (With micro-batches smaller than a group the two runs add the same gradients in another order;
    test_torchrun_collectives checks that gradient within 1e-5.)"""
    prompts = write_example(tmp_path, ["a gray square | t.png", "another | t.png"])
    extra = [str(write_evals(tmp_path)) if x == "EVALS" else x for x in extra]
    common = [*TINY_CPU, "--prompts", str(prompts), "--steps", "2", "--image-every", "0", *extra]  # (LoRA: 3)
    # one thread per process in both runs: the thread count changes float summation order (and so, rarely, a sample)
    one_process(*common, "--out", str(tmp_path / "one"), "--prompts-per-step", "2")
    proc = torchrun(*common, "--out", str(tmp_path / "two"), "--prompts-per-step", "1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("reward (mean of first") == 1  # rank 0 alone prints the summary
    assert_same_metrics(tmp_path / "one", tmp_path / "two")
    steps = [x for x in run_record(tmp_path / "two") if not x.get("eval")]
    assert steps[0]["prompts"] == [0, 1]  # both processes' groups, in the metrics of rank 0
    assert [x["step"] for x in eval_lines(tmp_path / "two")] == ([0, 2] if "--eval-prompts" in extra else [])
    assert_same_weights(tmp_path / "one" / "final", tmp_path / "two" / "final")
    if "--lora-rank" not in extra:  # the zero-gradient entries excepted above change nothing the model computes
        from transformers import GlmImageForConditionalGeneration
        r = sample_group(fresh_pipe(), "a cat", 2, 64, 64, T, seed=0)
        with torch.no_grad():
            one, two = (grpo.token_logprobs(GlmImageForConditionalGeneration.from_pretrained(tmp_path / d / "final")
                                            .to(DEVICE), r.prompt.inputs, r.tokens, T) for d in ("one", "two"))
        assert (one - two).abs().max() <= 1e-5


COLLECTIVES = """
import copy, functools, json, math, sys, torch, torch.distributed as dist
sys.path.insert(0, {here!r})
import grpo
from helpers import parallel, trainer
counts = {{"all_gather": 0, "reduce_scatter": 0}}
for op, name in [(op, op.split("_")[0] + "_" + op.split("_")[1]) for op in ("all_gather_into_tensor",
                 "all_gather_single", "reduce_scatter_tensor", "reduce_scatter_single") if hasattr(dist, op)]:
    real = getattr(dist, op)
    def counted(*a, _real=real, _name=name, **k):
        counts[_name] += 1
        return _real(*a, **k)
    setattr(dist, op, counted)
rank, world, _ = parallel.start_processes("cpu")
for lora in (False, True):
    counts.update(all_gather=0, reduce_scatter=0)
    pipe = grpo.load_glm_image("tiny")
    policy = grpo.trained_model(pipe, 4 if lora else 0)
    reference = copy.deepcopy(policy)  # unsharded, on every process: the one-process gradient over both groups
    both = [trainer.sample_groups(grpo, pipe, ["a cat"], 4, 64, 64, 0.9, [s])[0] for s in range(2)]
    advantages = torch.tensor([[1.0, -1.0, 0.5, -0.5], [0.3, 0.3, -0.9, 0.3]])
    parallel.shard(policy, torch.float32)
    opt = torch.optim.SGD([p for p in policy.parameters() if p.requires_grad], lr=0.0)
    with parallel.unsharded(policy):
        r = trainer.sample_groups(grpo, pipe, ["a cat"], 4, 64, 64, 0.9, [rank])[0]
    sampling = dict(counts)
    counts.update(all_gather=0, reduce_scatter=0)
    loss = functools.partial(grpo.micro_batch_loss, clip_eps=0.2, kl_beta=0.0)
    trainer.train_step(grpo, policy, opt, trainer.micro_batches([r], advantages[rank:rank + 1], 1), None, loss,
                       temperature=0.9, mu=1, max_grad_norm=math.inf)
    training = dict(counts)
    trainer.train_step(grpo, reference, torch.optim.SGD([p for p in reference.parameters() if p.requires_grad],
                                                        lr=0.0), trainer.micro_batches(both, advantages, 1), None,
                       loss, temperature=0.9, mu=1, max_grad_norm=math.inf)
    want = {{n: p.grad for n, p in reference.named_parameters() if p.grad is not None}}
    got = {{n: p.grad.full_tensor() for n, p in policy.named_parameters() if p.grad is not None}}
    norm = torch.sqrt(sum((g ** 2).sum() for g in want.values()))
    error = torch.sqrt(sum(((got[n] - want[n]) ** 2).sum() for n in want)) / norm
    units = len(parallel.fsdp_units(policy))
    if rank == 0:
        print(json.dumps({{"lora": lora, "sampling": sampling, "training": training, "units": units,
                          "tokens": r.tokens.shape[1], "same_params": got.keys() == want.keys(),
                          "layers": pipe.vision_language_encoder.config.text_config.num_hidden_layers,
                          "grad_error": error.item()}}))
parallel.stop_processes()  # a gloo thread alive at exit can abort a process ("terminate called ..."; seen in CI)
"""


def test_two_nodes(tmp_path):
    """Two nodes, as docs/many_gpus.md launches them: two torchrun commands (--nnodes 2, --node-rank 0 and 1, one
    process each) meeting at a c10d rendezvous on localhost, here on one machine. They train as one process does on
    both prompts (the same metrics and final weights within 1e-5), with a LoRA adapter and the KL on."""
    import os
    import socket
    import subprocess
    import sys
    prompts = write_example(tmp_path, ["a gray square | t.png", "another | t.png"])
    common = [*TINY_CPU, "--prompts", str(prompts), "--steps", "2", "--image-every", "0", "--lora-rank", "4",
              "--kl-beta", "0.04"]
    one_process(*common, "--out", str(tmp_path / "one"), "--prompts-per-step", "2")
    with socket.socket() as free:
        free.bind(("localhost", 0))
        port = free.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    nodes = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank",
                               str(rank), "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                               f"localhost:{port}", "--rdzv-id", "grpo-two-nodes", str(ROOT / "grpo.py"), *common,
                               "--out", str(tmp_path / "two"), "--prompts-per-step", "1"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env)
             for rank in (0, 1)]
    results = [node.communicate(timeout=600) for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], [err[-2000:] for _, err in results]
    assert_same_metrics(tmp_path / "one", tmp_path / "two")
    assert_same_weights(tmp_path / "one" / "final", tmp_path / "two" / "final")


def test_torchrun_nonfinite_reward(tmp_path, monkeypatch):
    """Under torchrun a group with a NaN reward leaves the loss while its process joins every collective: the prompt
    'another' gives a NaN, once on process 0 only at step 1 (so the processes keep 1 and 2 groups: the metrics are
    weighed by them), on both at step 2; the run equals one process training the same four groups a step (the NaN
    ones out of the loss): the same metrics and the same final weights, KL and variants on."""
    (tmp_path / "flaky_reward.py").write_text(
        "import math\n\ndef reward(images, example):\n    values = images.mean(dim=(1, 2, 3))\n"
        "    if example['prompt'] == 'another':\n        values[1] = math.nan\n    return values\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))  # for torchrun's processes
    monkeypatch.syspath_prepend(str(tmp_path))  # for this one's
    prompts = write_example(tmp_path, ["a gray square | t.png", "another | t.png", "a third | t.png"])
    common = [*TINY_CPU, "--prompts", str(prompts), "--steps", "2", "--image-every", "0", "--temperature", "2.0",
              "--reward", "ssim=1,flaky_reward:reward=0.5", "--kl-beta", "0.04", "--mu", "2", "--diversity", "0.1",
              "--scale-rewards", "batch", "--entropy-bonus", "0.1"]
    one_process(*common, "--out", str(tmp_path / "one"), "--prompts-per-step", "4")
    proc = torchrun(*common, "--out", str(tmp_path / "two"), "--prompts-per-step", "2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = run_record(tmp_path / "two")
    assert [x["dropped_groups"] for x in lines] == [1, 2] and [x["skipped"] for x in lines] == [0, 0]
    assert all(math.isfinite(x["loss"]) and x["kl"] > 0 for x in lines[1:])
    assert_same_metrics(tmp_path / "one", tmp_path / "two")
    assert_same_weights(tmp_path / "one" / "final", tmp_path / "two" / "final")


def test_torchrun_collectives(tmp_path):
    """Sampling gathers each FSDP unit at most once per generate, not once per token; each of 4 micro-batches
    reduce-scatters the units that hold trainable weights once (gradients stay sharded); the gradient is the mean
    over every sequence of both processes (within 1e-5 of one process's), with full fine-tuning and with LoRA (one
    launch, both in turn)."""
    script = tmp_path / "count.py"
    script.write_text(COLLECTIVES.format(here=str(ROOT)))
    proc = torchrun(script=script)
    assert proc.returncode == 0, proc.stderr[-3000:]
    counted = [json.loads(line) for line in proc.stdout.strip().splitlines() if line.startswith("{")]
    assert [c["lora"] for c in counted] == [False, True]
    for c in counted:
        assert c["tokens"] == 260 and c["sampling"]["all_gather"] <= c["units"]
        assert c["sampling"]["reduce_scatter"] == 0
        layers = c["layers"]  # decoder layers: the units that hold trainable weights
        assert c["training"]["reduce_scatter"] == (layers + (0 if c["lora"] else 1)) * 4, c
        assert c["same_params"] and c["grad_error"] < 1e-5, c


def test_main_each_reward_logged(tmp_path):
    """With two rewards every sample's values are logged: samples.jsonl holds a row per sample and step (its group,
    prompt, weighted reward, each reward and advantage), and the image grid writes each reward under each picture."""
    prompts = write_example(tmp_path, ["a red circle | t.png", "two blue squares | t.png"])
    out = tmp_path / "run"
    grpo.main([*TINY, "--prompts", str(prompts), "--out", str(out), "--steps", "2", "--reward", "ssim=1,mse=0.5",
               "--image-every", "1", "--temperature", "2.0"])
    rows = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert [(r["step"], r["sample"]) for r in rows] == [(s, i) for s in (1, 2) for i in range(4)]
    assert set(rows[0]) == {"step", "group", "prompt", "sample", "reward", "ssim", "mse", "advantage"}
    assert rows[0]["prompt"] == "a red circle" and rows[4]["prompt"] == "two blue squares"
    assert all(abs(r["reward"] - (r["ssim"] + 0.5 * r["mse"])) < 1e-6 for r in rows)
    line = run_record(out)[0]
    assert np.mean([r["reward"] for r in rows[:4]]) == pytest.approx(line["reward_mean"], abs=1e-6)
    assert max(r["advantage"] for r in rows[:4]) == pytest.approx(line["advantage/max"], abs=1e-6)
    grid = Image.open(out / "images" / "step_00001.png")
    assert grid.size == (5 * 128, 14 + 128 + 3 * 14)  # target + 4 samples; under each: the sum, ssim, mse


def test_main_shuffle(tmp_path):
    """--shuffle visits every prompt once an epoch in an order drawn from --seed (another epoch, another order); the
    tiny presets keep the file's order, the real model's shuffles, --no-shuffle overrides. (The same order after
    --resume: tests/test_stops.py, whose run shuffles.)"""
    assert trainer.parse_config(grpo, []).shuffle is False and trainer.parse_config(grpo, ["--model", "zai-org/GLM-Image"]).shuffle
    assert not trainer.parse_config(grpo, ["--model", "zai-org/GLM-Image", "--no-shuffle"]).shuffle
    prompts = write_example(tmp_path, ["a red circle | t.png", "a blue square | t.png", "two green triangles | t.png",
                                       "a yellow circle | t.png", "a red square | t.png"])
    grpo.main([*TINY, "--prompts", str(prompts), "--image-every", "0", "--shuffle", "--out", str(tmp_path / "run"),
               "--steps", "2", "--prompts-per-step", "5", "--group-size", "2", "--micro-batch-size", "2"])
    first, second = (x["prompts"] for x in run_record(tmp_path / "run"))  # a step an epoch
    assert sorted(first) == sorted(second) == list(range(5)) and first != second
    assert first != list(range(5))  # not the file's order (seed 0)
