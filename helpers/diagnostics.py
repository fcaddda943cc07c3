"""docs/healthy_training.md's readings of a micro-batch, computed beside its loss: grpo.py's
`micro_batch_loss` calls `readings` on the logits it trained on (detached) when this folder sits
beside grpo.py. Nothing here changes what is trained: the loss and its own metrics (ratio, clip,
KL) are grpo.py's `logits_loss`.

Like the rest of helpers/ it never imports grpo.py: grpo.py's `code_logprobs`, `grpo_loss`, `k3_kl`
`sampler_correction` and `truncation_weights` arrive as arguments.
"""

import torch


@torch.no_grad()
def readings(logits: torch.Tensor, codebook_size: int, mb, old: torch.Tensor | None, ref: tuple | None,
             algorithm: tuple, *, temperature: float, clip_eps: float | tuple[float, float], kl_beta: float,
             train_tokens: str = "large", top_k: int = 0, top_p: float = 1.0, policy_dist: str = "full",
             correction: str = "token_truncate", cap: float = 2.0, **loss_only) -> dict:
    """(mb, N, V) logits of a grpo.MicroBatch `mb` (`old`, `ref`: grpo.frozen_logprobs') -> its readings:
    - each region's (preview, large) mean log-prob, KL and clip fraction;
    - sampler_gap: the sampler's log-probs of q against the trainer's (the drift the mismatch weights
      correct);
    - outside_truncation: sampled tokens the trainer's own top-k / top-p drops;
    - no_gradient_frac: rows whose trained distribution keeps one code (log-prob 0: no gradient);
    - kl_untruncated: k3 on the whole softmax p (kl_beta > 0);
    - TRL's mismatch metrics of logits_loss' correction (`mismatch`) and the nucleus' mass Z_t = p / q.
    `algorithm`: grpo.py's (code_logprobs, grpo_loss, k3_kl, sampler_correction, truncation_weights).
    `loss_only`: logits_loss' other settings."""
    code_logprobs, grpo_loss, k3_kl, sampler_correction, truncation_weights = algorithm
    K, tokens = codebook_size, mb.tokens[..., None]

    def of(distribution):  # (mb, N, K) -> (mb, N): the sampled tokens' log-probs
        return distribution.gather(-1, tokens).squeeze(-1)

    cols = slice(mb.n_preview, None) if train_tokens == "large" else slice(None)  # in the loss
    full = code_logprobs(logits, temperature, K)  # p
    replayed = code_logprobs(logits, temperature, K, top_k, top_p, mb.support)  # q, on the sampler's cut
    pi = full if policy_dist == "full" else replayed
    logp = of(pi)
    old = logp if old is None else old
    own = replayed if mb.support is None else code_logprobs(logits, temperature, K, top_k, top_p)  # its cut
    trainer, own = of(replayed), of(own)
    both = trainer.isfinite() & mb.sampled.isfinite()
    m = {"sampler_gap": (trainer - mb.sampled).where(both, 0.0).abs().max().item(),
         "outside_truncation": int((~own.isfinite()).sum()),
         "no_gradient_frac": (pi[:, cols].isfinite().sum(-1) == 1).float().mean().item()}
    for name, cut in {"preview": slice(0, mb.n_preview), "large": slice(mb.n_preview, None)}.items():
        if logp[:, cut].numel():  # editing has no preview
            _, r = grpo_loss(logp[:, cut], old[:, cut], None if ref is None else ref[0][:, cut], mb.advantages,
                             clip_eps, kl_beta)
            m |= {f"{name}/logprob": logp[:, cut][logp[:, cut].isfinite()].mean().item(),
                  f"{name}/kl": r["kl"], f"{name}/clip_frac": r["clip_frac"]}
    if ref is not None:
        m["kl_untruncated"] = k3_kl(of(full)[:, cols], ref[1][:, cols]).mean().item()
    behaviour = mb.sampled_full if policy_dist == "full" else mb.sampled  # on the trained distribution
    m |= mismatch(old, behaviour, correction, cap, sampler_correction)
    mass = truncation_weights(mb.sampled, mb.sampled_full, "mass")  # Z_t, whether the loss weighs by it or not
    return m | {"truncation/nucleus_mass/mean": mass.mean().item(), "truncation/nucleus_mass/min": mass.min().item()}


def mismatch(old: torch.Tensor, sampled: torch.Tensor, mode: str, cap: float, sampler_correction) -> dict:
    """TRL's mismatch metrics of (S, T) log-probs of one distribution by the trainer (`old`) and by the sampler, under
    grpo's `sampler_correction` (`mode`, `cap`): the log-prob gap, its weights after the cap and the ratios before it
    (per token, or per sequence in the sequence modes), the k3 KL of the sampler from pi_old, the share of ratios above
    the cap. Tokens outside a truncation (-inf on either side) count as a gap of 0."""
    log_ratio = torch.where(old.isfinite() & sampled.isfinite(), old - sampled, 0.0)  # (S, T)
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
            "sampling/k3_kl": (log_ratio.exp() - 1 - log_ratio).mean().item(),  # KL(sampler || old)
            "sampling/capped_frac": (ratio > cap).float().mean().item() if mode != "none" else 0.0}
