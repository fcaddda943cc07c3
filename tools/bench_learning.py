"""Does GRPO make the tiny model draw better, and does it keep its pictures diverse? Held-out accuracy and layout
diversity before and after, per setting, over seeds.

  OMP_NUM_THREADS=2 python tools/bench_learning.py                        # every row, 3 seeds (~3 h on 2 cores, alone)
  OMP_NUM_THREADS=2 python tools/bench_learning.py --rows default --seeds 0 1 2
  python tools/bench_learning.py --rows default --seeds 5 -- --lr 2e-4    # extra grpo.py flags after --
  python tools/bench_learning.py --table                                  # the table of the runs recorded so far
  python tools/bench_learning.py --optimum inf 0.1 0.03                   # where the KL-regularised optimum lies
  python tools/bench_learning.py --optimum inf 0.1 --captions training    # ... on 161 training captions, then:
  python tools/bench_learning.py --gap docs/gap.png                       # each run's KL(pi || G), from its record
  OMP_NUM_THREADS=2 python tools/bench_learning.py --demos ssim           # the SSIM demo (prompts.txt), 3 seeds
  OMP_NUM_THREADS=2 python tools/bench_learning.py --demos edit           # the editing demo, 3 seeds

shapes: each row trains `grpo.py --reward shapes --prompts examples/shapes.txt` (GRPO's 643 training captions) for
--steps steps with the row's flags, and grpo.py's own evaluation (--eval-prompts examples/shapes_heldout.jsonl
--eval-samples 8 --eval-reward shapes_exact, fixed seeds) reads the 161 held-out captions (combinations never seen in
pre-training or in GRPO training) before and after: "fully right" is the share of (caption, sample) pairs the shapes
reward scores 1; "distinct layouts" the mean number of different large grids (a cell per token: the layout) among a
caption's 8 samples over the 139 captions that leave the place free; "one layout" the share of those drawn the same
way 8 times. Also the training minutes (evaluation excluded) and the share of the loss's tokens whose trained
distribution is one code (no gradient: --policy-dist truncated with top-p). The rejection-sampling row is
tools/rejection_sampling.py (fine-tuning on each group's best sample) with the same samples. A run longer than one
already in the runs folder with the same row, flags, seed and settings continues it from its end checkpoint (a copy;
--resume trains on as one run of the new length would) and records which run it continued.

Each run appends one line to --results (default docs/records/bench_learning.jsonl, beside the docs that quote it), so rows can be run one at a time and the
table printed from all of them. Run it alone: two CPU-heavy processes on 2 cores slow each other down many times.
"""

import argparse
import dataclasses
import json
import math
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # grpo.py and the files it imports live in the repository root

import grpo  # noqa: E402
from helpers import trainer, user_input  # noqa: E402
from helpers import run  # noqa: E402
from helpers import variants  # noqa: E402
from helpers import world  # noqa: E402
from helpers.rewards import shapes_reward  # noqa: E402
from tools import rejection_sampling  # noqa: E402

# the rows of the table: a name, what it is, and the grpo.py flags it adds to the tiny defaults
ROWS = {
    "beta0": ("GRPO without the KL or the diversity bonus", ["--kl-beta", "0", "--diversity", "0"]),
    "kl": ("GRPO with the KL, no diversity bonus", ["--kl-beta", "0.1", "--diversity", "0"]),
    "shaping": ("GRPO with the diversity bonus, no KL", ["--kl-beta", "0", "--diversity", "0.2"]),
    "both": ("GRPO with the KL and the diversity bonus", ["--kl-beta", "0.1", "--diversity", "0.2"]),
    "default": ("GRPO, the tiny defaults (the KL, mu 2, no bonus)", []),
    "rs": ("rejection sampling (best of 8, supervised)", []),
    # issue 35: a code holding more than top-p of the mass is its own nucleus (log pi = 0, no gradient) under the
    # truncated policy; the full softmax corrected by importance weights (TRL's way) still trains it
    "top_p_truncated": ("top-p 0.75 as deployed, --policy-dist truncated", ["--top-p", "0.75", "--policy-dist",
                                                                             "truncated"]),
    "top_p_full": ("top-p 0.75 as deployed, --policy-dist full, --truncation-weight mass",
                   ["--top-p", "0.75", "--policy-dist", "full", "--truncation-weight", "mass"]),
    # issue 46: the full softmax trained on the nucleus' samples, each token weighed by the nucleus' mass (p / q,
    # the row above) or not at all (TRL's and verl's practice, the default since: it kept the layouts)
    "top_p_full_none": ("top-p 0.75, --policy-dist full, --truncation-weight none",
                        ["--top-p", "0.75", "--policy-dist", "full", "--truncation-weight", "none"]),
    # issue 48: accuracy without the collapse. The KL gated to the samples at or above their group's mean (mistakes
    # go free), an entropy bonus on the less certain tokens (EG-GRPO), and the unlikeliness (He et al.): each group's
    # best samples' credit moved toward the least likely of them, on the defaults and in place of the KL. (The bonus
    # to each group's best only, --diversity-to best, was measured too and removed: its records say so.)
    "kl_gate": ("the KL gated to A >= 0", ["--kl-on", "above_mean"]),
    "entropy": ("an entropy bonus on the less certain tokens", ["--entropy-bonus", "0.02"]),
    "unlikely": ("the unlikeliness in place of the KL", ["--kl-beta", "0", "--unlikeliness", "1"]),
    "unlikely_kl": ("the unlikeliness on the defaults", ["--unlikeliness", "1"]),
    # issue 67: GARDO's three parts as its code does them, alone and whole (reset_freq 15: its code resets when more
    # than 15 epochs have passed, every 16th), and DiverseGRPO's
    # cluster bonus (grids differing in at most 1 of the 9 cells share a cluster; the bonus to each group's best)
    "gardo_div": ("GARDO's diversity factor on the codes", ["--gardo-diversity", "tokens"]),
    "gardo_gate": ("GARDO's uncertainty-gated KL (size as the second reward)",
                   ["--kl-on", "uncertain", "--reward", "shapes=1,size=0"]),
    "gardo_reset": ("GARDO's reference reset every 16 steps", ["--reference-reset-every", "16"]),
    "gardo": ("GARDO whole: the three parts", ["--gardo-diversity", "tokens", "--kl-on", "uncertain", "--reward",
                                               "shapes=1,size=0", "--reference-reset-every", "16"]),
    "clusters": ("DiverseGRPO's cluster bonus on the best", ["--cluster-bonus", "0.2"]),
    # issue 87: the objective whose optimum is known (tools/bandit.py). The KL in the reward, R - beta log(pi / ref)
    # with the group's mean as baseline, whose fixed point is G = ref exp(R / beta) / Z; MARA on it, tau 1 (the fully
    # right pictures share the likeliest one's mass); centred (Dr. GRPO's R - mean) and z-scored (the flag's default)
    "kl_reward": ("the KL in the reward (R - beta log(pi / ref), R - mean)", ["--kl-in-reward", "--scale-rewards",
                                                                            "none"]),
    "kl_reward_z": ("the KL in the reward, z-scored", ["--kl-in-reward"]),
    "mara": ("MARA (tau 1) with the KL in the reward, z-scored", ["--kl-in-reward", "--mara-threshold", "1"]),
}  # every GRPO row has the tiny defaults' mu 2 (the clip acts); rows of other flags come from `-- flags`
HELD_OUT = ["--eval-prompts", str(ROOT / "examples" / "shapes_heldout.jsonl"), "--eval-every", "0",
            "--eval-samples", "8", "--eval-reward", "shapes_exact"]


def shapes_accuracy(pipe, captions: list[str], samples: int = 8, seed: int = 0, cfg: grpo.Config | None = None) -> dict:
    """`samples` images per caption (the sampling seed fixed per caption), through grpo.sample_groups and
    grpo.decode_images at cfg's settings (default: the tiny model's), scored by the shapes reward ->
    {"accuracy": fraction drawn fully right, "reward": mean score, and the accuracy of each caption kind}. The quick
    reader of tools/train_tiny.py's report and tools/bench_kl_cap.py; the table below reads grpo.py's own evaluation."""
    cfg = cfg or trainer.parse_config(grpo, ["--model", "tiny"])
    right, scores, kinds = [], [], []
    for i, caption in enumerate(captions):
        with torch.no_grad():
            rollout, = trainer.sample_groups(grpo, pipe, [caption], samples, cfg.height, cfg.width,
                                             cfg.temperature, [seed * 1_000_003 + i], top_k=cfg.top_k, top_p=cfg.top_p)
            images = grpo.decode_images(pipe, caption, rollout.tokens, rollout.prompt.large_hw, cfg.height, cfg.width,
                                        cfg.num_inference_steps, cfg.decode_seed, cfg.guidance_scale)
        score = shapes_reward(images, {"prompt": caption})
        right += (score == 1).tolist()
        scores += score.tolist()
        kinds += [world.parse_caption(caption)["kind"]] * samples
    per_kind = {k: float(np.mean([r for r, kk in zip(right, kinds) if kk == k])) for k in world.KINDS if k in kinds}
    return {"accuracy": float(np.mean(right)), "reward": float(np.mean(scores)), **per_kind}


def held_out_captions() -> list[str]:
    """The 161 held-out captions in world.caption_split()'s order (examples/shapes_heldout.jsonl holds the same ones,
    dealt by kind)."""
    return world.caption_split()[1]


def layout_ceiling(k: int = 8) -> float:
    """The most distinct layouts of k a policy that is always right can draw, on the free-place held-out captions:
    uniform over each caption's right layouts (world.valid_scenes), averaged (7.14: "A left of B", 106 of the 139
    captions, has 27 right layouts, 7.04; one object anywhere 9, 5.49)."""
    free = [c for c in held_out_captions() if world.parse_caption(c)["kind"] != "position"]
    return float(np.mean([world.expected_distinct(world.valid_scenes(c), k) for c in free]))


def trained_pipe(out: Path):
    """The tiny pipeline with the AR of a run's final/ (full fine-tuning)."""
    from transformers import GlmImageForConditionalGeneration
    pipe = grpo.load_glm_image("tiny")
    pipe.vision_language_encoder.load_state_dict(GlmImageForConditionalGeneration.from_pretrained(out / "final")
                                                 .state_dict())
    return pipe


def run_shapes(row: str, seed: int, steps: int, extra: list[str], runs: Path) -> dict:
    """One training run of `row` with `seed` (kept in runs/<row>-seed<seed>: metrics, curves, final weights, the
    before/after grid); its held-out numbers before and after, read from its eval lines."""
    train = rejection_sampling.main if row == "rs" else grpo.main
    name = "_".join([row, *(x.lstrip("-") for x in extra), f"seed{seed}"])
    out = runs / "_".join([name, *([f"{steps}steps"] * (steps != 400))])
    argv = ["--prompts", str(ROOT / "examples" / "shapes.txt"), "--reward", "shapes=1", "--steps", str(steps),
            "--seed", str(seed), "--out", str(out), "--overwrite", "--image-every", "0", "--save-every", "400",
            *HELD_OUT, *ROWS[row][1], *extra]
    shorter = shorter_run(runs, name, steps) if train is grpo.main else None
    if shorter and not same_settings(shorter[0], argv):
        print(f"{out.name}: {shorter[0].name} was trained with other settings (or a rate that spans its steps): "
              "a fresh run", flush=True)
        shorter = None
    if shorter:  # the same run, done to fewer steps: continue it (--resume goes on as one run of this length would)
        earlier, done = shorter
        print(f"{out.name}: continues {earlier.name} from its step {done} (a copy)", flush=True)
        shutil.rmtree(out, ignore_errors=True)
        shutil.copytree(earlier, out)
    start = time.perf_counter()
    train(["--resume", str(out), "--steps", str(steps)] if shorter else argv)
    seconds = time.perf_counter() - start
    lines = run.read_metrics(out)
    cfg = trainer.parse_config(grpo, argv)
    settings = {k: getattr(cfg, k) for k in ("kl_beta", "mu", "diversity", "lr", "top_p", "policy_dist",
                                             "scale_rewards", "truncation_weight", "kl_on", "entropy_bonus",
                                             "unlikeliness", "gardo_diversity", "cluster_bonus", "cluster_radius",
                                             "reference_reset_every", "reward", "kl_in_reward", "mara_threshold")}
    evals, training = [x for x in lines if x.get("eval")], [x for x in lines if not x.get("eval")]

    def held_out(x):
        return {"right": x["eval/shapes_exact"], "layouts": x["eval/distinct_layouts"], "one": x["eval/one_layout"],
                **{k[len("eval/shapes_exact/"):]: v for k, v in x.items() if k.startswith("eval/shapes_exact/")}}
    return {"row": row, "seed": seed, "steps": steps, "flags": ROWS[row][1] + extra, "settings": settings,
            **({"continued_from": {"run": shorter[0].name, "step": shorter[1]}} if shorter else {}),  # its minutes:
            # the steps after that one only, so the table leaves them out
            "before": held_out(evals[0]),
            "after": held_out(evals[-1]),
            "minutes": (seconds - sum(x["sec_eval"] for x in evals if x["step"] > (shorter[1] if shorter else -1))) / 60,
            "no_gradient": float(np.mean([x.get("no_gradient_frac", 0.0) for x in training])),
            "kl": float(np.mean([x["kl"] for x in training[-50:]])),
            "clip_frac_max": max(x["clip_frac"] for x in training), "threads": torch.get_num_threads(),
            "curves": {k: [round(float(np.nanmean([x.get(k, np.nan) for x in training[i:i + 50]])), 4)
                           for i in range(0, len(training), 50)]
                       for k in ("entropy", "kl", "zero_std_groups", "reward_mean", "distinct_in_group",
                                 "kl_in_reward/penalty", "mara/augmented_share", "mara/anchor_reward", "preview/kl")
                       if any(k in x for x in training)}}  # 50-step means


def shorter_run(runs: Path, name: str, steps: int) -> tuple[Path, int] | None:
    """The longest run of `name` (the same row, flags and seed) in `runs` that saved a checkpoint at its end and did
    fewer than `steps` steps, as (its folder, its steps); None if there is none."""
    found = []
    for folder in runs.glob(name + "*"):
        match = re.fullmatch(re.escape(name) + r"(?:_(\d+)steps)?", folder.name)  # a 400-step run has no suffix
        done = int(match.group(1) or 400) if match else 0
        if 0 < done < steps and (folder / "checkpoints" / f"step-{done}").is_dir():
            found.append((done, folder))
    if not found:
        return None
    done, folder = max(found)
    return folder, done


def same_settings(folder: Path, argv: list[str]) -> bool:
    """Whether the run in `folder` trained with `argv`'s settings, its length and place aside, at a constant rate: a
    --resume to more steps then trains as one run of that length would (weights, optimizer, generators, variants'
    state and the prompts' order are in its checkpoint)."""
    saved = json.loads((folder / "config.json").read_text())
    cfg = trainer.parse_config(grpo, argv)
    wanted, unset = (json.loads(json.dumps(dataclasses.asdict(c))) for c in (cfg, type(cfg)()))
    free = {"out", "resume", *run.RESUMABLE}  # what --resume may change: the length, bookkeeping
    # a setting added since the run was saved: that run had it at its default (off), as --resume reads it
    return saved.get("lr_scheduler") == "constant" and not set(saved) - set(wanted) - free and \
        all(saved.get(k, unset[k]) == v for k, v in wanted.items() if k not in free)


def describe(r: dict) -> tuple:
    """A run's setting: the settings it recorded, else its flags over today's defaults (a later flag wins)."""
    fields = {f.name for f in dataclasses.fields(trainer.parse_config(grpo, ["--prompts", "x"]))}  # the variants' too
    if "settings" in r:  # a setting since removed (diversity_to) is named below, not looked up
        cfg = dataclasses.replace(trainer.parse_config(grpo, ["--prompts", "x"]),
                                  **{k: v for k, v in r["settings"].items() if k in fields})
    else:  # an older record: its flags over today's defaults (a later flag wins, as on the command line)
        cfg = trainer.parse_config(grpo, ["--prompts", "x", *r["flags"]])
    share = r.get("share")  # an earlier variant, tried and not kept: positive advantages divided by c^share
    if r["row"] == "rs":
        return ("rejection sampling: fine-tuning on each group's best sample (mu 1, no KL)",)
    parts = [f"beta {cfg.kl_beta:g}", f"mu {cfg.mu}"]
    best = r.get("settings", {}).get("diversity_to") == "best"  # issue 48's --diversity-to best, since removed
    parts += [f"diversity bonus {cfg.diversity:g}" + (" to each group's best (removed)" if best else "")
              ] if cfg.diversity else []
    parts += ["the KL gated to A >= 0 (--kl-on above_mean)"] if cfg.kl_on == "above_mean" else []
    aux = ", ".join(variants.auxiliary(cfg.reward))
    whole = cfg.kl_on == "uncertain" and cfg.gardo_diversity != "none" and cfg.reference_reset_every
    parts += [f"GARDO whole (beside {aux}, {cfg.gardo_diversity}, reset every {cfg.reference_reset_every})"
              ] if whole else []
    parts += [f"GARDO's uncertainty-gated KL (beside {aux})"] if cfg.kl_on == "uncertain" and not whole else []
    parts += [f"GARDO's diversity factor ({cfg.gardo_diversity})"] if cfg.gardo_diversity != "none" and not whole else []
    parts += [f"reference reset every {cfg.reference_reset_every}"] if cfg.reference_reset_every and not whole else []
    parts += [f"cluster bonus {cfg.cluster_bonus:g} (radius {cfg.cluster_radius:g})"] if cfg.cluster_bonus else []
    parts += [r["note"]] if r.get("note") else []
    parts += [f"entropy bonus {cfg.entropy_bonus:g}"] if cfg.entropy_bonus else []
    parts += [f"unlikeliness {cfg.unlikeliness:g}" + (f" {r['variant']}" if r.get("variant") else "")
              ] if cfg.unlikeliness else []
    parts += [f"positive advantages / c^{share:g} (a variant, not kept)"] if share else []
    parts += [f"MARA (tau {cfg.mara_threshold:g})"] if cfg.mara_threshold is not None else []
    parts += ["the KL in the reward"] if cfg.kl_in_reward else []
    parts += [f"--scale-rewards {cfg.scale_rewards}"] if cfg.scale_rewards != "group" else []
    parts += [f"top-p {cfg.top_p:g}, --policy-dist {cfg.policy_dist}"] if cfg.top_p < 1 else []
    if cfg.top_p < 1 and cfg.policy_dist == "full":  # before issue 46 the mass weighed the surrogate only
        parts += [f"--truncation-weight {r['settings'].get('truncation_weight', 'mass (surrogate only)')}"]
    parts += [f"lr {cfg.lr:g}"] if cfg.lr != grpo.Config().lr else []
    return ("GRPO, " + ", ".join(parts),)


def table(results: list[dict]) -> str:
    """One row per setting (the mean over its seeds, each seed's value in brackets), the pre-trained model first. A
    row marked * is transcribed from the docs' earlier table (its runs' records were not kept: no minutes)."""
    groups = {}
    for r in results:
        groups.setdefault((*describe(r), r["steps"]), []).append(r)
    lines = ["| setting | seeds | held-out fully right | distinct layouts of 8 (free place) | captions with one layout "
             "| no-gradient tokens | training min |", "|---|---|---|---|---|---|---|"]
    base = results[0]["before"] if results else None
    if base:
        lines.append(f"| pre-trained tiny model | - | {base['right']:.3f} | {base['layouts']:.2f} | {base['one']:.1%} "
                     "| - | - |")
    lines.append(f"| ceiling: every sample right, uniform over the right layouts | - | 1.000 | {layout_ceiling():.2f} "
                 "| 0.0% | - | - |")
    for (name, steps), rs in sorted(groups.items(), key=lambda kv: -np.mean([r["after"]["right"] for r in kv[1]])):
        def cell(f, fmt):
            values = [f(r) for r in rs]
            return f"{fmt(np.mean(values))} ({', '.join(fmt(v) for v in values)})" if len(rs) > 1 else fmt(values[0])
        lines.append(f"| {name}, {steps} steps{' *' * any('transcribed' in r for r in rs)} | {', '.join(str(r['seed']) for r in rs)} | "
                     f"{cell(lambda r: r['after']['right'], '{:.3f}'.format)} | "
                     f"{cell(lambda r: r['after']['layouts'], '{:.2f}'.format)} | "
                     f"{cell(lambda r: r['after']['one'], '{:.1%}'.format)} | "
                     f"{np.mean([r['no_gradient'] for r in rs]):.1%} | {minutes(rs)} |")
    return "\n".join(lines)


def minutes(rs: list[dict]) -> str:
    """The mean training minutes of runs, "-" where no record has them: transcribed ones, continued ones (their
    minutes count only the steps after the run they continued) and ones that shared the CPU (their "shared_cpu")."""
    known = [r["minutes"] for r in rs if r.get("minutes") is not None and "continued_from" not in r
             and "shared_cpu" not in r]
    return f"{np.mean(known):.1f}" if known else "-"


def frontier(results: list[dict], path: Path) -> None:
    """Held-out fully right against distinct layouts, one point per setting (its seeds' mean, their range as
    error bars; filled: 3 seeds, hollow: a one-seed screen), the pre-trained model and issue 48's goal marked: where
    the accuracy / diversity trade-off lies. Runs of other lengths than 400 steps carry their steps in the label and
    beside their point."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    groups = {}
    for r in results:
        if r.get("note"):  # a run its setting's later runs replace (its note says why)
            continue
        name = "rejection sampling" if r["row"] == "rs" else describe(r)[0].removeprefix("GRPO, ")
        groups.setdefault(name + ("" if r["steps"] == 400 else f", {r['steps']} steps"), []).append(r)
    fig, ax = plt.subplots(figsize=(13, 6.5))
    base = results[0]["before"]
    ax.plot(base["layouts"], base["right"], "k*", ms=12, label="pre-trained")
    ax.add_patch(plt.Rectangle((6.0, 0.9), 2.0, 0.1, color="green", alpha=0.15, label="goal (>= 90%, >= 6.0)"))
    ceiling = layout_ceiling()
    ax.axvline(ceiling, color="green", ls="--", lw=1, label=f"always right: at most {ceiling:.2f} layouts")
    top_p = [r for r in results if r["settings"].get("top_p", 1.0) < 1] if "settings" in results[-1] else []
    if top_p:  # sampled at top-p as deployed: another base model distribution
        ax.plot(top_p[0]["before"]["layouts"], top_p[0]["before"]["right"], "k*", ms=12, mfc="none",
                label="pre-trained, sampled at top-p 0.75")
    styles = iter([(m, c) for m in "osD^vP" for c in plt.cm.tab10.colors])  # 60 settings before one repeats
    defaults = describe({"row": "default", "settings": {}})[0].removeprefix("GRPO, ")
    for name, rs in sorted(groups.items(), key=lambda kv: (len(kv[1]) == 1, kv[0])):  # 3 seeds first
        marker, colour = ("X", "black") if name == "rejection sampling" else next(styles)
        if name == defaults:
            marker, colour, name = "*", "red", name + ": the tiny defaults"
        x = np.array([r["after"]["layouts"] for r in rs])
        y = np.array([r["after"]["right"] for r in rs])
        label = f"{name} ({len(rs)} seed{'s' if len(rs) > 1 else ''})"
        if rs[0]["steps"] != 400:  # a longer (or shorter) run: its steps beside the point too
            ax.annotate(f"{rs[0]['steps']} steps", (x.mean(), y.mean()), xytext=(6, 5), textcoords="offset points",
                        fontsize=7, color=colour)
        if len(rs) == 1:  # a screen: no range to show
            ax.plot(x, y, marker, ms=7, color=colour, mfc="none", mew=1.5, label=label)
            continue
        ax.errorbar(x.mean(), y.mean(), xerr=[[x.mean() - x.min()], [x.max() - x.mean()]],
                    yerr=[[y.mean() - y.min()], [y.max() - y.mean()]], fmt=marker, ms=7, color=colour,
                    capsize=3, label=label)
    ax.set_xlabel("distinct layouts of 8 samples, free-place held-out captions")
    ax.set_ylabel("held-out pictures fully right")
    ax.set_xlim(1.8, 8)
    ax.set_ylim(0.45, 1.0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6.5, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.set_title("GRPO on the tiny model, 400 steps of --reward shapes (other lengths: marked)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"frontier: {path}")


def evaluation_draws(out: Path | None, rewards: str, samples: int, examples: list | None = None) -> tuple:
    """Captions drawn through grpo.py's own evaluation (run.evaluate: `samples` a caption, seed EVAL_SEED + i) by a
    run's final/ weights (None: the pre-trained model), scored by `rewards` (--reward's syntax). `examples`:
    user_input.read_prompts's examples (default: the 161 held-out captions, examples/shapes_heldout.jsonl) -> (the
    examples, the (P, K) total reward, each reward's (P, K), each caption's K large grids as tuples)."""
    pipe = grpo.load_glm_image("tiny") if out is None else trained_pipe(out)
    cfg = trainer.parse_config(grpo, ["--model", "tiny"])
    if examples is None:
        examples = user_input.read_prompts(str(ROOT / "examples" / "shapes_heldout.jsonl"))
    rollouts = []  # the evaluation's draws, kept for their grids

    def sample_groups(*args, **kwargs):
        rollouts.extend(drawn := trainer.sample_groups(grpo, *args, **kwargs))
        return drawn
    seeds = [run.EVAL_SEED + i for i in range(len(examples))]
    scoring = user_input.parse_rewards(rewards, trainer.reward_table(grpo))
    _, total, each, _ = run.evaluate(pipe, examples, seeds, scoring, samples, cfg,
                                     (sample_groups, grpo.decode_images, grpo.group_rewards))
    grids = [[tuple(g) for g in ro.tokens[:, -math.prod(ro.prompt.large_hw):].tolist()] for ro in rollouts]
    return examples, total, each, grids


def training_captions(count: int = 161, seed: int = 0) -> list[dict]:
    """`count` of GRPO's 643 training captions (examples/shapes.txt), drawn without replacement with `seed` and kept
    in the file's order: a sample of the captions a run trains on (without --shuffle, the tiny default, in the
    file's order: a 50-step window's 100 captions are not this sample's mix)."""
    examples = user_input.read_prompts(str(ROOT / "examples" / "shapes.txt"))
    keep = sorted(np.random.default_rng(seed).choice(len(examples), size=count, replace=False).tolist())
    return [examples[i] for i in keep]


def layout_reading(out: Path | None) -> dict:
    """Where a run's distinct layouts come from: its final/ weights (None: the pre-trained model) draw the held-out
    captions through grpo.py's own evaluation (run.evaluate: examples/shapes_heldout.jsonl, K = 8, seed EVAL_SEED + i,
    so the samples of its last evaluation), and each free-place caption's distinct large grids are split into those
    of right pictures and those of wrong ones (a wrong picture is usually a layout of its own, so mistakes raise the
    count). Returns the means over the free-place captions: "layouts" (the eval's number), "right_layouts",
    "wrong_layouts", "right" (the share fully right), and the relation captions' ("relation/...")."""
    examples, right, _, grids = evaluation_draws(out, "shapes_exact", 8)
    rows = [(ex, ok == 1.0, g) for ex, ok, g in zip(examples, right, grids)]
    free = [row for row in rows if row[0].get("free_layout", True) is not False]

    def means(chosen):
        return {"layouts": float(np.mean([len(set(g)) for _, _, g in chosen])),
                "right_layouts": float(np.mean([len({x for x, ok in zip(g, r) if ok}) for _, r, g in chosen])),
                "wrong_layouts": float(np.mean([len({x for x, ok in zip(g, r) if not ok}) for _, r, g in chosen])),
                "right": float(np.mean([r.float().mean().item() for _, r, _ in chosen]))}
    relation = [x for x in free if x[0].get("category") == "relation"]
    return {**means(free), **{f"relation/{k}": v for k, v in means(relation).items()},
            "all_right": float(np.mean([r.float().mean().item() for _, r, _ in rows]))}


def optimum_reading(betas: list[float], samples: int = 32, captions: str = "held-out") -> dict:
    """Where the KL-regularised objective's optimum G = ref exp(R / beta) / Z lies, for each beta, estimated from the
    pre-trained model's own draws: `samples` a caption through grpo.py's evaluation (seed EVAL_SEED + i), R the shapes
    reward as trained (partial credit, fully right 1.0), on the 161 held-out captions or (`captions` "training") 161
    of the training captions (training_captions). Self-normalised importance sampling: G / ref is exp(R / beta) / Z,
    so a caption's draws weigh softmax(R / beta). Per beta: "right", G's share fully right (over all the captions);
    "layouts", the expected distinct large grids of 8 draws from G, the sum over the grids drawn of 1 - (1 - p)^8,
    over the free-place captions (grids the draws missed count nothing: a low estimate; beta inf is the reference's
    own, measured by the held-out evaluation's 8 draws as 7.64); "objective", G's value of E[R] - beta KL(pi || ref)
    (objective_gap reads it). A caption whose right pictures the reference draws less than about 1 / `samples` of the
    time has none among its draws: G's right share and its objective are then low estimates too. Returns {"samples",
    "captions", "large_tokens" (a picture's large grid: the sum the KL is over), "betas": [{"beta" (None: inf),
    "right", "layouts", "objective"}]}."""
    examples = training_captions() if captions == "training" else None
    examples, reward, each, grids = evaluation_draws(None, "shapes=1,shapes_exact=0", samples, examples)
    free = torch.tensor([ex.get("free_layout", world.parse_caption(ex["prompt"])["kind"] != "position") is not False
                         for ex in examples])
    return {"samples": samples, "captions": captions, "large_tokens": len(grids[0][0]),
            "betas": optimum_of_draws(reward, each["shapes_exact"], grids, free, betas)}


def optimum_of_draws(reward: torch.Tensor, right: torch.Tensor, grids: list[list[tuple]], free: torch.Tensor,
                     betas: list[float]) -> list[dict]:
    """optimum_reading's estimate from the reference's draws: (P, S) rewards, (P, S) 1.0 where fully right, each
    draw's large grid, (P,) bool the free-place captions -> per beta {"beta" (None: inf), "right", "layouts",
    "objective"}. The objective at G is beta log Z, Z = E_ref[exp(R / beta)] (put pi = G in E_pi[R] - beta
    E_pi[log(pi / ref)]), estimated by beta (logsumexp(R / beta) - log S) a caption, averaged; at beta inf, E_ref[R]."""
    readings = []
    for beta in betas:
        weights = torch.softmax(reward / beta, dim=-1)  # (P, samples): G's mass on each draw, within its caption
        layouts = []
        for w, g in zip(weights[free], [g for g, keep in zip(grids, free) if keep]):
            mass = {}
            for grid, p in zip(g, w.tolist()):
                mass[grid] = mass.get(grid, 0.0) + p
            layouts.append(sum(1 - (1 - p) ** 8 for p in mass.values()))
        log_z = torch.logsumexp(reward / beta, dim=-1) - math.log(reward.shape[1])  # (P,)
        readings.append({"beta": None if math.isinf(beta) else beta, "layouts": float(np.mean(layouts)),
                         "right": (weights * right).sum(dim=-1).mean().item(),
                         "objective": reward.mean().item() if math.isinf(beta) else (beta * log_z).mean().item()})
    return readings


def objective_gap(curves: dict, beta: float, tokens: int, optimum: float) -> list[float]:
    """How far a run's policy is from G, step by step, from its record's 50-step means alone: KL(pi || G) =
    (J(G) - J(pi)) / beta in nats a picture, J(pi) = E_pi[R] - beta KL(pi || ref) (the objective; put G = ref
    exp(R / beta) / Z into KL(pi || G) = E_pi[log(pi / ref)] - E_pi[R] / beta + log Z). E_pi[R]: the training
    reward's mean ("reward_mean", the policy's own samples); KL(pi || ref): `tokens` (the large grid's) times the
    per-token "kl" (the k3 estimate over the loss tokens, a picture's KL by the chain rule); J(G): `optimum`, the
    reference's estimate on the training captions (optimum_reading). `curves`: {"reward_mean": [...], "kl": [...]}
    -> one KL(pi || G) a window, >= 0 up to the estimates' noise."""
    return [(optimum - (r - beta * tokens * kl)) / beta for r, kl in zip(curves["reward_mean"], curves["kl"])]


GAP_ROWS = ["default", "clusters", "kl_reward", "kl_reward_z", "mara"]  # the issue 87 runs and what they are against


def gap_table(results: list[dict], reading: dict, path: Path) -> str:
    """objective_gap for the GAP_ROWS' runs (the longest of each row, flags and seed; the tiny defaults' size), as a
    table of 400-step means (one 50-step window is noisy: k3's tail, a window's 100 captions) with J(pi) over the
    run's last 400 steps, and a figure at `path`: KL(pi || G) against the step, 200-step means, a line a run. The
    reference's own KL(ref || G) = (J(G) - E_ref[R]) / beta is the line the runs start from."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    at = {x["beta"]: x["objective"] for x in reading["betas"]}
    lines = [f"J(G) from {reading['samples']} reference draws a training caption: " + ", ".join(
                 f"beta {x['beta'] or math.inf:g} {x['objective']:.3f}" for x in reading["betas"]), "",
             "| run | seed | steps | KL(pi \\|\\| G), steps 1-400 | 401-800 | 1201-1600 | J(pi), its last 400 steps | "
             "held-out right | layouts |", "|---|---|---|---|---|---|---|---|---|"]
    fig, ax = plt.subplots(figsize=(9, 5))
    colours = dict(zip(GAP_ROWS, plt.cm.tab10.colors))
    longest = {}  # a row, flags and seed's longest run (a 1600-step run holds its first 400 steps)
    for r in results:
        key = r["row"], " ".join(r["flags"]), r["seed"]
        if r["row"] in GAP_ROWS and not r.get("note") and r["steps"] >= longest.get(key, {}).get("steps", 0):
            longest[key] = r
    labelled, betas = set(), set()
    for (row, flags, seed), r in sorted(longest.items()):
        beta = r["settings"]["kl_beta"]
        name = ROWS[row][0] + "".join(f" {x}" for x in r["flags"][len(ROWS[row][1]):])  # with its extra flags
        if beta not in at:
            lines.append(f"| {name} | {seed} | {r['steps']} | (no reading at beta {beta}) |")
            continue
        gap = objective_gap(r["curves"], beta, reading["large_tokens"], at[beta])  # 50-step windows
        betas.add(beta)

        def mean(first, last, values=gap):  # steps first..last, if the run went that far
            return float(np.mean(values[max(0, first) // 50:last // 50])) if len(values) >= last // 50 else None
        shown = [mean(*span) for span in ((0, 400), (400, 800), (1200, 1600))]
        lines.append(f"| {name} | {seed} | {r['steps']} | "
                     + " | ".join("" if x is None else f"{x:.2f}" for x in shown)
                     + f" | {at[beta] - beta * mean(len(gap) * 50 - 400, len(gap) * 50):.3f} | "
                     f"{r['after']['right']:.1%} | {r['after']['layouts']:.2f} |")
        steps = [200 * (i + 1) for i in range(len(gap) // 4)]
        ax.plot(steps, [mean(s - 200, s) for s in steps], color=colours[row], lw=1.2, marker="o", ms=3,
                ls="--" if flags != " ".join(ROWS[row][1]) else "-", label=None if name in labelled else name)
        labelled.add(name)
    for beta in sorted(betas) if None in at else []:  # the reference's own distance from G, from the same draws
        ax.axhline((at[beta] - at[None]) / beta, color="black", ls=":", lw=1, label=f"the reference, beta {beta:g}")
    ax.axhline(0, color="green", ls="--", lw=1, label="at G")
    ax.set_xlabel("step")
    ax.set_ylabel("KL(pi || G), nats a picture (200-step means)")
    ax.set_title("How far each run's large grid is from the optimum G = ref exp(R / beta) / Z given the preview "
                 "(training captions)", fontsize=10)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return "\n".join(lines)


def run_ssim(seed: int, steps: int, extra: list[str]) -> dict:
    """The README's first command with `seed`: grpo.py's summary (first / last training reward, before / after)."""
    with tempfile.TemporaryDirectory() as out:
        start = time.perf_counter()
        summary = grpo.main(["--prompts", str(ROOT / "prompts.txt"), "--steps", str(steps), "--seed", str(seed),
                             "--out", out, "--image-every", "0", *extra])
        lines = run.read_metrics(Path(out))
    return {"seed": seed, **summary, "minutes": (time.perf_counter() - start) / 60,
            "kl_max": max(x["kl"] for x in lines), "clip_frac_max": max(x["clip_frac"] for x in lines)}


EDIT_DEMO = ["--model", "tiny-edit", "--prompts", str(ROOT / "examples" / "edits_train.jsonl"), "--reward", "edit",
             "--prompts-per-step", "4", "--eval-prompts", str(ROOT / "examples" / "edits_heldout.jsonl"),
             "--eval-every", "0", "--eval-samples", "8", "--eval-reward", "edit_exact"]


def run_edit(seed: int, steps: int, extra: list[str], runs: Path) -> dict:
    """The editing demo with `seed` (kept in runs/edit_seed<seed>): held-out edits fully right before and after, in all
    and per kind, read from the run's eval lines."""
    out = runs / f"edit_seed{seed}"
    start = time.perf_counter()
    grpo.main([*EDIT_DEMO, "--steps", str(steps), "--seed", str(seed), "--out", str(out), "--overwrite",
               "--image-every", "0", "--save-every", "0", *extra])
    seconds = time.perf_counter() - start
    lines = run.read_metrics(out)
    evals, training = [x for x in lines if x.get("eval")], [x for x in lines if not x.get("eval")]

    def held_out(x):
        return {"right": x["eval/edit_exact"], "reward": x["eval/edit"],
                **{k[len("eval/edit_exact/"):]: v for k, v in x.items() if k.startswith("eval/edit_exact/")}}
    return {"demo": "edit", "seed": seed, "steps": steps, "flags": extra, "before": held_out(evals[0]),
            "after": held_out(evals[-1]), "minutes": (seconds - sum(x["sec_eval"] for x in evals)) / 60,
            "kl": float(np.mean([x["kl"] for x in training[-50:]])),
            "clip_frac_max": max(x["clip_frac"] for x in training), "threads": torch.get_num_threads(),
            "curves": {k: [round(float(np.mean([x.get(k, np.nan) for x in training[i:i + 50]])), 4)
                           for i in range(0, len(training), 50)]
                       for k in ("entropy", "kl", "zero_std_groups", "reward_mean", "distinct_in_group")}}  # 50-step means


def edit_table(results: list[dict]) -> str:
    """Held-out edits fully right before -> after, per seed and kind, and their mean."""
    kinds = world.EDIT_KINDS
    lines = ["| seed | steps | fully right before | after | " + " | ".join(kinds) + " | training min |",
             "|---|---|---|---|" + "---|" * len(kinds) + "---|"]
    for r in results:
        lines.append(f"| {r['seed']} | {r['steps']} | {r['before']['right']:.3f} | {r['after']['right']:.3f} | "
                     + " | ".join(f"{r['before'][k]:.2f} -> {r['after'][k]:.2f}" for k in kinds)
                     + f" | {r['minutes']:.1f} |")
    if len(results) > 1:
        gain = [r["after"]["right"] - r["before"]["right"] for r in results]
        lines.append(f"| mean | | {np.mean([r['before']['right'] for r in results]):.3f} | "
                     f"{np.mean([r['after']['right'] for r in results]):.3f} (+{100 * np.mean(gain):.1f} points) | "
                     + " | ".join(f"{np.mean([r['before'][k] for r in results]):.2f} -> "
                                  f"{np.mean([r['after'][k] for r in results]):.2f}" for k in kinds)
                     + f" | {np.mean([r['minutes'] for r in results]):.1f} |")
    return "\n".join(lines)


def main() -> None:
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", nargs="+", default=list(ROWS), choices=list(ROWS))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=400, help="GRPO steps of the shapes runs")
    parser.add_argument("--ssim-steps", type=int, default=100, help="GRPO steps of the SSIM demo")
    parser.add_argument("--edit-steps", type=int, default=200, help="GRPO steps of the editing demo")
    parser.add_argument("--demos", nargs="+", default=["shapes"], choices=["shapes", "ssim", "edit"])
    parser.add_argument("--results", type=Path, default=ROOT / "docs" / "records" / "bench_learning.jsonl")
    parser.add_argument("--table", action="store_true", help="only print the table of --results")
    parser.add_argument("--frontier", type=Path, help="also draw accuracy against layouts to this PNG")
    parser.add_argument("--layouts", nargs="+", metavar="RUN", help="split the distinct layouts of runs' final/ (or "
                        "'base') into right and wrong pictures' (layout_reading), into docs/records/bench_layouts.jsonl")
    parser.add_argument("--optimum", nargs="+", type=float, metavar="BETA", help="where G = ref exp(R / beta) / Z "
                        "lies for each BETA (inf: the reference), from 32 draws a held-out caption (optimum_reading), "
                        "into docs/records/bench_optimum.jsonl")
    parser.add_argument("--captions", choices=["held-out", "training"], default="held-out", help="--optimum's "
                        "captions: the 161 held-out ones, or 161 of the training captions (what --gap reads)")
    parser.add_argument("--gap", type=Path, metavar="PNG", help="how far each recorded run's policy is from G "
                        "(objective_gap: KL(pi || G) a picture, step by step, from the records alone), as a table "
                        "and a figure at PNG; needs --optimum's reading on the training captions")
    args = parser.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    run.quiet_libraries()
    if args.optimum and min(args.optimum) <= 0:
        parser.error(f"--optimum {min(args.optimum):g}: each beta weighs the KL and divides the reward; give betas > 0")
    if args.optimum:
        reading = optimum_reading(args.optimum, captions=args.captions)
        with open(args.results.with_name("bench_optimum.jsonl"), "a") as f:
            f.write(json.dumps(reading) + "\n")
        for r in reading["betas"]:
            print(f"beta {r['beta'] or math.inf:g}: G fully right {r['right']:.3f}, distinct layouts of 8 "
                  f"{r['layouts']:.2f}, objective J(G) {r['objective']:.3f}")
        return
    if args.captions != "held-out" and not args.optimum:
        parser.error("--captions chooses --optimum's captions; give --optimum BETA... with it")
    if args.gap:
        if not args.results.exists():
            sys.exit(f"--gap: {args.results} does not exist: it reads the runs recorded there; train some first "
                     "(--rows ...) or give --results")
        optimum = args.results.with_name("bench_optimum.jsonl")
        readings = [json.loads(x) for x in optimum.read_text().splitlines()] if optimum.exists() else []
        readings = [r for r in readings if r.get("captions") == "training"]
        if not readings:
            sys.exit(f"--gap: {optimum} has no reading on the training captions; make one first: python "
                     "tools/bench_learning.py --optimum inf 0.1 --captions training (about 5 min)")
        print(gap_table([json.loads(x) for x in args.results.read_text().splitlines()], readings[-1], args.gap))
        return
    if args.layouts:
        for name in args.layouts:
            reading = layout_reading(None if name == "base" else Path(name))
            with open(args.results.with_name("bench_layouts.jsonl"), "a") as f:
                f.write(json.dumps({"run": name, **reading}) + "\n")
            print(name, {k: round(v, 3) for k, v in reading.items()}, flush=True)
        return
    if "shapes" in args.demos and not args.table:
        args.results.parent.mkdir(parents=True, exist_ok=True)
        for row in args.rows:
            for seed in args.seeds:
                result = run_shapes(row, seed, args.steps, extra, args.results.parent / "bench_learning")
                with open(args.results, "a") as f:
                    f.write(json.dumps(result) + "\n")
                print(f"{row} seed {seed}: held-out fully right {result['before']['right']:.3f} -> "
                      f"{result['after']['right']:.3f}, distinct layouts {result['before']['layouts']:.2f} -> "
                      f"{result['after']['layouts']:.2f}, {result['minutes']:.1f} min", flush=True)
    if "shapes" in args.demos and args.results.exists():
        results = [json.loads(x) for x in args.results.read_text().splitlines()]
        print(f"\ngrpo.py --reward shapes --prompts examples/shapes.txt (tools/bench_learning.py; {args.results})")
        print(table(results))
        if args.frontier:
            frontier(results, args.frontier)
    edits = args.results.with_name("bench_edit.jsonl")  # the editing demo's runs, beside --results
    if "edit" in args.demos and not args.table:
        edits.parent.mkdir(parents=True, exist_ok=True)
        for seed in args.seeds:
            result = run_edit(seed, args.edit_steps, extra, args.results.parent / "bench_learning")
            with open(edits, "a") as f:
                f.write(json.dumps(result) + "\n")
            print(f"edit seed {seed}: held-out edits fully right {result['before']['right']:.3f} -> "
                  f"{result['after']['right']:.3f}, {result['minutes']:.1f} min", flush=True)
    if "edit" in args.demos and edits.exists():
        print(f"\ngrpo.py --model tiny-edit --reward edit --prompts examples/edits_train.jsonl ({edits})")
        settings = {}  # a table per set of extra flags (the demo's own: none)
        for r in map(json.loads, edits.read_text().splitlines()):
            settings.setdefault(" ".join(r["flags"]) or "the tiny defaults", []).append(r)
        for flags, rs in settings.items():
            print(f"\n{flags}:\n{edit_table(rs)}")
    if "ssim" in args.demos and not args.table:
        rows = [run_ssim(seed, args.ssim_steps, extra) for seed in args.seeds]
        print(f"\ngrpo.py --prompts prompts.txt --steps {args.ssim_steps} {' '.join(extra)}")
        print("| seed | reward first steps | last steps | same seeds before | after | max KL | max clip fraction | "
              "minutes |")
        print("|---|---|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['seed']} | {r['reward_first']:.3f} | {r['reward_last']:.3f} | {r['shown_before']:.3f} | "
                  f"{r['shown_after']:.3f} | {r['kl_max']:.4f} | {r['clip_frac_max']:.3f} | {r['minutes']:.1f} |")


if __name__ == "__main__":
    main()
