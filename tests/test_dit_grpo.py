"""Tests for dit_grpo.py (Flow-GRPO on the DiT's denoising chain), on the pre-trained tiny model, on conftest.DEVICE
(the CPU in CI; GRPO_TEST_DEVICE=cuda on a GPU)."""

import dataclasses
import math
import re

import pytest
import torch

import dit_grpo
import grpo
from helpers import trainer
from conftest import DEVICE, PARITY, ROOT, sample_group, run_record as records  # a run's metrics.jsonl lines without the timings

SIZE = 96  # the tiny model's world: 3x3 large tokens


@pytest.fixture(scope="module")
def pipe():
    return grpo.load_glm_image("tiny", DEVICE)


def world_tokens(pipe, caption="two red circles", seed=0):
    """One AR sample for `caption`: (1, N) tokens and the large grid's size."""
    r = sample_group(pipe, caption, 1, SIZE, SIZE, 0.9, seed=seed)
    return r.tokens, r.prompt.large_hw


def test_sde_step():
    """Noise level 0 is the Euler step x + dt v bit for bit, with std 0; otherwise the std is a sqrt(sigma / (1 - sigma))
    sqrt(|dt|), at sigma = 1 with sigma_1 in the denominator, and the mean moves x towards the data as the SDE's drift."""
    x, v = torch.randn(2, 4, 3, 3), torch.randn(2, 4, 3, 3)
    sigma, nxt, s1 = torch.tensor(0.6), torch.tensor(0.4), torch.tensor(0.9)
    mean, std = dit_grpo.sde_step(x, v, sigma, nxt, s1, 0.0)
    assert torch.equal(mean, x + (nxt - sigma) * v) and std == 0
    mean, std = dit_grpo.sde_step(x, v, sigma, nxt, s1, 0.7)
    s = 0.7 * math.sqrt(0.6 / 0.4)
    assert std.item() == pytest.approx(s * math.sqrt(0.2), rel=1e-6)
    want = x * (1 + s ** 2 / 1.2 * -0.2) + v * (1 + s ** 2 * 0.4 / 1.2) * -0.2
    assert torch.allclose(mean, want, atol=1e-6)
    _, std_one = dit_grpo.sde_step(x, v, torch.tensor(1.0), s1, s1, 0.7)
    assert std_one.item() == pytest.approx(0.7 * math.sqrt(1 / 0.1) * math.sqrt(0.1), rel=1e-5)


def test_gaussian_logprob_and_kl():
    """The log-prob is torch's Normal density averaged over a sample's elements; the KL of two equal-std Gaussians is
    |dmean|^2 / (2 std^2) averaged likewise, 0 for equal means."""
    mean, std = torch.randn(3, 4, 5, 5), torch.tensor(0.3)
    x = mean + std * torch.randn(3, 4, 5, 5)
    want = torch.distributions.Normal(mean, std).log_prob(x).flatten(1).mean(1)
    assert torch.allclose(dit_grpo.gaussian_logprob(x, mean, std), want, atol=1e-5)
    other = mean + 0.1
    assert torch.allclose(dit_grpo.gaussian_kl(mean, other, std), torch.full((3,), 0.01 / (2 * 0.09)), atol=1e-6)
    assert torch.equal(dit_grpo.gaussian_kl(mean, mean, std), torch.zeros(3))


def test_sde_scheduler_step_known_noise():
    """An independent check of one SDE step: diffusers' own FlowMatchEulerDiscreteScheduler gives the Euler step, the
    SDE's mean adds Flow-GRPO's drift correction s^2 dt / (2 sigma) (x + (1 - sigma) v) to it, the noise is the one
    the generator draws, and the recorded log-prob is torch's Normal density of the sample, averaged over elements."""
    from diffusers import FlowMatchEulerDiscreteScheduler
    stock = FlowMatchEulerDiscreteScheduler()
    stock.set_timesteps(4)
    sde = dit_grpo.SDEScheduler.from_config(stock.config)
    sde.set_timesteps(4)
    x, v = torch.randn(2, 4, 6, 6), torch.randn(2, 4, 6, 6)
    for i in (0, 2):
        t = stock.timesteps[i]
        stock._step_index = sde._step_index = i
        euler = stock.step(v, t, x).prev_sample
        sde.begin(0.7, torch.Generator().manual_seed(11))
        sde._step_index = i
        prev = sde.step(v, t, x).prev_sample
        sigma, nxt = stock.sigmas[i].item(), stock.sigmas[i + 1].item()
        s = 0.7 * math.sqrt(sigma / (1 - (stock.sigmas[1].item() if sigma == 1 else sigma)))
        mean = euler + s ** 2 * (nxt - sigma) / (2 * sigma) * (x + (1 - sigma) * v)
        std = s * math.sqrt(sigma - nxt)
        noise = torch.randn(x.shape, generator=torch.Generator().manual_seed(11))
        assert torch.allclose(prev, mean + std * noise, atol=1e-5), i
        density = torch.distributions.Normal(mean, std).log_prob(prev).flatten(1).mean(1)
        assert torch.allclose(sde.steps[0][2], density, atol=1e-4), i


def test_sde_scheduler_noise_zero_is_the_pipeline(pipe):
    """At noise level 0 the pipeline with SDEScheduler paints exactly what the stock pipeline (its
    FlowMatchEulerDiscreteScheduler) paints from the same latents, at guidance 1 and 1.5; the stock scheduler is back
    in place afterwards."""
    tokens, large_hw = world_tokens(pipe)
    tokens = tokens.repeat(2, 1)
    for guidance in (1.0, 1.5):
        chain = dit_grpo.sample_chain(pipe, "two red circles", tokens, large_hw, SIZE, SIZE, 3, guidance, 5, 0.0)
        assert type(pipe.scheduler) is not dit_grpo.SDEScheduler
        embeds, negative = pipe.encode_prompt("two red circles", do_classifier_free_guidance=guidance > 1)
        stock = pipe(prompt_embeds=embeds.repeat(2, 1, 1), negative_prompt_embeds=None if negative is None else
                     negative.repeat(2, 1, 1), prior_token_ids=grpo.prior_ids(tokens, large_hw),
                     latents=chain.latents[:, 0].clone(), height=SIZE, width=SIZE, num_inference_steps=3,
                     guidance_scale=guidance, output_type="pt").images
        assert torch.equal(chain.images, stock.float().clamp(0, 1)), guidance
        assert chain.latents.shape[1] == 4 and chain.logprobs is None and chain.sigmas[-1] == 0


@pytest.mark.parametrize("guidance", [1.0, 1.5])
def test_chain_logprobs_parity(pipe, guidance):
    """The trainer's recomputed per-step log-probs equal the sampler's within 1e-5 (float32), classifier-free guidance
    included, also one sample at a time; the first update's ratio is exactly 1; samples differ by their noise alone."""
    tokens, large_hw = world_tokens(pipe)
    chain = dit_grpo.sample_chain(pipe, "two red circles", tokens.repeat(4, 1), large_hw, SIZE, SIZE, 3, guidance, 7,
                                  0.7)
    assert chain.logprobs.shape == (4, 3) and chain.logprobs.isfinite().all()
    assert not torch.equal(chain.images[0], chain.images[1])
    with torch.no_grad():
        logp, means, stds = dit_grpo.chain_logprobs(pipe.transformer, chain, [0, 1, 2], 0.7)
        one = torch.cat([dit_grpo.chain_logprobs(pipe.transformer, chain, [1], 0.7, slice(i, i + 1))[0]
                         for i in range(4)])
    assert (logp - chain.logprobs).abs().max() <= PARITY and (one[:, 0] - chain.logprobs[:, 1]).abs().max() <= PARITY
    assert means.shape == (4, 3, *chain.latents.shape[2:]) and stds.shape == (3,) and (stds > 0).all()
    _, m = grpo.grpo_loss(logp, logp.detach(), None, torch.tensor([1.0, -1.0, 0.5, -0.5], device=logp.device), 0.2, 0.0)
    assert m["ratio_min"] == m["ratio_max"] == 1.0


def test_sde_window_ode_after(pipe):
    """--sde-window 1 of 3 steps: the first step is an SDE step with a log-prob (the trainer's within 1e-5), the two
    after it are the pipeline's Euler steps x + dt v (no noise, no log-prob), so the group's pictures differ only by
    the initial noise and the first step's draw."""
    tokens, large_hw = world_tokens(pipe)
    chain = dit_grpo.sample_chain(pipe, "two red circles", tokens.repeat(2, 1), large_hw, SIZE, SIZE, 3, 1.5, 7, 0.7,
                                  sde_window=1)
    assert chain.logprobs.shape == (2, 1) and dit_grpo.window(3, 1) == [0]
    with torch.no_grad():
        assert (dit_grpo.chain_logprobs(pipe.transformer, chain, [0], 0.7)[0] - chain.logprobs).abs().max() <= PARITY
        for i in (1, 2):
            x = chain.latents[:, i]
            v = dit_grpo.velocity(pipe.transformer, x, chain.timesteps[i], chain.cond)
            euler = x + (chain.sigmas[i + 1] - chain.sigmas[i]) * v
            assert torch.allclose(chain.latents[:, i + 1], euler, atol=1e-5), i


def test_chain_logprobs_gradient(pipe):
    """Log-probs recomputed with gradient reach the DiT's weights; one sample at a time, their gradients add up to the
    whole group's (micro-batching over samples)."""
    tokens, large_hw = world_tokens(pipe)
    chain = dit_grpo.sample_chain(pipe, "a blue square", tokens.repeat(2, 1), large_hw, SIZE, SIZE, 2, 1.0, 3, 0.7)
    dit = pipe.transformer
    weight = next(p for n, p in dit.named_parameters() if p.ndim == 2)
    dit.requires_grad_(True)
    try:
        dit.zero_grad(set_to_none=True)
        dit_grpo.chain_logprobs(dit, chain, [0, 1], 0.7)[0].sum().backward()
        whole = weight.grad.clone()
        dit.zero_grad(set_to_none=True)
        for i in range(2):
            dit_grpo.chain_logprobs(dit, chain, [0, 1], 0.7, slice(i, i + 1))[0].sum().backward()
        assert whole.abs().sum() > 0 and torch.allclose(weight.grad, whole, atol=1e-5, rtol=1e-4)
    finally:
        dit.zero_grad(set_to_none=True)
        dit.requires_grad_(False)


def test_train_step(pipe):
    """The first update's ratio is exactly 1, the trainer agrees with the sampler (sampler_gap <= 1e-5) and the KL to
    an unchanged reference is 0; backward per denoising step and micro-batch (of 4 samples or of 1) gives the gradient
    of the whole batch's loss in one backward, KL term included."""
    import copy
    tokens, large_hw = world_tokens(pipe)
    chains = [dit_grpo.sample_chain(pipe, "two red circles", tokens.repeat(4, 1), large_hw, SIZE, SIZE, 3, 1.5, s, 0.7)
              for s in (1, 2)]
    advantages = grpo.group_advantages(torch.stack([c.images.mean(dim=(1, 2, 3)) for c in chains]))
    policy = copy.deepcopy(pipe.transformer).requires_grad_(True)
    reference = copy.deepcopy(pipe.transformer)
    grads = []
    for micro in (4, 1):
        optimizer = torch.optim.SGD(policy.parameters(), lr=0.0)
        m = dit_grpo.train_step(policy, optimizer, chains, advantages, reference, noise_level=0.7, steps=[0, 2],
                                clip_eps=0.2, kl_beta=0.04, micro_batch_size=micro, max_grad_norm=math.inf)
        assert m["ratio_min"] == m["ratio_max"] == 1.0 and m["sampler_gap"] <= PARITY and m["kl"] == 0.0
        assert m["skipped"] == 0 and m["grad_norm"] > 0
        grads.append({n: p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None})
    policy.zero_grad(set_to_none=True)  # the whole batch in one backward, written out: what the pieces must add up to
    for chain, adv in zip(chains, advantages):
        logp, means, stds = dit_grpo.chain_logprobs(policy, chain, [0, 2], 0.7)
        with torch.no_grad():
            ref_means = dit_grpo.chain_logprobs(reference, chain, [0, 2], 0.7)[1]
        kl = torch.stack([dit_grpo.gaussian_kl(means[:, j], ref_means[:, j], stds[j]) for j in range(2)], dim=1)
        loss = grpo.grpo_loss(logp, logp.detach(), None, adv, 0.2, 0.0)[0] + 0.04 * kl.mean()
        (loss / len(chains)).backward()
    whole = {n: p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None}
    for got in grads:
        assert got.keys() == whole.keys()
        assert all(torch.allclose(got[n], whole[n], atol=1e-6, rtol=1e-4) for n in whole)


def test_train_step_learns():
    """A few DiT updates rewarding bright pictures make the same prompt, tokens and noise brighter, and rewarding dark
    ones darker (noise level 0 to compare: the pipeline's own ODE); the AR's tokens are fixed: the decoder learned it."""
    results = {}
    for sign in (1.0, -1.0):
        pipe = grpo.load_glm_image("tiny", DEVICE)
        tokens, large_hw = world_tokens(pipe, "a blue square")
        dit = pipe.transformer.requires_grad_(True)
        optimizer = torch.optim.AdamW(dit.parameters(), lr=1e-3)

        def brightness(seed, noise):
            chain = dit_grpo.sample_chain(pipe, "a blue square", tokens.repeat(4, 1), large_hw, SIZE, SIZE, 2, 1.0,
                                          seed, noise)
            return chain, chain.images.mean(dim=(1, 2, 3))

        before = brightness(99, 0.0)[1].mean().item()
        for step in range(6):
            chain, reward = brightness(step, 0.7)
            dit_grpo.train_step(dit, optimizer, [chain], grpo.group_advantages(sign * reward[None]), None,
                                noise_level=0.7, steps=[0, 1], clip_eps=0.2, kl_beta=0.0, micro_batch_size=4,
                                max_grad_norm=1.0)
        results[sign] = (before, brightness(99, 0.0)[1].mean().item())
    (before, brighter), (_, darker) = results[1.0], results[-1.0]
    assert darker < before < brighter, results


def test_parse_config():
    """dit_grpo.py's flags are grpo.py's plus the SDE's (grpo.py's Config has none of them); its defaults: one update
    per batch, no diversity bonus, no KL on the tiny model (the real model's 0.04), gradient checkpointing on the real
    DiT; what the command line gives is kept."""
    tiny, real = dit_grpo.parse_config([]), dit_grpo.parse_config(["--model", "zai-org/GLM-Image"])
    assert (tiny.train, tiny.mu, tiny.diversity, tiny.kl_beta, tiny.gradient_checkpointing) == ("dit", 1, 0.0, 0.0, False)
    assert (real.mu, real.kl_beta, real.gradient_checkpointing, real.lora_rank) == (1, 0.04, True, 16)
    given = dit_grpo.parse_config(["--kl-beta", "0.1", "--no-gradient-checkpointing", "--model", "random",
                                   "--sde-window", "2", "--group-size", "3"])
    assert (given.kl_beta, given.gradient_checkpointing, given.sde_window, given.sde_noise) == (0.1, False, 2, 0.7)
    assert given.micro_batch_size == 1 and tiny.micro_batch_size == tiny.group_size == 8
    assert not {f.name for f in dataclasses.fields(grpo.Config)} & {"sde_noise", "sde_steps", "sde_window"}
    assert trainer.parse_config(grpo, []).gradient_checkpointing is False and trainer.parse_config(grpo, []).mu == 2


def run(tmp_path, out, *extra):
    import json
    target = str(ROOT / "examples" / "target_0.png")
    (tmp_path / "evals.jsonl").write_text(json.dumps({"prompt": "a red circle at the top left", "target": target,
                                                      "category": "position"}) + "\n")
    return dit_grpo.main(["--prompts", str(ROOT / "prompts.txt"), "--out", str(tmp_path / out),
                          "--image-every", "0", "--before-after", "0", "--eval-prompts",
                      str(tmp_path / "evals.jsonl"), "--eval-samples", "2", "--eval-every", "2", "--eval-reward",
                      "shapes_exact", "--device", DEVICE, *extra])


def test_main_train_dit(tmp_path, capsys):
    """python dit_grpo.py: the first update's ratio is exactly 1 and the trainer agrees with the sampler; 4 steps equal
    2 steps + resume + 2 (metrics, evaluations, weights); final/ loads with GlmImageTransformer2DModel; tools/compare.py
    reproduces the run's first and last evaluations; LoRA with a KL term runs (with --sde-steps 3: training chains of 3
    steps, evaluation of 2; with gradient checkpointing) and saves the adapter alone, in diffusers' format."""
    from diffusers import GlmImageTransformer2DModel
    import tools.compare as compare
    run(tmp_path, "whole", "--steps", "4", "--kl-beta", "0.04", "--lr", "1e-3", "--sde-window", "1")
    run(tmp_path, "half", "--steps", "2", "--kl-beta", "0.04", "--lr", "1e-3", "--sde-window", "1")
    dit_grpo.main(["--resume", str(tmp_path / "half"), "--steps", "4"])
    whole = records(tmp_path / "whole")
    assert whole == records(tmp_path / "half")
    steps = [x for x in whole if not x.get("eval")]
    assert steps[0]["ratio_min"] == steps[0]["ratio_max"] == 1.0 and all(x["sampler_gap"] <= PARITY for x in steps)
    assert all(x["skipped"] == 0 and math.isfinite(x["loss"]) for x in steps) and steps[-1]["kl"] > 0
    a, b = (GlmImageTransformer2DModel.from_pretrained(tmp_path / d / "final") for d in ("whole", "half"))
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    fresh = grpo.load_glm_image("tiny").transformer
    assert not all(torch.equal(p, q) for p, q in zip(a.parameters(), fresh.parameters()))
    with pytest.raises(SystemExit) as stop:  # grpo.py does not resume a DiT run (its config has the SDE's fields)
        grpo.main(["--resume", str(tmp_path / "whole"), "--steps", "5"])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and "trains the DIT is dit_grpo.py's to run: python dit_grpo.py" in err, err
    evals = [x for x in whole if x.get("eval")]
    result = compare.main([str(tmp_path / "whole" / "final")])
    assert {**result["trained"], "step": 4} == {**evals[-1], "sec_eval": 0.0}
    assert {**result["base"], "step": 0} == {**evals[0], "sec_eval": 0.0}
    chain_steps = []  # --sde-steps 3: the training chains take 3 steps, evaluation the run's 2 (grpo.decode_images)
    sample_chain = dit_grpo.sample_chain
    dit_grpo.sample_chain = lambda *a, **k: chain_steps.append(a[6]) or sample_chain(*a, **k)
    try:
        run(tmp_path, "lora", "--steps", "2", "--lora-rank", "4", "--kl-beta", "0.04", "--sde-steps", "3",
            "--gradient-checkpointing", "--save-merged")
    finally:
        dit_grpo.sample_chain = sample_chain
    assert chain_steps == [3] * 4  # 2 steps x 2 prompts
    assert [x["ratio_max"] for x in records(tmp_path / "lora") if not x.get("eval")][0] == 1.0
    # the adapter in diffusers' format: load_lora_adapter(folder) with no arguments loads exactly the trained weights,
    # and --save-merged's pipeline holds them fused (W + B A, alpha = r)
    from diffusers import GlmImagePipeline
    from conftest import latest_state
    final, trained = tmp_path / "lora" / "final", latest_state(tmp_path / "lora")["weights"]
    for kwargs in ({}, {"use_safetensors": True}):
        transformer = grpo.load_glm_image("tiny").transformer
        transformer.load_lora_adapter(final, **kwargs)
        lora = {re.sub(r"lora_(A|B)\.[^.]+\.weight", r"lora_\1.default.weight", n): p
                for n, p in transformer.named_parameters() if "lora_" in n}
        assert lora and all(torch.equal(p, trained["base_model.model." + n]) for n, p in lora.items()), kwargs
    merged = GlmImagePipeline.from_pretrained(final / "pipeline").transformer
    base, name = grpo.load_glm_image("tiny").transformer, "transformer_blocks.0.attn1.to_q"
    a, b = (trained[f"base_model.model.{name}.lora_{x}.default.weight"] for x in "AB")
    fused = dict(base.named_parameters())[f"{name}.weight"] + b @ a
    assert torch.allclose(dict(merged.named_parameters())[f"{name}.weight"], fused, atol=1e-6)


def test_main_train_dit_bad_input(tmp_path, capsys):
    """dit_grpo.py refuses, with one line and nothing written: a zero or negative noise level, a negative window or
    number of steps, --mu > 1 (one update per batch for now), prompts with source images (editing is the AR's for
    now), an unknown --train and the variants of the AR's tokens (--kl-on, --diversity, --policy-dist ...); grpo.py refuses --train dit and names dit_grpo.py, and dit_grpo.py --train ar
    names grpo.py."""
    here = ROOT
    for args, needle in [(["--sde-noise", "0"], "--sde-noise 0.0"), (["--sde-window", "-1"], "--sde-window -1"),
                         (["--sde-steps", "-2"], "--sde-steps -2"), (["--mu", "2"], "--mu 2"),
                         (["--prompts", str(here / "examples" / "edits.jsonl")], "text-to-image only"),
                         (["--train", "vae"], "--train vae"), (["--unlikeliness", "1"], "--unlikeliness: the options of the AR"),
                         (["--kl-on", "above_mean", "--diversity", "0.2"], "--diversity, --kl-on: the options"),
                         (["--policy-dist", "truncated"], "dit_grpo.py does not use them"),
                         (["--train", "ar"], "dit_grpo.py: error: --train ar is grpo.py's to run: python grpo.py")]:
        with pytest.raises(SystemExit) as stop:
            dit_grpo.main(["--prompts", str(here / "prompts.txt"), "--out", str(tmp_path / "x"), *args])
        err = capsys.readouterr().err
        assert stop.value.code == 2 and needle in err and "Traceback" not in err, (args, err)
        assert not (tmp_path / "x").exists()
    with pytest.raises(SystemExit) as stop:
        grpo.main(["--prompts", str(here / "prompts.txt"), "--train", "dit", "--out", str(tmp_path / "x")])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and "grpo.py: error: --train dit is dit_grpo.py's to run: python dit_grpo.py" in err


@pytest.mark.parametrize("extra", [["--kl-beta", "0.04", "--scale-rewards", "batch"],
                                   ["--lora-rank", "4", "--kl-beta", "0.04"]])
def test_torchrun_train_dit_equals_one_process(tmp_path, extra):
    """--train dit under torchrun (FSDP2 over the DiT's transformer blocks): 2 processes x 1 prompt per step make the
    same updates as 1 process x 2 prompts: the same metrics (rewards, log-probs, KL, the first ratio exactly 1) and
    the same final/ weights within 5% of one AdamW step (see below). The reward is `size` (continuous, with a spread
    of a few hundredths within a group): with SSIM, whose spread from decoder noise alone can be ~1e-4, float32
    rounding of the rewards becomes a visible part of the z-scored advantages, and the runs part after one update."""
    from safetensors.torch import load_file
    from conftest import assert_same_metrics, one_process, torchrun
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("two red circles\na blue square left of a yellow triangle\n")
    common = ["--prompts", str(prompts), "--reward", "size", "--steps", "2", "--group-size", "4",
              "--micro-batch-size", "2", "--sde-window", "1", "--lr", "1e-3", "--image-every", "0",
              "--before-after", "0", "--device", "cpu", *extra]  # gloo: one GPU cannot host 2 ranks
    script = ROOT / "dit_grpo.py"
    one_process(*common, "--out", str(tmp_path / "one"), "--prompts-per-step", "2", script=script)
    two = torchrun(*common, "--out", str(tmp_path / "two"), "--prompts-per-step", "1", script=script)
    assert two.returncode == 0, two.stderr[-3000:]
    assert_same_metrics(tmp_path / "one", tmp_path / "two")
    steps = records(tmp_path / "two")
    assert steps[0]["prompts"] == [0, 1] and steps[0]["ratio_min"] == steps[0]["ratio_max"] == 1.0
    assert steps[-1]["kl"] > 0
    name = "pytorch_lora_weights.safetensors" if "--lora-rank" in extra else "diffusion_pytorch_model.safetensors"
    a, b = (load_file(tmp_path / d / "final" / name) for d in ("one", "two"))
    assert a.keys() == b.keys() and a
    # the gradients agree within 1e-5 (grad_norm is among the metrics above), but many of the DiT's gradient entries
    # are ~1e-8, AdamW's eps, where lr * g / (|g| + eps) turns the reduction's float rounding into a visible part of
    # a step: measured up to 2% of lr (1e-3) after 3 steps; a wrong gradient would move weights by a whole lr
    assert max((a[k].float() - b[k].float()).abs().max().item() for k in a) <= 0.05 * 1e-3


def test_memory_plan_dit_lora_params(pipe):
    """tools/memory_plan.py counts the DiT's adapter parameters from shapes; on the tiny DiT's config the count equals
    what peft creates with dit_grpo.apply_lora."""
    import copy
    import tools.memory_plan as plan
    lora = dit_grpo.apply_lora(copy.deepcopy(pipe.transformer), 4)
    trainable = sum(p.numel() for p in lora.parameters() if p.requires_grad)
    assert trainable > 0 and plan.dit_lora_params(4, dict(pipe.transformer.config)) == trainable
