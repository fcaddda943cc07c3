"""GLM-Image's real token layout on the tiny model's widths: 1024x1024 and 1024x768 (256 preview tokens, then the
(H/32) x (W/32) large grid, N = 1280), sampler and trainer exact there, the DiT decoding it; and the loss's
bookkeeping at the real model's sizes (N = 1280 tokens, K = 16384 codes). About 2 minutes on 2 cores."""

import copy
import functools

import pytest
import torch

import grpo
from helpers import diagnostics, trainer, variants
from tests.conftest import CORRECTIONS, PARITY, T, sample_group, sampled_rows
from tests.conftest import sharp_pipe  # noqa: F401  the sharpened tiny model (a fixture)


@pytest.fixture(scope="module", params=[(1024, 1024), (1024, 768)], ids=["1024x1024", "1024x768"])
def real_size_rollout(request, sharp_pipe):
    """One G=2 group on the sharpened tiny model at a real resolution (~10 s each on 2 cores)."""
    height, width = request.param
    return height, width, sample_group(sharp_pipe, "a cat", 2, height, width, T, seed=0)


def test_real_resolution_layout(real_size_rollout):
    """256-ish preview tokens then the (H/32) x (W/32) large grid: N = 1280 at 1024x1024, as the real model writes."""
    height, width, r = real_size_rollout
    assert r.prompt.large_hw == (height // 32, width // 32)
    n = r.prompt.preview_hw[0] * r.prompt.preview_hw[1] + r.prompt.large_hw[0] * r.prompt.large_hw[1]
    assert r.tokens.shape == (2, n) and (n == 1280 if (height, width) == (1024, 1024) else n > 1000)
    positions = grpo.rope_positions(r.prompt.inputs["input_ids"][0], r.prompt.inputs["image_grid_thw"][:2], n, 128, 129)
    P = r.prompt.inputs["input_ids"].shape[1]
    large = positions[:, 0, P + r.prompt.preview_hw[0] * r.prompt.preview_hw[1]:]  # the large grid as inputs (all but its last)
    assert large[1].max() - large[1].min() == r.prompt.large_hw[0] - 1 and large[2].max() - large[2].min() == r.prompt.large_hw[1] - 1


def test_real_resolution_parity(real_size_rollout, sharp_pipe):
    """Sampler vs trainer log-probs within 2e-5 (float32) over all N tokens at a real resolution; a train_step
    there has ratio exactly 1 and moves the weights. (The sharpened model multiplies its logits by 16, and over 1280
    tokens the two attention paths' rounding reached 1.03e-5 on this project's 2-core CPU, 2026-11-27: the 64x64
    cases hold 1e-5.)"""
    height, width, r = real_size_rollout
    ar = sharp_pipe.vision_language_encoder
    with torch.no_grad():
        lp = grpo.token_logprobs(ar, r.prompt.inputs, r.tokens, T)
    assert (lp - r.q_logprobs).abs().max() <= 2 * PARITY
    policy = copy.deepcopy(ar)
    opt = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=1e-3)
    before = policy.lm_head.weight.detach().clone()
    readings = diagnostics.reader(trainer.parse_config(grpo, []), ar.config.vq_config.num_embeddings, grpo)
    loss = functools.partial(grpo.micro_batch_loss, clip_eps=0.2, kl_beta=0.0)
    m = trainer.train_step(grpo, policy, opt, trainer.micro_batches([r], torch.tensor([[1.0, -1.0]]), 1), None, loss,
                           temperature=T, mu=1, max_grad_norm=1.0, readings=readings)
    assert m["ratio_min"] == m["ratio_max"] == 1.0 and m["sampler_gap"] <= 2 * PARITY and m["skipped"] == 0
    assert not torch.equal(before, policy.lm_head.weight)


def test_real_resolution_decode(real_size_rollout, sharp_pipe):
    """The DiT decodes the (H/32) x (W/32) grid, upsampled 2x, into (G, 3, H, W) images in [0, 1]."""
    height, width, r = real_size_rollout
    images = grpo.decode_images(sharp_pipe, "a cat", r.tokens, r.prompt.large_hw, height, width, 1, seed=0)
    assert images.shape == (2, 3, height, width) and images.min() >= 0 and images.max() <= 1
    assert (images[0] - images[1]).abs().max() > 1e-3  # two different token grids, two images


def test_corrections_real_size():
    """The loss's bookkeeping at the real model's sizes (random logits, float32, a sampler with no rounding gap): every
    --sampler-correction mode gives the uncorrected gradient (1e-6), on the whole softmax and on the nucleus (the
    variant --policy-dist truncated), at top-p 1 and 0.75; --truncation-weight mass weighs it down (a nucleus' mass),
    never to 0 (before the corrections were kept apart, a sequence mode multiplied 1280 masses: a weight of 0); the
    mismatch metrics read no gap."""
    S, N, K = 1, 1280, 16384  # one sequence: the sequence modes' product runs over its 1280 tokens
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(S, N, K, generator=g) * 3
    norms = {}
    for top_p in (1.0, 0.75):
        mb = sampled_rows(logits, top_p, g, advantages=(1.0,))
        for dist, weight in [("full", "none"), ("full", "mass"), ("truncated", "none")]:
            trained = None
            for mode in CORRECTIONS:
                cfg = trainer.parse_config(grpo, ["--top-p", str(top_p), "--policy-dist", dist, "--truncation-weight",
                                                  weight, "--train-tokens", "all", "--kl-beta", "0",
                                                  "--sampler-correction", mode])
                trained = variants.on_truncation(mb, K, top_p < 1) if dist == "truncated" else mb
                x = logits.clone().requires_grad_()
                distribution = variants.distribution(grpo, x, T, K, trained.support)
                old = grpo.logprob_of(distribution, trained.tokens).detach()
                loss, _ = variants.variant_loss(distribution, trained, old, None, lesson_loss=grpo.micro_batch_loss,
                                                cfg=cfg, threshold=None)
                loss.backward()
                norms[top_p, dist, weight, mode] = x.grad.norm().item()
            m = diagnostics.mismatch(old, trained.sampler_logprobs, "token_truncate", 2.0, grpo)
            assert m["sampling/sampling_logp_difference/max"] <= 1e-5, (top_p, dist, weight)
            assert abs(m["sampling/importance_sampling_ratio/mean"] - 1) <= 1e-4, (top_p, dist, weight)
    for (top_p, dist, weight, mode), norm in norms.items():
        assert norm == pytest.approx(norms[top_p, dist, weight, "none"], rel=1e-6), (top_p, dist, weight, mode)
        plain = norms[top_p, dist, "none", "none"]
        assert plain / 2 <= norm <= 2 * plain, (top_p, dist, weight, mode, norm, plain)
    assert norms[0.75, "full", "mass", "none"] < 0.9 * norms[0.75, "full", "none", "none"]  # the mass acts (~0.75)
