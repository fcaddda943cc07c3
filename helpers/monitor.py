"""The reward-hacking monitor: signals that need no extra model, logged every step and at every evaluation, and one
warning line when one of them leaves the range the run's first steps set (docs/healthy_training.md, "When the reward
is being gamed"). The run never stops for it.

The signals (each step's mean over its pictures, every process's):
  - picture statistics (picture_signals): brightness, saturation, RMS contrast, high-frequency energy, colourfulness;
  - within-group diversity in pixels (group_diversity): token grids can differ while pictures do not;
  - the agreement of the trained reward with each measured-only one (the --reward terms of weight 0 each step, the
    --eval-reward ones at each evaluation): the trained reward rising while a measured-only one falls.

The rule (check), on each signal's step values (a step's mean over its pictures):
  - the base: the mean of the signal's first FIRST values; its spread: the standard deviation of its step-to-step
    changes over the first BASE steps divided by sqrt 2 (a steady drift hardly moves it: a hack that starts at once
    still leaves the spread its noise), at least FLOOR of the base's distance to its nearer bound (min(b, 1 - b): a
    brightness of 0.95 has 0.05 to move);
  - when prompts come back within the base (a small prompts file: the same prompts make the same kind of pictures,
    and two prompts of a step change its mean far more than training does), all of this is taken per set of the
    step's prompts (its "prompts" field): each set its own base and changes, a step compared with its own set's base;
  - from step BASE on, z = the median over the last WINDOW steps of (value - its base), in spreads (the median: one
    odd step does not warn).
A picture statistic warns when |z| >= the threshold (--monitor-threshold); the diversity when it falls that far
while the token grids' (distinct_in_group's z above -1) do not (with the grids it is the policy settling, which a
reward with one right picture asks for); a measured-only reward when it falls that far while the trained reward rose
by a spread or more. Each signal warns once a run. At an evaluation (the same prompts and seeds each time: only the
weights changed), a measured-only --eval-reward warns when it fell from the first evaluation's by the threshold in
standard errors of the difference (sqrt 2 times the first one's, over its prompts' means) while the trained total
rose by one standard error; the pictures' signals at evaluations are logged, not checked. Everything the rule reads
is in the run's metrics lines, so a resumed run's monitor is the uninterrupted run's, exactly, at the same threshold
(--monitor-threshold may change on resume), and a rule can be replayed on a finished run (tools/bench_monitor.py).

scikit-image (a well-kept library) converts to luma (ITU-R BT.709) and HSV; numpy's FFT measures the spectrum.
"""

import math

import numpy as np
import torch

BASE = 20  # steps that set each signal's spread (its step-to-step changes); checks start after them
FIRST = 3  # values that set each signal's base (a set of prompts' first 3 steps)
WINDOW = 10  # the steps whose median is compared with the base
FLOOR = 0.05  # the smallest spread: 5% of the base's distance to its nearer bound, min(b, 1 - b)
PICTURE = ("brightness", "saturation", "contrast", "high_frequency", "colourfulness")
HIGH = 0.25  # cycles per pixel: the high-frequency band is |f| > HIGH, the upper half of the band to Nyquist (0.5)


def picture_signals(images: torch.Tensor) -> dict[str, np.ndarray]:
    """(N, 3, H, W) pictures in [0, 1] -> {signal: (N,) float64}:
      brightness: the mean luma Y = 0.2125 R + 0.7154 G + 0.0721 B (skimage.color.rgb2gray, ITU-R BT.709), in [0, 1];
      saturation: the mean HSV saturation (max - min) / max (skimage.color.rgb2hsv), in [0, 1];
      contrast: RMS contrast, the standard deviation of the luma (Peli 1990), in [0, 0.5];
      high_frequency: the share of the luma's spectral power (its mean removed) at radial frequencies |f| > 0.25
        cycles per pixel (the spectrum reaches 0.5 along an axis, 0.71 in its corners), in [0, 1]: 0 for a flat
        picture, 0.80 for white noise, 1 for a one-pixel checkerboard;
      colourfulness: Hasler and Suesstrunk's M (2003), sqrt(sd(rg)^2 + sd(yb)^2) + 0.3 sqrt(mean(rg)^2 + mean(yb)^2),
        rg = R - G, yb = (R + G) / 2 - B, on [0, 1] channels (their 0-255 values / 255): >= 0, 0 for a gray picture,
        0.34 for a flat red one, about 1.1 at most (half red, half cyan)."""
    from skimage.color import rgb2gray, rgb2hsv  # scikit-image: imported when a run first measures
    rgb = images.detach().float().clamp(0, 1).permute(0, 2, 3, 1).cpu().numpy().astype(np.float64)  # (N, H, W, 3)
    luma = rgb2gray(rgb)  # (N, H, W)
    flat = luma - luma.mean(axis=(1, 2), keepdims=True)
    power = np.abs(np.fft.fft2(flat)) ** 2  # (N, H, W)
    fy, fx = np.meshgrid(np.fft.fftfreq(luma.shape[1]), np.fft.fftfreq(luma.shape[2]), indexing="ij")
    total = power.sum(axis=(1, 2))
    high = (power * (np.hypot(fy, fx) > HIGH)).sum(axis=(1, 2))
    rg, yb = rgb[..., 0] - rgb[..., 1], (rgb[..., 0] + rgb[..., 1]) / 2 - rgb[..., 2]
    return {"brightness": luma.mean(axis=(1, 2)),
            "saturation": rgb2hsv(rgb)[..., 1].mean(axis=(1, 2)),
            "contrast": luma.std(axis=(1, 2)),
            "high_frequency": np.where(total > 1e-12, high / np.maximum(total, 1e-12), 0.0),
            "colourfulness": np.hypot(rg.std(axis=(1, 2)), yb.std(axis=(1, 2)))
            + 0.3 * np.hypot(rg.mean(axis=(1, 2)), yb.mean(axis=(1, 2)))}


def group_diversity(images: torch.Tensor) -> float:
    """(G, 3, H, W) pictures of one group in [0, 1] -> the mean over its G (G - 1) / 2 pairs of their RMS distance
    sqrt(mean((x_i - x_j)^2)), in [0, 1]: 0 when every picture is the same. NaN for G = 1."""
    flat = images.detach().float().flatten(1).cpu()
    return (torch.pdist(flat) / math.sqrt(flat.shape[1])).mean().item() if len(flat) > 1 else math.nan


def step_signals(images: list[torch.Tensor], gather=lambda t: t) -> dict[str, float]:
    """A step's groups' (G, 3, H, W) pictures -> {"monitor/<signal>": its mean over the step's pictures (diversity: over
    its groups)}, every process's when `gather` is parallel.gather_rows (a process without pictures takes part)."""
    rows = torch.tensor([[float(np.mean(v)) for v in picture_signals(group).values()] + [group_diversity(group)]
                         for group in images], dtype=torch.float64).reshape(-1, len(PICTURE) + 1)  # (P, 6)
    means = gather(rows).nanmean(dim=0).tolist()
    return {f"monitor/{name}": value for name, value in zip([*PICTURE, "diversity"], means)}


def measured_only(weights: dict[str, float]) -> list[str]:
    """The --reward terms of weight 0 (measured, not trained), in their order."""
    return [name for name, weight in weights.items() if weight == 0]


def signals(history: list[dict], weights: dict[str, float]) -> dict[str, tuple[str, str]]:
    """{signal: (its key in a step's metrics line, the direction that warns: "both", "down while tokens hold", "down
    while trained up")}."""
    found = {name: (f"monitor/{name}", "both") for name in PICTURE if f"monitor/{name}" in history[-1]}
    if "monitor/diversity" in history[-1]:
        found["diversity"] = ("monitor/diversity", "down while tokens hold")
    for name in measured_only(weights):
        found[f"agreement/{name}"] = (f"reward/{name}", "down while trained up")
    return found


def prompt_sets(history: list[dict]) -> list[tuple]:
    """Each line's key for the rule: its sorted prompts when the base's prompt sets come back (at least half of the
    first BASE steps in sets seen FIRST times or more, and twice: a set's changes need two), else one key for every
    line."""
    sets = [tuple(sorted(h.get("prompts", ()))) for h in history]
    seen = {s: sets[:BASE].count(s) for s in set(sets[:BASE])}
    return sets if sum(n for n in seen.values() if n >= max(FIRST, 2)) >= BASE / 2 else [()] * len(sets)


def moved(history: list[dict], key: str) -> tuple[float, float, float] | None:
    """(z, base, the window's median value) of `key` at the last line of `history` (the module's rule); None before
    step BASE or without finite values."""
    if len(history) < BASE:
        return None
    sets, values = prompt_sets(history), [h.get(key, math.nan) for h in history]
    by_set = {}
    for s, v in zip(sets[:BASE], values[:BASE]):
        if math.isfinite(v):
            by_set.setdefault(s, []).append(v)
    bases = {s: float(np.mean(v[:FIRST])) for s, v in by_set.items() if len(v) >= FIRST}
    changes = [d for s, v in by_set.items() if s in bases for d in np.diff(v)]
    recent = [(v, v - bases[s]) for s, v in zip(sets[-WINDOW:], values[-WINDOW:]) if s in bases and math.isfinite(v)]
    if not recent or not changes:
        return None
    base = float(np.mean(list(bases.values())))
    spread = max(float(np.std(changes)) / math.sqrt(2), FLOOR * min(abs(base), abs(1 - base)), 1e-12)
    return (float(np.median([d for _, d in recent])) / spread, base,
            float(np.median([v for v, _ in recent])))


def z_score(history: list[dict], key: str) -> float | None:
    """How far `key` has moved from its base at the last line of `history`, in spreads (moved)."""
    found = moved(history, key)
    return None if found is None else found[0]


def check(history: list[dict], weights: dict[str, float], threshold: float) -> tuple[dict, list[str]]:
    """The monitor at the last step of `history` (the run's training metrics lines, oldest first, the last one this
    step's, with its "monitor/..." signals) -> ({"monitor/<signal>/z": z} for every signal past its base, the signals
    that warn now: past `threshold` in their direction and not warned before in the run (a "monitor/warning/<signal>"
    in an earlier line)). `weights`: --reward's {name: weight}. threshold 0: none warns."""
    zs, warn = {}, []
    if not history:
        return zs, warn
    warned = {key.removeprefix("monitor/warning/") for h in history[:-1] for key in h if key.startswith(
        "monitor/warning/")}
    trained, tokens = z_score(history, "reward_mean"), z_score(history, "distinct_in_group")
    for name, (key, direction) in signals(history, weights).items():
        z = z_score(history, key)
        if z is None:
            continue
        zs[f"monitor/{name}/z"] = z
        past = abs(z) >= threshold if direction == "both" else z <= -threshold
        if direction == "down while trained up":
            past = past and trained is not None and trained >= 1
        if direction == "down while tokens hold":
            past = past and (tokens is None or tokens > -1)
        if threshold > 0 and past and name not in warned:
            warn.append(name)
    return zs, warn


def replay(history: list[dict], weights: dict[str, float], threshold: float
           ) -> tuple[list[tuple[int, str, float]], dict[str, float]]:
    """check, step by step, over a finished run's training lines as the run called it (the rule reads only the lines:
    this is what a run with this rule prints, whatever rule the run itself had) -> the warnings [(step, signal, z)] and
    each signal's largest |z|. `history` is left as it was; the warnings the run wrote are not read."""
    lines = [{k: v for k, v in line.items() if not k.startswith("monitor/warning/")} for line in history]
    fired, largest = [], {}
    for t, line in enumerate(lines):
        zs, warn = check(lines[:t + 1], weights, threshold)
        for name in warn:
            line[f"monitor/warning/{name}"] = zs[f"monitor/{name}/z"]
            fired.append((line["step"], name, zs[f"monitor/{name}/z"]))
        for key, z in zs.items():
            signal = key.removeprefix("monitor/").removesuffix("/z")
            largest[signal] = max(largest.get(signal, 0.0), abs(z))
    return fired, largest


def eval_check(evals: list[dict], weights: dict[str, float], threshold: float) -> list[tuple[str, float]]:
    """The monitor at the last evaluation of `evals` (the run's eval lines, oldest first) -> [(reward, z)] for each
    measured-only --eval-reward (every eval reward but the trained total and the --reward terms) whose mean fell from
    the first evaluation's by `threshold` standard errors of the difference (sqrt 2 times "eval/monitor/se/<name>",
    the first evaluation's, at least FLOOR / 10 of its mean) while the trained total rose by one, and that has not
    warned at an earlier evaluation."""
    if len(evals) < 2 or threshold <= 0:
        return []
    first, last = evals[0], evals[-1]
    warned = {key.removeprefix("eval/monitor/warning/") for h in evals[:-1] for key in h
              if key.startswith("eval/monitor/warning/")}

    def z(name: str) -> float:  # the move of eval/<name> in standard errors of the difference
        se = math.sqrt(2) * max(first[f"eval/monitor/se/{name}"], FLOOR / 10 * abs(first[f"eval/{name}"]), 1e-12)
        return (last[f"eval/{name}"] - first[f"eval/{name}"]) / se

    if "eval/monitor/se/reward" not in first or not z("reward") >= 1:
        return []
    found = []
    for key in first:
        name = key.removeprefix("eval/monitor/se/")
        if key == name or name in weights or name == "reward" or name in warned or f"eval/{name}" not in last:
            continue
        if z(name) <= -threshold:
            found.append((name, z(name)))
    return found


def extreme(images: list[torch.Tensor], name: str, z: float, reward: torch.Tensor, each: dict) -> tuple[int, int]:
    """(group, sample) of the picture to look at, among `images` (this process's groups, each (G, 3, H, W)), for
    signal `name` moved by `z`: the picture furthest in the direction it moved (the brightest when brightness rose);
    for diversity the first sample of the group whose pictures are closest; for agreement/<reward> the sample the
    trained reward (`reward`, (P, G)) ranks furthest above that reward (`each[reward]`), both z-scored over the step's
    samples (non-finite ones left out)."""
    if name == "diversity":
        return int(np.nanargmin([group_diversity(group) for group in images])), 0
    if name.startswith("agreement/"):
        def scored(values: torch.Tensor) -> torch.Tensor:
            values = values.detach().double().cpu()
            finite = values[values.isfinite()]
            return (values - finite.mean()) / finite.std().clamp_min(1e-12) if finite.numel() > 1 else values * 0
        gap = scored(reward) - scored(each[name.removeprefix("agreement/")])  # (P, G)
        flat = int(torch.where(gap.isfinite(), gap, -math.inf).argmax())
        return flat // gap.shape[1], flat % gap.shape[1]
    values = [picture_signals(group)[name] for group in images]
    pick = max if z > 0 else min
    return pick(((p, i) for p, v in enumerate(values) for i in range(len(v))), key=lambda pi: values[pi[0]][pi[1]])


def warning_line(name: str, step: int, z: float, record: dict, history: list[dict], picture: str) -> str:
    """The one line a warning prints: the signal, the step, how far it moved (in its spreads), its base and the last
    WINDOW steps' median, and the picture to look at."""
    key = f"reward/{name.removeprefix('agreement/')}" if name.startswith("agreement/") else f"monitor/{name}"
    _, base, recent = moved(history, key)
    what = f"{name.removeprefix('agreement/')} fell while the trained reward rose" if name.startswith(
        "agreement/") else name
    return (f"warning: step {step}: monitor: {what}: {z:+.1f} spreads from its base ({base:.4f} -> {recent:.4f}, the "
            f"median of the last {WINDOW} steps); look at {picture} (docs/healthy_training.md, \"When the reward is "
            "being gamed\"; the run goes on)")


def summary(history: list[dict], evals: list[dict]) -> list[str]:
    """The run's warnings, for its summary: ["brightness at step 43 (+7.2)", ...] in the order they fired."""
    found = [f"{key.removeprefix('monitor/warning/')} at step {h['step']} ({h[key]:+.1f})" for h in history
             for key in h if key.startswith("monitor/warning/")]
    return found + [f"eval {key.removeprefix('eval/monitor/warning/')} at step {h['step']} ({h[key]:+.1f})"
                    for h in evals for key in h if key.startswith("eval/monitor/warning/")]
