"""What a GRPO run writes besides its metrics: image grids, and checkpoints that survive a kill.

Helpers of `grpo.py`'s main loop, kept out of the tutorial file; `grpo.py` re-exports them.
"""

import dataclasses
import json
import os
import shutil
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageDraw


RUN_FILES = ("config.json", "metrics.jsonl", "checkpoint.pt", "images", "final")  # what a run writes in --out


def open_run_dir(out: Path, cfg, start: int) -> list[dict]:
    """Make `out` ready for a run starting at step `start`; returns the metrics of the steps before it.

    A new run first clears what an earlier run left (the caller allows that only with --overwrite);
    a resumed run keeps its metrics up to the checkpoint and drops later lines, as those steps are redone.
    """
    if not cfg.resume:
        for name in RUN_FILES:
            shutil.rmtree(out / name) if (out / name).is_dir() else (out / name).unlink(missing_ok=True)
    (out / "images").mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=2))
    history = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()] if cfg.resume else []
    history = [h for h in history if h["step"] < start]
    (out / "metrics.jsonl").write_text("".join(json.dumps(h) + "\n" for h in history))
    return history


def append_metrics(out: Path, record: dict) -> None:
    """One JSON line per step, appended and closed (flushed) at once: a killed run keeps every finished step."""
    with open(out / "metrics.jsonl", "a") as f:
        f.write(json.dumps(record) + "\n")


def image_grid(targets: list[torch.Tensor], images: list[torch.Tensor], rewards: torch.Tensor) -> Image.Image:
    """One row per prompt: the target, then the G samples with their rewards written underneath."""
    _, H, W = targets[0].shape
    G, label = images[0].shape[0], 14
    grid = Image.new("RGB", ((G + 1) * W, len(targets) * (H + label)), "white")
    draw = ImageDraw.Draw(grid)
    for row, (target, group) in enumerate(zip(targets, images)):
        y = row * (H + label)
        for col, picture in enumerate([target, *group]):
            pixels = (picture.permute(1, 2, 0).cpu().numpy() * 255).round().astype(np.uint8)
            grid.paste(Image.fromarray(pixels), (col * W, y))
            text = "target" if col == 0 else f"{rewards[row, col - 1].item():.3f}"
            draw.text((col * W + 2, y + H + 1), text, fill="black")
    return grid


def save_checkpoint(path: Path, policy, optimizer, step: int, cfg) -> None:
    """Trainable weights, optimizer state, RNG states, the next step and the config, in one file written
    atomically: to a temporary name, flushed to disk, then renamed, so a kill leaves the last good one."""
    state = {"weights": {n: p.detach().cpu() for n, p in policy.named_parameters() if p.requires_grad},
             "optimizer": optimizer.state_dict(), "step": step, "config": dataclasses.asdict(cfg),
             "rng": {"torch": torch.random.get_rng_state(),
                     "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}}
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def load_checkpoint(path: Path, policy, optimizer) -> int:
    """Restore what save_checkpoint wrote into a freshly built policy/optimizer; returns the next step."""
    state = torch.load(path, map_location="cpu", weights_only=False)
    trainable = {n for n, p in policy.named_parameters() if p.requires_grad}
    if set(state["weights"]) != trainable:
        raise ValueError(f"{path} holds other trainable weights than this run (different --lora-rank or model?)")
    missing, unexpected = policy.load_state_dict(state["weights"], strict=False)
    assert not unexpected and not (trainable & set(missing))
    optimizer.load_state_dict(state["optimizer"])
    torch.random.set_rng_state(state["rng"]["torch"])
    if state["rng"]["cuda"]:
        torch.cuda.set_rng_state_all(state["rng"]["cuda"])
    return state["step"]


def save_pretrained_atomic(model, path: Path) -> None:
    """model.save_pretrained into `path`, written under a temporary name first so `path` is never half-written."""
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)  # the full AR, or for a peft model only the adapter
    shutil.rmtree(path, ignore_errors=True)
    os.replace(tmp, path)
