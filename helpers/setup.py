"""The trained model's set-up, beside grpo.py's lesson: float32 weights (or LoRA adapters, already on: grpo.py's
`trained_model`), --offload, FSDP2 over the processes and AdamW. helpers/trainer.py and dit_grpo.py call
`setup_training`; the KL reference is grpo.py's `reference_model` (a frozen copy, or the policy with its LoRA adapter
off), passed in: this file never imports grpo.py.
"""

import torch

from . import variants
from .parallel import shard


def setup_training(pipe, cfg, dtype: torch.dtype, world: int, reference_model, policy):
    """The trained model `policy` (grpo.trained_model's AR, or dit_grpo.py's DiT; LoRA on it or not), its weights in
    float32 unless LoRA (whose adapters are float32 already), --offload, the reference (grpo.reference_model; with
    --reference-reset-every, wrapped to be reset: variants.Reference), FSDP2 over `world` processes, AdamW ->
    (policy, reference or None, optimizer)."""
    if not cfg.lora_rank and dtype != torch.float32:
        policy.float()  # trainable weights stay float32: AdamW steps on bf16 weights round away
    for module in (pipe.text_encoder, pipe.transformer, pipe.vae) if cfg.offload else ():
        module.to("cpu")
    ref_model = reference_model(policy, cfg.kl_beta)  # before a checkpoint loads: initial weights
    if ref_model is not None and ref_model is not policy:
        ref_model.to(dtype)  # frozen: bf16 storage is enough
    if world > 1:  # FSDP2: each process keeps 1/world of the weights, gradients and AdamW state
        for model in {id(m): m for m in (policy, ref_model) if m is not None}.values():
            shard(model, dtype)
    if getattr(cfg, "reference_reset_every", 0) and ref_model is not None:  # GARDO's reset (helpers/variants.py)
        ref_model = variants.Reference(policy, ref_model)
    optimizer = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=cfg.lr,
                                  weight_decay=cfg.weight_decay)
    return policy, ref_model, optimizer
