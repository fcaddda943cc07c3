"""Memory plan for one GRPO step of grpo.py on the real GLM-Image, on one 80 GB GPU. An ESTIMATE, with the AR's terms
and the DiT's activations measured on the CPU at the real widths and the decoding term calibrated on one H100 (each
measured phase there within 4% of the plan: GPU_MEASURED).

    python tools/memory_plan.py                  # CPU, seconds, downloads nothing; shows the last measurement (MEASURED)
    python tools/memory_plan.py --micro-batch 4  # the tiny model's micro-batch (real-model default: 1)
    python tools/memory_plan.py --measure        # re-measure the AR's terms at the real widths (CPU, 4-10 min, 8 GB RAM)
    python tools/memory_plan.py --measure-dit    # re-measure the DiT's saved activations at its widths (CPU, a minute)

What it does
  1. Builds every component of zai-org/GLM-Image from its published config on the meta device (no memory, no
     download) and counts parameters: the AR (transformers GlmImageForConditionalGeneration, split into language-model
     layers / token embedding / lm_head / vision tower / VQ), the DiT (diffusers GlmImageTransformer2DModel), the VAE
     (AutoencoderKL) and the glyph encoder (T5EncoderModel).
  2. Counts the LoRA parameters for r=16 and r=64 on the AR language model's q/k/v/o_proj, gate_up_proj, down_proj
     (from the shapes; cross-checked with peft on a meta model).
  3. Prints the estimated peak GPU memory of one GRPO step at 1024x1024, G=4 (N = 256 preview + 1024 large = 1280
     generated tokens, a ~100-token prompt, so the teacher-forced sequence has L = P + N - 1 = 1379 tokens) for full
     fine-tuning and LoRA r=16 / r=64, with and without gradient checkpointing, backward micro-batch 1, with the
     assumptions, the measured-vs-formula table, checks against measurements and a verdict, as a markdown section.
  4. --measure: runs the AR at its published widths with 0, 1 and 2 decoder layers on the CPU the way grpo.py runs it
     (its own token_logprobs / apply_lora / generate arguments, autocast bf16, with and without checkpointing, one and
     two micro-batches) and records what autograd saves (saved-tensor hooks) and every storage the ops allocate and
     free (a TorchDispatchMode, `LiveStorages`); matrix products and attention return zeros of their exact shapes
     instead of computing (bf16 matmuls crawl on this CPU; the bytes are checked identical on a narrow copy). It
     prints the plan with the fresh numbers and the new MEASURED to paste below. Plain runs show MEASURED.

Where the configs come from (SOURCES below; public pages and repositories, read with a search tool, not downloaded here)
  - AR: zai-org/GLM-Image vision_language_encoder/config.json (its huggingface.co page): text_config, vision_config, and
    vq_config up to initializer_range. Every size in it equals the transformers 5.23 default in
    configuration_glm_image.py, so the parameter counts are the same either way; but the default rope_parameters lack
    the published mrope_section [8, 12, 12] and partial_rotary_factor 0.5 (a config built from defaults alone is not
    the published model). The rest of vq_config (latent_channels, num_embeddings) was cut off in the copy we could
    read: library defaults (1536, 16384), flagged; num_embeddings 16384 agrees with the DiT's
    prior_vq_quantizer_codebook_size. The VQ is 0.04B parameters and unused for text-to-image.
  - DiT: transformer/config.json of a full re-upload of the checkpoint (huggingface.co/xcreates/GLM-Image); the same
    values are in hao-ai-lab/FastVideo fastvideo/configs/models/dits/glm_image.py, sglang's GlmImageArchConfig and
    ollama/ollama x/imagegen/models/glm_image/transformer.go. The diffusers class defaults (64 heads x 40) are NOT
    the published model (32 heads x 128).
  - VAE: the raw vae/config.json was not found; values from hao-ai-lab/FastVideo fastvideo/configs/models/vaes/
    glm_image.py (it carries the 16 latents_mean/std values, so it was copied from the checkpoint) and from the
    comments of ollama/ollama x/imagegen/models/glm_image/vae.go; the two agree.
  - Glyph encoder: the raw text_encoder/config.json was not found; values from the comments of ollama/ollama
    x/imagegen/models/glm_image/text_encoder.go (a ByT5-small encoder; d_model 1472 = the DiT's text_embed_dim).
  Size check: these configs give 10.11B (AR), 6.93B (DiT), 0.218B (T5) parameters = 18.8 GiB bf16, 12.9 GiB bf16,
  0.81 GiB fp32: the checkpoint sizes a third-party ComfyUI node lists (18.8GB / 12.9GB / 830MB).

Assumptions (all byte counts are in the FORMULAS section)
  - Frozen weights in bf16: AR, DiT, VAE, T5 (grpo.py loads the pipeline with dtype=bfloat16 on a GPU).
  - Full fine-tuning trains what grpo.py trains: the AR language model incl. token embedding + lm_head (vision tower
    and VQ frozen). "fp32 master": fp32 weights 4 B + fp32 grads 4 B + AdamW m, v 8 B = 16 B/param, plus the bf16
    copies torch.autocast caches of the cast weights (the layers' linears and lm_head; not the embedding) while
    sampling and training (2 B/param). "bf16 + fp32 Adam": bf16 weights 2 B + bf16 grads 2 B + fp32 m, v 8 B =
    12 B/param. "(extra) bf16 + 8-bit Adam, beta 0": 2 + 2 + 2 B/param and no reference; not what grpo.py does
    (needs bitsandbytes), shown to size the gap.
  - LoRA: adapters in fp32 (peft's default), 4 + 4 + 8 = 16 B/param; base AR bf16.
  - Reference model: none extra with LoRA (adapter disabled = base model); a bf16 copy of the whole AR for full
    fine-tuning with KL beta > 0 (grpo.py's real default beta is 0.04).
  - Gradients stay allocated from optimizer.step() to the next train_step's zero_grad (as grpo.py is written), so
    they count in every phase; so do optimizer states.
  - AR activations kept for the backward, per decoder layer and token, with grpo.py's autocast(bf16) and SDPA
    flash/efficient attention (no L x L matrix; no mask, so k/v stay GQA-sized), see act_bytes_per_token_layer:
    ~42.3 h + 8 i bytes (full FT, fp32 weights: the residual stream is fp32), ~34.3 h + 8 i (full FT, bf16 weights),
    ~30.3 h + 8 i (LoRA: frozen norms keep only their fp32 input; each adapter keeps its own bf16 input). The formula
    equals, byte for byte, what saved-tensor hooks record on a narrow copy and at the real widths (MEASURED).
    Checkpointing keeps each layer's input (L x h x 2 bytes, 4 with an fp32 residual stream). The training phase is
    the largest of three moments (train_bytes): the start of the backward, inside one layer (+ a layer's workspace,
    + a weight-gradient transient with full FT), the end of a later micro-batch's backward (gradient transients).
  - Logits: lm_head on the last N positions only (logits_to_keep=N); kept are the final norm's tensors and the fp32
    log-softmax over the K codebook ids (N x K x 4), two more of those in the backward (logits_bytes).
  - Sampling (fast_decode.decode): a KV cache of G x (P + N) slots x layers x kv_heads x head_dim for keys and values (bf16;
    keys fp32 with fp32 weights), the prefill's transients, the token / log-prob / support buffers and one step's
    work over the vocabulary (sampler_bytes); no step's logits are kept.
  - Decoding (no grad): DiT ~12 hidden-widths per token alive inside a block (x, norm, q/k/v, normed/roped q/k,
    attention out, FF 4h + GELU 4h), batch G, 4096 image tokens + glyph tokens, CFG passes one after the other; VAE
    decode of the G images in one call in bf16: ~3 feature maps of the largest level alive at once (input, GroupNorm
    out, SiLU out: 512 channels at 1024x1024). DiT and VAE run one after the other: max of the two.
  - Peak = max over the phases of one step (sampling, decoding, backward). "Offloaded": DiT/VAE/T5 in CPU memory,
    on the GPU only for decoding (grpo.py --offload).
  - Budget: 80 GiB. "yes" = estimate <= 72 GiB (10% left for the CUDA context, allocator fragmentation and kernel
    workspaces, which are not modelled), "tight" = 72-80 GiB, "no" = above.
  - Calibration: the upstream README (github.com/zai-org/GLM-Image) reports the peak VRAM of plain diffusers inference
    on one H100 at 1024x1024: 37.82 GB (batch 1), 52.09 GB (batch 4). The same formulas for inference alone are
    printed next to those numbers; they come out 2% high at batch 1 and 7% low at batch 4 (the decoding term).
"""

import argparse
import contextlib
import gc
import io
import os
import pprint
import sys
import time
import warnings
from pathlib import Path

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

GiB = 2**30

# ---- 1. Published configs, and the last measurement -------------------------------------------------------------

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # grpo.py and the files it imports live in the repository root
from helpers.offline_model import PUBLISHED, SOURCES  # noqa: E402  (the one copy of the published configs)

AR_CONFIG, DIT_CONFIG, VAE_CONFIG, T5_CONFIG = PUBLISHED["ar"], PUBLISHED["dit"], PUBLISHED["vae"], PUBLISHED["t5"]
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_up_proj", "down_proj"]
PUBLISHED_INFERENCE_PEAK_GB = {1: 37.82, 4: 52.09}  # github.com/zai-org/GLM-Image README, H100, 1024x1024, T2I

# What `python tools/memory_plan.py --measure` printed last (bytes; see `measure`): pasted here so that a plain run takes
# seconds. Per mode: act / act_hooks / act_short: kept per decoder layer and token without checkpointing (live
# storages at L = 1379 / saved-tensor hooks / L = 611); ckpt / ckpt_short: the same with checkpointing; workspace: a
# recomputed layer's transient per token beside its saved tensors; autocast_layer: autocast's bf16 copies per layer;
# logits: what lies outside the layers (0-layer model), kept + backward; step_*: the 2-layer step's peak beside the
# weights and .grad (first / a later micro-batch, without / with checkpointing); step_scaled: the L = 611 peak
# scaled to L = 1379 (vs step_tokens, measured there); kv: KV cache bytes per position, layer and sequence (fast_decode.decode's
# fixed-shape cache); sampler_post: fast_decode.decode's peak beside its cache (measured 2026-11-24, after the decode loop).
MEASURED = {'when': '2026-11-22',
 'seconds': 401,
 'machine': '2-core CPU, torch 2.13.0+cpu, transformers 5.23.0, peft 0.21.2',
 'full_fp32': {'act': 282768.0,
               'act_hooks': 282768.0,
               'act_short': 282768.0,
               'ckpt': 16384.0,
               'ckpt_short': 16384.0,
               'workspace': 73724.0,
               'autocast_layer': 407905280,
               'logits': 307341708.0,
               'step_first': 2016399720.0,
               'step_later': 2172686344.0,
               'step_ckpt_first': 1514279212.0,
               'step_ckpt_later': 2217873416.0,
               'step_scaled': 1065322848.0,
               'step_tokens': 1065322848.0,
               'kv': 1536.0,
               'sampler_post': 968921112.0},
 'full_bf16': {'act': 250000.0,
               'act_hooks': 250000.0,
               'act_short': 250000.0,
               'ckpt': 8192.0,
               'ckpt_short': 8192.0,
               'workspace': 81916.0,
               'autocast_layer': 0,
               'logits': 296855948.0,
               'step_first': 964109928.0,
               'step_later': 964109928.0,
               'step_ckpt_first': 480658732.0,
               'step_ckpt_later': 506365484.0,
               'step_scaled': 964109920.0,
               'step_tokens': 964109920.0,
               'kv': 1024.0,
               'sampler_post': 121328664.0},
 'lora': {'act': 233808.0,
          'act_hooks': 233808.0,
          'act_short': 233808.0,
          'ckpt': 8192.0,
          'ckpt_short': 8192.0,
          'workspace': 114940.0,
          'autocast_layer': 2379776,
          'logits': 274262412.0,
          'step_first': 901618408.0,
          'step_later': 901618408.0,
          'step_ckpt_first': 508629612.0,
          'step_ckpt_later': 508629612.0,
          'step_scaled': 896858848.0,
          'step_tokens': 896858848.0}}

# Measured on one GPU: torch.cuda.max_memory_allocated of each phase of grpo.main (reset per phase), GiB, GLM-Image at
# its full published depth with random bf16 weights built on the GPU (grpo.py --model random; tools/bench_gpu.py), the
# real-model defaults: 1024x1024, G = 4, top-p 0.75, LoRA r = 16 on the AR, micro-batch 1, guidance 1.5, 50 DiT steps.
# Sampling by grpo.py's decode loop (with `generate` it peaked at 36.9); the DiT's update without checkpointing ran out
# of memory above 74.4 GiB (../shared/GLM_IMAGE_NOTES.md, "On a GPU"), with it (grpo.py's default now) it peaked at 36.9.
GPU_MEASURED = {
    "when": "2026-11-24", "machine": "one H100 80GB HBM3, torch 2.11.0+cu130, transformers 5.24.0, diffusers 0.42.1",
    "lora": {"sample": 33.6, "decode": 52.3, "train": 46.0},
    "lora_ckpt": {"train": 34.9},
    "lora_offload": {"sample": 19.5, "decode": 52.3, "train": 32.0},
    "dit_lora": {"train_oom_above": 74.4, "sample": 33.3, "decode": 52.3, "train_ckpt": 36.9, "sde_steps": 10,
                 "sde_window": 2},
}
VAE_MAPS_FORMULA = 3  # vae_decode_bytes' count of the largest level's maps alive at once (input, GroupNorm, SiLU)
VAE_MAPS = VAE_MAPS_FORMULA  # calibrated on GPU_MEASURED by `calibrate` (about 4.6: cuDNN workspaces, more maps)

# What `python tools/memory_plan.py --measure-dit` printed last: the DiT's saved tensors per token, per transformer block
# and per DiT call, in hidden-widths (bytes / 4096), at its published widths (1 block, random bf16 weights, LoRA r = 16
# as dit_grpo.apply_lora, autocast bf16; saved-tensor hooks, the slope between 256 and 1024 image tokens; weights out).
MEASURED_DIT = {"when": "2026-11-24", "machine": "2-core CPU, torch 2.13.0+cpu, diffusers 0.42.1, peft 0.21.2",
                "kept": 42.39, "ckpt": 4.0}


# ---- 2. Build on meta, count parameters -------------------------------------------------------------------------

def numel(module) -> int:
    return sum(p.numel() for p in module.parameters())


def build_ar(num_layers: int | None = None):
    from transformers import GlmImageConfig, GlmImageForConditionalGeneration
    cfg = dict(AR_CONFIG, text_config=dict(AR_CONFIG["text_config"]))
    if num_layers is not None:
        cfg["text_config"]["num_hidden_layers"] = num_layers
    config = GlmImageConfig(**cfg)
    with torch.device("meta"):
        return GlmImageForConditionalGeneration(config)


def count_components() -> dict:
    from diffusers import AutoencoderKL, GlmImageTransformer2DModel
    from transformers import T5Config, T5EncoderModel
    ar = build_ar()
    lm = ar.model.language_model
    with torch.device("meta"):
        dit = GlmImageTransformer2DModel(**DIT_CONFIG)
        vae = AutoencoderKL(**VAE_CONFIG)
        t5 = T5EncoderModel(T5Config(**T5_CONFIG))
    counts = {
        "AR language model, decoder layers": numel(lm) - lm.embed_tokens.weight.numel(),
        "AR token embedding": lm.embed_tokens.weight.numel(),
        "AR lm_head": ar.lm_head.weight.numel(),
        "AR vision tower": numel(ar.model.visual),
        "AR VQ": numel(ar.model.vqmodel),
        "AR total": numel(ar),
        "DiT": numel(dit),
        "VAE": numel(vae),
        "VAE decoder": numel(vae.decoder),
        "T5 glyph encoder": numel(t5),
    }
    counts["AR trainable (full FT, as grpo.py)"] = numel(lm) + counts["AR lm_head"]
    return counts


def library_default_diffs() -> list[str]:
    """Published AR values that differ from the transformers defaults (found: the rope_parameters)."""
    from transformers import GlmImageConfig
    default = GlmImageConfig().to_dict()
    diffs = []

    def compare(path: str, published, lib):
        if isinstance(published, dict):
            for k, v in published.items():
                compare(f"{path}.{k}" if path else k, v, (lib or {}).get(k))
        elif published != lib:
            diffs.append(f"{path}: published {published!r}, default {lib!r}")

    compare("", AR_CONFIG, default)
    return diffs


def lora_params_peft(r: int) -> int | None:
    """LoRA trainable params counted by peft on a 1-layer meta AR, times the layer count (None without peft)."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        return None
    model = get_peft_model(build_ar(num_layers=1), LoraConfig(r=r, lora_alpha=r, target_modules=LORA_TARGETS))
    per_layer = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return per_layer * AR_CONFIG["text_config"]["num_hidden_layers"]


# ---- 3. FORMULAS (every byte count of the plan is here) ---------------------------------------------------------

def shapes(ar_config: dict | None = None) -> dict:
    a = ar_config or AR_CONFIG
    t = a["text_config"]
    head_dim = t["hidden_size"] // t["num_attention_heads"]
    return dict(h=t["hidden_size"], i=t["intermediate_size"], layers=t["num_hidden_layers"],
                heads=t["num_attention_heads"], kv_dim=t["num_key_value_heads"] * head_dim, head_dim=head_dim,
                V=t["vision_vocab_size"], V_text=t["vocab_size"], K=a["vq_config"]["num_embeddings"])


def lora_params(r: int) -> int:
    """r x (in + out) for every adapted linear of every layer."""
    s = shapes()
    h, i, kv = s["h"], s["i"], s["kv_dim"]
    per_layer = (h + h) + 2 * (h + kv) + (h + h) + (h + 2 * i) + (i + h)  # q, k+v, o, gate_up, down
    return r * per_layer * s["layers"]


def cast_params_per_layer(s: dict | None = None) -> int:
    """Parameters autocast casts to bf16 in one decoder layer: the weights of q, k, v, o, gate_up, down and the q, k, v
    biases (not the RMSNorm weights: their multiply is no autocast op)."""
    s = s or shapes()
    h, i, kv = s["h"], s["i"], s["kv_dim"]
    return 2 * h * h + 2 * h * kv + 2 * h * i + i * h + (h + 2 * kv)


def cast_params(layers: int | None = None) -> int:
    """All parameters autocast casts: the decoder layers' linears and lm_head. Not the token embedding: a lookup is no
    autocast op (full FT, measured: the same bytes whether the embedding trains or not)."""
    s = shapes()
    return (s["layers"] if layers is None else layers) * cast_params_per_layer(s) + s["V"] * s["h"]


# How the AR is run, as grpo.py runs it on a GPU (dtype bfloat16 => torch.autocast(bfloat16) around everything):
#   "full_fp32": fp32 trainable weights under autocast (grpo.py's full fine-tuning: policy.float())
#   "full_bf16": bf16 trainable weights (autocast changes nothing)
#   "lora":      bf16 frozen base + fp32 peft adapters, under autocast
ACT_MODES = ("full_fp32", "full_bf16", "lora")


def act_bytes_per_token_layer(mode: str, s: dict | None = None, lora_rank: int = 16) -> float:
    """Bytes autograd keeps for the backward of one AR decoder layer, per token (SDPA flash/efficient attention).

    A GLM decoder layer = 4 RMSNorms (input, post_self_attn, post_attention, post_mlp), q/k/v/o, gate_up, SiLU x up,
    down. What is kept (each term checked by saved-tensor hooks, on a narrow copy and at the real widths: `measure`):
      attention kernel: q, out in bf16 (2 x 2h), k, v in bf16 (2 x 2 kv_dim, GQA), log-sum-exp fp32 (4 heads)
      RMSNorm: an fp32 copy of its input (4h each, 16h) and 1/rms (4 bytes each); its normalized output too when its
        weight trains (8h in bf16; 8h fp32 + 4h bf16 with an fp32 residual stream)
      linear inputs, only where a weight trains: q, k, v, o, gate_up (2h each; q/k/v share one bf16 input unless
        autocast casts it three times) and down (2i)
      MLP: gate_up output (4i) and SiLU output (2i)
    """
    s = s or shapes()
    h, i = s["h"], s["i"]
    attention = 2 * 2 * h + 2 * 2 * s["kv_dim"] + 4 * s["heads"]
    rms = 4 * 4
    if mode == "full_bf16":  # norm inputs fp32 16h + norm outputs 8h + linear inputs (q/k/v shared) 6h + 2i + MLP 6i
        return 16 * h + 8 * h + 6 * h + 2 * i + 6 * i + attention + rms
    if mode == "full_fp32":  # fp32 residual stream: two norms keep fp32 outputs (8h), two bf16 (4h); autocast casts
        return 16 * h + (8 * h + 4 * h) + (3 * 2 * h + 2 * h + 2 * h + 2 * i) + 6 * i + attention + rms  # q, k, v apart
    if mode == "lora":  # frozen norms: inputs only; each adapter keeps its own bf16 input (5 x 2h + 2i), A-out 6 x 2r
        return 16 * h + (5 * 2 * h + 2 * i) + 6 * i + 6 * 2 * lora_rank + attention + rms
    raise ValueError(mode)


def residual_bytes(mode: str) -> int:
    """Bytes per value of the residual stream (= a layer's input, all that checkpointing keeps of a layer)."""
    return 4 if mode == "full_fp32" else 2  # fp32 weights: the embedding and every residual add stay fp32


def layer_workspace_per_token(mode: str, s: dict | None = None) -> float:
    """Bytes per token alive beside one layer's saved tensors while that layer runs: the largest transient of its
    backward, for full FT the RMSNorm backward's fp32 L x h temporaries (5 of them, 20h; 18h with fp32 weights, whose
    residual stream needs no fp32 copy), for LoRA of its forward or recompute (peft casts down_proj's input to the fp32
    adapter's dtype, 4i, while ~15h of the layer's other temporaries are alive). As measured at the real widths."""
    s = s or shapes()
    return {"full_fp32": 18 * s["h"], "full_bf16": 20 * s["h"], "lora": 4 * s["i"] + 15 * s["h"]}[mode]


def logits_bytes(mode: str, L: int, N: int, micro_batch: int = 1) -> dict:
    """What lies outside the decoder layers (final RMSNorm, lm_head on the last N positions, code_logprobs):
      kept for the backward: the final norm's fp32 input (L x 4h) and 1/rms (L x 4); with a trainable norm / lm_head
        also its normalized output and lm_head's bf16 input (together L x 4h: 4h fp32 with fp32 weights, 2h + 2h
        bf16 with bf16 weights); lm_head's bf16 input cast (N x 2h) with fp32 weights; log_softmax's fp32 output over
        the K codebook ids (N x 4K). The bf16 N x V logits, their fp32 slice and the /T copy are freed after the
        forward.
      backward: the gradient of the gathered log-probs and of the log-softmax, 2 x N x 4K, beside what is kept."""
    s = shapes()
    h, K = s["h"], s["K"]
    full = mode.startswith("full")
    kept = L * (4 * h + 4 + (4 * h if full else 0)) + N * (4 * K + (2 * h if mode == "full_fp32" else 0))
    return dict(kept=micro_batch * kept, backward=micro_batch * 2 * N * K * 4)


def train_bytes(mode: str, checkpointing: bool, L: int, N: int, micro_batch: int, lora_rank: int = 16,
                layers: int | None = None, accumulating: bool = True, embedding_trains: bool | None = None) -> dict:
    """Peak bytes of one forward/backward of `micro_batch` sequences of length L beside the weights, their gradients,
    the optimizer and autocast's weight copies: the largest of three moments (measured at the real widths, 2 layers):
      A, the start of the backward: everything the forward kept (layers x one layer, or with checkpointing each layer's
        input) + the logits' kept tensors + their backward (`logits_bytes`)
      B, inside one layer: with checkpointing the inputs + the recomputed layer; without, everything kept; plus the
        larger of `layer_workspace_per_token` x L and, with full FT, down_proj's weight gradient (the first of a
        layer's backward: the bf16 gradient of its autocast copy before it becomes fp32 with fp32 weights; with bf16
        weights the incoming gradient added to .grad from the second micro-batch on) beside its input's gradient
        (L x 2i)
      C, the end of the backward of a later micro-batch (`accumulating`): autocast's copies, cached in the first
        micro-batch, keep their ToCopyBackward nodes of that first graph, and the engine runs those last: the bf16
        gradients of every cast weight (2 B/param) are alive together, beside the fp32 gradient of the embedding (or
        lm_head) about to be added to .grad; with bf16 weights the incoming gradient of the largest matrix; with LoRA
        the adapters' bf16 gradients; plus layer 0's input gradient (and with checkpointing its input)
    Layer 0 keeps L x (4h + 4) less when the embedding is frozen (its input norm's input needs no gradient), which
    is what LoRA does (embedding_trains defaults to: full fine-tuning)."""
    s = shapes()
    h, i = s["h"], s["i"]
    layers = s["layers"] if layers is None else layers
    full = mode.startswith("full")
    embedding_trains = full if embedding_trains is None else embedding_trains
    one_layer = micro_batch * L * act_bytes_per_token_layer(mode, lora_rank=lora_rank)
    inputs = layers * micro_batch * L * s["h"] * residual_bytes(mode)
    first_layer = 0 if (embedding_trains or checkpointing) else micro_batch * L * (4 * h + 4)
    kept = (inputs if checkpointing else layers * one_layer - first_layer)
    logits = logits_bytes(mode, L, N, micro_batch)
    weight_grad = 2 * h * i if mode == "full_fp32" or (mode == "full_bf16" and accumulating) else 0
    workspace = micro_batch * L * layer_workspace_per_token(mode)
    weight_grad_moment = weight_grad + micro_batch * L * 2 * i if weight_grad else 0  # + down_proj's input gradient
    moments = dict(A=kept + logits["kept"] + logits["backward"],
                   B=(inputs + one_layer if checkpointing else kept) + max(workspace, weight_grad_moment),
                   C=0)
    if accumulating:
        embedding = s["V_text"] * h if embedding_trains else 0
        layer0 = micro_batch * L * h * residual_bytes(mode) * (2 if checkpointing else int(embedding_trains))
        moments["C"] = layer0 + {"full_fp32": 2 * cast_params(layers) + 4 * max(embedding, s["V"] * h),
                                 "full_bf16": 2 * max(embedding, 2 * h * i),
                                 "lora": 2 * lora_params(lora_rank) * layers // s["layers"]}[mode]
    phase = max(moments, key=moments.get)
    return dict(moments, peak=moments[phase], phase=phase, kept=kept, logits=logits["kept"] + logits["backward"])


def kv_cache_bytes(G: int, L: int, mode: str = "lora", layers: int | None = None) -> float:
    """G sequences x L cache slots (prompt + generated) x layers x kv_dim, keys and values: bf16, keys fp32 when the
    weights are fp32 (full_fp32: the rotary cos/sin follow the fp32 residual stream and promote k; the static cache
    keeps each in its own dtype, measured)."""
    s = shapes()
    return G * L * (s["layers"] if layers is None else layers) * s["kv_dim"] * (2 + residual_bytes(mode))


def sampler_bytes(G: int, N: int, P: int = 100, top_p: bool = True) -> float:
    """fast_decode.decode's peak beside the KV cache: the prefill's transients (one layer's forward for the G x P prompt
    tokens), the (G, N) tokens and log-probs, with top-p / top-k the (G, N, K/8) support bits, and one step's fp32 work
    over the vocabulary (logits, probabilities, the exponential draws, the top-p sort: ~12 x G x V x 4 bytes). No
    step's logits are kept (generate kept all N of them: 1.25 GiB at G = 4, N = 1280)."""
    s = shapes()
    prefill = G * P * (8 * s["i"] + 10 * s["h"]) * 2  # one layer's forward transients for every prompt token (measured)
    return prefill + G * N * (8 + 4 + (s["K"] // 8 if top_p else 0)) + 12 * G * s["V"] * 4


def dit_activation_bytes(G: int, height: int, width: int, glyph_tokens: int) -> float:
    p, vae_scale = DIT_CONFIG["patch_size"], 2 ** (len(VAE_CONFIG["block_out_channels"]) - 1)
    tokens = (height // vae_scale // p) * (width // vae_scale // p) + glyph_tokens
    hidden = DIT_CONFIG["num_attention_heads"] * DIT_CONFIG["attention_head_dim"]
    return G * tokens * hidden * 2 * 12  # ~12 hidden-widths alive inside a block, one CFG pass at a time


def vae_decode_bytes(G: int, height: int, width: int, maps: float | None = None) -> float:
    """Largest moment of the decoder: `maps` maps at the biggest channels x pixels (default VAE_MAPS: the formula's 3,
    input, GroupNorm out, SiLU out, calibrated on a GPU by `calibrate`)."""
    maps = VAE_MAPS if maps is None else maps
    chans = list(reversed(VAE_CONFIG["block_out_channels"]))
    n = len(chans)
    worst = 0
    for b in range(n):  # up block b runs at 1/2^(n-1-b) of the output resolution, input channels chans[b-1]
        pixels = (height >> (n - 1 - b)) * (width >> (n - 1 - b))
        c_in = chans[max(b - 1, 0)]
        worst = max(worst, maps * c_in * pixels)
        if b < n - 1:  # the upsampler: nearest x2 output + conv output at 4x the pixels, input alive
            worst = max(worst, (2 * 4 + 1) * maps / 3 * chans[b] * pixels)
    return G * worst * 2


FULL_FT_VARIANTS = {  # bytes per trainable param: weights, grads, optimizer; autocast bf16 copies (of the cast params)
    "full FT, fp32 master + AdamW": dict(weights=4, grads=4, optim=8, autocast=2, reference=True, act="full_fp32"),
    "full FT, bf16 + fp32 AdamW": dict(weights=2, grads=2, optim=8, autocast=0, reference=True, act="full_bf16"),
    "(extra) full FT, bf16 + 8-bit AdamW, beta 0": dict(weights=2, grads=2, optim=2, autocast=0, reference=False,
                                                        act="full_bf16"),
}


def plan_rows(counts: dict, G: int, P: int, height: int, width: int, micro_batch: int, ranks=(16, 64),
              glyph_tokens: int = 64) -> tuple[list[dict], dict]:
    N = 256 + (height // 32) * (width // 32)  # preview grid (~16 x 16) + large grid
    L = P + N - 1
    ar_bf16 = counts["AR total"] * 2
    decoder_weights = (counts["DiT"] + counts["VAE"] + counts["T5 glyph encoder"]) * 2
    decoding = max(dit_activation_bytes(G, height, width, glyph_tokens), vae_decode_bytes(G, height, width))
    accumulating = G > micro_batch  # gradients of later micro-batches are added to .grad
    common = dict(N=N, L=L, ar_bf16=ar_bf16, decoder_weights=decoder_weights, decoding=decoding,
                  sampling={m: kv_cache_bytes(G, L + 1, m) + sampler_bytes(G, N) for m in ACT_MODES})

    settings = []
    trainable = counts["AR trainable (full FT, as grpo.py)"]
    frozen = counts["AR total"] - trainable
    for name, v in FULL_FT_VARIANTS.items():
        settings.append(dict(name=name, mode=v["act"], full=True, trainable=trainable,
                             persistent=trainable * (v["weights"] + v["grads"] + v["optim"]) + frozen * 2,
                             reference=ar_bf16 if v["reference"] else 0,
                             autocast=cast_params() * v["autocast"]))  # cached by autocast while sampling and training
    for r in ranks:
        n = lora_params(r)
        settings.append(dict(name=f"LoRA r={r}", mode="lora", full=False, trainable=n, persistent=ar_bf16 + n * 16,
                             reference=0, autocast=n * 2, rank=r))
    rows = []
    for st in settings:
        for ckpt in (False, True):
            tr = train_bytes(st["mode"], ckpt, L, N, micro_batch, st.get("rank", 16), accumulating=accumulating)
            ar_state = st["persistent"] + st["reference"]
            train = tr["peak"] + st["autocast"]
            peaks = {}
            for offload in (False, True):
                resident = 0 if offload else decoder_weights
                phases = {"sample": ar_state + resident + common["sampling"][st["mode"]] + st["autocast"],
                          "decode": ar_state + decoder_weights + decoding,
                          "train": ar_state + resident + train}
                phase = max(phases, key=phases.get)
                peaks[offload] = (phases[phase], phase, phases)
            rows.append(dict(st, ckpt=ckpt, ar_state=ar_state, train=train, train_parts=tr, peaks=peaks))
    return rows, common


def fsdp_rows(counts: dict, world: int, G: int, P: int, height: int, width: int, micro_batch: int,
              glyph_tokens: int = 64) -> list[dict]:
    """Per-GPU peaks of grpo.py under `torchrun --nproc-per-node world` (FSDP2, bf16), G samples per GPU, as grpo.py
    shards (parallel.shard): every AR parameter, gradient and AdamW state is split over the GPUs (full FT: policy.float()
    makes the whole AR fp32; the KL reference is a bf16 copy, sharded too; LoRA: the bf16 base and the adapters);
    the DiT, VAE and T5 are replicated. On top of the shards, per phase:
      sample: the AR gathered once in bf16 for the whole generate (parallel.unsharded; the vision tower and VQ are
        units of their own, never gathered for text-to-image) + the KV cache and sampler logits of one GPU's G;
      train: the root unit (embedding, lm_head) stays gathered in bf16, two layers in flight (the one running and the
        one prefetched), the activations of one micro-batch with bf16 compute weights (mode full_bf16 / lora), and the
        gradients in flight: every micro-batch reduce-scatters, full FT and LoRA alike (one layer's gradient and its
        fp32 reduce buffer);
      decode: the replicated DiT + VAE + T5 and their activations.
    No autocast weight copies: FSDP's mixed precision gathers bf16 weights directly."""
    N = 256 + (height // 32) * (width // 32)
    L = P + N - 1
    s = shapes()
    layer = counts["AR language model, decoder layers"] / s["layers"]
    root = counts["AR token embedding"] + counts["AR lm_head"]
    gathered = counts["AR total"] - counts["AR vision tower"] - counts["AR VQ"]  # what generate touches
    decoder_weights = (counts["DiT"] + counts["VAE"] + counts["T5 glyph encoder"]) * 2
    decoding = max(dit_activation_bytes(G, height, width, glyph_tokens), vae_decode_bytes(G, height, width))
    trainable = counts["AR trainable (full FT, as grpo.py)"]
    rows = []
    for name, mode, lora in [("full FT, fp32 master + AdamW, KL reference", "full_bf16", False),
                             ("LoRA r=16", "lora", True)]:
        n = lora_params(16) if lora else trainable
        shards = ((counts["AR total"] * 2 + n * 16) if lora
                  else counts["AR total"] * 4 + trainable * (4 + 8) + counts["AR total"] * 2) / world  # + bf16 ref
        grads_in_flight = (n / s["layers"] if lora else layer) * (2 + 4)
        for ckpt in (False, True):
            act = train_bytes(mode, ckpt, L, N, micro_batch, accumulating=G > micro_batch,
                              embedding_trains=not lora)
            phases = {"sample": shards + decoder_weights + gathered * 2 + kv_cache_bytes(G, L, "lora")
                      + sampler_bytes(G, N),
                      "decode": shards + decoder_weights + decoding,
                      "train": shards + decoder_weights + root * 2 + 2 * layer * 2 + act["peak"] + grads_in_flight}
            phase = max(phases, key=phases.get)
            rows.append(dict(name=name, world=world, ckpt=ckpt, shards=shards, phases=phases, phase=phase,
                             peak=phases[phase]))
    return rows


def verdict(x: float) -> str:
    return "yes" if x <= 72 * GiB else ("tight" if x <= 80 * GiB else "no")


def inference_check(counts: dict, height: int, width: int, glyph_tokens: int) -> list[str]:
    """Same formulas for plain diffusers inference (no optimizer, no grads), against the upstream README."""
    lines = []
    weights = (counts["AR total"] + counts["DiT"] + counts["VAE"] + counts["T5 glyph encoder"]) * 2
    for batch, measured in PUBLISHED_INFERENCE_PEAK_GB.items():
        N = 256 + (height // 32) * (width // 32)
        est = weights + max(kv_cache_bytes(batch, 1000 + N),  # the pipeline keeps no per-step logits
                            dit_activation_bytes(batch, height, width, glyph_tokens),
                            vae_decode_bytes(batch, height, width))
        lines.append(f"batch {batch}: estimate {est / 1e9:.1f} GB ({est / GiB:.1f} GiB), upstream measured "
                     f"{measured} GB")
    return lines


# ---- 4. MEASUREMENT: what the AR keeps and allocates, as grpo.py runs it, on the CPU (--measure) -------------------

ARITHMETIC_OPS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
                  torch.ops.aten.baddbmm.default, torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
                  torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default}
# (prompt tokens P, large grid, preview grid): L = P + N - 1, N = large + preview codes
LENGTHS = {"plan": (100, (32, 32), (16, 16)),  # the plan's sequence: N = 1024 + 256 = 1280, L = 1379
           "short": (100, (16, 16), (16, 16)),  # N = 512, L = 611: is everything linear in L and N?
           "few codes": (1355, (4, 4), (3, 3))}  # N = 25, L = 1379: a layer's workspace without the logits' transients


class LiveStorages(TorchDispatchMode):
    """A TorchDispatchMode that records every storage an op creates (at the dispatcher, below autograd and autocast):
    the op count at which it appeared, the op count after which it was found freed (checked after every op), its bytes,
    and its kind: "L" if the tensor has the sequence axis L, "N" if it has the generated axis N, else "const"
    (autocast's bf16 weight copies, weight gradients, scalars). Storages that existed before (weights, inputs) are not
    counted. The sum of the live ones is what a GPU caching allocator reports as allocated, less the buffers a kernel
    allocates and frees inside itself (cuBLAS / flash-attention workspaces) and less its rounding and fragmentation.

    skip_arithmetic: matrix products and the attention kernel return zeros of the shape, dtype and strides their meta
    kernels give, without computing (bf16 matrix products run at 0.2-12 GFLOP/s on the 2-core CPU); what autograd
    saves and allocates does not depend on the values (`check_skip_arithmetic`: identical bytes on a narrow copy).
    track=False: skip the arithmetic but record nothing (a long generate)."""

    def __init__(self, axes: dict, before, skip_arithmetic: bool = True):
        super().__init__()
        self.axes, self.skip, self.track = axes, skip_arithmetic, True
        self.before = {t.untyped_storage()._cdata for t in before}
        self.entries = []  # [born, died (None: alive), nbytes, kind, op, shape, dtype]
        self.alive = {}  # storage pointer -> (entry index, weak reference)
        self.ops = 0

    def kind(self, shape) -> str:
        return next((k for k, n in self.axes.items() if n in shape), "const")

    def prune(self):
        for key, (i, ref) in list(self.alive.items()):
            if ref.expired():
                self.entries[i][1] = self.ops
                del self.alive[key]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.skip and func in ARITHMETIC_OPS:
            to_meta = lambda t: t.to("meta") if isinstance(t, torch.Tensor) else t  # noqa: E731
            meta = func(*tree_map(to_meta, args), **tree_map(to_meta, kwargs))
            out = tree_map(lambda m: torch.empty_strided(m.shape, m.stride(), dtype=m.dtype).zero_()
                           if isinstance(m, torch.Tensor) else m, meta)
        else:
            out = func(*args, **kwargs)
        if not self.track:
            return out
        self.ops += 1
        self.prune()
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                if storage._cdata not in self.alive and storage._cdata not in self.before:
                    self.alive[storage._cdata] = (len(self.entries), StorageWeakRef(storage))
                    self.entries.append([self.ops, None, storage.nbytes(), self.kind(t.shape), str(func),
                                         tuple(t.shape), t.dtype])
        return out

    def live(self, op: int | None = None, exclude=(), born_after: int = -1) -> dict:
        """Bytes per kind alive after op `op` (default: now), of the storages born after op `born_after`."""
        op = self.ops if op is None else op
        out = {}
        for i, (born, died, n, kind, *_) in enumerate(self.entries):
            if born_after < born <= op and (died is None or died > op) and i not in exclude:
                out[kind] = out.get(kind, 0) + n
        return out

    def peak(self, scale: dict | None = None, exclude=(), start: int = 0, stop: int | None = None) -> tuple:
        """(bytes, op): the most live bytes after any op from start to stop, each kind's bytes times scale[kind]."""
        scale, stop = scale or {}, self.ops if stop is None else stop
        deltas = [0.0] * (self.ops + 2)
        for i, (born, died, n, kind, *_) in enumerate(self.entries):
            if i not in exclude:
                deltas[born] += n * scale.get(kind, 1.0)
                deltas[self.ops + 1 if died is None else died] -= n * scale.get(kind, 1.0)
        best, at, live = 0.0, start, 0.0
        for op in range(stop + 1):
            live += deltas[op]
            if op >= start and live > best:
                best, at = live, op
        return best, at


def narrow_ar_config() -> dict:
    """The AR at h=512, i=1712 (same heads, KV heads, norms, rope layout, GQA ratio), small vocabularies."""
    text = dict(AR_CONFIG["text_config"], hidden_size=512, intermediate_size=1712, vocab_size=1024,
                vision_vocab_size=1024, pad_token_id=1001, eos_token_id=1001,
                rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[2, 1, 1],
                                     partial_rotary_factor=0.5))  # sections sum to head_dim / 4 = 4
    return dict(AR_CONFIG, text_config=text, image_start_token_id=1000, image_end_token_id=1001,
                image_token_id=1002, vq_config=dict(embed_dim=32, num_embeddings=1000, latent_channels=64),
                vision_config=dict(AR_CONFIG["vision_config"], depth=1, hidden_size=64, num_heads=2,
                                   intermediate_size=64))


def one_row_embedding(model):
    """Freeze the token embedding and make it one row expanded to the whole vocabulary (a view: 0 bytes instead of
    1.3 / 2.6 GiB); a lookup returns the same shape and dtype, and a frozen lookup keeps nothing for the backward."""
    embed = model.get_input_embeddings()
    row = torch.zeros(1, embed.weight.shape[1], dtype=embed.weight.dtype)
    embed.weight = torch.nn.Parameter(row.expand(embed.weight.shape), requires_grad=False)


def measured_ar(ar_config: dict, layers: int, mode: str, lora_rank: int = 16, full_embedding: bool = False):
    """The AR of `ar_config` with `layers` decoder layers and 1 vision block, zero weights, on the CPU, set up as
    grpo.py sets it up for `mode`: built in bf16 (grpo.py's dtype on a GPU), then `policy.float()` (full_fp32) or
    `helpers/setup.apply_lora` (lora); vision tower and VQ frozen (as `grpo.only_ar_trains`). The token embedding is frozen too
    (`one_row_embedding`) unless full_embedding. With 0 layers the final norm's input is the embedding output plus a
    trainable scalar, as if it came from a trainable layer."""
    from transformers import GlmImageConfig, GlmImageForConditionalGeneration
    cfg = dict(ar_config, text_config=dict(ar_config["text_config"], num_hidden_layers=layers),
               vision_config=dict(ar_config["vision_config"], depth=1))
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # as from_pretrained(..., dtype=torch.bfloat16)
    try:
        with torch.device("meta"):
            model = GlmImageForConditionalGeneration(GlmImageConfig(**cfg))
    finally:
        torch.set_default_dtype(default)
    model = model.to_empty(device="cpu")
    with torch.no_grad():
        for t in (*model.parameters(), *model.buffers()):
            t.zero_()  # the bytes do not depend on the values
    model.model.visual.requires_grad_(False)
    model.model.vqmodel.requires_grad_(False)
    model.eval()
    if not full_embedding:
        one_row_embedding(model)
    if mode == "full_fp32":
        model.float()  # (materialises the expanded row for a moment)
        if not full_embedding:
            one_row_embedding(model)
    elif mode == "lora" and layers:
        from helpers.setup import apply_lora
        model = apply_lora(model, lora_rank)
    elif mode == "lora":  # no layer to adapt: the frozen base
        model.requires_grad_(False)
    if layers == 0:
        model.zero = torch.nn.Parameter(torch.zeros((), dtype=torch.float32 if mode == "full_fp32" else torch.bfloat16))
        model.get_input_embeddings().register_forward_hook(lambda module, args, out: out + model.zero)
    return model


def ar_inputs(model, P: int, large: tuple, preview: tuple, G: int = 1) -> tuple[dict, torch.Tensor]:
    """grpo.group_inputs' layout by hand (no processor): G copies of a P-token prompt ending in image start, the
    [large, preview] grid rows; and N = large + preview codes to score."""
    ids = (torch.arange(P)[None] % 100 + 500).repeat(G, 1)
    ids[:, -1] = model.config.image_start_token_id
    N = large[0] * large[1] + preview[0] * preview[1]
    inputs = dict(input_ids=ids, attention_mask=torch.ones_like(ids),
                  image_grid_thw=torch.tensor([[1, *large], [1, *preview]]).repeat(G, 1),
                  images_per_sample=torch.full((G,), 2))
    return inputs, (torch.arange(N)[None] % 1000).repeat(G, 1)


def measure_step(model, length: tuple, passes: int = 1, backward: bool = True, skip_arithmetic: bool = True,
                 scale_to: tuple | None = None) -> dict:
    """`passes` micro-batches of one sequence through trainer.train_step's work, inside one autocast(bf16) as grpo.py
    runs it: grpo.token_logprobs (teacher-forced forward, logits_to_keep=N, code_logprobs), a loss, its backward;
    gradients add up from the second pass on. Returns per kind: `saved` (saved_tensors_hooks of the first forward:
    distinct storages, weights and inputs excluded), `kept` (live storages at the end of the first forward), and per
    pass the peak of the live storages less the parameters' .grad (a persistent term of the plan): "all" and "tokens"
    (the L and N kinds alone), each split into what was born before that pass's backward ("fwd") and in it ("bwd");
    with scale_to=(L', N') also the "tokens" peak with every L / N tensor scaled to L' / N' (linearity check)."""
    from grpo import token_logprobs
    inputs, tokens = ar_inputs(model, *length)
    L, N = inputs["input_ids"].shape[1] + tokens.shape[1] - 1, tokens.shape[1]
    params = list(model.parameters())
    live = LiveStorages(dict(L=L, N=N), [*params, *model.buffers(), *inputs.values(), tokens], skip_arithmetic)
    saved, by_kind, bounds = {}, {}, []

    def pack(t):
        saved.setdefault(t.untyped_storage()._cdata, t)  # (holds nothing autograd does not hold anyway)
        return t

    model.train(model.is_activation_checkpointing)  # as trainer.train_step: train mode only to checkpoint
    with torch.autocast("cpu", dtype=torch.bfloat16), live:
        for k in range(passes):
            start = live.ops
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t) if k == 0 else contextlib.nullcontext():
                loss = -token_logprobs(model, inputs, tokens, 0.9).mean()
            live.prune()
            if k == 0:
                kept = live.live()
                for key, t in saved.items():
                    if key not in live.before:
                        kind = live.entries[live.alive[key][0]][3] if key in live.alive else live.kind(t.shape)
                        by_kind[kind] = by_kind.get(kind, 0) + t.untyped_storage().nbytes()
                saved.clear()
            forward_end = live.ops
            if backward:
                loss.backward()
            del loss
            live.prune()
            bounds.append((start, forward_end, live.ops))
    grads = {live.alive[p.grad.untyped_storage()._cdata][0] for p in params
             if p.grad is not None and p.grad.untyped_storage()._cdata in live.alive}
    for p in params:
        p.grad = None
    out = dict(L=L, N=N, saved=by_kind, kept=kept, passes=[])
    for start, forward_end, stop in bounds:
        record = {}
        for name, scale in (("all", {}), ("tokens", {"const": 0.0})):
            value, at = live.peak(scale, exclude=grads, start=start, stop=stop)
            everything, bwd = live.live(at, grads), live.live(at, grads, born_after=forward_end)
            record[name] = dict(peak=value, bwd=bwd, fwd={k: v - bwd.get(k, 0) for k, v in everything.items()})
        if scale_to:
            record["tokens scaled"] = live.peak(dict(L=scale_to[0] / L, N=scale_to[1] / N, const=0.0), exclude=grads,
                                                start=start, stop=stop)[0]
        out["passes"].append(record)
    return out


def measure_sampling(model, length: tuple, G: int, top_p: float = 0.75) -> dict:
    """grpo.py's fast decode loop (helpers/fast_decode.decode with the fixed-shape cache a GPU uses) on hand-made inputs (G copies of one
    prompt) under autocast(bf16), arithmetic skipped: the KV cache's bytes per position, layer and sequence (its
    (G, kv_heads, P + N, head_dim) storages) and the loop's peak beside the cache (its token, log-prob and support
    buffers, one step's logits, draws and top-p sort)."""
    import grpo
    from helpers import fast_decode
    inputs, _ = ar_inputs(model, *length, G=G)
    ids = inputs["input_ids"]
    P, (_, large_h, large_w), (_, prev_h, prev_w) = ids.shape[1], *inputs["image_grid_thw"][:2].tolist()
    N = large_h * large_w + prev_h * prev_w
    positions = grpo.rope_positions(ids[0], inputs["image_grid_thw"][:2], N + 1, model.config.image_start_token_id,
                                    model.config.image_end_token_id).expand(-1, G, -1)
    live = LiveStorages(dict(L=P + N), [*model.parameters(), *model.buffers(), *inputs.values(), positions])
    model.eval()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16), live:
        fast_decode.decode(model, ids, torch.ones_like(ids, dtype=torch.bool), positions, N, 0.9, 0, top_p,
                           [torch.Generator().manual_seed(0)], grpo.code_logprobs, static=True)
    kv_heads = model.config.text_config.num_key_value_heads
    cache = [e for e in live.entries  # keys and values (G, kv_heads, P + N, d), alive to the end (not per-step casts)
             if len(e[5]) == 4 and e[5][1:3] == (kv_heads, P + N) and e[1] is None]
    layers = model.config.text_config.num_hidden_layers
    kv = sum(e[2] for e in cache)
    return dict(L=P + N, N=N, G=G, kv_per_position_layer=kv / (G * (P + N) * layers), post_peak=live.peak()[0] - kv)


def check_skip_arithmetic(modes=ACT_MODES) -> int:
    """measure_step with and without skip_arithmetic on a narrow copy of the AR (2 layers, both checkpointing settings,
    2 passes): every number must be equal. Returns the number of runs compared."""
    compared = 0
    for mode in modes:
        model = measured_ar(narrow_ar_config(), 2, mode)
        for ckpt in (False, True):
            if ckpt:
                model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
            runs = [measure_step(model, (21, (4, 4), (3, 3)), passes=2, skip_arithmetic=skip) for skip in (False, True)]
            assert runs[0] == runs[1], f"skip_arithmetic changes the bytes ({mode}, checkpointing {ckpt})"
            compared += 1
    return compared


def narrow_check() -> dict:
    """Seconds: saved activations per token per layer on a narrow copy of the AR (h=512, i=1712; 1 vs 2 layers, forward
    only, real arithmetic, saved-tensor hooks), next to act_bytes_per_token_layer for the same shapes.
    Returns {mode: (measured, formula)}."""
    narrow, length = narrow_ar_config(), (15, (3, 5), (2, 4))  # L = 37, N = 23
    result = {}
    for mode in ACT_MODES:
        saved = [measure_step(measured_ar(narrow, layers, mode), length, backward=False, skip_arithmetic=False)["saved"]
                 for layers in (1, 2)]
        L = length[0] + 23 - 1
        result[mode] = ((saved[1]["L"] - saved[0]["L"]) / L, act_bytes_per_token_layer(mode, shapes(narrow)))
    return result


def measure(log=print) -> dict:
    """Everything MEASURED holds, at the published widths (4-10 minutes on 2 CPU cores, ~8 GB of memory)."""
    started = time.time()
    runs = {}
    for mode in ACT_MODES:
        for layers in (0, 1, 2):
            model = measured_ar(AR_CONFIG, layers, mode)
            for ckpt in ((False,) if layers == 0 else (False, True)):
                if ckpt:
                    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
                for name, length in LENGTHS.items():
                    if layers == 0 and name != "plan":
                        continue
                    runs[mode, layers, ckpt, name] = measure_step(
                        model, length, passes=2 if (layers == 2 and name == "plan") else 1,
                        scale_to=(1379, 1280) if name == "short" else None)
            del model
            gc.collect()
            log(f"  {mode}, {layers} decoder layers: done at {time.time() - started:.0f} s")
    sampling = {}
    for mode in ("full_bf16", "full_fp32"):
        sampling[mode] = measure_sampling(measured_ar(AR_CONFIG, 2, mode), LENGTHS["plan"], G=4)
        gc.collect()
        log(f"  sampling, {mode}: done at {time.time() - started:.0f} s")
    log(f"  skip_arithmetic = real arithmetic on the narrow copy: {check_skip_arithmetic()} runs compared")

    def per_layer(mode, ckpt, name, what="kept"):
        one, two = runs[mode, 1, ckpt, name][what]["L"], runs[mode, 2, ckpt, name][what]["L"]
        return (two - one) / runs[mode, 1, ckpt, name]["L"]

    m = dict(when=time.strftime("%Y-%m-%d"), seconds=round(time.time() - started),
             machine=f"{os.cpu_count()}-core CPU, torch {torch.__version__}, transformers "
                     f"{__import__('transformers').__version__}, peft {__import__('peft').__version__}")
    for mode in ACT_MODES:
        few = runs[mode, 2, True, "few codes"]["passes"][0]["tokens"]
        step = {ckpt: [p["all"]["peak"] for p in runs[mode, 2, ckpt, "plan"]["passes"]] for ckpt in (False, True)}
        m[mode] = dict(
            act=per_layer(mode, False, "plan"), act_hooks=per_layer(mode, False, "plan", "saved"),
            act_short=per_layer(mode, False, "short"), ckpt=per_layer(mode, True, "plan"),
            ckpt_short=per_layer(mode, True, "short"),
            workspace=few["bwd"].get("L", 0) / runs[mode, 2, True, "few codes"]["L"] - per_layer(mode, False, "plan"),
            autocast_layer=(runs[mode, 2, False, "plan"]["kept"].get("const", 0)
                            - runs[mode, 1, False, "plan"]["kept"].get("const", 0)),
            logits=runs[mode, 0, False, "plan"]["passes"][0]["tokens"]["peak"],
            step_first=step[False][0], step_later=step[False][1], step_ckpt_first=step[True][0],
            step_ckpt_later=step[True][1],
            step_scaled=runs[mode, 2, False, "short"]["passes"][0]["tokens scaled"],
            step_tokens=runs[mode, 2, False, "plan"]["passes"][0]["tokens"]["peak"])
    for mode, r in sampling.items():
        m[mode].update(kv=r["kv_per_position_layer"], sampler_post=r["post_peak"])
    return m


# ---- 5. Output: one function per section of the markdown ---------------------------------------------------------

def fmt_b(n: float) -> str:
    return f"{n / 1e9:.3f}B"


def table(header: list[str], align: list[str], rows: list[list]) -> str:
    return "\n".join(["| " + " | ".join(header) + " |", "|" + "|".join(align) + "|"]
                     + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows])


def section_title(H: int, W: int, G: int) -> list[str]:
    return [f"## Memory plan ({H}x{W}, G={G}, one 80 GB GPU)",
            "An ESTIMATE from the published configs and simple formulas (`python tools/memory_plan.py`): the AR's terms "
            "and the DiT's saved activations measured on the CPU at the real widths, the decoding term calibrated on "
            "one H100, where every measured phase came within 4% of the plan (Measured on a GPU, below). Sizes in GiB "
            "(2^30 bytes)."]


def section_parameters(counts: dict) -> list[str]:
    rows = [[k, fmt_b(v), f"{v * 2 / GiB:.2f}"] for k, v in counts.items()]
    for r in (16, 64):
        n, n_peft = lora_params(r), lora_params_peft(r)
        check = "peft not installed" if n_peft is None else ("= peft" if n_peft == n else f"peft says {n_peft}")
        rows.append([f"LoRA r={r} on {', '.join(LORA_TARGETS)}", f"{n / 1e6:.1f}M ({check})", f"{n * 2 / GiB:.2f}"])
    diffs = library_default_diffs()
    return ["### Parameters (each component built on the meta device from its published config)",
            table(["component", "parameters", "bf16 GiB"], ["---", "---:", "---:"], rows),
            "The published AR config equals the transformers 5.23 defaults in every size; "
            + ("nothing differs." if not diffs else "it differs in " + "; ".join(diffs) + " (no effect on sizes).")]


def section_peaks(rows: list[dict], c: dict, args) -> list[str]:
    G, mb = args.group_size, args.micro_batch
    dit_act, vae_act = dit_activation_bytes(G, args.height, args.width, args.glyph_tokens), vae_decode_bytes(
        G, args.height, args.width)
    lines = []
    for r in rows:
        (pr, phr, _), (po, pho, _) = r["peaks"][False], r["peaks"][True]
        ref = f" (ref {r['reference'] / GiB:.1f})" if r["reference"] else ""
        lines.append([r["name"], "yes" if r["ckpt"] else "no", f"{r['trainable'] / 1e9:.3f}B",
                      f"{r['ar_state'] / GiB:.1f}{ref}", f"{r['train'] / GiB:.1f}", f"{pr / GiB:.1f} ({phr})",
                      f"{po / GiB:.1f} ({pho})", f"{verdict(pr)} / {verdict(po)}"])
    kv = " / ".join(f"{kv_cache_bytes(G, c['L'], m) / GiB:.2f}" for m in ("lora", "full_fp32"))
    return [f"### Peak GPU memory of one GRPO step (GiB): N = {c['N']} generated tokens, L = {c['L']}, "
            f"backward micro-batch {mb}",
            table(["setting", "grad ckpt", "trainable", "AR weights + optimizer + grads (+ ref)",
                   "training extra: activations + logits (+ autocast copies)", "peak, all resident",
                   "peak, DiT/VAE/T5 offloaded", "fits 80 GB (resident / offloaded)"],
                  ["---", "---", "---:", "---:", "---:", "---:", "---:", "---"], lines),
            f"Phase terms: DiT + VAE + T5 weights {c['decoder_weights'] / GiB:.1f}; sampling (KV cache {kv} with "
            f"bf16 / fp32 weights + the decode loop's buffers {sampler_bytes(G, c['N']) / GiB:.2f}); decoding max(DiT "
            f"{dit_act / GiB:.1f}, VAE decode of {G} images {vae_act / GiB:.1f}); AR activations per token per layer: "
            + ", ".join(f"{m} {act_bytes_per_token_layer(m) / 1024:.0f} KiB" for m in ACT_MODES) + "."]


def section_assumptions() -> list[str]:
    s = shapes()
    bullets = [
        "bf16 frozen weights (AR, DiT, VAE, T5). Full fine-tuning trains what grpo.py trains: the AR language model "
        "with its token embedding, and lm_head (vision tower and VQ frozen).",
        "fp32 master: fp32 weights + fp32 grads + AdamW m, v = 16 B/param, plus the bf16 copies autocast caches while "
        f"sampling and training (2 B per cast param: the {cast_params() / 1e9:.2f}B linear weights of the layers and "
        "lm_head, not the embedding). bf16 + fp32 AdamW: 2 + 2 + 8 = 12 B/param (torch's AdamW on bf16 weights would "
        "keep bf16 moments: 8 B/param, and updates round away). (extra) 8-bit AdamW: 2 + 2 + 2 B/param, KL beta 0, no "
        "reference; not what grpo.py does.",
        "LoRA adapters in fp32 (peft default): 16 B/param. Reference: the base model with the adapter disabled (no "
        "copy) for LoRA; a bf16 copy of the AR for full fine-tuning with KL beta > 0 (grpo.py's real default 0.04).",
        "Gradients stay allocated from one optimizer step to the next zero_grad (as grpo.py is written), so they "
        "count in every phase; optimizer states too.",
        "AR activations, run as grpo.py runs it (autocast bf16, SDPA flash/efficient attention without a mask, so "
        "no L x L matrix and k/v stay GQA-sized), per layer and token: about 42.3 h + 8 i bytes (full FT, fp32 "
        "weights: fp32 residual stream), 34.3 h + 8 i (full FT, bf16 weights), 30.3 h + 8 i (LoRA); the terms are in "
        "act_bytes_per_token_layer and match saved-tensor hooks on a narrow copy and at the real widths (Measured). "
        "Checkpointing keeps each layer's input (L x h x 2 bytes, x 4 with an fp32 residual stream). The training "
        "extra is the largest of three moments (train_bytes): the start of the backward (everything kept + the "
        "logits' backward), inside one layer (with checkpointing the inputs + the recomputed layer; + a layer's "
        "workspace of 18h-20h bytes per token, 4i + 15h with LoRA, or with full FT down_proj's weight gradient), and "
        "the end of a later micro-batch's backward (full FT with fp32 weights: the bf16 gradients of all autocast "
        "copies, 2 B/param, alive together).",
        f"Logits only for the last N positions (logits_to_keep): kept are the final norm's fp32 input (and with full "
        f"FT its output), log_softmax's fp32 output over the {s['K']} codebook ids (N x {s['K']} x 4), and in the "
        f"backward two more such tensors; the N x {s['V']} bf16 logits are freed after the forward.",
        "Sampling (fast_decode.decode): a KV cache of G x (P + N) slots x layers x kv_heads x head_dim, keys and values in "
        "bf16 (keys fp32 with fp32 weights), the prefill's transients, the token / log-prob / support buffers and "
        "one step's fp32 work over the vocabulary; no step's logits are kept.",
        "Decoding (no grad, sequential phases): DiT ~12 hidden-widths per token inside a block, batch G, CFG passes "
        "one after the other; VAE decode of the G images in one call: ~3 maps of the largest level (512 channels at "
        "full resolution) alive at once.",
        "Peak = max over sampling, decoding and the backward. 'Offloaded' = DiT/VAE/T5 in CPU memory except while "
        "decoding. 'yes' = at most 72 GiB (10% left for the CUDA context, fragmentation and kernel workspaces, not "
        "modelled), 'tight' = 72-80 GiB, 'no' = above 80 GiB.",
    ]
    return ["### Assumptions", "\n".join(f"- {b}" for b in bullets)]


def measured_rows(m: dict) -> list[list[str]]:
    """The measured-vs-formula table: [term, formula, measured, ratio], the three training modes in one cell."""
    s = shapes()
    L, N, G = 1379, 1280, 4

    def row(term: str, unit: str, pairs: list):  # pairs: (formula, measured) per mode, None where not measured
        def cell(v):
            return "-" if v is None else (f"{v:,.0f}" if unit == "B" else f"{v / 2**20:,.1f}")
        return [f"{term} ({unit})", " / ".join(cell(f) for f, _ in pairs), " / ".join(cell(x) for _, x in pairs),
                " / ".join("-" if f is None or x is None or f == 0 else f"{x / f:.3f}" for f, x in pairs)]

    def step(mode, ckpt, accumulating):
        copies = {"full_fp32": 2 * cast_params(2), "full_bf16": 0, "lora": 2 * lora_params(16) * 2 // s["layers"]}
        return (train_bytes(mode, ckpt, L, N, 1, layers=2, accumulating=accumulating, embedding_trains=False)["peak"]
                + copies[mode])

    per_layer_copies = {"full_fp32": 2 * cast_params_per_layer(s), "full_bf16": 0,
                        "lora": 2 * lora_params(16) // s["layers"]}
    modes = ACT_MODES
    rows = [
        row("kept per decoder layer and token, no checkpointing", "B",
            [(act_bytes_per_token_layer(md), m[md]["act"]) for md in modes]),
        row("kept per decoder layer and token, checkpointing: the layer's input", "B",
            [(s["h"] * residual_bytes(md), m[md]["ckpt"]) for md in modes]),
        row("a layer's workspace per token beside its saved tensors (recomputed layer, few codes)", "B",
            [(layer_workspace_per_token(md), m[md]["workspace"]) for md in modes]),
        row("autocast's bf16 weight copies per decoder layer", "MiB",
            [(per_layer_copies[md], m[md]["autocast_layer"]) for md in modes]),
        row("outside the layers (final norm, lm_head, log-softmax): kept + backward, N = 1280, L = 1379", "MiB",
            [(sum(logits_bytes(md, L, N).values()), m[md]["logits"]) for md in modes]),
    ]
    for ckpt in (False, True):
        for later in (False, True):
            key = f"step_{'ckpt_' if ckpt else ''}{'later' if later else 'first'}"
            rows.append(row(f"2-layer step peak beside weights and .grad, {'with' if ckpt else 'no'} checkpointing, "
                            f"{'a later' if later else 'first'} micro-batch", "MiB",
                            [(step(md, ckpt, later), m[md][key]) for md in modes]))
    rows.append(row("KV cache per position, layer and sequence (LoRA samples as full_bf16)", "B",
                    [(kv_cache_bytes(1, 1, md, layers=1), m.get(md, {}).get("kv")) for md in modes[:2]]
                    + [(None, None)]))
    rows.append(row(f"the decode loop's peak beside its KV cache at G = {G}, N = {N}, top-p", "MiB",
                    [(sampler_bytes(G, N), m.get(md, {}).get("sampler_post")) for md in modes[:2]]
                    + [(None, None)]))
    return rows


def section_measured(m: dict, fresh: bool) -> list[str]:
    when = f"{'this run' if fresh else 'last run'}: {m['when']}, {m['machine']}, {m['seconds']} s"
    lin = ", ".join(f"{md} {m[md]['act_short']:.0f} / {m[md]['ckpt_short']:.0f}" for md in ACT_MODES)
    hooks = ", ".join(f"{md} {m[md]['act_hooks']:.0f}" for md in ACT_MODES)
    scaled = ", ".join(f"{md} {m[md]['step_scaled'] / 2**20:.1f} vs {m[md]['step_tokens'] / 2**20:.1f}"
                       for md in ACT_MODES)
    return [
        "### Measured at the real widths vs the formulas",
        f"`python tools/memory_plan.py --measure` ({when}) runs the AR at its published widths (h 4096, i 13696, 32 heads, "
        "2 KV heads, vocabularies 168064 / 16512) with 0, 1 and 2 decoder layers on the CPU, set up per mode as "
        "grpo.py sets it up (bf16; `policy.float()`; `apply_lora` r=16; vision tower and VQ frozen, and here the token "
        "embedding too), and runs grpo.py's own `token_logprobs`, a loss and its backward inside one autocast(bf16), "
        "for one or two micro-batches of one sequence (P = 100 prompt tokens, N = 1280 codes, L = 1379). Two "
        "recorders: saved-tensor hooks (distinct storages autograd saves, weights excluded) and a TorchDispatchMode "
        "that records every storage an op creates and when it is freed, i.e. what a GPU allocator would report as "
        "allocated, less kernel-internal workspaces (`LiveStorages`); parameter gradients are left out (a persistent "
        "term). Matrix products and the attention kernel return zeros of their exact shapes instead of computing "
        "(byte-identical to real arithmetic on a narrow copy, checked by `--measure`). Per-layer terms are 2 layers "
        "minus 1 layer; what lies outside the layers is the 0-layer model. KV cache and the decode loop: `fast_decode.decode` "
        "with the fixed-shape cache a GPU uses (G = 4, N = 1280, top-p 0.75; measured 2026-11-24). Cells: "
        "full_fp32 / full_bf16 / lora.",
        table(["term", "formula", "measured", "measured / formula"], ["---", "---:", "---:", "---:"],
              measured_rows(m)),
        f"Linear in L: per layer and token at L = 611 (no checkpointing / checkpointing): {lin} B, the same as at "
        f"L = 1379; the 2-layer peak (no checkpointing, first micro-batch, activations and logits) measured at "
        f"L = 611, N = 512 and scaled to 1379 / 1280 vs measured there: {scaled} MiB. Saved-tensor hooks give the "
        f"same bytes per layer and token as the live storages without checkpointing ({hooks}). The 2-layer rows run "
        "with the token embedding frozen (and so does their formula): with full FT the real layer 0 keeps "
        "L x (4h + 4) more (22 MB), as the 40-layer plan assumes. A later micro-batch of full FT with fp32 weights "
        "peaks higher than the first (train_bytes' moment C: the bf16 gradients of autocast's cached copies wait for "
        "the first micro-batch's ToCopyBackward nodes, which the engine runs last); measured once at 2 layers, "
        "torch.autocast(..., cache_enabled=False) around the update brings that micro-batch from 2072 to 1951 MiB "
        "(first: 1923 both).",
        "Measured here (CPU, real widths): the AR's activations per layer with and without checkpointing, a layer's "
        "workspace, autocast's weight copies, the logits and log-softmax tensors, the gradient transients of a later "
        "micro-batch, the KV cache and the decode loop's buffers. Still estimates: the DiT and VAE activations (the "
        "decoding phase, which sets the peak for LoRA with checkpointing), the CUDA context, allocator rounding and "
        "fragmentation, cuBLAS / cuDNN / flash-attention workspaces, the choice of attention kernel on the GPU (the "
        "CPU flash kernel keeps q, k, v, out and the log-sum-exp, as CUDA's flash kernel does), the embedding's "
        "gradient transient in a later micro-batch (frozen here; by shape), micro-batches of more than one sequence "
        "(measured with one; the formulas scale linearly), and the weights, gradients and optimizer states (counted "
        "from the parameters, not measured).",
    ]


def section_checks(counts: dict, args) -> list[str]:
    G = args.group_size
    checks = inference_check(counts, 1024, 1024, args.glyph_tokens)
    measured_slope = (PUBLISHED_INFERENCE_PEAK_GB[4] - PUBLISHED_INFERENCE_PEAK_GB[1]) / 3 * 1e9
    est_slope = vae_decode_bytes(1, 1024, 1024)
    with contextlib.redirect_stderr(io.StringIO()):
        traced = narrow_check()
    bullets = [
        "Parameter counts reproduce the checkpoint sizes a third-party loader lists: AR 18.8 GiB bf16 (only with the "
        "vision tower, so the checkpoint holds it), DiT 12.9 GiB bf16, glyph encoder 0.81 GiB fp32 (830 MB).",
        "Plain inference with the same formulas vs the upstream README (one H100, diffusers, 1024x1024): "
        + "; ".join(checks) + f". The growth per extra image there ({measured_slope / GiB:.2f} GiB) and the VAE term "
        f"here ({est_slope / GiB:.2f} GiB per image, calibrated on our own H100 run: Measured on a GPU) agree within "
        f"{abs(measured_slope - est_slope) / measured_slope:.0%}.",
        "Saved activations per token per layer on a narrow copy of the AR (h=512, i=1712, 1 vs 2 layers, "
        "saved-tensor hooks, autocast bf16): " + ", ".join(
            f"{md} measured {meas:.0f} B vs formula {form:.0f} B" for md, (meas, form) in traced.items()) + ".",
    ]
    return ["### Checks", "\n".join(f"- {b}" for b in bullets)]


def section_verdict(counts: dict, rows: list[dict], c: dict, args) -> list[str]:
    G, H, W = args.group_size, args.height, args.width
    vae_act = vae_decode_bytes(G, H, W)
    fits = [f"{r['name']}{' + ckpt' if r['ckpt'] else ''}" for r in rows if verdict(r["peaks"][False][0]) == "yes"]
    lora = [r for r in rows if r["mode"] == "lora"]
    full = [r for r in rows if r["full"] and not r["name"].startswith("(extra)")]
    extra = [r for r in rows if r["name"].startswith("(extra)")]
    frozen_gib = (counts["AR total"] - counts["AR trainable (full FT, as grpo.py)"]) * 2 / GiB
    lo = min(r["peaks"][False][0] for r in lora) / GiB
    hi = max(r["peaks"][False][0] for r in lora) / GiB
    bullets = [
        f"Fits with all components resident: {', '.join(fits) if fits else 'nothing'}. LoRA peaks at "
        f"{lo:.0f}-{hi:.0f} GiB; with checkpointing the decoding phase ({vae_act / GiB:.0f} GiB of VAE activations for "
        f"{G} images) sets the peak.",
        f"Full fine-tuning does not fit on one 80 GB GPU: AR weights + optimizer + grads alone are "
        f"{min(r['ar_state'] - r['reference'] for r in full) / GiB:.0f}-"
        f"{max(r['ar_state'] - r['reference'] for r in full) / GiB:.0f} GiB, before the "
        f"{full[0]['reference'] / GiB:.1f} GiB reference copy that KL beta > 0 needs. Even the (extra) 8-bit AdamW, "
        f"beta 0 variant peaks at {min(r['peaks'][True][0] for r in extra) / GiB:.0f}-"
        f"{max(r['peaks'][False][0] for r in extra) / GiB:.0f} GiB. Full FT needs sharding over several GPUs "
        "(FSDP2: see Many GPUs) or CPU-offloaded optimizer states. grpo.py as written is heavier still: "
        f"policy.float() also makes the frozen vision tower + VQ fp32 (+{frozen_gib:.1f} GiB).",
    ]
    changed = [f"{r['name']}{' + ckpt' if r['ckpt'] else ''}" for r in rows
               if verdict(r["peaks"][False][0]) != verdict(r["peaks"][True][0])]
    bullets.append("Offloading DiT/VAE/T5 during the AR phases " + (
        "does not change any verdict in the table: it lowers only the sampling and training phases (by "
        f"{c['decoder_weights'] / GiB:.0f} GiB), and the decoding phase, which needs them on the GPU, then sets the "
        "peak." if not changed else f"(-{c['decoder_weights'] / GiB:.0f} GiB outside decoding) changes the verdict "
        "for: " + ", ".join(changed) + "."))
    mb_peaks = {(m, ck): plan_row_peak(counts, args, m, ck, False)[0] for m in (1, 2, 4) for ck in (False, True)}
    bullets.append(
        "The micro-batch matters more than the rank: LoRA r=16, all resident, micro-batch 1 / 2 / 4: "
        + ", ".join(f"checkpointing {'on' if ck else 'off'} " + " / ".join(
            f"{mb_peaks[(m, ck)] / GiB:.0f}" for m in (1, 2, 4)) for ck in (False, True))
        + f" GiB. Micro-batches of 4 (the tiny model's default) need checkpointing here (without it: "
        f"~{mb_peaks[(4, False)] / GiB:.0f} GiB, {verdict(mb_peaks[(4, False)])}).")
    measured_slope = (PUBLISHED_INFERENCE_PEAK_GB[4] - PUBLISHED_INFERENCE_PEAK_GB[1]) / 3 * 1e9
    est_slope = vae_decode_bytes(1, 1024, 1024)
    margin = max(0.0, (measured_slope - est_slope) * G) if (H, W) == (1024, 1024) else 0.0  # calibrated at 1024
    with_margin = [max(max(ph.values()), ph["decode"] + margin) for r in lora for _, _, ph in [r["peaks"][False]]
                   if verdict(r["peaks"][False][0]) == "yes"]
    if with_margin and margin:
        bullets.append(f"Margin: the decoding term may be ~{margin / GiB:.0f} GiB low (see Checks); the LoRA settings "
                       f"that fit stay at or below {max(with_margin) / GiB:.0f} GiB even then.")
    bullets.append(
        f"Cheap savings: decode the G images one at a time (vae.enable_slicing(): ~{vae_act * (G - 1) / G / GiB:.0f} "
        "GiB less in the decoding phase); free gradients right after optimizer.step(); drop or offload the unused "
        f"vision tower + VQ ({(counts['AR vision tower'] + counts['AR VQ']) * 2 / GiB:.1f} GiB); keep SDPA "
        f"flash/efficient attention (eager attention would keep the {shapes()['heads']} x L x L probabilities, fp32 + "
        f"bf16: ~{shapes()['heads'] * c['L'] ** 2 * 6 / GiB:.2f} GiB per layer per sequence).")
    return ["### Verdict", "\n".join(f"- {b}" for b in bullets)]


def section_fsdp(counts: dict, args) -> list[str]:
    G, H, W = args.group_size, args.height, args.width
    rows = [r for world in (4, 8) for r in fsdp_rows(counts, world, G, args.prompt_tokens, H, W, args.micro_batch,
                                                     args.glyph_tokens)]
    body = table(["setting", "GPUs", "grad ckpt", "shards per GPU", "sample", "train", "decode", "peak per GPU",
                  "fits 80 GB"], ["---", "---:", "---", "---:", "---:", "---:", "---:", "---:", "---"],
                 [[r["name"], r["world"], "yes" if r["ckpt"] else "no", f"{r['shards'] / GiB:.1f}",
                   *(f"{r['phases'][p] / GiB:.1f}" for p in ("sample", "train", "decode")),
                   f"{r['peak'] / GiB:.1f} ({r['phase']})", verdict(r["peak"])] for r in rows])
    full = [r for r in rows if not r["name"].startswith("LoRA")]
    fits = sorted({r["world"] for r in full if verdict(r["peak"]) == "yes"})
    text = (f"`torchrun --nproc-per-node N grpo.py`, G={G} samples per GPU, micro-batch {args.micro_batch}, bf16 "
            "(FSDP2 mixed precision: bf16 gathers, fp32 gradient reduction). The same formulas as above, per GPU; the "
            "sharding terms are arithmetic, not measured (no GPU here). Full fine-tuning "
            + (f"fits on {' and '.join(map(str, fits))} x 80 GB" if fits else "does not fit on 4 or 8 x 80 GB")
            + "; LoRA fits everywhere (it fits on one GPU already). What remains per GPU is the replicated DiT + VAE + "
            f"T5 ({(counts['DiT'] + counts['VAE'] + counts['T5 glyph encoder']) * 2 / GiB:.1f} GiB), the bf16 AR "
            "gathered for sampling, and the decoding activations; the shards shrink with N.")
    return ["### Many GPUs (FSDP2)", text, body]


# ---- --train dit: GRPO on the DiT (dit_grpo.py) -----------------------------------------------------

DIT_KEPT_FORMULA = 34  # x hidden bytes: a transformer block's saved tensors per token in bf16 (Korthikanti et al. 2022,
#                        "34 s b h"); MEASURED_DIT["kept"] replaces it (42.4: LoRA's adapters keep their own inputs)


def dit_lora_params(r: int, config: dict | None = None) -> int:
    """Adapter parameters of dit_grpo.apply_lora at rank r on the published DiT: r (in + out) per Linear its
    LORA_TARGETS pattern matches (attn1 q/k/v/out and the MLP of every block; peft matches the full name)."""
    import re
    from diffusers import GlmImageTransformer2DModel
    from dit_grpo import LORA_TARGETS
    with torch.device("meta"):
        dit = GlmImageTransformer2DModel(**(config or DIT_CONFIG))
    return sum(r * (m.in_features + m.out_features) for name, m in dit.named_modules()
               if isinstance(m, torch.nn.Linear) and re.fullmatch(LORA_TARGETS, name))


def dit_train_activation_bytes(micro_batch: int, calls: int, height: int, width: int, glyph_tokens: int,
                               checkpointing: bool) -> float:
    """What one backward piece of dit_trainer.train_step keeps: `micro_batch` samples x ONE denoising step (it
    back-propagates step by step) x `calls` DiT calls (2 with classifier-free guidance). Without checkpointing every
    block's saved tensors; with it, what checkpointing keeps of each block (its inputs) plus one block recomputed.
    Both per token from MEASURED_DIT."""
    p, vae_scale = DIT_CONFIG["patch_size"], 2 ** (len(VAE_CONFIG["block_out_channels"]) - 1)
    tokens = (height // vae_scale // p) * (width // vae_scale // p) + glyph_tokens
    hidden = DIT_CONFIG["num_attention_heads"] * DIT_CONFIG["attention_head_dim"]
    block = tokens * MEASURED_DIT["kept"] * hidden
    layers = DIT_CONFIG["num_layers"]
    kept = layers * tokens * hidden * MEASURED_DIT["ckpt"] + block if checkpointing else layers * block
    return micro_batch * calls * kept


def dit_rows(counts: dict, G: int, height: int, width: int, micro_batch: int, glyph_tokens: int,
             worlds=(1, 4, 8)) -> list[dict]:
    """Per-GPU peaks of `dit_grpo.py` on the real DiT: G chains per prompt at guidance 1.5 (2 DiT calls a
    step). The AR (frozen, one sample per prompt), VAE and T5 are replicated in bf16; the DiT's trainable state is
    sharded over the GPUs by FSDP2 (parallel.shard: one unit per transformer block). Full FT: fp32 weights, grads and
    AdamW (16 B/param) + a bf16 KL reference (2 B/param); LoRA: the bf16 DiT + fp32 adapters, grads and AdamW.
    Phases: sample (the AR, G = 1: its KV cache is small), decode (the DiT gathered in bf16 for the chains, no
    gradient, + their activations or the VAE's), train (one step's graph for a micro-batch, the root and two blocks
    gathered in bf16 under FSDP, the gradients)."""
    N = 256 + (height // 32) * (width // 32)
    frozen = (counts["AR total"] + counts["VAE"] + counts["T5 glyph encoder"]) * 2
    dit = counts["DiT"]
    block = dit / DIT_CONFIG["num_layers"]
    decoding = max(dit_activation_bytes(G, height, width, glyph_tokens), vae_decode_bytes(G, height, width))
    rows = []
    for name, n, full in [("full FT, fp32 master + AdamW, KL reference", dit, True),
                          ("LoRA r=16", dit_lora_params(16), False), ("LoRA r=64", dit_lora_params(64), False)]:
        for world in worlds:
            state = (dit * (16 + 2) if full else dit * 2 + n * 16) / world
            gathered = 0 if world == 1 else dit * 2  # the chains run the DiT unsharded (parallel.unsharded)
            in_flight = 0 if world == 1 else (dit - DIT_CONFIG["num_layers"] * block) * 2 + 2 * block * 2
            for ckpt in (False, True):
                act = dit_train_activation_bytes(micro_batch, 2, height, width, glyph_tokens, ckpt)
                sampling = kv_cache_bytes(1, 100 + N - 1, "lora") + sampler_bytes(1, N)
                phases = {"sample": frozen + state + sampling,
                          "decode": frozen + state + gathered + decoding,
                          "train": frozen + state + in_flight + act + (n * 4 if not full and world > 1 else 0)}
                phase = max(phases, key=phases.get)
                rows.append(dict(name=name, world=world, ckpt=ckpt, trainable=n, state=state, phases=phases,
                                 phase=phase, peak=phases[phase], act=act))
    return rows


def section_dit(counts: dict, args) -> list[str]:
    G, H, W = args.group_size, args.height, args.width
    rows = dit_rows(counts, G, H, W, args.micro_batch, args.glyph_tokens)
    frozen = (counts["AR total"] + counts["VAE"] + counts["T5 glyph encoder"]) * 2
    body = table(["setting", "GPUs", "grad ckpt", "trainable", "DiT state per GPU", "train activations", "sample",
                  "decode", "train", "peak per GPU", "fits 80 GB"],
                 ["---", "---:", "---", "---:", "---:", "---:", "---:", "---:", "---:", "---:", "---"],
                 [[r["name"], r["world"], "yes" if r["ckpt"] else "no", f"{r['trainable'] / 1e9:.3f}B",
                   f"{r['state'] / GiB:.1f}", f"{r['act'] / GiB:.1f}",
                   *(f"{r['phases'][p] / GiB:.1f}" for p in ("sample", "decode", "train")),
                   f"{r['peak'] / GiB:.1f} ({r['phase']})", verdict(r["peak"])] for r in rows])
    text = (f"`dit_grpo.py` on the real DiT ({counts['DiT'] / 1e9:.2f}B), G={G} chains per "
            f"prompt, micro-batch {args.micro_batch}, guidance 1.5 (two DiT calls a step), one denoising step's graph "
            "at a time (train_step back-propagates step by step, so the window and --sde-steps change time, not "
            f"memory). The DiT's kept activations per token and block are measured at its widths on the CPU "
            f"(MEASURED_DIT, {MEASURED_DIT['when']}: {MEASURED_DIT['kept']} hidden-widths, {MEASURED_DIT['ckpt']} with "
            "checkpointing), the decoding term calibrated on a GPU (see Measured on a GPU); the AR, VAE and T5 stay "
            f"resident and replicated ({frozen / GiB:.1f} GiB). grpo.py turns checkpointing on by default for --train "
            "dit on the real model: without it the update does not fit one GPU.")
    return ["### GRPO on the DiT (--train dit)", text, body]


def decode_resident(counts: dict) -> float:
    """Bytes on the GPU while the LoRA r=16 run of GPU_MEASURED decodes, besides the activations: the bf16 AR, DiT,
    VAE and T5, and the adapters' fp32 weights, gradients and AdamW moments."""
    return (counts["AR total"] + counts["DiT"] + counts["VAE"] + counts["T5 glyph encoder"]) * 2 + lora_params(16) * 16


def calibrate(counts: dict) -> None:
    """VAE_MAPS from the decoding peak GPU_MEASURED holds (G = 4 at 1024x1024): the maps of the VAE's largest level
    that its activations above the weights amount to."""
    global VAE_MAPS
    above = GPU_MEASURED["lora"]["decode"] * GiB - decode_resident(counts)
    VAE_MAPS = above / vae_decode_bytes(4, 1024, 1024, maps=1)


def measure_dit(log=print) -> dict:
    """MEASURED_DIT: one transformer block of the DiT at its published widths (random bf16 weights, LoRA r = 16 as
    dit_grpo.apply_lora), dit_grpo.velocity with guidance 1.5 (two calls) under autocast(bf16) at 256x256 and 512x512,
    without and with gradient checkpointing: the bytes autograd saves (saved-tensor hooks, distinct storages, the
    weights excluded), per token (the slope between the two sizes, so that what does not grow with the tokens drops
    out), per call, in hidden-widths. About a minute on 2 CPU cores."""
    import dit_grpo
    import grpo
    from helpers.offline_model import glm_image, with_depths
    started = time.time()
    torch.set_default_dtype(torch.bfloat16)
    try:
        pipe = grpo.only_ar_trains(glm_image(with_depths(PUBLISHED, ar=1, vision=1, dit=1, t5=1)))
    finally:
        torch.set_default_dtype(torch.float32)
    policy = dit_grpo.apply_lora(pipe.transformer, 16)
    weights = {p.untyped_storage()._cdata for p in pipe.transformer.parameters()}
    hidden = DIT_CONFIG["num_attention_heads"] * DIT_CONFIG["attention_head_dim"]

    def saved(size: int) -> tuple[int, int]:
        seen = {}

        def pack(t):
            if t.untyped_storage()._cdata not in weights:
                seen[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()
            return t

        with torch.no_grad():
            embeds, negative = pipe.encode_prompt("a red circle", do_classifier_free_guidance=True, device="cpu",
                                                  dtype=torch.bfloat16)
        tokens = torch.randint(0, AR_CONFIG["vq_config"]["num_embeddings"], (1, 256 + (size // 32) ** 2))
        cond = dict(embeds=embeds, negative=negative, prior=grpo.prior_ids(tokens, (size // 32, size // 32)),
                    guidance_scale=1.5, height=size, width=size)
        x = torch.randn(1, DIT_CONFIG["in_channels"], size // 8, size // 8)
        with torch.autocast("cpu", dtype=torch.bfloat16), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            dit_grpo.velocity(policy, x, torch.tensor(500.0), cond)
        return sum(seen.values()), (size // 16) ** 2 + embeds.shape[1]

    out = dict(when=time.strftime("%Y-%m-%d"), machine=f"{os.cpu_count()}-core CPU, torch {torch.__version__}, "
               f"diffusers {__import__('diffusers').__version__}, peft {__import__('peft').__version__}")
    for key, ckpt in (("kept", False), ("ckpt", True)):
        if ckpt:
            pipe.transformer.enable_gradient_checkpointing()
        pipe.transformer.train(ckpt)  # diffusers checkpoints in train mode only
        (small, n_small), (large, n_large) = saved(256), saved(512)
        out[key] = round((large - small) / (n_large - n_small) / 2 / hidden, 2)  # 2 calls: guidance
        log(f"  DiT block, checkpointing {ckpt}: {out[key]} hidden-widths per token and call ({time.time() - started:.0f} s)")
    return out


def section_gpu(counts: dict, args) -> list[str]:
    """The plan's phases beside GPU_MEASURED, and the decoding term's calibration."""
    g = GPU_MEASURED
    rows, _ = plan_rows(counts, 4, args.prompt_tokens, 1024, 1024, 1, ranks=(16,), glyph_tokens=args.glyph_tokens)
    lora = {ck: next(r for r in rows if r["name"] == "LoRA r=16" and r["ckpt"] == ck) for ck in (False, True)}
    dit = {ck: next(r for r in dit_rows(counts, 4, 1024, 1024, 1, args.glyph_tokens, worlds=(1,))
                    if r["name"] == "LoRA r=16" and r["ckpt"] == ck) for ck in (False, True)}
    table_rows = []
    for name, planned, measured in [
            ("LoRA r=16, sample (the decode loop)", lora[False]["peaks"][False][2]["sample"], g["lora"]["sample"]),
            ("LoRA r=16, decode (4 images)", lora[False]["peaks"][False][2]["decode"], g["lora"]["decode"]),
            ("LoRA r=16, train", lora[False]["peaks"][False][2]["train"], g["lora"]["train"]),
            ("LoRA r=16 + checkpointing, train", lora[True]["peaks"][False][2]["train"], g["lora_ckpt"]["train"]),
            ("LoRA r=16 + --offload, sample", lora[False]["peaks"][True][2]["sample"], g["lora_offload"]["sample"]),
            ("LoRA r=16 + --offload, train", lora[False]["peaks"][True][2]["train"], g["lora_offload"]["train"]),
            ("--train dit, LoRA r=16, sample (one AR sample a prompt)", dit[True]["phases"]["sample"],
             g["dit_lora"]["sample"]),
            ("--train dit, LoRA r=16, decode (4 SDE chains)", dit[True]["phases"]["decode"], g["dit_lora"]["decode"]),
            ("--train dit, LoRA r=16, train", dit[False]["phases"]["train"], g["dit_lora"].get("train")),
            ("--train dit, LoRA r=16 + checkpointing, train", dit[True]["phases"]["train"],
             g["dit_lora"].get("train_ckpt"))]:
        measured_text = (f"{measured:.1f}" if measured else f"out of memory above {g['dit_lora']['train_oom_above']}"
                         if "dit" in name and "checkpointing" not in name else "not measured")
        ratio = f"{measured * GiB / planned:.2f}" if measured else "-"
        table_rows.append([name, f"{planned / GiB:.1f}", measured_text, ratio])
    above = g["lora"]["decode"] * GiB - decode_resident(counts)
    text = (f"Measured on {g['machine']} ({g['when']}): torch.cuda.max_memory_allocated per phase of grpo.main (reset "
            "per phase; tools/bench_gpu.py), GLM-Image at its full depth with random bf16 weights (`--model random`), "
            "the real defaults (1024x1024, G = 4, micro-batch 1, guidance 1.5). The decoding term is calibrated on it: "
            f"{above / GiB:.1f} GiB above the weights where the formula's {VAE_MAPS_FORMULA} maps of the VAE's largest "
            f"level give {vae_decode_bytes(4, 1024, 1024, VAE_MAPS_FORMULA) / GiB:.1f} (ratio "
            f"{VAE_MAPS / VAE_MAPS_FORMULA:.2f}; the upstream README's growth per image, "
            f"{(PUBLISHED_INFERENCE_PEAK_GB[4] - PUBLISHED_INFERENCE_PEAK_GB[1]) / 3 * 1e9 / GiB:.2f} GiB, agrees with "
            f"{above / 4 / GiB:.2f}): every plan above uses {VAE_MAPS:.2f} maps. The DiT's update uses MEASURED_DIT "
            f"({MEASURED_DIT['kept']} hidden-widths per token, block and call kept; {MEASURED_DIT['ckpt']} with "
            f"checkpointing; the formula's {DIT_KEPT_FORMULA} was {MEASURED_DIT['kept'] / DIT_KEPT_FORMULA:.2f}x low).")
    return ["### Measured on a GPU vs the plan", text,
            table(["phase", "plan (GiB)", "measured (GiB)", "measured / plan"], ["---", "---:", "---:", "---:"],
                  table_rows)]


# ---- Beside the plan: learned rewards on the GPU, --save-merged's copy on the host ----------------------

REWARD_CONFIGS = {  # the published checkpoints' shapes (their config.json), built on the meta device to count
    "clip / aesthetic: CLIP ViT-L/14 (openai/clip-vit-large-patch14)": ("CLIPModel", dict(
        text_config=dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072,
                         projection_dim=768),
        vision_config=dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096,
                           patch_size=14, image_size=224, projection_dim=768), projection_dim=768)),
    "pickscore: CLIP ViT-H/14 (yuvalkirstain/PickScore_v1)": ("CLIPModel", dict(
        text_config=dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096,
                         projection_dim=1024),
        vision_config=dict(hidden_size=1280, num_hidden_layers=32, num_attention_heads=16, intermediate_size=5120,
                           patch_size=14, image_size=224, projection_dim=1024), projection_dim=1024)),
    "dino: DINOv2-base (facebook/dinov2-base)": ("Dinov2Model", dict(
        hidden_size=768, num_hidden_layers=12, num_attention_heads=12, mlp_ratio=4, patch_size=14, image_size=518)),
}


def reward_params() -> dict[str, int]:
    """Parameters of each learned reward's default checkpoint (helpers/rewards.py's LEARNED), from its published
    shape on the meta device."""
    import transformers
    counts = {}
    for name, (kind, config) in REWARD_CONFIGS.items():
        config_class = getattr(transformers, kind.replace("Model", "Config"))
        with torch.device("meta"):
            model = getattr(transformers, kind)(config_class(**config))
        counts[name] = numel(model)
    return counts


def section_extras(counts: dict, rows: list, args) -> list[str]:
    """What the plan's phases leave out: a learned reward's weights, resident on each GPU once it has scored (float32,
    as the checkpoints are stored and transformers loads them), and --save-merged's whole pipeline, which rank 0 loads
    again on the host at the end to merge the adapter (bf16)."""
    lora = [r for r in rows if r["name"] == "LoRA r=16" and not r["ckpt"]][0]
    rewards = reward_params()
    body = table(["learned reward (default checkpoint)", "parameters", "GPU GiB (float32, every phase)",
                  "LoRA r=16, one GPU: peak with it"], ["---", "---:", "---:", "---:"],
                 [[name, f"{n / 1e9:.3f}B", f"{n * 4 / GiB:.1f}", f"{(lora['peaks'][False][0] + n * 4) / GiB:.1f}"]
                  for name, n in rewards.items()])
    pipeline = counts["AR total"] + counts["DiT"] + counts["VAE"] + counts["T5 glyph encoder"]
    text = ("Learned rewards (`--reward clip|pickscore|dino|aesthetic`, and `--eval-reward`) load their model once a "
            "process, then keep it on the GPU beside the plan's every phase (the aesthetic head and LPIPS' AlexNet "
            "add under 0.01 GiB). Each reward adds its own. `--save-merged` loads the whole pipeline once more on "
            f"rank 0's host at the end, in bf16: {pipeline / 1e9:.2f}B parameters, {pipeline * 2 / GiB:.1f} GiB of "
            "host memory beside the run's own. Served from another GPU or machine (`--reward http://HOST:PORT/NAME`, "
            "tools/reward_server.py, docs/rewards.md), a reward takes none of the training GPU: its row's GiB is "
            "freed on each of them, and a judge that could not sit beside the plan (a 7B one: about 13 GiB of bf16 "
            "weights) needs no room there.")
    return ["### Learned rewards and --save-merged", text, body]


def section_sources() -> list[str]:
    return ["### Sources of the configs", "\n".join(f"- {k}: {v}" for k, v in SOURCES.items())]


def plan_row_peak(counts, args, micro_batch, ckpt, offload):
    rows, _ = plan_rows(counts, args.group_size, args.prompt_tokens, args.height, args.width, micro_batch,
                        ranks=(16,), glyph_tokens=args.glyph_tokens)
    row = next(r for r in rows if r["name"] == "LoRA r=16" and r["ckpt"] == ckpt)
    return row["peaks"][offload]


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=100)
    parser.add_argument("--height", type=int, default=1024)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--micro-batch", type=int, default=1, help="sequences per forward/backward")
    parser.add_argument("--glyph-tokens", type=int, default=64, help="glyph (quoted-text) tokens seen by the DiT")
    parser.add_argument("--measure-dit", action="store_true",
                        help="re-measure the DiT's saved activations (MEASURED_DIT) at its published widths (CPU, a minute)")
    parser.add_argument("--measure", action="store_true",
                        help="re-measure the AR's terms at the real widths (CPU, 4-10 minutes, ~8 GB of memory) "
                             "instead of showing MEASURED, and print the new MEASURED")
    return parser.parse_args(argv)


def main(argv=None) -> str:
    args = parse_args(argv)
    warnings.filterwarnings("ignore")
    with contextlib.redirect_stderr(io.StringIO()):
        counts = count_components()
    calibrate(counts)
    rows, c = plan_rows(counts, args.group_size, args.prompt_tokens, args.height, args.width, args.micro_batch,
                        glyph_tokens=args.glyph_tokens)
    if args.measure_dit:
        with contextlib.redirect_stderr(io.StringIO()):
            print("MEASURED_DIT = " + pprint.pformat(measure_dit(log=lambda line: print(line, flush=True))))
        return ""
    measured = MEASURED
    if args.measure:
        stderr = sys.stderr  # the progress lines; the libraries' warnings are silenced
        with contextlib.redirect_stderr(io.StringIO()):
            measured = measure(log=lambda line: print(line, file=stderr, flush=True))
    sections = [section_title(args.height, args.width, args.group_size), section_parameters(counts),
                section_peaks(rows, c, args), section_assumptions(), section_measured(measured, args.measure),
                section_checks(counts, args), section_verdict(counts, rows, c, args), section_fsdp(counts, args),
                section_extras(counts, rows, args), section_dit(counts, args), section_gpu(counts, args),
                section_sources()]
    text = "\n\n".join(block for section in sections for block in section)
    print(text)
    if args.measure:
        print("\nMEASURED = " + pprint.pformat(measured, sort_dicts=False, width=116))
    return text


if __name__ == "__main__":
    main()
