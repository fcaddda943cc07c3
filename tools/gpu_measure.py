"""The real-default GRPO step on one GPU, measured: GLM-Image at its full published depth with random bf16 weights
(`--model random`, built on the GPU in seconds), `grpo.main` with the real model's defaults (1024x1024, G = 4, LoRA
r = 16, top-p 0.75, 50 DiT steps, bf16): per step and phase the seconds, per phase the peak GiB beside
tools/memory_plan.py's plan, the sampler's milliseconds a token step, and the bf16 drift (TRL's mismatch metrics, the
token_truncate weights' range, the sampled tokens outside the trainer's own nucleus). Then the same with a cheaper
training decode (--num-inference-steps 20).

    python tools/gpu_measure.py OUT                              # a GPU: about 5 minutes (tools/gpu_measure.sh)
    python tools/gpu_measure.py OUT --model random:2 --size 256 --dit 2 --short-dit 1  # a dry run on a CPU

Writes OUT/measure.md (the tables), OUT/measure.json (every number) and each run's metrics.jsonl.
"""

import argparse
import json
import math
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tools.bench_gpu import PROMPT, per_phase, planned  # noqa: E402

PHASES = ("sample", "decode", "reward", "train")
DRIFT = ("sampling/sampling_logp_difference/mean", "sampling/sampling_logp_difference/max",
         "sampling/importance_sampling_ratio/min", "sampling/importance_sampling_ratio/max",
         "sampling/raw_importance_sampling_ratio/min", "sampling/raw_importance_sampling_ratio/max",
         "sampling/capped_frac", "sampling/k3_kl", "sampler_gap", "outside_truncation",
         "truncation/nucleus_mass/mean", "truncation/nucleus_mass/min", "kl", "entropy", "grad_norm")


def measure(name: str, argv: list[str], out: Path) -> dict:
    """grpo.main(argv) with its phases timed and their GPU peaks -> the run's numbers (its metrics lines copied)."""
    began = time.perf_counter()
    seconds, peaks = per_phase(argv)
    run_dir = Path(argv[argv.index("--out") + 1])
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    shutil.copy(run_dir / "metrics.jsonl", out / f"{name}_metrics.jsonl")
    return {"argv": argv, "wall": time.perf_counter() - began, "seconds": seconds, "peaks": peaks, "lines": lines}


def table(name: str, result: dict, n_tokens: int, group: int, plan: dict) -> list[str]:
    """Markdown rows of one run: each step's phases, the peaks beside the plan, the sampler's ms a token step."""
    rows = [f"### {name}", "", "| step | " + " | ".join(f"{p} s" for p in PHASES) + " | step s |",
            "|---|" + "---:|" * (len(PHASES) + 1)]
    for line in result["lines"]:
        phases = [line.get(f"sec_{p}", math.nan) for p in PHASES]
        rows.append(f"| {line['step']} | " + " | ".join(f"{s:.1f}" for s in phases) + f" | {sum(phases):.1f} |")
    rows += ["", "| phase | peak GiB | plan GiB |", "|---|---:|---:|"]
    for phase, peak in result["peaks"].items():
        rows.append(f"| {phase} | {peak:.1f} | {plan[phase]:.1f} |" if phase in plan else f"| {phase} | {peak:.1f} | |")
    later = result["lines"][1:] or result["lines"]  # the first step also captures the CUDA graph
    sample = sum(line["sec_sample"] for line in later) / len(later)
    rows += ["", f"sampler: {1e3 * sample / n_tokens:.1f} ms a token step (G = {group}, {n_tokens} tokens, steps after "
             "the first)", ""]
    return rows


def drift(result: dict, n_tokens: int, group: int) -> list[str]:
    """Markdown rows of the bf16 drift, at each step."""
    rows = ["| step | " + " | ".join(DRIFT) + " | outside share |", "|---|" + "---:|" * (len(DRIFT) + 1)]
    for line in result["lines"]:
        values = [line.get(key, math.nan) for key in DRIFT]
        share = line.get("outside_truncation", math.nan) / (group * n_tokens)
        rows.append(f"| {line['step']} | " + " | ".join(f"{v:.3g}" for v in values) + f" | {share:.2%} |")
    return rows + [""]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--model", default="random")
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=3, help="real-default steps")
    parser.add_argument("--short-steps", type=int, default=2, help="steps with the cheaper decode")
    parser.add_argument("--dit", type=int, default=0, help="the real-default run's DiT steps (0: the preset's 50)")
    parser.add_argument("--short-dit", type=int, default=20, help="the cheaper decode's DiT steps")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp())
    (work / "prompts.txt").write_text(PROMPT + "\n")
    common = ["--model", args.model, "--prompts", str(work / "prompts.txt"), "--image-every", "0", "--save-every",
              "0", "--height", str(args.size), "--width", str(args.size)]
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    report = [f"# The real-default step: {device}, --model {args.model}, {args.size}x{args.size}", ""]
    results = {}
    runs = {"real defaults": ["--steps", str(args.steps), *(["--num-inference-steps", str(args.dit)] if args.dit else [])],
            f"--num-inference-steps {args.short_dit}": ["--steps", str(args.short_steps), "--num-inference-steps",
                                                        str(args.short_dit)]}
    plan = planned("LoRA r=16 (defaults)") if args.model == "random" and args.size == 1024 else {}
    n_tokens = (args.size // 32) ** 2 + 256  # the large grid and the 16x16 preview
    for i, (name, extra) in enumerate(runs.items()):
        try:
            results[name] = measure(f"run{i}", [*common, *extra, "--out", str(work / f"run{i}")], args.out)
        except SystemExit as stop:  # out of memory or bad input: one line on stderr, the table says so
            report += [f"### {name}: stopped (exit {stop.code})", ""]
            continue
        report += table(name, results[name], n_tokens, 4, plan)
        report += ["bf16 drift:", ""] + drift(results[name], n_tokens, 4)
        (args.out / "measure.md").write_text("\n".join(report) + "\n")  # what is done so far, if time runs out
    (args.out / "measure.json").write_text(json.dumps({"device": device, "model": args.model, "size": args.size,
                                                       "runs": results}, indent=1, default=str) + "\n")
    print("\n".join(report))


if __name__ == "__main__":
    main()
