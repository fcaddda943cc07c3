"""Tests for helpers/setup.py: LoRA (apply_lora) and the training set-up (setup_training), as main uses them.

    python -m pytest -q tests/test_setup.py
"""

import copy
import dataclasses
import functools

import torch

import grpo
from conftest import T, codebook, fresh_pipe, lora_policy, sample_group, tiny_run
from helpers import diagnostics, run_io, setup
from helpers.offline_model import tiny_glm_image


def test_apply_lora():
    """LoRA: only adapter weights train; sampler/trainer parity and ratio 1 at step 0; the reference with the
    adapter off equals the base model; the adapter saves and loads back in the peft format."""
    pipe = fresh_pipe()
    base = copy.deepcopy(pipe.vision_language_encoder)
    policy = lora_policy(pipe)
    trainable = [n for n, p in policy.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    assert any("gate_up_proj" in n for n in trainable) and any("q_proj" in n for n in trainable)
    r = sample_group(pipe, "a cat", 4, 64, 96, T, seed=0)  # samples through the injected adapters
    lp = grpo.token_logprobs(policy, r.inputs, r.tokens, T)
    assert (lp - r.q_logprobs).abs().max() <= 1e-5
    ref = grpo.reference_model(policy, 0.04)
    assert ref is policy  # no second copy
    with torch.no_grad():
        base_lp = grpo.token_logprobs(base, r.inputs, r.tokens, T)
    batches = grpo.micro_batches([r], torch.tensor([[1.0, -1.0, 0.5, -0.5]]), 2)
    assert (grpo.reference_logprobs(ref, batches[0], T) - base_lp[:2]).abs().max() <= 1e-5  # the adapter off
    assert (base_lp - r.q_logprobs).abs().max() > 1e-3  # the adapter matters
    opt = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=1e-3)
    loss = functools.partial(grpo.micro_batch_loss, clip_eps=0.2, kl_beta=0.04)
    readings = diagnostics.reader(grpo.parse_config([]), codebook(policy))
    m = grpo.train_step(policy, opt, batches, ref, loss, temperature=T, mu=1, max_grad_norm=1.0, readings=readings)
    assert m["ratio_min"] == m["ratio_max"] == 1 and m["sampler_gap"] <= 1e-5 and m["kl"] > 0
    assert all(p.grad is None for n, p in policy.named_parameters() if "lora_" not in n)
    adapters = [setup.apply_lora(fresh_pipe().vision_language_encoder, 4, seed) for seed in (0, 0, 1)]
    a, b, c = ({n: p for n, p in m.named_parameters() if "lora_A" in n} for m in adapters)
    assert a and a.keys() == b.keys() == c.keys()  # the loops below compare something
    assert all(torch.equal(a[n], b[n]) for n in a) and not all(torch.equal(a[n], c[n]) for n in a)  # seeded init


def test_apply_lora_save_load(tmp_path):
    """main with --lora-rank writes a peft adapter that PeftModel.from_pretrained loads onto the tiny AR."""
    from peft import PeftModel
    tiny_run(tmp_path, tmp_path / "lora", "--steps", "2", "--lora-rank", "4", "--lr", "0.05", "--kl-beta", "0.04")
    assert (tmp_path / "lora" / "final" / "adapter_config.json").is_file()
    loaded = PeftModel.from_pretrained(fresh_pipe().vision_language_encoder, tmp_path / "lora" / "final")
    state = run_io.read_checkpoint(tmp_path / "lora" / "checkpoint.pt")["weights"]
    for name, p in loaded.named_parameters():
        if "lora_" in name:
            key = name.replace(".lora_A.weight", ".lora_A.default.weight").replace(".lora_B.weight", ".lora_B.default.weight")
            assert torch.equal(p.cpu(), state[key] if key in state else state[name])


def test_setup_training():
    """The AR is the policy with AdamW over exactly its trainable weights at --lr; the reference is a frozen copy
    (None at beta 0); --offload moves the DiT, VAE and T5 to the CPU."""
    pipe = grpo.only_ar_trains(tiny_glm_image(0))
    cfg = grpo.with_defaults(grpo.Config(model="tiny", lr=2e-4, kl_beta=0.1, offload=True))
    policy, ref, opt = setup.setup_training(pipe, cfg, torch.float32, 1, grpo.reference_model)
    trainable = [p for p in policy.parameters() if p.requires_grad]
    assert policy is pipe.vision_language_encoder and opt.param_groups[0]["lr"] == 2e-4
    assert [id(p) for p in opt.param_groups[0]["params"]] == [id(p) for p in trainable]
    assert ref is not policy and not any(p.requires_grad for p in ref.parameters())
    assert pipe.transformer.device.type == "cpu"
    _, none, _ = setup.setup_training(pipe, dataclasses.replace(cfg, kl_beta=0.0), torch.float32, 1,
                                      grpo.reference_model)
    assert none is None
