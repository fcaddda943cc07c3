"""GRPO on GLM-Image, in one file you can read top to bottom.

GLM-Image draws a picture in two stages: an autoregressive model (the AR, a 9B GLM) writes a grid of
visual tokens, and a diffusion transformer (the DiT, 7B) paints pixels conditioned on those tokens.
This file trains the AR with GRPO (Group Relative Policy Optimization, Shao et al. 2024):

  for each prompt q (and, to edit, a source image), sample a group of G token sequences o_1..o_G from the
  old policy, decode them to images, score them (SSIM / -MSE against a target, OCR of rendered text, or
  any function of the images), and maximise

    J = 1/G sum_i 1/|o_i| sum_t [ min(r_it A_i, clip(r_it, 1-eps, 1+eps) A_i) - beta KL_it ]

  with r_it = pi(o_it | q, o_i<t) / pi_old(o_it | q, o_i<t), A_i = (R_i - mean(R)) / std(R) over the
  group, and KL_it the k3 estimator exp(ref - logp) - (ref - logp) - 1 against a frozen reference.

Where this departs from the paper:
  - The "sequence" is a visual-token grid, not text: a small preview grid (~16x16) then the large grid
    (H/32 x W/32). Only the large grid reaches the DiT, so by default the loss covers only those tokens
    (`--train-tokens large`); the preview tokens still condition them.
  - Sampling (grpo.py's own decode loop, a CUDA graph per step on a GPU) is restricted to the VQ codebook ids and
    never stops early, so every sample has exactly N tokens; sampler and trainer share one definition of the
    distribution (`code_logprobs`: softmax(logits / T) over the codebook, truncated by --top-k / --top-p as
    deployed: GLM-Image samples with top-p 0.75), which is what makes pi / pi_old exactly 1 on the first update.
    Peers that sample with top-p but score the full softmax break that ratio; here the trainer scores over the very
    codes the sampler's truncation kept (`Rollout.support`), so no sampled token falls outside.
  - In bf16 the KV-cached sampler and the full-sequence trainer round differently (up to 0.12 nats a token at full
    depth): pi_old is the trainer's forward, and the policy-gradient term is weighted by pi_old / pi_sampler,
    truncated at 2 per token (`--sampler-correction`, TRL's importance-sampling correction; 1 in float32).
  - The AR uses 3D rotary positions. A teacher-forced forward must be given the positions that
    generation used (`rope_positions`); the default forward gets them wrong for every image token.
  - The DiT and VAE are frozen and run with the same latent noise for every sample of a group, so
    reward differences come from the tokens alone.
  - Advantages use the population std of the group (`--scale-rewards batch`: of the step's whole batch; `none`:
    Dr. GRPO's centring only), and a group with no spread gets zero advantage. The clip range may be asymmetric
    (`--clip-eps-high`, DAPO's clip-higher).
  - `--train dit` trains the DiT instead, on its denoising chain (Flow-GRPO's SDE step; dit_grpo.py): the AR's
    tokens are sampled once per prompt and the group differs by decoder noise alone.
  - Editing: the source image is encoded once per group and its codes written into the prompt, so sampler
    and trainer see the same tokens; the AR then writes the large grid only (no preview grid).

Many GPUs the nanoGPT way: under torchrun each process takes whole groups of its own (the algorithm never
sees the world size), FSDP2 shards the trained model (`parallel.shard`), rank 0 writes. Helpers live beside this file:
offline_model.py (GLM-Image built in code), parallel.py (torch.distributed), run_io.py (files, curves.png), rewards.py
(more rewards), world.py (the tiny model's world of shapes); tools/compare.py puts a run beside its base model.

Commands:
  pip install -r requirements.txt
  python grpo.py --prompts prompts.txt                          # the pre-trained tiny GLM-Image, 2 CPU cores
  python grpo.py --prompts examples/shapes.txt --reward shapes  # draw what the caption asks (a rule-based reward)
  python grpo.py --prompts examples/shapes.txt --reward shapes --eval-prompts examples/shapes_heldout.jsonl  # held out
  python grpo.py --prompts examples/edits.jsonl                 # editing: a source image in the prompt
  python grpo.py --prompts my_prompts.txt --model zai-org/GLM-Image                  # the real model (GPU, bf16)
  python grpo.py --prompts my_prompts.txt --model random --steps 1  # its published configs, random weights: speed
  torchrun --nproc-per-node 8 grpo.py --prompts my_prompts.txt --model zai-org/GLM-Image  # 8 GPUs, FSDP2
  python -m pytest -q                                           # tests, CPU, 8-14 minutes
"""

import argparse
import contextlib
import copy
import dataclasses
import json
import math
import os
import re
import sys
import time
import warnings
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from tqdm.auto import tqdm

from parallel import (INTERRUPT, all_agree, distributed, extreme, final_weights, gather_list, gather_rows,  # many GPUs
                      interrupts_caught, interrupts_held, load_trainable_state, reduce_metrics, shard, start_processes,
                      stop_processes, stop_requested, sync_gradients, trainable_state, unsharded)
from rewards import MORE_REWARDS, import_reward, needs  # ocr, shapes, module:function rewards
from run_io import (RUN_FILES, Reporter, append_metrics, atomic_write, check_out_dir, check_reporter,  # run files
                    image_grid, open_run_dir, plot_curves, read_checkpoint, read_metrics, read_resume, save_checkpoint,
                    save_image, save_pretrained_atomic, side_by_side)


# ---- 1. Config ----------------------------------------------------------------------------------

def arg(default, help: str):
    """A config field whose one-line doc becomes its --help."""
    return dataclasses.field(default=default, metadata={"help": help})


@dataclasses.dataclass
class Config:
    prompts: str = arg("prompts.txt", "'prompt | target.png' lines, or .jsonl: {\"prompt\", \"target\", \"source\"}")
    model: str = arg("tiny", "hub id (zai-org/GLM-Image), local path, 'tiny' (the pre-trained tiny_glm_image/), or "
                             "'random' (the published configs, random weights: speed and memory without the download)")
    out: str = arg("runs/grpo", "output directory")
    steps: int = arg(100, "optimizer steps")
    seed: int = arg(0, "seed of the AR sampling")
    group_size: int | None = arg(None, "samples per prompt (G) (default 8 tiny, 4 real)")
    prompts_per_step: int | None = arg(None, "prompts (groups) per optimizer step (default 2 tiny, 1 real)")
    micro_batch_size: int | None = arg(None, "sequences per forward/backward (default 4 tiny, 1 real)")
    lr: float | None = arg(None, "AdamW lr (default 1e-4 tiny, 1e-5 real)")
    weight_decay: float = arg(0.01, "AdamW weight decay")
    max_grad_norm: float = arg(1.0, "gradient-norm clip")
    clip_eps: float = arg(0.2, "PPO clip range eps: the ratio is clipped to [1 - eps, 1 + eps_high]")
    clip_eps_high: float | None = arg(None, "upper clip range (DAPO's clip-higher; default: --clip-eps)")
    scale_rewards: str = arg("group", "advantages divided by the std of the group, the batch, or none (Dr. GRPO)")
    kl_beta: float | None = arg(None, "weight of the k3 KL to the reference (default 0 tiny, 0.04 real)")
    mu: int = arg(1, "policy updates per batch of rollouts")
    temperature: float = arg(0.9, "sampling temperature (GLM-Image: 0.9)")
    top_p: float | None = arg(None, "nucleus sampling, scored exactly: the fewest codes with probability >= p "
                                    "(default 1.0 tiny: off; 0.75 real: GLM-Image's)")
    top_k: int = arg(0, "sample from the k most likely codes only, scored exactly (0: off)")
    sampler_correction: str = arg("token_truncate", "importance weights pi_old / pi_sampler on the policy-gradient "
                                  "term for the sampler/trainer gap in bf16: token_truncate | token_mask | "
                                  "sequence_truncate | sequence_mask (TRL's modes) | none")
    sampler_cap: float = arg(2.0, "the cap of --sampler-correction: weights above it are cut to it (truncate) or 0 "
                                  "(mask)")
    height: int | None = arg(None, "image height (default 96 tiny, 1024 real)")
    width: int | None = arg(None, "image width (default 96 tiny, 1024 real)")
    num_inference_steps: int | None = arg(None, "DiT denoising steps (default 2 tiny, 50 real)")
    guidance_scale: float | None = arg(None, "DiT classifier-free guidance (default 1.0 tiny, 1.5 real: GLM-Image's)")
    decode_seed: int = arg(0, "seed of the DiT latent noise (fixed per run)")
    reward: str = arg("ssim=1,mse=0", "rewards and weights: ssim, mse, ocr or module:function, e.g. ssim=1,ocr=0.5")
    train_tokens: str = arg("large", "tokens in the loss: large | all")
    image_every: int = arg(10, "save an image grid every N steps (0: never)")
    before_after: int | None = arg(None, "the first N prompts, sampled with fixed seeds before and after training: "
                                         "images/before_after.png (default 4 tiny, 0 real)")
    eval_prompts: str = arg("", "held-out prompts (formats as --prompts; .jsonl lines may carry a \"category\"), "
                                "scored with fixed seeds at step 0, every --eval-every steps and at the end")
    eval_every: int = arg(25, "evaluate every N steps (0: only before the first update and at the end)")
    eval_samples: int = arg(4, "images per eval prompt")
    eval_reward: str = arg("", "rewards only measured on the eval prompts, never optimised, e.g. shapes_exact")
    save_every: int = arg(50, "save a checkpoint every N steps (0: only at the end)")
    resume: str = arg("", "run directory to continue (--steps is the total)")
    overwrite: bool = arg(False, "replace the run in --out")
    train: str = arg("ar", "what GRPO trains: ar (the AR's visual tokens) or dit (the DiT's denoising chain, "
                           "Flow-GRPO: dit_grpo.py; text-to-image)")
    sde_noise: float = arg(0.7, "--train dit: noise level of the SDE step (Flow-GRPO's a)")
    sde_steps: int = arg(0, "--train dit: denoising steps of the training chains (0: --num-inference-steps; "
                            "evaluation and pictures keep --num-inference-steps)")
    sde_window: int = arg(0, "--train dit: SDE steps (trained) on the first N denoising steps, ODE after (0: all SDE)")
    lora_rank: int | None = arg(None, "LoRA rank on the trained model, 0: train all its weights (default 0 tiny, 16 real)")
    gradient_checkpointing: bool | None = arg(None, "recompute activations in the backward (default: on for --train "
                                                    "dit with the real model, whose update does not fit without)")
    offload: bool = arg(False, "keep DiT, VAE, T5 on CPU except to decode")
    device: str = arg("auto", "cpu | cuda | auto")
    report_to: str = arg("none", "also send the metrics and image grids to tensorboard (<out>/tensorboard) or wandb "
                                 "(offline, <out>/wandb): none | tensorboard | wandb")
    dtype: str = arg("auto", "float32 | bfloat16 | auto")


MODEL_DEFAULTS = {  # filled in where the command line left a field at None
    "tiny": dict(lr=1e-4, kl_beta=0.0, height=96, width=96, num_inference_steps=2, guidance_scale=1.0, top_p=1.0,
                 group_size=8, prompts_per_step=2,
                 micro_batch_size=4, lora_rank=0, before_after=4),
    # LoRA r=16 with micro-batches of 1 fits one 80 GB GPU (about 46 GiB estimated, see tools/memory_plan.py)
    "real": dict(lr=1e-5, kl_beta=0.04, height=1024, width=1024, num_inference_steps=50, guidance_scale=1.5, top_p=0.75,
                 group_size=4,
                 prompts_per_step=1, micro_batch_size=1, lora_rank=16, before_after=0),
}


def config_parser(default=None) -> argparse.ArgumentParser:
    """One flag per Config field (the name with dashes), defaulting to the field's default (or to `default`)."""
    parser = argparse.ArgumentParser(description="GRPO on GLM-Image", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    for f in dataclasses.fields(Config):
        kinds = {"int | None": int, "float | None": float, "bool | None": bool}  # optional: a model-dependent default
        flag, kind = "--" + f.name.replace("_", "-"), kinds.get(str(f.type), f.type)
        value = f.default if default is None else default
        if kind is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=value, help=f.metadata["help"])
        else:
            parser.add_argument(flag, type=kind, default=value, help=f.metadata["help"])
    return parser


def given_flags(argv: list[str] | None = None) -> set[str]:
    """The Config fields the command line sets itself (not left at their defaults)."""
    return set(vars(config_parser(default=argparse.SUPPRESS).parse_args(argv)))


def parse_config(argv: list[str] | None = None) -> Config:
    """Command line -> Config. Flags are the field names with dashes; None fields get MODEL_DEFAULTS."""
    cfg = Config(**vars(config_parser().parse_args(argv)))
    defaults = MODEL_DEFAULTS["tiny" if cfg.model == "tiny" else "real"]
    defaults = {**defaults, "gradient_checkpointing": cfg.model != "tiny" and cfg.train == "dit"}  # tools/memory_plan
    return dataclasses.replace(cfg, **{k: v for k, v in defaults.items() if getattr(cfg, k) is None})


# ---- 2. Loading GLM-Image -----------------------------------------------------------------------

TINY = Path(__file__).resolve().parent / "tiny_glm_image"  # a tiny GLM-Image pre-trained by tools/train_tiny.py


def load_glm_image(name: str, device: str = "cpu", dtype: torch.dtype = torch.float32):
    """GlmImagePipeline.from_pretrained(name): a hub id, a local folder, or 'tiny' (the folder TINY, a few MB, which
    draws world.py's shapes); 'random' builds GLM-Image from its published configs with random weights on the
    device (no download: 3-4 s for the 17B parameters in bf16 on an H100), to measure speed and memory; 'random:L'
    with L layers in each of its parts. Everything but the AR frozen."""
    from diffusers import GlmImagePipeline
    if name.split(":")[0] == "random":
        from offline_model import PUBLISHED, glm_image, with_depths
        layers = int(name[len("random:"):]) if ":" in name else None
        default = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            configs = with_depths(PUBLISHED, layers, layers, layers, layers) if layers else PUBLISHED
            return only_ar_trains(glm_image(configs, device=device))
        finally:
            torch.set_default_dtype(default)
    pipe = GlmImagePipeline.from_pretrained(TINY if name == "tiny" else name, dtype=dtype)
    return only_ar_trains(pipe.to(device))


def only_ar_trains(pipe):
    """Freeze the DiT, VAE, T5 and the AR's vision tower and VQ; eval mode and no dropout everywhere. Returns `pipe`."""
    pipe.set_progress_bar_config(disable=True)
    for module in (pipe.text_encoder, pipe.transformer, pipe.vae):
        module.requires_grad_(False).eval()
    ar = pipe.vision_language_encoder.eval()  # models built in code start in train mode
    ar.model.visual.requires_grad_(False)  # the vision tower and VQ encoder only encode source images
    ar.model.vqmodel.requires_grad_(False)
    disable_dropout(ar)
    return pipe


@contextlib.contextmanager
def decoder_on(pipe, device: str, offload: bool):
    """With --offload the frozen T5, DiT and VAE sit on the CPU and come to `device` only inside this block."""
    for module in (pipe.text_encoder, pipe.transformer, pipe.vae) if offload else ():
        module.to(device)
    try:
        yield
    finally:
        for module in (pipe.text_encoder, pipe.transformer, pipe.vae) if offload else ():
            module.to("cpu")


def disable_dropout(model) -> None:
    """Zero every dropout of the AR (GLM-Image's are already 0), so train and eval mode give the same
    distribution: dropout on in training but not in sampling would make pi != pi_old at step 0."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        if isinstance(getattr(module, "attention_dropout", None), float):
            module.attention_dropout = 0.0


def apply_lora(policy, rank: int, seed: int = 0):
    """Wrap the AR's language-model attention and MLP projections in LoRA adapters (peft) and freeze the rest.

    Dropout 0 so sampler and trainer see one distribution. The adapters' random A matrices come from `seed`
    (the caller's RNG untouched): the same seed, the same run, on every process. The adapters are injected into `policy`
    in place, so the pipeline samples with them; the returned PeftModel can switch them off
    (`disable_adapter`, the reference) and saves just the adapter.
    """
    from peft import LoraConfig, get_peft_model  # optional dependency, only for --lora-rank > 0
    config = LoraConfig(r=rank, lora_alpha=rank, lora_dropout=0.0,
                        target_modules=r".*language_model\.layers\.\d+\.(self_attn\.(q|k|v|o)_proj|mlp\.(gate_up|down)_proj)")
    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        torch.manual_seed(seed)
        warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning)  # peft asks
        return get_peft_model(policy, config)


def reference_model(policy, kl_beta: float):
    """The KL reference: None when beta = 0 (no KL term); with LoRA the policy itself, whose base weights
    are the reference once the adapter is switched off (no second copy); else a frozen copy of the AR."""
    if kl_beta == 0:
        return None
    if hasattr(policy, "disable_adapter"):
        return policy
    return copy.deepcopy(policy).requires_grad_(False).eval()


# ---- 3. Prompts, targets and source images ------------------------------------------------------

def read_prompts(path: str, flag: str = "--prompts") -> list[dict]:
    """A prompts file -> examples: dicts with "prompt", "target" and "source" (image paths or None), "text" (the
    text the image should show, or None), "where" (file:line, for messages) and any other fields of a .jsonl line.

    Text file: 'prompt | target.png' per line (split at the last '|'), or a prompt alone (no target).
    .jsonl: one object per line, {"prompt": "make it night", "target": "night.png", "source": "day.png"}; "target"
    and "source" (an image to edit) are optional. Paths are relative to the prompts file. "text" is the .jsonl
    field, else the text in quotes in the prompt (GLM-Image's convention: its glyph encoder renders quoted text).
    Blank lines and '#' comments are skipped. Raises ValueError naming the file and line (and `flag`).
    """
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as error:
        reason = "not UTF-8 text" if isinstance(error, UnicodeDecodeError) else error.strerror or str(error)
        raise ValueError(f"cannot read {flag} {path} ({reason}); give a text file of 'prompt | target.png' lines "
                         "or a .jsonl file")
    examples = []
    for number, line in enumerate(lines, start=1):
        line, where = line.strip(), f"{path}:{number}"
        if not line or line.startswith("#"):
            continue
        fields = read_jsonl_line(line, where) if path.suffix == ".jsonl" else read_text_line(line, where)
        quoted = " ".join(a or b for a, b in re.findall(r'"([^"]+)"|“([^”]+)”', fields["prompt"]))
        paths = {key: path.parent / fields[key] if fields.get(key) else None for key in ("target", "source")}
        examples.append({**fields, "text": fields.get("text") or quoted or None, "where": where, **paths})
    if not examples:
        raise ValueError(f"{path} has no examples; add lines of the form 'prompt | target.png'")
    return examples


def read_text_line(line: str, where: str) -> dict:
    """'prompt | target.png' or a prompt alone -> {"prompt", "target"}."""
    prompt, bar, target = (part.strip() for part in line.rpartition("|"))
    if bar and not (prompt and target):
        raise ValueError(f"{where}: expected 'prompt | target.png' or a prompt alone, got '{line}'")
    return {"prompt": prompt, "target": target} if bar else {"prompt": line}


def read_jsonl_line(line: str, where: str) -> dict:
    """One JSON object with a "prompt" string and optional "target", "source", "text" strings -> that dict."""
    example = '{"prompt": "make it night", "target": "night.png", "source": "day.png"}'
    try:
        fields = json.loads(line)
    except json.JSONDecodeError as error:
        raise ValueError(f"{where}: not JSON ({error.msg}); write one object per line, e.g. {example}") from None
    if not isinstance(fields, dict) or not isinstance(fields.get("prompt"), str) or not fields["prompt"].strip():
        raise ValueError(f'{where}: needs a "prompt" string, e.g. {example}')
    for key in ("target", "source", "text"):
        if fields.get(key) is not None and not (isinstance(fields[key], str) and fields[key].strip()):
            raise ValueError(f'{where}: "{key}" must be a non-empty string, e.g. {example}')
    return {**fields, "prompt": fields["prompt"].strip()}


def load_image(path: str | Path, height: int, width: int, role: str = "target") -> torch.Tensor:
    """PNG/JPEG -> (3, H, W) float32 in [0, 1], resized (bicubic) if its size differs.
    Raises ValueError for a missing or unreadable image."""
    if not Path(path).is_file():
        raise ValueError(f"{role} {path} does not exist; fix its path in the prompts file")
    try:
        with Image.open(path) as image:
            image = image.convert("RGB")
            if image.size != (width, height):
                image = image.resize((width, height), Image.BICUBIC)
            pixels = np.asarray(image, dtype=np.float32) / 255.0  # (H, W, 3)
    except OSError as error:
        raise ValueError(f"{role} {path} is not a readable image ({error}); replace it or fix the prompts file")
    return torch.from_numpy(pixels).permute(2, 0, 1).contiguous()  # (3, H, W)


# ---- 4. Group sampling --------------------------------------------------------------------------

class Source(NamedTuple):
    image: Image.Image  # the image being edited, as the DiT's VAE sees it
    codes: torch.Tensor  # (h_s * w_s,) long, its VQ codes from the AR's vision tower: encoded once per group
    grid_hw: tuple[int, int]  # (h_s, w_s) = its size / 32


class Rollout(NamedTuple):
    tokens: torch.Tensor  # (G, N) long, visual codes: preview grid then large grid (editing: the large grid only)
    logprobs: torch.Tensor  # (G, N) float32, log pi_old of each token under the sampled distribution
    inputs: dict  # AR inputs of the group: input_ids (G, P), attention_mask, image_grid_thw (2G, 3), ...
    preview_hw: tuple[int, int]  # preview grid (h', w'), generated first; (0, 0) when editing (none is generated)
    large_hw: tuple[int, int]  # large grid (H/32, W/32), generated last; the only one the DiT sees
    source: Source | None  # the image being edited, or None (text-to-image)
    support: torch.Tensor | None = None  # (G, N, K/8) uint8: each token's codes kept by top-k / top-p, as bits (None:
    # no truncation, all K codes); the trainer scores over this set (code_logprobs' `support`): the sampling mask kept


def code_logprobs(logits: torch.Tensor, temperature: float, codebook_size: int, top_k: int = 0,
                  top_p: float = 1.0, support: torch.Tensor | None = None) -> torch.Tensor:
    """(..., V) raw AR logits -> (..., K) float32 log-probs of the sampled distribution over the codebook ids:
    softmax(logits / T), truncated to the `top_k` most likely codes (ties at the k-th kept) and to the nucleus
    (the most likely codes down to the first whose cumulative probability reaches `top_p`), renormalised. Given a
    (..., K) bool `support` (the set the sampler kept: code_support), softmax(logits / T) renormalised over that set
    instead: the trainer replays the sampler's truncation rather than recomputing it from its own logits.

    The one definition of the policy's distribution: sample_group samples from it and the trainer scores with it,
    so pi / pi_old is exactly 1 before the first update. A code outside the truncation has log-prob -inf. A token
    that leaves the nucleus after an update therefore has ratio 0: with A > 0 the surrogate is 0 and without
    gradient (the clip takes (1 - eps) A only when that is smaller), with A < 0 it is the clipped (1 - eps) A, also
    without gradient; grpo_loss keeps it finite (tested). ids >= K (image start/end, spare ids) are impossible.
    """
    scores = logits[..., :codebook_size].float() / temperature
    if support is not None:
        return torch.log_softmax(scores.masked_fill(~support, -math.inf), dim=-1)
    if 0 < top_k < codebook_size:  # as transformers' TopKLogitsWarper
        scores = scores.masked_fill(scores < scores.topk(top_k, dim=-1).values[..., -1:], -math.inf)
    if top_p < 1.0:  # as transformers' TopPLogitsWarper: drop the least likely codes while their total is <= 1 - p
        ascending, order = scores.sort(dim=-1, stable=True)
        drop = ascending.softmax(dim=-1).cumsum(dim=-1) <= 1 - top_p
        drop[..., -1] = False  # the most likely code always stays
        scores = scores.masked_fill(drop.scatter(-1, order, drop), -math.inf)
    return torch.log_softmax(scores, dim=-1)


def support_bits(kept: torch.Tensor) -> torch.Tensor:
    """(..., K) bool -> (..., ceil(K/8)) uint8: the codes a truncation kept, 8 to a byte (2 KiB a token at K = 16384:
    10 MiB for a group of 4 at 1024x1024)."""
    kept = F.pad(kept, (0, -kept.shape[-1] % 8)).unflatten(-1, (-1, 8)).to(torch.uint8)  # (..., K/8, 8)
    return (kept << torch.arange(8, device=kept.device, dtype=torch.uint8)).sum(-1, dtype=torch.uint8)


def code_support(bits: torch.Tensor, codebook_size: int) -> torch.Tensor:
    """support_bits' (..., ceil(K/8)) uint8 -> the (..., K) bool set again."""
    shifts = torch.arange(8, device=bits.device, dtype=torch.uint8)
    return ((bits[..., None] >> shifts) & 1).bool().flatten(-2)[..., :codebook_size]


def group_inputs(processor, prompt: str, group_size: int, height: int, width: int, device,
                 source: Image.Image | None = None) -> dict:
    """One prompt (and the image to edit, if any) -> AR inputs repeated G times. Repeating by hand keeps each
    sample's grid rows together; generate(num_return_sequences=G) would repeat_interleave them.

    Per sample, image_grid_thw holds [large, preview] for text-to-image and [source, large] for editing (which
    generates no preview grid). With a source, `pixel_values` (one copy) are its patches and input_ids hold one
    <|image|> placeholder per source token, until encode_source puts the codes in their place.
    """
    content = ([{"type": "image", "image": source}] if source is not None else []) + [{"type": "text", "text": prompt}]
    one = processor.apply_chat_template([[{"role": "user", "content": content}]], tokenize=True, return_dict=True,
                                        processor_kwargs=dict(target_h=height, target_w=width, return_tensors="pt"))
    inputs = {
        "input_ids": one["input_ids"].repeat(group_size, 1).to(device),  # (G, P)
        "attention_mask": one["attention_mask"].repeat(group_size, 1).to(device),  # (G, P)
        "image_grid_thw": one["image_grid_thw"].repeat(group_size, 1).to(device),  # (2G, 3): 2 grid rows per sample
        "images_per_sample": one["images_per_sample"].repeat(group_size).to(device),  # (G,)
    }
    if source is not None:
        inputs["pixel_values"] = one["pixel_values"].to(device)  # (h_s * w_s, 3 * 16 * 16), one copy
    return inputs


@torch.no_grad()
def encode_source(model, inputs: dict, source: Image.Image) -> tuple[dict, Source]:
    """The source's patches -> its VQ codes (vision tower, then nearest codebook entry), written into input_ids in
    place of the <|image|> placeholders: the path GlmImageModel.forward takes with pixel_values, done ONCE per group,
    so the sampler and every training forward see the very same source tokens (and need no pixel_values)."""
    core, grid = model.model, inputs["image_grid_thw"][:1]  # (1, 3): the source row of the first sample
    features = core.get_image_features(inputs["pixel_values"], grid, return_dict=True).pooler_output
    codes = core.get_image_tokens(features).view(-1)  # (h_s * w_s,)
    ids = inputs["input_ids"]
    filled = ids.masked_scatter(ids == model.config.image_token_id, codes.repeat(ids.shape[0]))
    inputs = {k: v for k, v in inputs.items() if k != "pixel_values"} | {"input_ids": filled}
    (_, h, w) = grid[0].tolist()
    if (32 * h, 32 * w) != (source.height, source.width):  # the DiT conditions on the source at (h_s, w_s) x 32
        raise ValueError(f"the processor made a {h}x{w} token grid of a {source.width}x{source.height} source; the DiT "
                         "needs size / 32: resize sources (or the processor's size limits) to match")
    return inputs, Source(source, codes, (h, w))


def to_pil(image: torch.Tensor) -> Image.Image:
    """(3, H, W) float in [0, 1] -> PIL (exact for images read from 8-bit files). The processor rescales by 1/255
    itself, so it must not get the [0, 1] tensor."""
    return Image.fromarray((image.float().clamp(0, 1).permute(1, 2, 0).cpu().numpy() * 255).round().astype(np.uint8))


def group_prompt(pipe, prompt: str, group_size: int, height: int, width: int,
                 source: torch.Tensor | None = None) -> tuple[dict, Source | None, tuple, tuple]:
    """One prompt (and a (3, H, W) source image) -> the group's AR inputs (group_inputs; editing: with the source's
    codes in place, encode_source), the Source, and the preview and large grids (h', w'), (H/32, W/32) that the AR
    will write: the preview first, (0, 0) when editing (none is written)."""
    model = pipe.vision_language_encoder
    image = to_pil(source) if source is not None else None
    inputs = group_inputs(pipe.processor, prompt, group_size, height, width, model.device, image)
    first, second = (tuple(row[1:]) for row in inputs["image_grid_thw"][:2].tolist())
    if image is None:
        return inputs, None, second, first  # image_grid_thw holds [large, preview]
    inputs, src = encode_source(model, inputs, image)
    return inputs, src, (0, 0), second  # [source, large]


def rope_positions(input_ids: torch.Tensor, image_grid_thw: torch.Tensor, num_tokens: int, image_start_id: int,
                   image_end_id: int) -> torch.Tensor:
    """3D rotary positions (3, 1, P + N - 1) of one sample's prompt (input_ids (P,), its grid rows) followed by all
    of its N generated tokens but the last, as GlmImageModel.get_rope_index gives them to generate.

    Text is a 1D ramp on all three axes (temporal, height, width). A source image (the tokens between an image-start
    and an image-end id) with grid h x w starting at p takes t = p, h = p + row, w = p + col, and the ramp goes on
    at p + max(h, w). The grids the prompt does not hold are then generated in REVERSE order of image_grid_thw
    (text-to-image: preview, then large; editing: the large grid) by the same rule, each starting where the last
    one ended.
    """
    ids = input_ids.tolist()
    starts = [i + 1 for i, t in enumerate(ids) if t == image_start_id]  # first token of each image in the prompt
    ends = [i for i, t in enumerate(ids) if t == image_end_id]  # a source image is complete: it has an end
    grids = [tuple(row[1:]) for row in image_grid_thw.tolist()]

    def grid(p, h, w):  # (3, h*w): t = p, rows and columns offset from p
        rows, cols = torch.arange(h).repeat_interleave(w), torch.arange(w).repeat(h)
        return torch.stack([torch.full_like(rows, p), p + rows, p + cols])

    positions, p, done = [], 0, 0  # p: the next position; done: prompt tokens placed so far
    for start, end, (h, w) in zip(starts, ends, grids):  # the source images, in order
        positions += [torch.arange(p, p + start - done).expand(3, -1), grid(p + start - done, h, w)]
        p, done = p + start - done + max(h, w), end
    positions.append(torch.arange(p, p + len(ids) - done).expand(3, -1))  # the rest of the prompt
    p += len(ids) - done
    for h, w in reversed(grids[len(ends):]):  # the generated grids
        positions.append(grid(p, h, w))
        p += max(h, w)
    positions = torch.cat(positions, dim=1)[:, : len(ids) + num_tokens - 1]  # the last token is never an input
    return positions[:, None, :].to(image_grid_thw.device)  # (3, 1, P+N-1)


@torch.no_grad()
def sample_groups(pipe, prompts: list[str], group_size: int, height: int, width: int, temperature: float,
                  seeds: list[int], sources: list | None = None, top_k: int = 0, top_p: float = 1.0) -> list[Rollout]:
    """G samples for each of P prompts (editing: and a (3, H, W) source image each), with their log-probs, from ONE
    decode of all P*G rows: the prompts left-padded to one length, each row at its own rotary positions.

    Every sample is exactly N = h'w' + (H/32)(W/32) codebook tokens (editing: (H/32)(W/32); groups of different N,
    editing beside text-to-image, are decoded apart). Group p draws from its own generator seeded with seeds[p], so
    its tokens are those it gets when sampled alone, and those `generate` drew with grpo.py's logits processor.
    """
    model = pipe.vision_language_encoder.eval()  # no dropout: sampler and trainer draw from one distribution
    groups = [group_prompt(pipe, prompt, group_size, height, width, source)
              for prompt, source in zip(prompts, sources or [None] * len(prompts))]
    lengths = [a[0] * a[1] + b[0] * b[1] for _, _, a, b in groups]  # N of each group: preview + large grid
    rollouts = [None] * len(groups)
    for n in sorted(set(lengths)):
        mine = [i for i, length in enumerate(lengths) if length == n]
        prompt_ids = [groups[i][0]["input_ids"][0] for i in mine]  # (P_i,) each
        positions = [rope_positions(ids, groups[i][0]["image_grid_thw"][:int(groups[i][0]["images_per_sample"][0])],
                                    n + 1, model.config.image_start_token_id, model.config.image_end_token_id)
                     for ids, i in zip(prompt_ids, mine)]  # (3, 1, P_i + N) each: the last token is fed too
        width_p = max(len(ids) for ids in prompt_ids)  # left padding: every prompt ends in the last column

        def left_pad(x, dim=-1):  # pad the last dim on the left to width_p (+ N), then G rows a prompt along `dim`
            return torch.cat([F.pad(v, (width_p - len(ids), 0)) for v, ids in zip(x, prompt_ids)], dim
                             ).repeat_interleave(group_size, dim)

        tokens, logprobs, support = decode(
            model, left_pad([ids[None] for ids in prompt_ids], 0),  # (P*G, width_p), pad id 0
            left_pad([torch.ones_like(ids[None], dtype=torch.bool) for ids in prompt_ids], 0),  # False on the padding
            left_pad(positions, 1),  # (3, P*G, width_p + N)
            n, temperature, top_k, top_p, [torch.Generator(model.device).manual_seed(seeds[i]) for i in mine])
        for j, i in enumerate(mine):
            inputs, source, preview_hw, large_hw = groups[i]
            rows = slice(j * group_size, (j + 1) * group_size)
            rollouts[i] = Rollout(tokens[rows], logprobs[rows], inputs, preview_hw, large_hw, source,
                                  None if support is None else support[rows])
    return rollouts


def sample_group(pipe, prompt: str, group_size: int, height: int, width: int, temperature: float,
                 seed: int, source: torch.Tensor | None = None, top_k: int = 0, top_p: float = 1.0) -> Rollout:
    """G samples for one prompt: sample_groups with one group."""
    return sample_groups(pipe, [prompt], group_size, height, width, temperature, [seed],
                         None if source is None else [source], top_k, top_p)[0]


@torch.no_grad()
def decode(model, input_ids: torch.Tensor, valid: torch.Tensor, positions: torch.Tensor, n_tokens: int,
           temperature: float, top_k: int, top_p: float, generators: list, static: bool | None = None
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The AR's decode loop: prefill the prompts once, then one token a step with a KV cache.

    input_ids (B, P) prompts, left-padded; valid (B, P) bool, False on padding; positions (3, B, P + N) the rotary
    positions of every prompt and generated token (rope_positions); `generators`: one per group, the B rows split
    evenly between them. Returns the (B, N) sampled codes and their (B, N) float32 log-probs under code_logprobs,
    the one distribution, and with top-k / top-p the (B, N, K/8) bits of the codes each draw kept (support_bits;
    else None). No step's logits are kept. On a GPU the step is captured once as a CUDA graph and
    replayed (repeat_step), which needs fixed shapes: `static` (default: on a GPU) pre-allocates the cache for all
    P + N slots and masks all of them at every step; otherwise the cache grows and a step attends to the filled
    slots only (as generate's: 6% faster per step on a CPU).
    """
    from transformers import DynamicCache, StaticCache
    K, V = model.config.vq_config.num_embeddings, model.lm_head.out_features  # codebook ids, lm_head rows
    (B, P), N, device = input_ids.shape, n_tokens, input_ids.device
    L = P + N  # slots: the prompt, then every generated token (the last one is fed too: one step body)
    static = device.type == "cuda" if static is None else static
    cache = (StaticCache(config=model.config.text_config, max_cache_len=L) if static else
             DynamicCache(config=model.config.text_config))
    seen = F.pad(valid, (0, N), value=True)  # (B, L): slots that hold a token (padding never does)
    slot = torch.arange(L, device=device)

    def forward(ids, slots):  # (B, S) tokens at slots `slots` (S,) -> (B, V) logits after the last one
        kv = L if static else int(slots[-1]) + 1  # the slots attended to
        mask = ((seen[:, None, None, :] & (slot <= slots[:, None])) | (slot == slots[:, None]))[..., :kv]  # (B, 1, S,
        # kv): causal, without the padding; a pad slot attends to itself (a query that sees nothing makes NaN)
        return model(input_ids=ids, attention_mask=mask, position_ids=positions[:, :, slots], cache=cache,
                     logits_to_keep=1).logits[:, -1]  # the trainer's forward (token_logprobs), one token at a time

    tokens = torch.zeros(B, N, dtype=torch.long, device=device)
    logprobs = torch.zeros(B, N, device=device)
    truncated = 0 < top_k < K or top_p < 1
    support = torch.zeros(B, N, (K + 7) // 8, dtype=torch.uint8, device=device) if truncated else None
    t = torch.zeros(1, dtype=torch.long, device=device)  # the step, kept on the device: a CUDA graph replays it
    logits = forward(input_ids, slot[:P])  # prefill: (B, V) logits of the first token

    def step():  # draw token t from code_logprobs, then feed it: the logits of token t + 1
        logp = code_logprobs(logits, temperature, K, top_k, top_p)  # (B, K)
        noise = torch.cat([torch.empty(B // len(generators), V, device=device).exponential_(generator=g)
                           for g in generators])  # (B, V), each group's (G, V) as torch.multinomial draws it
        token = (logp.exp() / noise[:, :K]).argmax(dim=-1, keepdim=True)  # (B, 1): torch.multinomial(probs, 1)
        tokens.index_copy_(1, t, token)
        logprobs.index_copy_(1, t, logp.gather(-1, token))
        if truncated:  # the sampling mask, kept for the trainer
            support.index_copy_(1, t, support_bits(logp.isfinite())[:, None])
        logits.copy_(forward(token, P + t))
        t.add_(1)

    repeat_step(step, N, generators)
    return tokens, logprobs, support


def repeat_step(step, n: int, generators: list) -> None:
    """step() n times. On a GPU (one process) the first runs eagerly, warming up kernels and allocator, and the rest
    replay ONE CUDA graph of it: no Python and no kernel launches between steps, no host synchronisation (a decode
    step of the real AR is ~2,000 small kernels, which the CPU cannot launch as fast as the GPU runs them)."""
    step()
    if n == 1 or generators[0].device.type != "cuda" or distributed():  # FSDP's hooks are not captured
        for _ in range(n - 1):
            step()
        return
    graph = torch.cuda.CUDAGraph()
    for generator in generators:  # the draws of a replay advance each group's generator, as eager steps do
        graph.register_generator_state(generator)
    autocast = torch.autocast("cuda", torch.get_autocast_dtype("cuda"), torch.is_autocast_enabled("cuda"),
                              cache_enabled=False)  # as the caller's autocast, without its cast cache (not graph-safe)
    with torch.cuda.graph(graph), autocast:
        step()
    for _ in range(n - 1):
        graph.replay()


# ---- 5. Log-probs of given tokens ---------------------------------------------------------------

def token_logprobs(model, inputs: dict, tokens: torch.Tensor, temperature: float, top_k: int = 0,
                   top_p: float = 1.0, support: torch.Tensor | None = None) -> torch.Tensor:
    """(G, N) float32 log-probs of `tokens` given the prompt, from one teacher-forced forward (token_logits), under
    code_logprobs: over the sampler's kept codes when `support` (a Rollout's (G, N, K/8) bits) is given.

    Differentiable (call under torch.no_grad() for the reference)."""
    K = model.config.vq_config.num_embeddings
    support = None if support is None else code_support(support, K)
    logits = token_logits(model, inputs, tokens)  # (G, N, V)
    return code_logprobs(logits, temperature, K, top_k, top_p, support).gather(-1, tokens[..., None]).squeeze(-1)


def token_logits(model, inputs: dict, tokens: torch.Tensor) -> torch.Tensor:
    """(G, N, V) raw logits that predict each of `tokens` given the prompt: one teacher-forced forward.

    Passing explicit `position_ids` is what makes this agree with the sampler: without them the model puts the image
    tokens on the 1D text ramp and the log-probs are wrong (see the tests and the notebook). The rows share one prompt
    (a group, as sample_groups returns it): the positions are built from row 0, so other prompts in the same call are
    refused rather than scored at the wrong positions.
    """
    G, P = inputs["input_ids"].shape
    if not (inputs["input_ids"] == inputs["input_ids"][:1]).all():
        raise ValueError("token_logits scores one prompt per call (its positions come from row 0), but the rows of "
                         "input_ids differ: call it once per group")
    N = tokens.shape[1]
    input_ids = torch.cat([inputs["input_ids"], tokens[:, :-1]], dim=1)  # (G, P+N-1)
    attention_mask = torch.cat([inputs["attention_mask"], torch.ones_like(tokens[:, :-1])], dim=1)
    rows = int(inputs["images_per_sample"][0])  # grid rows of one sample (the G samples share one prompt)
    positions = rope_positions(inputs["input_ids"][0], inputs["image_grid_thw"][:rows], N,
                               model.config.image_start_token_id, model.config.image_end_token_id)
    return model(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions.expand(-1, G, -1),
                 use_cache=False, logits_to_keep=N).logits  # (G, N, V)


# ---- 6. Decoding tokens to images ---------------------------------------------------------------

def prior_ids(tokens: torch.Tensor, large_hw: tuple[int, int]) -> torch.Tensor:
    """(G, N) AR tokens -> (G, 4hw) the DiT's prior ids: the large grid (the last h*w tokens; the preview never
    reaches the DiT), upsampled 2x (nearest) to the DiT's H/16 x W/16 grid."""
    G, (h, w) = tokens.shape[0], large_hw
    large = tokens[:, -h * w:].reshape(G, 1, h, w)  # (G, 1, H/32, W/32)
    return F.interpolate(large.float(), scale_factor=2, mode="nearest").long().reshape(G, -1)  # (G, 4hw) at H/16


@torch.no_grad()
def decode_images(pipe, prompt: str, tokens: torch.Tensor, large_hw: tuple[int, int], height: int, width: int,
                  num_inference_steps: int, seed: int, guidance_scale: float = 1.5,
                  source: Source | None = None) -> torch.Tensor:
    """(G, N) tokens -> (G, 3, H, W) float32 images in [0, 1]: large grid -> prior ids -> DiT -> VAE.

    The whole group in one pipeline call, all samples from the same latent noise (seeded), so the
    images differ only through their tokens. The preview tokens never reach the DiT. Editing: the DiT also
    attends to the source (VAE latents and its codes, upsampled like the prior), as GLM-Image edits. Passing our
    tokens as prior_token_ids skips the pipeline's own AR step, the part of diffusers 0.42.1 that fails with
    transformers >= 5.23 for editing (it concatenates the list get_image_features now returns along channels).
    """
    G, device = tokens.shape[0], pipe.transformer.device
    prior = prior_ids(tokens, large_hw)  # (G, 4hw) at H/16
    embeds, negative = pipe.encode_prompt(prompt, do_classifier_free_guidance=guidance_scale > 1, device=device,
                                          dtype=pipe.transformer.dtype)
    generator = torch.Generator("cpu").manual_seed(seed)
    shape = (1, pipe.transformer.config.in_channels, height // pipe.vae_scale_factor, width // pipe.vae_scale_factor)
    latents = torch.randn(shape, generator=generator).to(device, pipe.transformer.dtype).repeat(G, 1, 1, 1)
    edit = {}
    if source is not None:  # one copy per sample: the pipeline's batch is the group
        hs, ws = source.grid_hw
        codes = F.interpolate(source.codes.view(1, 1, hs, ws).float(), scale_factor=2, mode="nearest")
        edit = dict(image=[[source.image]] * G, prior_token_image_ids=[codes.long().view(-1).to(device)] * G,
                    source_image_grid_thw=[torch.tensor([[1, 2 * hs, 2 * ws]], device=device)] * G)
    images = pipe(prompt_embeds=embeds.repeat(G, 1, 1),
                  negative_prompt_embeds=None if negative is None else negative.repeat(G, 1, 1),
                  prior_token_ids=prior, latents=latents, height=height, width=width,
                  num_inference_steps=num_inference_steps, guidance_scale=guidance_scale, output_type="pt",
                  **edit).images
    return images.float().clamp(0, 1)  # (G, 3, H, W)


# ---- 7. Rewards ---------------------------------------------------------------------------------
# A reward is any function fn(images, example) -> (G,) float tensor, higher is better: images (G, 3, H, W) float32 in
# [0, 1], example the dict of one prompts line (read_prompts) with "target" loaded as a (3, H, W) tensor (or None).
# `@needs(...)` names the example fields a reward cannot do without, so a missing one stops the run before it starts.
# The card's rewards (SSIM, -MSE against a target) are here; OCR, the shapes checker and plug-in loading in rewards.py.

@needs("target")
def mse_reward(images: torch.Tensor, example: dict) -> torch.Tensor:
    """(G, 3, H, W) in [0, 1], example["target"] (3, H, W) -> (G,) negative mean squared error, in [-1, 0]."""
    return -((images - example["target"]) ** 2).mean(dim=(1, 2, 3))


@needs("target")
def ssim_reward(images: torch.Tensor, example: dict) -> torch.Tensor:
    """(G, 3, H, W) in [0, 1], example["target"] (3, H, W) -> (G,) SSIM (Wang et al. 2004), in [-1, 1].

    11-tap Gaussian window (sigma 1.5), K1 = 0.01, K2 = 0.03, data range 1, computed over valid
    (unpadded) windows, averaged over channels and pixels.
    """
    C1, C2 = 0.01 ** 2, 0.03 ** 2
    g = torch.exp(-((torch.arange(11, dtype=torch.float32) - 5) ** 2) / (2 * 1.5 ** 2))
    g = (g / g.sum()).to(images.device)
    window = (g[:, None] * g[None, :]).expand(3, 1, 11, 11)  # (3, 1, 11, 11), one per channel

    def blur(x):  # (G, 3, H, W) -> (G, 3, H-10, W-10)
        return F.conv2d(x, window, groups=3)

    x, y = images.float(), example["target"].float().expand_as(images)
    mu_x, mu_y = blur(x), blur(y)
    var_x = blur(x * x) - mu_x ** 2
    var_y = blur(y * y) - mu_y ** 2
    cov = blur(x * y) - mu_x * mu_y
    ssim_map = ((2 * mu_x * mu_y + C1) * (2 * cov + C2)) / ((mu_x ** 2 + mu_y ** 2 + C1) * (var_x + var_y + C2))
    return ssim_map.mean(dim=(1, 2, 3))


REWARDS = {"ssim": ssim_reward, "mse": mse_reward, **MORE_REWARDS}  # MORE_REWARDS: ocr, shapes (rewards.py)


def parse_rewards(spec: str, flag: str = "--reward") -> dict[str, tuple]:
    """'ssim=1,ocr=0.5,mypkg.rewards:clip=1' -> {name: (fn, weight)} (a name alone weighs 1): built-in names (REWARDS) or import paths
    module:function (found like `python -m` finds modules: installed, or in the current directory). Every reward
    listed is computed and logged; weight 0 only keeps it out of the sum. Raises ValueError naming the problem."""
    rewards = {}
    for part in spec.split(","):
        name, _, value = (x.strip() for x in part.rpartition("=")) if "=" in part else (part.strip(), "", "")
        try:
            weight = float(value) if "=" in part else 1.0  # a name alone weighs 1
        except ValueError:
            raise ValueError(f"reward weight '{part}' is not name=number; write e.g. {flag} ssim=1,mse=0") from None
        if not weight >= 0:
            raise ValueError(f"reward weight '{part}' is negative; weights must be >= 0")
        rewards[name] = (import_reward(name) if ":" in name else REWARDS.get(name), weight)
        if rewards[name][0] is None:
            raise ValueError(f"unknown reward '{name}' in {flag} '{spec}'; use {', '.join(REWARDS)} or an import "
                             "path module:function")
    if sum(w for _, w in rewards.values()) <= 0:
        raise ValueError(f"{flag} '{spec}' gives every reward weight 0; give at least one a positive weight")
    return rewards


def group_rewards(images: list[torch.Tensor], examples: list[dict], rewards: dict[str, tuple]
                  ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """P groups of (G, 3, H, W) images and their P examples -> (P, G) weighted sum, and each reward's (P, G).

    Row p scores group p against example p only: a reward never meets another prompt's samples.
    """
    each = {name: torch.stack([fn(group, example).float().reshape(-1).to(group.device)  # a reward may answer on the CPU
                               for group, example in zip(images, examples, strict=True)])
            for name, (fn, _) in rewards.items()}
    total = sum(w * each[name] for name, (_, w) in rewards.items())
    return total, each


# ---- 8. Advantages ------------------------------------------------------------------------------

def group_advantages(rewards: torch.Tensor, eps: float = 1e-6, scale: str = "group",
                     batch: torch.Tensor | None = None) -> torch.Tensor:
    """(P, G) or (G,) rewards -> same-shape advantages: each reward minus its group's mean, divided by the group's
    std (scale "group", the paper), by the std of every reward of the step ("batch": `batch`, all processes'
    rewards, default `rewards`) or by nothing ("none": Dr. GRPO, no bias towards groups of small spread).

    Population stds. A group with no spread carries no signal and gets zeros rather than a division by ~0;
    "no spread" is relative to the rewards' size (std <= eps x the group's largest |reward|: float rounding,
    whatever the reward's scale), so the advantages are invariant to r -> r + b for every group whose spread is
    above rounding, and (scales group and batch) to r -> a r for a > 0.
    """
    mean = rewards.mean(dim=-1, keepdim=True)
    std = rewards.std(dim=-1, unbiased=False, keepdim=True)
    spread = std > eps * rewards.abs().amax(dim=-1, keepdim=True)
    if scale == "batch":
        std = (rewards if batch is None else batch).std(unbiased=False)
    elif scale == "none":
        std = torch.ones_like(std)
    return torch.where(spread, (rewards - mean) / std.clamp_min(torch.finfo(std.dtype).tiny), torch.zeros_like(rewards))


# ---- 9. Loss ------------------------------------------------------------------------------------

CORRECTIONS = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask", "none")  # TRL's modes, and off


def sampler_correction(old_logprobs: torch.Tensor, sampled_logprobs: torch.Tensor, mode: str = "none",
                       cap: float = 2.0) -> tuple[torch.Tensor, dict]:
    """Importance weights for the gap between the sampler and the trainer (TRL's vLLM importance-sampling
    correction): (S, T) log-probs of the sampled tokens under pi_old (the trainer's forward) and under the sampler
    -> the weights on the policy-gradient term, (S, T) per token or (S, 1) per sequence, and the mismatch metrics.

    r = pi_old / pi_sampler, per token (token_*) or its product over the sequence's tokens in the loss (sequence_*);
    *_truncate caps r at `cap` (truncated importance sampling), *_mask gives 0 where r > cap (the token or sequence
    leaves the gradient); "none": weights 1. In float32 sampler and trainer agree within 1e-5, so r = 1 within
    1e-5; in bf16 the KV-cached sampler and the full-sequence trainer round differently (README: "Exact in float32,
    corrected in bf16"). Metrics, TRL's names: sampling/sampling_logp_difference/{mean,max} (|log pi_old - log
    pi_sampler| per token), sampling/importance_sampling_ratio/{min,mean,max} (r at the mode's level, before the
    cap), and in the same namespace sampling/k3_kl (mean of r - 1 - log r per token: KL(pi_sampler || pi_old) on the
    sampler's draws, verl's rollout_corr/k3_kl) and sampling/capped_frac (tokens or sequences the cap acted on).
    """
    both = old_logprobs.isfinite() & sampled_logprobs.isfinite()  # a token outside a truncation carries no ratio
    log_ratio = torch.where(both, old_logprobs - sampled_logprobs, 0.0)  # (S, T)
    level = log_ratio.sum(dim=1, keepdim=True) if mode.startswith("sequence") else log_ratio  # (S, 1) or (S, T)
    ratio = torch.exp(level.clamp(max=20.0))  # a sequence's sum can be large: exp stays finite
    capped = ratio > cap
    weights = (ratio.clamp(max=cap) if mode.endswith("truncate") else ratio.masked_fill(capped, 0.0)
               if mode.endswith("mask") else torch.ones_like(ratio))
    token_ratio = torch.exp(log_ratio)
    metrics = {"sampling/sampling_logp_difference/mean": log_ratio.abs().mean().item(),
               "sampling/sampling_logp_difference/max": log_ratio.abs().max().item(),
               "sampling/importance_sampling_ratio/min": ratio.min().item(),
               "sampling/importance_sampling_ratio/mean": ratio.mean().item(),
               "sampling/importance_sampling_ratio/max": ratio.max().item(),
               "sampling/k3_kl": (token_ratio - 1 - log_ratio).mean().item(),
               "sampling/capped_frac": capped.float().mean().item() if mode != "none" else 0.0}
    return weights.detach(), metrics


def grpo_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, ref_logprobs: torch.Tensor | None,
              advantages: torch.Tensor, clip_eps: float | tuple[float, float], kl_beta: float,
              weights: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
    """PPO-clipped GRPO loss with a k3 KL penalty. (S, T) log-probs, (S,) advantages -> scalar loss.

    Per token: r = exp(logp - old), surrogate = min(r A, clip(r, 1-eps, 1+eps_high) A) (`clip_eps` is eps, or
    (eps, eps_high) for DAPO's clip-higher), KL = exp(ref - logp) - (ref - logp) - 1 (>= 0, unbiased for
    KL(pi || ref)),
    loss = -(surrogate - beta KL), averaged over the tokens of a sequence, then over sequences
    (the paper's 1/|o_i|). DAPO averages over all tokens of the batch and Dr. GRPO divides by a
    constant; here every sample has exactly N tokens, so all three differ only by a constant factor.
    `ref_logprobs` may be None when beta = 0. `weights`, (S, T) or (S, 1), multiply the surrogate (not the KL): the
    importance weights pi_old / pi_sampler of sampler_correction; None: 1.
    """
    # a token the old policy could not draw (-inf: outside its top-k / nucleus by rounding) carries no information:
    # ratio 1 without gradient, instead of exp(-inf + inf) = NaN
    ratio = torch.exp(torch.where(old_logprobs.isneginf(), 0.0, logprobs - old_logprobs))  # (S, T)
    adv = advantages[:, None].to(ratio)  # (S, 1), on the log-probs' device
    low, high = clip_eps if isinstance(clip_eps, tuple) else (clip_eps, clip_eps)  # (eps, eps_high): clip-higher
    unclipped, clipped = ratio * adv, ratio.clamp(1 - low, 1 + high) * adv
    surrogate = torch.min(unclipped, clipped) * (1.0 if weights is None else weights)
    if ref_logprobs is None:
        kl = torch.zeros_like(ratio)
    else:
        # the log-ratio is capped at +-20: exp stays finite (exp(20) ~ 5e8) when the policy finds a sampled token
        # far less likely than the reference does, and a token the reference's top-k / nucleus excludes (-inf)
        # counts 19, not inf; where the cap acts the token gets no KL gradient. Below it this is the exact k3.
        log_ref_ratio = (ref_logprobs - logprobs).clamp(-20.0, 20.0)
        kl = (torch.exp(log_ref_ratio) - log_ref_ratio - 1).clamp_min(0)  # >= 0; the clamp only removes rounding
        kl = torch.where(logprobs.isfinite(), kl, 0.0)  # a token outside the policy's truncation: no estimate
    loss = (-(surrogate - kl_beta * kl)).mean(dim=1).mean()
    with torch.no_grad():
        # the clip stops the gradient where r A is larger than the clipped value: r > 1+eps with A > 0,
        # r < 1-eps with A < 0
        clipped_out = ((ratio > 1 + high) & (adv > 0)) | ((ratio < 1 - low) & (adv < 0))
        metrics = {"policy_loss": -surrogate.mean(dim=1).mean().item(), "kl": kl.mean().item(),
                   "clip_frac": clipped_out.float().mean().item(), "ratio_min": ratio.min().item(),
                   "ratio_mean": ratio.mean().item(), "ratio_max": ratio.max().item()}
    return loss, metrics


# ---- 10. Update ---------------------------------------------------------------------------------

@torch.no_grad()
def reference_logprobs(ref_model, inputs: dict, tokens: torch.Tensor, temperature: float, top_k: int = 0,
                       top_p: float = 1.0, support: torch.Tensor | None = None) -> torch.Tensor:
    """(G, N) log-probs under the reference: a frozen copy, or a LoRA policy with its adapter switched off."""
    if hasattr(ref_model, "disable_adapter"):
        with ref_model.disable_adapter():
            return token_logprobs(ref_model, inputs, tokens, temperature, top_k, top_p, support)
    return token_logprobs(ref_model, inputs, tokens, temperature, top_k, top_p, support)


def select_rows(inputs: dict, rows: slice) -> dict:
    """The AR inputs of samples `rows` of a group (image_grid_thw holds images_per_sample grid rows per sample)."""
    per_sample = int(inputs["images_per_sample"][0])
    return {"input_ids": inputs["input_ids"][rows], "attention_mask": inputs["attention_mask"][rows],
            "image_grid_thw": inputs["image_grid_thw"].view(-1, per_sample, 3)[rows].reshape(-1, 3),
            "images_per_sample": inputs["images_per_sample"][rows]}


def region_metrics(regions: dict, logp: torch.Tensor, old: torch.Tensor, ref: torch.Tensor | None,
                   adv: torch.Tensor, clip_eps: float, kl_beta: float) -> dict:
    """Mean log-prob, KL and clip fraction of each region (preview / large grid) of (mb, N) log-probs, whichever
    tokens the loss covers; a region with no tokens (the preview when editing) is left out."""
    metrics = {}
    for name, cut in regions.items():
        if logp[:, cut].numel():
            _, m = grpo_loss(logp[:, cut], old[:, cut], None if ref is None else ref[:, cut], adv, clip_eps, kl_beta)
            finite = logp[:, cut][logp[:, cut].isfinite()]  # a token outside the truncation is -inf
            metrics.update({f"{name}/logprob": finite.mean().item(), f"{name}/kl": m["kl"],
                            f"{name}/clip_frac": m["clip_frac"]})
    return metrics


def micro_batch_loss(policy, inputs: dict, tokens: torch.Tensor, sampled: torch.Tensor, support: torch.Tensor | None,
                     adv: torch.Tensor, n_preview: int, old: torch.Tensor | None, ref: torch.Tensor | None, *,
                     temperature: float, clip_eps: float | tuple[float, float], kl_beta: float, train_tokens: str,
                     top_k: int, top_p: float, correction: str = "none", cap: float = 2.0) -> tuple[torch.Tensor, dict]:
    """One micro-batch: the trainer's (mb, N) log-probs of the sampled tokens (the forward, with gradient; over the
    sampler's kept codes `support`, if any) and the GRPO loss over the tokens in the loss, its policy-gradient term
    weighted by sampler_correction(pi_old, pi_sampler); `old` None means the old policy is the current one (mu = 1).
    Metrics: the loss's, the correction's, each region's (preview / large grid), `sampler_gap` (the largest
    |log pi_trainer - log pi_sampler|) and `outside_truncation` (sampled tokens the trainer's OWN top-k / nucleus
    would exclude: the replayed support keeps them)."""
    K = policy.config.vq_config.num_embeddings
    logits = token_logits(policy, inputs, tokens)  # (mb, N, V), with grad
    kept = None if support is None else code_support(support, K)  # (mb, N, K) bool: the sampler's truncation
    logp = code_logprobs(logits, temperature, K, top_k, top_p, kept).gather(-1, tokens[..., None]).squeeze(-1)
    old = logp.detach() if old is None else old
    regions = {"preview": slice(0, n_preview), "large": slice(n_preview, None)}
    cols = regions["large"] if train_tokens == "large" else slice(None)
    weights, m_corr = sampler_correction(old[:, cols], sampled[:, cols], correction, cap)
    loss, m = grpo_loss(logp[:, cols], old[:, cols], None if ref is None else ref[:, cols], adv, clip_eps, kl_beta,
                        weights)
    with torch.no_grad():
        own = code_logprobs(logits.detach(), temperature, K, top_k, top_p).gather(-1, tokens[..., None])
    both = logp.isfinite() & sampled.isfinite()
    m.update(loss=loss.item(), sampler_gap=(logp.detach() - sampled).where(both, 0.0).abs().max().item(),
             outside_truncation=int((~own.isfinite()).sum()), **m_corr,
             **region_metrics(regions, logp.detach(), old, ref, adv, clip_eps, kl_beta))
    return loss, m


def train_step(policy, optimizer, rollouts: list[Rollout], advantages: torch.Tensor, ref_model, *,
               temperature: float, clip_eps: float, kl_beta: float, micro_batch_size: int,
               max_grad_norm: float, mu: int = 1, train_tokens: str = "large", top_k: int = 0,
               top_p: float = 1.0, correction: str = "none", cap: float = 2.0) -> dict:
    """`mu` optimizer steps on P groups of rollouts with (P, G) advantages; returns metrics.

    Micro-batches of `micro_batch_size` sequences; each micro-batch loss is weighted by its share of
    the P*G sequences, so the accumulated gradient equals the full-batch gradient. Every log-prob (policy, old,
    reference) is over the codes each rollout's sampler kept (Rollout.support), and the policy-gradient term is
    weighted by sampler_correction(`correction`, `cap`) (grpo.py's default: token_truncate, 2.0).
    """
    # transformers only checkpoints in train mode; disable_dropout makes train and eval mode the same distribution
    policy.train(policy.is_activation_checkpointing)
    # micro-batches: (AR inputs, tokens, sampler log-probs, sampler supports, advantages, number of preview tokens)
    batches = [(select_rows(r.inputs, rows), r.tokens[rows], r.logprobs[rows],
                None if r.support is None else r.support[rows], adv[rows], r.preview_hw[0] * r.preview_hw[1])
               for r, adv in zip(rollouts, advantages)
               for rows in (slice(i, i + micro_batch_size) for i in range(0, len(adv), micro_batch_size))]
    n_seqs = advantages.numel()
    with torch.no_grad():
        # with mu = 1 the old policy IS the current one, so old = logp.detach() below (ratio exactly 1, the clip
        # idles); with mu > 1 the old log-probs are frozen before the first update and the clip starts to act
        olds = ([token_logprobs(policy, inp, tok, temperature, top_k, top_p, sup) for inp, tok, _, sup, *_ in batches]
                if mu > 1 else None)
        refs = ([reference_logprobs(ref_model, inp, tok, temperature, top_k, top_p, sup)
                 for inp, tok, _, sup, *_ in batches] if kl_beta > 0 else None)
    skipped, parts = 0, []  # parts: every micro-batch's metrics and share of the sequences, over all mu updates
    for _ in range(mu):
        optimizer.zero_grad(set_to_none=True)
        update_parts, finite = [], True
        for k, (inputs, tokens, sampled, support, adv, n_preview) in enumerate(batches):
            loss, m = micro_batch_loss(policy, inputs, tokens, sampled, support, adv, n_preview,
                                       None if olds is None else olds[k], None if refs is None else refs[k],
                                       temperature=temperature, clip_eps=clip_eps, kl_beta=kl_beta,
                                       train_tokens=train_tokens, top_k=top_k, top_p=top_p, correction=correction,
                                       cap=cap)
            share = tokens.shape[0] / n_seqs  # micro-batch losses are means; weight them to a full-batch mean
            finite = finite and bool(torch.isfinite(loss))
            sync_gradients(policy, k == len(batches) - 1)  # FSDP + LoRA: reduce across processes after the last
            (loss * share).backward()  # even when not finite: with FSDP every process must join every backward
            update_parts.append((m, share))
        totals, parts = merge_metrics(update_parts), parts + update_parts  # the means: this update's
        params = [p for group in optimizer.param_groups for p in group["params"]]
        totals["grad_norm"] = torch.nn.utils.clip_grad_norm_(params, max_grad_norm).item()
        if all_agree(finite) and math.isfinite(totals["grad_norm"]):  # every process steps, or none
            optimizer.step()
        else:  # a NaN / inf loss or gradient never reaches the weights: this update is skipped
            optimizer.zero_grad(set_to_none=True)
            skipped += 1
    # extremes over all mu updates; sampler_gap is max |log pi_trainer - log pi_sampler| (0 up to float error
    # before the first update: larger means sampler and trainer disagree on the distribution)
    return {**totals, **{k: v for k, v in merge_metrics(parts).items() if extreme(k)}, "skipped": skipped}


def merge_metrics(parts: list[tuple[dict, float]]) -> dict:
    """Micro-batches' metrics with their shares of the sequences -> one dict: extremes and counts by their rule
    (parallel.extreme: min, max, sum), the rest the mean over the sequences that have the metric (an editing group has
    no preview region)."""
    keys = dict.fromkeys(k for m, _ in parts for k in m)
    return {k: extreme(k)([m[k] for m, _ in parts if k in m]) if extreme(k) else
            sum(m[k] * s for m, s in parts if k in m) / sum(s for m, s in parts if k in m) for k in keys}


# ---- 11. Evaluation -----------------------------------------------------------------------------
# Rewards on prompts the run never trains on, with seeds fixed per prompt, so that two evaluations differ only by the
# weights: what tells learning apart from overfitting the training prompts or gaming the reward.

@torch.no_grad()
def evaluate(pipe, examples: list[dict], rewards: dict, n_samples: int, seed: int, cfg: Config, rank: int = 0,
             world: int = 1, keep_images: int = 0) -> tuple[list[torch.Tensor], torch.Tensor, dict]:
    """`n_samples` images of each example, sampled and decoded exactly as in training but with fixed seeds (example
    i: AR seed `seed + i`, decoder noise --decode-seed): the same weights give the same images, whatever the step,
    --seed or the number of processes. Scored by every reward of `rewards`.

    Process r takes examples r, r + world, ...; the scores are gathered back in example order. Returns the images of
    the first `keep_images` examples ((K, 3, H, W) each, rounded to 8 bits, on every process), the (P, K) weighted
    total and each reward's (P, K), P = len(examples).
    """
    mine = list(range(rank, len(examples), world))
    chunk = max(1, cfg.prompts_per_step * cfg.group_size // n_samples)  # prompts a decode: a training step's rows
    rollouts = [r for c in range(0, len(mine), chunk) for r in sample_groups(
        pipe, [examples[i]["prompt"] for i in mine[c:c + chunk]], n_samples, cfg.height, cfg.width, cfg.temperature,
        [seed + i for i in mine[c:c + chunk]], [examples[i].get("source") for i in mine[c:c + chunk]], cfg.top_k,
        cfg.top_p)]
    images = [decode_images(pipe, examples[i]["prompt"], r.tokens, r.large_hw, cfg.height, cfg.width,
                            cfg.num_inference_steps, cfg.decode_seed, cfg.guidance_scale, r.source)
              for i, r in zip(mine, rollouts)]
    total, each = (group_rewards(images, [examples[i] for i in mine], rewards) if mine else  # more processes than
                   (torch.zeros(0, n_samples), {name: torch.zeros(0, n_samples) for name in rewards}))  # examples
    order = torch.tensor(gather_list(mine)).argsort()  # rows arrive in rank order; back to example order
    total, each = gather_rows(total).cpu()[order], {name: gather_rows(v).cpu()[order] for name, v in each.items()}
    kept = gather_list([(i, (im * 255).round().to(torch.uint8).cpu()) for i, im in zip(mine, images) if i < keep_images])
    return [im.float() / 255 for _, im in sorted(kept, key=lambda pair: pair[0])], total, each


def eval_record(step: int, examples: list[dict], total: torch.Tensor, each: dict, seconds: float) -> dict:
    """The metrics line of an evaluation: each reward's mean over prompts and samples ("eval/reward" is the weighted
    total of --reward), and per category for the examples whose .jsonl line has a "category"."""
    scores = {"reward": total, **each}
    record = {"step": step, "eval": True, **{f"eval/{name}": v.mean().item() for name, v in scores.items()}}
    categories = [str(ex["category"]) if "category" in ex else None for ex in examples]
    for category in sorted(set(categories) - {None}):
        rows = [i for i, c in enumerate(categories) if c == category]
        record.update({f"eval/{name}/{category}": v[rows].mean().item() for name, v in scores.items()})
    return {**record, "sec_eval": seconds}


# ---- 12. Main -----------------------------------------------------------------------------------

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
    if cfg.sampler_correction not in CORRECTIONS or not cfg.sampler_cap >= 1:
        raise ValueError(f"--sampler-correction {cfg.sampler_correction} --sampler-cap {cfg.sampler_cap}: use one "
                         f"of {', '.join(CORRECTIONS)} with a cap >= 1 (below 1 it cuts even an exact sampler's weight)")
    if cfg.scale_rewards not in ("group", "batch", "none"):
        raise ValueError(f"--scale-rewards {cfg.scale_rewards}: use group, batch or none")
    for name, ok, rule in [("clip-eps", 0 < cfg.clip_eps < 1, "in (0, 1)"), ("kl-beta", cfg.kl_beta >= 0, ">= 0"),
                           ("clip-eps-high", cfg.clip_eps_high is None or cfg.clip_eps_high > 0, "> 0"),
                           ("lr", 0 < cfg.lr < 1, "in (0, 1)"), ("temperature", cfg.temperature > 0, "> 0"),
                           ("max-grad-norm", cfg.max_grad_norm > 0, "> 0"), ("lora-rank", cfg.lora_rank >= 0, ">= 0"),
                           ("top-p", 0 < cfg.top_p <= 1, "in (0, 1]"), ("top-k", cfg.top_k >= 0, ">= 0")]:
        if not ok:
            raise ValueError(f"--{name} {getattr(cfg, name.replace('-', '_'))} is out of range; it must be {rule}")
    for name in ("steps", "mu", "prompts_per_step", "num_inference_steps", "eval_samples"):
        if getattr(cfg, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
    if cfg.train not in ("ar", "dit"):
        raise ValueError(f"--train {cfg.train}: use ar (the AR) or dit (the DiT's denoising chain)")
    if cfg.train == "dit" and not (cfg.sde_noise > 0 and cfg.sde_window >= 0 and cfg.sde_steps >= 0):
        raise ValueError(f"--sde-noise {cfg.sde_noise} / --sde-window {cfg.sde_window} / --sde-steps "
                         f"{cfg.sde_steps}: the noise must be > 0 (the log-probs of a deterministic step do not "
                         "exist), the window and steps >= 0")
    if cfg.train == "dit" and cfg.mu != 1:
        raise ValueError(f"--mu {cfg.mu}: --train dit makes one update per batch of chains for now; drop --mu")
    if cfg.eval_every < 0:
        raise ValueError(f"--eval-every {cfg.eval_every} must be >= 0 (0: evaluate only at step 0 and at the end)")
    if cfg.eval_reward and not cfg.eval_prompts:
        raise ValueError("--eval-reward is measured on --eval-prompts; give an --eval-prompts file too")
    if cfg.dtype not in ("auto", "float32", "bfloat16") or cfg.device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"--dtype {cfg.dtype} / --device {cfg.device}: use auto|float32|bfloat16 / auto|cpu|cuda")
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device cuda, but torch {torch.__version__} sees no CUDA GPU here; use --device cpu (or "
                         "auto), or install a CUDA build of torch on a machine with a GPU")


def fail(message: str, code: int = 2) -> None:
    """One line on stderr (from the first process only, under torchrun), no traceback, exit `code` (2: bad input).
    The other processes wait a moment before they exit, so that torchrun does not stop the first one before it has
    said why (seen once: no line at all)."""
    if int(os.environ.get("RANK", 0)) == 0:
        print(f"grpo.py: error: {message}", file=sys.stderr)
    else:
        time.sleep(3)
    raise SystemExit(code)


def load_examples(examples: list[dict], rewards: dict, height: int, width: int) -> list[dict]:
    """Check that every reward has what it needs in every example, then read the images: "target" and "source"
    become (3, H, W) float32 tensors in [0, 1] (resized with a one-line note if their size differs)."""
    loaded = []
    for example in examples:
        for name, (fn, _) in rewards.items():
            for field in getattr(fn, "needs", ()):
                if example.get(field) is None:
                    raise ValueError(f"{example['where']}: reward '{name}' needs a {field} and this example has none; "
                                     f"add one, or leave '{name}' out of --reward")
            problem = (getattr(fn, "check", None) or (lambda _: None))(example)
            if problem:
                raise ValueError(f"{example['where']}: reward '{name}': {problem}")
        for role in ("target", "source"):
            if example[role] is not None:
                with contextlib.suppress(OSError), Image.open(example[role]) as image:  # the header only
                    if image.size != (width, height):
                        print(f"note: {role} {example[role]} is {image.size[0]}x{image.size[1]}, resized to "
                              f"{width}x{height}", file=sys.stderr)
        try:
            images = {role: load_image(example[role], height, width, role)
                      for role in ("target", "source") if example[role] is not None}
        except ValueError as error:
            raise ValueError(f"{example['where']}: {error}") from None  # name the prompts line
        loaded.append({**example, **images})
    return loaded


def check_rewards(rewards: dict, example: dict, height: int, width: int) -> None:
    """Call every reward once on two gray images, so a missing package or a wrong return shape stops the run now."""
    for name, (fn, _) in rewards.items():
        try:
            value = fn(torch.full((2, 3, height, width), 0.5), example)
        except ImportError as error:  # an optional package (e.g. EasyOCR for ocr): the message says what to install
            raise ValueError(f"reward '{name}': {error}") from None
        except Exception as error:
            raise ValueError(f"reward '{name}' failed on two gray test images: {type(error).__name__}: "
                             f"{str(error).strip().splitlines()[0] if str(error).strip() else ''}") from None
        if not (torch.is_tensor(value) and value.shape == (2,)):
            raise ValueError(f"reward '{name}' must return a (G,) tensor, one value per image; for 2 images it "
                             f"returned {tuple(value.shape) if torch.is_tensor(value) else type(value).__name__}")


def load_evals(cfg: Config, rewards: dict) -> tuple[list[dict], dict] | None:
    """The --eval-prompts examples and what is measured on them: the rewards of --reward (weighted as in training) and
    those of --eval-reward (weight 0: measured, never optimised). None without --eval-prompts. Raises ValueError."""
    if not cfg.eval_prompts:
        return None
    measured = parse_rewards(cfg.eval_reward, "--eval-reward") if cfg.eval_reward else {}
    eval_rewards = {**rewards, **{name: (fn, 0.0) for name, (fn, _) in measured.items() if name not in rewards}}
    examples = load_examples(read_prompts(cfg.eval_prompts, "--eval-prompts"), eval_rewards, cfg.height, cfg.width)
    check_rewards(measured, examples[0], cfg.height, cfg.width)
    return examples, eval_rewards


def prepare(argv: list[str] | None) -> tuple[Config, list[dict], dict, tuple | None, Path, int]:
    """Parse and check everything before anything is written: config, prompts, images, rewards, --out or --resume.
    Returns the config, the examples with their images, the rewards, the eval set (load_evals), the run directory
    and the first step."""
    cfg = parse_config(argv)
    out, start = Path(cfg.resume or cfg.out), 0
    try:
        if cfg.resume:
            saved, start, saved_world = read_resume(out)  # config.json; step and processes from checkpoint.pt
            given = given_flags(argv)
            refused = sorted(given - {"resume", "steps", "device", "report_to"})  # a run goes on as it was, but these
            if refused:
                raise ValueError(f"--resume continues {out} with its saved settings, so it cannot take "
                                 f"{', '.join('--' + f.replace('_', '-') for f in refused)}: drop them (or start a new "
                                 "run with another --out)")
            keep = {f: getattr(cfg, f) for f in ("steps", "device", "report_to") if f in given}
            try:
                cfg = dataclasses.replace(Config(**saved), **keep, resume=cfg.resume, out=str(out))
            except TypeError:
                raise ValueError(f"{out / 'config.json'} is not a grpo.py config (its fields differ); restore it from "
                                 "the checkpoint's copy (torch.load(checkpoint.pt)['config'])") from None
            total, world = cfg.prompts_per_step * saved_world, int(os.environ.get("WORLD_SIZE", 1))
            if total % world:  # the same groups per step on another number of processes, or refuse
                raise ValueError(f"{out} trains {total} groups per step; {world} processes cannot share them evenly: "
                                 f"resume on a number of processes that divides {total}")
            cfg = dataclasses.replace(cfg, prompts_per_step=total // world)
            read_metrics(out)
            if cfg.steps < start:
                raise ValueError(f"--steps {cfg.steps} is below the {start} steps {out} has done; --steps is the "
                                 f"total, so pass more than {start}")
        validate(cfg)
        check_reporter(cfg.report_to)
        check_out_dir(out)
        rewards = parse_rewards(cfg.reward)
        examples = load_examples(read_prompts(cfg.prompts), rewards, cfg.height, cfg.width)
        check_rewards(rewards, examples[0], cfg.height, cfg.width)
        if cfg.train == "dit" and any(e["source"] is not None for e in examples):
            raise ValueError(f"--train dit is text-to-image only for now, and {cfg.prompts} has source images; train "
                             "the AR on edits (--train ar)")
        evals = load_evals(cfg, rewards)
        if not cfg.resume and not cfg.overwrite and any((out / name).exists() for name in RUN_FILES):
            raise ValueError(f"--out {out} holds another run; pass --resume {out} to continue it, --overwrite to "
                             "replace it, or another --out")
    except ValueError as error:
        fail(str(error))
    if cfg.resume and cfg.steps == start:
        print(f"{out} has done all {start} steps of --steps {cfg.steps}: nothing to do (pass a larger --steps to "
              "train on)")
        raise SystemExit(0)
    return cfg, examples, rewards, evals, out, start


def setup_training(pipe, cfg: Config, dtype: torch.dtype, world: int):
    """The policy (the AR, maybe with LoRA, sharded over `world` processes; with --train dit the DiT), the KL
    reference and the optimizer."""
    policy = pipe.vision_language_encoder if cfg.train == "ar" else pipe.transformer.requires_grad_(True)
    if cfg.train == "dit":
        pipe.vision_language_encoder.requires_grad_(False)
    if cfg.lora_rank:  # adapters in float32 (peft's default), base weights frozen
        policy = (apply_lora if cfg.train == "ar" else dit_grpo().apply_lora)(policy, cfg.lora_rank, cfg.seed)
    elif dtype != torch.float32:
        policy.float()  # trainable weights stay float32: AdamW updates to bf16 weights round away (RMSNorm freezes)
    if cfg.gradient_checkpointing:  # the DiT (diffusers) names it differently from the AR (transformers)
        if cfg.train == "dit":
            policy.enable_gradient_checkpointing()
        else:
            policy.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    if cfg.offload:
        for module in (pipe.text_encoder, pipe.transformer, pipe.vae):
            module.to("cpu")
    ref_model = reference_model(policy, cfg.kl_beta)  # taken before a checkpoint is loaded: the initial weights
    if ref_model is not None and ref_model is not policy:
        ref_model.to(dtype)  # frozen: bf16 storage is enough (the trainable policy itself stays float32)
    if world > 1:  # FSDP2: each process keeps 1/world of the weights, gradients and AdamW state
        for model in {id(m): m for m in (policy, ref_model) if m is not None}.values():
            shard(model, dtype)
    optimizer = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=cfg.lr,
                                  weight_decay=cfg.weight_decay)
    return policy, ref_model, optimizer


def main(argv: list[str] | None = None) -> dict:
    cfg, examples, rewards, evals, out, start = prepare(argv)  # every input checked, nothing written yet
    quiet_libraries()  # after the checks: --help and bad input never wait for diffusers to import
    rank, world, device = start_processes(cfg.device)  # torchrun: one process per GPU; else rank 0 of 1
    dtype = compute_settings(device, cfg.dtype, cfg.model)  # the real model in bf16 on GPUs; one thread on the CPU
    with timed({}, "load", cfg):
        pipe = load_or_fail(cfg.model, device, dtype)
    with timed({}, "setup", cfg):
        policy, ref_model, optimizer = setup_training(pipe, cfg, dtype, world)
        if cfg.resume:
            load_trainable_state(policy, optimizer, read_checkpoint(out / "checkpoint.pt"))
    evaluated = {h["step"] for h in read_metrics(out) if h.get("eval")} if cfg.resume else set()  # kept on resume
    history = open_run_dir(out, cfg, start) if rank == 0 else []  # the training metrics before `start`, else []
    examples, evals = on_device(examples, device), evals and (on_device(evals[0], device), evals[1])
    autocast = torch.autocast(device.split(":")[0], dtype=torch.bfloat16, enabled=dtype == torch.bfloat16)
    shown = examples[:cfg.before_after]  # sampled with fixed seeds now and after training: what changed, by eye
    if shown and start == 0:
        show(out / "images" / "before.png", pipe, policy, shown, rewards, cfg, autocast, device, rank, world,
             "before training")
    skipped, done = sum(h["skipped"] for h in history), start  # done: steps whose update is applied and logged
    reporter = Reporter(cfg.report_to if rank == 0 else "none", out, dataclasses.asdict(cfg))  # TensorBoard / W&B
    progress = tqdm(range(start, cfg.steps), desc="grpo", initial=start, total=cfg.steps, disable=rank != 0)
    try:
        with interrupts_caught():  # Ctrl-C and SIGTERM: see parallel.on_interrupt
            if evals and eval_due(start, cfg) and start not in evaluated:  # held-out prompts, before any update
                run_evaluation(out, start, pipe, policy, evals, cfg, autocast, device, rank, world, reporter)
            for step in progress:
                # groups are numbered over all processes; the number picks the prompt and seeds the sampling
                groups = [(step * world + rank) * cfg.prompts_per_step + j for j in range(cfg.prompts_per_step)]
                batch, seconds = [examples[g % len(examples)] for g in groups], {}
                rollouts, images, reward, each, advantages = (  # 1.-4. sample, decode, score
                    sample_and_score if cfg.train == "ar" else dit_grpo().sample_and_score)(
                    pipe, policy, batch, groups, rewards, cfg, autocast, device, seconds)
                with interrupts_held():  # an update and its log line land together (or not at all)
                    with timed(seconds, "train", cfg), autocast:  # 5. the clipped policy-gradient update
                        metrics = update(policy, optimizer, rollouts, advantages, ref_model, cfg)
                    record = step_record(step, groups, len(examples), reward, each, advantages, rollouts, metrics,
                                         seconds)
                    skipped, done = skipped + record["skipped"], step + 1
                    history.append(record)
                    if rank == 0:
                        log_step(out, progress, record, skipped, history, cfg.kl_beta, reporter)
                save_step_outputs(out, step, cfg, batch, images, reward, policy, optimizer, rank, world, reporter)
                if evals and eval_due(step + 1, cfg):  # the policy after step + 1 updates
                    run_evaluation(out, step + 1, pipe, policy, evals, cfg, autocast, device, rank, world, reporter)
                if stop_requested():  # with many processes, an interrupt in any of them stops all after this step
                    raise KeyboardInterrupt
    except KeyboardInterrupt:
        interrupted(out, policy, optimizer, done, cfg, rank, world, progress)
    except OSError as error:  # a full disk, a vanished directory: the last checkpoint stays good
        fail(f"cannot write {error.filename or out} ({error.strerror or error}); make room, then continue with "
             f"--resume {out}", code=1)
    finally:
        reporter.close()
    finish(out, policy, optimizer, cfg, rank, world)  # the last checkpoint, final/ and curves.png
    after = show(out / "images" / "after.png", pipe, policy, shown, rewards, cfg, autocast, device, rank, world,
                 f"after {cfg.steps} steps") if shown else None
    summary = summarize(out, history, len(examples), skipped, rank, after)
    stop_processes()  # torchrun: leave the process group cleanly
    return summary


def on_device(examples: list[dict], device: str) -> list[dict]:
    """The examples with their images (targets, sources) on `device`, where the rewards meet the samples."""
    return [{k: v.to(device) if torch.is_tensor(v) else v for k, v in e.items()} for e in examples]


def compute_settings(device: str, dtype: str, model: str = "tiny") -> torch.dtype:
    """The dtype for --dtype on `device` (auto: float32 for the tiny model everywhere, which draws worse in bf16 (0.836
    before training instead of 0.906 on an H100); for the real model bf16 on a GPU, float32 on the CPU). On the CPU
    one thread unless
    OMP_NUM_THREADS says otherwise: on 2 cores the tiny demo ran 1.2x faster with 2 threads but used 1.5x the CPU,
    and more threads than free cores stalled a busy machine 10-60x."""
    if device == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)
    return {"auto": torch.bfloat16 if device.startswith("cuda") and model != "tiny" else torch.float32,
            "float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]


def update(policy, optimizer, rollouts: list, advantages: torch.Tensor, ref_model, cfg: Config) -> dict:
    """Step 5 with the config's settings: train_step on the AR, or with --train dit dit_grpo.train_step on the DiT."""
    clip_eps = (cfg.clip_eps, cfg.clip_eps_high or cfg.clip_eps)
    if cfg.train == "dit":
        steps = dit_grpo().window(len(rollouts[0].timesteps), cfg.sde_window)  # the chains' own length
        return dit_grpo().train_step(policy, optimizer, rollouts, advantages, ref_model, noise_level=cfg.sde_noise,
                                     steps=steps, clip_eps=clip_eps, kl_beta=cfg.kl_beta,
                                     micro_batch_size=cfg.micro_batch_size, max_grad_norm=cfg.max_grad_norm)
    return train_step(policy, optimizer, rollouts, advantages, ref_model, temperature=cfg.temperature,
                      kl_beta=cfg.kl_beta, clip_eps=clip_eps, micro_batch_size=cfg.micro_batch_size,
                      max_grad_norm=cfg.max_grad_norm, mu=cfg.mu, train_tokens=cfg.train_tokens, top_k=cfg.top_k,
                      top_p=cfg.top_p, correction=cfg.sampler_correction, cap=cfg.sampler_cap)


def dit_grpo():
    """dit_grpo.py (--train dit), imported when first needed: it imports diffusers, which --help need not wait for."""
    import dit_grpo as module
    return module


def load_or_fail(model: str, device: str, dtype: torch.dtype):
    """load_glm_image, or one line naming why not (offline hub, wrong path, ...) and exit 2, no traceback."""
    try:
        return load_glm_image(model, device, dtype)
    except torch.OutOfMemoryError:
        raise  # timed's one line
    except Exception as error:
        cause = (str(error).strip().splitlines() or [""])[0][:200]
        hint = "tools/train_tiny.py rebuilds it" if model == "tiny" else "offline? use --model tiny or a local path"
        fail(f"cannot load --model {model} ({type(error).__name__}: {cause}); {hint}")


def sample_and_score(pipe, policy, batch: list[dict], groups: list[int], rewards: dict, cfg: Config, autocast,
                     device: str, seconds: dict) -> tuple:
    """Steps 1-4 of a GRPO step for this process's P groups: sample G token grids per prompt (seeded by the group's
    number), decode them with the frozen DiT, score them, and z-score the rewards within each group. Returns the
    rollouts, the images, the (P, G) rewards (and each reward's), and the (P, G) advantages."""
    with timed(seconds, "sample", cfg), autocast, unsharded(policy):  # 1. G token grids per prompt
        rollouts = sample_groups(pipe, [ex["prompt"] for ex in batch], cfg.group_size, cfg.height, cfg.width,
                                 cfg.temperature, [cfg.seed * 1_000_003 + g for g in groups],
                                 [ex.get("source") for ex in batch], cfg.top_k, cfg.top_p)  # all groups, one decode
    with timed(seconds, "decode", cfg), decoder_on(pipe, device, cfg.offload):  # 2. images, frozen DiT
        images = [decode_images(pipe, ex["prompt"], r.tokens, r.large_hw, cfg.height, cfg.width,
                                cfg.num_inference_steps, cfg.decode_seed, cfg.guidance_scale, r.source)
                  for ex, r in zip(batch, rollouts)]
    with timed(seconds, "reward", cfg):
        reward, each, advantages = score(images, batch, rewards, cfg)  # 3.-4.
    return rollouts, images, reward, each, advantages


def score(images: list[torch.Tensor], batch: list[dict], rewards: dict, cfg: Config) -> tuple:
    """Steps 3-4 for P groups of images (the AR's or, with --train dit, the DiT's): (P, G) rewards and each reward's,
    and the (P, G) advantages, z-scored within each group (--scale-rewards batch: by the std of every process's)."""
    reward, each = group_rewards(images, batch, rewards)  # 3. score them: (P, G)
    advantages = group_advantages(reward, scale=cfg.scale_rewards,  # 4. z-score within each group
                                  batch=gather_rows(reward) if cfg.scale_rewards == "batch" else None)
    return reward, each, advantages


def quiet_libraries() -> None:
    """Keep the terminal for our progress bar and one-line errors."""
    import diffusers
    import transformers
    diffusers.logging.set_verbosity_error()
    diffusers.utils.logging.disable_progress_bar()  # from_pretrained's "Loading pipeline components" bar
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()  # save_pretrained's "Writing model shards" bar


PHASES = {"load": "loading the model onto the device", "setup": "setting up training (LoRA, the KL reference, "
          "the optimizer, a checkpoint)", "sample": "sampling (the decode loop)", "decode": "decoding (DiT + VAE)",
          "reward": "scoring the images", "train": "the update (train_step)", "show": "sampling the before / after "
          "grids", "eval": "evaluating --eval-prompts"}


def memory_levers(phase: str, cfg: Config) -> list[str]:
    """The settings that would lower the memory of `phase`, among those this run does not use already."""
    full, trains = cfg.lora_rank == 0, phase in ("setup", "train")
    levers = [("--lora-rank 16", full and trains),
              ("--kl-beta 0 (no reference copy)", full and cfg.kl_beta > 0 and phase == "setup"),
              ("--micro-batch-size 1", cfg.micro_batch_size > 1 and phase == "train"),
              ("--gradient-checkpointing", not cfg.gradient_checkpointing and phase == "train"),
              ("--offload", not cfg.offload and phase in ("setup", "sample", "train")),
              ("a smaller --group-size", cfg.group_size > 2 and phase in ("sample", "decode", "train", "show")),
              ("fewer --prompts-per-step", cfg.prompts_per_step > 1 and phase == "sample"),
              ("fewer --eval-samples", cfg.eval_samples > 1 and phase == "eval"),
              ("a smaller --height / --width", phase in ("decode", "show", "eval")),
              ("more GPUs (torchrun shards the trained model)", trains),
              ("a GPU with more memory", True)]
    return [lever for lever, applies in levers if applies]


@contextlib.contextmanager
def timed(seconds: dict, phase: str, cfg: Config):
    """seconds[phase] = the wall-clock time the block took. Running out of (GPU) memory in it stops the run like bad
    input: one line naming the phase and the levers this run does not use yet, exit 2; the step is not saved, so the
    last checkpoint stays."""
    start = time.perf_counter()
    try:
        yield
    except torch.OutOfMemoryError:
        rank = int(os.environ.get("RANK", 0))
        tqdm.write(f"grpo.py: error: out of memory while {PHASES.get(phase, phase)}{f' (process {rank})' if rank else ''}; "
                   f"the last checkpoint is kept. To fit: {', '.join(memory_levers(phase, cfg))}", file=sys.stderr)
        raise SystemExit(2) from None
    seconds[phase] = time.perf_counter() - start


def step_record(step: int, groups: list[int], n_examples: int, reward: torch.Tensor, each: dict,
                advantages: torch.Tensor, rollouts: list[Rollout], metrics: dict, seconds: dict) -> dict:
    """The metrics line of one step: reward statistics over the groups of every process, the update's metrics,
    and the seconds of each phase (this process)."""
    reward, advantages, groups = gather_rows(reward), gather_rows(advantages), gather_list(groups)
    samples = [r.tokens if hasattr(r, "tokens") else r.latents[:, -1].flatten(1) for r in rollouts]  # dit: latents
    distinct = gather_rows(torch.tensor([[len({tuple(t) for t in s.tolist()})] for s in samples]))
    return {"step": step, "prompts": [g % n_examples for g in groups], "reward_mean": reward.mean().item(),
            "reward_std": reward.std(dim=-1, unbiased=False).mean().item(),  # within groups
            **{f"reward/{name}": gather_rows(value).mean().item() for name, value in each.items()},
            "zero_std_groups": int((advantages == 0).all(dim=-1).sum()),  # groups that carry no signal
            "distinct_samples": distinct.float().mean().item(), **reduce_metrics(metrics),
            **{f"sec_{phase}": value for phase, value in seconds.items()}}


def log_step(out: Path, progress, record: dict, skipped: int, history: list[dict], kl_beta: float,
             reporter: Reporter) -> None:
    """The step's line in metrics.jsonl (and --report-to), the progress bar, and a warning for a skipped update (rank
    0). The bar shows the step's reward, its mean over the last 20 steps (steps differ by prompt) and, when there is a
    KL term, the KL."""
    append_metrics(out, {**record, "skipped_total": skipped})
    reporter.log(record)
    recent = np.mean([h["reward_mean"] for h in history[-20:]])
    progress.set_postfix(reward=f"{record['reward_mean']:.3f}", reward_avg20=f"{recent:.3f}",
                         **({"kl": f"{record['kl']:.4f}"} if kl_beta > 0 else {}))
    if record["skipped"]:
        progress.write(f"warning: step {record['step']}: non-finite loss or gradient, update skipped "
                       f"({skipped} so far)", file=sys.stderr)


def save_step_outputs(out: Path, step: int, cfg: Config, batch: list[dict], images: list[torch.Tensor],
                      reward: torch.Tensor, policy, optimizer, rank: int, world: int, reporter: Reporter) -> None:
    """Every --image-every steps an image grid (rank 0; and to --report-to), every --save-every steps a checkpoint (all
    processes)."""
    if rank == 0 and cfg.image_every and (step % cfg.image_every == 0 or step + 1 == cfg.steps):
        path = out / "images" / f"step_{step:05d}.png"
        save_grid(path, batch, images, reward, [f"step {step}: {ex['prompt']}" for ex in batch])
        reporter.image("samples", path, step)
    if cfg.save_every and (step + 1) % cfg.save_every == 0:
        save_run(out, policy, optimizer, step + 1, cfg, rank, world)


def interrupted(out: Path, policy, optimizer, done: int, cfg: Config, rank: int, world: int, progress) -> None:
    """After Ctrl-C: a checkpoint of the `done` finished steps (unless the user forced an immediate stop), exit 130."""
    progress.close()
    if not INTERRUPT["forced"]:
        save_run(out, policy, optimizer, done, cfg, rank, world)  # the steps from `done` on did not finish: redone
    if rank == 0:
        saved = "the last checkpoint is kept" if INTERRUPT["forced"] else f"checkpoint at step {done}"
        launch = f"torchrun --nproc-per-node {world} grpo.py" if world > 1 else "python grpo.py"
        print(f"interrupted: {saved} in {out}; continue it with: {launch} --resume {out}", file=sys.stderr)
    raise SystemExit(130)


def save_grid(path: Path, batch: list[dict], images: list[torch.Tensor], reward: torch.Tensor,
              titles: list[str]) -> None:
    """An image grid of groups (source and target, then the samples) under their titles; a failed write only warns."""
    rows = [[(role, ex.get(role)) for role in ("source", "target") if any(e.get(role) is not None for e in batch)]
            + [("", im) for im in group] for ex, group in zip(batch, images)]
    try:
        save_image(image_grid(rows, reward, titles), path)
    except OSError as error:
        tqdm.write(f"warning: could not write {path} ({error.strerror or error}); training goes on", file=sys.stderr)


SHOW_SEED = 20_260_000  # the sampling seeds of the before / after grids: fixed, whatever --seed
EVAL_SEED = 30_260_000  # the sampling seeds of --eval-prompts: prompt i gets EVAL_SEED + i at every evaluation
EVAL_GRID = 4  # the eval prompts shown in each evaluation's image grid (the first ones of the file)


def show(path: Path, pipe, policy, examples: list[dict], rewards: dict, cfg: Config, autocast, device: str, rank: int,
         world: int, when: str) -> float:
    """G samples of each example with fixed seeds (`evaluate`), into an image grid at `path` (rank 0); after training
    also images/before_after.png beside the grid from before. Returns the mean reward."""
    with timed({}, "show", cfg), autocast, unsharded(policy), decoder_on(pipe, device, cfg.offload):
        images, reward, _ = evaluate(pipe, examples, rewards, cfg.group_size, SHOW_SEED, cfg, rank, world,
                                     keep_images=len(examples))
    if rank == 0:
        save_grid(path, examples, images, reward, [f"{ex['prompt']} ({when})" for ex in examples])
        with contextlib.suppress(OSError):  # the mean reward, for the summary line of a resumed run
            atomic_write(path.with_suffix(".json"), lambda f: f.write(json.dumps({"reward": reward.mean().item()}).encode()))
        if path.name == "after.png" and (path.parent / "before.png").exists():
            with contextlib.suppress(OSError):
                save_image(side_by_side(path.parent / "before.png", path), path.parent / "before_after.png")
    return reward.mean().item()


def eval_due(step: int, cfg: Config) -> bool:
    """Whether the policy after `step` updates is evaluated: before the first update, every --eval-every, the last."""
    return step == 0 or step == cfg.steps or (cfg.eval_every > 0 and step % cfg.eval_every == 0)


def run_evaluation(out: Path, step: int, pipe, policy, evals: tuple, cfg: Config, autocast, device: str, rank: int,
                   world: int, reporter: Reporter) -> None:
    """Evaluate the policy after `step` updates on the eval set: a line in metrics.jsonl ("eval": true), an image grid
    of the first EVAL_GRID prompts (images/eval_<step>.png: the same prompts and seeds every time, so one prompt can be
    followed through training) and a line on the terminal (rank 0). Every process takes part."""
    examples, rewards = evals
    seconds = {}
    with timed(seconds, "eval", cfg), autocast, unsharded(policy), decoder_on(pipe, device, cfg.offload):
        images, total, each = evaluate(pipe, examples, rewards, cfg.eval_samples, EVAL_SEED, cfg, rank, world,
                                       keep_images=EVAL_GRID)
    record = eval_record(step, examples, total, each, seconds["eval"])
    if rank == 0:
        append_metrics(out, record)
        reporter.log(record)
        save_grid(out / "images" / f"eval_{step:05d}.png", examples[:EVAL_GRID], images, total[:EVAL_GRID],
                  [f"eval, step {step}: {ex['prompt']}" for ex in examples[:EVAL_GRID]])
        reporter.image("eval", out / "images" / f"eval_{step:05d}.png", step)
        means = ", ".join(f"{key[5:]} {value:.4f}" for key, value in record.items() if key.count("/") == 1)
        tqdm.write(f"eval at step {step} ({len(examples)} prompts x {cfg.eval_samples}): {means} "
                   f"({seconds['eval']:.1f} s)")


def save_run(out: Path, policy, optimizer, step: int, cfg: Config, rank: int, world: int) -> None:
    """checkpoint.pt: the full trainable state gathered from every process, written by rank 0 (atomically)."""
    weights, optimizer_state = trainable_state(policy, optimizer)
    if rank == 0:
        save_checkpoint(out / "checkpoint.pt", weights, optimizer_state, step, cfg, world)


def finish(out: Path, policy, optimizer, cfg: Config, rank: int, world: int) -> None:
    """The last checkpoint, final/ (the AR, or with LoRA only the adapter, loadable with from_pretrained) and
    curves.png."""
    try:
        save_run(out, policy, optimizer, cfg.steps, cfg, rank, world)
        weights = final_weights(policy)  # every process takes part; only rank 0 gets the tensors
        if rank == 0:
            save_pretrained_atomic(policy, out / "final", state_dict=weights)
    except OSError as error:
        fail(f"cannot write {error.filename or out} ({error.strerror or error}); make room, then run --resume {out} "
             f"--steps {cfg.steps} again", code=1)
    try:
        if rank == 0:
            plot_curves(out)  # rewards (training and eval), KL, clip fraction, groups with no signal
    except Exception as error:  # everything is saved; a picture that fails is only a warning
        tqdm.write(f"warning: could not draw {out / 'curves.png'} ({type(error).__name__}: {error}); "
                   f"python tools/plot_run.py {out} draws it later", file=sys.stderr)


def summarize(out: Path, history: list[dict], n_examples: int, skipped: int, rank: int, after: float | None) -> dict:
    """The summary line: the mean training reward of the first and of the last quarter of the steps (whole cycles over
    the prompts where a cycle fits in a quarter, so both sides saw the same prompts) and, with --before-after, the
    mean reward of the same prompts and seeds before and after training."""
    quarter = max(1, len(history) // 4)
    cycle = math.ceil(n_examples / max(1, len(history[0]["prompts"]))) if history else 1  # steps per pass
    window = quarter // cycle * cycle if cycle <= quarter else quarter
    first, last = history[:window], history[-window:]
    summary = {"reward_first": float(np.mean([h["reward_mean"] for h in first])),
               "reward_last": float(np.mean([h["reward_mean"] for h in last])), "skipped": skipped}
    before = out / "images" / "before.json"
    if after is not None and before.exists():
        summary.update(shown_before=json.loads(before.read_text())["reward"], shown_after=after)
    if rank == 0:
        shown = (f"; same prompts and seeds before -> after: {summary['shown_before']:.4f} -> {after:.4f} "
                 f"(images/before_after.png)" if "shown_after" in summary else "")
        print(f"reward (mean of first {len(first)} steps) {summary['reward_first']:.4f} -> "
              f"(mean of last {len(last)} steps) {summary['reward_last']:.4f}{shown}; saved to {out}")
    return summary


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:  # Ctrl-C while loading or checking (the training loop handles its own): no traceback
        print("grpo.py: interrupted", file=sys.stderr)
        raise SystemExit(130) from None
