"""Make the example targets for the tiny demo: images the tiny GLM-Image itself can produce.

A randomly initialised tiny DiT + VAE only paints a narrow family of images, so a hand-drawn target
would be out of reach. Each target here is the decode of a random token grid under the same tiny
weights and the same decoder noise that `python grpo.py --model tiny` uses, so GRPO can climb toward it.

  python make_targets.py            # rewrites examples/*.png and prompts.txt
"""

import torch
from PIL import Image

import grpo

PROMPTS = ["a red square on a white background", "a blue circle in the snow", "a green triangle at dusk"]


def main(size: int = 64, seed: int = 1234) -> None:
    cfg = grpo.Config(model="tiny")
    pipe = grpo.load_glm_image("tiny")
    K = pipe.vision_language_encoder.config.vq_config.num_embeddings
    generator = torch.Generator().manual_seed(seed)
    lines = ["# prompt | target image (path relative to this file). Targets made by make_targets.py with the tiny model."]
    for i, prompt in enumerate(PROMPTS):
        h = w = size // 32
        tokens = torch.randint(0, K, (1, h * w), generator=generator)  # only the large grid reaches the DiT
        image = grpo.decode_images(pipe, prompt, tokens, (h, w), size, size, num_inference_steps=2,
                                   seed=cfg.decode_seed, guidance_scale=cfg.guidance_scale)[0]
        path = f"examples/target_{i}.png"
        Image.fromarray((image.permute(1, 2, 0).numpy() * 255).round().astype("uint8")).save(path)
        lines.append(f"{prompt} | {path}")
    with open("prompts.txt", "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
