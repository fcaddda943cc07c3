"""Benchmark of one GRPO step on the tiny GLM-Image: every number below is measured in one run.

  python tools/bench.py                 # CPU, tiny model, under a minute on 2 cores
  python tools/bench.py --real-shapes   # published widths, reduced depth, 1024x1024, G=2, fp32 + bf16 (~17 min, 16 GB)
  python tools/bench.py --sampler       # the decode loop vs generate: CPU (~4 min, 1 thread); with --device cuda
                                        # the FULL published depth in bf16 on one GPU (~4 min on an H100)

Prints one markdown table:
  - seconds per phase of one step (sample, decode, reward, old / ref / new log-probs, backward, optimizer step);
  - one batched `generate` for the group vs G sequential calls, at G = 4 and 8 (speed-up);
  - activation memory saved for backward vs micro-batch size (1, 2, G): bytes of the tensors autograd keeps for
    the backward of one micro-batch (a saved-tensors hook counts them; on a GPU add torch.cuda.max_memory_allocated);
  - full fine-tuning vs LoRA (r = 16): trainable parameters, train-step time, optimizer-state memory;
  - the OCR reward (EasyOCR, when installed: bash tools/install_ocr.sh): building its reader, and seconds per image
    at 64x64 and at 1024x1024 (text rendered with PIL).
Timings are medians of a few repeats; compare rows as ratios, these machines are noisy.

--sampler times grpo.sample_groups (grpo.py's decode loop) against `generate` drawing from the same code_logprobs
(tools/generate_reference.py, grpo.py's sampler before the loop) in one run, in ms per decoding step, and checks that
both draw the same tokens. CPU: a 40-layer AR at the tiny widths (the per-layer overhead of the real depth, no compute)
at 1024x1024 with G = 4, and the pre-trained tiny model at its 96x96 (a group of 8, and a demo step's 2 groups of 8
in one decode), plus torch.compile's cost and gain there. GPU: GLM-Image at its full published depth with random
bf16 weights built on the GPU (offline_model.PUBLISHED), 1024x1024, G = 4 and 16: the CUDA-graph loop beside the
eager loop and generate (each timed on a prefix of the tokens), the floor (the weights read once per step at the
copy bandwidth measured there), the sampler / trainer gap in bf16; and the tiny model on the GPU in float32.

--real-shapes runs complete GRPO steps through grpo.py's own functions on `offline_model.real_shapes_glm_image()`
(every published width, vocabulary and id; 2 AR layers, 1 vision / DiT / T5 layer; random weights) at 1024x1024 with
G=2, LoRA r=16 and KL beta 0.04 (the real-model defaults), once in float32 and once as grpo.py runs on a GPU (bf16
weights, float32 adapters, autocast bf16): seconds per phase, peak resident memory, the sampler/trainer gap, the token
layout. The DiT runs 2 denoising steps (the real default is 50: multiply that phase by ~25); the VAE decodes one image
at a time (float32 peak resident memory 15.8 GiB instead of 23.1 GiB).
"""

import argparse
import copy
import functools
import math
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # grpo.py and the files it imports live in the repository root

import grpo  # noqa: E402
from helpers import diagnostics, fast_decode, setup, trainer, user_input, variants  # noqa: E402
from helpers import rewards  # noqa: E402
from tools.generate_reference import generate_group  # noqa: E402  grpo.py's sampler before its decode loop

G, H, W, T, PROMPT = 4, 96, 96, 0.9, "a red square on the left"  # the pre-trained tiny model at its own size


def sample_group(pipe, prompt, group_size, height, width, temperature, seed, top_p=1.0):
    """One prompt's group as main samples it (helpers/trainer.py: the fast decode)."""
    return trainer.sample_groups(grpo, pipe, [prompt], group_size, height, width, temperature, [seed],
                                 top_p=top_p)[0]


def train_step(policy, opt, rollouts, advantages, ref, micro_batch_size, kl_beta):
    """The trainer's step as grpo.main calls it: the rollouts' micro-batches, the lesson's loss (clip 0.2, one
    update)."""
    batches = trainer.micro_batches(rollouts, advantages, micro_batch_size)
    loss = functools.partial(grpo.micro_batch_loss, clip_eps=0.2, kl_beta=kl_beta)
    readings = diagnostics.reader(trainer.parse_config(grpo, []), policy.config.vq_config.num_embeddings, grpo)
    return trainer.train_step(grpo, policy, opt, batches, ref, loss, temperature=T, mu=1, max_grad_norm=1.0,
                              readings=readings)


def timed(fn, repeats=3):
    """Median seconds of `repeats` calls, and the last result."""
    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def saved_activation_bytes(fn) -> int:
    """Bytes of the distinct tensors autograd saves for backward while `fn` runs."""
    seen = {}

    def pack(t):
        seen[(t.untyped_storage().data_ptr(), t.dtype)] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    out.backward()
    return sum(seen.values())


def phases(pipe, policy, rows):
    target = user_input.load_image(ROOT / "examples" / "target_0.png", H, W)
    ref = copy.deepcopy(policy).requires_grad_(False)
    opt = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=1e-3)
    t, r = timed(lambda: sample_group(pipe, PROMPT, G, H, W, T, seed=0))
    rows.append(("phase: sample (G=4, one decode)", f"{t:.3f} s"))
    t, images = timed(lambda: grpo.decode_images(pipe, PROMPT, r.tokens, r.prompt.large_hw, H, W, 2, seed=0))
    rows.append(("phase: decode (DiT + VAE, whole group)", f"{t:.3f} s"))
    t, (rewards, _) = timed(lambda: grpo.group_rewards([images], [{"target": target}], {"ssim": (grpo.ssim_reward, 1.0)}))
    rows.append(("phase: reward (SSIM)", f"{t * 1e3:.2f} ms"))
    with torch.no_grad():
        t, _ = timed(lambda: grpo.token_logprobs(policy, r.prompt.inputs, r.tokens, T))
    rows.append(("phase: old log-probs (no grad)", f"{t:.3f} s"))
    batch = grpo.micro_batches([r], torch.zeros(1, G), G)
    t, _ = timed(lambda: grpo.reference_logprobs(ref, batch[0], T))
    rows.append(("phase: ref log-probs (no grad)", f"{t:.3f} s"))
    adv = grpo.group_advantages(rewards)[0]
    t_fwd, logp = timed(lambda: grpo.token_logprobs(policy, r.prompt.inputs, r.tokens, T))
    rows.append(("phase: new log-probs (with grad)", f"{t_fwd:.3f} s"))

    def backward():
        loss, _ = grpo.grpo_loss(grpo.token_logprobs(policy, r.prompt.inputs, r.tokens, T), logp.detach(), None, adv,
                                 0.2, 0.0)
        loss.backward()

    t, _ = timed(backward)
    rows.append(("phase: backward (forward excluded)", f"{max(t - t_fwd, 0):.3f} s"))
    t, _ = timed(opt.step)
    rows.append(("phase: optimizer step (AdamW)", f"{t * 1e3:.2f} ms"))
    return r, adv


def batched_vs_sequential(pipe, rows):
    for g in (4, 8):
        t_batch, _ = timed(lambda: sample_group(pipe, PROMPT, g, H, W, T, seed=0), repeats=2)
        t_seq, _ = timed(lambda: [sample_group(pipe, PROMPT, 1, H, W, T, seed=s) for s in range(g)], repeats=2)
        rows.append((f"sampling G={g}: batched vs {g} sequential", f"{t_batch:.2f} s vs {t_seq:.2f} s = "
                     f"{t_seq / t_batch:.1f}x faster"))


def memory_vs_micro_batch(policy, r, adv, rows):
    for mb in (1, 2, G):
        rows_mb = slice(0, mb)

        def loss():
            lp = grpo.token_logprobs(policy, r.prompt.inputs, r.tokens[rows_mb], T)
            return grpo.grpo_loss(lp, lp.detach(), None, adv[rows_mb], 0.2, 0.0)[0]

        rows.append((f"activations saved for backward, micro-batch {mb}", f"{saved_activation_bytes(loss) / 2**20:.1f} MiB"))
        policy.zero_grad(set_to_none=True)


def full_vs_lora(rows):
    for rank in (0, 16):
        pipe = grpo.load_glm_image("tiny")
        policy = grpo.trained_model(pipe, rank)
        params = [p for p in policy.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=1e-3)
        r = sample_group(pipe, PROMPT, G, H, W, T, seed=0)
        adv = torch.tensor([[1.0, -1.0, 0.5, -0.5]])
        t, _ = timed(lambda: train_step(policy, opt, [r], adv, None, micro_batch_size=G, kl_beta=0.0))
        state_bytes = sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values()
                          if torch.is_tensor(v))
        name = f"LoRA r={rank}" if rank else "full fine-tuning"
        rows.append((f"{name}: trainable params / train step / AdamW state",
                     f"{sum(p.numel() for p in params):,} / {t:.3f} s / {state_bytes / 2**10:.0f} KiB"))


def ocr_cost(rows):
    """The ocr reward's cost on the CPU: building EasyOCR's reader once, then per image at 64x64 and 1024x1024."""
    try:
        import easyocr  # noqa: F401
    except ImportError:
        rows.append(("ocr reward", "not measured: EasyOCR is not installed (bash tools/install_ocr.sh)"))
        return
    from PIL import Image, ImageDraw, ImageFont
    t, _ = timed(rewards.ocr_reader, repeats=1)
    rows.append(("ocr reward: build the reader (once per process)", f"{t:.1f} s"))
    for size in (64, 1024):
        image = Image.new("RGB", (size, size), "white")
        ImageDraw.Draw(image).text((size // 2, size // 2), "OPEN 24 HOURS", fill="black", anchor="mm",
                                   font=ImageFont.load_default(size=max(size // 10, 6)))
        images = torch.from_numpy(np.asarray(image, dtype=np.float32) / 255).permute(2, 0, 1)[None]
        t, score = timed(lambda: rewards.ocr_reward(images.repeat(2, 1, 1, 1), {"text": "open 24 hours"}), repeats=2)
        rows.append((f"ocr reward: {size}x{size}, per image", f"{t / 2:.2f} s (read: score {score[0]:.2f})"))


def peak_rss_reset() -> None:
    """Reset the kernel's peak-RSS counter of this process (Linux: VmHWM), so each precision gets its own peak."""
    Path("/proc/self/clear_refs").write_text("5")


def peak_rss_gib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024 / 2**30
    return float("nan")


def emit(rows, name, value):
    """Keep a row for the table and print it at once: --real-shapes runs long, partial results should survive."""
    rows.append((name, value))
    print(f"| {name} | {value} |", flush=True)


def real_shapes_step(pipe, policy, precision: str, rows, height=1024, width=1024, group=2):
    """One complete GRPO step (sample, decode, reward, advantages, update) with grpo.py's functions; rows += timings."""
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bfloat16")
    opt = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=1e-5)
    peak_rss_reset()
    t0 = time.perf_counter()
    with autocast:
        r = sample_group(pipe, PROMPT, group, height, width, T, seed=0)
    t1 = time.perf_counter()
    n_prev, n_large = r.prompt.preview_hw[0] * r.prompt.preview_hw[1], r.prompt.large_hw[0] * r.prompt.large_hw[1]
    emit(rows, f"{precision}: token layout", f"{n_prev} preview ({r.prompt.preview_hw[0]}x{r.prompt.preview_hw[1]}) + {n_large} "
         f"large ({r.prompt.large_hw[0]}x{r.prompt.large_hw[1]}) = {r.tokens.shape[1]} tokens per sample")
    emit(rows, f"{precision}: sample (G={group}, one decode)", f"{t1 - t0:.1f} s")
    images = grpo.decode_images(pipe, PROMPT, r.tokens, r.prompt.large_hw, height, width, 2, seed=0)
    t2 = time.perf_counter()
    emit(rows, f"{precision}: decode (DiT 2 steps + VAE in float32, {group} images, the VAE one at a time)",
         f"{t2 - t1:.1f} s")
    target = images[0].flip(-1)  # any image of the right size: the benchmark measures cost, not learning
    rewards, _ = grpo.group_rewards([images], [{"target": target}], {"ssim": (grpo.ssim_reward, 1.0)})
    advantages = grpo.group_advantages(rewards)
    t3 = time.perf_counter()
    emit(rows, f"{precision}: reward + advantages", f"{t3 - t2:.2f} s")
    with autocast:
        m = train_step(policy, opt, [r], advantages, policy, micro_batch_size=1, kl_beta=0.04)
    t4 = time.perf_counter()
    emit(rows, f"{precision}: train_step (ref + {group} x forward/backward, AdamW)", f"{t4 - t3:.1f} s")
    emit(rows, f"{precision}: step total", f"{t4 - t0:.1f} s")
    emit(rows, f"{precision}: peak resident memory", f"{peak_rss_gib():.1f} GiB")
    emit(rows, f"{precision}: sampler/trainer gap (max abs log-prob), ratio min/max",
         f"{m['sampler_gap']:.2e}, {m['ratio_min']:.6f}/{m['ratio_max']:.6f}")


def real_shapes(rows):
    from helpers.offline_model import real_shapes_glm_image
    t = time.perf_counter()
    pipe = grpo.only_ar_trains(real_shapes_glm_image())
    n = {name: sum(p.numel() for p in m.parameters()) for name, m in
         [("AR", pipe.vision_language_encoder), ("DiT", pipe.transformer), ("VAE", pipe.vae), ("T5", pipe.text_encoder)]}
    emit(rows, "model", "published widths, 2 AR / 1 vision / 1 DiT / 1 T5 layers: " +
         ", ".join(f"{k} {v / 1e9:.2f}B" for k, v in n.items()) + f" parameters; built in "
         f"{time.perf_counter() - t:.0f} s")
    # the VAE decodes the group one image at a time: decoding both 1024x1024 images in one float32 call peaked at
    # 23.1 GiB resident, all but 0.4 GiB of a 24 GB machine (grpo.py decodes a group in one call; the AR's numbers
    # do not depend on it)
    pipe.vae.enable_slicing()
    policy = grpo.trained_model(pipe, 16)
    real_shapes_step(pipe, policy, "float32", rows)
    # as grpo.py runs on a GPU: bf16 AR weights, float32 adapters, autocast. The DiT and VAE stay float32 here:
    # bf16 convolutions and long matmuls are ~8x slower than float32 on CPUs without bf16 units, and decoding
    # precision does not touch the AR's log-probs
    pipe.vision_language_encoder.to(torch.bfloat16)
    for p in policy.parameters():
        if p.requires_grad:
            p.data = p.data.float()
    real_shapes_step(pipe, policy, "bfloat16", rows)


# ---- --sampler: the decode loop against generate -----------------------------------------------

def sync(device):
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def per_step(fn, n_tokens, device, repeats=1):
    """(median ms per decoding step over `repeats` calls of fn, the last result)."""
    def call():
        sync(device)
        result = fn()
        sync(device)
        return result
    seconds, result = timed(call, repeats)
    return 1e3 * seconds / n_tokens, result


def eager_prefix(n):
    """fast_decode.repeat_step that runs only the first n steps, eagerly: the loop without CUDA graphs, timed on a
    prefix."""
    def repeat(step, _n, draw, capture=False):
        for _ in range(n):
            draw()
            step()
    return repeat


def sampler_compare(pipe, name, device, group, height, width, prefix=0, repeats=1, emit_row=None):
    """One row set: the decode loop vs generate on one prompt, ms per step, same tokens. `prefix` > 0 times generate
    and the eager loop on the first `prefix` tokens only (the real model's generate takes 139 ms a step)."""
    model = pipe.vision_language_encoder
    r = sample_group(pipe, PROMPT, group, height, width, T, seed=0)  # warm-up (and the tokens to compare)
    n = r.tokens.shape[1]
    loop_ms, r = per_step(lambda: sample_group(pipe, PROMPT, group, height, width, T, seed=0), n, device, repeats)
    m = prefix or n
    gen_ms, (tokens, *_) = per_step(lambda: generate_group(pipe, PROMPT, group, height, width, T, 0,
                                                           max_new_tokens=m), m, device, repeats)
    same = (r.tokens[:, :m] == tokens).float().mean().item()
    emit_row(f"{name}: decode loop vs generate, ms per step (N = {n}, G = {group})",
             f"{loop_ms:.2f} vs {gen_ms:.2f}{f' (generate on the first {m} tokens)' if prefix else ''} = "
             f"{gen_ms / loop_ms:.2f}x; {group * 1e3 / loop_ms:.0f} tokens/s; same tokens: {same:.1%}")
    if device.startswith("cuda"):
        original = fast_decode.repeat_step
        fast_decode.repeat_step = eager_prefix(m)
        try:
            eager_ms, _ = per_step(lambda: sample_group(pipe, PROMPT, group, height, width, T, seed=0), m, device)
        finally:
            fast_decode.repeat_step = original
        emit_row(f"{name}: the same loop eager (no CUDA graph), ms per step", f"{eager_ms:.2f} (first {m} tokens)")
        with torch.no_grad():
            trainer = grpo.token_logprobs(model, r.prompt.inputs, r.tokens, T)
        gap = (trainer - r.q_logprobs).abs()
        emit_row(f"{name}: sampler vs trainer, abs log-prob difference max / mean", f"{gap.max():.3g} / {gap.mean():.3g}")
    return loop_ms


def sampler_cpu(emit_row):
    from helpers.offline_model import TINY, glm_image, with_depths
    deep = grpo.only_ar_trains(glm_image(with_depths(TINY, ar=40)))
    sampler_compare(deep, "40-layer tiny-width AR, 1024x1024", "cpu", 4, 1024, 1024, emit_row=emit_row)
    pipe = grpo.load_glm_image("tiny")
    sampler_compare(pipe, "tiny model, 96x96", "cpu", 8, H, W, repeats=5, emit_row=emit_row)
    prompts = [PROMPT, "two blue squares above a green triangle"]
    one, _ = timed(lambda: trainer.sample_groups(grpo, pipe, prompts, 8, H, W, T, [0, 1]), repeats=5)
    two, _ = timed(lambda: [generate_group(pipe, p, 8, H, W, T, s) for s, p in enumerate(prompts)], repeats=5)
    emit_row("tiny model: a demo step's 2 groups of 8, one decode vs 2 generates", f"{one:.3f} s vs {two:.3f} s = "
             f"{two / one:.2f}x")
    lesson, _ = timed(lambda: grpo.sample_groups(pipe, prompts, 8, H, W, T, [0, 1]), repeats=5)  # the lesson's loop
    emit_row("tiny model: a demo step's 2 groups of 8, helpers/fast_decode.py vs grpo.generate (the lesson's loop)",
             f"{one:.3f} s vs {lesson:.3f} s = {lesson / one:.2f}x")
    # torch.compile of the AR's forward, on the pre-allocated cache (fixed shapes: one compilation)
    compiled = torch.compile(pipe.vision_language_encoder)
    original = fast_decode.decode
    fast_decode.decode = lambda model, *args, **kwargs: original(compiled, *args, **{**kwargs, "static": True})
    try:
        first, _ = timed(lambda: sample_group(pipe, PROMPT, 8, H, W, T, seed=0), repeats=1)
        then, _ = timed(lambda: sample_group(pipe, PROMPT, 8, H, W, T, seed=0), repeats=5)
    finally:
        fast_decode.decode = original
    eager, _ = timed(lambda: sample_group(pipe, PROMPT, 8, H, W, T, seed=0), repeats=5)
    emit_row("tiny model: torch.compile on the CPU, first group (compiling) / then per group / eager per group",
             f"{first:.1f} s / {then:.3f} s / {eager:.3f} s: pays off after {first / max(eager - then, 1e-9):.0f} "
             "groups")


def copy_bandwidth(device) -> float:
    """Bytes per second of a device-to-device copy (read + write counted), median of 10."""
    x = torch.empty(2**30, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    y.copy_(x)
    sync(device)
    times = []
    for _ in range(10):
        start = time.perf_counter()
        y.copy_(x)
        sync(device)
        times.append(time.perf_counter() - start)
    return 2 * x.numel() / statistics.median(times)


def sampler_gpu(emit_row):
    from helpers.offline_model import PUBLISHED, glm_image
    emit_row("GPU", f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    start = time.perf_counter()
    torch.set_default_dtype(torch.bfloat16)
    try:
        pipe = grpo.only_ar_trains(glm_image(PUBLISHED, device="cuda"))
    finally:
        torch.set_default_dtype(torch.float32)
    emit_row("full depth, random bf16 weights: built on the GPU in", f"{time.perf_counter() - start:.1f} s")
    lm = pipe.vision_language_encoder.model.language_model
    step_bytes = sum(p.numel() * p.element_size() for n, p in lm.named_parameters() if "embed" not in n)
    step_bytes += pipe.vision_language_encoder.lm_head.weight.nbytes
    bandwidth = copy_bandwidth("cuda")
    floor = 1e3 * step_bytes / bandwidth
    emit_row("floor: the language model's weights read once a step", f"{step_bytes / 1e9:.2f} GB / "
             f"{bandwidth / 1e12:.2f} TB/s (copy, measured) = {floor:.2f} ms per step")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        for group, prefix in ((4, 128), (16, 64)):
            ms = attempt(lambda: sampler_compare(pipe, "full depth bf16, 1024x1024", "cuda", group, 1024, 1024,
                                                 prefix=prefix, emit_row=emit_row), emit_row)
            if ms:
                emit_row(f"full depth, G = {group}: a group's sampling / the floor", f"{ms * 1280 / 1e3:.1f} s / "
                         f"{ms / floor:.2f}x the floor")
    pipe = lm = None  # the full-depth model's memory back before the tiny one (the lambdas above close over pipe)
    torch.cuda.empty_cache()
    tiny = grpo.load_glm_image("tiny", "cuda", torch.float32)
    attempt(lambda: sampler_compare(tiny, "tiny model on the GPU, float32, 96x96", "cuda", 8, H, W, repeats=3,
                                    emit_row=emit_row), emit_row)


def attempt(fn, emit_row):
    """fn(), or a row naming its error: one failing section does not lose the others (a GPU run is short)."""
    try:
        return fn()
    except Exception as error:  # noqa: BLE001
        import traceback
        traceback.print_exc()
        emit_row("error", f"{type(error).__name__}: {str(error).splitlines()[0][:300] if str(error) else ''}")


def sampler(device):
    print("| measurement | value |\n|---|---|")
    emit([], "machine", f"{torch.get_num_threads()} CPU threads, torch {torch.__version__}")
    row = functools.partial(emit, [])
    sampler_gpu(row) if device == "cuda" else sampler_cpu(row)


# ---- --gap: the sampler / trainer gap in bf16 --------------------------------------------------

def float32_logits(head, args, logits):
    """A forward hook on the lm_head: the logits computed and returned in float32 whatever the weights' dtype or
    autocast (MiniMax-M1's fix for the sampler / trainer gap), in the sampler and the trainer alike."""
    with torch.autocast(logits.device.type, enabled=False):
        return torch.nn.functional.linear(args[0].float(), head.weight.float())


def mismatch(trainer: torch.Tensor, sampled: torch.Tensor) -> dict:
    """TRL's mismatch metrics of the default correction (token_truncate at 2), as a run logs them."""
    return diagnostics.mismatch(trainer, sampled, "token_truncate", 2.0, grpo)


def gap_rows(pipe, name, group, size, top_p, emit_row, train_tokens="large"):
    """Sample a group in bf16 (autocast, as grpo.py on a GPU) and score it with the trainer, once with bf16 logits
    (grpo.py) and once with float32 logits (float32_logits): the gap per token, the sampled tokens outside the
    trainer's OWN nucleus (what the replayed support removes), and what --sampler-correction modes would do."""
    model = pipe.vision_language_encoder
    K = model.config.vq_config.num_embeddings
    device = model.device.type
    for logits in ("bf16", "float32"):
        hook = model.lm_head.register_forward_hook(float32_logits) if logits == "float32" else None
        with torch.autocast(device, dtype=torch.bfloat16), torch.no_grad():
            r = sample_group(pipe, PROMPT, group, size, size, T, seed=0, top_p=top_p)
            raw = grpo.token_logits(model, r.prompt.inputs, r.tokens)
            own = grpo.code_logprobs(raw, T, K, 0, top_p).gather(-1, r.tokens[..., None]).squeeze(-1)
            kept = None if r.support is None else fast_decode.code_support(r.support, K)
            replayed = grpo.code_logprobs(raw, T, K, 0, top_p, kept).gather(-1, r.tokens[..., None]).squeeze(-1)
        cols = slice(r.prompt.preview_hw[0] * r.prompt.preview_hw[1], None) if train_tokens == "large" else slice(None)
        m = mismatch(replayed[:, cols], r.q_logprobs[:, cols])
        seq = (replayed[:, cols] - r.q_logprobs[:, cols]).sum(1)  # log of each sequence's ratio
        outside = int((~own.isfinite()).sum())
        emit_row(f"{name}, {logits} logits: gap max / mean (nats), k3 KL",
                 f"{m['sampling/sampling_logp_difference/max']:.3g} / "
                 f"{m['sampling/sampling_logp_difference/mean']:.3g}, {m['sampling/k3_kl']:.2g}")
        emit_row(f"{name}, {logits} logits: sampled tokens outside the trainer's own nucleus -> with the support "
                 "replayed", f"{outside} of {own.numel()} -> {int((~replayed.isfinite()).sum())}")
        emit_row(f"{name}, {logits} logits: token ratios min / max; tokens > 2; sequences' log-ratio (large grid) "
                 "min / max; sequences with ratio > 2 (sequence_mask at 2 would drop them)",
                 f"{m['sampling/raw_importance_sampling_ratio/min']:.3f} / "
                 f"{m['sampling/raw_importance_sampling_ratio/max']:.3f}; "
                 f"{m['sampling/capped_frac']:.2%}; {seq.min():.2f} / {seq.max():.2f}; "
                 f"{int((seq > math.log(2)).sum())} of {len(seq)}")
        # the default objective (--policy-dist full): the mismatch on the whole softmax p, apart from the truncation
        with torch.no_grad():
            trainer_p = grpo.logprob_of(grpo.code_logprobs(raw, T, K), r.tokens)
        p_m = mismatch(trainer_p[:, cols], r.p_logprobs[:, cols])
        p_seq = (trainer_p[:, cols] - r.p_logprobs[:, cols]).sum(1)
        mass = variants.nucleus_mass(r.q_logprobs[:, cols], r.p_logprobs[:, cols])
        emit_row(f"{name}, {logits} logits, on p (--policy-dist full): gap max / mean (nats), k3 KL; token_truncate "
                 "weights min / max, capped share; sequences' log-ratio min / max; nucleus mass Z_t mean / min",
                 f"{p_m['sampling/sampling_logp_difference/max']:.3g} / "
                 f"{p_m['sampling/sampling_logp_difference/mean']:.3g}, {p_m['sampling/k3_kl']:.2g}; "
                 f"{p_m['sampling/importance_sampling_ratio/min']:.3f} / "
                 f"{p_m['sampling/importance_sampling_ratio/max']:.3f}, {p_m['sampling/capped_frac']:.2%}; "
                 f"{p_seq.min():.2f} / {p_seq.max():.2f}; {mass.mean():.3f} / {mass.min():.3f}")
        if hook is not None:
            hook.remove()


def gap(device):
    print("| measurement | value |\n|---|---|")
    row = functools.partial(emit, [])
    row("machine", f"{torch.get_num_threads()} CPU threads, torch {torch.__version__}" +
        (f", {torch.cuda.get_device_name()}" if device == "cuda" else ""))
    if device == "cuda":
        from helpers.offline_model import PUBLISHED, glm_image
        torch.set_default_dtype(torch.bfloat16)
        try:
            pipe = grpo.only_ar_trains(glm_image(PUBLISHED, device="cuda"))
        finally:
            torch.set_default_dtype(torch.float32)
        attempt(lambda: gap_rows(pipe, "full depth, 1024x1024, G = 4, top-p 0.75", 4, 1024, 0.75, row), row)
        return
    from helpers.offline_model import real_shapes_glm_image
    tiny = grpo.load_glm_image("tiny", dtype=torch.bfloat16)
    gap_rows(tiny, "tiny model bf16, 96x96, G = 8, top-p 0.75", 8, 96, 0.75, row)
    real = grpo.only_ar_trains(real_shapes_glm_image(ar=2))
    real.vision_language_encoder.to(torch.bfloat16)
    gap_rows(real, "published widths, 2 AR layers, bf16, 256x256, G = 2, top-p 0.75", 2, 256, 0.75, row)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--real-shapes", action="store_true", help="the published widths at 1024x1024 (minutes)")
    parser.add_argument("--sampler", action="store_true", help="the decode loop against generate (minutes)")
    parser.add_argument("--gap", action="store_true", help="the sampler / trainer gap in bf16 (minutes)")
    parser.add_argument("--device", default="cpu", help="--sampler, --gap: cpu, or cuda (the full depth on one GPU)")
    args = parser.parse_args()
    torch.manual_seed(0)
    if args.sampler or args.gap:
        if args.device == "cpu":
            torch.set_num_threads(1)
        (sampler if args.sampler else gap)(args.device)
        return
    if args.real_shapes:
        print("| measurement | value |\n|---|---|")
        emit([], "machine", f"{torch.get_num_threads()} CPU threads, torch {torch.__version__}")
        real_shapes([])
        return
    rows = [("machine", f"{torch.get_num_threads()} CPU threads, torch {torch.__version__}, tiny model, {H}x{W}")]
    pipe = grpo.load_glm_image("tiny")
    policy = pipe.vision_language_encoder
    r, adv = phases(pipe, policy, rows)
    batched_vs_sequential(pipe, rows)
    memory_vs_micro_batch(policy, r, adv, rows)
    full_vs_lora(rows)
    ocr_cost(rows)
    print("| measurement | value |\n|---|---|")
    for name, value in rows:
        print(f"| {name} | {value} |")


if __name__ == "__main__":
    main()
