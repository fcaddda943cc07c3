"""helpers/monitor.py, the reward-hacking monitor: each signal on known pictures equals its formula; the rule warns on
a planted drift, once, and stays silent on a run whose signals only wobble; in a run the warning is one line naming the
signal, the step, how far it moved and the picture to look at, and the summary lists it. (Its state is the metrics
lines: tests/test_stops.py's matrix resumes it exactly.)

    python -m pytest -q tests/test_monitor.py
"""

import math

import numpy as np
import pytest
import torch

import grpo
from helpers import monitor
from tests.conftest import TINY, run_record, write_example


def picture(rgb, h=8, w=8):
    """A (1, 3, h, w) picture of one colour."""
    return torch.tensor(rgb, dtype=torch.float32)[None, :, None, None].expand(1, 3, h, w).clone()


def test_picture_signals_by_formula():
    """On pictures whose statistics are known by hand: a flat gray, a flat red, a one-pixel checkerboard (all its
    power at the Nyquist corner), two halves (all its power along one axis, mostly low), a muted red."""
    gray, red, muted = picture([0.5, 0.5, 0.5]), picture([1.0, 0.0, 0.0]), picture([0.5, 0.25, 0.25])
    board = ((torch.arange(8)[:, None] + torch.arange(8)[None]) % 2).float().expand(1, 3, 8, 8).clone()
    halves = (torch.arange(8) >= 4).float()[None, None, None].expand(1, 3, 8, 8).clone()
    s = {name: values.tolist() for name, values in monitor.picture_signals(
        torch.cat([gray, red, board, halves, muted])).items()}
    assert s["brightness"] == pytest.approx([0.5, 0.2125, 0.5, 0.5, 0.2125 * 0.5 + 0.7875 * 0.25])
    assert s["saturation"] == pytest.approx([0.0, 1.0, 0.0, 0.0, 0.5])  # (max - min) / max
    assert s["contrast"] == pytest.approx([0.0, 0.0, 0.5, 0.5, 0.0])  # the luma's standard deviation
    assert s["high_frequency"][:3] == pytest.approx([0.0, 0.0, 1.0])
    # two halves: a square wave along x, power at f = 1/8 and 3/8 (odd harmonics, 1 / sin^2(pi f / 1)): the 3/8 share
    power = {f: 1 / math.sin(math.pi * f) ** 2 for f in (1 / 8, 3 / 8)}
    assert s["high_frequency"][3] == pytest.approx(power[3 / 8] / sum(power.values()))
    # Hasler and Suesstrunk's M: flat pictures have no spread, only the mean term: 0.3 |(rg, yb)|
    assert s["colourfulness"] == pytest.approx([0.0, 0.3 * math.hypot(1.0, 0.5), 0.0, 0.0,
                                                0.3 * math.hypot(0.25, 0.125)])


def test_noise_is_high_frequency():
    """White noise spreads its power evenly: the share above 0.25 cycles per pixel is the band's area, 1 - pi / 16."""
    noise = torch.rand(4, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    share = monitor.picture_signals(noise)["high_frequency"]
    assert np.allclose(share, 1 - math.pi / 16, atol=0.03)


def test_group_diversity():
    """The mean pairwise RMS distance: 1 between black and white, 0 among copies, the pairs' mean for three."""
    black, white, gray = picture([0, 0, 0]), picture([1, 1, 1]), picture([0.5, 0.5, 0.5])
    assert monitor.group_diversity(torch.cat([black, white])) == pytest.approx(1.0)
    assert monitor.group_diversity(torch.cat([gray, gray, gray])) == 0.0
    assert monitor.group_diversity(torch.cat([black, white, gray])) == pytest.approx((1 + 0.5 + 0.5) / 3)
    assert math.isnan(monitor.group_diversity(gray))


def history(values: dict, steps: int) -> list[dict]:
    """A run's metrics lines: for each key, values[key](step) (steps counted from 1)."""
    return [{"step": t, **{key: f(t) for key, f in values.items()}} for t in range(1, steps + 1)]


def warnings_over(lines: list[dict], weights=None, threshold=6.0) -> list[tuple[int, str]]:
    """The monitor replayed over a run's lines as the run calls it (monitor.replay): [(step, signal)]."""
    return [(step, name) for step, name, _ in monitor.replay(lines, weights or {}, threshold)[0]]


def wobble(t: int, scale: float = 0.02, seed: int = 0) -> float:
    return scale * np.random.default_rng(seed * 100_000 + t).standard_normal()


def test_silent_while_the_signals_wobble():
    """300 steps whose signals only wobble (noise around a constant): no warning at 6 spreads."""
    lines = history({"reward_mean": lambda t: 0.5 + wobble(t, seed=1), "reward/mse": lambda t: 0.5 + wobble(t, seed=2),
                     "monitor/brightness": lambda t: 0.5 + wobble(t, seed=3),
                     "monitor/diversity": lambda t: 0.2 + wobble(t, seed=4)}, 300)
    assert warnings_over(lines, {"ssim": 1, "mse": 0}) == []


def test_warns_on_a_planted_drift_once():
    """Brightness wobbling by 0.02 until step 60, then rising 0.01 a step: it warns at the first step whose last 10
    steps' median is 6 spreads above the base (the first 3 steps' mean; the spread: the first 20 steps' step-to-step
    changes over sqrt 2, at least 5% of min(b, 1 - b)), by hand from the same numbers, and once only."""
    bright = lambda t: 0.5 + wobble(t) + 0.01 * max(0, t - 60)  # noqa: E731
    lines = history({"reward_mean": lambda t: 0.5, "monitor/brightness": bright}, 200)
    fired = monitor.replay(lines, {}, 6.0)[0]
    base = np.mean([bright(t) for t in range(1, 4)])
    spread = max(np.std(np.diff([bright(t) for t in range(1, 21)])) / np.sqrt(2), 0.05 * min(base, 1 - base))
    first = next(t for t in range(20, 201) if np.median([bright(u) for u in range(t - 9, t + 1)]) - base
                 >= 6 * spread)
    assert [(step, name) for step, name, _ in fired] == [(first, "brightness")] and 60 < first < 90
    assert fired[0][2] >= 6


def test_prompt_sets():
    """Two prompt pairs taking turns, whose pictures differ far more than training moves them: each step is compared
    with its own pair's base, so a wobble stays silent and a drift in one pair warns; prompts that never come back
    share one base."""
    pair = lambda t: [0, 1] if t % 2 else [2, 3]  # noqa: E731
    level = lambda t: 0.9 if t % 2 else 0.5  # noqa: E731  (the pairs' brightness: 0.4 apart)
    steady = [{**line, "prompts": pair(line["step"])} for line in history(
        {"reward_mean": lambda t: 0.5, "monitor/brightness": lambda t: level(t) + wobble(t, 0.005)}, 100)]
    assert warnings_over(steady) == []
    drifting = [{**line, "prompts": pair(line["step"])} for line in history(
        {"reward_mean": lambda t: 0.5, "monitor/brightness": lambda t: level(t) + wobble(t, 0.005)
         - 0.004 * max(0, t - 30)}, 100)]
    fired = warnings_over(drifting)
    assert [name for _, name in fired] == ["brightness"] and 30 < fired[0][0] < 60
    assert monitor.prompt_sets(steady)[:2] == [(0, 1), (2, 3)]
    fresh = [{**line, "prompts": [2 * line["step"], 2 * line["step"] + 1]} for line in steady]
    assert monitor.prompt_sets(fresh) == [()] * len(fresh)


def test_direction_of_each_signal():
    """Diversity warns only when it falls (and not with the token grids' diversity); a measured-only reward only
    when it falls while the trained reward rose; a picture statistic either way; the threshold 0 turns the warnings
    off."""
    up = lambda t: 0.5 + 0.02 * max(0, t - 30) + wobble(t)  # noqa: E731
    down = lambda t: 0.5 - 0.02 * max(0, t - 30) + wobble(t, seed=5)  # noqa: E731
    assert warnings_over(history({"reward_mean": up, "monitor/diversity": up}, 100)) == []
    assert [n for _, n in warnings_over(history({"reward_mean": up, "monitor/diversity": down}, 100))] == ["diversity"]
    assert warnings_over(history({"reward_mean": up, "monitor/diversity": down, "distinct_in_group": down}, 100)) == []
    assert [n for _, n in warnings_over(history({"reward_mean": up, "monitor/saturation": down}, 100))] == [
        "saturation"]
    weights = {"brightness": 1, "ssim": 0}
    assert [n for _, n in warnings_over(history({"reward_mean": up, "reward/ssim": down}, 100), weights)] == [
        "agreement/ssim"]
    assert warnings_over(history({"reward_mean": down, "reward/ssim": down}, 100), weights) == []  # both fall
    assert warnings_over(history({"reward_mean": up, "reward/ssim": up}, 100), weights) == []  # both rise
    assert warnings_over(history({"reward_mean": up, "monitor/saturation": down}, 100), threshold=0) == []


def test_eval_check():
    """At an evaluation: a measured-only eval reward that fell by 6 standard errors of the difference (sqrt 2 times
    the first evaluation's) while the trained total rose by one warns, once; one that fell less, a --reward term, or a
    total that did not rise, do not."""
    first = {"step": 0, "eval": True, "eval/reward": 0.5, "eval/shapes_exact": 0.5, "eval/ssim": 0.5,
             "eval/monitor/se/reward": 0.01, "eval/monitor/se/shapes_exact": 0.01, "eval/monitor/se/ssim": 0.01}
    later = {**first, "step": 50, "eval/reward": 0.7, "eval/shapes_exact": 0.38, "eval/ssim": 0.3}
    weights = {"brightness": 1.0, "ssim": 0.0}  # ssim: a --reward term (measured each step), not an eval reward
    assert monitor.eval_check([first, later], weights, 6) == [("shapes_exact", pytest.approx(-0.12 / 0.01 / 2 ** 0.5))]
    assert monitor.eval_check([first, {**later, "eval/shapes_exact": 0.45}], weights, 6) == []  # -3.5
    assert monitor.eval_check([first, {**later, "eval/reward": 0.51}], weights, 6) == []  # the total rose by 0.7
    warned = {**later, "eval/monitor/warning/shapes_exact": -8.5}
    assert monitor.eval_check([first, warned, {**later, "step": 100}], weights, 6) == []


def test_extreme():
    """The picture to look at: the brightest when brightness rose, the darkest when it fell; the group whose pictures
    are closest for diversity; for agreement the sample the trained reward ranks furthest above the measured one (a
    non-finite one never)."""
    groups = [torch.cat([picture([0.2] * 3), picture([0.9] * 3)]), torch.cat([picture([0.5] * 3), picture([0.5] * 3)])]
    assert monitor.extreme(groups, "brightness", +7.0, None, {}) == (0, 1)
    assert monitor.extreme(groups, "brightness", -7.0, None, {}) == (0, 0)
    assert monitor.extreme(groups, "diversity", -7.0, None, {}) == (1, 0)
    reward = torch.tensor([[0.9, 0.1], [0.5, float("nan")]])
    measured = torch.tensor([[0.1, 0.9], [0.5, -5.0]])
    assert monitor.extreme(groups, "agreement/ssim", -7.0, reward, {"ssim": measured}) == (0, 0)


def brightness_reward(images: torch.Tensor, example: dict) -> torch.Tensor:
    """A hackable reward: the pictures' mean brightness."""
    return images.mean(dim=(1, 2, 3))


def test_warning_in_a_run(tmp_path, monkeypatch, capsys):
    """A 6-step tiny run trained on brightness, the base 1 step, the spread 2 and the window 2, at a low threshold:
    the warning is one line naming the signal, the step, its z and the grid of the group to look at, which exists; the
    metrics line holds the z; the summary names the warning; the step's signals are logged at every step."""
    monkeypatch.setattr(monitor, "BASE", 2)
    monkeypatch.setattr(monitor, "FIRST", 1)
    monkeypatch.setattr(monitor, "WINDOW", 2)
    monkeypatch.setitem(grpo.REWARDS, "brightness", brightness_reward)
    prompts = write_example(tmp_path, ["a gray square | t.png"])
    out = tmp_path / "run"
    grpo.main([*TINY, "--prompts", str(prompts), "--out", str(out), "--steps", "6", "--reward", "brightness=1,ssim=0",
               "--lr", "3e-3", "--monitor-threshold", "0.5", "--image-every", "0", "--before-after", "0"])
    err = capsys.readouterr()
    lines = run_record(out)
    assert all(f"monitor/{name}" in line for line in lines for name in [*monitor.PICTURE, "diversity"])
    warned = [(line["step"], key.removeprefix("monitor/warning/"), value) for line in lines for key, value in
              line.items() if key.startswith("monitor/warning/")]
    assert warned and all(step >= 2 and abs(z) >= 0.5 for step, _, z in warned)
    step, name, z = warned[0]
    printed = [line for line in err.err.splitlines() if line.startswith(f"warning: step {step}: monitor: ")]
    assert len(printed) >= 1 and f"{z:+.1f} spreads" in "\n".join(printed)
    picture = out / "images" / f"monitor_{step:05d}_{name.replace('/', '_')}.png"
    assert picture.is_file() and str(picture) in "\n".join(printed)
    assert "monitor: " in err.out and f"{name} at step {step}" in err.out  # the summary
