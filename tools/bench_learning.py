"""Does the tiny demo learn? Runs `grpo.py --model tiny` for several seeds and prints one table per prompts file.

  python tools/bench_learning.py                         # 3 seeds x 100 steps, text-to-image (prompts.txt) and editing
                                                   # (examples/edits.jsonl): ~3 min on 2 cores
  python tools/bench_learning.py --seeds 0 1 2 3 4 5 -- --kl-beta 0.04 --lr 3e-3   # extra grpo.py flags after --

Per seed: mean reward of the first and last steps (whole cycles over the prompts, as grpo.py prints),
their difference, the fraction of groups in the last quarter of the steps that collapsed (all rewards alike, so zero
advantage: grpo.py's zero_std_groups), and seconds per step.
"""

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # grpo.py and the files it imports live in the repository root

import grpo  # noqa: E402


def run(seed: int, steps: int, prompts: str, extra: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as out:
        start = time.perf_counter()
        summary = grpo.main(["--model", "tiny", "--prompts", prompts, "--steps", str(steps), "--seed", str(seed),
                             "--out", out, "--image-every", "0", *extra])
        seconds = time.perf_counter() - start
        lines = [json.loads(x) for x in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    late = lines[-len(lines) // 4:]
    return {"seed": seed, **summary, "gain": summary["reward_last"] - summary["reward_first"],
            # groups whose rewards were all alike (std < grpo.group_advantages' eps): the count grpo.py itself
            # gives zero advantage, rather than an exact reward_std == 0
            "collapsed_late": sum(x["zero_std_groups"] for x in late) / sum(len(x["prompts"]) for x in late),
            "sec_per_step": seconds / steps}


def main() -> None:
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--prompts", nargs="+", default=[str(ROOT / "prompts.txt"), str(ROOT / "examples/edits.jsonl")])
    args = parser.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    for prompts in args.prompts:
        table(prompts, [run(seed, args.steps, prompts, extra) for seed in args.seeds], args.steps, extra)


def table(prompts: str, rows: list[dict], steps: int, extra: list[str]) -> None:
    print(f"\ngrpo.py --model tiny --prompts {prompts} --steps {steps} {' '.join(extra)}")
    print("| seed | reward first | reward last | gain | collapsed (last 25%) | s/step |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['seed']} | {r['reward_first']:.3f} | {r['reward_last']:.3f} | {r['gain']:+.3f} | "
              f"{r['collapsed_late']:.0%} | {r['sec_per_step']:.2f} |")
    gains = [r["gain"] for r in rows]
    print(f"| mean | | | {np.mean(gains):+.3f} (min {min(gains):+.3f}) | | {np.mean([r['sec_per_step'] for r in rows]):.2f} |")


if __name__ == "__main__":
    main()
