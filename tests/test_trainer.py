"""Tests for helpers/trainer.py, the lab's trainer around grpo.py's lesson: the presets and the command line, the
robust update (`train_step`: a group out of the loss, many processes' shares, the sampler's corrections, the
diagnostics' seam), on CPU with the tiny GLM-Image. That the trainer gives the lesson's numbers: test_grpo.py
(test_train, test_update_and_the_trainers_step).

    python -m pytest -q tests/test_trainer.py
"""

import copy
import dataclasses
import functools
import math

import pytest
import torch

import grpo
from helpers import run, trainer, variants
from conftest import CORRECTIONS, DEVICE, T, codebook, kept_codes, sample_group, sampled_rows, smooth_source
from conftest import pipe, random_pipe, sharp_pipe  # noqa: F401  the tiny pipelines (fixtures)


# ---- The presets and the command line -----------------------------------------------------------

def test_parse_config():
    """Flags are the field names with dashes; the real model's presets fill only what the command line (or a --config
    file) left out; a preset's --help says both defaults; micro-batches of 0 are a whole group."""
    cfg = trainer.parse_config(grpo, ["--group-size", "8", "--kl-beta", "0.04", "--height", "64"])
    assert cfg.model == "tiny" and (cfg.group_size, cfg.kl_beta, cfg.height, cfg.width) == (8, 0.04, 64, 96)
    assert cfg.micro_batch_size == 8 and trainer.parse_config(grpo, ["--group-size", "4"]).micro_batch_size == 4
    real = trainer.parse_config(grpo, ["--model", "zai-org/GLM-Image"])
    assert (real.height, real.top_p, real.lora_rank, real.mu, real.micro_batch_size) == (1024, 0.75, 16, 1, 1)
    assert (real.lr, real.kl_beta, real.shuffle, real.before_after) == (1e-5, 0.04, True, 0)
    given = trainer.parse_config(grpo, ["--model", "zai-org/GLM-Image", "--group-size", "6", "--lora-rank", "0"])
    assert (given.group_size, given.lora_rank, given.micro_batch_size) == (6, 0, 1)
    help_text = run.config_parser(type(cfg)).format_help()  # one default a flag: a preset's own, in its help
    assert "(default: 8 tiny, 4 real)" in help_text and "(default: None)" not in help_text
    assert "(default: 0.2)" in help_text  # a plain field's, from argparse
    flags = {"--" + f.name.replace("_", "-") for f in dataclasses.fields(type(cfg))}
    assert {"--group-size", "--clip-eps", "--kl-beta", "--top-p", "--out", "--resume", "--diversity",
            "--policy-dist", "--sampler-correction", "--before-after", "--offload"} <= flags  # the lesson's, the
    # run's (helpers/run.py) and the variants' (variants.py)
    assert set(trainer.PRESETS) <= {f.name for f in dataclasses.fields(type(cfg))}
    tiny = {f.name: f.default for f in dataclasses.fields(type(cfg))}
    assert all(tiny[name] == pair[0] for name, pair in trainer.PRESETS.items())  # Config's defaults: the tiny ones


def test_parse_config_file(tmp_path):
    """A --config file's keys count as given: the real model's presets do not replace them."""
    (tmp_path / "c.yaml").write_text("model: zai-org/GLM-Image\nlr: 3.0e-6\n")
    cfg = trainer.parse_config(grpo, ["--config", str(tmp_path / "c.yaml")])
    assert (cfg.lr, cfg.group_size) == (3e-6, 4)


def test_reward_table():
    """The command line's rewards: grpo.py's (ssim, mse) and helpers/rewards.py's, by name."""
    table = trainer.reward_table(grpo)
    assert table["ssim"] is grpo.ssim_reward and {"shapes", "ocr", "pickscore"} <= set(table)


def test_load_random():
    """'random:L': GLM-Image's published widths at depth L, in the dtype asked (on the meta device: no memory), with
    only the AR trainable, as grpo.load_glm_image leaves a model."""
    cfg = trainer.parse_config(grpo, ["--model", "random:1"])
    random = trainer.load(grpo, cfg, "meta", torch.bfloat16)
    ar = random.vision_language_encoder
    assert ar.model.language_model.embed_tokens.weight.shape == (168064, 4096)
    assert len(ar.model.language_model.layers) == len(random.transformer.transformer_blocks) == 1
    assert {p.dtype for part in (ar, random.transformer, random.vae) for p in part.parameters()} == {torch.bfloat16}
    assert torch.get_default_dtype() == torch.float32 and not any(p.requires_grad for p in random.vae.parameters())


# ---- Sampling -----------------------------------------------------------------------------------

def test_sample_groups(random_pipe):
    """The fast decode's groups: grpo.sample_groups' tokens and log-probs for the same seeds (test_fast_decode.py has
    the rest), text-to-image and editing, with the kept codes' bits under top-p."""
    prompts, sources = ["a red circle", "make it red"], [None, smooth_source(64, 64)]
    fast = trainer.sample_groups(grpo, random_pipe, prompts, 2, 64, 64, T, [4, 5], 0, 0.75, sources)
    lesson = grpo.sample_groups(random_pipe, prompts, 2, 64, 64, T, [4, 5], 0, 0.75, sources)
    for f, s in zip(fast, lesson):
        assert torch.equal(f.tokens, s.tokens) and (f.q_logprobs - s.q_logprobs).abs().max() <= 1e-6
        assert f.prompt.large_hw == s.prompt.large_hw and f.support is not None


# ---- The update, robust for many processes -----------------------------------------------------

def loss(clip_eps=0.2, kl_beta=0.0, sampler_cap=2.0):
    """grpo.micro_batch_loss with its settings, as main binds them."""
    return functools.partial(grpo.micro_batch_loss, clip_eps=clip_eps, kl_beta=kl_beta, sampler_cap=sampler_cap)


def gradients(policy, rollouts, advantages, micro_batch_size, ref=None, mu=1, lr=0.0, correction="token_truncate",
              kl_beta=0.0):
    """train_step on `policy` (SGD at `lr`, no gradient clip) -> the last update's gradients by name, and the metrics;
    `correction`: a --sampler-correction mode, through the variants' seam."""
    opt = torch.optim.SGD([p for p in policy.parameters() if p.requires_grad], lr=lr)
    batches = trainer.micro_batches(rollouts, advantages, micro_batch_size)
    loss_fn = loss(kl_beta=kl_beta)
    if correction != "token_truncate":
        cfg = trainer.parse_config(grpo, ["--sampler-correction", correction, "--kl-beta", str(kl_beta)])
        batches, loss_fn = variants.update(batches, loss_fn, policy, cfg, grpo)
    m = trainer.train_step(grpo, policy, opt, batches, ref, loss_fn, temperature=T, mu=mu, max_grad_norm=math.inf)
    return {n: p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None}, m


def relative_difference(a: dict, b: dict) -> float:
    """|a - b| / |a| over every tensor of two gradients."""
    norm = torch.sqrt(sum((g ** 2).sum() for g in a.values()))
    return (torch.sqrt(sum(((a[k] - b[k]) ** 2).sum() for k in a)) / norm).item()


def test_micro_batches(pipe):
    """Each group's rows cut into micro-batches in order, never two groups in one, each with its rows' tokens, the
    sampler's log-probs of p, its advantages and the preview's length, its rollout and rows (the variants' reading),
    in the loss unless its group's reward was not finite."""
    rollouts = [sample_group(pipe, p, 4, 64, 64, T, seed=s) for s, p in enumerate(["a cat", "a dog"])]
    batches = trainer.micro_batches(rollouts, torch.arange(8.0).view(2, 4), 3, torch.tensor([True, False]))
    assert [len(mb.tokens) for mb in batches] == [3, 1, 3, 1] and [mb.in_loss for mb in batches] == [1, 1, 0, 0]
    assert torch.equal(batches[1].tokens, rollouts[0].tokens[3:]) and batches[2].advantages.tolist() == [4, 5, 6]
    assert batches[3].inputs is rollouts[1].prompt.inputs and batches[0].n_preview == 16 * 16  # the preview at 64x64
    assert torch.equal(batches[2].sampler_logprobs, rollouts[1].p_logprobs[:3]) and batches[0].support is None
    assert batches[3].rollout is rollouts[1] and batches[3].rows == slice(3, 6)
    lesson = grpo.micro_batches(rollouts, torch.arange(8.0).view(2, 4), 3)  # the lesson's fields, the same
    assert all(torch.equal(getattr(a, f), getattr(b, f)) for a, b in zip(lesson, batches) for f in ("tokens",
               "sampler_logprobs", "advantages")) and [a.n_preview for a in lesson] == [b.n_preview for b in batches]


def test_distribution():
    """The trained distribution: code_logprobs, or given codes (a support) softmax(logits / T) renormalised over
    exactly those (no truncation recomputed): a sampler's top-k / top-p cut gives its own q back."""
    logits = torch.tensor([[2.0, 1.0, 1.0, 0.0, -1.0, 9.0]])
    support = torch.tensor([[False, True, False, True, True]])
    got = variants.distribution(grpo, logits, 0.5, 5, support)[0]
    assert torch.isinf(got[[0, 2]]).all()
    assert torch.allclose(got[[1, 3, 4]], torch.log_softmax(torch.tensor([1.0, 0.0, -1.0]) / 0.5, -1))
    truncated = grpo.code_logprobs(logits, 0.9, 5, top_k=3, top_p=0.8)
    assert torch.equal(variants.distribution(grpo, logits, 0.9, 5, truncated.isfinite()), truncated)
    assert torch.equal(variants.distribution(grpo, logits, 0.9, 5), grpo.code_logprobs(logits, 0.9, 5))


def test_reference_logprobs(random_pipe):
    """The reference's log-probs of the drawn codes on the micro-batch's trained distribution: the lesson's without a
    support; with one (--policy-dist truncated), renormalised over its codes."""
    ar = random_pipe.vision_language_encoder
    r = sample_group(random_pipe, "a cat", 2, 64, 64, T, seed=0, top_p=0.75)
    mb = trainer.micro_batches([r], torch.zeros(1, 2), 2)[0]
    assert torch.equal(trainer.reference_logprobs(grpo, ar, mb, T), grpo.reference_logprobs(ar, mb, T))
    assert trainer.reference_logprobs(grpo, None, mb, T) is None
    truncated = mb._replace(support=kept_codes(r, ar))
    with torch.no_grad():
        q = grpo.token_logprobs(ar, r.prompt.inputs, r.tokens, T, 0, 0.75)
    assert (trainer.reference_logprobs(grpo, ar, truncated, T) - q).abs().max() <= 1e-5

def test_train_step(sharp_pipe):
    """The first update's ratio is exactly 1 (pi_old is the policy before its first step), only the AR gets
    gradients, the loss is grpo_loss of the trainer's log-probs on the large grid, and the weights move."""
    pipe = copy.deepcopy(sharp_pipe)
    policy = pipe.vision_language_encoder
    r = sample_group(pipe, "a cat", 4, 64, 64, T, seed=0)
    before = policy.lm_head.weight.detach().clone()
    adv = torch.tensor([[1.0, -1.0, 0.5, -0.5]])
    grads, m = gradients(policy, [r], adv, 2, ref=grpo.reference_model(policy, 0.1), kl_beta=0.1, lr=1e-3)
    assert m["ratio_min"] == m["ratio_max"] == 1.0 and m["clip_frac"] == 0 and m["kl"] < 1e-6 and m["skipped"] == 0
    assert not torch.equal(before, policy.lm_head.weight)
    for module in (pipe.transformer, pipe.vae, pipe.text_encoder, policy.model.visual, policy.model.vqmodel):
        assert all(p.grad is None for p in module.parameters())
    with torch.no_grad():
        logprobs = grpo.token_logprobs(sharp_pipe.vision_language_encoder, r.prompt.inputs, r.tokens, T)[:, 256:]
    want, _ = grpo.grpo_loss(logprobs, logprobs, logprobs, adv[0], 0.2, 0.1)
    assert abs(m["loss"] - want.item()) < 1e-5


def test_train_step_micro_batching(pipe):
    """Micro-batches of 1 give the full batch's gradient within 1e-5: each loss weighs its share of the step."""
    rollouts = [sample_group(pipe, p, 4, 64, 64, T, seed=s) for s, p in enumerate(["a cat", "a dog"])]
    advantages = torch.tensor([[1.0, -1.0, 0.5, -0.5], [0.3, 0.3, -0.9, 0.3]])
    whole, m_whole = gradients(copy.deepcopy(pipe.vision_language_encoder), rollouts, advantages, 4)
    micro, m_micro = gradients(copy.deepcopy(pipe.vision_language_encoder), rollouts, advantages, 1)
    assert whole.keys() == micro.keys() and relative_difference(whole, micro) < 1e-5
    assert abs(m_whole["loss"] - m_micro["loss"]) < 1e-6


def test_train_step_mu(random_pipe):
    """With mu > 1 the later updates see their ratios leave 1 (pi_old stays the first update's), and the clip acts;
    each update's gradient starts from zero: at lr 0 the third update's gradient is the first's."""
    r = sample_group(random_pipe, "a cat", 4, 64, 64, T, seed=0)
    adv = torch.tensor([[1.0, -1.0, 0.5, -0.5]])
    once, _ = gradients(copy.deepcopy(random_pipe.vision_language_encoder), [r], adv, 2)
    thrice, _ = gradients(copy.deepcopy(random_pipe.vision_language_encoder), [r], adv, 2, mu=3)
    assert relative_difference(once, thrice) < 1e-6
    _, m = gradients(copy.deepcopy(random_pipe.vision_language_encoder), [r], torch.tensor([[1.0, -1.0, 1.0, -1.0]]),
                     4, mu=3, lr=5.0)
    assert (m["ratio_max"] > 1.2 or m["ratio_min"] < 0.8) and m["clip_frac"] > 0


def test_train_step_mu_autocast(random_pipe):
    """Under bf16 autocast (the real model's --dtype) the later updates read the weights the optimizer stepped, not
    the bf16 copies autocast cast at the first update (it keeps them until its region ends): their ratios leave 1."""
    from tests.conftest import lora_policy
    r = sample_group(random_pipe, "a cat", 4, 64, 64, T, seed=0)
    ar = copy.deepcopy(random_pipe.vision_language_encoder)
    policy = lora_policy(type("Pipe", (), {"vision_language_encoder": ar})(), rank=2)  # only Linear weights train
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, m = gradients(policy, [r], torch.tensor([[1.0, -1.0, 1.0, -1.0]]), 4, mu=2, lr=5.0)
    assert m["ratio_max"] > 1.05 or m["ratio_min"] < 0.95


def test_loss_shares(monkeypatch):
    """Each micro-batch weighs its rows over the sequences in the loss (0 out of the loss), so the shares of one
    process sum to 1; under torchrun the count is the mean over the processes (rows_per_process)."""
    def mb(rows: int, in_loss: bool = True) -> trainer.MicroBatch:
        return trainer.MicroBatch({}, torch.zeros(rows, 3), torch.zeros(rows, 3), torch.zeros(rows), 0, None,
                               slice(0, rows), in_loss=in_loss)
    batches = [mb(3), mb(1), mb(4, in_loss=False), mb(2)]
    assert trainer.loss_shares(batches) == [0.5, 1 / 6, 0.0, 1 / 3]
    monkeypatch.setattr(trainer, "rows_per_process", lambda n: (n + 12) / 2)  # another process with 12 rows in the loss
    assert trainer.loss_shares(batches) == [1 / 3, 1 / 9, 0.0, 2 / 9]


def test_active_dropout(pipe):
    """The modules that drop out now: an attention dropout or a LoRA-style nn.Dropout with p > 0, in train mode only;
    disable_dropout leaves none."""
    ar = copy.deepcopy(pipe.vision_language_encoder)
    assert trainer.active_dropout(ar.train()) == []
    ar.model.language_model.layers[0].self_attn.attention_dropout = 0.3
    ar.model.language_model.layers[1].mlp.add_module("lora_dropout", torch.nn.Dropout(0.1))
    dropping = trainer.active_dropout(ar)
    assert dropping == ["model.language_model.layers.0.self_attn", "model.language_model.layers.1.mlp.lora_dropout"]
    assert trainer.active_dropout(ar.eval()) == []  # in eval mode nothing drops out
    grpo.disable_dropout(ar)  # zeroes nn.Dropout's p and the attention dropouts
    assert trainer.active_dropout(ar.train()) == []


def test_train_mode(pipe):
    """train_step's mode: train mode only to checkpoint activations, eval otherwise; a dropout on in train mode is
    refused in one line, by train_step too (with dropout pi would not be pi_old at update 2)."""
    ar = copy.deepcopy(pipe.vision_language_encoder)
    trainer.train_mode(ar)
    assert not ar.training
    ar.activation_checkpointing_enable()
    trainer.train_mode(ar)
    assert ar.training
    ar.model.language_model.layers[0].self_attn.attention_dropout = 0.3
    r = sample_group(pipe, "a cat", 2, 64, 64, T, seed=0)
    opt = torch.optim.SGD([p for p in ar.parameters() if p.requires_grad], lr=0.0)
    with pytest.raises(ValueError, match=r"^train_step: model.language_model.layers.0.self_attn drops out in train "
                                         r"mode, so pi != pi_old; set its p to 0 \(disable_dropout\)"):
        trainer.train_step(grpo, ar, opt, trainer.micro_batches([r], torch.tensor([[1.0, -1.0]]), 2), None, loss(),
                        temperature=T, mu=2, max_grad_norm=1.0)


def test_train_step_in_loss(pipe):
    """A micro-batch out of the loss (its group's reward was not finite: in_loss False) runs but adds nothing, its KL
    included: the gradient and the metrics equal those of the step without it; with none in the loss the step is
    skipped."""
    rollouts = [sample_group(pipe, p, 4, 64, 64, T, seed=s) for s, p in enumerate(["a cat", "a dog"])]
    advantages = torch.tensor([[1.0, -1.0, 0.5, -0.5], [0.0, 0.0, 0.0, 0.0]])
    ref = copy.deepcopy(pipe.vision_language_encoder).requires_grad_(False)
    with torch.no_grad():
        ref.lm_head.weight.mul_(2.0)  # a reference apart from the policy: a KL from the first update on

    def step(batches):
        policy = copy.deepcopy(pipe.vision_language_encoder)
        opt = torch.optim.SGD([p for p in policy.parameters() if p.requires_grad], lr=0.0)
        m = trainer.train_step(grpo, policy, opt, batches, ref, loss(kl_beta=0.1),
                            temperature=T, mu=1, max_grad_norm=math.inf)
        return {n: p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None}, m

    both, m_both = step(trainer.micro_batches(rollouts, advantages, 2, torch.tensor([True, False])))
    alone, m_alone = step(trainer.micro_batches(rollouts[:1], advantages[:1], 2))
    assert m_both["kl"] > 1e-4 and relative_difference(alone, both) < 1e-6
    assert m_both == pytest.approx(m_alone, rel=1e-5)
    none = trainer.micro_batches(rollouts, advantages, 2, torch.tensor([False, False]))
    assert step(none)[1] == {"skipped": 1}


def test_train_step_nonfinite(pipe):
    """A NaN loss skips the update (counted) and leaves the weights as they were; no micro-batch at all (every group
    left out) skips the step's updates."""
    r = sample_group(pipe, "a cat", 4, 64, 64, T, seed=0)
    policy = copy.deepcopy(pipe.vision_language_encoder)
    before = [p.detach().clone() for p in policy.parameters()]
    _, m = gradients(policy, [r], torch.tensor([[float("nan"), 1.0, -1.0, 0.0]]), 2, lr=1e-2)
    assert m["skipped"] == 1 and all(torch.equal(p, q) for p, q in zip(before, policy.parameters()))
    opt = torch.optim.SGD(policy.parameters(), lr=1.0)
    assert trainer.train_step(grpo, policy, opt, [], None, loss(), temperature=T, mu=2,
                           max_grad_norm=1.0) == {"skipped": 2}


def test_train_step_correction(random_pipe):
    """A sampler gap, injected: each --sampler-correction mode's gradient is the uncorrected one times its weight
    (first update: ratio 1). A gap of +0.3 nats on the large grid weighs e^0.3 (token_truncate), -0.3 weighs e^-0.3,
    1.0 is cut to the cap 2 (truncate) or to 0 (mask). A gap on the PREVIEW only (outside the loss) leaves the token
    modes alone, and the sequence modes see it: the preview conditions the large grid."""
    r = sample_group(random_pipe, "a red circle", 4, 64, 64, T, seed=1)
    n_preview = math.prod(r.prompt.preview_hw)
    adv = torch.tensor([[1.0, -1.0, 0.5, -0.5]])
    base, _ = gradients(copy.deepcopy(random_pipe.vision_language_encoder), [r], adv, 2, correction="none")
    large, preview = slice(n_preview, None), slice(0, n_preview)
    for cols, gap, mode, factor in [(large, 0.3, "token_truncate", math.exp(0.3)),
                                    (large, -0.3, "token_truncate", math.exp(-0.3)),
                                    (large, 1.0, "token_truncate", 2.0), (large, 1.0, "token_mask", 0.0),
                                    (large, -0.3, "token_mask", math.exp(-0.3)), (large, 1.0, "none", 1.0),
                                    (preview, 0.1, "token_truncate", 1.0), (preview, 0.1, "sequence_truncate", 2.0),
                                    (preview, 0.1, "sequence_mask", 0.0),
                                    (preview, -0.01, "sequence_truncate", math.exp(-0.01 * n_preview))]:
        p_logprobs = r.p_logprobs.clone()
        p_logprobs[:, cols] -= gap  # the sampler's log-probs: pi_old / pi_sampler = e^gap there
        grads, _ = gradients(copy.deepcopy(random_pipe.vision_language_encoder), [r._replace(p_logprobs=p_logprobs)],
                             adv, 2, correction=mode)
        norm = torch.sqrt(sum((g ** 2).sum() for g in base.values()))
        difference = torch.sqrt(sum(((grads[k] - factor * g) ** 2).sum() for k, g in base.items()))
        assert difference <= 1e-5 * norm, (mode, gap)  # relative to the uncorrected gradient


def test_optimizer_step():
    """Clips the gradient to max_grad_norm and steps, returning the norm before the clip; a non-finite loss or
    gradient skips the step (False) and clears the gradient."""
    weight = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([weight], lr=1.0)
    weight.grad = torch.tensor([3.0, 4.0])
    norm, stepped = trainer.optimizer_step(opt, [({"loss": 0.5}, 1.0)], 1.0)
    assert norm == pytest.approx(5.0) and stepped
    assert torch.allclose(weight.detach(), torch.tensor([-0.6, -0.8]))  # clipped to norm 1
    for loss, grad in ((math.nan, [1.0, 1.0]), (0.5, [math.inf, 1.0])):
        weight.grad = torch.tensor(grad)
        assert not trainer.optimizer_step(opt, [({"loss": loss}, 1.0)], 1.0)[1]
        assert weight.grad is None and torch.allclose(weight.detach(), torch.tensor([-0.6, -0.8]))


def test_train_step_gradient_checkpointing(pipe):
    """Gradient checkpointing gives the same gradients as without, within 1e-5 relative."""
    r = sample_group(pipe, "a cat", 4, 64, 64, T, seed=0)
    adv = torch.tensor([[1.0, -1.0, 0.5, -0.5]])
    plain, _ = gradients(copy.deepcopy(pipe.vision_language_encoder), [r], adv, 2)
    policy = copy.deepcopy(pipe.vision_language_encoder)
    policy.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    checkpointed, _ = gradients(policy, [r], adv, 2)
    assert relative_difference(plain, checkpointed) < 1e-5


def test_sampler_correction():
    """variants.sampler_correction, TRL's five modes by hand (token_truncate is grpo.importance_weights): r = exp(old - sampled) per token, or per sequence (its sum) on each of its tokens,
    cut to the cap (truncate) or to 0 above it (mask), 1 for none; an exact sampler gets 1; never differentiable."""
    old = torch.tensor([[-1.0, -2.0, -0.5], [-1.0, -1.0, -1.0]], requires_grad=True)
    sampled = torch.tensor([[-1.5, -1.0, -0.5], [-2.0, -1.0, -1.0]])
    d = old.detach() - sampled
    seq = d.sum(1, keepdim=True).expand(2, 3)
    cap = 1.5
    want = {"token_truncate": d.exp().clamp(max=cap), "token_mask": torch.where(d.exp() > cap, 0.0, d.exp()),
            "sequence_truncate": seq.exp().clamp(max=cap), "sequence_mask": torch.where(seq.exp() > cap, 0.0, seq.exp()),
            "none": torch.ones(2, 3)}
    assert set(CORRECTIONS) == set(want)
    for mode, weights in want.items():
        got = variants.sampler_correction(old, sampled, mode, cap)
        assert torch.allclose(got, weights) and not got.requires_grad, mode
    assert variants.sampler_correction(old, old.detach()).eq(1).all()
    assert torch.equal(variants.sampler_correction(old, sampled, "token_truncate", cap),
                       grpo.importance_weights(old, sampled, cap))
