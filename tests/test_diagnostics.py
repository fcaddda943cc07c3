"""Tests for helpers/diagnostics.py: docs/healthy_training.md's readings beside grpo.py's loss.

    python -m pytest -q tests/test_diagnostics.py
"""

import math

import pytest
import torch

import grpo
from conftest import ALGORITHM, T, sampled_rows
from helpers import diagnostics



def test_readings():
    """The readings beside the loss, from the logits alone: each region's mean finite log-prob and grpo_loss's KL over
    its tokens (no preview region when editing); an exact sampler's gap is 0 and one 0.5 nats off reads 0.5; tokens
    the trainer's own top-p drops are counted; kl_untruncated is k3 on the whole softmax."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 6, 16, generator=g) * 3
    mb = sampled_rows(logits, 0.75, g)._replace(n_preview=2)
    ref = (mb.sampled_full - 0.3, mb.sampled_full - 0.2)
    kw = dict(temperature=T, clip_eps=0.2, kl_beta=0.04, top_p=0.75)
    m = diagnostics.readings(logits, 16, mb, None, ref, ALGORITHM, **kw)  # --policy-dist full: p is trained
    logp = grpo.logprob_of(grpo.code_logprobs(logits, T, 16), mb.tokens)
    for region, cut in (("preview", slice(0, 2)), ("large", slice(2, None))):
        _, want = grpo.grpo_loss(logp[:, cut], logp[:, cut], ref[0][:, cut], mb.advantages, 0.2, 0.04)
        assert m[f"{region}/kl"] == pytest.approx(want["kl"]) and m[f"{region}/kl"] > 0
        assert m[f"{region}/logprob"] == pytest.approx(logp[:, cut].mean().item())
    assert m["sampler_gap"] <= 1e-6 and m["outside_truncation"] == 0 and m["no_gradient_frac"] == 0
    assert m["kl_untruncated"] == pytest.approx(grpo.k3_kl(logp[:, 2:], ref[1][:, 2:]).mean().item())
    assert diagnostics.readings(logits, 16, mb._replace(sampled=mb.sampled - 0.5), None, ref, ALGORITHM,
                                **kw)["sampler_gap"] == pytest.approx(0.5, abs=1e-5)
    edit = diagnostics.readings(logits, 16, mb._replace(n_preview=0), None, None, ALGORITHM, **kw)
    assert "preview/logprob" not in edit and "kl_untruncated" not in edit
    least = mb._replace(tokens=logits.argmin(-1), support=None)  # codes no nucleus keeps
    assert diagnostics.readings(logits, 16, least, None, None, ALGORITHM, **kw)["outside_truncation"] == 12


def test_mismatch():
    """TRL's mismatch metrics of sampler_correction's weights, by hand: the gap (0 where either side is -inf), the
    ratios before the cap (per token, or the sequence's product), the weights after it, the k3 KL of the sampler from
    pi_old, the share above the cap."""
    old = torch.tensor([[-1.0, -2.0, -0.5], [-1.0, -1.0, -1.0]])
    sampled = torch.tensor([[-1.5, -1.0, -0.5], [-2.0, -1.0, -math.inf]])
    d = torch.tensor([[0.5, -1.0, 0.0], [1.0, 0.0, 0.0]])  # old - sampled, 0 where not finite
    cap = 1.5
    m = diagnostics.mismatch(old, sampled, "token_truncate", cap, grpo.sampler_correction)
    assert m["sampling/sampling_logp_difference/max"] == 1.0
    assert m["sampling/sampling_logp_difference/mean"] == pytest.approx(2.5 / 6)
    assert m["sampling/raw_importance_sampling_ratio/max"] == pytest.approx(math.e)  # before the cap
    assert m["sampling/raw_importance_sampling_ratio/min"] == pytest.approx(math.exp(-1))
    assert m["sampling/importance_sampling_ratio/max"] == pytest.approx(cap)  # the weights applied, as TRL logs them
    assert m["sampling/importance_sampling_ratio/min"] == pytest.approx(math.exp(-1))
    assert m["sampling/k3_kl"] == pytest.approx(((d.exp() - 1 - d).sum() / 6).item())
    assert m["sampling/capped_frac"] == pytest.approx(2 / 6)  # e^0.5 and e^1 exceed 1.5
    seq = diagnostics.mismatch(old, sampled, "sequence_mask", cap, grpo.sampler_correction)
    assert seq["sampling/raw_importance_sampling_ratio/max"] == pytest.approx(math.e)  # the sequence's product
    assert seq["sampling/importance_sampling_ratio/max"] == pytest.approx(math.exp(-0.5))  # e is masked to 0
