"""Each peer the docs name, checked against the peer's own code (docs/claims.md lists every such sentence).

Each test transcribes the peer's lines, as read in its repository (the commit in the docstring; docs/claims.md quotes
them), and compares this project's function with them on the same numbers. Where this project differs on purpose, the
test measures the difference the docs state.
"""

import math

import pytest
import torch

import grpo
from helpers import variants


def random_logprobs(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [-torch.rand(*shape, generator=g) * 3 for _ in range(3)]


def trl_importance_weights(old_per_token_logps, sampling_per_token_logps, mode, clip_max, clip_min=None):
    """TRL's vLLM importance-sampling weights, transcribed from trl/trainer/grpo_trainer.py (huggingface/trl f2cd577,
    lines 2578-2619), no padding (mask all ones)."""
    mask = torch.ones_like(old_per_token_logps)
    per_token_logps_diff = (old_per_token_logps - sampling_per_token_logps) * mask
    sequence_level_is = mode in ["sequence_mask", "sequence_truncate"]
    if sequence_level_is:
        logps_diff = per_token_logps_diff.sum(dim=-1, keepdim=True)
    else:
        logps_diff = per_token_logps_diff
    ratio = torch.exp(logps_diff)
    min_val = clip_min if clip_min is not None else -math.inf
    if mode in ["sequence_truncate", "token_truncate"]:
        ratio = torch.clamp(ratio, min=clip_min, max=clip_max)
    else:
        invalid = (ratio < min_val) | (ratio > clip_max)
        ratio = ratio.masked_fill(invalid, value=0.0)
    return ratio.expand_as(old_per_token_logps)


def test_trl_mismatch_weights():
    """grpo.sampler_correction is TRL's vllm_importance_sampling_mode weights, in each of TRL's four modes (TRL's
    default is sequence_mask at 3.0, this project's token_truncate at 2.0; the modes and the cap mean the same)."""
    old, sampled, _ = random_logprobs(3, 7)
    sampled = old + 0.4 * (sampled + 1.5)  # gaps of both signs, some sequences' sums past the cap
    for mode in ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask"):
        for cap in (2.0, 3.0):
            want = trl_importance_weights(old, sampled, mode, cap)
            assert torch.allclose(grpo.sampler_correction(old, sampled, mode, cap), want, rtol=1e-6), (mode, cap)
    masked = grpo.sampler_correction(old, sampled, "sequence_mask", 2.0)
    assert masked.eq(0).any() and masked.ne(0).any()  # the example exercises the mask


def trl_per_token_loss(per_token_logps, old_per_token_logps, ref_per_token_logps, advantages, epsilon_low,
                       epsilon_high, beta, importance_sampling_ratio):
    """TRL's per-token GRPO loss, transcribed from trl/trainer/grpo_trainer.py (f2cd577, lines 3071-3121):
    the k3 KL, the two-sided clip (epsilon_high: DAPO's clip-higher), the mismatch weight, then + beta KL."""
    per_token_kl = torch.exp(ref_per_token_logps - per_token_logps) - (ref_per_token_logps - per_token_logps) - 1
    log_ratio = per_token_logps - old_per_token_logps
    coef_1 = torch.exp(log_ratio)
    coef_2 = torch.clamp(coef_1, 1 - epsilon_low, 1 + epsilon_high)
    per_token_loss1 = coef_1 * advantages.unsqueeze(1)
    per_token_loss2 = coef_2 * advantages.unsqueeze(1)
    per_token_loss = -torch.min(per_token_loss1, per_token_loss2)
    per_token_loss = per_token_loss * importance_sampling_ratio
    per_token_loss = per_token_loss + beta * per_token_kl
    return per_token_loss, per_token_kl


def trl_aggregate(per_token_loss, mask, loss_type):
    """TRL's loss aggregation (f2cd577, lines 3124-3145), one process, one accumulation step: "grpo" the mean of each
    sequence's token mean, "dapo" (TRL's default) the mean over every token of the batch."""
    if loss_type == "grpo":
        return ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    normalizer = mask.sum().clamp(min=1.0)  # num_items_in_batch / num_processes, one process
    return (per_token_loss * mask).sum() / normalizer


def test_trl_loss():
    """grpo_loss is TRL's per-token loss (k3 KL to the reference, the clipped surrogate times the mismatch weights,
    + beta KL), and with equal-length samples TRL's default loss_type "dapo" (a token mean over the batch) and "grpo"
    (1/|o_i| per sequence, as grpo.py's docstring writes it) give grpo_loss's number; with unequal lengths, as an
    LLM's, they differ, which is why grpo_loss's copier's note points at the token mean."""
    logp, old, ref = random_logprobs(4, 6, seed=1)
    logp = old + 0.3 * (logp + 1.5) / 3  # ratios around 1, some past the clip
    A = torch.tensor([1.2, -0.4, 0.7, -1.5])
    w = grpo.sampler_correction(old, old - 0.1)
    loss, metrics = grpo.grpo_loss(logp, old, ref, A, 0.2, 0.04, w)
    per_token, kl = trl_per_token_loss(logp, old, ref, A, 0.2, 0.2, 0.04, w)
    mask = torch.ones_like(logp)
    for loss_type in ("dapo", "grpo"):
        assert loss.item() == pytest.approx(trl_aggregate(per_token, mask, loss_type).item(), rel=1e-6), loss_type
    assert metrics["kl"] == pytest.approx(kl.mean().item(), rel=1e-6)  # Schulman's k3, as TRL computes it
    mask[0, 3:] = 0  # a shorter first sample: the two aggregations part
    assert trl_aggregate(per_token, mask, "dapo").item() != pytest.approx(trl_aggregate(per_token, mask, "grpo").item())


def verl_clip_higher_loss(old_log_prob, log_prob, advantages, cliprange_low, cliprange_high):
    """verl's compute_policy_loss_vanilla without dual-clip, transcribed from verl/trainer/ppo/core_algos.py
    (volcengine/verl b178a3c, lines 1195-1222): DAPO's clip-higher, per token."""
    negative_approx_kl = log_prob - old_log_prob
    ratio = torch.exp(negative_approx_kl)
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - cliprange_low, 1 + cliprange_high)
    return torch.maximum(pg_losses1, pg_losses2)


def test_dapo_clip_higher():
    """--clip-eps-high H passes grpo_loss eps = H where A > 0 and eps elsewhere (variants.clip_range): the same loss
    and gradient as verl's and TRL's clamp(r, 1 - eps, 1 + H) on every token (DAPO: eps 0.2, H 0.28)."""
    _, old, _ = random_logprobs(4, 5, seed=2)
    log_ratio = torch.tensor([0.1, 0.2, 0.25, 0.4, -0.3]).repeat(4, 1)  # ratios 0.74 .. 1.49: each clip reached
    logp = (old + log_ratio).requires_grad_()
    A = torch.tensor([1.0, -1.0, 0.5, -2.0])
    ours, _ = grpo.grpo_loss(logp, old, None, A, variants.clip_range(A, 0.2, 0.28), 0.0)
    (ours_grad,) = torch.autograd.grad(ours, logp)
    verl = verl_clip_higher_loss(old, logp, A[:, None], 0.2, 0.28).mean()
    (verl_grad,) = torch.autograd.grad(verl, logp)
    trl = trl_aggregate(trl_per_token_loss(logp, old, old, A, 0.2, 0.28, 0.0, 1.0)[0], torch.ones_like(old), "dapo")
    assert ours.item() == pytest.approx(verl.item(), rel=1e-6) == pytest.approx(trl.item(), rel=1e-6)
    assert torch.allclose(ours_grad, verl_grad, atol=1e-8)
    symmetric, _ = grpo.grpo_loss(logp, old, None, A, 0.2, 0.0)
    assert symmetric.item() != pytest.approx(ours.item())  # the example reaches the upper clip


def test_dr_grpo():
    """--scale-rewards none is Dr. GRPO here: its advantages are R - mean (sail-sg/understand-r1-zero
    train_zero_math.py, lines 286-307: no std), and its other change, each sequence's token sum over a constant
    (generate_max_length) instead of over |o_i|, is already grpo_loss's 1/T when every sample has T tokens."""
    reward = torch.tensor([[0.2, 0.9, 0.4, 0.4], [1.0, 3.0, 2.0, 6.0]])
    z = grpo.group_advantages(reward)
    rewards = reward.flatten()
    values = rewards.view(-1, 4).mean(dim=1).repeat_interleave(4)  # oat's MC baseline: the group mean
    dr_grpo = (rewards - values).view(2, 4)
    assert torch.allclose(variants.rescaled(z, reward, "none"), dr_grpo, atol=1e-6)
    logp, old, _ = random_logprobs(8, 5, seed=3)
    A = dr_grpo.flatten()
    per_token = -torch.min(torch.exp(logp - old) * A[:, None],
                           torch.clamp(torch.exp(logp - old), 0.8, 1.2) * A[:, None])
    generate_max_length = 5  # every sample fills the same grid: |o_i| = T = the maximum length
    dr_loss = ((per_token.sum(dim=1)) / generate_max_length).mean()  # oat's masked_sum, then the batch mean
    assert grpo.grpo_loss(logp, old, None, A, 0.2, 0.0)[0].item() == pytest.approx(dr_loss.item(), rel=1e-6)


def test_trl_group_std():
    """grpo.group_advantages divides by the population std (/ G); TRL's default (scale_rewards "group") by the
    sample std (/ G - 1) + 1e-4: TRL's advantages are sqrt((G - 1) / G) of ours (1.07x smaller at G = 8), up to
    its 1e-4."""
    g = torch.Generator().manual_seed(4)
    reward = torch.rand(3, 8, generator=g)
    trl = (reward - reward.mean(dim=1, keepdim=True)) / (reward.std(dim=1, keepdim=True) + 1e-4)
    ratio = grpo.group_advantages(reward) / trl
    assert torch.allclose(ratio, torch.full_like(ratio, math.sqrt(8 / 7)), rtol=1e-3)
    assert math.sqrt(8 / 7) == pytest.approx(1.069, abs=1e-3)


def test_schulman_k3_unbiased():
    """Schulman's k3, r - 1 - log r with r = ref / pi, averaged over tokens drawn from pi, estimates KL(pi || ref)
    without bias (the mean of 200k draws within 3 standard errors); drawn from another distribution (pi_old at a later
    update, or a top-p nucleus) it does not."""
    g = torch.Generator().manual_seed(5)
    pi = torch.softmax(torch.randn(6, generator=g), 0)
    ref = torch.softmax(torch.randn(6, generator=g), 0)
    exact = (pi * (pi / ref).log()).sum().item()
    draws = torch.multinomial(pi, 200_000, replacement=True, generator=g)
    d = ref.log()[draws] - pi.log()[draws]
    k3 = torch.exp(d) - d - 1  # grpo_loss's kl, per token
    assert abs(k3.mean().item() - exact) < 3 * k3.std().item() / math.sqrt(len(k3))
    other = torch.softmax(torch.randn(6, generator=g), 0)
    elsewhere = torch.multinomial(other, 200_000, replacement=True, generator=g)
    d = ref.log()[elsewhere] - pi.log()[elsewhere]
    assert abs((torch.exp(d) - d - 1).mean().item() - exact) > 0.05


def test_transformers_warpers():
    """grpo.code_logprobs' top-k and top-p cut the codes as transformers' TopKLogitsWarper and TopPLogitsWarper do
    (the same codes kept, ties and the always-kept most likely code included), then renormalise."""
    from transformers import TopKLogitsWarper, TopPLogitsWarper
    g = torch.Generator().manual_seed(6)
    logits = torch.randn(5, 40, generator=g) * 2
    logits[0, :4] = 3.0  # ties at the top
    for top_k, top_p in [(7, 1.0), (0, 0.75), (0, 0.3), (0, 0.999), (12, 0.6)]:
        scores = logits / 0.9
        if top_k:
            scores = TopKLogitsWarper(top_k)(None, scores)
        if top_p < 1:
            scores = TopPLogitsWarper(top_p)(None, scores)
        want = torch.log_softmax(scores, dim=-1)
        got = grpo.code_logprobs(logits, 0.9, 40, top_k, top_p)
        assert torch.equal(got.isfinite(), want.isfinite()), (top_k, top_p)
        assert torch.allclose(got[got.isfinite()], want[want.isfinite()], atol=1e-6), (top_k, top_p)


def test_k3_gradient():
    """grpo_loss's KL term (k3, on tokens drawn from pi) has, in expectation, the gradient of KL(ref || pi) with
    respect to pi's logits: sum_x pi(x) d k3(x) = sum_x (pi - ref)(x) d log pi(x) = d KL(ref || pi)."""
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(6, generator=g, requires_grad=True)
    ref = torch.softmax(torch.randn(6, generator=g), 0)
    logp = torch.log_softmax(logits, 0)
    d = ref.log() - logp
    k3 = torch.exp(d) - d - 1  # every code's k3; the expectation weighs it by pi, held fixed (the draws)
    (expected,) = torch.autograd.grad((logp.exp().detach() * k3).sum(), logits)
    kl_ref_pi = (ref * (ref.log() - torch.log_softmax(logits, 0))).sum()
    (want,) = torch.autograd.grad(kl_ref_pi, logits)
    assert torch.allclose(expected, want, atol=1e-6)
    kl_pi_ref = (torch.softmax(logits, 0) * (torch.log_softmax(logits, 0) - ref.log())).sum()
    (other,) = torch.autograd.grad(kl_pi_ref, logits)
    assert not torch.allclose(expected, other, atol=1e-3)  # not KL(pi || ref)'s
