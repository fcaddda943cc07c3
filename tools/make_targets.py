"""Make the example targets for the tiny demo: images the tiny GLM-Image itself can produce.

A randomly initialised tiny DiT + VAE only paints a narrow family of images, so a hand-drawn target
would be out of reach. Each target here is the decode of a random token grid under the same tiny
weights and the same decoder noise that `python grpo.py --model tiny` uses, so GRPO can climb toward it.

Editing examples (examples/edits.jsonl): a random token grid is decoded once without a source (the "clean"
image); the source is that image shifted and blurred; the target is the decode of the same tokens with the DiT
conditioned on that source, exactly as grpo.py decodes an editing sample. So the target is reachable from the
source, and the reward (SSIM to the target) can rise.

  python tools/make_targets.py            # rewrites examples/*.png, examples/edits.jsonl and prompts.txt
"""

import json
import os
import sys
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageFilter

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # grpo.py and the files it imports live in the repository root

import grpo  # noqa: E402

PROMPTS = ["a red square on a white background", "a blue circle in the snow", "a green triangle at dusk"]
EDITS = ["sharpen the photo and move it back into place", "restore the picture"]


def save(image: torch.Tensor, path: str) -> Image.Image:
    pil = grpo.to_pil(image)
    pil.save(path)
    return pil


def main(size: int = 64, seed: int = 1234) -> None:
    os.chdir(ROOT)  # the paths below are the repository's
    cfg = grpo.Config(model="tiny")
    pipe = grpo.load_glm_image("tiny")
    K = pipe.vision_language_encoder.config.vq_config.num_embeddings
    generator = torch.Generator().manual_seed(seed)
    h = w = size // 32

    def decode(prompt, tokens, source=None):
        return grpo.decode_images(pipe, prompt, tokens, (h, w), size, size, num_inference_steps=2,
                                  seed=cfg.decode_seed, guidance_scale=cfg.guidance_scale, source=source)[0]

    lines = ["# prompt | target image (path relative to this file). Targets made by tools/make_targets.py with the tiny model."]
    for i, prompt in enumerate(PROMPTS):
        tokens = torch.randint(0, K, (1, h * w), generator=generator)  # only the large grid reaches the DiT
        save(decode(prompt, tokens), f"examples/target_{i}.png")
        lines.append(f"{prompt} | examples/target_{i}.png")
    with open("prompts.txt", "w") as f:
        f.write("\n".join(lines) + "\n")

    edits = []
    for i, prompt in enumerate(EDITS):
        tokens = torch.randint(0, K, (1, h * w), generator=generator)
        clean = grpo.to_pil(decode(prompt, tokens))
        shifted = Image.fromarray(np.roll(np.asarray(clean), size // 4, axis=1))
        source = shifted.filter(ImageFilter.GaussianBlur(2))
        source.save(f"examples/edit_source_{i}.png")
        inputs = grpo.group_inputs(pipe.processor, prompt, 1, size, size, "cpu", source)
        _, encoded = grpo.encode_source(pipe.vision_language_encoder, inputs, source)
        save(decode(prompt, tokens, encoded), f"examples/edit_target_{i}.png")
        edits.append({"prompt": prompt, "source": f"edit_source_{i}.png", "target": f"edit_target_{i}.png"})
    with open("examples/edits.jsonl", "w") as f:
        f.write("".join(json.dumps(e) + "\n" for e in edits))


if __name__ == "__main__":
    main()
