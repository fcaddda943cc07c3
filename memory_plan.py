"""Memory plan for one GRPO step of grpo.py on the real GLM-Image, on one 80 GB GPU. An ESTIMATE, not a measurement.

    python memory_plan.py                  # CPU, a few seconds, downloads nothing
    python memory_plan.py --micro-batch 4  # the tiny model's micro-batch (real-model default: 1)

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
     assumptions, two checks against measurements and a verdict, as a markdown section.

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
    copies torch.autocast caches of them while sampling and training (2 B/param). "bf16 + fp32 Adam": bf16 weights
    2 B + bf16 grads 2 B + fp32 m, v 8 B = 12 B/param. "(extra) bf16 + 8-bit Adam, beta 0": 2 + 2 + 2 B/param and no
    reference; not what grpo.py does (needs bitsandbytes), shown to size the gap.
  - LoRA: adapters in fp32 (peft's default), 4 + 4 + 8 = 16 B/param; base AR bf16.
  - Reference model: none extra with LoRA (adapter disabled = base model); a bf16 copy of the whole AR for full
    fine-tuning with KL beta > 0 (grpo.py's real default beta is 0.04).
  - Gradients stay allocated from optimizer.step() to the next train_step's zero_grad (as grpo.py is written), so
    they count in every phase; so do optimizer states.
  - AR activations kept for the backward, per decoder layer and token, with grpo.py's autocast(bf16) and SDPA
    flash/efficient attention (no L x L matrix; no mask, so k/v stay GQA-sized), see act_bytes_per_token_layer:
    ~42.3 h + 8 i bytes (full FT, fp32 weights: the residual stream is fp32), ~34.3 h + 8 i (full FT, bf16 weights),
    ~30.3 h + 8 i (LoRA: frozen norms keep only their fp32 input; each adapter keeps its own bf16 input). The formula
    equals, byte for byte, what saved-tensor hooks record on a narrow copy of the AR (printed under Checks).
    No checkpointing: all layers + one more layer as backward workspace. With checkpointing: each layer's input
    (L x h x 2 bytes, 4 with an fp32 residual stream) + one recomputed layer + workspace.
  - Logits: lm_head on the last N positions only (logits_to_keep=N): N x V bf16, then code_logprobs' fp32 copies
    over the K codebook ids (~3 x N x K x 4 bytes: the saved log-softmax, its grad and a transient).
  - Sampling: KV cache G x L x layers x 2 x kv_heads x head_dim x 2 bytes (2 KV heads: small) and the raw fp32
    logits generate(output_logits=True) returns, stacked and turned into log-probs (~4 x G x N x V x 4 bytes).
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
import io
import warnings

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

GiB = 2**30

# ---- 1. Published configs ---------------------------------------------------------------------------------------

from offline_model import PUBLISHED, SOURCES  # noqa: E402  (the one copy of the published configs)

AR_CONFIG, DIT_CONFIG, VAE_CONFIG, T5_CONFIG = PUBLISHED["ar"], PUBLISHED["dit"], PUBLISHED["vae"], PUBLISHED["t5"]
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_up_proj", "down_proj"]
PUBLISHED_INFERENCE_PEAK_GB = {1: 37.82, 4: 52.09}  # github.com/zai-org/GLM-Image README, H100, 1024x1024, T2I


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

def shapes(text_config: dict | None = None) -> dict:
    t = text_config or AR_CONFIG["text_config"]
    head_dim = t["hidden_size"] // t["num_attention_heads"]
    return dict(h=t["hidden_size"], i=t["intermediate_size"], layers=t["num_hidden_layers"],
                heads=t["num_attention_heads"], kv_dim=t["num_key_value_heads"] * head_dim, head_dim=head_dim,
                V=t["vision_vocab_size"], K=AR_CONFIG["vq_config"]["num_embeddings"])


def lora_params(r: int) -> int:
    """r x (in + out) for every adapted linear of every layer."""
    s = shapes()
    h, i, kv = s["h"], s["i"], s["kv_dim"]
    per_layer = (h + h) + 2 * (h + kv) + (h + h) + (h + 2 * i) + (i + h)  # q, k+v, o, gate_up, down
    return r * per_layer * s["layers"]


# How the AR is run, as grpo.py runs it on a GPU (dtype bfloat16 => torch.autocast(bfloat16) around everything):
#   "full_fp32": fp32 trainable weights under autocast (grpo.py's full fine-tuning: policy.float())
#   "full_bf16": bf16 trainable weights (autocast changes nothing)
#   "lora":      bf16 frozen base + fp32 peft adapters, under autocast
ACT_MODES = ("full_fp32", "full_bf16", "lora")


def act_bytes_per_token_layer(mode: str, s: dict | None = None, lora_rank: int = 16) -> float:
    """Bytes autograd keeps for the backward of one AR decoder layer, per token (SDPA flash/efficient attention).

    A GLM decoder layer = 4 RMSNorms (input, post_self_attn, post_attention, post_mlp), q/k/v/o, gate_up, SiLU x up,
    down. What is kept (each term checked by `trace_activations` below):
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


def backward_bytes(mode: str, checkpointing: bool, L: int, N: int, micro_batch: int, lora_rank: int = 16) -> dict:
    """Activations + logits of one forward/backward of `micro_batch` sequences of length L."""
    s = shapes()
    one_layer = micro_batch * L * act_bytes_per_token_layer(mode, lora_rank=lora_rank)
    if checkpointing:  # the input of every layer (fp32 residual stream with fp32 weights) + the recomputed layer
        saved = s["layers"] * micro_batch * L * s["h"] * (4 if mode == "full_fp32" else 2) + one_layer
    else:
        saved = s["layers"] * one_layer
    workspace = one_layer  # gradient buffers of the layer being back-propagated (rough)
    logits = micro_batch * (N * s["V"] * 2 + 3 * N * s["K"] * 4 + N * s["h"] * 2 + L * s["h"] * 4)  # + final norm
    return dict(activations=saved + workspace, logits=logits)


def kv_cache_bytes(G: int, L: int) -> float:
    s = shapes()
    return G * (L + 1) * s["layers"] * 2 * s["kv_dim"] * 2


def sampler_logits_bytes(G: int, N: int) -> float:
    s = shapes()
    return 4 * G * N * s["V"] * 4  # fp32 per-step logits, their torch.stack, the /T copy and the log-softmax


def dit_activation_bytes(G: int, height: int, width: int, glyph_tokens: int) -> float:
    p, vae_scale = DIT_CONFIG["patch_size"], 2 ** (len(VAE_CONFIG["block_out_channels"]) - 1)
    tokens = (height // vae_scale // p) * (width // vae_scale // p) + glyph_tokens
    hidden = DIT_CONFIG["num_attention_heads"] * DIT_CONFIG["attention_head_dim"]
    return G * tokens * hidden * 2 * 12  # ~12 hidden-widths alive inside a block, one CFG pass at a time


def vae_decode_bytes(G: int, height: int, width: int) -> float:
    """Largest moment of the decoder: ~3 maps (input, GroupNorm out, SiLU out) at the biggest channels x pixels."""
    chans = list(reversed(VAE_CONFIG["block_out_channels"]))
    n = len(chans)
    worst = 0
    for b in range(n):  # up block b runs at 1/2^(n-1-b) of the output resolution, input channels chans[b-1]
        pixels = (height >> (n - 1 - b)) * (width >> (n - 1 - b))
        c_in = chans[max(b - 1, 0)]
        worst = max(worst, 3 * c_in * pixels)
        if b < n - 1:  # the upsampler: nearest x2 output + conv output at 4x the pixels, input alive
            worst = max(worst, (2 * 4 + 1) * chans[b] * pixels)
    return G * worst * 2


FULL_FT_VARIANTS = {  # bytes per trainable param: weights, grads, optimizer; autocast bf16 copies (under autocast)
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
    sampling = kv_cache_bytes(G, L) + sampler_logits_bytes(G, N)
    decoding = max(dit_activation_bytes(G, height, width, glyph_tokens), vae_decode_bytes(G, height, width))
    common = dict(N=N, L=L, ar_bf16=ar_bf16, decoder_weights=decoder_weights, sampling=sampling, decoding=decoding)

    settings = []
    trainable = counts["AR trainable (full FT, as grpo.py)"]
    frozen = counts["AR total"] - trainable
    for name, v in FULL_FT_VARIANTS.items():
        settings.append(dict(name=name, mode=v["act"], full=True, trainable=trainable,
                             persistent=trainable * (v["weights"] + v["grads"] + v["optim"]) + frozen * 2,
                             reference=ar_bf16 if v["reference"] else 0,
                             autocast=trainable * v["autocast"]))  # cached by autocast while sampling and training
    for r in ranks:
        n = lora_params(r)
        settings.append(dict(name=f"LoRA r={r}", mode="lora", full=False, trainable=n, persistent=ar_bf16 + n * 16,
                             reference=0, autocast=n * 2, rank=r))
    rows = []
    for st in settings:
        for ckpt in (False, True):
            bw = backward_bytes(st["mode"], ckpt, L, N, micro_batch, st.get("rank", 16))
            ar_state = st["persistent"] + st["reference"]
            train = bw["activations"] + bw["logits"] + st["autocast"]
            peaks = {}
            for offload in (False, True):
                resident = 0 if offload else decoder_weights
                phases = {"sample": ar_state + resident + sampling + st["autocast"],
                          "decode": ar_state + decoder_weights + decoding,
                          "train": ar_state + resident + train}
                phase = max(phases, key=phases.get)
                peaks[offload] = (phases[phase], phase, phases)
            rows.append(dict(st, ckpt=ckpt, ar_state=ar_state, train=train, peaks=peaks))
    return rows, common


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
        lines.append(f"batch {batch}: estimate {est / 1e9:.1f} GB ({est / GiB:.1f} GiB), upstream measured {measured} GB")
    return lines


# ---- 4. Check of the activation formula: saved-tensor hooks on a narrow copy of the AR ----------------------------

def trace_activations(L: int = 37, N: int = 23) -> dict:
    """Bytes autograd keeps per token per layer, measured on a narrow copy of the AR (h=512, i=1712, same heads,
    KV heads, norms, GQA ratio; zero weights, CPU, the way grpo.py runs it: autocast bf16) from 1 vs 2 layers, next to
    act_bytes_per_token_layer for the same shapes. CPU SDPA uses its flash kernel here, which keeps what the CUDA
    flash/efficient kernels keep. Returns {mode: (measured, formula)}."""
    from transformers import GlmImageConfig, GlmImageForConditionalGeneration
    text = dict(AR_CONFIG["text_config"], hidden_size=512, intermediate_size=1712, vocab_size=1024,
                vision_vocab_size=1024, pad_token_id=1001, eos_token_id=1001,
                rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[2, 1, 1],
                                     partial_rotary_factor=0.5))  # sections sum to head_dim / 4 = 4
    narrow = dict(AR_CONFIG, text_config=text, image_start_token_id=1000, image_end_token_id=1001,
                  image_token_id=1002, vq_config=dict(embed_dim=32, num_embeddings=1000, latent_channels=64),
                  vision_config=dict(AR_CONFIG["vision_config"], depth=1, hidden_size=64, num_heads=2,
                                     intermediate_size=64))

    def saved_bytes(mode: str, layers: int) -> int:
        config = GlmImageConfig(**dict(narrow, text_config=dict(text, num_hidden_layers=layers)))
        with torch.device("meta"):
            model = GlmImageForConditionalGeneration(config)
        model = model.to_empty(device="cpu")
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
        model.model.visual.requires_grad_(False)
        model.model.vqmodel.requires_grad_(False)
        model.float() if mode == "full_fp32" else model.to(torch.bfloat16)
        if mode == "lora":
            from peft import LoraConfig, get_peft_model
            model = get_peft_model(model, LoraConfig(r=16, lora_alpha=16, target_modules=LORA_TARGETS))
        seen = {}

        def pack(t):  # activations are the saved tensors with a sequence axis (weights and their casts have none)
            if L in t.shape or N in t.shape:
                seen[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()
            return t

        ids, pos = torch.zeros(1, L, dtype=torch.long), torch.arange(L).expand(3, 1, L)
        with torch.autocast("cpu", dtype=torch.bfloat16), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(input_ids=ids, position_ids=pos, use_cache=False, logits_to_keep=N)
        return sum(seen.values())

    result = {}
    for mode in ACT_MODES:
        if mode == "lora":
            try:
                import peft  # noqa: F401
            except ImportError:
                continue
        measured = (saved_bytes(mode, 2) - saved_bytes(mode, 1)) / L
        result[mode] = (measured, act_bytes_per_token_layer(mode, shapes(text)))
    return result


# ---- 4. MEASUREMENT: what the AR keeps and allocates, as grpo.py runs it, on the CPU (--measure) -------------------

ARITHMETIC_OPS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
                  torch.ops.aten.baddbmm.default, torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
                  torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default}
# (prompt tokens P, large grid, preview grid): L = P + N - 1, N = large + preview codes
LENGTHS = {"plan": (100, (32, 32), (16, 16)),  # the plan's sequence: N = 1024 + 256 = 1280, L = 1379
           "short": (100, (16, 16), (16, 16)),  # N = 512, L = 611: is everything linear in L and N?
           "few codes": (1355, (4, 4), (3, 3))}  # N = 25, L = 1379: the layers' backward without the logits' transients


class LiveStorages(TorchDispatchMode):
    """A TorchDispatchMode that records every storage an op creates (at the dispatcher, below autograd and autocast):
    the op count at which it appeared, the op count after which it was found freed (checked after every op), its bytes,
    and its kind: "L" if the tensor has the sequence axis L, "N" if it has the generated axis N, else "const" (autocast's
    bf16 weight copies, weight gradients, scalars). Storages that exist before (weights, inputs) are not counted. The
    sum of the live ones is what a GPU caching allocator reports as allocated, less the buffers a kernel allocates and
    frees inside itself (cuBLAS / cuDNN / flash-attention workspaces). skip_arithmetic: matrix products and the
    attention kernel return zeros of the shape, dtype and strides their meta kernels give, without computing (bf16
    matrix products run at ~0.2-12 GFLOP/s on the 2-core CPU); what autograd saves and allocates does not depend on
    the values (checked: `check_skip_arithmetic`)."""

    def __init__(self, axes: dict, before, skip_arithmetic: bool = True):
        super().__init__()
        self.axes, self.skip = axes, skip_arithmetic
        self.before = {t.untyped_storage()._cdata for t in before}
        self.entries = []  # [born, died (None: alive), nbytes, kind, op name, shape, dtype]
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
                w = n * scale.get(kind, 1.0)
                deltas[born] += w
                deltas[self.ops + 1 if died is None else died] -= w
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
    """The AR of `ar_config` with `layers` decoder layers and 1 vision block, zero weights, on the CPU, set up as grpo.py
    sets it up for `mode`: loaded in bf16 (grpo.py's dtype on a GPU), then `policy.float()` (full_fp32) or
    `grpo.apply_lora` (lora); vision tower and VQ frozen (`grpo.only_ar_trains`). The token embedding is frozen too
    (one_row_embedding) unless full_embedding. With 0 layers, the hidden states reaching the final norm come from a
    trainable scalar added to the embedding (as if from a trainable layer, without keeping the embedding's output)."""
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
    elif mode == "lora":
        if layers:
            from grpo import apply_lora
            model = apply_lora(model, lora_rank)
        else:  # nothing to adapt; the base is frozen
            model.requires_grad_(False)
    if layers == 0:
        model.zero = torch.nn.Parameter(torch.zeros((), dtype=torch.float32 if mode == "full_fp32" else torch.bfloat16))
        model.get_input_embeddings().register_forward_hook(lambda module, args, out: out + model.zero)
    return model


def ar_inputs(model, P: int, large: tuple, preview: tuple, G: int = 1) -> tuple[dict, torch.Tensor]:
    """grpo.group_inputs' layout by hand (no processor): G copies of a P-token prompt ending in image start, the
    [large, preview] grid rows, and N = large + preview codes."""
    ids = (torch.arange(P)[None] % 100 + 500).repeat(G, 1)
    ids[:, -1] = model.config.image_start_token_id
    N = large[0] * large[1] + preview[0] * preview[1]
    inputs = dict(input_ids=ids, attention_mask=torch.ones_like(ids),
                  image_grid_thw=torch.tensor([[1, *large], [1, *preview]]).repeat(G, 1),
                  images_per_sample=torch.full((G,), 2))
    return inputs, (torch.arange(N)[None] % 1000).repeat(G, 1)


def measure_step(model, length: tuple, passes: int = 1, skip_arithmetic: bool = True) -> dict:
    """`passes` micro-batches of one sequence through grpo.train_step's work, inside one autocast(bf16) as grpo.py runs
    it: grpo.token_logprobs (teacher-forced forward, logits_to_keep=N, code_logprobs), a loss, its backward; gradients
    accumulate from the second pass on. Returns, per kind: `saved` (saved_tensors_hooks of the first forward: distinct
    storages, weights excluded), `kept` (live storages at the end of the first forward), and per pass the peak of the
    live storages less the parameters' .grad (a persistent term of the plan), split into what was born in that pass's
    forward ("fwd", incl. earlier passes) and in its backward ("bwd")."""
    from grpo import token_logprobs
    inputs, tokens = ar_inputs(model, *length)
    L, N = inputs["input_ids"].shape[1] + tokens.shape[1] - 1, tokens.shape[1]
    params = list(model.parameters())
    live = LiveStorages(dict(L=L, N=N), [*params, *model.buffers(), *inputs.values(), tokens], skip_arithmetic)
    saved, kept, bounds = {}, None, []

    def pack(t):
        saved.setdefault(t.untyped_storage()._cdata, t)  # (keeps nothing autograd would not keep anyway)
        return t

    model.train(model.is_activation_checkpointing)  # as grpo.train_step: train mode only to checkpoint
    with torch.autocast("cpu", dtype=torch.bfloat16), live:
        for k in range(passes):
            start = live.ops
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t) if k == 0 else contextlib.nullcontext():
                loss = -token_logprobs(model, inputs, tokens, 0.9).mean()
            live.prune()
            if k == 0:
                kept = live.live()
                by_kind = {}
                for key, t in saved.items():
                    if key not in live.before:
                        kind = live.entries[live.alive[key][0]][3] if key in live.alive else live.kind(t.shape)
                        by_kind[kind] = by_kind.get(kind, 0) + t.untyped_storage().nbytes()
                saved = by_kind
            forward_end = live.ops
            loss.backward()
            del loss
            live.prune()
            bounds.append((start, forward_end, live.ops))
    grads = {live.alive[p.grad.untyped_storage()._cdata][0] for p in params
             if p.grad is not None and p.grad.untyped_storage()._cdata in live.alive}
    for p in params:
        p.grad = None
    out = dict(L=L, N=N, saved=saved, kept=kept, passes=[])
    for start, forward_end, stop in bounds:
        record = {}
        for name, scale in (("all", {}), ("tokens", {"const": 0.0})):  # tokens: the L and N kinds alone
            value, at = live.peak(scale, exclude=grads, start=start, stop=stop)
            everything, bwd = live.live(at, grads), live.live(at, grads, born_after=forward_end)
            record[name] = dict(peak=value, bwd=bwd, fwd={k: v - bwd.get(k, 0) for k, v in everything.items()})
        out["passes"].append(record)
    return out


# ---- 5. Output ---------------------------------------------------------------------------------------------------

def fmt_b(n: float) -> str:
    return f"{n / 1e9:.3f}B"


def main(argv=None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=100)
    parser.add_argument("--height", type=int, default=1024)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--micro-batch", type=int, default=1, help="sequences per forward/backward")
    parser.add_argument("--glyph-tokens", type=int, default=64, help="glyph (quoted-text) tokens seen by the DiT")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    G, H, W, mb = args.group_size, args.height, args.width, args.micro_batch

    with contextlib.redirect_stderr(io.StringIO()):
        counts = count_components()
    rows, c = plan_rows(counts, G, args.prompt_tokens, H, W, mb, glyph_tokens=args.glyph_tokens)
    dit_act, vae_act = dit_activation_bytes(G, H, W, args.glyph_tokens), vae_decode_bytes(G, H, W)
    out = []
    p = out.append
    p(f"## Memory plan ({H}x{W}, G={G}, one 80 GB GPU)")
    p("")
    p("An ESTIMATE from the published configs and simple formulas (`python memory_plan.py`), not a measurement on a "
      "GPU. Sizes in GiB (2^30 bytes).")
    p("")
    p("### Parameters (each component built on the meta device from its published config)")
    p("")
    p("| component | parameters | bf16 GiB |")
    p("|---|---:|---:|")
    for k, v in counts.items():
        p(f"| {k} | {fmt_b(v)} | {v * 2 / GiB:.2f} |")
    for r in (16, 64):
        n, n_peft = lora_params(r), lora_params_peft(r)
        check = "peft not installed" if n_peft is None else ("= peft" if n_peft == n else f"peft says {n_peft}")
        p(f"| LoRA r={r} on {', '.join(LORA_TARGETS)} | {n / 1e6:.1f}M ({check}) | {n * 2 / GiB:.2f} |")
    p("")
    diffs = library_default_diffs()
    p("The published AR config equals the transformers 5.23 defaults in every size; "
      + ("nothing differs." if not diffs else "it differs in " + "; ".join(diffs) + " (no effect on sizes)."))
    p("")
    p(f"### Peak GPU memory of one GRPO step (GiB): N = {c['N']} generated tokens, L = {c['L']}, "
      f"backward micro-batch {mb}")
    p("")
    p("| setting | grad ckpt | trainable | AR weights + optimizer + grads (+ ref) | training extra: activations + logits "
      "(+ autocast copies) | peak, all resident | peak, DiT/VAE/T5 offloaded | fits 80 GB (resident / offloaded) |")
    p("|---|---|---:|---:|---:|---:|---:|---|")
    for r in rows:
        (pr, phr, _), (po, pho, _) = r["peaks"][False], r["peaks"][True]
        ref = f" (ref {r['reference'] / GiB:.1f})" if r["reference"] else ""
        p(f"| {r['name']} | {'yes' if r['ckpt'] else 'no'} | {r['trainable'] / 1e9:.3f}B "
          f"| {r['ar_state'] / GiB:.1f}{ref} | {r['train'] / GiB:.1f} | {pr / GiB:.1f} ({phr}) | {po / GiB:.1f} ({pho}) "
          f"| {verdict(pr)} / {verdict(po)} |")
    p("")
    p(f"Phase terms: DiT + VAE + T5 weights {c['decoder_weights'] / GiB:.1f}; sampling (KV cache "
      f"{kv_cache_bytes(G, c['L']) / GiB:.2f} + fp32 sampler logits {sampler_logits_bytes(G, c['N']) / GiB:.2f}); "
      f"decoding max(DiT {dit_act / GiB:.1f}, VAE decode of {G} images {vae_act / GiB:.1f}); AR activations per "
      f"token per layer: " + ", ".join(f"{m} {act_bytes_per_token_layer(m) / 1024:.0f} KiB" for m in ACT_MODES) + ".")
    p("")
    p("### Assumptions")
    p("")
    for line in (
        "bf16 frozen weights (AR, DiT, VAE, T5). Full fine-tuning trains what grpo.py trains: the AR language model "
        "with its token embedding, and lm_head (vision tower and VQ frozen).",
        "fp32 master: fp32 weights + fp32 grads + AdamW m, v = 16 B/param, plus the bf16 copies autocast caches while "
        "sampling and training (2 B/param). bf16 + fp32 AdamW: 2 + 2 + 8 = 12 B/param (torch's AdamW on bf16 "
        "weights would keep bf16 moments: 8 B/param, and updates round away). (extra) 8-bit AdamW: 2 + 2 + 2 B/param, "
        "KL beta 0, no reference; not what grpo.py does.",
        "LoRA adapters in fp32 (peft default): 16 B/param. Reference: the base model with the adapter disabled (no "
        "copy) for LoRA; a bf16 copy of the AR for full fine-tuning with KL beta > 0 (grpo.py's real default 0.04).",
        "Gradients stay allocated from one optimizer step to the next zero_grad (as grpo.py is written), so they "
        "count in every phase; optimizer states too.",
        "AR activations, run as grpo.py runs it (autocast bf16, SDPA flash/efficient attention without a mask, so "
        "no L x L matrix and k/v stay GQA-sized), per layer and token: about 42.3 h + 8 i bytes (full FT, fp32 "
        "weights: fp32 residual stream), 34.3 h + 8 i (full FT, bf16 weights), 30.3 h + 8 i (LoRA); the terms are in "
        "act_bytes_per_token_layer and match saved-tensor hooks on a narrow copy of the AR (Checks). No "
        "checkpointing: all layers + one layer of workspace. Checkpointing: each layer's input (L x h x 2 bytes, x 4 "
        "with an fp32 residual stream) + one recomputed layer + workspace.",
        f"Logits only for the last N positions (logits_to_keep): N x {shapes()['V']} bf16 plus ~3 fp32 copies over the "
        f"{shapes()['K']} codebook ids.",
        "Sampling: KV cache G x L x layers x 2 x kv_heads x head_dim x 2 bytes (2 KV heads: small) + the fp32 "
        "logits generate(output_logits=True) returns, stacked and turned into log-probs.",
        "Decoding (no grad, sequential phases): DiT ~12 hidden-widths per token inside a block, batch G, CFG passes "
        "one after the other; VAE decode of the G images in one call: ~3 maps of the largest level (512 channels at "
        "full resolution) alive at once.",
        "Peak = max over sampling, decoding and the backward. 'Offloaded' = DiT/VAE/T5 in CPU memory except while "
        "decoding. 'yes' = at most 72 GiB (10% left for the CUDA context, fragmentation and kernel workspaces, not "
        "modelled), 'tight' = 72-80 GiB, 'no' = above 80 GiB.",
    ):
        p(f"- {line}")
    p("")
    p("### Checks")
    p("")
    p("- Parameter counts reproduce the checkpoint sizes a third-party loader lists: AR 18.8 GiB bf16 (only with the "
      "vision tower, so the checkpoint holds it), DiT 12.9 GiB bf16, glyph encoder 0.81 GiB fp32 (830 MB).")
    checks = inference_check(counts, 1024, 1024, args.glyph_tokens)
    measured_slope = (PUBLISHED_INFERENCE_PEAK_GB[4] - PUBLISHED_INFERENCE_PEAK_GB[1]) / 3 * 1e9
    est_slope = vae_decode_bytes(1, 1024, 1024)
    p("- Plain inference with the same formulas vs the upstream README (one H100, diffusers, 1024x1024): "
      + "; ".join(checks) + f". The measured growth per extra image ({measured_slope / GiB:.1f} GiB) is larger than "
      f"the VAE term here ({est_slope / GiB:.1f} GiB per image): the decoding phase may be underestimated by up to "
      f"~{(measured_slope - est_slope) * G / GiB:.0f} GiB at G={G} (cuDNN workspaces, allocator).")
    with contextlib.redirect_stderr(io.StringIO()):
        traced = trace_activations()
    p("- Saved activations per token per layer on a narrow copy of the AR (h=512, i=1712, 1 vs 2 layers, "
      "saved-tensor hooks, autocast bf16): " + ", ".join(
          f"{m} measured {meas:.0f} B vs formula {form:.0f} B" for m, (meas, form) in traced.items()) + ".")
    p("")
    p("### Verdict")
    p("")
    fits = [f"{r['name']}{' + ckpt' if r['ckpt'] else ''}" for r in rows if verdict(r["peaks"][False][0]) == "yes"]
    lora = [r for r in rows if r["mode"] == "lora"]
    full = [r for r in rows if r["full"] and not r["name"].startswith("(extra)")]
    extra = [r for r in rows if r["name"].startswith("(extra)")]
    frozen_gib = (counts["AR total"] - counts["AR trainable (full FT, as grpo.py)"]) * 2 / GiB
    lo = min(r["peaks"][False][0] for r in lora) / GiB
    hi = max(r["peaks"][False][0] for r in lora) / GiB
    p(f"- Fits with all components resident: {', '.join(fits) if fits else 'nothing'}. LoRA peaks at "
      f"{lo:.0f}-{hi:.0f} GiB; with checkpointing the decoding phase ({vae_act / GiB:.0f} GiB of VAE activations for "
      f"{G} images) sets the peak.")
    p(f"- Full fine-tuning does not fit on one 80 GB GPU: AR weights + optimizer + grads alone are "
      f"{min(r['ar_state'] - r['reference'] for r in full) / GiB:.0f}-"
      f"{max(r['ar_state'] - r['reference'] for r in full) / GiB:.0f} GiB, before the "
      f"{full[0]['reference'] / GiB:.1f} GiB reference copy that KL beta > 0 needs. Even the (extra) 8-bit AdamW, "
      f"beta 0 variant peaks at {min(r['peaks'][True][0] for r in extra) / GiB:.0f}-"
      f"{max(r['peaks'][False][0] for r in extra) / GiB:.0f} GiB. Full FT needs sharding over several GPUs "
      "(FSDP/ZeRO) or CPU-offloaded optimizer states. grpo.py as written is heavier still: policy.float() also makes "
      f"the frozen vision tower + VQ fp32 (+{frozen_gib:.1f} GiB) and its copy.deepcopy reference is then fp32 "
      f"(+{full[0]['reference'] / GiB:.1f} GiB).")
    changed = [f"{r['name']}{' + ckpt' if r['ckpt'] else ''}" for r in rows
               if verdict(r["peaks"][False][0]) != verdict(r["peaks"][True][0])]
    p("- Offloading DiT/VAE/T5 during the AR phases " + (
        "does not change any verdict in the table: it lowers only the sampling and training phases (by "
        f"{c['decoder_weights'] / GiB:.0f} GiB), and the decoding phase, which needs them on the GPU, then sets the "
        "peak." if not changed else f"(-{c['decoder_weights'] / GiB:.0f} GiB outside decoding) changes the verdict "
        "for: " + ", ".join(changed) + "."))
    mb_peaks = {(m, ck): plan_row_peak(counts, args, m, ck, False)[0] for m in (1, 2, 4) for ck in (False, True)}
    p("- The micro-batch matters more than the rank: LoRA r=16, all resident, micro-batch 1 / 2 / 4: "
      + ", ".join(f"checkpointing {'on' if ck else 'off'} " + " / ".join(
          f"{mb_peaks[(m, ck)] / GiB:.0f}" for m in (1, 2, 4)) for ck in (False, True))
      + f" GiB. grpo.py's current default micro_batch_size=4 needs checkpointing (without it: "
      f"~{mb_peaks[(4, False)] / GiB:.0f} GiB, {verdict(mb_peaks[(4, False)])}).")
    margin = max(0.0, (measured_slope - est_slope) * G) if (H, W) == (1024, 1024) else 0.0  # calibrated at 1024
    with_margin = [max(max(ph.values()), ph["decode"] + margin) for r in lora for _, _, ph in [r["peaks"][False]]
                   if verdict(r["peaks"][False][0]) == "yes"]
    if with_margin and margin:
        p(f"- Margin: the decoding term may be ~{margin / GiB:.0f} GiB low (see Checks); the LoRA settings that fit "
          f"stay at or below {max(with_margin) / GiB:.0f} GiB even then.")
    p(f"- Cheap savings: decode the G images one at a time (vae.enable_slicing(): ~{vae_act * (G - 1) / G / GiB:.0f} "
      "GiB less in the decoding phase); free gradients right after optimizer.step(); drop or offload the unused "
      f"vision tower + VQ ({(counts['AR vision tower'] + counts['AR VQ']) * 2 / GiB:.1f} GiB); keep SDPA "
      f"flash/efficient attention (eager attention would keep the {shapes()['heads']} x L x L probabilities, fp32 + "
      f"bf16: ~{shapes()['heads'] * c['L'] ** 2 * 6 / GiB:.2f} GiB per layer per sequence).")
    p("")
    p("### Sources of the configs")
    p("")
    for k, v in SOURCES.items():
        p(f"- {k}: {v}")
    text = "\n".join(out)
    print(text)
    return text


def plan_row_peak(counts, args, micro_batch, ckpt, offload):
    rows, _ = plan_rows(counts, args.group_size, args.prompt_tokens, args.height, args.width, micro_batch,
                        ranks=(16,), glyph_tokens=args.glyph_tokens)
    row = next(r for r in rows if r["name"] == "LoRA r=16" and r["ckpt"] == ckpt)
    return row["peaks"][offload]


if __name__ == "__main__":
    main()
