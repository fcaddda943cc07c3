"""The trained model's set-up, beside grpo.py's lesson: LoRA adapters (peft) or float32 weights, activation
checkpointing, --offload, FSDP2 over the processes and AdamW. grpo.py's `main` and dit_grpo.py call
`setup_training`; the KL reference is grpo.py's `reference_model` (a frozen copy, or the policy with its LoRA
adapter off), passed in: this file never imports grpo.py.
"""

import warnings

import torch

from . import variants
from .parallel import shard


def apply_lora(policy, rank: int, seed: int = 0):
    """LoRA (peft, dropout 0) on the AR's language model, attention and MLP, injected in place (the
    pipeline samples with it); its `disable_adapter` is the reference. A matrices from `seed`."""
    from peft import LoraConfig, get_peft_model  # optional dependency, only for --lora-rank > 0
    projections = r"(self_attn\.(q|k|v|o)_proj|mlp\.(gate_up|down)_proj)"
    config = LoraConfig(r=rank, lora_alpha=rank, lora_dropout=0.0,
                        target_modules=r".*language_model\.layers\.\d+\." + projections)
    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        torch.manual_seed(seed)
        warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning)  # peft asks it
        return get_peft_model(policy, config)


def setup_training(pipe, cfg, dtype: torch.dtype, world: int, reference_model, policy=None, lora=None):
    """The trained model (the AR, or dit_grpo.py's DiT with its `lora`) with LoRA or in float32, --gradient-
    checkpointing, --offload, the reference (grpo.reference_model; with --reference-reset-every, wrapped to be reset:
    variants.Reference), FSDP2 over `world` processes, AdamW -> (policy, reference or None, optimizer)."""
    policy = pipe.vision_language_encoder if policy is None else policy
    if cfg.lora_rank:  # adapters in float32 (peft's default), base weights frozen
        policy = (lora or apply_lora)(policy, cfg.lora_rank, cfg.seed)
    elif dtype != torch.float32:
        policy.float()  # trainable weights stay float32: AdamW steps on bf16 weights round away
    if cfg.gradient_checkpointing and hasattr(policy, "activation_checkpointing_enable"):  # the AR (transformers)
        policy.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    elif cfg.gradient_checkpointing:  # dit_grpo.py's DiT (diffusers)
        policy.enable_gradient_checkpointing()
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
