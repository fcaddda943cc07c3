"""What a GRPO run writes besides its metrics: image grids, and checkpoints that survive a kill.

Helpers of `grpo.py`'s main loop, kept out of the tutorial file; `grpo.py` re-exports them.
"""

import dataclasses
import os
import shutil
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageDraw


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
