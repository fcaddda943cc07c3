"""GRPO on GLM-Image, in one file you can read top to bottom.

GLM-Image draws a picture in two stages: an autoregressive model (the AR, a 9B GLM) writes a grid of
visual tokens, and a diffusion transformer (the DiT, 7B) paints pixels conditioned on those tokens.
This file trains the AR with GRPO (Group Relative Policy Optimization, Shao et al. 2024):

  for each prompt q, sample a group of G token sequences o_1..o_G from the old policy, decode them to
  images, score them (SSIM / -MSE against a target image), and maximise

    J = 1/G sum_i 1/|o_i| sum_t [ min(r_it A_i, clip(r_it, 1-eps, 1+eps) A_i) - beta KL_it ]

  with r_it = pi(o_it | q, o_i<t) / pi_old(o_it | q, o_i<t), A_i = (R_i - mean(R)) / std(R) over the
  group, and KL_it the k3 estimator exp(ref - logp) - (ref - logp) - 1 against a frozen reference.

Where this departs from the paper:
  - The "sequence" is a visual-token grid, not text: a small preview grid (~16x16) then the large grid
    (H/32 x W/32). Only the large grid reaches the DiT, so by default the loss covers only those tokens
    (`--train-tokens large`); the preview tokens still condition them.
  - Sampling is restricted to the VQ codebook ids and never stops early, so every sample has exactly N
    tokens; sampler and trainer share one definition of the distribution (softmax(logits / T) over the
    codebook, no top-k / top-p), which is what makes pi / pi_old exactly 1 on the first update.
  - The AR uses 3D rotary positions. A teacher-forced forward must be given the positions that
    generation used (`rope_positions`); the default forward gets them wrong for every image token.
  - The DiT and VAE are frozen and run with the same latent noise for every sample of a group, so
    reward differences come from the tokens alone.
  - Advantages use the population std of the group, and a group with no spread gets zero advantage.

Commands:
  pip install -r requirements.txt
  python grpo.py --prompts prompts.txt --model tiny     # tiny GLM-Image built in code, 2 CPU cores, ~1-2 min
  python grpo.py --prompts prompts.txt                  # the real zai-org/GLM-Image (GPU, bf16)
  python -m pytest -q test_grpo.py                      # tests, CPU, a few minutes
"""

import argparse
import contextlib
import copy
import dataclasses
import json
import math
import sys
import time
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from run_io import (RUN_FILES, append_metrics, image_grid, load_checkpoint, open_run_dir,  # what a run writes
                    save_checkpoint, save_pretrained_atomic)
from offline_model import tiny_glm_image  # a tiny GLM-Image built in code (offline demo, tests, notebook)


# ---- 1. Config ----------------------------------------------------------------------------------

def arg(default, help: str):
    """A config field whose one-line doc becomes its --help."""
    return dataclasses.field(default=default, metadata={"help": help})


@dataclasses.dataclass
class Config:
    prompts: str = arg("prompts.txt", "file of 'prompt | target.png' lines")
    model: str = arg("zai-org/GLM-Image", "hub id, local path, or 'tiny'")
    out: str = arg("runs/grpo", "output directory")
    steps: int = arg(100, "optimizer steps")
    seed: int = arg(0, "seed of the AR sampling")
    group_size: int = arg(4, "samples per prompt (G)")
    prompts_per_step: int = arg(1, "prompts (groups) per optimizer step")
    micro_batch_size: int | None = arg(None, "sequences per forward/backward (default 4 tiny, 1 real)")
    lr: float | None = arg(None, "AdamW lr (default 1e-2 tiny, 1e-5 real)")
    weight_decay: float = arg(0.01, "AdamW weight decay")
    max_grad_norm: float = arg(1.0, "gradient-norm clip")
    clip_eps: float = arg(0.2, "PPO clip range eps")
    kl_beta: float | None = arg(None, "weight of the k3 KL to the reference (default 0 tiny, 0.04 real)")
    mu: int = arg(1, "policy updates per batch of rollouts")
    temperature: float = arg(0.9, "sampling temperature (GLM-Image: 0.9)")
    height: int | None = arg(None, "image height (default 64 tiny, 1024 real)")
    width: int | None = arg(None, "image width (default 64 tiny, 1024 real)")
    num_inference_steps: int | None = arg(None, "DiT denoising steps (default 2 tiny, 50 real)")
    guidance_scale: float = arg(1.5, "DiT classifier-free guidance")
    decode_seed: int = arg(0, "seed of the DiT latent noise (fixed per run)")
    reward: str = arg("ssim=1,mse=0", "reward weights, e.g. ssim=1,mse=0.5")
    train_tokens: str = arg("large", "tokens in the loss: large | all")
    image_every: int = arg(10, "save an image grid every N steps (0: never)")
    save_every: int = arg(50, "save a checkpoint every N steps (0: only at the end)")
    resume: str = arg("", "run directory to continue (--steps is the total)")
    overwrite: bool = arg(False, "replace the run in --out")
    lora_rank: int | None = arg(None, "LoRA rank on the AR, 0: train all AR weights (default 0 tiny, 16 real)")
    gradient_checkpointing: bool = arg(False, "recompute AR activations")
    offload: bool = arg(False, "keep DiT, VAE, T5 on CPU except to decode")
    device: str = arg("auto", "cpu | cuda | auto")
    dtype: str = arg("auto", "float32 | bfloat16 | auto")


MODEL_DEFAULTS = {  # filled in where the command line left a field at None
    "tiny": dict(lr=1e-2, kl_beta=0.0, height=64, width=64, num_inference_steps=2, micro_batch_size=4, lora_rank=0),
    # LoRA r=16 with micro-batches of 1 fits one 80 GB GPU (about 46 GiB estimated, see memory_plan.py)
    "real": dict(lr=1e-5, kl_beta=0.04, height=1024, width=1024, num_inference_steps=50, micro_batch_size=1,
                 lora_rank=16),
}


def parse_config(argv: list[str] | None = None) -> Config:
    """Command line -> Config. Flags are the field names with dashes; None fields get MODEL_DEFAULTS."""
    parser = argparse.ArgumentParser(description="GRPO on GLM-Image", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    for f in dataclasses.fields(Config):
        flag, kind = "--" + f.name.replace("_", "-"), {"int | None": int, "float | None": float}.get(str(f.type), f.type)
        if kind is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, help=f.metadata["help"])
        else:
            parser.add_argument(flag, type=kind, default=f.default, help=f.metadata["help"])
    cfg = Config(**vars(parser.parse_args(argv)))
    defaults = MODEL_DEFAULTS["tiny" if cfg.model == "tiny" else "real"]
    return dataclasses.replace(cfg, **{k: v for k, v in defaults.items() if getattr(cfg, k) is None})


def parse_reward_weights(spec: str) -> dict[str, float]:
    """'ssim=1,mse=0.5' -> {'ssim': 1.0, 'mse': 0.5}. Raises ValueError on unknown names or negative weights."""
    weights = {}
    for part in spec.split(","):
        name, _, value = part.partition("=")
        name = name.strip()
        if name not in REWARDS:
            raise ValueError(f"unknown reward '{name}' in --reward '{spec}'; use names from {sorted(REWARDS)}")
        try:
            weights[name] = float(value)
        except ValueError:
            raise ValueError(f"reward weight '{part}' is not name=number; write e.g. --reward ssim=1,mse=0") from None
        if not weights[name] >= 0:
            raise ValueError(f"reward weight '{part}' is negative; weights must be >= 0")
    if sum(weights.values()) <= 0:
        raise ValueError(f"--reward '{spec}' gives every reward weight 0; give at least one a positive weight")
    return weights


# ---- 2. Loading GLM-Image -----------------------------------------------------------------------

def load_glm_image(name: str, device: str = "cpu", dtype: torch.dtype = torch.float32):
    """'tiny' -> tiny_glm_image(0); otherwise GlmImagePipeline.from_pretrained(name). Everything but the AR frozen."""
    if name == "tiny":
        pipe = tiny_glm_image(0)  # weights never depend on --seed, so the shipped targets stay reachable
    else:
        from diffusers import GlmImagePipeline
        pipe = GlmImagePipeline.from_pretrained(name, dtype=dtype)
    pipe.to(device)
    if name == "tiny" and dtype != torch.float32:
        pipe.to(dtype=dtype)
    pipe.set_progress_bar_config(disable=True)
    for module in (pipe.text_encoder, pipe.transformer, pipe.vae):
        module.requires_grad_(False).eval()
    ar = pipe.vision_language_encoder.eval()  # models built in code start in train mode
    ar.model.visual.requires_grad_(False)  # the vision tower and VQ encoder only serve image-to-image
    ar.model.vqmodel.requires_grad_(False)
    disable_dropout(ar)
    return pipe


def move_decoder(pipe, device) -> None:
    """The frozen T5, DiT and VAE to `device`: with --offload they sit on the CPU except while decoding."""
    for module in (pipe.text_encoder, pipe.transformer, pipe.vae):
        module.to(device)


def disable_dropout(model) -> None:
    """Zero every dropout of the AR (GLM-Image's are already 0), so train and eval mode give the same
    distribution: dropout on in training but not in sampling would make pi != pi_old at step 0."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        if isinstance(getattr(module, "attention_dropout", None), float):
            module.attention_dropout = 0.0


def apply_lora(policy, rank: int):
    """Wrap the AR's language-model attention and MLP projections in LoRA adapters (peft) and freeze the rest.

    Dropout 0 so sampler and trainer see one distribution. The adapters are injected into `policy`
    in place, so the pipeline samples with them; the returned PeftModel can switch them off
    (`disable_adapter`, the reference) and saves just the adapter.
    """
    from peft import LoraConfig, get_peft_model  # optional dependency, only for --lora-rank > 0
    config = LoraConfig(r=rank, lora_alpha=rank, lora_dropout=0.0,
                        target_modules=r".*language_model\.layers\.\d+\.(self_attn\.(q|k|v|o)_proj|mlp\.(gate_up|down)_proj)")
    return get_peft_model(policy, config)


def reference_model(policy, kl_beta: float):
    """The KL reference: None when beta = 0 (no KL term); with LoRA the policy itself, whose base weights
    are the reference once the adapter is switched off (no second copy); else a frozen copy of the AR."""
    if kl_beta == 0:
        return None
    if hasattr(policy, "disable_adapter"):
        return policy
    return copy.deepcopy(policy).requires_grad_(False).eval()


# ---- 3. Prompts and targets ---------------------------------------------------------------------

def read_prompts(path: str) -> list[tuple[str, Path]]:
    """'prompt | target.png' per line -> [(prompt, target_path)]; split at the last '|', paths relative
    to the prompts file; blank lines and '#' comments skipped. Raises ValueError naming the problem."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        reason = "not UTF-8 text" if isinstance(error, UnicodeDecodeError) else error.strerror or str(error)
        raise ValueError(f"cannot read --prompts {path} ({reason}); give a text file of 'prompt | target.png' lines")
    examples = []
    for number, line in enumerate(text.splitlines(), start=1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        prompt, bar, target = line.rpartition("|")
        if not bar or not prompt.strip() or not target.strip():
            raise ValueError(f"{path}:{number}: expected 'prompt | target.png', got '{line}'")
        examples.append((prompt.strip(), path.parent / target.strip()))
    if not examples:
        raise ValueError(f"{path} has no examples; add lines of the form 'prompt | target.png'")
    return examples


def load_target(path: str | Path, height: int, width: int) -> torch.Tensor:
    """PNG/JPEG -> (3, H, W) float32 in [0, 1], resized (bicubic) if its size differs.
    Raises ValueError for a missing or unreadable image."""
    if not Path(path).is_file():
        raise ValueError(f"target {path} does not exist; fix its path in the prompts file")
    try:
        with Image.open(path) as image:
            image = image.convert("RGB")
            if image.size != (width, height):
                image = image.resize((width, height), Image.BICUBIC)
            pixels = np.asarray(image, dtype=np.float32) / 255.0  # (H, W, 3)
    except OSError as error:
        raise ValueError(f"target {path} is not a readable image ({error}); replace it or fix the prompts file")
    return torch.from_numpy(pixels).permute(2, 0, 1).contiguous()  # (3, H, W)


# ---- 4. Group sampling --------------------------------------------------------------------------

class Rollout(NamedTuple):
    tokens: torch.Tensor  # (G, N) long, visual codes: preview grid then large grid
    logprobs: torch.Tensor  # (G, N) float32, log pi_old of each token under the sampled distribution
    inputs: dict  # AR inputs of the group: input_ids (G, P), attention_mask, image_grid_thw (2G, 3), ...
    preview_hw: tuple[int, int]  # preview grid (h', w'), generated first
    large_hw: tuple[int, int]  # large grid (H/32, W/32), generated second; the only one the DiT sees


def code_logprobs(logits: torch.Tensor, temperature: float, codebook_size: int) -> torch.Tensor:
    """(..., V) raw AR logits -> (..., K) float32 log-probs of softmax(logits / T) over the codebook ids.

    The one definition of the policy's distribution, shared by the sampler and the trainer: no top-k,
    no top-p, ids >= K (image start/end, spare ids) impossible.
    """
    return torch.log_softmax(logits[..., :codebook_size].float() / temperature, dim=-1)


def group_inputs(processor, prompt: str, group_size: int, height: int, width: int, device) -> dict:
    """One prompt -> AR inputs repeated G times. Repeating by hand keeps each sample's [large, preview]
    grid pair together; generate(num_return_sequences=G) would repeat_interleave the grid rows."""
    messages = [[{"role": "user", "content": [{"type": "text", "text": prompt}]}]]
    one = processor.apply_chat_template(messages, tokenize=True, return_dict=True,
                                        processor_kwargs=dict(target_h=height, target_w=width, return_tensors="pt"))
    return {
        "input_ids": one["input_ids"].repeat(group_size, 1).to(device),  # (G, P)
        "attention_mask": one["attention_mask"].repeat(group_size, 1).to(device),  # (G, P)
        "image_grid_thw": one["image_grid_thw"].repeat(group_size, 1).to(device),  # (2G, 3): [large, preview] x G
        "images_per_sample": one["images_per_sample"].repeat(group_size).to(device),  # (G,)
    }


@torch.no_grad()
def sample_group(pipe, prompt: str, group_size: int, height: int, width: int, temperature: float,
                 seed: int) -> Rollout:
    """G samples for one prompt from ONE batched generate (KV cache), with their log-probs.

    Every sample is exactly N = h'w' + (H/32)(W/32) codebook tokens. Log-probs come from the raw logits
    through `code_logprobs`, i.e. exactly the distribution generate sampled from.
    """
    model, K = pipe.vision_language_encoder, pipe.vision_language_encoder.config.vq_config.num_embeddings
    model.eval()  # no dropout: sampler and trainer must draw from one and the same distribution
    inputs = group_inputs(pipe.processor, prompt, group_size, height, width, model.device)
    (_, large_h, large_w), (_, prev_h, prev_w) = inputs["image_grid_thw"][:2].tolist()
    n_tokens = prev_h * prev_w + large_h * large_w
    vision_vocab = model.config.text_config.vision_vocab_size
    devices = [model.device] if model.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):  # seeded sampling without touching the caller's RNG
        torch.manual_seed(seed)
        out = model.generate(
            **inputs, do_sample=True, temperature=temperature, top_k=0, top_p=1.0, repetition_penalty=1.0,
            max_new_tokens=n_tokens, suppress_tokens=list(range(K, vision_vocab)),  # codes only, never stop early
            output_logits=True, return_dict_in_generate=True)
    tokens = out.sequences[:, inputs["input_ids"].shape[1]:]  # (G, N)
    logits = torch.stack(out.logits, dim=1)  # (G, N, V) raw, before temperature and suppression
    logprobs = code_logprobs(logits, temperature, K).gather(-1, tokens[..., None]).squeeze(-1)  # (G, N)
    return Rollout(tokens, logprobs, inputs, (prev_h, prev_w), (large_h, large_w))


# ---- 5. Log-probs of given tokens ---------------------------------------------------------------

def rope_positions(image_grid_thw: torch.Tensor, prompt_len: int, num_tokens: int) -> torch.Tensor:
    """3D rotary positions (3, 1, P + N - 1) for prompt + all generated tokens but the last.

    The text-to-image prompt holds no image, so its positions are a 1D ramp on all three axes
    (temporal, height, width). The grids are then generated in REVERSE order of image_grid_thw
    (preview first): a grid h x w starting at p has t = p, h = p + row, w = p + col, and the next
    grid starts at p + max(h, w). This mirrors GlmImageModel.get_rope_index, which generate uses.
    """
    positions = [torch.arange(prompt_len).expand(3, -1)]  # (3, P)
    p = prompt_len
    for _, h, w in reversed(image_grid_thw[:2].tolist()):  # this sample's [large, preview] -> preview, large
        rows = torch.arange(h).repeat_interleave(w)  # (h*w,) 0,0,..,1,1,..
        cols = torch.arange(w).repeat(h)  # (h*w,) 0,1,..,0,1,..
        positions.append(torch.stack([torch.full_like(rows, p), p + rows, p + cols]))  # (3, h*w)
        p += max(h, w)
    positions = torch.cat(positions, dim=1)[:, : prompt_len + num_tokens - 1]  # the last token is never an input
    return positions[:, None, :].to(image_grid_thw.device)  # (3, 1, P+N-1)


def token_logprobs(model, inputs: dict, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    """(G, N) float32 log-probs of `tokens` given the prompt, from one teacher-forced forward.

    Differentiable (call under torch.no_grad() for the reference). Passing explicit `position_ids`
    is what makes this agree with sample_group: without them the model puts the image tokens on the
    1D text ramp and the log-probs are wrong (see the tests and the notebook).
    """
    G, P = inputs["input_ids"].shape
    N = tokens.shape[1]
    input_ids = torch.cat([inputs["input_ids"], tokens[:, :-1]], dim=1)  # (G, P+N-1)
    attention_mask = torch.cat([inputs["attention_mask"], torch.ones_like(tokens[:, :-1])], dim=1)
    positions = rope_positions(inputs["image_grid_thw"], P, N).expand(-1, G, -1)  # (3, G, P+N-1)
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions,
                   use_cache=False, logits_to_keep=N).logits  # (G, N, V): the logits that predict each token
    K = model.config.vq_config.num_embeddings
    return code_logprobs(logits, temperature, K).gather(-1, tokens[..., None]).squeeze(-1)


# ---- 6. Decoding tokens to images ---------------------------------------------------------------

@torch.no_grad()
def decode_images(pipe, prompt: str, tokens: torch.Tensor, large_hw: tuple[int, int], height: int, width: int,
                  num_inference_steps: int, seed: int, guidance_scale: float = 1.5) -> torch.Tensor:
    """(G, N) tokens -> (G, 3, H, W) float32 images in [0, 1]: large grid -> prior ids -> DiT -> VAE.

    The whole group in one pipeline call, all samples from the same latent noise (seeded), so the
    images differ only through their tokens. The preview tokens never reach the DiT.
    """
    G, (h, w) = tokens.shape[0], large_hw
    device = pipe.transformer.device
    large = tokens[:, -h * w:].reshape(G, 1, h, w)  # (G, 1, H/32, W/32)
    prior = F.interpolate(large.float(), scale_factor=2, mode="nearest").long().reshape(G, -1)  # (G, 4hw) at H/16
    embeds, negative = pipe.encode_prompt(prompt, do_classifier_free_guidance=guidance_scale > 1, device=device,
                                          dtype=pipe.transformer.dtype)
    generator = torch.Generator("cpu").manual_seed(seed)
    shape = (1, pipe.transformer.config.in_channels, height // pipe.vae_scale_factor, width // pipe.vae_scale_factor)
    latents = torch.randn(shape, generator=generator).to(device, pipe.transformer.dtype).repeat(G, 1, 1, 1)
    images = pipe(prompt_embeds=embeds.repeat(G, 1, 1),
                  negative_prompt_embeds=None if negative is None else negative.repeat(G, 1, 1),
                  prior_token_ids=prior, latents=latents, height=height, width=width,
                  num_inference_steps=num_inference_steps, guidance_scale=guidance_scale, output_type="pt").images
    return images.float().clamp(0, 1)  # (G, 3, H, W)


# ---- 7. Rewards ---------------------------------------------------------------------------------

def mse_reward(images: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """(G, 3, H, W), (3, H, W) in [0, 1] -> (G,) negative mean squared error, in [-1, 0]."""
    return -((images - target) ** 2).mean(dim=(1, 2, 3))


def ssim_reward(images: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """(G, 3, H, W), (3, H, W) in [0, 1] -> (G,) SSIM (Wang et al. 2004), in [-1, 1].

    11-tap Gaussian window (sigma 1.5), K1 = 0.01, K2 = 0.03, data range 1, computed over valid
    (unpadded) windows, averaged over channels and pixels.
    """
    C1, C2 = 0.01 ** 2, 0.03 ** 2
    g = torch.exp(-((torch.arange(11, dtype=torch.float32) - 5) ** 2) / (2 * 1.5 ** 2))
    g = (g / g.sum()).to(images.device)
    window = (g[:, None] * g[None, :]).expand(3, 1, 11, 11)  # (3, 1, 11, 11), one per channel

    def blur(x):  # (G, 3, H, W) -> (G, 3, H-10, W-10)
        return F.conv2d(x, window, groups=3)

    x, y = images.float(), target.float().expand_as(images)
    mu_x, mu_y = blur(x), blur(y)
    var_x = blur(x * x) - mu_x ** 2
    var_y = blur(y * y) - mu_y ** 2
    cov = blur(x * y) - mu_x * mu_y
    ssim_map = ((2 * mu_x * mu_y + C1) * (2 * cov + C2)) / ((mu_x ** 2 + mu_y ** 2 + C1) * (var_x + var_y + C2))
    return ssim_map.mean(dim=(1, 2, 3))


REWARDS = {"ssim": ssim_reward, "mse": mse_reward}


def group_rewards(images: list[torch.Tensor], targets: list[torch.Tensor], weights: dict[str, float]) -> torch.Tensor:
    """P groups of (G, 3, H, W) images and their P (3, H, W) targets -> (P, G) weighted rewards.

    Row p scores group p against target p only: a reward never meets another prompt's samples.
    """
    return torch.stack([sum(w * REWARDS[name](group, target) for name, w in weights.items())
                        for group, target in zip(images, targets, strict=True)])


# ---- 8. Advantages ------------------------------------------------------------------------------

def group_advantages(rewards: torch.Tensor, eps: float = 1e-4) -> torch.Tensor:
    """(P, G) or (G,) rewards -> same-shape advantages, z-scored within each group (last dim).

    Population std; a group whose std is below eps (all samples alike) carries no signal and gets
    zeros rather than a division by ~0. Invariant to r -> a r + b for a > 0.
    """
    mean = rewards.mean(dim=-1, keepdim=True)
    std = rewards.std(dim=-1, unbiased=False, keepdim=True)
    return torch.where(std > eps, (rewards - mean) / std.clamp_min(eps), torch.zeros_like(rewards))


# ---- 9. Loss ------------------------------------------------------------------------------------

def grpo_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, ref_logprobs: torch.Tensor | None,
              advantages: torch.Tensor, clip_eps: float, kl_beta: float) -> tuple[torch.Tensor, dict]:
    """PPO-clipped GRPO loss with a k3 KL penalty. (S, T) log-probs, (S,) advantages -> scalar loss.

    Per token: r = exp(logp - old), surrogate = min(r A, clip(r, 1-eps, 1+eps) A),
    KL = exp(ref - logp) - (ref - logp) - 1 (>= 0, unbiased for KL(pi || ref)),
    loss = -(surrogate - beta KL), averaged over the tokens of a sequence, then over sequences
    (the paper's 1/|o_i|). DAPO averages over all tokens of the batch and Dr. GRPO divides by a
    constant; here every sample has exactly N tokens, so all three differ only by a constant factor.
    `ref_logprobs` may be None when beta = 0.
    """
    ratio = torch.exp(logprobs - old_logprobs)  # (S, T)
    adv = advantages[:, None].to(ratio.dtype)  # (S, 1)
    unclipped, clipped = ratio * adv, ratio.clamp(1 - clip_eps, 1 + clip_eps) * adv
    surrogate = torch.min(unclipped, clipped)
    if ref_logprobs is None:
        kl = torch.zeros_like(ratio)
    else:
        # capping the log-ratio at 20 keeps exp finite (exp(20) ~ 5e8) when a drifted policy samples a token
        # the reference finds near-impossible; below the cap this is the exact k3 estimator
        log_ref_ratio = (ref_logprobs - logprobs).clamp(max=20.0)
        kl = (torch.exp(log_ref_ratio) - log_ref_ratio - 1).clamp_min(0)  # >= 0; the clamp only removes rounding
    loss = (-(surrogate - kl_beta * kl)).mean(dim=1).mean()
    with torch.no_grad():
        # the clip stops the gradient where r A is larger than the clipped value: r > 1+eps with A > 0,
        # r < 1-eps with A < 0
        clipped_out = ((ratio > 1 + clip_eps) & (adv > 0)) | ((ratio < 1 - clip_eps) & (adv < 0))
        metrics = {"policy_loss": -surrogate.mean(dim=1).mean().item(), "kl": kl.mean().item(),
                   "clip_frac": clipped_out.float().mean().item(), "ratio_min": ratio.min().item(),
                   "ratio_mean": ratio.mean().item(), "ratio_max": ratio.max().item()}
    return loss, metrics


# ---- 10. Update ---------------------------------------------------------------------------------

@torch.no_grad()
def reference_logprobs(ref_model, inputs: dict, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    """(G, N) log-probs under the reference: a frozen copy, or a LoRA policy with its adapter switched off."""
    if hasattr(ref_model, "disable_adapter"):
        with ref_model.disable_adapter():
            return token_logprobs(ref_model, inputs, tokens, temperature)
    return token_logprobs(ref_model, inputs, tokens, temperature)


def select_rows(inputs: dict, rows: slice) -> dict:
    """The AR inputs of samples `rows` of a group (image_grid_thw holds two grid rows per sample)."""
    return {"input_ids": inputs["input_ids"][rows], "attention_mask": inputs["attention_mask"][rows],
            "image_grid_thw": inputs["image_grid_thw"].view(-1, 2, 3)[rows].reshape(-1, 3),
            "images_per_sample": inputs["images_per_sample"][rows]}


def train_step(policy, optimizer, rollouts: list[Rollout], advantages: torch.Tensor, ref_model, *,
               temperature: float, clip_eps: float, kl_beta: float, micro_batch_size: int,
               max_grad_norm: float, mu: int = 1, train_tokens: str = "large") -> dict:
    """`mu` optimizer steps on P groups of rollouts with (P, G) advantages; returns metrics.

    Micro-batches of `micro_batch_size` sequences; each micro-batch loss is weighted by its share of
    the P*G sequences, so the accumulated gradient equals the full-batch gradient.
    """
    # transformers only checkpoints in train mode; disable_dropout makes train and eval mode the same distribution
    policy.train(policy.is_activation_checkpointing)
    # micro-batches: (AR inputs, tokens, sampler log-probs, advantages, number of preview tokens)
    batches = [(select_rows(r.inputs, rows), r.tokens[rows], r.logprobs[rows], adv[rows],
                r.preview_hw[0] * r.preview_hw[1])
               for r, adv in zip(rollouts, advantages)
               for rows in (slice(i, i + micro_batch_size) for i in range(0, len(adv), micro_batch_size))]
    n_seqs = advantages.numel()
    with torch.no_grad():
        # with mu = 1 the old policy IS the current one, so old = logp.detach() below (ratio exactly 1, the clip
        # idles); with mu > 1 the old log-probs are frozen before the first update and the clip starts to act
        olds = [token_logprobs(policy, inp, tok, temperature) for inp, tok, *_ in batches] if mu > 1 else None
        refs = ([reference_logprobs(ref_model, inp, tok, temperature) for inp, tok, *_ in batches]
                if kl_beta > 0 else None)
    ratio_min, ratio_max, gap, skipped = math.inf, -math.inf, 0.0, 0
    for _ in range(mu):
        optimizer.zero_grad(set_to_none=True)
        totals: dict[str, float] = {}
        finite = True
        for k, (inputs, tokens, sampled, adv, n_preview) in enumerate(batches):
            logp = token_logprobs(policy, inputs, tokens, temperature)  # (mb, N), with grad
            old = logp.detach() if olds is None else olds[k]
            gap = max(gap, (logp.detach() - sampled).abs().max().item())  # sampler vs trainer drift
            ref = None if refs is None else refs[k]
            regions = {"preview": slice(0, n_preview), "large": slice(n_preview, None)}
            cols = regions["large"] if train_tokens == "large" else slice(None)
            loss, m = grpo_loss(logp[:, cols], old[:, cols], None if ref is None else ref[:, cols], adv, clip_eps,
                                kl_beta)
            share = logp.shape[0] / n_seqs  # micro-batch losses are means; weight them to a full-batch mean
            finite = finite and bool(torch.isfinite(loss))
            if finite:
                (loss * share).backward()
            m["loss"] = loss.item()
            for name, cut in regions.items():  # diagnostics per region, whichever tokens the loss covers
                _, mr = grpo_loss(logp[:, cut].detach(), old[:, cut], None if ref is None else ref[:, cut], adv,
                                  clip_eps, kl_beta)
                m.update({f"{name}/logprob": logp[:, cut].mean().item(), f"{name}/kl": mr["kl"],
                          f"{name}/clip_frac": mr["clip_frac"]})
            ratio_min, ratio_max = min(ratio_min, m.pop("ratio_min")), max(ratio_max, m.pop("ratio_max"))
            for key, value in m.items():
                totals[key] = totals.get(key, 0.0) + value * share
        params = [p for group in optimizer.param_groups for p in group["params"]]
        totals["grad_norm"] = torch.nn.utils.clip_grad_norm_(params, max_grad_norm).item()
        if finite and math.isfinite(totals["grad_norm"]):
            optimizer.step()
        else:  # a NaN / inf loss or gradient never reaches the weights: this update is skipped
            optimizer.zero_grad(set_to_none=True)
            skipped += 1
    # extremes over all mu updates; sampler_gap is max |log pi_trainer - log pi_sampler| (0 up to float error
    # before the first update: larger means sampler and trainer disagree on the distribution)
    return {**totals, "ratio_min": ratio_min, "ratio_max": ratio_max, "sampler_gap": gap, "skipped": skipped}


# ---- 11. Main -----------------------------------------------------------------------------------

def validate(cfg: Config) -> None:
    """Raise ValueError with a one-line fix for a configuration that cannot run."""
    for name in ("height", "width"):
        value = getattr(cfg, name)
        if value <= 0 or value % 32:
            raise ValueError(f"--{name} {value} is not a positive multiple of 32 (GLM-Image tokens are 32x32 pixels)")
    if cfg.group_size < 2:
        raise ValueError(f"--group-size {cfg.group_size}: GRPO compares samples within a group; use 2 or more")
    if cfg.micro_batch_size < 1 or cfg.group_size % cfg.micro_batch_size:
        raise ValueError(f"--micro-batch-size {cfg.micro_batch_size} must divide --group-size {cfg.group_size}")
    if cfg.train_tokens not in ("large", "all"):
        raise ValueError(f"--train-tokens {cfg.train_tokens}: use 'large' or 'all'")
    for name, ok, rule in [("clip-eps", 0 < cfg.clip_eps < 1, "in (0, 1)"), ("kl-beta", cfg.kl_beta >= 0, ">= 0"),
                           ("lr", 0 < cfg.lr < 1, "in (0, 1)"), ("temperature", cfg.temperature > 0, "> 0"),
                           ("max-grad-norm", cfg.max_grad_norm > 0, "> 0"), ("lora-rank", cfg.lora_rank >= 0, ">= 0")]:
        if not ok:
            raise ValueError(f"--{name} {getattr(cfg, name.replace('-', '_'))} is out of range; it must be {rule}")
    for name in ("steps", "mu", "prompts_per_step", "num_inference_steps"):
        if getattr(cfg, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
    if cfg.dtype not in ("auto", "float32", "bfloat16") or cfg.device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"--dtype {cfg.dtype} / --device {cfg.device}: use auto|float32|bfloat16 / auto|cpu|cuda")
    parse_reward_weights(cfg.reward)


def fail(message: str) -> None:
    print(f"grpo.py: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def prepare(argv: list[str] | None) -> tuple[Config, list, list, Path]:
    """Parse and check everything before anything is written: config, prompts, targets, output directory."""
    cfg = parse_config(argv)
    out = Path(cfg.resume or cfg.out)
    try:
        if cfg.resume:
            if not (out / "checkpoint.pt").is_file() or not (out / "config.json").is_file():
                raise ValueError(f"--resume {out}: no checkpoint.pt there; resume a directory a run saved into")
            saved = Config(**json.loads((out / "config.json").read_text()))  # not the (large) checkpoint itself
            cfg = dataclasses.replace(saved, steps=cfg.steps, resume=cfg.resume, out=str(out))  # --steps is the total
        validate(cfg)
        examples = read_prompts(cfg.prompts)
        targets = [load_target(path, cfg.height, cfg.width) for _, path in examples]
        for _, path in examples:
            with Image.open(path) as image:  # reads the header only
                if image.size != (cfg.width, cfg.height):
                    print(f"note: target {path} is {image.size[0]}x{image.size[1]}, resized to {cfg.width}x"
                          f"{cfg.height}", file=sys.stderr)
        if not cfg.resume and not cfg.overwrite and any((out / name).exists() for name in RUN_FILES):
            raise ValueError(f"--out {out} holds another run; pass --resume {out} to continue it, --overwrite to "
                             "replace it, or another --out")
    except ValueError as error:
        fail(str(error))
    return cfg, examples, targets, out


def main(argv: list[str] | None = None) -> dict:
    import diffusers
    import transformers
    from tqdm.auto import tqdm
    diffusers.logging.set_verbosity_error()  # keep the terminal for our progress bar and one-line errors
    transformers.logging.set_verbosity_error()
    cfg, examples, targets, out = prepare(argv)
    device = ("cuda" if torch.cuda.is_available() else "cpu") if cfg.device == "auto" else cfg.device
    dtype = {"auto": torch.bfloat16 if device == "cuda" else torch.float32,
             "float32": torch.float32, "bfloat16": torch.bfloat16}[cfg.dtype]
    try:
        pipe = load_glm_image(cfg.model, device, dtype)
    except Exception as error:  # offline hub, wrong path, ...: one line, no traceback
        fail(f"cannot load --model {cfg.model} ({type(error).__name__}); offline? use --model tiny or a local path")
    policy = pipe.vision_language_encoder
    if cfg.lora_rank:
        policy = apply_lora(policy, cfg.lora_rank)  # adapters in float32 (peft's default), base weights frozen
    elif dtype != torch.float32:
        policy.float()  # trainable weights stay float32: AdamW updates to bf16 weights round away (RMSNorm freezes)
    if cfg.gradient_checkpointing:
        policy.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    if cfg.offload:
        move_decoder(pipe, "cpu")
    ref_model = reference_model(policy, cfg.kl_beta)  # taken before a checkpoint is loaded: the initial weights
    optimizer = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=cfg.lr,
                                  weight_decay=cfg.weight_decay)
    start = load_checkpoint(out / "checkpoint.pt", policy, optimizer) if cfg.resume else 0
    targets = [t.to(device) for t in targets]

    def precision():  # bf16 compute with float32 trainable weights, the same for sampling and training
        return torch.autocast(device, dtype=torch.bfloat16) if dtype == torch.bfloat16 else contextlib.nullcontext()

    history = open_run_dir(out, cfg, start)  # the metrics of the steps before `start` (resume), else []
    reward_weights, skipped = parse_reward_weights(cfg.reward), sum(h["skipped"] for h in history)
    step = start
    progress = tqdm(range(start, cfg.steps), desc="grpo", initial=start, total=cfg.steps)
    try:
        for step in progress:
            t0 = time.perf_counter()
            picks = [(step * cfg.prompts_per_step + j) % len(examples) for j in range(cfg.prompts_per_step)]
            with precision():
                rollouts = [sample_group(pipe, examples[i][0], cfg.group_size, cfg.height, cfg.width,
                                         cfg.temperature, seed=cfg.seed * 1_000_003 + step * cfg.prompts_per_step + j)
                            for j, i in enumerate(picks)]
            t1 = time.perf_counter()
            if cfg.offload:
                move_decoder(pipe, device)
            images = [decode_images(pipe, examples[i][0], r.tokens, r.large_hw, cfg.height, cfg.width,
                                    cfg.num_inference_steps, cfg.decode_seed, cfg.guidance_scale)
                      for i, r in zip(picks, rollouts)]
            if cfg.offload:
                move_decoder(pipe, "cpu")
            t2 = time.perf_counter()
            rewards = group_rewards(images, [targets[i] for i in picks], reward_weights)  # (P, G)
            advantages = group_advantages(rewards)
            t3 = time.perf_counter()
            with precision():
                metrics = train_step(policy, optimizer, rollouts, advantages, ref_model, temperature=cfg.temperature,
                                     clip_eps=cfg.clip_eps, kl_beta=cfg.kl_beta, micro_batch_size=cfg.micro_batch_size,
                                     max_grad_norm=cfg.max_grad_norm, mu=cfg.mu, train_tokens=cfg.train_tokens)
            t4 = time.perf_counter()
            skipped += metrics["skipped"]
            if metrics["skipped"]:
                progress.write(f"warning: step {step}: non-finite loss or gradient, update skipped ({skipped} so far)")
            record = {"step": step, "prompts": picks, "reward_mean": rewards.mean().item(),
                      "reward_std": rewards.std(dim=-1, unbiased=False).mean().item(),
                      "zero_std_groups": int((advantages == 0).all(dim=-1).sum()),  # groups with no signal
                      "distinct_samples": float(np.mean([len({tuple(t) for t in r.tokens.tolist()}) for r in rollouts])),
                      **metrics, "skipped_total": skipped,
                      "sec_sample": t1 - t0, "sec_decode": t2 - t1, "sec_reward": t3 - t2, "sec_train": t4 - t3}
            append_metrics(out, record)
            history.append(record)
            progress.set_postfix(reward=f"{record['reward_mean']:.3f}", kl=f"{record['kl']:.3f}")
            if cfg.image_every and (step % cfg.image_every == 0 or step == cfg.steps - 1):
                image_grid([targets[i] for i in picks], images, rewards).save(out / "images" / f"step_{step:05d}.png")
            if cfg.save_every and (step + 1) % cfg.save_every == 0:
                save_checkpoint(out / "checkpoint.pt", policy, optimizer, step + 1, cfg)
    except KeyboardInterrupt:
        progress.close()
        save_checkpoint(out / "checkpoint.pt", policy, optimizer, step, cfg)  # `step` did not finish: redo it
        print(f"interrupted: checkpoint at step {step} in {out}; continue with --resume {out}", file=sys.stderr)
        raise SystemExit(130)
    save_checkpoint(out / "checkpoint.pt", policy, optimizer, cfg.steps, cfg)
    save_pretrained_atomic(policy, out / "final")  # the full AR, or with --lora-rank only the adapter (peft format)
    window = min(len(history), len(examples) * math.ceil(5 / len(examples)))  # whole cycles over the prompts
    first, last = history[:window], history[-window:]
    summary = {"reward_first": float(np.mean([h["reward_mean"] for h in first])),
               "reward_last": float(np.mean([h["reward_mean"] for h in last])), "skipped": skipped}
    print(f"reward (mean of first {len(first)} steps) {summary['reward_first']:.4f} -> "
          f"(mean of last {len(last)} steps) {summary['reward_last']:.4f}; saved to {out}")
    return summary


if __name__ == "__main__":
    main()
