"""One GRPO step of grpo.main on GLM-Image at its full published depth (random bf16 weights, `--model random`) per
phase: seconds and peak GPU memory (torch.cuda.max_memory_allocated, reset at each phase) beside tools/memory_plan.py's
prediction, for LoRA r=16 (the real defaults), + --gradient-checkpointing, + --offload, --train dit (LoRA r=16 on the
DiT, checkpointing on by default), and full fine-tuning (which must stop with one line, not a traceback).

    python tools/bench_gpu.py                           # one GPU of 80 GB, about 6 minutes
    python tools/bench_gpu.py --model random:1 --size 64  # a dry run at 1 layer per part, on the CPU (no peaks)

Prints a markdown table; the DiT steps of all but the first run are cut to --dit-steps (the memory of a phase does not
depend on their number; the first run keeps the real 50 and gives the real step time).
"""

import argparse
import contextlib
import gc
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import dit_grpo  # noqa: E402
import grpo  # noqa: E402
from helpers import run  # noqa: E402
from tools import memory_plan  # noqa: E402

GiB = 2**30
PROMPT = "a red circle on the left | " + str(ROOT / "examples" / "target_0.png")  # an SSIM target, resized


def per_phase(argv: list[str]) -> tuple[dict, dict]:
    """grpo.main(argv) (dit_grpo.main for --train dit) with every phase's seconds and peak GiB recorded (run.timed
    wrapped)."""
    seconds, peaks, original = {}, {}, run.timed
    cuda = torch.cuda.is_available()

    @contextlib.contextmanager
    def timed(phase_seconds, phase, cfg):
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        with original(phase_seconds, phase, cfg):
            yield
            if cuda:
                torch.cuda.synchronize()
        seconds[phase] = seconds.get(phase, 0.0) + time.perf_counter() - start
        if cuda:
            peaks[phase] = max(peaks.get(phase, 0.0), torch.cuda.max_memory_allocated() / GiB)

    gc.collect()  # the last run's pipeline is in reference cycles: freed only now (seen: 13 GiB left otherwise)
    run.timed = timed
    try:
        (dit_grpo.main if "dit" in argv else grpo.main)(argv)
    finally:
        run.timed = original
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    return seconds, peaks


def planned(name: str) -> dict:
    """memory_plan's phases (GiB) for the run, at 1024x1024, G = 4, micro-batch 1."""
    with contextlib.redirect_stderr(None):
        counts = memory_plan.count_components()
    memory_plan.calibrate(counts)
    if name.startswith("--train dit"):
        rows = memory_plan.dit_rows(counts, 4, 1024, 1024, 1, 64, worlds=(1,))
        row = next(r for r in rows if r["name"] == "LoRA r=16" and r["ckpt"])
        return {k: v / GiB for k, v in row["phases"].items()}
    rows, _ = memory_plan.plan_rows(counts, 4, 100, 1024, 1024, 1, ranks=(16,))
    row = next(r for r in rows if r["name"] == "LoRA r=16" and r["ckpt"] == ("checkpointing" in name))
    return {k: v / GiB for k, v in row["peaks"]["offload" in name][2].items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="random")
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--dit-steps", type=int, default=10, help="DiT steps of every run but the first")
    parser.add_argument("--runs", default="", help="only the runs whose name contains this (e.g. offload)")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp())
    prompts = work / "prompts.txt"
    prompts.write_text(PROMPT + "\n")
    common = ["--model", args.model, "--prompts", str(prompts), "--steps", "1", "--image-every", "0",
              "--height", str(args.size), "--width", str(args.size), "--save-every", "0"]
    runs = {"LoRA r=16 (defaults)": [],
            "LoRA r=16 + --gradient-checkpointing": ["--gradient-checkpointing"],
            "LoRA r=16 + --offload": ["--offload"],
            "--train dit, LoRA r=16 (--sde-steps 10 --sde-window 2)": ["--train", "dit", "--sde-steps", "10",
                                                                        "--sde-window", "2"]}
    print("| run | phase | seconds | peak GiB | plan GiB |\n|---|---|---:|---:|---:|", flush=True)
    for i, (name, extra) in enumerate(runs.items()):
        if args.runs not in name:
            continue
        steps = [] if i == 0 else ["--num-inference-steps", str(args.dit_steps)]
        try:
            seconds, peaks = per_phase([*common, *steps, *extra, "--out", str(work / f"run{i}")])
        except SystemExit as stop:
            print(f"| {name} | stopped | exit {stop.code} | | |", flush=True)
            continue
        plan = planned(name) if args.size == 1024 and args.model == "random" else {}
        for phase in seconds:
            peak = f"{peaks[phase]:.1f}" if phase in peaks else "-"
            print(f"| {name} | {phase} | {seconds[phase]:.1f} | {peak} | "
                  f"{plan[phase]:.1f} |" if phase in plan else f"| {name} | {phase} | {seconds[phase]:.1f} | {peak} | |",
                  flush=True)
    if args.runs:
        return
    # full fine-tuning: a separate process, to read what a user reads (one line, exit 2)
    done = subprocess.run([sys.executable, str(ROOT / "grpo.py"), *common, "--lora-rank", "0", "--out",
                           str(work / "full")], capture_output=True, text=True)
    lines = [line for line in done.stderr.splitlines() if line.strip() and "%|" not in line]
    print(f"| full fine-tuning (--lora-rank 0) | exit {done.returncode} | | | |\n\n" + "\n".join(lines[-3:]), flush=True)


if __name__ == "__main__":
    main()
