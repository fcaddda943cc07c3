"""Stopped anywhere, resumed exactly: a short run with every stateful option on at once (a cosine schedule with
warmup, GARDO's reference reset with its KL trigger, --kl-on uncertain's controller, --shuffle, held-out evaluation,
TensorBoard, LoRA, mu 2, the reward-hacking monitor with a base of 2 steps and a low threshold, so that it warns) is stopped at each phase of a step, by Ctrl-C, SIGTERM, a failing reward, a full disk or a
kill, then resumed with the command it printed; every metrics line, every TensorBoard scalar and the final weights
equal the uninterrupted run's, bit for bit. The rule they check is docs/robustness.md's: a step lands whole or not at
all (helpers/run.py's `landing`). In-process and on the tiny model at 64x64: one reference run serves every stop.

    python -m pytest -q tests/test_stops.py
"""

import os
import signal

import pytest
import torch

import grpo
from helpers import monitor, run, run_io, trainer, variants
from helpers.user_input import guarded
from conftest import TINY, run_record, write_evals, write_example

STEPS = 8
FLAGS = ["--steps", str(STEPS), "--mu", "2", "--kl-beta", "0.1", "--lora-rank", "4", "--lr", "3e-3",
         "--lr-scheduler", "cosine", "--warmup-steps", "1", "--reference-reset-every", "2",
         "--reference-reset-kl", "0.03", "--kl-on", "uncertain", "--shuffle", "--eval-every", "2", "--eval-samples",
         "2", "--report-to", "tensorboard", "--save-every", "2", "--image-every", "2", "--monitor-threshold", "0.5"]


@pytest.fixture(scope="module", autouse=True)
def short_monitor():
    """The monitor's base 1 step, its spread and window 2 each (3, 20, 10 in a run): z-scores from step 2 of 8, warnings."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(monitor, "FIRST", 1)
        patch.setattr(monitor, "BASE", 2)
        patch.setattr(monitor, "WINDOW", 2)
        yield


class Killed(BaseException):
    """A kill -9, in-process: no handler runs, nothing is saved (only the block's `finally`s, which write nothing)."""


def jitter(images: torch.Tensor, example: dict) -> torch.Tensor:
    """A user's reward that draws from torch's global RNG (a random crop, say): logged at weight 0, and ranked by
    --kl-on uncertain, so a resume that restored another RNG state than the uninterrupted run had shows."""
    return images.mean(dim=(1, 2, 3)) + 0.01 * torch.rand(len(images))


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The prompts (3: --shuffle reorders them), the evaluation set and the uninterrupted run."""
    folder = tmp_path_factory.mktemp("stops")
    prompts = write_example(folder, ["a gray square | t.png", "another | t.png", "a third | t.png"])
    evals = write_evals(folder)
    argv = [*TINY, "--prompts", str(prompts), "--eval-prompts", str(evals), "--reward", "ssim=1,jitter=0,mse=0",
            *FLAGS]
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(grpo.REWARDS, "jitter", jitter)
        grpo.main([*argv, "--out", str(folder / "whole")])
        yield argv, folder / "whole"


def tensorboard_scalars(out) -> dict:
    """Every scalar of the run's TensorBoard files as TensorBoard shows it (a resume's purge applied): {tag: [(step,
    value)]}."""
    from tensorboard.backend.event_processing.event_multiplexer import EventMultiplexer
    multiplexer = EventMultiplexer().AddRunsFromDirectory(str(out / "tensorboard")).Reload()
    scalars = {}
    for name in multiplexer.Runs():
        for tag in multiplexer.GetAccumulator(name).Tags()["scalars"]:
            if not tag.startswith("sec_"):  # the seconds differ run to run
                events = multiplexer.Scalars(name, tag)
                scalars.setdefault(tag, []).extend((e.step, e.value) for e in events)
    return {tag: sorted(values) for tag, values in scalars.items()}


def final_weights(out) -> dict:
    from safetensors.torch import load_file
    return load_file(out / "final" / "adapter_model.safetensors")


def stop_in(monkeypatch, module, name, stop, step=3, in_eval=False):
    """Make `module.name` (a phase's function, as main calls it) run `stop` on its first call in step `step` (with
    `in_eval`, in the evaluation of the policy after step `step`), before it does its work. `stop` None: the call is
    grpo.group_rewards', and its last reward raises inside its guard, as a user's reward would."""
    original, now, state = getattr(module, name), {"step": 0, "eval": None}, {"done": False}
    steps, evaluation = run.steps, run.run_evaluation

    def counting(r):
        for item in steps(r):
            now["step"] = item[0]
            yield item

    def evaluating(r, evaluated):
        now["eval"] = evaluated
        try:
            evaluation(r, evaluated)
        finally:
            now["eval"] = None

    def stopping(*args, **kwargs):
        at = now["eval"] == step if in_eval else now["step"] == step and now["eval"] is None
        if at and not state["done"]:
            state["done"] = True
            if stop is None:
                images, examples, rewards = args
                last = list(rewards)[-1]  # after jitter has drawn: a checkpoint must not keep that draw
                rewards = {**rewards, last: (guarded(last, broken_reward), rewards[last][1])}
                return original(images, examples, rewards)
            stop()
        return original(*args, **kwargs)

    monkeypatch.setattr(run, "steps", counting)
    monkeypatch.setattr(run, "run_evaluation", evaluating)
    monkeypatch.setattr(module, name, stopping)
    return state


def broken_reward(images, example):
    return images.mean(dim=(1, 2, 3)) / 0 if example["no such field"] else None


def full_disk():
    raise OSError(28, "No space left on device")


def kill():
    raise Killed


PHASES = {"sampling": (trainer, "sample_groups"), "decoding": (grpo, "decode_images"),
          "reward": (grpo, "group_rewards"), "update": (trainer, "train_step"), "log": (run, "log_step"), "after-step": (variants, "after_step"),
          "checkpoint write": (run, "save_checkpoint"), "evaluation": (trainer, "sample_groups")}
CHAIN = [  # (phase, how, step, exit code, the step of the checkpoint a resume reads): one run stopped again and again
    ("sampling", "SIGTERM", 1, 130, 0),  # nothing landed: a checkpoint of the initial state, AdamW's state empty
    ("sampling", "SIGTERM", 2, 130, 1), ("decoding", "SIGINT", 2, 130, 1), ("reward", "SIGTERM", 2, 130, 1),
    ("update", "SIGINT", 2, 130, 2), ("update", "SIGTERM", 3, 130, 3), ("log", "SIGTERM", 4, 130, 4),
    ("after-step", "SIGINT", 5, 130, 5), ("checkpoint write", "SIGTERM", 6, 130, 6),
    ("evaluation", "SIGINT", 6, 130, 6),  # the evaluation after step 6, which the resume does first
    ("evaluation", "a reward raises", 6, 1, 6),
    ("reward", "a reward raises", 8, 1, 7),  # step 7 landed, saved now without step 8's draws of the rewards before
    ("log", "a full disk", 8, 1, 7), ("decoding", "kill -9", 8, None, 7)]


def test_stopped_anywhere_resumes_exactly(files, monkeypatch, capsys):
    """One run stopped in every phase of a step in turn (CHAIN), each time resumed with the command it printed: what
    it has written equals the uninterrupted run's first lines after every stop, and at the end every metrics line,
    every TensorBoard scalar and the final weights equal it bit for bit. A signal before the landing drops the step;
    in the landing (update, log line, schedule, reference, checkpoint) it waits for its end; in an evaluation the
    evaluation is redone. A failing reward stops with one line (exit 1) and the landed steps saved; a full disk with
    one line and the last checkpoint; a kill keeps the last checkpoint."""
    argv, whole = files
    out = whole.parent / "stopped"
    expected = run_record(whole)
    assert any(key.startswith("monitor/warning/") for line in expected for key in line)  # the monitor's state matters
    command = [*argv, "--out", str(out)]
    for phase, how, step, code, landed in CHAIN:
        where = f"{how} in {phase}, step {step}"
        module, name = PHASES[phase]
        if how == "a reward raises":  # the reward itself raises, inside its guard, in the step or the evaluation
            module, name = grpo, "group_rewards"
            stop = None
        else:
            stop = {"SIGINT": lambda: signal.raise_signal(signal.SIGINT), "kill -9": kill, "a full disk": full_disk,
                    "SIGTERM": lambda: signal.raise_signal(signal.SIGTERM)}[how]
        state = stop_in(monkeypatch, module, name, stop, step, in_eval=phase == "evaluation")
        if code is None:
            with pytest.raises(Killed):
                grpo.main(command)
        else:
            with pytest.raises(SystemExit) as exit_info:
                grpo.main(command)
            assert exit_info.value.code == code, where
            assert f"--resume {out}" in capsys.readouterr().err, where
        monkeypatch.undo()
        assert state["done"], where
        assert run_io.read_checkpoint(run_io.resume_point(out)[1])["step"] == landed, where
        written = [line for line in run_record(out) if line["step"] <= landed]  # (a resume drops the later ones)
        assert written == expected[:len(written)] and written[-1]["step"] == landed, where
        command = ["--resume", str(out)]
    grpo.main(command)
    assert run_record(out) == expected
    assert tensorboard_scalars(out) == tensorboard_scalars(whole)
    mine, theirs = final_weights(out), final_weights(whole)
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)


def test_measured_case_rates_and_reset(tmp_path, monkeypatch):
    """Issue 76's measured case: Ctrl-C inside step 3's update of a cosine schedule with a warmup step and a KL-
    triggered reset: the step-3 checkpoint holds the scheduler after step 3's updates (3 x mu 2: it moves once an
    update) and the reset of step 3, and the resumed run's rates per step are the uninterrupted run's (they lagged one
    step to the end)."""
    prompts = write_example(tmp_path, ["a gray square | t.png", "another | t.png"])
    argv = [*TINY, "--prompts", str(prompts), "--mu", "2", "--kl-beta", "0.1", "--lr", "3e-3", "--lr-scheduler",
            "cosine", "--warmup-steps", "1", "--reference-reset-every", "3", "--reference-reset-kl", "0.03",
            "--lora-rank", "4", "--steps", "7", "--save-every", "0", "--image-every", "0"]
    grpo.main([*argv, "--out", str(tmp_path / "whole")])
    stop_in(monkeypatch, trainer, "train_step", lambda: signal.raise_signal(signal.SIGINT))
    with pytest.raises(SystemExit):
        grpo.main([*argv, "--out", str(tmp_path / "stopped")])
    monkeypatch.undo()
    state = run_io.read_checkpoint(run_io.resume_point(tmp_path / "stopped")[1])
    assert state["step"] == 3 and state["scheduler"]["last_epoch"] == 3 * 2
    assert state["variants"]["reference"]["last"] == 3
    grpo.main(["--resume", str(tmp_path / "stopped")])
    rates = [[line["lr"] for line in run_record(tmp_path / name)] for name in ("whole", "stopped")]
    assert rates[0] == rates[1] and len(set(rates[0])) == 7


@pytest.mark.parametrize("fails", ["before", "after", "SIGTERM before"])
def test_reward_fails_in_the_grids(tmp_path, monkeypatch, capsys, fails):
    """A reward that raises while the before or the after grid is drawn (--before-after, outside any step) stops the
    run as in a step: one line naming it, its traceback in <out>/error.txt, exit 1, the command that continues. The
    resume ends the run: after a failed after grid, with no step to do, it writes the end again (final/run.json). A
    SIGTERM while the before grid is drawn is the run's stop: a checkpoint at step 0, exit 130, no traceback."""
    calls = {"n": 0}
    failing = {"after": 4}.get(fails, 2)  # 1: the start-up check, 2: the before grid, 3: step 1, 4: the after grid

    def flaky(images, example):
        calls["n"] += 1
        if calls["n"] == failing and fails.startswith("SIGTERM"):
            signal.raise_signal(signal.SIGTERM)
        elif calls["n"] == failing:
            raise RuntimeError("the judge is down")
        return images.mean(dim=(1, 2, 3))

    monkeypatch.setitem(grpo.REWARDS, "flaky", flaky)
    prompts = write_example(tmp_path, ["a gray square | t.png"])
    out = tmp_path / "run"
    argv = [*TINY, "--prompts", str(prompts), "--reward", "ssim=1,flaky=0", "--steps", "1", "--before-after", "1",
            "--save-every", "0", "--out", str(out)]
    with pytest.raises(SystemExit) as exit_info:
        grpo.main(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == (130 if fails.startswith("SIGTERM") else 1) and "Traceback" not in err
    assert f"--resume {out}" in err and f"checkpoint at step {1 if fails == 'after' else 0}" in err
    if not fails.startswith("SIGTERM"):
        assert "reward 'flaky' raised RuntimeError: the judge is down" in err
        assert "the judge is down" in (out / "error.txt").read_text()
    assert (out / "final").is_dir() == (fails == "after") and not (out / "final" / "run.json").exists()
    grpo.main(["--resume", str(out)])
    assert (out / "final" / "run.json").exists() and (out / "images" / "before_after.png").exists()
    assert [line["step"] for line in run_record(out)] == [1]


def test_reward_failed_before_any_checkpoint_under_torchrun(tmp_path, capsys):
    """Under torchrun a failing reward saves nothing (the other processes wait in a collective): before any checkpoint
    the line says to start again, not to --resume what is not there; after one it names that checkpoint."""
    from types import SimpleNamespace
    from tqdm import tqdm
    from helpers.user_input import RewardError
    r = SimpleNamespace(progress=tqdm(disable=True), world=2, saved=-1, done=0, out=tmp_path, start=0, checkpoint=None)
    for saved, needle in [(-1, "nothing saved yet: fix it, then start the run again (into the same --out)"),
                          (4, "checkpoint at step 4 in "), (4, ": fix it, then continue it with: torchrun --nproc-per-node 2")]:
        r.saved = saved
        with pytest.raises(SystemExit) as exit_info:
            run.reward_failed(r, RewardError("judge", "raised RuntimeError: down", "Traceback ..."))
        err = capsys.readouterr().err
        assert exit_info.value.code == 1 and needle in err and ("--resume" in err) == (saved >= 0)
        assert (tmp_path / "error.txt").read_text() == "Traceback ..."


STATES = {"step 0": (0, -1), "a step logged, no checkpoint": (2, -1), "after a checkpoint": (3, 2)}  # (done, saved)


@pytest.mark.parametrize("when", list(STATES))
@pytest.mark.parametrize("how", ["one signal", "two signals", "a reward fails", "a reward fails under torchrun",
                                 "a full disk", "a read-only disk", "out of memory"])
def test_every_stop_says_what_is_kept(tmp_path, monkeypatch, capsys, how, when):
    """Every way a run stops says what is kept and what to run, and it is true: --resume only when a checkpoint exists
    after the stop, naming its step; before any, that nothing is saved and to start again (with --overwrite once a
    step is logged, as a new start deletes it). One signal and a failing reward in one process save the landed steps
    first; two signals, a reward failing under torchrun, a failed write and out of memory save nothing."""
    import errno
    from tqdm import tqdm
    from helpers import parallel
    from helpers.user_input import RewardError
    r = run.Run(trainer.parse_config(grpo, ["--out", str(tmp_path)]), tmp_path, 0, None, [], {}, None, grpo)
    r.progress, (r.done, r.saved) = tqdm(disable=True), STATES[when]
    monkeypatch.setattr(run, "save_run", lambda r, step: setattr(r, "saved", step))
    monkeypatch.setitem(parallel.INTERRUPT, "forced", how == "two signals")
    saves = how in ("one signal", "a reward fails")
    with pytest.raises(SystemExit) as exit_info:
        if how in ("one signal", "two signals"):
            run.interrupted(r)
        elif how.startswith("a reward fails"):
            r.world = 2 if how.endswith("torchrun") else 1
            run.reward_failed(r, RewardError("judge", "raised RuntimeError: down", "Traceback ..."))
        elif how == "out of memory":
            with run.timed({}, "train", r):
                raise torch.OutOfMemoryError("CUDA out of memory")
        else:
            code = errno.ENOSPC if how == "a full disk" else errno.EROFS
            run.write_failed(r, OSError(code, os.strerror(code), str(tmp_path / "metrics.jsonl")))
    err = capsys.readouterr().err
    kept = STATES[when][0] if saves else STATES[when][1]  # the checkpoint a resume would read
    assert exit_info.value.code == {"one signal": 130, "two signals": 130, "out of memory": 2}.get(how, 1)
    assert "\n" not in err.strip() and "Traceback" not in err, err
    if kept >= 0:
        assert f"checkpoint at step {kept} in {tmp_path}" in err and f"--resume {tmp_path}" in err, err
    else:
        assert "nothing saved yet" in err and "--resume" not in err, err
        assert ("--overwrite" in err) == (STATES[when][0] > 0), err
    if how in ("a full disk", "a read-only disk"):
        assert ("make room" in err) == (how == "a full disk") and ("read-only" in err) == (how != "a full disk"), err
