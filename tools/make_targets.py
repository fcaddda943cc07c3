"""Make the demos' prompts files from world.py: `prompts.txt` (captions with rendered targets, for the SSIM demo),
`examples/shapes.txt` and `examples/shapes_heldout.jsonl` (the training and held-out captions, no targets, for the
`shapes` reward; the held-out lines carry their kind as "category", and position captions "free_layout": false),
and `examples/edits.jsonl` (editing).

prompts.txt: training captions, each with a target the world renders for it (shapes centred in their cells). SSIM to
the target rewards the samples that put the asked shapes where the target has them.

examples/shapes*: world.caption_split() (seeded): GRPO trains on the first, the held-out combinations in the second
never appear in pre-training or in GRPO training, so they measure what generalises.

examples/edits.jsonl: the source is a world picture shifted and blurred; the target is what the tiny model's DiT paints
for that picture's codes when it also sees the source, exactly as grpo.py decodes an editing sample, so the target is
reachable from the source and SSIM can rise. (The tiny AR was pre-trained for text-to-image only: editing runs here
to show the mechanics, not a skill.)

  python tools/make_targets.py            # rewrites the files above and examples/*.png
"""

import itertools
import json
import os
import random
import sys
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageFilter

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # grpo.py and the files it imports live in the repository root

import grpo  # noqa: E402
from helpers import trainer, world  # noqa: E402

# captions whose target fixes the layout (or nearly): with a caption that leaves the places free ("a green triangle
# above a yellow circle"), SSIM to one rendering of it rates a blank picture (0.88) above a right one drawn elsewhere
# (0.76), and GRPO learns to draw nothing (measured; the `shapes` reward does not have this hole)
SSIM_DEMO = ["a red circle at the top left", "two blue squares", "a green triangle in the center",
             "a yellow square at the bottom right"]
EDITS = [("a red square on the left", "move it back into place"), ("two yellow squares", "restore the picture")]


def main(seed: int = 1234) -> None:
    os.chdir(ROOT)  # the paths below are the repository's
    train, held_out = world.caption_split()
    assert all(c in train for c in SSIM_DEMO + [c for c, _ in EDITS]), "demo captions must be training captions"
    rng = random.Random(seed)
    lines = ["# prompt | target image (path relative to this file): world.py's captions and pictures, made by "
             "tools/make_targets.py"]
    for i, caption in enumerate(SSIM_DEMO):
        world.render(world.sample_scene(caption, rng)).save(f"examples/target_{i}.png")
        lines.append(f"{caption} | examples/target_{i}.png")
    Path("prompts.txt").write_text("\n".join(lines) + "\n")

    shuffled = random.Random(seed).sample(train, len(train))
    header = "# captions of world.py for --reward shapes ({}; tools/make_targets.py)\n"
    Path("examples/shapes.txt").write_text(header.format("GRPO's training split") + "\n".join(shuffled) + "\n")
    by_kind = {k: [c for c in held_out if world.parse_caption(c)["kind"] == k]
               for k in ("relation", "counting", "two_objects", "position", "single")}  # most room for GRPO first
    dealt = [c for row in itertools.zip_longest(*by_kind.values()) for c in row if c is not None]  # kinds in turn,
    fixed = {"free_layout": False}  # a position caption names its cell: its diversity is not measured
    Path("examples/shapes_heldout.jsonl").write_text("".join(  # so an eval grid's first prompts show every kind
        json.dumps({"prompt": c, "category": kind, **(fixed if kind == "position" else {})}) + "\n"
        for c in dealt for kind in [world.parse_caption(c)["kind"]]))

    pipe = grpo.load_glm_image("tiny")
    cfg = trainer.parse_config(grpo, ["--model", "tiny"])
    size = cfg.height
    edits = []
    for i, (caption, instruction) in enumerate(EDITS):
        scene = world.sample_scene(caption, rng)
        clean = world.render(scene, rng)
        source = Image.fromarray(np.roll(np.asarray(clean), size // 6, axis=1)).filter(ImageFilter.GaussianBlur(1.5))
        source.save(f"examples/edit_source_{i}.png")
        inputs = grpo.group_inputs(pipe.processor, instruction, 1, size, size, "cpu", source)
        _, encoded = grpo.encode_source(pipe.vision_language_encoder, inputs, source)
        tokens = torch.tensor([world.labels(scene)])  # the large grid: the codes of the clean picture
        target = grpo.decode_images(pipe, instruction, tokens, (world.GRID, world.GRID), size, size,
                                    cfg.num_inference_steps, cfg.decode_seed, cfg.guidance_scale, encoded)[0]
        grpo.to_pil(target).save(f"examples/edit_target_{i}.png")
        edits.append({"prompt": instruction, "source": f"edit_source_{i}.png", "target": f"edit_target_{i}.png"})
    Path("examples/edits.jsonl").write_text("".join(json.dumps(e) + "\n" for e in edits))


if __name__ == "__main__":
    main()
