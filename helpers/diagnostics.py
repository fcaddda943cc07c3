"""docs/healthy_training.md's readings of a micro-batch, computed beside its loss: grpo.py's
`micro_batch_loss` calls `readings` on the logits it trained on (detached) when this folder sits
beside grpo.py. Nothing here changes what is trained: the loss and its own metrics (ratio, clip,
KL, the mismatch weights) are grpo.py's `logits_loss`.

Like the rest of helpers/ it never imports grpo.py: grpo.py's `code_logprobs`, `grpo_loss` and
`k3_kl` arrive as arguments.
"""

import torch


@torch.no_grad()
def readings(logits: torch.Tensor, codebook_size: int, mb, old: torch.Tensor | None, ref: tuple | None,
             algorithm: tuple, *, temperature: float, clip_eps: float | tuple[float, float], kl_beta: float,
             train_tokens: str = "large", top_k: int = 0, top_p: float = 1.0, policy_dist: str = "full",
             **loss_only) -> dict:
    """(mb, N, V) logits of a grpo.MicroBatch `mb` (`old`, `ref`: grpo.frozen_logprobs') -> its readings:
    - each region's (preview, large) mean log-prob, KL and clip fraction;
    - sampler_gap: the sampler's log-probs of q against the trainer's (the drift the mismatch weights
      correct);
    - outside_truncation: sampled tokens the trainer's own top-k / top-p drops;
    - no_gradient_frac: rows whose trained distribution keeps one code (log-prob 0: no gradient);
    - kl_untruncated: k3 on the whole softmax p (kl_beta > 0).
    `algorithm`: grpo.py's (code_logprobs, grpo_loss, k3_kl). `loss_only`: logits_loss' other settings."""
    code_logprobs, grpo_loss, k3_kl = algorithm
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
    return m
