"""One denoising step of GLM-Image's DiT at its full published depth (random bf16 weights, no hub): seconds, FLOPs
(torch's FlopCounterMode), and model-FLOPs utilisation against a bf16 matmul measured on the same GPU; per attention
backend (diffusers' set_attention_backend), the guidance branches as two calls of B images (what GlmImagePipeline does)
against one call of 2B, and the blocks compiled (torch.compile per block), each with its output's distance from the
default's (bf16 rounding: compare with the distance of two bf16 runs of different batch sizes).

    python tools/bench_dit_step.py                                  # one GPU: 4 images, 1024x1024 (about 2 minutes)
    python tools/bench_dit_step.py --layers 1 --size 256 --device cpu --dtype float32   # a dry run on the CPU

A decode of --images pictures is --steps denoising steps of 2 calls each (guidance 1.5), then the VAE: the DiT's part of
it and its floor (the FLOPs at the measured matmul rate) are printed at the end.
"""

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from helpers.offline_model import PUBLISHED  # noqa: E402

BACKENDS = ["native", "_native_flash", "_native_efficient", "_native_cudnn"]


def clock(fn, device: str, repeats: int) -> float:
    """Seconds per call of fn(): one warm-up, then the mean of `repeats` (synchronised on CUDA)."""
    fn()
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    sync()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    sync()
    return (time.perf_counter() - start) / repeats


def matmul_peak(device: str, dtype: torch.dtype) -> float:
    """FLOP/s of an 8192^3 matmul (the ceiling MFU is measured against; 1 on the CPU's dry run)."""
    if not device.startswith("cuda"):
        return float("nan")
    a, b = (torch.randn(8192, 8192, device=device, dtype=dtype) for _ in range(2))
    return 2 * 8192 ** 3 / clock(lambda: a @ b, device, 10)


def inputs(images: int, size: int, text: int, drop: bool, device: str, dtype: torch.dtype, seed: int) -> dict:
    """The DiT's inputs for one branch at one denoising step: latents, glyph embeddings, prior tokens (dropped for the
    unconditional branch), timestep, size and crop."""
    g = torch.Generator().manual_seed(seed)
    side = size // 8  # the VAE's 8x; the DiT patches 2x2 of them: (size / 16)^2 image tokens
    prior = torch.randint(0, PUBLISHED["dit"]["prior_vq_quantizer_codebook_size"], (images, (side // 2) ** 2),
                          generator=g)
    return dict(hidden_states=torch.randn(images, 16, side, side, generator=g).to(device, dtype),
                encoder_hidden_states=torch.randn(images, text, PUBLISHED["dit"]["text_embed_dim"],
                                                  generator=g).to(device, dtype),
                prior_token_id=prior.to(device), prior_token_drop=torch.full_like(prior, drop, dtype=torch.bool,
                                                                                 device=device),
                timestep=torch.full((images,), 500.0, device=device),
                target_size=torch.tensor([[size, size]] * images, device=device, dtype=dtype),
                crop_coords=torch.zeros(images, 2, device=device, dtype=dtype), return_dict=False)


def cat(a: dict, b: dict) -> dict:
    return {k: torch.cat([a[k], b[k]]) if torch.is_tensor(a[k]) else a[k] for k in a}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--layers", type=int, default=PUBLISHED["dit"]["num_layers"], help="DiT blocks (published: 30)")
    p.add_argument("--size", type=int, default=1024)
    p.add_argument("--images", type=int, default=4, help="images a branch (the group size G)")
    p.add_argument("--text", type=int, default=16, help="glyph tokens (T5 embeddings of the quoted text)")
    p.add_argument("--steps", type=int, default=50, help="denoising steps of a decode (for its floor)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-compile", action="store_true")
    args = p.parse_args(argv)
    from diffusers import GlmImageTransformer2DModel
    from diffusers.utils import logging
    from torch.utils.flop_counter import FlopCounterMode
    logging.set_verbosity_error()  # "attention backends are an experimental feature", once per switch

    dtype, dev = getattr(torch, args.dtype), args.device
    torch.manual_seed(0)
    start = time.perf_counter()
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # built in bf16 directly: no float32 copy of 7B parameters first
    with torch.device(dev):
        dit = GlmImageTransformer2DModel(**{**PUBLISHED["dit"], "num_layers": args.layers}).eval()
    torch.set_default_dtype(default)
    params = sum(p.numel() for p in dit.parameters())
    name = torch.cuda.get_device_name() if dev.startswith("cuda") else "CPU"
    print(f"{name}, torch {torch.__version__}: DiT {args.layers} blocks, {params / 1e9:.2f}B parameters, {args.dtype},"
          f" built in {time.perf_counter() - start:.1f} s; {args.images} images a branch at {args.size}x{args.size}"
          f" ({(args.size // 16) ** 2} image + {args.text} text tokens)")
    peak = matmul_peak(dev, dtype)
    cond = inputs(args.images, args.size, args.text, False, dev, dtype, 0)
    uncond = {**cond, "prior_token_drop": torch.ones_like(cond["prior_token_drop"]),
              "encoder_hidden_states": inputs(args.images, args.size, args.text, True, dev, dtype, 1)[
                  "encoder_hidden_states"]}
    both = cat(cond, uncond)

    with torch.no_grad():
        with FlopCounterMode(display=False) as counter:
            dit(**cond)
        flops = counter.get_total_flops()  # one call of B images
        rows, outputs = [], {}
        for backend in BACKENDS:
            try:
                dit.set_attention_backend(backend)
                out = dit(**cond)[0].float()
                sec = clock(lambda: dit(**cond), dev, args.repeats)
            except Exception as error:  # a backend this torch / GPU / dtype does not run
                rows.append((f"attention {backend}", None, str(error).splitlines()[0][:90]))
                continue
            outputs[backend] = out
            rows.append((f"attention {backend}", sec, out))
        best = min((r for r in rows if r[1] is not None), key=lambda r: r[1])[0].split()[-1]
        dit.set_attention_backend(best)
        two = clock(lambda: (dit(**cond), dit(**uncond)), dev, args.repeats)
        one_out = dit(**both)[0].float()
        one = clock(lambda: dit(**both), dev, args.repeats)
        rows.append((f"guidance: 2 calls of {args.images} ({best})", two / 2, None))
        rows.append((f"guidance: 1 call of {2 * args.images} ({best})", one / 2, one_out[:args.images]))
        if not args.no_compile:
            start = time.perf_counter()
            for block in dit.transformer_blocks:
                block.compile()
            out = dit(**cond)[0].float()
            compile_s = time.perf_counter() - start
            rows.append((f"blocks compiled ({best}; compiling {compile_s:.0f} s)", clock(lambda: dit(**cond), dev,
                                                                                          args.repeats), out))

    reference = outputs["native"]
    print(f"one call = {flops / 1e12:.2f} TFLOP; bf16 matmul {peak / 1e12:.0f} TFLOP/s measured here\n")
    print("| one call of the DiT (B images) | ms | MFU | max abs diff from native | relative |")
    print("|---|---|---|---|---|")
    for label, sec, out in rows:
        if sec is None:
            print(f"| {label} | - | - | {out} | |")
            continue
        diff = "" if out is None else f"{(out - reference).abs().max().item():.3g}"
        rel = "" if out is None else f"{((out - reference).norm() / reference.norm()).item():.2e}"
        print(f"| {label} | {sec * 1e3:.1f} | {flops / sec / peak:.1%} | {diff} | {rel} |")
    fastest = min(r[1] for r in rows if r[1] is not None)
    calls = 2 * args.steps
    print(f"\ndecode's DiT part: {calls} calls ({args.steps} steps x 2 branches): {calls * fastest:.1f} s at the fastest"
          f" row, {calls * rows[0][1]:.1f} s at native; floor {calls * flops / peak:.1f} s (the FLOPs at the matmul"
          " rate)")


if __name__ == "__main__":
    main()
