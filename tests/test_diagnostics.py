"""Tests for helpers/diagnostics.py: docs/healthy_training.md's readings beside grpo.py's loss.

    python -m pytest -q tests/test_diagnostics.py
"""

import math

import pytest
import torch

import grpo
from conftest import T, sampled_rows
from helpers import diagnostics



def readings(logits, mb, old, ref, **settings):
    """diagnostics.readings with the tiny defaults' settings (K from the logits)."""
    kw = dict(codebook_size=logits.shape[-1], temperature=T, top_k=0, top_p=0.75, clip_eps=0.2, kl_beta=0.04,
              correction="token_truncate", cap=2.0, lesson=grpo)
    return diagnostics.readings(logits, mb, old, ref, **(kw | settings))


def test_readings():
    """The readings beside the loss, from the logits alone: each region's mean log-prob and grpo_loss' KL over its
    tokens (no preview region when editing), the entropy of the loss tokens; an exact sampler's gap is 0 and one 0.5
    nats off reads 0.5; tokens the trainer's own top-p drops are counted."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 6, 16, generator=g) * 3
    mb = sampled_rows(logits, 0.75, g)._replace(n_preview=2)
    logp = grpo.logprob_of(grpo.code_logprobs(logits, T, 16), mb.tokens)  # the lesson trains p
    ref = logp - 0.3
    m = readings(logits, mb, logp, ref)
    for region, cut in (("preview", slice(0, 2)), ("large", slice(2, None))):
        _, want = grpo.grpo_loss(logp[:, cut], logp[:, cut], ref[:, cut], mb.advantages, 0.2, 0.04)
        assert m[f"{region}/kl"] == pytest.approx(want["kl"]) and m[f"{region}/kl"] > 0
        assert m[f"{region}/logprob"] == pytest.approx(logp[:, cut].mean().item())
    assert m["sampler_gap"] <= 1e-6 and m["outside_truncation"] == 0 and m["no_gradient_frac"] == 0
    p = grpo.code_logprobs(logits, T, 16)
    assert m["entropy"] == pytest.approx(-(p.exp() * p).sum(-1)[:, 2:].mean().item(), rel=1e-5)
    rollout = mb.rollout._replace(q_logprobs=mb.rollout.q_logprobs - 0.5)
    assert readings(logits, mb._replace(rollout=rollout), logp, ref)["sampler_gap"] == pytest.approx(0.5, abs=1e-5)
    edit = readings(logits, mb._replace(n_preview=0), logp, None)
    assert "preview/logprob" not in edit and "large/kl" in edit
    least = mb._replace(tokens=logits.argmin(-1))  # codes no nucleus keeps
    assert readings(logits, least, logp, None)["outside_truncation"] == 12


def test_mismatch():
    """TRL's mismatch metrics of sampler_correction's weights, by hand: the gap (0 where either side is -inf), the
    ratios before the cap (per token, or the sequence's product), the weights after it, the k3 KL of the sampler from
    pi_old, the share above the cap."""
    old = torch.tensor([[-1.0, -2.0, -0.5], [-1.0, -1.0, -1.0]])
    sampled = torch.tensor([[-1.5, -1.0, -0.5], [-2.0, -1.0, -math.inf]])
    d = torch.tensor([[0.5, -1.0, 0.0], [1.0, 0.0, 0.0]])  # old - sampled, 0 where not finite
    cap = 1.5
    m = diagnostics.mismatch(old, sampled, "token_truncate", cap, grpo)
    assert m["sampling/sampling_logp_difference/max"] == 1.0
    assert m["sampling/sampling_logp_difference/mean"] == pytest.approx(2.5 / 6)
    assert m["sampling/raw_importance_sampling_ratio/max"] == pytest.approx(math.e)  # before the cap
    assert m["sampling/raw_importance_sampling_ratio/min"] == pytest.approx(math.exp(-1))
    assert m["sampling/importance_sampling_ratio/max"] == pytest.approx(cap)  # the weights applied, as TRL logs them
    assert m["sampling/importance_sampling_ratio/min"] == pytest.approx(math.exp(-1))
    assert m["sampling/k3_kl"] == pytest.approx(((d.exp() - 1 - d).sum() / 6).item())
    assert m["sampling/capped_frac"] == pytest.approx(2 / 6)  # e^0.5 and e^1 exceed 1.5
    seq = diagnostics.mismatch(old, sampled, "sequence_mask", cap, grpo)
    assert seq["sampling/raw_importance_sampling_ratio/max"] == pytest.approx(math.e)  # the sequence's product
    assert seq["sampling/importance_sampling_ratio/max"] == pytest.approx(math.exp(-0.5))  # e is masked to 0
