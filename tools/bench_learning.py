"""Does GRPO make the tiny model draw better? Held-out accuracy before and after, over seeds.

  OMP_NUM_THREADS=2 python tools/bench_learning.py       # 3 seeds, both demos (38 min on 2 cores, alone)
  python tools/bench_learning.py --seeds 0 --demos shapes -- --lr 2e-4     # extra grpo.py flags after --

shapes: `grpo.py --reward shapes --prompts examples/shapes.txt` (GRPO's training captions) for --steps steps, then
  the held-out accuracy: the fraction of (caption, sample) pairs drawn fully right (shapes reward = 1), over every
  caption of examples/shapes_heldout.jsonl (combinations never seen in pre-training or GRPO training) x --samples
  samples with fixed seeds, through grpo.py's own sampling and decoding at the run's settings. Measured for the
  pre-trained model once and for each run's final/ weights; also the training minutes and how many distinct samples
  the groups of the last 10 steps hold (a policy collapsed to one image per prompt has 1).
ssim: `grpo.py --prompts prompts.txt` (captions with rendered targets): the mean reward of the first and last steps
  (grpo.py's summary) and of the same prompts and seeds before and after training (its before / after grids).

Accuracies are printed per caption kind too. Run it alone: two CPU-heavy processes on 2 cores slow each other down.
"""

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # grpo.py and the files it imports live in the repository root

import grpo  # noqa: E402
import run  # noqa: E402
import world  # noqa: E402
from rewards import shapes_reward  # noqa: E402


def shapes_accuracy(pipe, captions: list[str], samples: int = 8, seed: int = 0, cfg: grpo.Config | None = None) -> dict:
    """`samples` images per caption (the sampling seed fixed per caption), through grpo.sample_group and
    grpo.decode_images at cfg's settings (default: the tiny model's), scored by the shapes reward ->
    {"accuracy": fraction drawn fully right, "reward": mean score, and the accuracy of each caption kind}."""
    cfg = cfg or grpo.parse_config(["--model", "tiny"])
    right, scores, kinds = [], [], []
    for i, caption in enumerate(captions):
        with torch.no_grad():
            rollout = grpo.sample_group(pipe, caption, samples, cfg.height, cfg.width, cfg.temperature,
                                        seed * 1_000_003 + i)
            images = grpo.decode_images(pipe, caption, rollout.tokens, rollout.large_hw, cfg.height, cfg.width,
                                        cfg.num_inference_steps, cfg.decode_seed, cfg.guidance_scale)
        score = shapes_reward(images, {"prompt": caption})
        right += (score == 1).tolist()
        scores += score.tolist()
        kinds += [world.parse_caption(caption)["kind"]] * samples
    per_kind = {k: float(np.mean([r for r, kk in zip(right, kinds) if kk == k])) for k in world.KINDS if k in kinds}
    return {"accuracy": float(np.mean(right)), "reward": float(np.mean(scores)), **per_kind}


def held_out_captions() -> list[str]:
    """The 161 held-out captions in world.caption_split()'s order (examples/shapes_heldout.jsonl holds the same ones,
    dealt by kind): the order the README's numbers were measured in, as sampling seeds follow the position."""
    return world.caption_split()[1]


def trained_pipe(run: Path):
    """The tiny pipeline with the AR of a run's final/ (full fine-tuning)."""
    from transformers import GlmImageForConditionalGeneration
    pipe = grpo.load_glm_image("tiny")
    pipe.vision_language_encoder.load_state_dict(GlmImageForConditionalGeneration.from_pretrained(run / "final")
                                                 .state_dict())
    return pipe


def run_shapes(seed: int, steps: int, samples: int, extra: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as out:
        start = time.perf_counter()
        summary = grpo.main(["--prompts", str(ROOT / "examples" / "shapes.txt"), "--reward", "shapes=1", "--steps",
                             str(steps), "--seed", str(seed), "--out", out, "--image-every", "0", *extra])
        minutes = (time.perf_counter() - start) / 60
        lines = [json.loads(x) for x in (Path(out) / "metrics.jsonl").read_text().splitlines()]
        cfg = grpo.parse_config(["--model", "tiny", *extra])
        after = shapes_accuracy(trained_pipe(Path(out)), held_out_captions(), samples, cfg=cfg)
    return {"seed": seed, "after": after, "minutes": minutes, "train_first": summary["reward_first"],
            "train_last": summary["reward_last"],
            "distinct": float(np.mean([x["distinct_samples"] for x in lines[-10:]])), "group_size": cfg.group_size}


def run_ssim(seed: int, steps: int, extra: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as out:
        start = time.perf_counter()
        summary = grpo.main(["--prompts", str(ROOT / "prompts.txt"), "--steps", str(steps), "--seed", str(seed),
                             "--out", out, "--image-every", "0", *extra])
    return {"seed": seed, **summary, "minutes": (time.perf_counter() - start) / 60}


def main() -> None:
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=400, help="GRPO steps of the shapes demo")
    parser.add_argument("--ssim-steps", type=int, default=100, help="GRPO steps of the SSIM demo")
    parser.add_argument("--samples", type=int, default=8, help="samples per held-out caption")
    parser.add_argument("--demos", nargs="+", default=["shapes", "ssim"], choices=["shapes", "ssim"])
    args = parser.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    run.quiet_libraries()
    flags = " ".join(extra)
    if "shapes" in args.demos:
        start = time.perf_counter()
        cfg = grpo.parse_config(["--model", "tiny", *extra])
        base = shapes_accuracy(grpo.load_glm_image("tiny"), held_out_captions(), args.samples, cfg=cfg)
        print(f"pre-trained tiny model: held-out accuracy {base['accuracy']:.3f} ({len(held_out_captions())} captions x "
              f"{args.samples} samples, {(time.perf_counter() - start) / 60:.1f} min to measure)", flush=True)
        rows = [run_shapes(seed, args.steps, args.samples, extra) for seed in args.seeds]
        print(f"\ngrpo.py --reward shapes --prompts examples/shapes.txt --steps {args.steps} {flags}")
        print("| seed | held-out before | held-out after | gain | train reward first -> last | distinct samples "
              "(of G) | training min |")
        print("|---|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['seed']} | {base['accuracy']:.3f} | {r['after']['accuracy']:.3f} | "
                  f"{r['after']['accuracy'] - base['accuracy']:+.3f} | {r['train_first']:.3f} -> {r['train_last']:.3f} |"
                  f" {r['distinct']:.1f} of {r['group_size']} | {r['minutes']:.1f} |")
        print("\nheld-out accuracy per kind: " + ", ".join(
            f"{k} {base[k]:.2f} -> {np.mean([r['after'][k] for r in rows]):.2f}" for k in world.KINDS))
    if "ssim" in args.demos:
        rows = [run_ssim(seed, args.ssim_steps, extra) for seed in args.seeds]
        print(f"\ngrpo.py --prompts prompts.txt --steps {args.ssim_steps} {flags}")
        print("| seed | reward first steps | last steps | same seeds before | after | minutes |")
        print("|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['seed']} | {r['reward_first']:.3f} | {r['reward_last']:.3f} | {r['shown_before']:.3f} | "
                  f"{r['shown_after']:.3f} | {r['minutes']:.1f} |")


if __name__ == "__main__":
    main()
