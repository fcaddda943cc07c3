"""docs/healthy_training.md's readings of a micro-batch, computed beside its loss: grpo.py's
`train_step` calls the function `reader` returns on the logits it trained on (detached). Nothing here
changes what is trained: the loss and its own metrics (ratio, clip, KL) are grpo.py's.

It builds on grpo.py's functions (`code_logprobs`, `logprob_of`, `grpo_loss`), which arrive as an argument, `lesson`
(grpo.py itself): imports run one way, grpo.py -> helpers/, never back.
"""

import functools

import torch

from .variants import clip_range, distribution, entropy, loss_tokens, nucleus_mass, sampler_correction


def reader(cfg, codebook_size: int, lesson):
    """`readings` with the run's settings, the AR's codebook size K and grpo.py (`lesson`): fn(logits, mb,
    old_logprobs, ref_logprobs) -> dict."""
    return functools.partial(readings, codebook_size=codebook_size, temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p,
                             clip_eps=cfg.clip_eps, kl_beta=cfg.kl_beta, correction=cfg.sampler_correction,
                             cap=cfg.sampler_cap, train_tokens=cfg.train_tokens, clip_eps_high=cfg.clip_eps_high,
                             lesson=lesson)


@torch.no_grad()
def readings(logits: torch.Tensor, mb, old_logprobs: torch.Tensor, ref_logprobs: torch.Tensor | None, *,
             codebook_size: int, temperature: float, top_k: int, top_p: float, clip_eps: float, kl_beta: float, correction: str,
             cap: float, train_tokens: str = "large", clip_eps_high: float | None = None, lesson) -> dict:
    """(mb, N, V) logits of a grpo.MicroBatch `mb` (pi_old's and the reference's log-probs beside them) ->
    - entropy: the trained distribution's, over the loss tokens (nats);
    - each region's (preview, large) mean log-prob, k3 KL and clip fraction;
    - sampler_gap: the sampler's log-probs of q against the trainer's, on the codes the sampler kept (the drift
      the mismatch weights correct);
    - outside_truncation: sampled tokens the trainer's own top-k / top-p drops;
    - no_gradient_frac: loss tokens whose trained distribution keeps one code (log-prob 0: no gradient);
    - TRL's mismatch metrics of the loss' correction (`mismatch`) and the nucleus' mass Z_t = p / q.
    `lesson`: grpo.py, whose functions compute them."""
    K, rollout = codebook_size, mb.rollout
    q_sampler = rollout.q_logprobs[mb.rows]
    trained = distribution(lesson, logits, temperature, K, mb.support)  # pi_theta
    logprobs = lesson.logprob_of(trained, mb.tokens)
    cols = loss_tokens(mb, train_tokens)
    kept = kept_codes(mb, K)
    replayed = (lesson.code_logprobs(logits, temperature, K, top_k, top_p) if kept is None
                else distribution(lesson, logits, temperature, K, kept))  # q, the sampler's cut
    own = lesson.logprob_of(lesson.code_logprobs(logits, temperature, K, top_k, top_p), mb.tokens)  # the trainer's cut
    q_trainer = lesson.logprob_of(replayed, mb.tokens)
    both = q_trainer.isfinite() & q_sampler.isfinite()
    m = {"entropy": entropy(trained)[:, cols].mean().item(),
         "sampler_gap": (q_trainer - q_sampler).where(both, 0.0).abs().max().item(),
         "outside_truncation": int((~own.isfinite()).sum()),
         "no_gradient_frac": (trained[:, cols].isfinite().sum(-1) == 1).float().mean().item()}
    for name, cut in {"preview": slice(0, mb.n_preview), "large": slice(mb.n_preview, None)}.items():
        if logprobs[:, cut].numel():  # editing has no preview
            ref = None if ref_logprobs is None else ref_logprobs[:, cut]
            eps = clip_range(mb.advantages, clip_eps, clip_eps_high)  # the loss' clip
            _, region = lesson.grpo_loss(logprobs[:, cut], old_logprobs[:, cut], ref, mb.advantages, eps, kl_beta)
            m |= {f"{name}/logprob": logprobs[:, cut].mean().item(), f"{name}/kl": region["kl"],
                  f"{name}/clip_frac": region["clip_frac"]}
    m |= mismatch(old_logprobs, mb.sampler_logprobs, correction, cap, lesson)
    mass = nucleus_mass(q_sampler, rollout.p_logprobs[mb.rows])  # Z_t, whether the loss weighs by it or not
    return m | {"truncation/nucleus_mass/mean": mass.mean().item(), "truncation/nucleus_mass/min": mass.min().item()}


def kept_codes(mb, codebook_size: int) -> torch.Tensor | None:
    """The codes each of the micro-batch's draws kept, (mb, N, K) bool, or None (no top-k / top-p)."""
    from .fast_decode import code_support
    if mb.support is not None:
        return mb.support
    kept = getattr(mb.rollout, "support", None)  # (the lesson's grpo.Rollout records none)
    if kept is None:
        return None
    return code_support(kept[mb.rows], codebook_size)


def mismatch(old: torch.Tensor, sampled: torch.Tensor, mode: str, cap: float, lesson) -> dict:
    """TRL's mismatch metrics of (S, T) log-probs of one distribution by the trainer (`old`) and by the sampler, under
    helpers/variants.py's `sampler_correction` (`mode`, `cap`): the log-prob gap, its weights after the cap and the ratios before it
    (per token, or per sequence in the sequence modes), the k3 KL of the sampler from pi_old, the share of ratios above
    the cap. Tokens outside a truncation (-inf on either side) count as a gap of 0. `lesson`: grpo.py."""
    sampled = torch.where(old.isfinite() & sampled.isfinite(), sampled, old)  # outside a truncation: no gap
    log_ratio = old - sampled  # (S, T)
    weights = sampler_correction(old, sampled, mode, cap)
    level = "sequence" if mode.startswith("sequence") else "token"
    ratio = sampler_correction(old, sampled, f"{level}_truncate", float("inf"))  # before the cap
    return {"sampling/sampling_logp_difference/mean": log_ratio.abs().mean().item(),
            "sampling/sampling_logp_difference/max": log_ratio.abs().max().item(),
            "sampling/importance_sampling_ratio/min": weights.min().item(),  # after the cap
            "sampling/importance_sampling_ratio/mean": weights.mean().item(),
            "sampling/importance_sampling_ratio/max": weights.max().item(),
            "sampling/raw_importance_sampling_ratio/min": ratio.min().item(),  # before it
            "sampling/raw_importance_sampling_ratio/max": ratio.max().item(),
            # KL(sampler || old); k3 >= 0 for each token, and the clamp removes float32's rounding below it
            "sampling/k3_kl": (log_ratio.exp() - 1 - log_ratio).clamp_min(0).mean().item(),
            "sampling/capped_frac": (ratio > cap).float().mean().item() if mode != "none" else 0.0}
