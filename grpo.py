"""GRPO on GLM-Image, in one file you can read top to bottom.

GLM-Image draws in two stages: an autoregressive model (the AR, a 9B GLM) writes a grid of visual
tokens, and a diffusion transformer (the DiT, 7B) paints pixels conditioned on them. This file
trains the AR with GRPO (Group Relative Policy Optimization, Shao et al. 2024): for each prompt q
(and, to edit, a source image), sample a group of G token sequences o_1..o_G, decode them to images,
score them (SSIM / -MSE to a target, or any function of the images) and maximise

    J = 1/G sum_i 1/|o_i| sum_t [ min(r_it A_i, clip(r_it, 1-eps, 1+eps) A_i) - beta KL_it ]

with r_it = pi(o_it | q, o_i<t) / pi_old(o_it | q, o_i<t), A_i = (R_i - mean(R)) / std(R) over the
group and KL_it the k3 estimator exp(ref - logp) - (ref - logp) - 1 against a frozen reference.

Where this departs from the paper (docs/ measures each): only the large grid (H/32 x W/32, drawn
after a preview grid) reaches the DiT, so only its tokens are in the loss; one definition of the
sampled distribution (`code_logprobs`), so pi / pi_old is exactly 1 at the first update; with top-p
the sampler draws from the nucleus q and the trained policy is the whole softmax p, with TRL's
mismatch weights for sampler drift; the AR's 3D rotary positions are replayed (`rope_positions`).
Copied alone it runs a step (helpers/: plumbing, fast decode, FSDP2); dit_grpo.py trains the DiT.

  python grpo.py --prompts prompts.txt                          # the tiny GLM-Image, on a CPU
  python grpo.py --prompts examples/shapes.txt --reward shapes  # draw what the caption asks
  python grpo.py --prompts my_prompts.txt --model zai-org/GLM-Image   # the real model (GPU, bf16)
  torchrun --nproc-per-node 8 grpo.py --prompts my_prompts.txt --model zai-org/GLM-Image   # 8 GPUs
"""

import contextlib
import copy
import dataclasses
import math
import sys
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

try:  # helpers/, beside this file: main's plumbing, the fast decode, FSDP2, rewards beyond pixels
    from helpers import diagnostics, fast_decode, run, setup
    from helpers.parallel import (all_agree, gather_rows, interrupts_held, merge_metrics,
                                  sync_gradients, unsharded)
    from helpers.rewards import MORE_REWARDS
except ModuleNotFoundError as missing:  # copied alone: one process (see the end of this file)
    if missing.name != "helpers":
        raise
    diagnostics = fast_decode = run = setup = None
    MORE_REWARDS = {}


# ---- 1. Config ----------------------------------------------------------------------------------
def arg(default, help: str, choices: tuple = ()):
    """A config field whose doc becomes its --help (and, if given, the values it may take)."""
    return dataclasses.field(default=default, metadata={"help": help, "choices": choices})

@dataclasses.dataclass
class Config:  # a field per flag (--group-size ...); None: MODEL_DEFAULTS fills it in
    # the algorithm: a group per prompt, its advantages, the clipped loss and the KL
    group_size: int | None = arg(None, "samples per prompt (G) (default 8 tiny, 4 real)")
    prompts_per_step: int | None = arg(None, "prompts (groups) per step (default 2 tiny, 1 real)")
    reward: str = arg("ssim=1,mse=0", "rewards and weights, e.g. ssim=1,ocr=0.5 (docs/rewards.md)")
    scale_rewards: str = arg("group", "advantages / std of the group, batch or none (Dr. GRPO)",
                             ("group", "batch", "none"))
    diversity: float = arg(0.0, "bonus / c on each reward, c its group's same-grid samples")
    unlikeliness: float = arg(0.0, "He et al.: +-U/2 among a group's best, to the least likely")
    clip_eps: float = arg(0.2, "PPO clip: the ratio is clipped to [1 - eps, 1 + eps_high]")
    clip_eps_high: float | None = arg(None, "upper clip (DAPO's clip-higher; default: --clip-eps)")
    kl_beta: float | None = arg(None, "weight of the KL to the reference (0.1 tiny, 0.04 real)")
    kl_on: str = arg("all", "the KL on every sample or on those with A >= 0", ("all", "above_mean"))
    entropy_bonus: float = arg(0.0, "EG-GRPO: + bonus x entropy on the less certain tokens")
    mu: int | None = arg(None, "updates per batch; > 1 lets the clip act (default 2 tiny, 1 real)")
    lr: float | None = arg(None, "AdamW lr (default 1e-4 tiny, 1e-5 real)")
    steps: int = arg(100, "optimizer steps")
    micro_batch_size: int | None = arg(None, "sequences per pass (default: G tiny, 1 real)")
    train_tokens: str = arg("large", "tokens in the loss: large | all", ("large", "all"))
    # sampling, and what the loss does about top-k / top-p and the sampler's rounding
    temperature: float = arg(0.9, "sampling temperature (GLM-Image: 0.9)")
    top_p: float | None = arg(None, "nucleus sampling (default 1.0 tiny: off, 0.75 real)")
    top_k: int = arg(0, "sample from the k most likely codes only (0: off)")
    policy_dist: str = arg("full", "trained: the full softmax or the sampler's truncated one "
                                   "(docs/real_model.md)", ("full", "truncated"))
    sampler_correction: str = arg("token_truncate", "mismatch weights pi_old / pi_sampler on the "
                                  "trained distribution (TRL's TIS / MIS)", ("token_truncate",
                                  "token_mask", "sequence_truncate", "sequence_mask", "none"))
    sampler_cap: float = arg(2.0, "weights above it are cut to it (truncate) or to 0 (mask)")
    truncation_weight: str = arg("none", "--policy-dist full, top-k / top-p: tokens weighed by "
                                         "their nucleus' mass (p / q) or not", ("mass", "none"))
    seed: int = arg(0, "seed of the AR sampling")
    # the model, the images, the data
    prompts: str = arg("prompts.txt", "'prompt | target.png' lines, or .jsonl (docs/editing.md)")
    model: str = arg("tiny", "hub id, folder, tiny, tiny-edit, or random (published configs)")
    height: int | None = arg(None, "image height (default 96 tiny, 1024 real)")
    width: int | None = arg(None, "image width (default 96 tiny, 1024 real)")
    num_inference_steps: int | None = arg(None, "DiT denoising steps (default 2 tiny, 50 real)")
    guidance_scale: float | None = arg(None, "DiT guidance (default 1.0 tiny, 1.5 real)")
    decode_seed: int = arg(0, "seed of the DiT latent noise (fixed per run)")
    lora_rank: int | None = arg(None, "LoRA rank, 0: train every weight (default 0 tiny, 16 real)")
    weight_decay: float = arg(0.01, "AdamW weight decay")
    max_grad_norm: float = arg(1.0, "gradient-norm clip")
    before_after: int | None = arg(None, "N prompts drawn before/after (default 4 tiny, 0 real)")
    gradient_checkpointing: bool | None = arg(None, "recompute activations in the backward")
    offload: bool = arg(False, "keep DiT, VAE, T5 on CPU except to decode")
    # and the run's: --out, --eval-prompts, --save-every, --resume, --device ... (helpers/run.py)

TINY = Path(__file__).resolve().parent / "tiny_glm_image"  # pre-trained by tools/train_tiny.py
# the tiny model and its editing sibling (tools/train_tiny_edit.py: an AR that edits, the same DiT)
TINY_MODELS = {"tiny": TINY, "tiny-edit": TINY.with_name("tiny_glm_image_edit")}

MODEL_DEFAULTS = {  # where the command line left a field at None; the tiny demo runs the whole loss
    "tiny": dict(lr=1e-4, kl_beta=0.1, mu=2, height=96, width=96, top_p=1.0,
                 num_inference_steps=2, guidance_scale=1.0, group_size=8, prompts_per_step=2,
                 lora_rank=0, before_after=4, gradient_checkpointing=False),
    # LoRA r=16 with micro-batches of 1 fits one 80 GB GPU (docs/real_model.md: the memory plan)
    "real": dict(lr=1e-5, kl_beta=0.04, mu=1, height=1024, width=1024, top_p=0.75,
                 num_inference_steps=50, guidance_scale=1.5, group_size=4, prompts_per_step=1,
                 micro_batch_size=1, lora_rank=16, before_after=0, gradient_checkpointing=False),
}

def parse_config(argv: list[str] | None = None) -> Config:
    """Command line -> Config (helpers/run.py builds the parser): a flag per field."""
    if run is None:  # grpo.py copied alone
        raise SystemExit("grpo.py: parse_config needs helpers/ beside grpo.py; copied alone, build "
                         "the config in code: with_defaults(Config(model='tiny', ...))")
    config = run.with_run_settings(Config)  # + the run's fields: --out, --resume, --device ...
    return with_defaults(config(**vars(run.config_parser(config).parse_args(argv))))

def with_defaults(cfg: Config) -> Config:
    """`cfg` with its None fields from MODEL_DEFAULTS: the tiny model's or the real one's."""
    defaults = dict(MODEL_DEFAULTS["tiny" if cfg.model in TINY_MODELS else "real"])
    defaults.setdefault("micro_batch_size", cfg.group_size or defaults["group_size"])  # tiny: G
    return dataclasses.replace(cfg, **{k: v for k, v in defaults.items() if getattr(cfg, k) is None})


# ---- 2. Loading GLM-Image -----------------------------------------------------------------------
def load_glm_image(name: str, device: str = "cpu", dtype: torch.dtype = torch.float32):
    """GlmImagePipeline from a hub id, a folder or TINY_MODELS; 'random[:L]': GLM-Image built from
    its published configs, random weights, L layers a part (helpers/offline_model.py)."""
    from diffusers import GlmImagePipeline
    if name.split(":")[0] == "random":
        from helpers.offline_model import random_glm_image
        return only_ar_trains(random_glm_image(name, device, dtype))
    return only_ar_trains(GlmImagePipeline.from_pretrained(TINY_MODELS.get(name, name),
                                                           dtype=dtype).to(device))

def only_ar_trains(pipe):
    """Freeze all but the AR (its vision tower and VQ only encode sources); eval, no dropout."""
    pipe.set_progress_bar_config(disable=True)
    ar = pipe.vision_language_encoder.eval()  # models built in code start in train mode
    for module in (pipe.text_encoder, pipe.transformer, pipe.vae, ar.model.visual, ar.model.vqmodel):
        module.requires_grad_(False).eval()
    disable_dropout(ar)
    return pipe

def disable_dropout(model) -> None:
    """Zero every dropout (GLM-Image's are 0): dropout in training only would make pi != pi_old."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        if isinstance(getattr(module, "attention_dropout", None), float):
            module.attention_dropout = 0.0

def reference_model(policy, kl_beta: float):
    """The KL reference: None when beta = 0; with LoRA the policy (adapter off), else a copy."""
    if kl_beta == 0 or hasattr(policy, "disable_adapter"):
        return None if kl_beta == 0 else policy
    return copy.deepcopy(policy).requires_grad_(False).eval()


# ---- 3. Group sampling --------------------------------------------------------------------------
class Source(NamedTuple):
    image: Image.Image  # the image being edited, as the DiT's VAE sees it
    codes: torch.Tensor  # (h_s * w_s,) long, its VQ codes from the AR's vision tower
    grid_hw: tuple[int, int]  # (h_s, w_s) = its size / 32

class Prompt(NamedTuple):  # one prompt's group, ready for the AR (group_prompt)
    inputs: dict  # input_ids, attention_mask (G, L), image_grid_thw (2G, 3), images_per_sample
    preview_hw: tuple[int, int]  # the grid the AR writes FIRST (h', w'); (0, 0) when editing
    large_hw: tuple[int, int]  # the grid it writes last (H/32, W/32): the only one the DiT sees
    source: Source | None  # the image being edited, or None (text-to-image)

class Rollout(NamedTuple):  # a group's samples (sample_groups): the Prompt's fields after the draws
    tokens: torch.Tensor  # (G, N) long codes: preview grid then large grid (editing: large only)
    logprobs: torch.Tensor  # (G, N) float32, each token's log-prob under what it was drawn from (q)
    full_logprobs: torch.Tensor  # (G, N) float32, under the whole softmax (p; = q without top-k/p)
    inputs: dict
    preview_hw: tuple[int, int]
    large_hw: tuple[int, int]
    source: Source | None
    support: torch.Tensor | None = None  # (G, N, K/8) bits of each draw's kept codes (fast_decode)

def code_logprobs(logits: torch.Tensor, temperature: float, codebook_size: int, top_k: int = 0,
                  top_p: float = 1.0, support: torch.Tensor | None = None) -> torch.Tensor:
    """(..., V) AR logits -> (..., K) float32 log-probs over the codebook: softmax(logits / T) cut
    to `top_k` / `top_p` (or to the sampler's kept codes, a (..., K) bool `support`), renormalised,
    -inf outside. One definition of the policy: the sampler draws from it, the trainer scores it."""
    scores = logits[..., :codebook_size].float() / temperature  # ids >= K are never drawn
    if support is not None:
        return torch.log_softmax(scores.masked_fill(~support, -math.inf), dim=-1)
    if 0 < top_k < codebook_size:  # as transformers' TopKLogitsWarper
        scores = scores.masked_fill(scores < scores.topk(top_k, dim=-1).values[..., -1:], -math.inf)
    if top_p < 1.0:  # as TopPLogitsWarper: drop the least likely codes while their sum <= 1 - p
        ascending, order = scores.sort(dim=-1, stable=True)  # order[j]: the code in place j
        drop = ascending.softmax(dim=-1).cumsum(dim=-1) <= 1 - top_p
        drop[..., -1] = False  # the most likely code always stays
        # unsort, code order[j] gets drop[j]: scores [2, 0, 1] sort to order [1, 2, 0]; at p 0.75
        # place 0 goes (its share 0.09 <= 0.25), so code 1 does: [False, True, False]
        scores = scores.masked_fill(drop.scatter(-1, order, drop), -math.inf)
    return torch.log_softmax(scores, dim=-1)

def group_inputs(processor, prompt: str, group_size: int, height: int, width: int, device,
                 source: Image.Image | None = None) -> dict:
    """One prompt (and an image to edit) -> its AR inputs repeated G times (Prompt.inputs; editing:
    and the source's pixel_values), image_grid_thw a sample's rows together: [large, preview]."""
    content = [{"type": "image", "image": source}] if source is not None else []
    one = processor.apply_chat_template(
        [[{"role": "user", "content": content + [{"type": "text", "text": prompt}]}]],
        tokenize=True, return_dict=True,
        processor_kwargs=dict(target_h=height, target_w=width, return_tensors="pt"))
    inputs = {k: one[k].repeat(group_size, 1).to(device)
              for k in ("input_ids", "attention_mask", "image_grid_thw")}
    inputs["images_per_sample"] = one["images_per_sample"].repeat(group_size).to(device)
    if source is not None:
        inputs["pixel_values"] = one["pixel_values"].to(device)
    return inputs

@torch.no_grad()
def encode_source(model, inputs: dict, source: Image.Image) -> tuple[dict, Source]:
    """The source's VQ codes written into input_ids in place of its placeholders, ONCE per group (as
    GlmImageModel.forward does with pixel_values): sampler and trainer see the same tokens."""
    core, grid = model.model, inputs["image_grid_thw"][:1]  # (1, 3): the source row of sample 0
    features = core.get_image_features(inputs["pixel_values"], grid, return_dict=True).pooler_output
    codes = core.get_image_tokens(features).view(-1)  # (h_s * w_s,)
    ids = inputs["input_ids"]
    filled = ids.masked_scatter(ids == model.config.image_token_id, codes.repeat(ids.shape[0]))
    inputs = {k: v for k, v in inputs.items() if k != "pixel_values"} | {"input_ids": filled}
    (_, h, w) = grid[0].tolist()
    if (32 * h, 32 * w) != (source.height, source.width):  # the DiT needs the source at size / 32
        raise ValueError(f"the processor made a {h}x{w} token grid of a {source.width}x"
                         f"{source.height} source; the DiT needs size / 32: resize the sources")
    return inputs, Source(source, codes, (h, w))

def to_pil(image: torch.Tensor) -> Image.Image:
    """(3, H, W) float in [0, 1] -> PIL (exact for 8-bit images)."""
    array = (image.float().clamp(0, 1).permute(1, 2, 0).cpu().numpy() * 255).round()
    return Image.fromarray(array.astype(np.uint8))

def group_prompt(pipe, prompt: str, group_size: int, height: int, width: int,
                 source: torch.Tensor | None = None) -> Prompt:
    """One prompt (and a (3, H, W) source to edit) -> its group's Prompt. The processor lists a
    sample's grids as [large, preview] (or [source, large]), but the AR WRITES the preview first: at
    96x96 [1, 3, 3], [1, 16, 16]: the 16x16 preview, then the 3x3 large grid (N = 256 + 9)."""
    model = pipe.vision_language_encoder
    image = to_pil(source) if source is not None else None
    inputs = group_inputs(pipe.processor, prompt, group_size, height, width, model.device, image)
    listed = [tuple(row[1:]) for row in inputs["image_grid_thw"][:2].tolist()]  # sample 0's grids
    if image is None:  # [large, preview]
        return Prompt(inputs, preview_hw=listed[1], large_hw=listed[0], source=None)
    inputs, src = encode_source(model, inputs, image)  # [source, large]
    return Prompt(inputs, preview_hw=(0, 0), large_hw=listed[1], source=src)

def rope_positions(input_ids: torch.Tensor, image_grid_thw: torch.Tensor, num_tokens: int,
                   image_start_id: int, image_end_id: int) -> torch.Tensor:
    """3D rotary positions (3, 1, L + N - 1) of an L-token prompt and its N tokens but the last, as
    GlmImageModel.get_rope_index gives generate: text is a ramp on all 3 axes; a grid h x w at p
    puts cell (row, col) at (p, p + row, p + col) and the ramp resumes at p + max(h, w). Generated
    grids come in REVERSE order of image_grid_thw (text-to-image: preview, then large). Example:
    a 5-token prompt, then a 2x3 preview and a 4x4 large grid (image_grid_thw [[1,4,4], [1,2,3]]):
        prompt  (0,0,0) (1,1,1) (2,2,2) (3,3,3) (4,4,4)
        preview (5,5,5) (5,5,6) (5,5,7) (5,6,5) (5,6,6) (5,6,7)        the ramp resumes at 5 + 3
        large   (8,8,8) (8,8,9) (8,8,10) (8,8,11) (8,9,8) ... (8,11,11)  (its last is never fed)"""
    ids = input_ids.tolist()
    starts = [i + 1 for i, t in enumerate(ids) if t == image_start_id]  # each image's first token
    ends = [i for i, t in enumerate(ids) if t == image_end_id]  # a source image has an end
    grids = [tuple(row[1:]) for row in image_grid_thw.tolist()]

    def grid(p, h, w):  # (3, h*w): t = p, rows and columns offset from p
        rows, cols = torch.arange(h).repeat_interleave(w), torch.arange(w).repeat(h)
        return torch.stack([torch.full_like(rows, p), p + rows, p + cols])

    positions, p, done = [], 0, 0  # p: the next position; done: prompt tokens placed so far
    for start, end, (h, w) in zip(starts, ends, grids):  # the source images, in order
        text = start - done  # the prompt's tokens before this image (its start token included)
        positions += [torch.arange(p, p + text).expand(3, -1), grid(p + text, h, w)]
        p, done = p + text + max(h, w), end
    positions.append(torch.arange(p, p + len(ids) - done).expand(3, -1))  # the rest of the prompt
    p += len(ids) - done
    for h, w in reversed(grids[len(ends):]):  # the generated grids
        positions.append(grid(p, h, w))
        p += max(h, w)
    positions = torch.cat(positions, dim=1)[:, : len(ids) + num_tokens - 1]  # the last: never fed
    return positions[:, None, :].to(image_grid_thw.device)  # (3, 1, L+N-1)

@torch.no_grad()
def generate(model, group: Prompt, temperature: float, seed: int, top_k: int = 0,
             top_p: float = 1.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The AR's decode loop, as nanoGPT's generate: prefill the prompt once, then N steps of logits
    -> code_logprobs -> draw -> append, a KV cache holding the past -> (G, N) codes, their log-probs
    under q (what the draw used: top-k / top-p) and under p (the whole softmax). A draw is the race
    torch.multinomial runs over all V ids: transformers' generate and fast_decode draw the same."""
    from transformers import DynamicCache
    ids = group.inputs["input_ids"]  # (G, L): one L-token prompt, G times
    (G, L), (h0, w0), (h, w) = ids.shape, group.preview_hw, group.large_hw
    N, K, V = h0 * w0 + h * w, model.config.vq_config.num_embeddings, model.lm_head.out_features
    grids = group.inputs["image_grid_thw"][:int(group.inputs["images_per_sample"][0])]
    positions = rope_positions(ids[0], grids, N, model.config.image_start_token_id,
                               model.config.image_end_token_id).expand(-1, G, -1)  # (3, G, L+N-1)
    generator = torch.Generator(ids.device).manual_seed(seed)
    cache, fed, at = DynamicCache(config=model.config.text_config), ids, slice(0, L)
    drawn = []  # each step's (G, 1) codes and their log-probs under q and under p
    for t in range(N):
        logits = model(input_ids=fed, position_ids=positions[:, :, at], cache=cache,
                       logits_to_keep=1).logits[:, -1]  # (G, V): the next token's, cache updated
        q = code_logprobs(logits, temperature, K, top_k, top_p)  # (G, K): what the draw uses
        p = code_logprobs(logits, temperature, K)  # the whole softmax (= q without top-k / top-p)
        noise = torch.empty(G, V, device=ids.device).exponential_(generator=generator)[:, :K]
        fed = (q.exp() / noise).argmax(dim=-1, keepdim=True)  # (G, 1) = torch.multinomial(q, 1)
        drawn.append((fed, q.gather(-1, fed), p.gather(-1, fed)))
        at = slice(L + t, L + t + 1)  # the token just drawn is fed next, at its own position
    return tuple(torch.cat(column, dim=1) for column in zip(*drawn))  # (G, N) each

@torch.no_grad()
def sample_groups(pipe, prompts: list[str], group_size: int, height: int, width: int,
                  temperature: float, seeds: list[int], sources: list | None = None, top_k: int = 0,
                  top_p: float = 1.0) -> list[Rollout]:
    """G samples for each of P prompts (and sources to edit), group p from seeds[p]: `generate` a
    group at a time, or helpers/fast_decode.py's same tokens, faster (all in one padded decode)."""
    model = pipe.vision_language_encoder.eval()  # no dropout: one distribution
    groups = [group_prompt(pipe, prompt, group_size, height, width, source)
              for prompt, source in zip(prompts, sources or [None] * len(prompts))]
    if fast_decode is None:  # grpo.py copied alone: the lesson's loop
        drawn = [(*generate(model, group, temperature, seed, top_k, top_p), None)
                 for group, seed in zip(groups, seeds)]
    else:
        drawn = fast_decode.sample_groups(model, groups, temperature, seeds, top_k, top_p, prompts,
                                          code_logprobs, rope_positions)
    return [Rollout(*d[:3], *group, support=d[3]) for d, group in zip(drawn, groups)]


# ---- 4. Log-probs of given tokens ---------------------------------------------------------------
def token_logprobs(model, inputs: dict, tokens: torch.Tensor, temperature: float, top_k: int = 0,
                   top_p: float = 1.0, support: torch.Tensor | None = None) -> torch.Tensor:
    """(S, N) float32 log-probs of `tokens` from one teacher-forced forward, under code_logprobs
    (over the sampler's kept codes, a (S, N, K) bool `support`, when given). Differentiable."""
    K = model.config.vq_config.num_embeddings
    logits = token_logits(model, inputs, tokens)  # (S, N, V)
    return logprob_of(code_logprobs(logits, temperature, K, top_k, top_p, support), tokens)

def logprob_of(distribution: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """(S, N, K) log-probs of every code, (S, N) tokens -> (S, N) each token's log-prob."""
    return distribution.gather(-1, tokens[..., None]).squeeze(-1)

def token_logits(model, inputs: dict, tokens: torch.Tensor) -> torch.Tensor:
    """(S, N, V) logits that predict each of `tokens`, S samples of ONE prompt (its group's inputs):
    one teacher-forced forward at generation's positions (rope_positions, not the text ramp)."""
    ids, (S, N) = inputs["input_ids"], tokens.shape
    if not (ids == ids[:1]).all():
        raise ValueError("token_logits scores one prompt's samples: call it once per group")
    input_ids = torch.cat([ids[:1].expand(S, -1), tokens[:, :-1]], dim=1)  # (S, L+N-1)
    grids = inputs["image_grid_thw"][:int(inputs["images_per_sample"][0])]  # a sample's grid rows
    positions = rope_positions(ids[0], grids, N, model.config.image_start_token_id,
                               model.config.image_end_token_id).expand(-1, S, -1)
    return model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),  # no padding
                 position_ids=positions, use_cache=False, logits_to_keep=N).logits  # (S, N, V)


# ---- 5. Decoding tokens to images ---------------------------------------------------------------
def prior_ids(tokens: torch.Tensor, large_hw: tuple[int, int]) -> torch.Tensor:
    """(G, N) tokens -> (G, 4hw) the DiT's prior ids: the large grid upsampled 2x (nearest)."""
    G, (h, w) = tokens.shape[0], large_hw
    large = tokens[:, -h * w:].reshape(G, 1, h, w).float()  # the large grid: (G, 1, H/32, W/32)
    return F.interpolate(large, scale_factor=2, mode="nearest").long().reshape(G, -1)

@torch.no_grad()
def decode_images(pipe, prompt: str, tokens: torch.Tensor, large_hw: tuple[int, int], height: int,
                  width: int, num_inference_steps: int, seed: int, guidance_scale: float = 1.5,
                  source: Source | None = None) -> torch.Tensor:
    """(G, N) tokens -> (G, 3, H, W) float32 images in [0, 1] by the pipeline (prior ids, DiT, VAE;
    editing: and the source), the group from one latent noise: images differ by tokens only."""
    G, device, dtype = tokens.shape[0], pipe.transformer.device, pipe.transformer.dtype
    prior = prior_ids(tokens, large_hw)  # (G, 4hw) at H/16
    embeds, negative = pipe.encode_prompt(prompt, do_classifier_free_guidance=guidance_scale > 1,
                                          device=device, dtype=dtype)
    f, generator = pipe.vae_scale_factor, torch.Generator("cpu").manual_seed(seed)
    shape = (1, pipe.transformer.config.in_channels, height // f, width // f)  # one noise for all G
    latents = torch.randn(shape, generator=generator).to(device, dtype).repeat(G, 1, 1, 1)
    edit = {}
    if source is not None:  # one copy per sample: the pipeline's batch is the group
        (hs, ws), codes = source.grid_hw, prior_ids(source.codes[None], source.grid_hw)[0]
        edit = dict(image=[[source.image]] * G, prior_token_image_ids=[codes.to(device)] * G,
                    source_image_grid_thw=[torch.tensor([[1, 2 * hs, 2 * ws]], device=device)] * G)
    images = pipe(prompt_embeds=embeds.repeat(G, 1, 1),
                  negative_prompt_embeds=None if negative is None else negative.repeat(G, 1, 1),
                  prior_token_ids=prior, latents=latents, height=height, width=width,
                  num_inference_steps=num_inference_steps, guidance_scale=guidance_scale,
                  output_type="pt", **edit).images
    return images.float().clamp(0, 1)  # (G, 3, H, W)


# ---- 6. Rewards ---------------------------------------------------------------------------------
# A reward: any fn(images, example) -> (G,) float, higher is better; images (G, 3, H, W) float32 in
# [0, 1], example a prompts line ("target": a (3, H, W) tensor or None); fn.needs: fields it needs.
def mse_reward(images: torch.Tensor, example: dict) -> torch.Tensor:
    """(G, 3, H, W) in [0, 1], example["target"] (3, H, W) -> (G,) -MSE, in [-1, 0]."""
    return -((images - example["target"]) ** 2).mean(dim=(1, 2, 3))

def ssim_reward(images: torch.Tensor, example: dict) -> torch.Tensor:
    """(G, 3, H, W) in [0, 1], example["target"] (3, H, W) -> (G,) SSIM (Wang et al. 2004) in
    [-1, 1]: 11-tap Gaussian window (sigma 1.5), K1 0.01, K2 0.03, valid windows."""
    C1, C2 = 0.01 ** 2, 0.03 ** 2
    g = torch.exp(-((torch.arange(11, dtype=torch.float32) - 5) ** 2) / (2 * 1.5 ** 2))
    g = (g / g.sum()).to(images.device)
    window = (g[:, None] * g[None, :]).expand(3, 1, 11, 11)  # (3, 1, 11, 11), one per channel
    x, y = images.float(), example["target"].float().expand_as(images)  # (G, 3, H, W)
    # local means and second moments: each map blurred by the window -> (G, 3, H-10, W-10)
    mu_x, mu_y, xx, yy, xy = (F.conv2d(m, window, groups=3) for m in (x, y, x * x, y * y, x * y))
    var_x, var_y, cov = xx - mu_x ** 2, yy - mu_y ** 2, xy - mu_x * mu_y
    ssim_map = (((2 * mu_x * mu_y + C1) * (2 * cov + C2))
                / ((mu_x ** 2 + mu_y ** 2 + C1) * (var_x + var_y + C2)))
    return ssim_map.mean(dim=(1, 2, 3))

mse_reward.needs = ssim_reward.needs = ("target",)  # checked in every example before a run starts
REWARDS = {"ssim": ssim_reward, "mse": mse_reward, **MORE_REWARDS}  # helpers/rewards.py: ocr, ...

def group_rewards(images: list[torch.Tensor], examples: list[dict], rewards: dict[str, tuple]
                  ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """P groups of (G, 3, H, W) images and their examples -> (P, G) weighted sum, each reward's."""
    each = {name: torch.stack([fn(group, example).float().reshape(-1).to(group.device)
                               for group, example in zip(images, examples, strict=True)])
            for name, (fn, _) in rewards.items()}
    total = sum(w * each[name] for name, (_, w) in rewards.items())
    return total, each


# ---- 7. Advantages ------------------------------------------------------------------------------
def group_advantages(rewards: torch.Tensor, eps: float = 1e-6, scale: str = "group",
                     batch: torch.Tensor | None = None) -> torch.Tensor:
    """(P, G) or (G,) rewards R -> advantages A_i = (R_i - mean(R)) / std(R) within each group.
    Variants: the std of the whole step ("batch") or none ("none": Dr. GRPO). A group with no
    spread (rounding) gets zeros. The std is the population std (/ G; TRL's: / (G - 1))."""
    mean, std = rewards.mean(-1, keepdim=True), rewards.std(-1, unbiased=False, keepdim=True)
    spread = std > eps * rewards.abs().amax(dim=-1, keepdim=True)
    if scale == "batch":
        std = (rewards if batch is None else batch).std(unbiased=False)
    elif scale == "none":
        std = torch.ones_like(std)
    z = (rewards - mean) / std.clamp_min(torch.finfo(std.dtype).tiny)
    return torch.where(spread, z, torch.zeros_like(rewards))

def repeats(grids: list[torch.Tensor]) -> torch.Tensor:
    """Each group's (G, n) large grids -> (P, G) c, how many drew that grid (bonus: diversity/c)."""
    return torch.stack([(g[:, None] == g[None]).all(-1).sum(-1) for g in grids])

def score(images: list[torch.Tensor], batch: list[dict], rewards: dict, scale: str = "group",
          grids: list | None = None, diversity: float = 0.0, unlikeliness: float = 0.0,
          logprobs: list | None = None) -> tuple:
    """Steps 3-4: P groups of images -> (P, G) rewards, each reward's, and the advantages: z-scores
    of the rewards plus the diversity bonus (`grids`: each group's large grids), then each group's
    best samples' credit moved to the least likely (`logprobs`: a group's (G, N), the grid last)."""
    reward, each = group_rewards(images, batch, rewards)  # 3. score them: (P, G)
    shaped = reward + diversity / repeats(grids).to(reward) if diversity > 0 else reward
    everyone = gather_rows(shaped) if scale == "batch" else None
    advantages = group_advantages(shaped, scale=scale, batch=everyone)  # 4. advantages
    if unlikeliness > 0:  # He et al. (arXiv 2506.02355), after the z-score: inside, an all-right
        best = reward == reward.amax(dim=-1, keepdim=True)  # group's move is a whole advantage
        loglik = torch.stack([lp[:, -g.shape[1]:].sum(-1) for lp, g in zip(logprobs, grids)])
        rank = torch.where(best, loglik, math.inf).argsort(dim=-1, stable=True).argsort(-1)
        k = best.sum(-1, keepdim=True)  # ranks 0 .. k - 1 over the best -> +U/2 .. -U/2; sum kept
        advantages -= unlikeliness * (rank / (k - 1).clamp_min(1) - 0.5) * best * (k > 1)
    return reward, each, advantages


# ---- 8. Loss ------------------------------------------------------------------------------------
def grpo_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, ref_logprobs: torch.Tensor | None,
              advantages: torch.Tensor, clip_eps: float | tuple[float, float], kl_beta: float,
              weights: torch.Tensor | None = None, mass: torch.Tensor | None = None,
              kl_on: str = "all") -> tuple[torch.Tensor, dict]:
    """(S, T) log-probs, (S,) advantages -> the loss -(min(r A, clip(r) A) * weights - beta k3 KL)
    * mass, averaged over a sequence's tokens, then over sequences (1/|o_i|); metrics (policy_loss,
    kl: unweighted). `weights` (sampler_correction) scale the surrogate only, as TRL's; `mass`
    (truncation_weights) the whole term; kl_on "above_mean": the mistakes go free (A < 0, no KL)."""
    # a token the old policy could not draw (-inf: outside its truncation): ratio 1, no gradient
    ratio = torch.exp(torch.where(old_logprobs.isneginf(), 0.0, logprobs - old_logprobs))  # (S, T)
    adv = advantages[:, None].to(ratio)  # (S, 1), on the log-probs' device
    low, high = clip_eps if isinstance(clip_eps, tuple) else (clip_eps, clip_eps)
    unclipped, clipped = ratio * adv, ratio.clamp(1 - low, 1 + high) * adv
    surrogate = torch.min(unclipped, clipped) * (1.0 if weights is None else weights)
    kl = torch.zeros_like(ratio) if ref_logprobs is None else k3_kl(logprobs, ref_logprobs)
    gate = (adv >= 0).to(kl) if kl_on == "above_mean" else 1.0  # (S, 1): the KL's samples
    per_token = (surrogate - kl_beta * kl * gate) * (1.0 if mass is None else mass)
    loss = -per_token.mean(dim=1).mean()
    with torch.no_grad():  # the clip stops the gradient: r > 1+eps with A > 0, r < 1-eps with A < 0
        clipped_out = ((ratio > 1 + high) & (adv > 0)) | ((ratio < 1 - low) & (adv < 0))
        metrics = {"policy_loss": -surrogate.mean(dim=1).mean().item(), "kl": kl.mean().item(),
                   "clip_frac": clipped_out.float().mean().item(), "ratio_min": ratio.min().item(),
                   "ratio_mean": ratio.mean().item(), "ratio_max": ratio.max().item()}
    return loss, metrics

def k3_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """(S, T) -> k3 = exp(d) - d - 1, d = ref - logp (Schulman): >= 0, unbiased for KL(pi||ref), its
    gradient KL(ref || pi)'s; d capped at +-20 (tools/bench_kl_cap.py), 0 outside a truncation."""
    d = (ref_logprobs - logprobs).clamp(-20.0, 20.0)
    kl = (torch.exp(d) - d - 1).clamp_min(0)  # >= 0; the clamp only removes rounding
    return torch.where(logprobs.isfinite(), kl, 0.0)

def sampler_correction(old_logprobs: torch.Tensor, sampled_logprobs: torch.Tensor,
                       mode: str = "token_truncate", cap: float = 2.0) -> torch.Tensor:
    """TRL's mismatch weights: (S, T) log-probs of ONE distribution (the trained one) by the trainer
    (pi_old) and the sampler (kernels, bf16) -> pi_old / pi_sampler per token or sequence, capped at
    `cap` (*_truncate) or 0 above it (*_mask); an exact sampler gets 1 (float32: 1 +- 1e-4)."""
    both = old_logprobs.isfinite() & sampled_logprobs.isfinite()  # outside a truncation: no ratio
    log_ratio = torch.where(both, old_logprobs - sampled_logprobs, 0.0)  # (S, T)
    level = log_ratio.sum(dim=1, keepdim=True) if mode.startswith("sequence") else log_ratio
    ratio = torch.exp(level.clamp(max=20.0))  # a sequence's sum can be large: exp stays finite
    return (ratio.clamp(max=cap) if mode.endswith("truncate") else ratio.masked_fill(ratio > cap, 0)
            if mode.endswith("mask") else torch.ones_like(ratio)).detach()

def truncation_weights(sampled: torch.Tensor, sampled_full: torch.Tensor, mode: str = "none"
                       ) -> torch.Tensor:
    """(S, T) log-probs of the drawn tokens under the sampler's nucleus q and its whole softmax p ->
    per-token weights p / q = Z_t, the mass p puts on the nucleus ("mass": q's samples weighed to
    p's objective), or 1 ("none": top-k / top-p ignored, as in TRL and verl). No truncation: 1."""
    mass = torch.exp(torch.where(sampled.isfinite(), sampled_full - sampled, 0.0)).clamp(max=1.0)
    return mass if mode == "mass" else torch.ones_like(mass)

class MicroBatch(NamedTuple):
    inputs: dict  # its group's AR inputs (one prompt)
    tokens: torch.Tensor  # (mb, N) the sampled codes
    sampled: torch.Tensor  # (mb, N) their log-probs under the sampler's q (what it drew from)
    sampled_full: torch.Tensor  # (mb, N) under the sampler's whole softmax p
    support: torch.Tensor | None  # (mb, N, K) bool: the codes each draw kept (None: recompute)
    advantages: torch.Tensor  # (mb,)
    n_preview: int  # the preview grid's tokens, first in `tokens` (0 when editing)

def logits_loss(logits: torch.Tensor, codebook_size: int, mb: MicroBatch, old: torch.Tensor | None,
                ref: tuple | None, *, temperature: float, clip_eps: float | tuple[float, float],
                kl_beta: float, train_tokens: str = "large", top_k: int = 0, top_p: float = 1.0,
                correction: str = "token_truncate", cap: float = 2.0, policy_dist: str = "full",
                truncation_weight: str = "none", kl_on: str = "all", entropy_bonus: float = 0.0
                ) -> tuple[torch.Tensor, dict]:
    """(mb, N, V) logits -> the loss: the trained distribution's log-probs (the whole softmax p, or
    the sampler's truncation q), its mismatch weights, the truncation weight (p only), grpo_loss.
    `old`, `ref`: frozen_logprobs' (`old` None: mu 1). Defaults: the command line's."""
    if policy_dist == "full":  # p, and the sampler's log-probs under p
        pi, behaviour = code_logprobs(logits, temperature, codebook_size), mb.sampled_full
    else:  # q: the sampler's truncation, replayed on its kept codes when it recorded them
        pi = code_logprobs(logits, temperature, codebook_size, top_k, top_p, mb.support)
        behaviour = mb.sampled
    logp = logprob_of(pi, mb.tokens)  # (mb, N)
    old = logp.detach() if old is None else old
    weights = sampler_correction(old, behaviour, correction, cap)  # over all N tokens
    mass = truncation_weights(mb.sampled, mb.sampled_full,
                              truncation_weight if policy_dist == "full" else "none")
    cols = slice(mb.n_preview, None) if train_tokens == "large" else slice(None)  # in the loss
    weights = weights if correction.startswith("sequence") else weights[:, cols]
    loss, m = grpo_loss(logp[:, cols], old[:, cols], None if ref is None else ref[0][:, cols],
                        mb.advantages, clip_eps, kl_beta, weights, mass[:, cols], kl_on)
    H = -(pi.exp() * pi.nan_to_num(neginf=0.0)).sum(-1)[:, cols]  # (mb, n) entropy, nats
    if entropy_bonus > 0:  # EG-GRPO (arXiv 2604.02355): + bonus x H on the less certain tokens
        loss = loss - entropy_bonus * (H * (H > H.mean()).to(H)).mean()
    return loss, {"loss": loss.item(), "entropy": H.mean().item(), **m}


# ---- 9. Update ---------------------------------------------------------------------------------
def micro_batches(rollouts: list[Rollout], advantages: torch.Tensor, size: int,
                  codebook_size: int) -> list[MicroBatch]:
    """P rollouts and their (P, G) advantages -> MicroBatches of `size` rows, a group's in order."""
    return [MicroBatch(r.inputs, r.tokens[rows], r.logprobs[rows], r.full_logprobs[rows],
                       None if r.support is None  # the engine's packed bits -> (mb, N, K) bool
                       else fast_decode.code_support(r.support[rows], codebook_size),
                       adv[rows], r.preview_hw[0] * r.preview_hw[1])
            for r, adv in zip(rollouts, advantages)
            for rows in (slice(i, i + size) for i in range(0, len(adv), size))]

@torch.no_grad()
def frozen_logprobs(policy, ref_model, batches: list[MicroBatch], mu: int, *, temperature: float,
                    kl_beta: float, top_k: int = 0, top_p: float = 1.0, policy_dist: str = "full",
                    **loss_only) -> tuple[list, list]:
    """Each micro-batch's log-probs before the first update, on the trained distribution: pi_old's
    (mu > 1; else None: ratio 1) and the reference's (kl_beta > 0; else None), on it and on the
    whole softmax p (for kl_untruncated). A LoRA reference is the policy with its adapter off."""
    K = policy.config.vq_config.num_embeddings
    adapter_off = getattr(ref_model, "disable_adapter", contextlib.nullcontext)
    olds, refs = [], []
    for mb in batches:  # the trained distribution: p (no cut), or the sampler's truncation q
        cut = (top_k, top_p, mb.support) if policy_dist == "truncated" else (0, 1.0, None)
        olds.append(token_logprobs(policy, mb.inputs, mb.tokens, temperature, *cut)
                    if mu > 1 else None)
        refs.append(None)
        if kl_beta > 0:  # the reference on the trained distribution and on p
            with adapter_off():
                logits = token_logits(ref_model, mb.inputs, mb.tokens)  # (mb, N, V)
            refs[-1] = tuple(logprob_of(code_logprobs(logits, temperature, K, *c), mb.tokens)
                             for c in (cut, (0, 1.0, None)))
    return olds, refs

def micro_batch_loss(policy, mb: MicroBatch, old: torch.Tensor | None, ref: tuple | None,
                     **objective) -> tuple[torch.Tensor, dict]:
    """One micro-batch's loss (logits_loss) and, beside it, docs/healthy_training.md's readings."""
    logits = token_logits(policy, mb.inputs, mb.tokens)  # (mb, N, V), with grad
    K = policy.config.vq_config.num_embeddings
    loss, metrics = logits_loss(logits, K, mb, old, ref, **objective)
    if diagnostics is not None:  # helpers/ there: the readings too (copied alone: the loss's only)
        algorithm = (code_logprobs, grpo_loss, k3_kl, sampler_correction, truncation_weights)
        metrics |= diagnostics.readings(logits.detach(), K, mb, old, ref, algorithm, **objective)
    return loss, metrics

def train_step(policy, optimizer, rollouts: list[Rollout], advantages: torch.Tensor, ref_model, *,
               micro_batch_size: int, max_grad_norm: float, mu: int = 1, **objective) -> dict:
    """`mu` optimizer steps on P groups with (P, G) advantages -> metrics; `objective`: logits_loss'
    settings. Each micro-batch's loss weighs its share: the accumulated gradient is the batch's."""
    # transformers only checkpoints in train mode; without dropout, train and eval are one policy
    policy.train(policy.is_activation_checkpointing)
    K = policy.config.vq_config.num_embeddings
    batches = micro_batches(rollouts, advantages, micro_batch_size, K)
    olds, refs = frozen_logprobs(policy, ref_model, batches, mu, **objective)
    updates, skipped = [], 0  # each update's micro-batches: (metrics, share)
    for _ in range(mu):
        optimizer.zero_grad(set_to_none=True)
        updates.append([])
        for k, mb in enumerate(batches):
            loss, m = micro_batch_loss(policy, mb, olds[k], refs[k], **objective)
            share = len(mb.tokens) / advantages.numel()  # losses are means: weigh each to the batch
            sync_gradients(policy, k == len(batches) - 1)  # FSDP + LoRA: reduce after the last
            (loss * share).backward()  # even when not finite: with FSDP every process joins
            updates[-1].append((m, share))
        params = [p for group in optimizer.param_groups for p in group["params"]]
        grad_norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm).item()
        finite = all(math.isfinite(m["loss"]) for m, _ in updates[-1])
        if all_agree(finite) and math.isfinite(grad_norm):  # every process steps, or none
            optimizer.step()
        else:  # a NaN / inf loss or gradient never reaches the weights: this update is skipped
            optimizer.zero_grad(set_to_none=True)
            skipped += 1
    return merge_metrics(updates) | {"grad_norm": grad_norm, "skipped": skipped}


# ---- 10. Main -----------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> dict:
    r = run.prepare(parse_config(argv), argv, REWARDS)  # every input checked, nothing written yet
    cfg, rewards = r.cfg, r.rewards
    run.start(r)  # torchrun: one process per GPU (else rank 0 of 1), the device and dtype
    with run.timed({}, "load", cfg), run.loading(cfg.model):
        pipe = load_glm_image(cfg.model, r.device, r.dtype)
    with run.timed({}, "setup", cfg):
        policy, ref_model, optimizer = setup.setup_training(  # the AR: LoRA, FSDP2, AdamW
            pipe, cfg, r.dtype, r.world, reference_model)
        run.open_run(r, policy, optimizer)  # --resume's checkpoint; the run directory
    # the before / after grids and --eval-prompts: steps 1-3 on fixed seeds (helpers/run.py)
    r.evaluate = run.evaluator(r, pipe, policy, (sample_groups, decode_images, group_rewards))

    with run.training(r):  # Ctrl-C: a checkpoint, exit 130; a full disk: one line, exit 1
        for step, groups, batch, seconds in run.steps(r):  # a group's number: its prompt and seed
            with run.timed(seconds, "sample", cfg), r.autocast, unsharded(policy):  # 1. sample
                rollouts = sample_groups(pipe, [ex["prompt"] for ex in batch], cfg.group_size,
                                         cfg.height, cfg.width, cfg.temperature,
                                         [cfg.seed * 1_000_003 + g for g in groups],
                                         [ex.get("source") for ex in batch], cfg.top_k, cfg.top_p)
            with run.timed(seconds, "decode", cfg), run.decoder_on(pipe, r.device, cfg.offload):
                images = [decode_images(pipe, ex["prompt"], ro.tokens, ro.large_hw, cfg.height,
                                        cfg.width, cfg.num_inference_steps, cfg.decode_seed,
                                        cfg.guidance_scale, ro.source)
                          for ex, ro in zip(batch, rollouts)]  # 2. decode the tokens
            grids = [ro.tokens[:, -math.prod(ro.large_hw):] for ro in rollouts]  # what the DiT saw
            with run.timed(seconds, "reward", cfg):  # 3.-4. rewards, z-scored within each group
                reward, each, advantages = score(images, batch, rewards, cfg.scale_rewards, grids,
                                                 cfg.diversity, cfg.unlikeliness,
                                                 [ro.logprobs for ro in rollouts])  # as drawn
            with interrupts_held():  # an update and its log line land together (or not at all)
                with run.timed(seconds, "train", cfg), r.autocast:  # 5. the clipped update
                    metrics = train_step(
                        policy, optimizer, rollouts, advantages, ref_model,
                        micro_batch_size=cfg.micro_batch_size, max_grad_norm=cfg.max_grad_norm,
                        mu=cfg.mu, kl_beta=cfg.kl_beta, train_tokens=cfg.train_tokens,
                        clip_eps=(cfg.clip_eps, cfg.clip_eps_high or cfg.clip_eps), top_k=cfg.top_k,
                        temperature=cfg.temperature, policy_dist=cfg.policy_dist, kl_on=cfg.kl_on,
                        correction=cfg.sampler_correction, cap=cfg.sampler_cap, top_p=cfg.top_p,
                        truncation_weight=cfg.truncation_weight, entropy_bonus=cfg.entropy_bonus)
                run.log_step(r, step, groups, reward, each, advantages, grids, metrics, seconds)
            run.after_step(r, step, batch, images, reward)  # image grids, checkpoints, evaluations
    return run.finish(r)  # the last checkpoint, final/, curves.png, the after grid, the summary


# ---- 11. Copied alone ---------------------------------------------------------------------------
if run is None:  # without helpers/: one process, each collective an identity (main needs helpers/)
    def all_agree(value): return value  # noqa: E704
    def gather_rows(rows): return rows  # noqa: E704
    def sync_gradients(model, last): return None  # noqa: E704
    def merge_metrics(updates):  # the last update's means (shares sum to 1), the ratio's extremes
        last = {k: sum(m[k] * share for m, share in updates[-1]) for k in updates[-1][0][0]}
        every = [m for update in updates for m, _ in update]
        return last | {k: f(m[k] for m in every) for k, f in [("ratio_min", min), ("ratio_max", max)]}


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:  # Ctrl-C while loading or checking (training handles its own)
        print("grpo.py: interrupted", file=sys.stderr)
        raise SystemExit(130) from None
