"""GRPO on GLM-Image, in one file you can read top to bottom.

GLM-Image draws in two stages: an autoregressive model (the AR, a 9B GLM) writes a grid of visual
tokens, and a diffusion transformer (the DiT, 7B) paints pixels conditioned on them. This file
trains the AR with GRPO (Group Relative Policy Optimization, Shao et al. 2024): for each prompt x
(and, to edit, a source image), sample a group of G token sequences o_1..o_G, decode them to images,
score them (SSIM / -MSE to a target, or any function of the images) and maximise

    J = 1/G sum_i 1/|o_i| sum_t [ min(r_it A_i, clip(r_it, 1-eps, 1+eps) A_i) - beta KL_it ]

with r_it = pi(o_it | x, o_i<t) / pi_old(o_it | x, o_i<t), A_i = (R_i - mean(R)) / std(R) over the
group and KL_it the k3 estimator exp(ref - logp) - (ref - logp) - 1 against a frozen reference.

The symbols, as the code names them:
  x       a prompt (and, to edit, its source image); in code a Prompt, its AR inputs (group_prompt)
  o_i     sample i: the N codes the AR writes for x (a Rollout's tokens[i]), preview grid then large
  G, P    samples per prompt (a group: --group-size), prompts (groups) per step: advantages (P, G)
  N, K    codes per sample; the codebook's size (the codes the AR may draw; V >= K: its vocabulary)
  p       the whole softmax(logits / temperature) over the K codes: the trained policy pi
  q       p cut to top-k / top-p and renormalised: what the sampler draws from (q = p without them)
  pi_old  p as the trainer's first forward computes it for the sampled codes (train_step)
  ref     the frozen reference of the KL: the initial weights (with LoRA: the adapter off); a variant,
          --reference-reset-every, moves it to the policy every N steps (helpers/variants.py)
  R, A    a sample's reward (group_rewards) and its advantage (group_advantages)
  r       the ratio pi / pi_old of a sampled code (pi_theta: pi at the current weights, in train_step)
  micro   a step's MicroBatches: some rows of one group each, one forward pass each (mb: one of them)
  eps, beta, mu   the clip range, the KL's weight, the updates a batch of samples gets (Config)
A group is one prompt's G samples; a step samples P groups; the Run (helpers/run.py) is `job`.

The sections: the config and loading GLM-Image, then GRPO's five steps, numbered as the README
and the notebook number them: 1 sample, 2 decode, 3 score, 4 advantages, 5 update (5a the trainer's
log-probs, 5b the loss, 5c mu updates on micro-batches); then `train`, the loop that runs them, and
`main`, which runs the same steps with the run's plumbing around them (helpers/run.py).

Where this departs from the paper (docs/ measures each):
  - only the large grid (H/32 x W/32, drawn after a preview grid) reaches the DiT, so only its
    tokens are in the loss;
  - one definition of the sampled distribution (`code_logprobs`), which sampler and trainer both
    call; pi / pi_old is exactly 1 at the first update by construction (its pi_old is pi itself),
    and what the sampler's kernels drift from it the mismatch weights below measure;
  - the trained policy pi is the whole softmax p, while with top-p (the real preset) the sampler
    draws from its nucleus q: the ratio, the KL and the loss are p's, and q != p is left
    uncorrected by default (helpers/variants.py has --policy-dist truncated, which trains q);
  - TRL's mismatch weights w = pi_old / pi_sampler compare p with p: pi_old, p's log-probs as the
    trainer's first forward computes them, against the log-probs of p the sampler computed while
    drawing (other kernels, bf16 on a GPU). In float32 on a CPU they are 1 within 1e-4;
  - the AR's 3D rotary positions are replayed (`rope_positions`), or the log-probs are wrong.

Copied alone (with requirements.txt's packages) this file runs `train` on a model folder, sampling
with its own decode loop, `generate`; `main`, `parse_config` and random weights need helpers/ beside
it: the run's plumbing, helpers/fast_decode.py (the same tokens as `generate`, faster: what `main`
samples with), FSDP2, and helpers/variants.py (the options that are off in both presets).
dit_grpo.py: GRPO on the DiT.

  python grpo.py --prompts prompts.txt                          # the tiny GLM-Image, on a CPU
  python grpo.py --prompts examples/shapes.txt --reward shapes  # draw what the caption asks
  python grpo.py --prompts my_prompts.txt --model zai-org/GLM-Image   # the real model (GPU, bf16)
  torchrun --nproc-per-node 8 grpo.py --prompts my_prompts.txt --model zai-org/GLM-Image   # 8 GPUs
  python -m pytest -q test_grpo.py                              # a test for every function here
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

try:  # helpers/, beside this file: main's plumbing, fast decode, FSDP2, more rewards, variants
    from helpers import diagnostics, fast_decode, run, setup, variants
    from helpers.parallel import all_agree, merge_metrics, rows_per_process, unsharded
    from helpers.rewards import MORE_REWARDS
except ImportError as missing:  # copied alone (or beside another project's helpers): one process
    if missing.name != "helpers":
        raise
    diagnostics = fast_decode = run = setup = variants = None
    MORE_REWARDS = {}
    # all_agree, rows_per_process and merge_metrics, which train_step calls, become
    # one-process stand-ins, defined at the end of this file (plumbing, not lesson)


# ---- Config --------------------------------------------------------------------------------------

def arg(default, help: str, choices: tuple = ()):
    """A config field whose doc becomes its --help (and, if given, the values it may take)."""
    return dataclasses.field(default=default, metadata={"help": help, "choices": choices})


def preset(tiny, real, help: str):
    """A config field whose default depends on the model: `tiny` for the shipped tiny GLM-Image,
    `real` for GLM-Image itself. It stays None until `with_defaults` fills it in."""
    return dataclasses.field(default=None, metadata={
        "help": f"{help} (default: {tiny} tiny, {real} real)", "choices": (), "tiny": tiny,
        "real": real})


@dataclasses.dataclass
class Config:  # a field per flag (--group-size ...); helpers/ adds the run's and variants' flags
    # the algorithm: a group per prompt, its advantages, the clipped loss and the KL
    group_size: int | None = preset(8, 4, "samples per prompt (G)")
    prompts_per_step: int | None = preset(2, 1, "prompts (groups) per step")
    reward: str = arg("ssim=1,mse=0", "rewards and weights, e.g. ssim=1,ocr=0.5 (docs/rewards.md)")
    clip_eps: float = arg(0.2, "PPO clip: the ratio is clipped to [1 - eps, 1 + eps]")
    kl_beta: float | None = preset(0.1, 0.04, "weight of the k3 KL to the frozen reference")
    mu: int | None = preset(2, 1, "updates per batch of samples; from the second the clip acts")
    lr: float | None = preset(1e-4, 1e-5, "AdamW learning rate")
    steps: int = arg(100, "optimizer steps")
    micro_batch_size: int | None = preset(0, 1, "sequences per forward pass (0: a whole group)")
    # sampling, as GLM-Image is deployed, and the correction of the sampler's rounding
    temperature: float = arg(0.9, "sampling temperature (GLM-Image: 0.9)")
    top_p: float | None = preset(1.0, 0.75, "nucleus sampling: the smallest set of codes holding "
                                            "this much probability (1: off)")
    top_k: int = arg(0, "sample from the k most likely codes only (0: off)")
    sampler_correction: str = arg("token_truncate", "TRL's mismatch weights pi_old / pi_sampler",
                                  ("token_truncate", "token_mask", "sequence_truncate",
                                   "sequence_mask", "none"))
    sampler_cap: float = arg(2.0, "mismatch weights above it: cut to it (truncate) or to 0 (mask)")
    seed: int = arg(0, "seed of the AR sampling")
    # the model, the images, the data
    prompts: str = arg("prompts.txt", "'prompt | target.png' lines, or .jsonl (docs/editing.md)")
    shuffle: bool | None = preset(False, True, "the prompts in a new order each epoch, drawn from "
                                               "--seed")
    model: str = arg("tiny", "hub id, folder, tiny, tiny-edit, or random (published configs)")
    revision: str = arg("", "the hub model's revision: a commit hash, branch or tag ('': its main)")
    height: int | None = preset(96, 1024, "image height")
    width: int | None = preset(96, 1024, "image width")
    num_inference_steps: int | None = preset(2, 50, "DiT denoising steps")
    guidance_scale: float | None = preset(1.0, 1.5, "DiT guidance")
    decode_seed: int = arg(0, "seed of the DiT latent noise (fixed per run)")
    lora_rank: int | None = preset(0, 16, "LoRA rank (0: train every weight)")
    weight_decay: float = arg(0.01, "AdamW weight decay")
    max_grad_norm: float = arg(1.0, "gradient-norm clip")
    before_after: int | None = preset(4, 0, "prompts drawn before and after training, side by side")
    gradient_checkpointing: bool | None = preset(False, False, "recompute activations in backward")
    # (a preset: dit_grpo.py turns it on for the real DiT where the command line leaves it out)
    offload: bool = arg(False, "keep DiT, VAE, T5 on CPU except to decode")
    # and the run's (--out, --eval-prompts, --resume, --device ...: helpers/run.py) and the
    # variants' (--diversity, --clip-eps-high, --policy-dist ...: helpers/variants.py)


TINY = Path(__file__).resolve().parent / "tiny_glm_image"  # pre-trained by tools/train_tiny.py
# the tiny model and its editing sibling (tools/train_tiny_edit.py: an AR that edits, the same DiT)
TINY_MODELS = {"tiny": TINY, "tiny-edit": TINY.with_name("tiny_glm_image_edit")}


def parse_config(argv: list[str] | None = None) -> Config:
    """Command line -> Config (helpers/run.py builds the parser): a flag per field."""
    if run is None:  # grpo.py copied alone
        raise SystemExit("grpo.py: parse_config needs helpers/ beside grpo.py; copied alone, build "
                         "the config in code: with_defaults(Config(model='tiny', ...))")
    config = run.with_run_settings(Config)  # + the run's and the variants' fields
    return with_defaults(config(**run.parse_flags(config, argv)))  # --config FILE's, then the flags


def with_defaults(cfg: Config) -> Config:
    """`cfg` with each preset field left at None set to its model's default (tiny or real)."""
    model = "tiny" if cfg.model in TINY_MODELS else "real"
    presets = {field.name: field.metadata[model] for field in dataclasses.fields(cfg)
               if "tiny" in field.metadata and getattr(cfg, field.name) is None}
    cfg = dataclasses.replace(cfg, **presets)
    if cfg.micro_batch_size == 0:  # a whole group in one forward pass (the tiny model's default)
        cfg = dataclasses.replace(cfg, micro_batch_size=cfg.group_size)
    return cfg


# ---- Loading GLM-Image ---------------------------------------------------------------------------

def load_glm_image(name: str, device: str = "cpu", dtype: torch.dtype = torch.float32,
                   revision: str = ""):
    """GlmImagePipeline from a hub id (at `revision`: a commit, branch or tag), a folder or
    TINY_MODELS; 'random[:L]': GLM-Image built from its published configs, random weights, L layers
    a part (helpers/offline_model.py)."""
    from diffusers import GlmImagePipeline
    if name.split(":")[0] == "random":
        from helpers.offline_model import random_glm_image
        return only_ar_trains(random_glm_image(name, device, dtype))
    pipe = GlmImagePipeline.from_pretrained(TINY_MODELS.get(name, name), dtype=dtype,
                                            revision=revision or None)
    return only_ar_trains(pipe.to(device))


def only_ar_trains(pipe):
    """Freeze all but the AR (its vision tower and VQ only encode sources); eval, no dropout."""
    pipe.set_progress_bar_config(disable=True)
    ar = pipe.vision_language_encoder.eval()  # models built in code start in train mode
    frozen = (pipe.text_encoder, pipe.transformer, pipe.vae, ar.model.visual, ar.model.vqmodel)
    for module in frozen:
        module.requires_grad_(False).eval()
    disable_dropout(ar)
    return pipe


def active_dropout(model) -> list[str]:
    """The names of `model`'s modules that drop out now: in train mode with a dropout p > 0."""
    dropping = []
    for name, module in model.named_modules():
        p = module.p if isinstance(module, torch.nn.Dropout) else 0.0
        attention = getattr(module, "attention_dropout", None)
        if isinstance(attention, float):  # (a Dropout module there is found as a module)
            p = max(p, attention)
        if module.training and p > 0:
            dropping.append(name or type(module).__name__)
    return dropping


def disable_dropout(model) -> None:
    """Zero every dropout (GLM-Image's are 0): dropout in training only would make pi != pi_old."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        if isinstance(getattr(module, "attention_dropout", None), float):
            module.attention_dropout = 0.0


def reference_model(policy, kl_beta: float):
    """The frozen KL reference: None when beta is 0 (no KL term); with LoRA the policy itself, whose
    adapter is switched off to read it (no copy); else a frozen copy of the initial weights. (Frozen
    within a run unless --reference-reset-every resets it: helpers/variants.py's Reference.)"""
    if kl_beta == 0:
        return None
    if hasattr(policy, "disable_adapter"):
        return policy
    return copy.deepcopy(policy).requires_grad_(False).eval()


# ---- Step 1. Sample: a group of token grids per prompt, and their log-probs ----------------------

class Source(NamedTuple):
    image: Image.Image  # the image being edited, as the DiT's VAE sees it
    codes: torch.Tensor  # (h_s * w_s,) long, its VQ codes from the AR's vision tower
    grid_hw: tuple[int, int]  # (h_s, w_s) = its size / 32


class Prompt(NamedTuple):  # one prompt's group, ready for the AR (group_prompt)
    inputs: dict  # input_ids, attention_mask (G, L), image_grid_thw (2G, 3), images_per_sample
    preview_hw: tuple[int, int]  # the grid the AR writes FIRST (h', w'); (0, 0) when editing
    large_hw: tuple[int, int]  # the grid it writes last (H/32, W/32): the only one the DiT sees
    source: Source | None  # the image being edited, or None (text-to-image)


class Rollout(NamedTuple):  # a group's samples (sample_groups): its Prompt's fields and the draws
    # (flat, not a Prompt inside: steps 2-5 and the variants read one object a group)
    tokens: torch.Tensor  # (G, N) long codes: preview grid then large grid (editing: large only)
    q_logprobs: torch.Tensor  # (G, N) float32: each code's log-prob under q, what the draw used
    p_logprobs: torch.Tensor  # (G, N) float32: under p, the whole softmax (q = p without top-k/p)
    inputs: dict
    preview_hw: tuple[int, int]
    large_hw: tuple[int, int]
    source: Source | None
    support: torch.Tensor | None = None  # (G, N, ceil(K/8)) uint8: the codes each draw kept, 8 to
    # a byte (helpers/fast_decode.py's support_bits; its code_support unpacks them to (G, N, K) bool)


def code_logprobs(logits: torch.Tensor, temperature: float, codebook_size: int, top_k: int = 0,
                  top_p: float = 1.0, support: torch.Tensor | None = None) -> torch.Tensor:
    """(..., V) AR logits -> (..., K) float32 log-probs over the codebook: softmax(logits / T) cut
    to `top_k` / `top_p` (or to given codes: a (..., K) bool `support`, which only a variant,
    --policy-dist truncated, passes), renormalised, -inf outside.
    One definition of the policy: the sampler draws from it, the trainer scores it."""
    scores = logits[..., :codebook_size].float() / temperature  # ids >= K are never drawn
    if support is not None:
        return torch.log_softmax(scores.masked_fill(~support, -math.inf), dim=-1)
    if 0 < top_k < codebook_size:  # as transformers' TopKLogitsWarper
        kth_best = scores.topk(top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth_best, -math.inf)
    if top_p < 1.0:  # as TopPLogitsWarper: drop the least likely codes while their sum <= 1 - p
        ascending, order = scores.sort(dim=-1, stable=True)  # order[j]: the code in place j
        dropped = ascending.softmax(dim=-1).cumsum(dim=-1) <= 1 - top_p
        dropped[..., -1] = False  # the most likely code always stays
        # back to code order: code order[j] gets dropped[j]. Scores [2, 0, 1] sort to order
        # [1, 2, 0]; at p 0.75 place 0 goes (its share 0.09 <= 0.25), so code 1 does.
        dropped = torch.zeros_like(dropped).scatter(-1, order, dropped)
        scores = scores.masked_fill(dropped, -math.inf)
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
    _, h, w = grid[0].tolist()
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
    inputs, encoded = encode_source(model, inputs, image)  # [source, large]
    return Prompt(inputs, preview_hw=(0, 0), large_hw=listed[1], source=encoded)


def rope_positions(input_ids: torch.Tensor, image_grid_thw: torch.Tensor, num_tokens: int,
                   image_start_id: int, image_end_id: int) -> torch.Tensor:
    """3D rotary positions (3, 1, L + N - 1) of an L-token prompt and its N tokens but the last, as
    GlmImageModel.get_rope_index gives generate: text is a ramp on all 3 axes; a grid h x w at p
    puts cell (row, col) at (p, p + row, p + col) and the ramp resumes at p + max(h, w). Generated
    grids come in REVERSE order of image_grid_thw (text-to-image: preview, then large). Example:
    a 5-token prompt, then a 2x3 preview and a 4x4 large grid (image_grid_thw [[1,4,4], [1,2,3]]):
        prompt  (0,0,0) (1,1,1) (2,2,2) (3,3,3) (4,4,4)
        preview (5,5,5) (5,5,6) (5,5,7) (5,6,5) (5,6,6) (5,6,7)        the ramp resumes at 5 + 3
        large   (8,8,8) (8,8,9) (8,8,10) (8,8,11) (8,9,8) ... (8,11,11)  (its last is never fed)
    Editing: each source image in the prompt (between an image start and an image end) is a grid
    too, in the order listed; the grids after them are the generated ones. (On a first read, skip
    the body: test_rope_positions checks it against transformers' own get_rope_index.)"""

    def ramp(p: int, n: int) -> torch.Tensor:  # (3, n): n text tokens from position p
        return torch.arange(p, p + n).expand(3, -1)

    def grid(p: int, h: int, w: int) -> torch.Tensor:  # (3, h*w): t = p, rows and columns from p
        rows, cols = torch.arange(h).repeat_interleave(w), torch.arange(w).repeat(h)
        return torch.stack([torch.full_like(rows, p), p + rows, p + cols])

    ids = input_ids.tolist()
    ends = [i for i, t in enumerate(ids) if t == image_end_id]  # only a source image is closed
    starts = [i + 1 for i, t in enumerate(ids) if t == image_start_id][:len(ends)]  # the last opens
    grids = [tuple(row[1:]) for row in image_grid_thw.tolist()]  # the generated image: not closed
    sources, generated = grids[:len(ends)], grids[len(ends):]
    positions, p, placed = [], 0, 0  # p: the next position; placed: prompt tokens given one
    for start, end, (h, w) in zip(starts, ends, sources, strict=True):
        text = start - placed  # the text before this source image, its image-start token included
        positions += [ramp(p, text), grid(p + text, h, w)]
        p += text + max(h, w)
        placed = end
    positions.append(ramp(p, len(ids) - placed))  # the rest of the prompt, its image-start last
    p += len(ids) - placed
    for h, w in reversed(generated):  # the generated grids: the preview first
        positions.append(grid(p, h, w))
        p += max(h, w)
    positions = torch.cat(positions, dim=1)[:, : len(ids) + num_tokens - 1]  # the last: never fed
    return positions[:, None, :].to(image_grid_thw.device)  # (3, 1, L + N - 1)


@torch.no_grad()
def generate(model, prompt: "Prompt", temperature: float, seed: int, top_k: int = 0,
             top_p: float = 1.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The AR's decode loop, in the shape of gpt-fast's generate: `prefill` the prompt once, then
    N steps of `decode_one_token` (logits -> code_logprobs -> draw -> feed), a KV cache holding the
    past.
    Returns (G, N) codes, their log-probs under q (what the draw used: top-k / top-p) and under p
    (the whole softmax). Needs `code_logprobs` and `rope_positions` (and a `prompt` with .inputs,
    .preview_hw and .large_hw: a Prompt, group_prompt's)."""
    from transformers import DynamicCache
    ids = prompt.inputs["input_ids"]  # (G, L): one L-token prompt, G times
    G, L = ids.shape
    N = math.prod(prompt.preview_hw) + math.prod(prompt.large_hw)  # the tokens to draw
    K, V = model.config.vq_config.num_embeddings, model.lm_head.out_features
    grids = prompt.inputs["image_grid_thw"][:int(prompt.inputs["images_per_sample"][0])]
    positions = rope_positions(ids[0], grids, N, model.config.image_start_token_id,
                               model.config.image_end_token_id).expand(-1, G, -1)  # (3, G, L+N-1)
    generator = torch.Generator(ids.device).manual_seed(seed)
    cache = DynamicCache(config=model.config.text_config)
    fed, at = ids, slice(0, L)  # the prefill feeds the prompt; each step after it one token
    tokens, q_logprobs, p_logprobs = [], [], []  # each step's (G, 1)
    for t in range(N):
        logits = model(input_ids=fed, position_ids=positions[:, :, at], cache=cache,
                       logits_to_keep=1).logits[:, -1]  # (G, V): the next token's, cache updated
        q = code_logprobs(logits, temperature, K, top_k, top_p)  # (G, K): what the draw uses
        p = code_logprobs(logits, temperature, K)  # the whole softmax (= q without top-k / top-p)
        # torch.multinomial(q.exp(), 1) as a race: the first of exponential(1) / q to finish. The
        # noise is drawn over all V ids and cut to K so that the random numbers are the ones
        # transformers' generate uses: same seed, same codes (helpers/fast_decode.py draws so too).
        noise = torch.empty(G, V, device=ids.device).exponential_(generator=generator)[:, :K]
        fed = (q.exp() / noise).argmax(dim=-1, keepdim=True)  # (G, 1): the drawn codes
        tokens.append(fed)
        q_logprobs.append(q.gather(-1, fed))
        p_logprobs.append(p.gather(-1, fed))
        at = slice(L + t, L + t + 1)  # the code just drawn is fed next, at its own position
    return torch.cat(tokens, dim=1), torch.cat(q_logprobs, dim=1), torch.cat(p_logprobs, dim=1)


def group_seed(run_seed: int, group_id: int) -> int:
    """The sampling seed of the group numbered `group_id` (over the whole run: step, process and
    prompt) in the run seeded `run_seed` (--seed). 1_000_003 is a prime above any run's number of
    groups, so runs of different seeds never share a group's seed, and a resumed run redraws a
    group exactly."""
    return run_seed * 1_000_003 + group_id


@torch.no_grad()
def sample_groups(pipe, prompts: list[str], group_size: int, height: int, width: int,
                  temperature: float, seeds: list[int], sources: list | None = None, top_k: int = 0,
                  top_p: float = 1.0) -> list[Rollout]:
    """G samples for each of P prompts (and sources to edit), group p from seeds[p]: `generate` a
    group at a time, or helpers/fast_decode.py's same tokens, faster (all in one padded decode)."""
    model = pipe.vision_language_encoder.eval()  # no dropout: one distribution
    encoded = [group_prompt(pipe, text, group_size, height, width, source)  # one Prompt each
               for text, source in zip(prompts, sources or [None] * len(prompts))]
    rollouts = []
    if fast_decode is None:  # grpo.py copied alone: the lesson's loop
        for prompt, seed in zip(encoded, seeds):
            tokens, q_logprobs, p_logprobs = generate(model, prompt, temperature, seed, top_k,
                                                      top_p)
            rollouts.append(Rollout(tokens, q_logprobs, p_logprobs, **prompt._asdict()))
        return rollouts
    drawn = fast_decode.sample_groups(model, encoded, temperature, seeds, top_k, top_p, prompts,
                                      code_logprobs, rope_positions)
    for prompt, draws in zip(encoded, drawn):
        rollouts.append(Rollout(draws.tokens, draws.q_logprobs, draws.p_logprobs,
                                **prompt._asdict(), support=draws.support))
    return rollouts


# ---- Step 2. Decode: tokens to pictures ----------------------------------------------------------

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
    if negative is not None:
        negative = negative.repeat(G, 1, 1)
    f, generator = pipe.vae_scale_factor, torch.Generator("cpu").manual_seed(seed)
    shape = (1, pipe.transformer.config.in_channels, height // f, width // f)  # one noise for all G
    latents = torch.randn(shape, generator=generator).to(device, dtype).repeat(G, 1, 1, 1)
    edit = {}
    if source is not None:  # one copy per sample: the pipeline's batch is the group
        hs, ws = source.grid_hw
        codes = prior_ids(source.codes[None], source.grid_hw)[0].to(device)
        edit = dict(image=[[source.image]] * G, prior_token_image_ids=[codes] * G,
                    source_image_grid_thw=[torch.tensor([[1, 2 * hs, 2 * ws]], device=device)] * G)
    images = pipe(prompt_embeds=embeds.repeat(G, 1, 1), negative_prompt_embeds=negative,
                  prior_token_ids=prior, latents=latents, height=height, width=width,
                  num_inference_steps=num_inference_steps, guidance_scale=guidance_scale,
                  output_type="pt", **edit).images
    return images.float().clamp(0, 1)  # (G, 3, H, W)


# ---- Step 3. Score: rewards ----------------------------------------------------------------------
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

    def blur(x: torch.Tensor) -> torch.Tensor:  # (G, 3, H, W) -> (G, 3, H-10, W-10) local means
        return F.conv2d(x, window, groups=3)

    x, y = images.float(), example["target"].float().expand_as(images)  # (G, 3, H, W)
    mu_x, mu_y = blur(x), blur(y)
    var_x = blur(x * x) - mu_x ** 2
    var_y = blur(y * y) - mu_y ** 2
    cov = blur(x * y) - mu_x * mu_y
    ssim_map = (((2 * mu_x * mu_y + C1) * (2 * cov + C2))
                / ((mu_x ** 2 + mu_y ** 2 + C1) * (var_x + var_y + C2)))
    return ssim_map.mean(dim=(1, 2, 3))


mse_reward.needs = ("target",)  # checked in every example before a run starts
ssim_reward.needs = ("target",)
REWARDS = {"ssim": ssim_reward, "mse": mse_reward, **MORE_REWARDS}  # helpers/rewards.py: ocr, ...


def group_rewards(images: list[torch.Tensor], examples: list[dict], rewards: dict[str, tuple]
                  ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """P groups of (G, 3, H, W) images and their examples, rewards {name: (fn, weight)} -> the
    (P, G) weighted sum and each reward's (P, G). A reward of weight 0 is computed and returned
    (logged) but is not in the sum: even a NaN of it (0 * nan is nan) leaves the sum alone."""
    each = {}
    for name, (fn, _) in rewards.items():
        values = [fn(group, example).float().reshape(-1).to(group.device)
                  for group, example in zip(images, examples, strict=True)]
        each[name] = torch.stack(values)  # (P, G)
    total = torch.zeros_like(next(iter(each.values())))
    for name, (_, weight) in rewards.items():
        if weight != 0:
            total = total + weight * each[name]
    return total, each


# ---- Step 4. Advantages --------------------------------------------------------------------------

def group_advantages(rewards: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """(P, G) or (G,) rewards R -> advantages A_i = (R_i - mean(R)) / std(R) within each group. The
    std is the population's (/ G; TRL divides by the sample std + 1e-4). A group whose rewards do not spread (equal
    up to rounding) gets zeros: it has nothing to teach; so does a group with a NaN or inf reward
    (main leaves its loss out of the step, train_step)."""
    mean = rewards.mean(dim=-1, keepdim=True)
    std = rewards.std(dim=-1, unbiased=False, keepdim=True)
    spread = std > eps * rewards.abs().amax(dim=-1, keepdim=True)  # False where a reward is NaN
    z = (rewards - mean) / std.clamp_min(torch.finfo(std.dtype).tiny)
    return torch.where(spread, z, torch.zeros_like(rewards))


# ---- Step 5. Update. 5a: the trainer's log-probs of the sampled tokens ---------------------------

def token_logits(model, inputs: dict, tokens: torch.Tensor) -> torch.Tensor:
    """(S, N) tokens, S samples of ONE prompt (its group's inputs) -> (S, N, V) logits that predict
    each of them: one teacher-forced forward at generation's positions (rope_positions, not the
    text ramp that a plain forward would use: several nats off on a peaked model)."""
    ids = inputs["input_ids"]
    S, N = tokens.shape
    if not (ids == ids[:1]).all():
        raise ValueError("token_logits scores one prompt's samples: call it once per group")
    input_ids = torch.cat([ids[:1].expand(S, -1), tokens[:, :-1]], dim=1)  # (S, L+N-1)
    grids = inputs["image_grid_thw"][:int(inputs["images_per_sample"][0])]  # a sample's grid rows
    positions = rope_positions(ids[0], grids, N, model.config.image_start_token_id,
                               model.config.image_end_token_id).expand(-1, S, -1)
    return model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),  # no padding
                 position_ids=positions, use_cache=False, logits_to_keep=N).logits  # (S, N, V)


def logprob_of(distribution: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """(S, N, K) log-probs of every code, (S, N) tokens -> (S, N) each token's log-prob."""
    return distribution.gather(-1, tokens[..., None]).squeeze(-1)


def token_logprobs(model, inputs: dict, tokens: torch.Tensor, temperature: float, top_k: int = 0,
                   top_p: float = 1.0, support: torch.Tensor | None = None) -> torch.Tensor:
    """(S, N) float32 log-probs of `tokens` from one teacher-forced forward, under code_logprobs
    (cut to given codes, a (S, N, K) bool `support`, when given). Differentiable."""
    K = model.config.vq_config.num_embeddings
    logits = token_logits(model, inputs, tokens)  # (S, N, V)
    return logprob_of(code_logprobs(logits, temperature, K, top_k, top_p, support), tokens)


# ---- 5b: the loss --------------------------------------------------------------------------------

def grpo_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, ref_logprobs: torch.Tensor | None,
              advantages: torch.Tensor, clip_eps: float | torch.Tensor,
              kl_beta: float | torch.Tensor, weights: float | torch.Tensor = 1.0
              ) -> tuple[torch.Tensor, dict]:
    """The GRPO loss of S sampled sequences of n loss tokens each:

        loss = -1/S sum_i 1/n sum_t [ w_it min(r_it A_i, clip(r_it, 1 - eps, 1 + eps) A_i)
                                      - beta KL_it ]

    r_it = pi / pi_old = exp(logprobs - old_logprobs), (S, n); A_i = advantages, (S,); KL_it the k3
    estimator of KL(pi || ref) per token (0 without a reference); w_it TRL's mismatch weights
    (sampler_correction: 1 for an exact sampler). Returns the loss (differentiable in logprobs)
    and its metrics. The symbols may vary by sequence or token: A, eps, beta and w may be tensors
    that broadcast to (S, n) (helpers/variants.py passes them so).

    A copier's notes: every sequence here has n tokens (GLM-Image's samples of a prompt all fill the
    same grids), so the mean over each sequence's tokens and then over sequences (the paper's
    1/G sum_i 1/|o_i| sum_t) equals the mean over all S*n tokens. For an LLM, whose completions
    differ in length, the two differ: take the token-level mean over the batch, sum(m * term) /
    sum(m) with a (S, n) 0/1 padding mask m, as TRL's default loss_type "dapo" does; the
    per-sequence mean weighs a short answer's tokens more (the length bias Dr. GRPO points out).
    k3 (Schulman) = exp(d) - d - 1, d = ref - logp: >= 0, unbiased for KL(pi || ref) when the
    tokens are drawn from pi itself. Here they are drawn by the sampler (pi_old; at mu > 1 pi has
    moved since) and, under top-p, from its nucleus q: the k3 is then the sampler's average of that
    expression, blind to the codes the nucleus cut (docs/healthy_training.md). In expectation under
    pi, its gradient is KL(ref || pi)'s. d is capped at +-20 so that exp stays finite
    (tools/bench_kl_cap.py)."""
    A = advantages.reshape(len(advantages), -1).to(logprobs)  # (S, 1): A_i on each of its tokens
    ratio = torch.exp(logprobs - old_logprobs)  # (S, n)
    clipped_ratio = torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps)
    surrogate = torch.min(ratio * A, clipped_ratio * A)  # the pessimistic bound of PPO
    kl = torch.zeros_like(logprobs)
    if ref_logprobs is not None:
        d = (ref_logprobs - logprobs).clamp(-20.0, 20.0)
        kl = torch.exp(d) - d - 1  # >= 0 but for rounding (-6e-8 in float32), kept: a clamp would zero its gradient
    per_token = weights * surrogate - kl_beta * kl  # (S, n)
    loss = -per_token.mean(dim=1).mean()  # 1/|o_i| within a sequence, then 1/G over sequences
    with torch.no_grad():  # the clip stops the gradient: r > 1+eps with A > 0, r < 1-eps with A < 0
        clipped = ((ratio > 1 + clip_eps) & (A > 0)) | ((ratio < 1 - clip_eps) & (A < 0))
        metrics = {"policy_loss": -(weights * surrogate).mean(dim=1).mean().item(),
                   "kl": kl.mean().clamp_min(0).item(), "clip_frac": clipped.float().mean().item(),
                   "ratio_min": ratio.min().item(), "ratio_mean": ratio.mean().item(),
                   "ratio_max": ratio.max().item()}
    return loss, metrics


def sampler_correction(old_logprobs: torch.Tensor, sampler_logprobs: torch.Tensor,
                       mode: str = "token_truncate", cap: float = 2.0) -> torch.Tensor:
    """TRL's mismatch weights (vllm_importance_sampling_mode): (S, T) log-probs of the drawn tokens
    under ONE distribution, the trained one, as the trainer computes them (pi_old) and as the
    sampler did (its kernels, bf16) -> (S, T) weights pi_old / pi_sampler, per token or, in the
    sequence modes, one per sequence (the product of its tokens' ratios) on each of its tokens;
    above `cap` cut to it (truncate) or to 0 (mask); "none": 1. An exact sampler gets 1 (float32:
    1 +- 1e-4). Not differentiable: a weight, not a term of the policy."""
    log_ratio = old_logprobs - sampler_logprobs  # (S, T)
    if mode.startswith("sequence"):
        log_ratio = log_ratio.sum(dim=1, keepdim=True).expand_as(old_logprobs)
    ratio = torch.exp(log_ratio.clamp(max=20.0)).detach()  # a sequence's sum can be large
    if mode.endswith("truncate"):
        return ratio.clamp(max=cap)
    if mode.endswith("mask"):
        return ratio.masked_fill(ratio > cap, 0.0)
    return torch.ones_like(ratio)


# ---- 5c: mu updates, a micro-batch at a time -----------------------------------------------------

class MicroBatch(NamedTuple):  # some of one group's samples: what one forward pass trains on
    inputs: dict  # its prompt's AR inputs (the group's)
    tokens: torch.Tensor  # (mb, N) the sampled codes
    sampler_logprobs: torch.Tensor  # (mb, N): their log-probs under the trained distribution (p),
    # as the sampler computed them (the mismatch weights compare pi_old with these)
    advantages: torch.Tensor  # (mb,)
    n_preview: int  # the preview grid's tokens, first in `tokens` (0 when editing): not in the loss
    rollout: Rollout  # where they come from: rollout.tokens[rows] is `tokens`
    rows: slice
    support: torch.Tensor | None = None  # (mb, N, K) bool: the trained distribution's codes at each
    # token; None: all K, the whole softmax p (helpers/variants.py: --policy-dist truncated sets it)
    in_loss: bool = True  # False: its group's reward was not finite. It still runs its forward and
    # backward (under torchrun every process must join each collective), with its loss times 0


def micro_batches(rollouts: list[Rollout], advantages: torch.Tensor, size: int,
                  in_loss: torch.Tensor | None = None) -> list[MicroBatch]:
    """P rollouts, their (P, G) advantages and (P,) bool `in_loss` (default: all) -> MicroBatches of
    `size` rows, a group's in order."""
    if in_loss is None:
        in_loss = torch.ones(len(rollouts), dtype=torch.bool)
    batches = []
    for rollout, A, trained in zip(rollouts, advantages, in_loss, strict=True):  # A: its (G,)
        for start in range(0, len(A), size):
            rows = slice(start, start + size)
            batches.append(MicroBatch(
                inputs=rollout.inputs, tokens=rollout.tokens[rows],
                sampler_logprobs=rollout.p_logprobs[rows], advantages=A[rows],
                n_preview=math.prod(rollout.preview_hw), rollout=rollout, rows=rows,
                in_loss=bool(trained)))
    return batches


@torch.no_grad()
def reference_logprobs(ref_model, mb: MicroBatch, temperature: float) -> torch.Tensor | None:
    """(mb, N) log-probs of a micro-batch's tokens under the frozen reference, on the trained
    distribution (mb.support's codes, all by default); None without a reference (beta 0). With
    LoRA the reference is the policy with its adapter switched off."""
    if ref_model is None:
        return None
    adapter_off = getattr(ref_model, "disable_adapter", contextlib.nullcontext)
    with adapter_off():
        return token_logprobs(ref_model, mb.inputs, mb.tokens, temperature, support=mb.support)


class LossSettings(NamedTuple):  # the loss' symbols, as main sets them from the config
    clip_eps: float | torch.Tensor  # eps (helpers/variants.py may pass it per sample or token)
    kl_beta: float | torch.Tensor  # beta (idem)
    correction: str = "token_truncate"  # sampler_correction's mode
    cap: float = 2.0  # and its cap


def micro_batch_loss(distribution: torch.Tensor, mb: MicroBatch, old_logprobs: torch.Tensor,
                     ref_logprobs: torch.Tensor | None, settings: LossSettings
                     ) -> tuple[torch.Tensor, dict]:
    """A micro-batch's GRPO loss: (mb, N, K) log-probs of the trained policy pi_theta (code_logprobs
    of its logits, differentiable), (mb, N) pi_old's and the reference's of the drawn tokens ->
    grpo_loss on the large grid, the tokens the DiT sees, with TRL's mismatch weights; metrics."""
    logprobs = logprob_of(distribution, mb.tokens)  # (mb, N) log pi_theta of the drawn codes
    weights = sampler_correction(old_logprobs, mb.sampler_logprobs, settings.correction,
                                 settings.cap)  # (mb, N): a sequence mode's weight is the whole draw's,
    # the preview's codes included: they condition the large grid (test_train_step_correction)
    large = slice(mb.n_preview, None)  # the preview conditions the large grid but is never drawn
    if ref_logprobs is not None:
        ref_logprobs = ref_logprobs[:, large]
    loss, metrics = grpo_loss(logprobs[:, large], old_logprobs[:, large], ref_logprobs,
                              mb.advantages, settings.clip_eps, settings.kl_beta, weights[:, large])
    return loss, {"loss": loss.item(), **metrics}


def train_mode(policy) -> None:
    """The policy in the mode train_step trains it in, or a one-line refusal: transformers only
    checkpoints activations in train mode, and without dropout train and eval mode are one policy;
    with a dropout on, each forward would draw another policy, so pi_old would not be the sampler's
    and the ratio would leave 1 at lr 0."""
    policy.train(policy.is_activation_checkpointing)
    dropping = active_dropout(policy)
    if dropping:
        raise ValueError(f"train_step: {dropping[0]} drops out in train mode, so pi != pi_old; "
                         "set its p to 0 (disable_dropout) or put the model in eval mode")


def train_step(policy, optimizer, batches: list[MicroBatch], ref_model, loss_fn,
               settings: LossSettings, *, temperature: float, mu: int, max_grad_norm: float,
               readings=None, scheduler=None) -> dict:
    """`mu` updates of the policy on one step's micro-batches -> metrics.
    `loss_fn(distribution, mb, old_logprobs, ref_logprobs, settings)`: micro_batch_loss, or a
    variant's wrapper of it (helpers/variants.py). `readings(logits, mb, old_logprobs,
    ref_logprobs)`: the one seam, docs/healthy_training.md's measurements beside the loss
    (helpers/diagnostics.py), or None. `scheduler`: a learning-rate schedule stepped after each
    update applied (transformers' get_scheduler; metrics' "lr": the first update's rate), or None.
    A micro-batch out of the loss (mb.in_loss False: its group's reward was not finite) runs with
    its loss times 0; the step is skipped only when no process has one in the loss. The metrics'
    "sequences": those in the loss here (helpers/ averages the processes' metrics by them)."""
    train_mode(policy)
    if all_agree(not any(mb.in_loss for mb in batches)):  # every group left (non-finite rewards)
        return {"skipped": mu}
    K = policy.config.vq_config.num_embeddings
    shares = loss_shares(batches)  # the loss is a mean over sequences: each micro-batch's weight
    ref_logprobs = [reference_logprobs(ref_model, mb, temperature) for mb in batches]  # no gradient
    rate = optimizer.param_groups[0]["lr"]  # the first update's learning rate (logged)
    old_logprobs = [None] * len(batches)  # pi_old's, filled by the first update
    updates, skipped = [], 0  # each update's micro-batches: (metrics, share)
    for _ in range(mu):  # mu updates on the same samples (cleanrl's update epochs); unlike its
        # minibatches, the micro-batches below accumulate ONE gradient: one optimizer step an update
        optimizer.zero_grad(set_to_none=True)
        update = []
        for k, mb in enumerate(batches):  # gradient accumulation, a micro-batch at a time
            logits = token_logits(policy, mb.inputs, mb.tokens)  # (rows, N, V), with grad
            distribution = code_logprobs(logits, temperature, K, support=mb.support)  # pi_theta
            if old_logprobs[k] is None:  # the first update: no weight has moved since sampling
                # (the optimizer steps after the last micro-batch): pi_theta IS pi_old, r = 1
                old_logprobs[k] = logprob_of(distribution, mb.tokens).detach()
            loss, metrics = loss_fn(distribution, mb, old_logprobs[k], ref_logprobs[k], settings)
            (loss * shares[k]).backward()  # even out of the loss: every process joins FSDP's sync
            if mb.in_loss:
                if readings is not None:
                    metrics |= readings(logits.detach(), mb, old_logprobs[k], ref_logprobs[k])
                update.append((metrics, shares[k]))
        updates.append(update)
        grad_norm, stepped = optimizer_step(optimizer, update, max_grad_norm)  # one step an update
        skipped += not stepped
        if stepped and scheduler is not None:  # the next update's rate (a skipped update moves none)
            scheduler.step()
    sequences = sum(len(mb.tokens) for mb in batches if mb.in_loss)  # in the loss, this process
    return merge_metrics(updates) | {"grad_norm": grad_norm,  # the last update's, before its clip
                                     "skipped": skipped, "sequences": sequences, "lr": rate}


def loss_shares(batches: list[MicroBatch]) -> list[float]:
    """Each micro-batch's weight in the step's loss, a mean over the sequences in the loss: its rows
    over the rows in the loss (0 out of the loss). Under torchrun FSDP averages the processes'
    gradients, so the rows counted are the mean over the processes of each one's (rows_per_process),
    which makes the gradient the mean over every sequence of every process."""
    sequences = sum(len(mb.tokens) for mb in batches if mb.in_loss)
    n_rows = rows_per_process(sequences)
    return [len(mb.tokens) / n_rows if mb.in_loss else 0.0 for mb in batches]


def optimizer_step(optimizer, parts: list[tuple[dict, float]], max_grad_norm: float
                   ) -> tuple[float, bool]:
    """Clip the accumulated gradient and step -> its norm before the clip, and whether it stepped:
    a non-finite loss (in `parts`: each micro-batch's metrics and share) or gradient in any process
    skips the step, and never reaches the weights."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    grad_norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm).item()
    finite = math.isfinite(grad_norm) and all(math.isfinite(m["loss"]) for m, _ in parts)
    if all_agree(finite):  # every process steps, or none
        optimizer.step()
        # bf16 autocast keeps the copies of the weights it cast until its region ends, and
        # train_step runs in one: without this the next update would read the weights before
        # this step (pi = pi_old, r = 1, no clip)
        torch.clear_autocast_cache()
        return grad_norm, True
    optimizer.zero_grad(set_to_none=True)
    return grad_norm, False


# ---- The loop: steps 1-5, a step at a time -------------------------------------------------------

def train(pipe, policy, ref_model, optimizer, examples: list[dict], rewards: dict, cfg: Config,
          scheduler=None) -> list[dict]:
    """GRPO's loop, as a student reads it: cfg.steps steps, each on the next cfg.prompts_per_step
    `examples` (prompts file lines, "target" a loaded (3, H, W) image in [0, 1]), scored by `rewards`
    ({name: (fn, weight)}) -> each step's metrics. `main` runs this loop with helpers/run.py's plumbing
    around each step (checks, timing, checkpoints, logging, evaluation, many processes, the variants'
    seams): test_grpo.py::test_train shows that both give the same numbers at the tiny presets."""
    settings = LossSettings(cfg.clip_eps, cfg.kl_beta, cfg.sampler_correction, cfg.sampler_cap)
    history = []
    for step in range(cfg.steps):
        groups = [step * cfg.prompts_per_step + j for j in range(cfg.prompts_per_step)]  # over the run
        batch = [examples[g % len(examples)] for g in groups]  # the file's order, round and round
        rollouts = sample_groups(  # 1. sample a group of G token grids per prompt
            pipe, [ex["prompt"] for ex in batch], cfg.group_size, cfg.height, cfg.width,
            cfg.temperature, [group_seed(cfg.seed, g) for g in groups],
            [ex.get("source") for ex in batch], cfg.top_k, cfg.top_p)
        images = [decode_images(  # 2. decode them to pictures, a group from one noise
            pipe, ex["prompt"], rollout.tokens, rollout.large_hw, cfg.height, cfg.width,
            cfg.num_inference_steps, cfg.decode_seed, cfg.guidance_scale, rollout.source)
            for ex, rollout in zip(batch, rollouts)]
        reward, _ = group_rewards(images, batch, rewards)  # 3. score: (P, G)
        advantages = group_advantages(reward)  # 4. z-scores within each group
        batches = micro_batches(rollouts, advantages, cfg.micro_batch_size)
        metrics = train_step(policy, optimizer, batches, ref_model, micro_batch_loss, settings,  # 5.
                             temperature=cfg.temperature, mu=cfg.mu,
                             max_grad_norm=cfg.max_grad_norm, scheduler=scheduler)
        history.append({"step": step + 1, "reward_mean": reward.mean().item(), **metrics})
    return history


# ---- main: the loop with the run's plumbing around it --------------------------------------------

def main(argv: list[str] | None = None) -> dict:
    """The command line's run: `train`'s steps 1-5, with the run's plumbing around them (helpers/
    run.py: the checks, processes, timing, checkpoints, logging, evaluation) and the two seams of the
    options beside the lesson (helpers/variants.py)."""
    lesson = sys.modules[__name__]  # this file: helpers/ takes what it needs of it as an argument
    job = run.prepare(parse_config(argv), argv, REWARDS, lesson)  # all input checked, none written
    cfg = job.cfg
    run.start(job)  # torchrun: one process per GPU (else rank 0 of 1), the device and dtype
    with run.timed({}, "load", job), run.loading(cfg.model):
        pipe = load_glm_image(cfg.model, job.device, job.dtype, cfg.revision)
    with run.timed({}, "setup", job):
        policy, ref_model, optimizer = setup.setup_training(  # the AR: LoRA, FSDP2, AdamW
            pipe, cfg, job.dtype, job.world, reference_model)
        run.open_run(job, policy, optimizer, ref_model)  # --resume's checkpoint; the run directory
    # the before / after grids and --eval-prompts: steps 1-3 on fixed seeds (helpers/run.py)
    job.evaluate = run.evaluator(job, pipe, policy, (sample_groups, decode_images, group_rewards))
    settings = LossSettings(clip_eps=cfg.clip_eps, kl_beta=cfg.kl_beta,
                            correction=cfg.sampler_correction, cap=cfg.sampler_cap)
    # docs/healthy_training.md's measurements, beside the loss
    readings = diagnostics.reader(cfg, policy.config.vq_config.num_embeddings, lesson)
    with run.training(job):  # Ctrl-C: a checkpoint, exit 130; a full disk: one line, exit 1
        # each step: P examples (prompts, targets, sources), numbered over the run by group_ids
        for step, group_ids, examples, seconds in run.steps(job):
            with run.timed(seconds, "sample", job), job.autocast, unsharded(policy):
                rollouts = sample_groups(  # 1. sample a group of token grids per prompt
                    pipe, prompts=[ex["prompt"] for ex in examples], group_size=cfg.group_size,
                    height=cfg.height, width=cfg.width, temperature=cfg.temperature,
                    seeds=[group_seed(cfg.seed, g) for g in group_ids],
                    sources=[ex.get("source") for ex in examples], top_k=cfg.top_k,
                    top_p=cfg.top_p)
            with run.timed(seconds, "decode", job), run.decoder_on(pipe, job.device, cfg.offload):
                images = [decode_images(  # 2. decode the tokens to pictures
                    pipe, prompt=ex["prompt"], tokens=rollout.tokens, large_hw=rollout.large_hw,
                    height=cfg.height, width=cfg.width, num_inference_steps=cfg.num_inference_steps,
                    seed=cfg.decode_seed, guidance_scale=cfg.guidance_scale, source=rollout.source)
                    for ex, rollout in zip(examples, rollouts)]
            with run.timed(seconds, "reward", job):
                reward, each = group_rewards(images, examples, job.rewards)  # 3. score: (P, G)
                # (P,) bool, False for a group with a NaN / inf reward (warned): A 0, loss out
                in_loss = run.finite_groups(job, step, reward, each, examples)
                advantages = variants.advantages(  # 4. z-scores within each group (and the seam)
                    group_advantages(reward), rollouts, reward, each, in_loss, cfg, lesson, images)
            with run.landing():  # from here the step lands whole or not at all: a stop waits
                with run.timed(seconds, "train", job), job.autocast:  # 5. the clipped update
                    # the seam of step 5: the variants' micro-batches and loss (else as given)
                    micro, loss_fn = variants.update(
                        micro_batches(rollouts, advantages, cfg.micro_batch_size, in_loss),
                        micro_batch_loss, policy, cfg, lesson, reward, each, job.variants)
                    metrics = train_step(policy, optimizer, micro, ref_model, loss_fn, settings,
                                         temperature=cfg.temperature, mu=cfg.mu,
                                         max_grad_norm=cfg.max_grad_norm, readings=readings,
                                         scheduler=job.scheduler)
                run.log_step(job, step, group_ids, reward, each, advantages, in_loss, rollouts,
                             metrics, seconds)
                run.after_step(job, step, examples, images, reward, each)  # reference, checkpoint
            run.evaluation(job, step)  # --eval-prompts, when due
    return run.finish(job)  # the last checkpoint, final/, curves.png, the after grid, the summary


# ---- Copied alone --------------------------------------------------------------------------------
# Without helpers/ there is one process: each collective is an identity, and the metrics are the
# last update's share-weighted means, ratio_min / ratio_max over every update (train runs; main needs
# helpers/).

if run is None:
    def all_agree(flag: bool) -> bool:
        return flag

    def rows_per_process(n: int) -> float:
        return n

    def merge_metrics(updates: list[list[tuple[dict, float]]]) -> dict:
        last = updates[-1]
        merged = {key: sum(m[key] * share for m, share in last) for key in last[0][0]}
        every = [m for update in updates for m, _ in update]
        merged["ratio_min"] = min(m["ratio_min"] for m in every)
        merged["ratio_max"] = max(m["ratio_max"] for m in every)
        return merged


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:  # Ctrl-C while loading or checking (training handles its own)
        print("grpo.py: interrupted", file=sys.stderr)
        raise SystemExit(130) from None
    run.leave()  # torchrun: a finished process exits before a gloo thread can abort it
