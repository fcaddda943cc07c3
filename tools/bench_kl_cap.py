"""What the KL cap does to a run whose policy drifts: grpo.py's cap against verl's and against none (TRL's).

  OMP_NUM_THREADS=2 python tools/bench_kl_cap.py               # 3 variants x 40 steps (5 min on 2 cores)
  OMP_NUM_THREADS=2 python tools/bench_kl_cap.py -- --lr 3e-2   # extra grpo.py flags after --

The k3 estimator exp(x) - x - 1, x = log pi_ref - log pi, explodes when the policy finds a sampled token far less
likely than the reference does (x large). The variants, each the KL term that grpo_loss adds (the rest of the loss is
grpo.py's own, computed by grpo.grpo_loss with beta 0):

  grpo   x clamped to [-20, 20] (grpo.py): exact below the cap; beyond it the value is fixed and the token gets
         no KL gradient
  verl   x clamped to [-20, 20], then the k3 value clamped to [-10, 10] (verl's low_var_kl): no KL gradient once
         a token's estimate passes 10 (x > ~2.6)
  none   no cap (TRL): exp(x) may overflow to inf, and then grpo.py skips the update (non-finite loss)

A deliberately drifting run: the pre-trained tiny model on the shapes captions with a large lr (3e-3: a pre-trained
tiny AR is wrecked within tens of steps at such an lr without a KL term), beta 0.1 and 2 updates per batch. Printed
per variant: the mean reward, KL and zero-spread groups of the last quarter, the largest KL of a step, skipped updates,
and the held-out accuracy of the final weights on 32 held-out captions x 4 samples.

Measured (2026-11-24, 2-core CPU, alone), lr 3e-3 / lr 3e-2: grpo and none were IDENTICAL (the +-20 cap never
acted: the largest step KL was 17.7 / 10.8), verl's clamp acted and did not help (held-out accuracy after 0.000 vs
0.016 / KL of the last quarter 9.76 vs 7.53: it removes the pull-back exactly on the tokens that drifted most).
Every variant wrecked the model at these learning rates; the cap is an overflow guard, not a trust region.
"""

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # grpo.py and the files it imports live in the repository root

import grpo  # noqa: E402
from helpers import run  # noqa: E402
from bench_learning import held_out_captions, shapes_accuracy, trained_pipe  # noqa: E402  (tools/, beside this file)

ORIGINAL = grpo.grpo_loss


def k3(x: torch.Tensor, variant: str) -> torch.Tensor:
    if variant == "none":
        return torch.exp(x) - x - 1
    x = x.clamp(-20.0, 20.0)
    kl = (torch.exp(x) - x - 1).clamp_min(0)
    return kl.clamp(-10.0, 10.0) if variant == "verl" else kl


def loss_with(variant: str):
    """grpo_loss whose KL term is the variant's."""
    def loss_fn(logprobs, old_logprobs, ref_logprobs, advantages, clip_eps, kl_beta):
        loss, metrics = ORIGINAL(logprobs, old_logprobs, None, advantages, clip_eps, 0.0)
        if ref_logprobs is None or kl_beta == 0:
            return loss, metrics
        kl = torch.where(logprobs.isfinite(), k3(ref_logprobs - logprobs, variant), 0.0)
        metrics["kl"] = kl.mean().item()
        return loss + kl_beta * kl.mean(dim=1).mean(), metrics
    return loss_fn


def run_variant(variant: str, steps: int, extra: list[str]) -> dict:
    grpo.grpo_loss = loss_with(variant)
    try:
        with tempfile.TemporaryDirectory() as out:
            grpo.main(["--prompts", str(ROOT / "examples" / "shapes.txt"), "--reward", "shapes", "--steps", str(steps),
                       "--lr", "3e-3", "--kl-beta", "0.1", "--mu", "2", "--out", out, "--image-every", "0",
                       "--before-after", "0", *extra])
            lines = [json.loads(x) for x in (Path(out) / "metrics.jsonl").read_text().splitlines()]
            last = lines[-max(1, steps // 4):]
            accuracy = shapes_accuracy(trained_pipe(Path(out)), held_out_captions()[::5][:32], 4)["accuracy"]
    finally:
        grpo.grpo_loss = ORIGINAL
    return {"variant": variant, "reward": np.mean([x["reward_mean"] for x in last]),
            "kl": np.mean([x["kl"] for x in last]), "kl_max": max(x["kl"] for x in lines),
            "zero_std": np.mean([x["zero_std_groups"] for x in last]), "skipped": lines[-1]["skipped_total"],
            "held_out": accuracy}


def main() -> None:
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--variants", nargs="+", default=["grpo", "verl", "none"])
    args = parser.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    run.quiet_libraries()
    base = shapes_accuracy(grpo.load_glm_image("tiny"), held_out_captions()[::5][:32], 4)["accuracy"]
    rows = [run_variant(v, args.steps, extra) for v in args.variants]
    lr = extra[extra.index("--lr") + 1] if "--lr" in extra else "3e-3"
    print(f"\n{args.steps} steps, lr {lr}, beta 0.1, mu 2; held-out accuracy before: {base:.3f}")
    print("| KL cap | reward (last quarter) | KL (last quarter) | largest KL of a step | zero-spread groups "
          "(of 2) | skipped updates | held-out accuracy after |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['variant']} | {r['reward']:.3f} | {r['kl']:.3f} | {r['kl_max']:.3g} | {r['zero_std']:.2f} | "
              f"{r['skipped']} | {r['held_out']:.3f} |")


if __name__ == "__main__":
    main()
