"""Record each variant's metrics on the tiny model, to check that moving a variant changed nothing (tests/test_variants.py).

    python tools/record_variants.py OUT.json [REPO]    # REPO: a checkout of grpo.py (default: this one)

Each row is a 3-step tiny run (G 4, 64x64, one prompt a step, lr 1e-3, temperature 2 so that groups spread) with one option on; the metrics lines are
written as JSON, without the seconds. tests/data/variants_before.json was recorded at 47e9037, before the variants
left grpo.py.
"""

import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
from PIL import Image

ROWS = {  # name -> the flags that turn the option on (besides the tiny settings below)
    "lesson": [],
    "scale_batch": ["--scale-rewards", "batch", "--prompts-per-step", "2"],
    "scale_none": ["--scale-rewards", "none"],
    "diversity": ["--diversity", "0.2"],
    "unlikeliness": ["--reward", "flat", "--unlikeliness", "0.5"],
    "clip_eps_high": ["--clip-eps-high", "0.28", "--mu", "2"],
    "kl_on": ["--kl-on", "above_mean", "--kl-beta", "0.1", "--mu", "2"],
    "entropy_bonus": ["--entropy-bonus", "0.1"],
    "train_tokens": ["--train-tokens", "all", "--kl-beta", "0.1", "--mu", "2"],
    "policy_dist": ["--policy-dist", "truncated", "--top-p", "0.75", "--kl-beta", "0.1", "--mu", "2"],
    "truncation_weight": ["--truncation-weight", "mass", "--top-p", "0.75", "--kl-beta", "0.1", "--mu", "2"],
    "sequence_mask": ["--sampler-correction", "sequence_mask", "--top-p", "0.75", "--kl-beta", "0.1", "--mu", "2"],
}
TINY = ["--model", "tiny", "--device", "cpu", "--group-size", "4", "--prompts-per-step", "1", "--height", "64",
        "--width", "64", "--before-after", "0", "--mu", "1", "--kl-beta", "0", "--steps", "3", "--lr", "1e-3",
        "--image-every", "0", "--temperature", "2.0"]  # T 2: groups that spread


def flat(images, example):
    """A reward every sample ties on: all of a group are its best (what --unlikeliness acts on)."""
    return torch.zeros(len(images))


def record(repo: Path, rows: dict = ROWS) -> dict:
    sys.path.insert(0, str(repo))
    import grpo
    grpo.REWARDS["flat"] = flat
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        Image.fromarray(np.full((64, 64, 3), 128, np.uint8)).save(tmp / "t.png")
        (tmp / "prompts.txt").write_text("a red circle | t.png\ntwo blue squares | t.png\n")
        for name, flags in rows.items():
            grpo.main([*TINY, "--prompts", str(tmp / "prompts.txt"), "--out", str(tmp / name), *flags])
            lines = [json.loads(x) for x in (tmp / name / "metrics.jsonl").read_text().splitlines()]
            out[name] = [{k: v for k, v in x.items() if not k.startswith("sec_")} for x in lines]
    return out


if __name__ == "__main__":
    repo = Path(sys.argv[2]) if len(sys.argv) > 2 else Path(__file__).resolve().parent.parent
    Path(sys.argv[1]).write_text(json.dumps(record(repo), indent=1) + "\n")
