"""Pre-train the tiny GLM-Image on world.py's shapes, so that `grpo.py --model tiny` draws what it is asked.

  python tools/train_tiny.py                          # ~30 min on 2 CPU cores; rewrites tiny_glm_image/
  python tools/train_tiny.py --quick --out /tmp/t     # a few steps of every stage (what the test runs)
  python tools/train_tiny.py --check-only             # re-measure the checks of tiny_glm_image/ (2 min)

The model is GLM-Image's own classes at small sizes (offline_model.WORLD: AR 0.7M parameters, DiT 1.3M, VAE 0.25M),
trained on CPU in the order the picture depends on them, with the pipeline's own conventions:

  1. Data: scenes of the training captions (world.caption_split: the held-out combinations never appear), rendered
     at 96x96; a cell's code is its world label (0 empty, 1..12 the objects).
  2. VAE (AutoencoderKL): reconstruction with a small KL, then the decoder alone (the encoder, and so the latents the
     DiT learns, stay fixed); latents_mean / latents_std from its latents, since the pipeline decodes
     latents * std + mean.
  3. VQ: the AR's vision tower keeps its random weights; its 1x1 quant_conv and codebook are fitted as a cosine
     classifier, so that get_image_tokens (the editing path) gives every 32-pixel cell its label.
  4. DiT (GlmImageTransformer2DModel): flow matching on (normalised latents, codes upsampled 2x as prior_token_ids).
     x_s = (1 - s) x0 + s noise, target noise - x0, timestep 1000 s - 1, half the sigmas at the points the pipeline
     steps through (t = int(linspace(1000, 1, n + 1)[:-1]) for 2 and 4 steps); the prior dropped for 10% of the
     samples, as the pipeline's unconditional branch drops it. Its text input is the T5 encoding of a caption with
     no quoted text (what the pipeline gives it for every prompt here).
  5. AR (GlmImageForConditionalGeneration): next-token prediction of caption -> preview grid -> large grid, with
     the 3D positions generation uses (grpo.rope_positions). The tiny preview grid (16x16, finer than the 3x3
     large grid: the processor sizes it so) is blank (all code 0); only the large grid reaches the DiT.
       a) without the 255 leading preview tokens (the prompt, the last preview token and the large grid at their
          true positions): short sequences, so the AR learns in minutes to read its caption. With all 265 tokens
          from the start a tiny AR never looks at the caption (../shared/GLM_IMAGE_NOTES.md).
       b) the whole sequence, as grpo.sample_groups generates it: it learns the blank preview and to read through it.
     A share of the pairs (--noise, 0.4) has a noisy caption: the picture has one mistake the caption does not
     mention (world.corrupt: an object too many or too few, a wrong colour, a wrong place), as web captions do.
     The pre-trained model makes such mistakes too, deliberately: GRPO's `shapes` reward has something to fix.
  6. save_pretrained of the whole pipeline (written beside --out and swapped in), reloaded with
     GlmImagePipeline.from_pretrained, and its held-out accuracy measured through grpo.sample_groups,
     grpo.decode_images and the shapes reward (bench_learning.shapes_accuracy: the fraction of held-out captions x
     samples drawn fully right, at grpo.py's tiny settings).

Deterministic for a --seed on a given machine and thread count. Every stage prints its time and numbers.
"""

import argparse
import json
import math
import random
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # grpo.py and the files it imports live in the repository root

import grpo  # noqa: E402
from helpers import run, trainer  # noqa: E402
from helpers import run_io  # noqa: E402
from helpers import offline_model  # noqa: E402
from helpers import world  # noqa: E402
from bench_learning import shapes_accuracy  # noqa: E402  (tools/, beside this file)

SIZE, N_LARGE = world.SIZE, world.GRID * world.GRID
STEPS = dict(vae=700, vae_decoder=500, vq=400, dit=4000, ar_short=1800, ar_full=3000)  # the full recipe
QUICK = dict(vae=3, vae_decoder=2, vq=5, dit=3, ar_short=3, ar_full=2)


def log(message: str) -> None:
    print(message, flush=True)


def cosine_lr(step: int, total: int, peak: float, warmup: int = 100, floor: float = 0.05) -> float:
    """Linear warm-up to `peak`, then a cosine down to floor * peak."""
    progress = min(1.0, step / max(1, total))
    return peak * min(1.0, (step + 1) / warmup) * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


def set_lr(optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


# ---- 1. Data -------------------------------------------------------------------------------------

def captions_by_kind(captions: list[str]) -> dict[str, list[str]]:
    return {kind: [c for c in captions if world.parse_caption(c)["kind"] == kind] for kind in world.KINDS}


def draw_pair(rng: random.Random, by_kind: dict, noise: float) -> tuple[str, dict]:
    """A caption (a kind, then a caption of it, uniformly) and a scene for it; with probability `noise` the scene
    carries one mistake the caption does not mention."""
    caption = rng.choice(by_kind[rng.choice(world.KINDS)])
    scene = world.sample_scene(caption, rng)
    return caption, world.corrupt(scene, caption, rng) if rng.random() < noise else scene


def pictures(n: int, rng: random.Random, by_kind: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """n rendered scenes (n, 3, 96, 96) in [0, 1] and their cell labels (n, 9); the decoder never reads captions."""
    images, labels = [], []
    for _ in range(n):
        _, scene = draw_pair(rng, by_kind, noise=0.0)
        images.append(np.asarray(world.render(scene, rng)))
        labels.append(world.labels(scene))
    return torch.from_numpy(np.stack(images)).permute(0, 3, 1, 2).float() / 255, torch.tensor(labels)


# ---- 2. VAE --------------------------------------------------------------------------------------

def train_vae(vae, images: torch.Tensor, steps: int, decoder_steps: int, seed: int, batch: int = 16) -> None:
    """Reconstruction (MSE + 0.1 L1) with a KL weight of 1e-3 per pixel, then the decoder alone on the encoder's
    mean latents (lr 2e-3, then 1e-3; cosine)."""
    generator = torch.Generator().manual_seed(seed)
    vae.train().requires_grad_(True)
    for phase, n, peak in (("vae", steps, 2e-3), ("vae decoder", decoder_steps, 1e-3)):
        params = list(vae.parameters()) if phase == "vae" else list(vae.decoder.parameters())
        optimizer = torch.optim.AdamW(params, lr=peak, weight_decay=0.0)
        start = time.perf_counter()
        for step in range(n):
            x = images[torch.randint(0, len(images), (batch,), generator=generator)] * 2 - 1
            if phase == "vae":
                posterior = vae.encode(x).latent_dist
                z, kl = posterior.sample(generator=generator), posterior.kl().mean() / x[0].numel()
            else:
                with torch.no_grad():
                    z, kl = vae.encode(x).latent_dist.mode(), torch.zeros(())
            out = vae.decode(z).sample
            loss = F.mse_loss(out, x) + 0.1 * F.l1_loss(out, x) + 1e-3 * kl
            set_lr(optimizer, cosine_lr(step, n, peak, warmup=50))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        log(f"  {phase}: {n} steps, {time.perf_counter() - start:.0f} s, last loss {loss.item():.4f}")
    vae.eval().requires_grad_(False)


@torch.no_grad()
def encode(vae, images: torch.Tensor, batch: int = 100) -> torch.Tensor:
    return torch.cat([vae.encode(images[i:i + batch] * 2 - 1).latent_dist.mode() for i in range(0, len(images), batch)])


# ---- 3. VQ ---------------------------------------------------------------------------------------

@torch.no_grad()
def vision_features(pipe, images: torch.Tensor, batch: int = 256) -> torch.Tensor:
    """(n, 3, H, W) -> (n, 9, C): the vision tower's feature of each cell, through the processor (the editing path)."""
    ar, processor = pipe.vision_language_encoder, pipe.processor.image_processor
    features = []
    for i in range(0, len(images), batch):
        pixels = processor([grpo.to_pil(im) for im in images[i:i + batch]], return_tensors="pt")
        maps = ar.model.get_image_features(pixels["pixel_values"], pixels["image_grid_thw"],
                                           return_dict=True).pooler_output  # n x (C, 3, 3)
        features += [m.flatten(1).T for m in maps]
    return torch.stack(features)


def fit_vq(pipe, features: torch.Tensor, labels: torch.Tensor, steps: int) -> float:
    """Fit the VQ's quant_conv (1x1) and codebook so that the nearest (L2-normalised) entry of a cell's feature is
    its label: a cosine classifier trained with cross-entropy at temperature 0.05. Returns its training accuracy."""
    vq = pipe.vision_language_encoder.model.vqmodel
    conv, codebook = vq.quant_conv, vq.quantize.embedding
    x, y = features.reshape(-1, features.shape[-1]), labels.reshape(-1)
    optimizer = torch.optim.Adam([conv.weight, conv.bias, codebook.weight], lr=1e-2)
    with torch.enable_grad():
        conv.requires_grad_(True), codebook.requires_grad_(True)
        for _ in range(steps):
            h = F.linear(x, conv.weight[:, :, 0, 0], conv.bias)
            logits = F.normalize(h, dim=-1) @ F.normalize(codebook.weight, dim=-1).T / 0.05
            loss = F.cross_entropy(logits, y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    vq.requires_grad_(False)
    return (logits.argmax(-1) == y).float().mean().item()


@torch.no_grad()
def vq_codes(pipe, images: torch.Tensor) -> torch.Tensor:
    """(n, 3, H, W) -> (n, 9) codes from the AR's own path: vision tower, quant_conv, nearest codebook entry."""
    ar, processor = pipe.vision_language_encoder, pipe.processor.image_processor
    pixels = processor([grpo.to_pil(im) for im in images], return_tensors="pt")
    maps = ar.model.get_image_features(pixels["pixel_values"], pixels["image_grid_thw"], return_dict=True).pooler_output
    return ar.model.get_image_tokens(maps).view(len(images), -1)


# ---- 4. DiT --------------------------------------------------------------------------------------

def train_dit(pipe, latents: torch.Tensor, labels: torch.Tensor, steps: int, seed: int, batch: int = 32,
              peak: float = 1e-3) -> None:
    """Flow matching with the pipeline's timestep convention (see the module docstring)."""
    dit = pipe.transformer.train().requires_grad_(True)
    with torch.no_grad():
        text, _ = pipe.encode_prompt("a red circle", do_classifier_free_guidance=False, device="cpu")
    grid = world.GRID
    prior = F.interpolate(labels.view(-1, 1, grid, grid).float(), scale_factor=2, mode="nearest").long()
    prior = prior.view(len(labels), -1)  # (n, 36): the codes at H/16, as decode_images passes them
    points = torch.tensor(sorted({int(t) / 1000 for n in (2, 4) for t in np.linspace(1000, 1, n + 1)[:-1]}))
    size, crop = torch.tensor([[float(SIZE), float(SIZE)]]).expand(batch, -1), torch.zeros(batch, 2)
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(dit.parameters(), lr=peak, weight_decay=0.0)
    start, losses = time.perf_counter(), []
    for step in range(steps):
        index = torch.randint(0, len(latents), (batch,), generator=generator)
        x0 = latents[index]
        noise = torch.randn(x0.shape, generator=generator)
        uniform = torch.rand(batch, generator=generator).clamp(1e-3, 1.0)
        on_schedule = points[torch.randint(0, len(points), (batch,), generator=generator)]
        sigma = torch.where(torch.rand(batch, generator=generator) < 0.5, on_schedule, uniform)
        s = sigma.view(-1, 1, 1, 1)
        drop = (torch.rand(batch, generator=generator) < 0.1)[:, None].expand(-1, prior.shape[1])
        velocity = dit(hidden_states=(1 - s) * x0 + s * noise, encoder_hidden_states=text.expand(batch, -1, -1),
                       prior_token_id=prior[index], prior_token_drop=drop, timestep=sigma * 1000 - 1,
                       target_size=size, crop_coords=crop, return_dict=False)[0]
        loss = F.mse_loss(velocity, noise - x0)
        set_lr(optimizer, cosine_lr(step, steps, peak))
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(dit.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.item())
        if (step + 1) % 1000 == 0:
            log(f"  dit step {step + 1}: loss {np.mean(losses[-1000:]):.4f}, {time.perf_counter() - start:.0f} s")
    log(f"  dit: {steps} steps, {time.perf_counter() - start:.0f} s, last loss {np.mean(losses[-100:]):.4f}")
    dit.eval().requires_grad_(False)


# ---- 5. AR ---------------------------------------------------------------------------------------

class Prompts:
    """Each caption's prompt ids and the 3D positions of prompt + preview + large grid (cached)."""

    def __init__(self, pipe):
        self.pipe, self.cache = pipe, {}
        config = pipe.vision_language_encoder.config
        self.ids = (config.image_start_token_id, config.image_end_token_id)

    def __call__(self, caption: str) -> tuple[torch.Tensor, torch.Tensor]:
        if caption not in self.cache:
            inputs = grpo.group_inputs(self.pipe.processor, caption, 1, SIZE, SIZE, "cpu")
            n = 256 + N_LARGE
            positions = grpo.rope_positions(inputs["input_ids"][0], inputs["image_grid_thw"][:2], n, *self.ids)
            self.cache[caption] = (inputs["input_ids"][0], positions[:, 0])
        return self.cache[caption]


def left_padded(rows: list[tuple], pad_id: int) -> tuple:
    """(inputs (n,), positions (3, n), targets (n,)) rows of different lengths -> input_ids, attention_mask,
    position_ids (3, B, L) and targets (B, L), left-padded to the longest (pad_id, mask 0, target -100)."""
    B, L = len(rows), max(len(r[0]) for r in rows)
    input_ids, mask = torch.full((B, L), pad_id), torch.zeros(B, L, dtype=torch.long)
    position_ids, targets = torch.zeros(3, B, L, dtype=torch.long), torch.full((B, L), -100)
    for b, (inputs, pos, target) in enumerate(rows):
        n = len(inputs)
        input_ids[b, L - n:], mask[b, L - n:], position_ids[:, b, L - n:], targets[b, L - n:] = inputs, 1, pos, target
    return input_ids, mask, position_ids, targets


def ar_batch(prompts: Prompts, pairs: list[tuple[str, dict]], short: bool, pad_id: int):
    """Left-padded teacher-forcing inputs for (caption, scene) pairs -> input_ids, attention_mask, position_ids
    (3, B, L), targets (B, L) (-100: no loss) and which targets are large-grid tokens (B, L). targets[:, j] is what
    the logits at j predict. short: only the last preview token is kept before the large grid (positions unchanged)."""
    rows = []
    for caption, scene in pairs:
        ids, positions = prompts(caption)
        P = len(ids)
        tokens = torch.tensor([0] * 256 + world.labels(scene))  # blank preview, then the large grid
        if short:
            keep = torch.cat([torch.arange(P), torch.arange(P + 255, P + 264)])
            inputs, pos = torch.cat([ids, tokens[255:-1]]), positions[:, keep]
            targets = torch.cat([torch.full((P,), -100), tokens[256:]])
        else:
            inputs, pos = torch.cat([ids, tokens[:-1]]), positions
            targets = torch.cat([torch.full((P - 1,), -100), tokens])
        rows.append((inputs, pos, targets))
    input_ids, mask, position_ids, targets = left_padded(rows, pad_id)
    B, L = input_ids.shape
    large = torch.zeros(B, L, dtype=torch.bool)
    large[:, -N_LARGE:] = True  # the last 9 targets of every row are the large grid
    return input_ids, mask, position_ids, targets, large


def train_ar(pipe, by_kind: dict, steps: int, short: bool, seed: int, noise: float, batch: int, peak: float) -> None:
    """Next-token prediction; the loss weighs the 9 large-grid tokens and the 256 preview tokens equally in all."""
    ar = pipe.vision_language_encoder
    ar.train().requires_grad_(True)
    ar.model.visual.requires_grad_(False), ar.model.vqmodel.requires_grad_(False)
    K, pad = ar.config.vq_config.num_embeddings, ar.config.image_end_token_id
    prompts, rng = Prompts(pipe), random.Random(seed)
    optimizer = torch.optim.AdamW([p for p in ar.parameters() if p.requires_grad], lr=peak, betas=(0.9, 0.98),
                                  weight_decay=0.01)
    start, large_losses = time.perf_counter(), []
    for step in range(steps):
        pairs = [draw_pair(rng, by_kind, noise) for _ in range(batch)]
        input_ids, mask, positions, targets, large = ar_batch(prompts, pairs, short, pad)
        logits = ar(input_ids=input_ids, attention_mask=mask, position_ids=positions, use_cache=False).logits
        ce = F.cross_entropy(logits[..., :K].float().flatten(0, 1), targets.flatten().clamp_min(0),
                             reduction="none").view_as(targets)
        seen = targets >= 0
        weight = torch.where(large, 1.0, N_LARGE / 256) * seen
        loss = (ce * weight).sum() / weight.sum()
        set_lr(optimizer, cosine_lr(step, steps, peak))
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ar.parameters(), 1.0)
        optimizer.step()
        large_losses.append((ce * large).sum().item() / large.sum().item())
        if (step + 1) % 500 == 0:
            log(f"  ar {'short' if short else 'full'} step {step + 1}: large-grid loss "
                f"{np.mean(large_losses[-500:]):.4f}, {time.perf_counter() - start:.0f} s")
    log(f"  ar {'short' if short else 'full'}: {steps} steps, {time.perf_counter() - start:.0f} s, large-grid loss "
        f"{np.mean(large_losses[-100:]):.4f}")
    ar.eval()


# ---- 6. Save and check ---------------------------------------------------------------------------

def swap_in(tmp: Path, out: Path) -> None:
    """Replace `out` by the finished folder `tmp` (the old one is removed only once the new one is in place)."""
    old = out.with_name(out.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if out.exists():
        out.rename(old)
    tmp.rename(out)
    shutil.rmtree(old, ignore_errors=True)


def dit_check(pipe, test_labels: torch.Tensor, seed: int) -> float:
    """The fraction of pictures whose codes (N, 9) the DiT + VAE decode, at grpo.py's tiny settings (steps, guidance),
    into pictures read back (world.read_scene) as exactly those objects in those cells."""
    cfg = trainer.parse_config(grpo, ["--model", "tiny"])
    zeros = torch.zeros(len(test_labels), 256, dtype=torch.long)  # the blank preview
    decoded = torch.cat([grpo.decode_images(pipe, "", torch.cat([zeros, test_labels], 1)[i:i + 50], (3, 3), SIZE, SIZE,
                                            cfg.num_inference_steps, seed, cfg.guidance_scale)
                         for i in range(0, len(test_labels), 50)])
    read = [{(r, c): o for r, c, o in world.read_scene(im)} for im in (decoded.permute(0, 2, 3, 1) * 255).byte().numpy()]
    return float(np.mean([r == world.scene_of_labels(l.tolist()) for r, l in zip(read, test_labels)]))


def check_only(args) -> dict:
    """Re-measure the checks of the checkpoint in --out (the DiT's decoding and the held-out accuracy, at grpo.py's
    current tiny settings) and update those fields of its training_report.json; the weights are not touched."""
    from diffusers import GlmImagePipeline
    out = Path(args.out)
    report = json.loads((out / "training_report.json").read_text())
    seed = report["seed"]
    train_captions, held_out = world.caption_split()
    _, test_labels = pictures(200, random.Random(seed + 1), captions_by_kind(train_captions))
    pipe = grpo.only_ar_trains(GlmImagePipeline.from_pretrained(out))
    pipe.set_progress_bar_config(disable=True)
    report["dit_decoded_right"] = dit_check(pipe, test_labels, seed)
    report["held_out"] = shapes_accuracy(pipe, held_out[:args.eval_captions], 8, seed)
    report["checked_with"] = {k: getattr(trainer.parse_config(grpo, ["--model", "tiny"]), k)
                              for k in ("height", "width", "num_inference_steps", "guidance_scale", "temperature")}
    run_io.atomic_write(out / "training_report.json", lambda f: f.write((json.dumps(report, indent=1) + "\n").encode()))
    log(f"re-checked {out}: dit decoded right {report['dit_decoded_right']:.3f}, held-out accuracy "
        f"{report['held_out']['accuracy']:.3f}")
    return report


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(ROOT / "tiny_glm_image"), help="checkpoint folder to write")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--noise", type=float, default=0.4, help="share of pre-training pairs with a noisy caption")
    parser.add_argument("--images", type=int, default=4000, help="rendered pictures for the VAE, VQ and DiT")
    parser.add_argument("--eval-captions", type=int, default=161, help="held-out captions in the final check (all: 161)")
    parser.add_argument("--quick", action="store_true", help="a few steps of every stage (for the test)")
    parser.add_argument("--check-only", action="store_true", help="re-measure the checks of the checkpoint in --out")
    args = parser.parse_args(argv)
    run.quiet_libraries()
    if args.check_only:
        return check_only(args)
    steps = QUICK if args.quick else STEPS
    n_images = 32 if args.quick else args.images
    torch.manual_seed(args.seed)
    total = time.perf_counter()
    seconds = {}

    start = time.perf_counter()
    train_captions, held_out = world.caption_split()
    by_kind = captions_by_kind(train_captions)
    pipe = offline_model.glm_image(offline_model.WORLD, args.seed)
    pipe.set_progress_bar_config(disable=True)
    for module in (pipe.text_encoder, pipe.vision_language_encoder, pipe.transformer, pipe.vae):
        module.eval().requires_grad_(False)
    grpo.disable_dropout(pipe.vision_language_encoder)
    images, labels = pictures(n_images, random.Random(args.seed), by_kind)
    test_images, test_labels = pictures(min(200, n_images), random.Random(args.seed + 1), by_kind)
    seconds["data"] = time.perf_counter() - start
    log(f"1. data: {n_images} pictures of {len(train_captions)} training captions ({len(held_out)} held out), "
        f"{seconds['data']:.0f} s")

    start = time.perf_counter()
    train_vae(pipe.vae, images, steps["vae"], steps["vae_decoder"], args.seed)
    latents = encode(pipe.vae, images)
    mean, std = latents.mean(dim=(0, 2, 3)), latents.std(dim=(0, 2, 3))
    pipe.vae.register_to_config(latents_mean=mean.tolist(), latents_std=std.tolist())
    with torch.no_grad():
        decoded = ((pipe.vae.decode(encode(pipe.vae, test_images)).sample + 1) / 2).clamp(0, 1)
    psnr = -10 * math.log10(F.mse_loss(decoded, test_images).item())
    seconds["vae"] = time.perf_counter() - start
    log(f"2. vae: PSNR {psnr:.1f} dB on {len(test_images)} new pictures, {seconds['vae']:.0f} s")

    start = time.perf_counter()
    fitted = fit_vq(pipe, vision_features(pipe, images[:2000]), labels[:2000], steps["vq"])
    codes_right = (vq_codes(pipe, test_images) == test_labels).float().mean().item()
    seconds["vq"] = time.perf_counter() - start
    log(f"3. vq: cells coded right {fitted:.4f} (fitted), {codes_right:.4f} (new pictures), {seconds['vq']:.0f} s")

    start = time.perf_counter()
    normalised = (latents - mean.view(1, -1, 1, 1)) / std.view(1, -1, 1, 1)
    train_dit(pipe, normalised, labels, steps["dit"], args.seed)
    decoded_right = dit_check(pipe, test_labels, args.seed)
    seconds["dit"] = time.perf_counter() - start
    log(f"4. dit: new pictures decoded from their codes and read back fully right {decoded_right:.3f} "
        f"(grpo.py's tiny settings), {seconds['dit']:.0f} s")

    start = time.perf_counter()
    train_ar(pipe, by_kind, steps["ar_short"], short=True, seed=args.seed, noise=args.noise, batch=64, peak=2e-3)
    train_ar(pipe, by_kind, steps["ar_full"], short=False, seed=args.seed + 1, noise=args.noise, batch=16, peak=1e-3)
    seconds["ar"] = time.perf_counter() - start
    log(f"5. ar: {seconds['ar']:.0f} s")

    start = time.perf_counter()
    out = Path(args.out)
    tmp = out.with_name(out.name + ".tmp")  # written in full, checked, then swapped in: `out` is never half-written
    shutil.rmtree(tmp, ignore_errors=True)
    pipe.save_pretrained(tmp)
    from diffusers import GlmImagePipeline
    loaded = grpo.only_ar_trains(GlmImagePipeline.from_pretrained(tmp))
    captions = held_out[:args.eval_captions]
    samples = 2 if args.quick else 8
    captions = captions[:2] if args.quick else captions
    result = shapes_accuracy(loaded, captions, samples, args.seed)
    seconds["check"] = time.perf_counter() - start
    size = sum(f.stat().st_size for f in tmp.rglob("*") if f.is_file()) / 2 ** 20
    report = {"seed": args.seed, "noise": args.noise, "steps": steps, "vae_psnr": psnr, "vq_cells_right": codes_right,
              "dit_decoded_right": decoded_right, "held_out": result, "seconds": seconds,
              "minutes": (time.perf_counter() - total) / 60, "size_mb": size, "torch_threads": torch.get_num_threads(),
              "checked_with": {k: getattr(trainer.parse_config(grpo, ["--model", "tiny"]), k)
                               for k in ("height", "width", "num_inference_steps", "guidance_scale", "temperature")}}
    (tmp / "training_report.json").write_text(json.dumps(report, indent=1) + "\n")
    swap_in(tmp, out)
    log(f"6. saved {out} ({size:.1f} MB); reloaded with GlmImagePipeline.from_pretrained: held-out accuracy "
        f"{result['accuracy']:.3f} ({len(captions)} captions x {samples} samples, T 0.9), reward {result['reward']:.3f}; "
        + ", ".join(f"{k} {result[k]:.2f}" for k in world.KINDS if k in result))
    log(f"total {report['minutes']:.1f} min")
    return report


if __name__ == "__main__":
    main()
