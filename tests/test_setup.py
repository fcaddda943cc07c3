"""Tests for LoRA as main trains it (grpo.trained_model, through the trainer) and helpers/setup.py's training set-up
(setup_training), as main uses them.

    python -m pytest -q tests/test_setup.py
"""

import copy
import dataclasses
import functools
import os

import pytest
import torch

import grpo
from conftest import T, codebook, fresh_pipe, latest_state, lora_policy, sample_group, tiny_run
from helpers import diagnostics, setup, trainer
from helpers.offline_model import tiny_glm_image


def test_lora():
    """LoRA: only adapter weights train; sampler/trainer parity and ratio 1 at step 0; the reference with the
    adapter off equals the base model; the adapter saves and loads back in the peft format."""
    pipe = fresh_pipe()
    base = copy.deepcopy(pipe.vision_language_encoder)
    policy = lora_policy(pipe)
    trainable = [n for n, p in policy.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    assert any("gate_up_proj" in n for n in trainable) and any("q_proj" in n for n in trainable)
    r = sample_group(pipe, "a cat", 4, 64, 96, T, seed=0)  # samples through the injected adapters
    lp = grpo.token_logprobs(policy, r.prompt.inputs, r.tokens, T)
    assert (lp - r.q_logprobs).abs().max() <= 1e-5
    ref = grpo.reference_model(policy, 0.04)
    assert ref is policy  # no second copy
    with torch.no_grad():
        base_lp = grpo.token_logprobs(base, r.prompt.inputs, r.tokens, T)
    batches = trainer.micro_batches([r], torch.tensor([[1.0, -1.0, 0.5, -0.5]]), 2)
    assert (grpo.reference_logprobs(ref, batches[0], T) - base_lp[:2]).abs().max() <= 1e-5  # the adapter off
    assert (base_lp - r.q_logprobs).abs().max() > 1e-3  # the adapter matters
    opt = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=1e-3)
    loss = functools.partial(grpo.micro_batch_loss, clip_eps=0.2, kl_beta=0.04)
    readings = diagnostics.reader(trainer.parse_config(grpo, []), codebook(policy), grpo)
    m = trainer.train_step(grpo, policy, opt, batches, ref, loss, temperature=T, mu=1, max_grad_norm=1.0,
                           readings=readings)
    assert m["ratio_min"] == m["ratio_max"] == 1 and m["sampler_gap"] <= 1e-5 and m["kl"] > 0
    assert all(p.grad is None for n, p in policy.named_parameters() if "lora_" not in n)
    adapters = [grpo.trained_model(fresh_pipe(), 4, seed=seed) for seed in (0, 0, 1)]
    a, b, c = ({n: p for n, p in m.named_parameters() if "lora_A" in n} for m in adapters)
    assert a and a.keys() == b.keys() == c.keys()  # the loops below compare something
    assert all(torch.equal(a[n], b[n]) for n in a) and not all(torch.equal(a[n], c[n]) for n in a)  # seeded init


@pytest.mark.filterwarnings("ignore:.is_gradient_checkpointing. is deprecated:FutureWarning")  # peft's own
def test_results_load_with_standard_calls(tmp_path):
    """A LoRA run's results load with one standard call each (issue 58): final/ and each checkpoint with transformers'
    `load_adapter` (adapter_config.json names the base model's folder, not a cache path) and PeftModel, holding
    exactly the trained weights; --save-merged's final/pipeline/ with GlmImagePipeline.from_pretrained alone. The
    adapter and the merged pipeline draw the same tokens, other than the base model's; the model card names the
    base, the reward and the line that loads it. tools/merge.py writes the same pipeline after a run."""
    import json
    import re
    from diffusers import GlmImagePipeline
    from peft import PeftModel
    out = tmp_path / "lora"
    tiny_run(tmp_path, out, "--steps", "3", "--lora-rank", "4", "--lr", "0.05", "--kl-beta", "0.04", "--save-every", "2",
             "--save-merged")
    final = out / "final"
    assert json.loads((final / "adapter_config.json").read_text())["base_model_name_or_path"] == str(grpo.TINY)
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-2", "step-3"]
    card = (out / "checkpoints" / "step-2" / "README.md").read_text()  # ours, not peft's empty template
    assert "checkpoint after step 2 of 3" in card and "library_name: peft" in card and "Model Card for" not in card
    assert f"--resume {out / 'checkpoints' / 'step-2'}" in card
    trained = latest_state(out)["weights"]  # what the optimizer stepped: "...lora_A.default.weight"
    for folder in (final, out / "checkpoints" / "step-3"):
        loaded = fresh_pipe().vision_language_encoder
        loaded.load_adapter(str(folder))
        lora = {n: p for n, p in loaded.named_parameters() if "lora_" in n}
        assert lora and all(torch.equal(p.cpu(), trained["base_model.model." + n]) for n, p in lora.items()), folder
    peft = PeftModel.from_pretrained(fresh_pipe().vision_language_encoder, final)
    assert all(torch.equal(p.cpu(), trained[re.sub(r"lora_(A|B)\.weight", r"lora_\1.default.weight", n)])
               for n, p in peft.named_parameters() if "lora_" in n)
    adapter, merged, base = fresh_pipe(), GlmImagePipeline.from_pretrained(final / "pipeline"), fresh_pipe()
    adapter.vision_language_encoder.load_adapter(str(final))
    a, m, b = (sample_group(pipe, "a gray square", 4, 64, 64, T, seed=3) for pipe in (adapter, merged, base))
    assert torch.equal(a.tokens, m.tokens) and torch.allclose(a.p_logprobs, m.p_logprobs, atol=1e-4)
    assert not torch.allclose(a.p_logprobs, b.p_logprobs, atol=1e-3)
    # tools/merge.py, after a run, writes the same pipeline
    import shutil
    import sys
    from safetensors.torch import load_file
    from tools import merge
    def merged_ar():
        folder = final / "pipeline" / "vision_language_encoder"
        return {path.name: load_file(path) for path in sorted(folder.glob("*.safetensors"))}

    written = merged_ar()
    shutil.rmtree(final / "pipeline")
    argv, sys.argv = sys.argv, ["merge.py", str(out)]
    try:
        merge.main()
    finally:
        sys.argv = argv
    again = merged_ar()
    assert written and written.keys() == again.keys()
    assert all(torch.equal(t, again[f][k]) for f in written for k, t in written[f].items())
    card = (final / "README.md").read_text()
    metadata = card.split("---")[1]  # a folder is no hub id: not the metadata's base_model; the usage's relative path
    assert "base_model" not in metadata and "pipeline_tag: text-to-image" in metadata and "reward: `ssim=1,mse=0`" in card
    assert f'GlmImagePipeline.from_pretrained("{os.path.relpath(grpo.TINY)}"' in card
    assert f'pipe.vision_language_encoder.load_adapter("{final}")' in card and '"lora_rank": 4' in card


def test_setup_training():
    """The AR is the policy with AdamW over exactly its trainable weights at --lr; the reference is a frozen copy
    (None at beta 0); --offload moves the DiT, VAE and T5 to the CPU."""
    pipe = grpo.only_ar_trains(tiny_glm_image(0))
    cfg = trainer.parse_config(grpo, ["--lr", "2e-4", "--kl-beta", "0.1", "--offload"])
    policy, ref, opt = setup.setup_training(pipe, cfg, torch.float32, 1, grpo.reference_model,
                                            pipe.vision_language_encoder)
    trainable = [p for p in policy.parameters() if p.requires_grad]
    assert policy is pipe.vision_language_encoder and opt.param_groups[0]["lr"] == 2e-4
    assert [id(p) for p in opt.param_groups[0]["params"]] == [id(p) for p in trainable]
    assert ref is not policy and not any(p.requires_grad for p in ref.parameters())
    assert pipe.transformer.device.type == "cpu"
    _, none, _ = setup.setup_training(pipe, dataclasses.replace(cfg, kl_beta=0.0), torch.float32, 1,
                                      grpo.reference_model, pipe.vision_language_encoder)
    assert none is None
