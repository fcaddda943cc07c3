"""The companion of grpo.py: a test_<function> for every function of grpo.py, in its sections (config, loading,
steps 1-5, the loop, editing, main), each opening with the property it checks. Everything runs on the tiny GLM-Image on
a CPU.

    python -m pytest -q test_grpo.py                          # these, in about a minute on 2 cores
    python -m pytest -q                                       # and tests/: whole runs, torchrun, 1024x1024, variants
    GRPO_TEST_DEVICE=cuda python -m pytest -q test_grpo.py    # on a GPU

Shared with tests/ (tests/conftest.py): the three tiny pipelines (`pipe`: the pre-trained tiny model; `random_pipe`:
random weights, so its samples differ; `sharp_pipe`: random and peaked, so wrong log-probs are far from right ones),
`sample_group` (one prompt's group as the trainer samples it: the same tokens, helpers/fast_decode.py) and
`smooth_source` (an image to edit).
"""

import ast
import copy
import dataclasses
import inspect
import json
import math
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch
from PIL import Image

import grpo
from helpers import run, trainer, user_input
from helpers.offline_model import tiny_glm_image
from tests.conftest import DEVICE, PARITY, ROOT, T, sample_group, smooth_source  # settings, helpers
from tests.conftest import pipe, random_pipe, sharp_pipe  # noqa: F401  the tiny pipelines (fixtures)
from tools.generate_reference import generate_group  # transformers' generate, with code_logprobs as its processor


def codebook(model) -> int:
    """The AR's codebook size K."""
    return model.config.vq_config.num_embeddings


# ---- Config --------------------------------------------------------------------------------------

def test_arg():
    """A field's default stays its default; its help travels in the metadata (--help)."""
    field = grpo.arg(3, "how many")
    assert field.default == 3 and field.metadata == {"help": "how many"}


def test_config():
    """Every field has a default (the tiny model's: what the command line gives it) and a help line."""
    fields = dataclasses.fields(grpo.Config)
    assert all(f.metadata["help"] and f.default is not dataclasses.MISSING for f in fields)
    cli = trainer.parse_config(grpo, [])
    assert all(getattr(cli, f.name) == f.default for f in fields if f.name != "micro_batch_size")  # 0: a group
    assert dataclasses.asdict(grpo.Config())["group_size"] == 8


# ---- Loading GLM-Image ---------------------------------------------------------------------------

def test_load_glm_image(pipe, monkeypatch):
    """'tiny' loads the shipped folder as a hub id would load, with only the AR's language model trainable."""
    from diffusers import GlmImagePipeline
    loaded, real = [], GlmImagePipeline.from_pretrained.__func__
    monkeypatch.setattr(GlmImagePipeline, "from_pretrained",
                        classmethod(lambda cls, path, **kw: loaded.append(path) or real(cls, path, **kw)))
    grpo.load_glm_image("tiny")
    assert loaded == [grpo.TINY] and (grpo.TINY / "model_index.json").is_file()
    trainable = {n for n, p in pipe.vision_language_encoder.named_parameters() if p.requires_grad}
    assert trainable and all(n.startswith(("model.language_model", "lm_head")) for n in trainable)


def test_only_ar_trains():
    """Only the AR's language model trains: DiT, VAE, T5, vision tower and VQ frozen, everything in eval mode."""
    pipe = grpo.only_ar_trains(tiny_glm_image(0))  # built in code: it starts in train mode, all trainable
    ar = pipe.vision_language_encoder
    for module in (pipe.transformer, pipe.vae, pipe.text_encoder, ar.model.visual, ar.model.vqmodel):
        assert not any(p.requires_grad for p in module.parameters()) and not module.training
    assert any(p.requires_grad for p in ar.model.language_model.parameters()) and not ar.training


def test_disable_dropout():
    """After disable_dropout, train mode scores like eval mode (peer bug: dropout on only in training)."""
    pipe = tiny_glm_image(0)
    ar = pipe.vision_language_encoder
    for layer in ar.model.language_model.layers:
        layer.self_attn.attention_dropout = 0.5
    r = sample_group(pipe, "a cat", 2, 64, 64, T, seed=0)  # sampling switches dropout off (eval)
    ar.train()
    with torch.no_grad():
        assert (grpo.token_logprobs(ar, r.prompt.inputs, r.tokens, T) - r.q_logprobs).abs().max() > 1e-2
    grpo.disable_dropout(ar)
    with torch.no_grad():
        assert (grpo.token_logprobs(ar, r.prompt.inputs, r.tokens, T) - r.q_logprobs).abs().max() <= 1e-5


def test_trained_model(pipe):
    """LoRA on the language model's attention and MLP, injected in place (the pipeline samples with it), the rest
    frozen, seeded (the same A twice); rank 0 trains the AR itself; activation checkpointing when asked."""
    whole = grpo.trained_model(copy.deepcopy(pipe), 0)
    assert not hasattr(whole, "disable_adapter") and not whole.is_activation_checkpointing
    copied = copy.deepcopy(pipe)
    lora = grpo.trained_model(copied, 4, gradient_checkpointing=True, seed=3)
    trainable = [n for n, p in lora.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n and "language_model.layers" in n for n in trainable)
    assert {n.split(".")[-4] for n in trainable} >= {"q_proj", "v_proj", "gate_up_proj", "down_proj"}
    assert copied.vision_language_encoder.model.language_model.layers[0].self_attn.q_proj.lora_A  # in place
    assert lora.is_activation_checkpointing
    again = grpo.trained_model(copy.deepcopy(pipe), 4, seed=3)
    a = dict(lora.named_parameters())
    assert all(torch.equal(p, a[n]) for n, p in again.named_parameters() if "lora_A" in n)


def test_reference_model(pipe):
    """None when beta is 0; the policy itself under LoRA (its adapter off is the reference); else a frozen copy."""
    ar = pipe.vision_language_encoder
    assert grpo.reference_model(ar, 0.0) is None
    ref = grpo.reference_model(ar, 0.04)
    for p, q in zip(ar.parameters(), ref.parameters()):
        assert torch.equal(p, q) and p.data_ptr() != q.data_ptr() and not q.requires_grad
    assert not ref.training
    lora = grpo.trained_model(copy.deepcopy(pipe), 4)
    assert grpo.reference_model(lora, 0.04) is lora


# ---- Step 1. Sample: a group of token grids per prompt, and their log-probs ----------------------

def test_code_logprobs(pipe):
    """code_logprobs is the distribution transformers' generate samples from with it as its processor."""
    K = codebook(pipe.vision_language_encoder)
    _, _, scores, logits = generate_group(pipe, "a cat", 4, 64, 64, T, 0)  # (G, N, V) processed / raw
    assert torch.isinf(scores[..., K:]).all() and torch.isfinite(scores[..., :K]).all()
    sampled = torch.log_softmax(scores.float(), -1)[..., :K]
    assert (sampled - grpo.code_logprobs(logits, T, K)).abs().max() < 1e-5
    # the peer bug "divide the processed scores by T again" gives another distribution
    assert (torch.log_softmax(scores[..., :K] / T, -1) - sampled).abs().max() > 1e-2


def test_code_logprobs_truncation():
    """top-k and top-p by hand: ties at the k-th value kept, the nucleus the fewest codes reaching p (a tie broken
    by id, the lower out first), renormalised, -inf outside; ids beyond the codebook never count."""
    logits = torch.tensor([[2.0, 1.0, 1.0, 0.0, -1.0, 9.0]])  # K = 5: id 5 is no code
    inf = float("-inf")

    def logprobs(**cut):
        return grpo.code_logprobs(logits, 1.0, 5, **cut)[0]

    assert torch.allclose(logprobs(), torch.log_softmax(logits[0, :5], -1))
    kept = torch.log_softmax(torch.tensor([2.0, 1.0, 1.0]), -1)  # top-2: the tie at the 2nd value stays
    assert torch.allclose(logprobs(top_k=2), torch.tensor([*kept.tolist(), inf, inf]))
    # p = softmax: 0.521, 0.191, 0.191, 0.070, 0.026; ascending sums 0.026, 0.096, 0.288, 0.479, 1
    assert torch.allclose(logprobs(top_p=0.75), torch.tensor([*kept.tolist(), inf, inf]))  # drops sums <= 0.25
    two = torch.log_softmax(torch.tensor([2.0, 1.0]), -1)
    assert torch.allclose(logprobs(top_p=0.6), torch.tensor([two[0], inf, two[1], inf, inf]))  # id 1 of the tie
    assert torch.allclose(logprobs(top_p=0.01), torch.tensor([0.0, inf, inf, inf, inf]))  # the most likely stays
    assert torch.allclose(logprobs(top_k=3, top_p=0.6), logprobs(top_p=0.6))  # k first, then the nucleus


def test_code_logprobs_unsort_example():
    """The worked example in code_logprobs: scores [2, 0, 1] at top-p 0.75 drop code 1 (the least likely) only."""
    kept = grpo.code_logprobs(torch.tensor([2.0, 0.0, 1.0]), 1.0, 3, top_p=0.75).isfinite()
    assert kept.tolist() == [True, False, True]


def test_group_inputs(pipe):
    """The group repeats the prompt G times and keeps each sample's [large, preview] grid rows together."""
    inputs = grpo.group_inputs(pipe.processor, "a cat", 4, 64, 96, DEVICE)
    assert inputs["input_ids"].shape[0] == 4 and (inputs["input_ids"] == inputs["input_ids"][0]).all()
    assert inputs["image_grid_thw"].tolist() == [[1, 2, 3], [1, 13, 19]] * 4
    assert inputs["images_per_sample"].tolist() == [2] * 4
    assert inputs["input_ids"][0, -1] == pipe.vision_language_encoder.config.image_start_token_id


def test_group_inputs_editing(pipe):
    """With a source: one placeholder per source token between image start and end, the patches once, and per
    sample the grid rows [source, large] (editing writes no preview)."""
    cfg = pipe.vision_language_encoder.config
    inputs = grpo.group_inputs(pipe.processor, "make it red", 3, 64, 96, DEVICE, grpo.to_pil(smooth_source(64, 64)))
    assert inputs["image_grid_thw"].tolist() == [[1, 2, 2], [1, 2, 3]] * 3
    ids = inputs["input_ids"][0].tolist()
    start = ids.index(cfg.image_start_token_id)
    assert ids[start + 1: start + 5] == [cfg.image_token_id] * 4 and ids[start + 5] == cfg.image_end_token_id
    assert inputs["pixel_values"].shape == (4, 3 * 16 * 16) and ids[-1] == cfg.image_start_token_id


def test_group_prompt(pipe):
    """The processor lists [large, preview], the AR writes the preview first (the docstring's 96x96 example)."""
    group = grpo.group_prompt(pipe, "a cat", 2, 96, 96)
    assert group.inputs["image_grid_thw"][:2, 1:].tolist() == [[3, 3], [16, 16]]
    assert (group.preview_hw, group.large_hw, group.source) == ((16, 16), (3, 3), None)


@pytest.mark.parametrize("height,width", [(64, 64), (64, 96)])
def test_rope_positions(pipe, height, width):
    """Prompt and decode positions equal those GlmImageModel computes for generate (text-to-image and editing)."""
    cfg, core = pipe.vision_language_encoder.config, pipe.vision_language_encoder.model
    for source in (None, smooth_source(height, width)):
        r = sample_group(pipe, "make it red", 2, height, width, T, seed=0, source=source)
        P, N = r.prompt.inputs["input_ids"].shape[1], r.tokens.shape[1]
        prompt_pos, _ = core.get_rope_index(r.prompt.inputs["input_ids"], r.prompt.inputs["image_grid_thw"],
                                            r.prompt.inputs["images_per_sample"], r.prompt.inputs["attention_mask"])
        decode_pos = core._cached_decode_position_ids  # (G, 3, N + 1), stored by get_rope_index
        mine = grpo.rope_positions(r.prompt.inputs["input_ids"][0], r.prompt.inputs["image_grid_thw"][:2], N,
                                   cfg.image_start_token_id, cfg.image_end_token_id)
        assert mine.shape == (3, 1, P + N - 1) and torch.equal(mine[:, 0, :P], prompt_pos[:, 0])
        assert torch.equal(mine[:, 0, P:], decode_pos[0, :, : N - 1])


def test_rope_positions_worked_example():
    """The docstring's example: a 5-token prompt, a 2x3 preview and a 4x4 large grid -> the triples it lists."""
    ids = torch.tensor([1, 2, 3, 4, 5])  # no image start / end tokens: a prompt of text
    got = grpo.rope_positions(ids, torch.tensor([[1, 4, 4], [1, 2, 3]]), 6 + 16, 98, 99)[:, 0].T.tolist()
    assert got[:5] == [[i, i, i] for i in range(5)]
    assert got[5:11] == [[5, 5, 5], [5, 5, 6], [5, 5, 7], [5, 6, 5], [5, 6, 6], [5, 6, 7]]
    assert got[11:15] == [[8, 8, 8], [8, 8, 9], [8, 8, 10], [8, 8, 11]] and got[15] == [8, 9, 8]
    assert len(got) == 5 + 6 + 16 - 1 and got[-1] == [8, 11, 10]  # the last token is never fed


@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (0, 0.75), (5, 1.0)], ids=["full", "top-p", "top-k"])
def test_generate(pipe, sharp_pipe, top_k, top_p):
    """The lesson's decode loop draws the very codes transformers' generate draws with code_logprobs as its
    processor for the same seed, with its log-probs: pre-trained and sharpened, square and not, editing."""
    for p, (height, width), source in [(pipe, (96, 96), None), (sharp_pipe, (64, 96), None),
                                        (pipe, (96, 64), smooth_source(96, 64))]:
        K = codebook(p.vision_language_encoder)
        group = (grpo.group_prompt(p, "a red circle", 4, height, width) if source is None else
                 grpo.edit_prompt(p, "a red circle", 4, height, width, source))
        tokens, q_logprobs, p_logprobs = grpo.generate(p.vision_language_encoder, group, T, 5, top_k, top_p)
        want_tokens, _, _, logits = generate_group(p, "a red circle", 4, height, width, T, 5, source, top_k, top_p)
        assert torch.equal(tokens, want_tokens)
        q = grpo.logprob_of(grpo.code_logprobs(logits, T, K, top_k, top_p), tokens)
        assert (q_logprobs - q).abs().max() <= 1e-5
        assert (p_logprobs - grpo.logprob_of(grpo.code_logprobs(logits, T, K), tokens)).abs().max() <= 1e-5


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_generate_exact(random_pipe, attention):
    """Sampler against trainer (one teacher-forced forward), sdpa and eager attention, text-to-image and editing:
    the log-probs under q and under p within 1e-5 in float32, so the first ratio is 1."""
    pipe = copy.deepcopy(random_pipe)
    ar = pipe.vision_language_encoder
    ar.set_attn_implementation(attention)
    for source in (None, smooth_source(64, 64)):
        r = grpo.sample_groups(pipe, ["make it red"], 3, 64, 64, T, [2], 0, 0.75, [source])[0]
        with torch.no_grad():
            q = grpo.token_logprobs(ar, r.prompt.inputs, r.tokens, T, 0, 0.75)
            p = grpo.token_logprobs(ar, r.prompt.inputs, r.tokens, T)
        assert (r.q_logprobs - q).abs().max() <= PARITY and (r.p_logprobs - p).abs().max() <= PARITY
        assert (r.p_logprobs <= r.q_logprobs + 1e-6).all()  # log p - log q = log of the nucleus' mass <= 0


def test_group_seed():
    """A group's seed: --seed * 1_000_003 + its number: within a run each group its own, and the runs of two seeds
    never share one (below 1_000_003 groups)."""
    first, second = ({grpo.group_seed(seed, g) for g in range(100_000)} for seed in (0, 1))
    assert len(first) == len(second) == 100_000 and not first & second  # a seed a group, none shared across runs
    assert grpo.group_seed(1, 5) == 1_000_008 and grpo.group_seed(0, 5) == 5


def test_sample_groups(random_pipe):
    """One Rollout per prompt, by `generate`: exactly N codes, group p drawn from seeds[p] as it is alone, with its own
    inputs and source (a source: edit_prompt's group); the caller's random state untouched."""
    K = codebook(random_pipe.vision_language_encoder)
    prompts, sources = ["a red circle", "make it red"], [None, smooth_source(64, 64)]
    state = torch.random.get_rng_state()
    rollouts = grpo.sample_groups(random_pipe, prompts, 2, 64, 64, T, [4, 5], sources=sources)
    assert torch.equal(state, torch.random.get_rng_state())
    for prompt, source, seed, r in zip(prompts, sources, [4, 5], rollouts):
        alone = grpo.sample_groups(random_pipe, [prompt], 2, 64, 64, T, [seed], sources=[source])[0]
        assert torch.equal(r.tokens, alone.tokens) and torch.equal(r.prompt.inputs["input_ids"],
                                                                   alone.prompt.inputs["input_ids"])
        assert r.tokens.shape[1] == math.prod(r.prompt.preview_hw) + math.prod(r.prompt.large_hw)
        assert r.prompt.large_hw == (2, 2) and (r.prompt.source is None) == (source is None)
        assert 0 <= r.tokens.min() and r.tokens.max() < K and r.q_logprobs.dtype == torch.float32
    other = grpo.sample_groups(random_pipe, prompts[:1], 2, 64, 64, T, [5])[0]
    assert not torch.equal(rollouts[0].tokens, other.tokens)


# ---- Step 2. Decode: tokens to pictures ----------------------------------------------------------

def test_prior_ids():
    """Only the large grid (the last h*w tokens) reaches the DiT, each token covering 2x2 of the DiT's grid."""
    tokens = torch.tensor([[9, 9, 9, 1, 2, 3, 4, 5, 6]])  # 3 preview tokens, then a 2x3 large grid
    want = torch.tensor([[1, 1, 2, 2, 3, 3], [1, 1, 2, 2, 3, 3], [4, 4, 5, 5, 6, 6], [4, 4, 5, 5, 6, 6]])
    assert torch.equal(grpo.prior_ids(tokens, (2, 3)), want.reshape(1, -1))
    assert torch.equal(grpo.prior_ids(tokens.repeat(2, 1), (2, 3))[1], want.reshape(-1))


def test_decode_images(pipe):
    """(G, 3, H, W) in [0, 1], deterministic for a seed, changed by the large grid's tokens only."""
    r = sample_group(pipe, "a cat", 4, 64, 96, T, seed=0)

    def decode(tokens):
        return grpo.decode_images(pipe, "a cat", tokens, r.prompt.large_hw, 64, 96, 2, seed=0)

    images = decode(r.tokens)
    assert images.shape == (4, 3, 64, 96) and images.dtype == torch.float32
    assert images.min() >= 0 and images.max() <= 1 and images.std() > 0 and torch.equal(images, decode(r.tokens))
    same = r.tokens.clone()
    same[1:] = r.tokens[0]
    shared = decode(same)
    assert (shared[1:] - shared[0]).abs().max() < 1e-4  # same tokens, same noise: the same image
    K = codebook(pipe.vision_language_encoder)
    new_large, new_preview = r.tokens.clone(), r.tokens.clone()
    new_large[:, -6:] = (new_large[:, -6:] + 7) % K
    new_preview[:, :10] = (new_preview[:, :10] + 7) % K
    assert (decode(new_large) - images).abs().max() > 1e-3 and torch.allclose(decode(new_preview), images)


def test_decode_images_editing(pipe, monkeypatch):
    """Editing: the DiT sees the source (another source or none decodes otherwise), given as GlmImagePipeline makes
    its prior ids from the source's codes (upsampled 2x), one copy per sample (edit_inputs)."""
    r = sample_group(pipe, "make it red", 2, 64, 64, T, seed=0, source=smooth_source(seed=0))
    other = sample_group(pipe, "make it red", 2, 64, 64, T, seed=0, source=smooth_source(seed=5)).prompt.source

    def decode(source):
        return grpo.decode_images(pipe, "make it red", r.tokens, r.prompt.large_hw, 64, 64, 2, seed=0, source=source)

    images = decode(r.prompt.source)
    assert (images - decode(None)).abs().max() > 1e-2 and (images - decode(other)).abs().max() > 1e-2
    (hs, ws), upsampled = r.prompt.source.grid_hw, pipe._upsample_token_ids(r.prompt.source.codes, *r.prompt.source.grid_hw)
    calls, call = [], type(pipe).__call__
    monkeypatch.setattr(type(pipe), "__call__", lambda self, **kw: calls.append(kw) or call(self, **kw))
    decode(r.prompt.source)
    assert len(calls[0]["prior_token_image_ids"]) == len(calls[0]["source_image_grid_thw"]) == 2
    for ids, grid in zip(calls[0]["prior_token_image_ids"], calls[0]["source_image_grid_thw"]):
        assert torch.equal(ids, upsampled.reshape(-1)) and grid.tolist() == [[1, 2 * hs, 2 * ws]]


# ---- Step 3. Score: rewards ----------------------------------------------------------------------

def naive_ssim(x, y):
    """Straight from Wang et al. 2004, window by window, in float64 numpy."""
    g = np.exp(-((np.arange(11) - 5) ** 2) / (2 * 1.5 ** 2))
    w = np.outer(g, g) / np.outer(g, g).sum()
    C1, C2 = 0.01 ** 2, 0.03 ** 2
    values = []
    for c in range(x.shape[0]):
        for i in range(x.shape[1] - 10):
            for j in range(x.shape[2] - 10):
                a, b = x[c, i:i + 11, j:j + 11], y[c, i:i + 11, j:j + 11]
                ma, mb = (w * a).sum(), (w * b).sum()
                va, vb, cov = (w * (a - ma) ** 2).sum(), (w * (b - mb) ** 2).sum(), (w * (a - ma) * (b - mb)).sum()
                values.append(((2 * ma * mb + C1) * (2 * cov + C2)) / ((ma ** 2 + mb ** 2 + C1) * (va + vb + C2)))
    return float(np.mean(values))


def test_ssim_reward():
    """1 for identical images; equal to a window-by-window computation within 1e-4; falls with noise."""
    g = torch.Generator().manual_seed(0)
    target = torch.rand(3, 24, 20, generator=g)
    noisy = (target + 0.1 * torch.randn(3, 3, 24, 20, generator=g)).clamp(0, 1)
    assert torch.allclose(grpo.ssim_reward(target[None], {"target": target}), torch.ones(1), atol=1e-6)
    ours = grpo.ssim_reward(noisy, {"target": target})
    for k in range(3):
        assert abs(ours[k].item() - naive_ssim(noisy[k].double().numpy(), target.double().numpy())) < 1e-4
    levels = torch.stack([(target + s * torch.randn(3, 24, 20, generator=g)).clamp(0, 1) for s in (0.02, 0.1, 0.3)])
    assert (grpo.ssim_reward(levels, {"target": target}).diff() < 0).all()


def test_mse_reward():
    """0 for identical images, minus the mean squared error otherwise; falls with noise."""
    target = torch.rand(3, 16, 16)
    assert grpo.mse_reward(target[None], {"target": target}).item() == 0
    assert torch.allclose(grpo.mse_reward(torch.full((1, 3, 16, 16), 0.5), {"target": target}),
                          -((target - 0.5) ** 2).mean()[None])
    g = torch.Generator().manual_seed(1)
    levels = torch.stack([(target + s * torch.randn(3, 16, 16, generator=g)).clamp(0, 1) for s in (0.02, 0.1, 0.3)])
    assert (grpo.mse_reward(levels, {"target": target}).diff() < 0).all()


def test_reward_functions():
    """'ssim=1,mse=0' -> each named reward with its weight; a name alone weighs 1."""
    assert grpo.reward_functions("ssim=1,mse=0") == {"ssim": (grpo.ssim_reward, 1.0), "mse": (grpo.mse_reward, 0.0)}
    assert grpo.reward_functions("mse") == {"mse": (grpo.mse_reward, 1.0)}
    assert grpo.reward_functions("x=0.5", {"x": len}) == {"x": (len, 0.5)}


def test_group_rewards():
    """Row p scores group p against example p (peer bug: rewards meeting the wrong prompt); each reward comes back
    beside the weighted sum."""
    examples = [{"target": torch.zeros(3, 16, 16)}, {"target": torch.ones(3, 16, 16)}]
    images = [torch.zeros(4, 3, 16, 16), torch.ones(4, 3, 16, 16)]
    total, each = grpo.group_rewards(images, examples, {"mse": (grpo.mse_reward, 1.0), "ssim": (grpo.ssim_reward, 0.5)})
    assert total.shape == (2, 4) and torch.allclose(total, torch.full((2, 4), 0.5))
    assert set(each) == {"mse", "ssim"} and torch.equal(each["mse"], torch.zeros(2, 4))
    swapped, _ = grpo.group_rewards(images[::-1], examples, {"mse": (grpo.mse_reward, 1.0)})
    assert (swapped == -1).all()


# ---- Step 4. Advantages --------------------------------------------------------------------------

def test_group_advantages():
    """z-scores within each group: mean 0, std 1, zeros (not NaN) without spread, the same for a R + b (a > 0) at any
    scale (the no-spread test is relative to the rewards' size)."""
    r = torch.tensor([[0.1, 0.5, 0.3, 0.9], [2.0, 2.0, 2.0, 2.0], [1.0, -1.0, 0.0, 0.0]])
    a = grpo.group_advantages(r)
    assert a.shape == r.shape and torch.isfinite(a).all() and torch.equal(a[1], torch.zeros(4))
    assert torch.allclose(a.mean(-1), torch.zeros(3), atol=1e-6)
    assert torch.allclose(a[[0, 2]].std(-1, unbiased=False), torch.ones(2), atol=1e-5)
    assert torch.allclose(grpo.group_advantages(r[0]), a[0])  # (G,) works too
    assert torch.equal(grpo.group_advantages(torch.full((4,), 0.3) + torch.tensor([0, 1e-7, 0, 0])), torch.zeros(4))
    for scale, shift in [(3.0, -7.0), (1e-5, 0.0), (1e-5, 1e-3), (1e4, -3e4)]:
        assert torch.allclose(grpo.group_advantages(scale * r + shift), a, atol=1e-3), (scale, shift)


# ---- Step 5. Update. 5a: the trainer's log-probs of the sampled tokens ---------------------------

def test_token_logits(sharp_pipe):
    """The logits that predict token t are the ones the sampler drew it from; the text ramp (no positions) is not."""
    ar = sharp_pipe.vision_language_encoder
    K = codebook(ar)
    r = sample_group(sharp_pipe, "a red circle", 2, 64, 96, T, seed=1)
    with torch.no_grad():
        logits = grpo.token_logits(ar, r.prompt.inputs, r.tokens)
        ramp = ar(input_ids=torch.cat([r.prompt.inputs["input_ids"], r.tokens[:, :-1]], 1),
                  logits_to_keep=r.tokens.shape[1]).logits  # positions left to the model: the 1D text ramp
    assert logits.shape == (*r.tokens.shape, ar.lm_head.out_features)
    assert (grpo.logprob_of(grpo.code_logprobs(logits, T, K), r.tokens) - r.q_logprobs).abs().max() <= PARITY
    assert (grpo.logprob_of(grpo.code_logprobs(ramp, T, K), r.tokens) - r.q_logprobs).abs().max() > 1.0  # nats


def test_token_logits_one_prompt_per_call(pipe):
    """Rows of two prompts in one call would be scored at row 0's positions: refused with a clear error."""
    a, b = (sample_group(pipe, p, 2, 96, 96, T, seed=0) for p in ("a red circle", "a blue square"))
    assert a.prompt.inputs["input_ids"].shape == b.prompt.inputs["input_ids"].shape  # same length, different words
    both = {k: torch.cat([a.prompt.inputs[k], b.prompt.inputs[k]]) for k in a.prompt.inputs}
    with pytest.raises(ValueError, match="one prompt.s samples"):
        grpo.token_logits(pipe.vision_language_encoder, both, torch.cat([a.tokens, b.tokens]))


def test_logprob_of():
    """Each token's entry of its own row of the distribution."""
    distribution = torch.log(torch.tensor([[[0.1, 0.9], [0.7, 0.3]]]))
    assert torch.allclose(grpo.logprob_of(distribution, torch.tensor([[1, 0]])), torch.log(torch.tensor([[0.9, 0.7]])))


@pytest.mark.parametrize("height,width", [(64, 64), (96, 64)])
def test_token_logprobs(pipe, sharp_pipe, height, width):
    """The trainer's log-probs equal the sampler's within 1e-5 in float32 (plain and sharpened, text-to-image and
    editing), so the first ratio is 1; gradients reach the AR through them."""
    for p in (pipe, sharp_pipe):
        for source in (None, smooth_source(height, width)):
            r = sample_group(p, "make it red", 4, height, width, T, seed=1, source=source)
            with torch.no_grad():
                logprobs = grpo.token_logprobs(p.vision_language_encoder, r.prompt.inputs, r.tokens, T)
            assert logprobs.shape == r.tokens.shape and (logprobs - r.q_logprobs).abs().max() <= PARITY
    ar = copy.deepcopy(sharp_pipe.vision_language_encoder)  # r: the sharpened model's last group
    grpo.token_logprobs(ar, r.prompt.inputs, r.tokens, T).sum().backward()
    assert ar.lm_head.weight.grad.abs().sum() > 0


def test_token_logprobs_temperature_mismatch(sharp_pipe):
    """Peer bug: scoring at T = 1 what was sampled at T = 0.9 puts the first ratio far from 1."""
    r = sample_group(sharp_pipe, "a cat", 4, 64, 64, T, seed=2)
    wrong = grpo.token_logprobs(sharp_pipe.vision_language_encoder, r.prompt.inputs, r.tokens, 1.0)
    _, m = grpo.grpo_loss(wrong, r.q_logprobs, None, torch.ones(4), 0.2, 0.0)
    assert max(m["ratio_max"] - 1, 1 - m["ratio_min"]) > 0.2


@pytest.mark.parametrize("top_k,top_p", [(0, 0.75), (5, 0.75)], ids=["top-p", "both"])
def test_token_logprobs_truncated(sharp_pipe, top_k, top_p):
    """GLM-Image's deployed sampling: the trainer's truncated log-probs equal the sampler's q within 1e-5; scoring
    the whole softmax instead of the nucleus (the peer bug) is far off."""
    ar = sharp_pipe.vision_language_encoder
    r = sample_group(sharp_pipe, "a red circle", 4, 96, 96, T, seed=3, top_k=top_k, top_p=top_p)
    with torch.no_grad():
        truncated = grpo.token_logprobs(ar, r.prompt.inputs, r.tokens, T, top_k, top_p)
        whole = grpo.token_logprobs(ar, r.prompt.inputs, r.tokens, T)
    assert torch.isfinite(r.q_logprobs).all() and (truncated - r.q_logprobs).abs().max() <= PARITY
    assert (whole - r.q_logprobs).abs().max() > 0.05


# ---- 5b: the loss --------------------------------------------------------------------------------

def test_k3_kl():
    """k3 by hand: exp(d) - d - 1 with d = ref - logp (0 where they agree, > 0 either side), zeros without a
    reference, d capped at 20 (finite where pi gives a token 25 nats less than ref, its gradient 0 there)."""
    logp = torch.tensor([[-1.0, -2.0, -0.5, -30.0]], requires_grad=True)
    ref = torch.tensor([[-1.0, -1.0, -1.5, -5.0]])
    got = grpo.k3_kl(logp, ref)
    d = torch.tensor([0.0, 1.0, -1.0, 20.0])
    assert torch.allclose(got[0], d.exp() - d - 1) and got[0, 0] == 0 and (got[0, 1:] > 0).all()
    got.sum().backward()
    assert torch.isfinite(got).all() and logp.grad[0, 3] == 0 and logp.grad[0, 1] < 0  # pulled toward ref
    assert torch.equal(grpo.k3_kl(logp, None), torch.zeros(1, 4))


def test_loss_metrics():
    """The metrics by hand: clip_frac counts only the tokens whose gradient the clip stops (r past 1 + eps with A > 0,
    below 1 - eps with A < 0; r = 1.5 with A < 0 is not), the KL's and the ratio's statistics over the mask's tokens."""
    ratio = torch.tensor([[1.5, 1.0, 0.5], [1.5, 0.7, 9.0]])
    A = torch.tensor([[1.0], [-1.0]])
    kl = torch.tensor([[0.1, 0.2, 0.3], [0.4, 0.5, 7.0]])
    m = grpo.loss_metrics(ratio, A, 0.2, kl, torch.tensor(-0.25))
    assert m["clip_frac"] == pytest.approx(2 / 6) and m["policy_loss"] == -0.25  # (0, 0) and (1, 1)
    assert m["kl"] == pytest.approx(8.5 / 6) and (m["ratio_min"], m["ratio_max"]) == (0.5, 9.0)
    masked = grpo.loss_metrics(ratio, A, 0.2, kl, torch.tensor(-0.25), torch.tensor([[1, 1, 1], [1, 1, 0]]))
    assert masked["kl"] == pytest.approx(1.5 / 5) and masked["ratio_max"] == 1.5 and masked["clip_frac"] == pytest.approx(2 / 5)


def test_aggregate():
    """TRL's aggregations by hand on two sequences of 4 and 2 real tokens (sums 10 and 11): "grpo" the mean of their
    token means, "bnpo" and "dapo" (by default) the mean over the 6 tokens, "dapo" over num_items_in_batch,
    "dr_grpo" over S times the padded length or max_completion_length; no mask: every token is real."""
    values = torch.tensor([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    want = {("grpo", None, None): (10 / 4 + 11 / 2) / 2, ("bnpo", 7, None): 21 / 6, ("dapo", None, None): 21 / 6,
            ("dapo", 7, None): 21 / 7, ("dr_grpo", None, None): 21 / (2 * 4), ("dr_grpo", None, 6): 21 / (2 * 6)}
    for (loss_type, items, length), value in want.items():
        assert grpo.aggregate(values, mask, loss_type, items, length).item() == pytest.approx(value), loss_type
    assert grpo.aggregate(values).item() == pytest.approx((10 / 4 + 11 / 4) / 2)
    with pytest.raises(ValueError, match="use grpo, bnpo, dapo or dr_grpo"):
        grpo.aggregate(values, mask, "token_mean")


def test_grpo_loss():
    """The docstring's equation, by a loop over sequences and tokens; the KL >= 0, 0 at the reference, finite on a
    spike; the metrics as defined."""
    g = torch.Generator().manual_seed(0)
    logp, old, ref = (-torch.rand(3, 5, generator=g) * 3 for _ in range(3))
    w = torch.rand(3, 5, generator=g) + 0.5
    adv, eps, beta = torch.tensor([1.0, -0.5, 0.0]), 0.2, 0.1
    loss, m = grpo.grpo_loss(logp, old, ref, adv, eps, beta, w)
    total = 0.0
    for i in range(3):
        for t in range(5):
            r = math.exp(logp[i, t] - old[i, t])
            surrogate = min(r * adv[i].item(), min(max(r, 1 - eps), 1 + eps) * adv[i].item())
            d = (ref[i, t] - logp[i, t]).item()
            total += -(w[i, t].item() * surrogate - beta * (math.exp(d) - d - 1)) / 5 / 3
    assert abs(loss.item() - total) < 1e-6
    assert m["kl"] >= 0 and m["ratio_min"] <= m["ratio_mean"] <= m["ratio_max"]
    assert grpo.grpo_loss(logp, old, logp.clone(), adv, eps, beta)[1]["kl"] == 0
    assert grpo.grpo_loss(logp, old, None, adv, eps, 0.0)[1]["kl"] == 0
    assert torch.isfinite(grpo.grpo_loss(logp, old, logp + 1000.0, adv, eps, beta)[0])  # d capped at 20


def test_grpo_loss_first_ratio():
    """At the first update pi_old is pi itself: every ratio exactly 1, no clip, and the gradient is -A / (S T) per
    token (the surrogate's, the KL's being 0 at the reference)."""
    logp = torch.full((4, 3), -0.7, requires_grad=True)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
    loss, m = grpo.grpo_loss(logp, logp.detach(), logp.detach(), adv, 0.2, 0.1)
    loss.backward()
    assert m["ratio_min"] == m["ratio_max"] == 1 and m["clip_frac"] == 0 and m["kl"] == 0
    assert torch.allclose(logp.grad, -adv[:, None].expand(4, 3) / 12)


def test_grpo_loss_clip_gradient():
    """The gradient is zero exactly where the clip should stop it: r > 1+eps with A > 0, r < 1-eps with A < 0."""
    logp = torch.log(torch.tensor([[1.5], [1.5], [0.5], [0.5]])).requires_grad_()
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0])
    loss, m = grpo.grpo_loss(logp, torch.zeros(4, 1), None, adv, 0.2, 0.0)
    loss.backward()
    assert logp.grad[0, 0] == 0 and logp.grad[3, 0] == 0  # clipped: no push beyond the trust region
    assert logp.grad[1, 0] != 0 and logp.grad[2, 0] != 0  # the pessimistic branch keeps its gradient
    assert m["clip_frac"] == 0.5


def test_grpo_loss_kl_gradient():
    """The KL term's gradient is k3's own, beta (1 - exp(ref - logp)) / (S n) per token, also on the tokens whose k3
    float32 rounds below 0 (a clamp at 0 zeroed their gradient there; TRL's per_token_kl has none); the logged KL
    keeps its sign."""
    g = torch.Generator().manual_seed(0)
    ref = -torch.rand(4, 256, generator=g) * 4
    logp = (ref + (torch.rand(4, 256, generator=g) - 0.5) * 2e-4).requires_grad_()  # near the reference
    d = ref - logp.detach()
    below = (d.exp() - d - 1) < 0
    assert below.sum() >= 3  # float32 rounds these tokens' k3 below 0
    loss, m = grpo.grpo_loss(logp, logp.detach(), ref, torch.zeros(4), 0.2, 0.1)  # A = 0: the KL's gradient alone
    loss.backward()
    expected = 0.1 * (1 - d.double().exp()) / logp.numel()
    assert (logp.grad[below].double() * expected[below] > 0).all()  # their gradient kept, its sign k3's
    assert (logp.grad.double() - expected).abs().sum() / expected.abs().sum() < 1e-2 and m["kl"] >= 0


def test_grpo_loss_weights():
    """The mismatch weights multiply each token's surrogate (and its gradient), not the KL."""
    g = torch.Generator().manual_seed(1)
    logp = (-torch.rand(2, 4, generator=g)).requires_grad_()
    old, ref, adv = logp.detach() - 0.05, logp.detach() + 0.1, torch.tensor([1.0, -2.0])
    w = torch.rand(2, 4, generator=g) * 2
    loss, m = grpo.grpo_loss(logp, old, ref, adv, 0.2, 0.1, w)
    r = torch.exp(logp - old)
    surrogate = torch.min(r * adv[:, None], r.clamp(0.8, 1.2) * adv[:, None])
    d = ref - logp
    assert torch.allclose(loss, (-(w * surrogate - 0.1 * (d.exp() - d - 1))).mean())
    assert m["kl"] == pytest.approx((d.exp() - d - 1).mean().item())  # the KL logged unweighted


def test_grpo_loss_per_sample_symbols():
    """A, eps and beta may vary by sequence or token (the variants' seam): per-sample values equal separate calls."""
    g = torch.Generator().manual_seed(3)
    logp, old, ref = (-torch.rand(2, 4, generator=g) for _ in range(3))
    eps, beta, adv = torch.tensor([[0.1], [0.3]]), torch.tensor([[0.0], [0.5]]), torch.tensor([1.0, -1.0])
    together, _ = grpo.grpo_loss(logp, old, ref, adv, eps, beta)
    apart = [grpo.grpo_loss(logp[i:i + 1], old[i:i + 1], ref[i:i + 1], adv[i:i + 1], eps[i].item(), beta[i].item())[0]
             for i in range(2)]
    assert torch.allclose(together, sum(apart) / 2)
    per_token = adv[:, None] * torch.rand(2, 4, generator=g)  # A_it: a token's own advantage
    by_token, _ = grpo.grpo_loss(logp, old, ref, per_token, 0.2, 0.0)
    r = torch.exp(logp - old)
    assert torch.allclose(by_token, -torch.min(r * per_token, r.clamp(0.8, 1.2) * per_token).mean())


def test_grpo_loss_aggregations():
    """TRL's loss_types with a padding mask, by hand on answers of unequal length (an LLM's): "grpo" each answer's
    token mean then the mean, "dapo" the token sum over the batch's tokens (by default these answers', TRL's "bnpo"),
    "dr_grpo" the token sum over S times max_completion_length (by default the padded length), "bnpo" the token mean
    over these answers whatever is passed; a mask of ones gives the lesson's loss for each; another name is refused;
    the policy_loss metric is aggregated as the loss is."""
    g = torch.Generator().manual_seed(5)
    logp, old, ref = (-torch.rand(3, 4, generator=g) for _ in range(3))
    adv = torch.tensor([1.0, -0.5, 0.3])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]], dtype=torch.float32)
    r = torch.exp(logp - old)
    d = ref - logp
    per_token = torch.min(r * adv[:, None], r.clamp(0.8, 1.2) * adv[:, None]) - 0.1 * (d.exp() - d - 1)
    want = {"grpo": -sum((per_token[i] * mask[i]).sum() / mask[i].sum() for i in range(3)) / 3,
            "dapo": -(per_token * mask).sum() / mask.sum(), "dr_grpo": -(per_token * mask).sum() / (3 * 4)}
    plain, _ = grpo.grpo_loss(logp, old, ref, adv, 0.2, 0.1)
    for loss_type, value in want.items():
        got, _ = grpo.grpo_loss(logp, old, ref, adv, 0.2, 0.1, mask=mask, loss_type=loss_type)
        assert got.item() == pytest.approx(value.item(), rel=1e-6), loss_type
        ones, _ = grpo.grpo_loss(logp, old, ref, adv, 0.2, 0.1, mask=torch.ones(3, 4), loss_type=loss_type)
        assert ones.item() == pytest.approx(plain.item(), rel=1e-6), loss_type
    assert len({round(v.item(), 6) for v in want.values()}) == 3  # unequal lengths: three different losses
    # TRL's normalisers given: dapo over the accumulated batch's tokens (here 20), dr_grpo over max_completion_length 8
    dapo, _ = grpo.grpo_loss(logp, old, ref, adv, 0.2, 0.1, mask=mask, loss_type="dapo", num_items_in_batch=20)
    dr_grpo, _ = grpo.grpo_loss(logp, old, ref, adv, 0.2, 0.1, mask=mask, loss_type="dr_grpo", max_completion_length=8)
    assert dapo.item() == pytest.approx(-(per_token * mask).sum().item() / 20, rel=1e-6)
    assert dr_grpo.item() == pytest.approx(-(per_token * mask).sum().item() / (3 * 8), rel=1e-6)
    bnpo, _ = grpo.grpo_loss(logp, old, ref, adv, 0.2, 0.1, mask=mask, loss_type="bnpo", num_items_in_batch=20)
    assert bnpo.item() == pytest.approx(want["dapo"].item(), rel=1e-6)  # bnpo: these answers' tokens, always
    with pytest.raises(ValueError, match="loss_type 'sum'"):
        grpo.grpo_loss(logp, old, ref, adv, 0.2, 0.1, mask=mask, loss_type="sum")
    # policy_loss is the policy term aggregated as the loss is: "grpo" per answer, then the mean
    policy = torch.min(r * adv[:, None], r.clamp(0.8, 1.2) * adv[:, None])
    for loss_type, value in {"grpo": -sum((policy[i] * mask[i]).sum() / mask[i].sum() for i in range(3)) / 3,
                             "dapo": -(policy * mask).sum() / mask.sum()}.items():
        _, metrics = grpo.grpo_loss(logp, old, ref, adv, 0.2, 0.1, mask=mask, loss_type=loss_type)
        assert metrics["policy_loss"] == pytest.approx(value.item(), rel=1e-6), loss_type
    # the metrics read the answers' tokens only: the padding's ratio and KL are not in them
    real = mask.bool()
    assert metrics["kl"] == pytest.approx((d.exp() - d - 1)[real].mean().item(), rel=1e-6)
    assert metrics["ratio_max"] == r[real].max().item() and metrics["ratio_min"] == r[real].min().item()


def test_importance_weights():
    """Truncated importance weights (TRL's token_truncate) by hand: exp(pi_old - sampler) per token, cut to the cap;
    an exact sampler gets 1; never differentiable."""
    old = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    sampled = torch.tensor([[-1.5, -1.0, -0.5]])
    got = grpo.importance_weights(old, sampled, 1.5)
    assert torch.allclose(got, torch.tensor([[math.exp(0.5), math.exp(-1.0), 1.0]]).clamp(max=1.5))
    assert not got.requires_grad and grpo.importance_weights(old, old.detach()).eq(1).all()


# ---- 5c: mu updates, a micro-batch at a time -----------------------------------------------------

def gradients(policy, rollouts, advantages, micro_batch_size, ref=None, mu=1, lr=0.0, kl_beta=0.0):
    """`update` on `policy` (SGD at `lr`, no gradient clip) -> the last update's gradients by name, and the metrics."""
    opt = torch.optim.SGD([p for p in policy.parameters() if p.requires_grad], lr=lr)
    cfg = grpo.Config(mu=mu, kl_beta=kl_beta, max_grad_norm=math.inf, temperature=T)
    m = grpo.update(policy, opt, grpo.micro_batches(rollouts, advantages, micro_batch_size), ref, cfg)
    return {n: p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None}, m


def relative_difference(a: dict, b: dict) -> float:
    """|a - b| / |a| over every tensor of two gradients."""
    norm = torch.sqrt(sum((g ** 2).sum() for g in a.values()))
    return (torch.sqrt(sum(((a[k] - b[k]) ** 2).sum() for k in a)) / norm).item()


def test_micro_batches(pipe):
    """Each group's rows cut into micro-batches in order, never two groups in one, each with its rows' tokens, the
    sampler's log-probs of p, its advantages and the preview's length."""
    rollouts = [sample_group(pipe, p, 4, 64, 64, T, seed=s) for s, p in enumerate(["a cat", "a dog"])]
    batches = grpo.micro_batches(rollouts, torch.arange(8.0).view(2, 4), 3)
    assert [len(mb.tokens) for mb in batches] == [3, 1, 3, 1]
    assert torch.equal(batches[1].tokens, rollouts[0].tokens[3:]) and batches[2].advantages.tolist() == [4, 5, 6]
    assert batches[3].inputs is rollouts[1].prompt.inputs and batches[0].n_preview == 16 * 16  # the preview at 64x64
    assert torch.equal(batches[2].sampler_logprobs, rollouts[1].p_logprobs[:3])


def test_reference_logprobs(random_pipe):
    """The reference's log-probs of the drawn codes; None without a reference; under LoRA the policy with its adapter
    switched off."""
    ar = random_pipe.vision_language_encoder
    r = sample_group(random_pipe, "a cat", 2, 64, 64, T, seed=0)
    mb = grpo.micro_batches([r], torch.zeros(1, 2), 2)[0]
    assert grpo.reference_logprobs(None, mb, T) is None
    with torch.no_grad():
        whole = grpo.token_logprobs(ar, r.prompt.inputs, r.tokens, T)
    assert torch.equal(grpo.reference_logprobs(ar, mb, T), whole)
    lora = grpo.trained_model(copy.deepcopy(random_pipe), 4)
    for name, p in lora.named_parameters():
        if "lora_B" in name:
            p.data.fill_(0.5)  # the adapter now changes the policy ...
    with torch.no_grad():
        assert (grpo.token_logprobs(lora, r.prompt.inputs, r.tokens, T) - whole).abs().max() > 1e-3
    assert (grpo.reference_logprobs(lora, mb, T) - whole).abs().max() <= 1e-5  # ... and is off for the reference


def test_micro_batch_loss(random_pipe):
    """grpo_loss on the large grid (the preview stays out) with the mismatch weights of the sampler's p against
    pi_old: a sampler 0.3 nats off weighs each surrogate e^0.3 (token_truncate), capped at 2."""
    ar = random_pipe.vision_language_encoder
    r = sample_group(random_pipe, "two blue squares", 4, 64, 64, T, seed=3)
    mb = grpo.micro_batches([r], torch.tensor([[1.0, 0.5, 0.5, 1.0]]), 4)[0]  # not z-scores: a loss away from 0
    with torch.no_grad():
        distribution = grpo.code_logprobs(grpo.token_logits(ar, r.prompt.inputs, r.tokens), T, codebook(ar))
    old = grpo.logprob_of(distribution, r.tokens)
    large = slice(mb.n_preview, None)
    for shift, weight in [(0.0, 1.0), (0.3, math.exp(0.3)), (1.0, 2.0)]:
        off = mb._replace(sampler_logprobs=mb.sampler_logprobs - shift)  # pi_old / pi_sampler = e^shift
        loss, m = grpo.micro_batch_loss(distribution, off, old, None, 0.2, 0.0)
        want, _ = grpo.grpo_loss(old[:, large], old[:, large], None, mb.advantages, 0.2, 0.0)
        assert loss.item() == pytest.approx(weight * want.item(), rel=1e-4) and m["loss"] == loss.item()
    ref = old - 0.1
    _, with_ref = grpo.micro_batch_loss(distribution, mb, old, ref, 0.2, 0.1)
    d = (ref - old)[:, large]
    assert with_ref["kl"] == pytest.approx((d.exp() - d - 1).mean().item())  # the KL of the large grid only
    given = torch.full_like(old, 0.5)  # weights given (a variant's): in place of the lesson's
    loss, _ = grpo.micro_batch_loss(distribution, mb, old, None, 0.2, 0.0, weights=given)
    want, _ = grpo.grpo_loss(old[:, large], old[:, large], None, mb.advantages, 0.2, 0.0)
    assert loss.item() == pytest.approx(0.5 * want.item(), rel=1e-5)


def test_update(sharp_pipe):
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


def test_update_micro_batching(pipe):
    """Micro-batches of 1 give the full batch's gradient within 1e-5: each loss weighs its share of the step."""
    rollouts = [sample_group(pipe, p, 4, 64, 64, T, seed=s) for s, p in enumerate(["a cat", "a dog"])]
    advantages = torch.tensor([[1.0, -1.0, 0.5, -0.5], [0.3, 0.3, -0.9, 0.3]])
    whole, m_whole = gradients(copy.deepcopy(pipe.vision_language_encoder), rollouts, advantages, 4)
    micro, m_micro = gradients(copy.deepcopy(pipe.vision_language_encoder), rollouts, advantages, 1)
    assert whole.keys() == micro.keys() and relative_difference(whole, micro) < 1e-5
    assert abs(m_whole["loss"] - m_micro["loss"]) < 1e-6


def test_update_mu(random_pipe):
    """With mu > 1 the later updates see their ratios leave 1 (pi_old stays the first update's), and the clip acts;
    each update's gradient starts from zero: at lr 0 the third update's gradient is the first's; mu 0 is refused."""
    r = sample_group(random_pipe, "a cat", 4, 64, 64, T, seed=0)
    adv = torch.tensor([[1.0, -1.0, 0.5, -0.5]])
    once, _ = gradients(copy.deepcopy(random_pipe.vision_language_encoder), [r], adv, 2)
    thrice, _ = gradients(copy.deepcopy(random_pipe.vision_language_encoder), [r], adv, 2, mu=3)
    assert relative_difference(once, thrice) < 1e-6
    _, m = gradients(copy.deepcopy(random_pipe.vision_language_encoder), [r], torch.tensor([[1.0, -1.0, 1.0, -1.0]]),
                     4, mu=3, lr=5.0)
    assert (m["ratio_max"] > 1.2 or m["ratio_min"] < 0.8) and m["clip_frac"] > 0
    with pytest.raises(ValueError, match="mu 0: update_epochs is at least 1"):  # not a NameError after no update
        gradients(random_pipe.vision_language_encoder, [r], adv, 2, mu=0)


def test_update_nonfinite(pipe):
    """A NaN loss skips the update (counted) and leaves the weights as they were."""
    r = sample_group(pipe, "a cat", 4, 64, 64, T, seed=0)
    policy = copy.deepcopy(pipe.vision_language_encoder)
    before = [p.detach().clone() for p in policy.parameters()]
    _, m = gradients(policy, [r], torch.tensor([[float("nan"), 1.0, -1.0, 0.0]]), 2, lr=1e-2, mu=2)
    assert m["skipped"] == 2 and all(torch.equal(p, q) for p, q in zip(before, policy.parameters()))


def test_update_and_the_trainers_step(random_pipe):
    """The lesson's update and the trainer's robust step (helpers/trainer.py, what the command line runs) compute the
    same numbers in one process: gradients, weights and metrics bit for bit, at mu 2 with the KL and micro-batches
    (STYLE.md rule 18)."""
    import functools
    rollouts = [sample_group(random_pipe, p, 4, 64, 64, T, seed=s) for s, p in enumerate(["a cat", "a dog"])]
    advantages = torch.tensor([[1.0, -1.0, 0.5, -0.5], [0.3, 0.3, -0.9, 0.3]])
    cfg = grpo.Config(mu=2, kl_beta=0.1, temperature=T)
    results = []
    for robust in (False, True):
        policy = copy.deepcopy(random_pipe.vision_language_encoder)
        ref = grpo.reference_model(policy, cfg.kl_beta)
        opt = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=1e-3)
        if robust:
            loss = functools.partial(grpo.micro_batch_loss, clip_eps=cfg.clip_eps, kl_beta=cfg.kl_beta,
                                     sampler_cap=cfg.sampler_cap)
            m = trainer.train_step(grpo, policy, opt, trainer.micro_batches(rollouts, advantages, 2), ref, loss,
                                   temperature=T, mu=cfg.mu, max_grad_norm=cfg.max_grad_norm)
        else:
            m = grpo.update(policy, opt, grpo.micro_batches(rollouts, advantages, 2), ref, cfg)
        results.append((m, [p.detach().clone() for p in policy.parameters()]))
    (lesson, weights), (robust, robust_weights) = results
    assert all(torch.equal(a, b) for a, b in zip(weights, robust_weights))
    for key in lesson:
        assert lesson[key] == robust[key], key
    assert lesson["ratio_max"] > lesson["ratio_min"] and lesson["kl"] > 0  # the second update and the KL at work


# ---- The loop: steps 1-5, a step at a time -------------------------------------------------------

def test_example_index():
    """Every example once an epoch: in the file's order, or with shuffle in a permutation drawn from (seed, epoch),
    another each epoch and seed; the command line's order (helpers/run.py reads this one)."""
    assert [grpo.example_index(g, 3, 0, False) for g in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    epochs = [[grpo.example_index(5 * e + i, 5, 1, True) for i in range(5)] for e in range(4)]
    assert all(sorted(order) == list(range(5)) for order in epochs) and len({tuple(o) for o in epochs}) > 1
    assert epochs[0] != [grpo.example_index(i, 5, 2, True) for i in range(5)]


def test_read_examples(tmp_path):
    """'prompt | target.png' lines (comments and blank lines skipped, a prompt alone without a target) -> the targets
    as (3, H, W) in [0, 1], resized: the very tensors the command line loads (helpers/user_input.py) for plain PNGs."""
    Image.fromarray((np.arange(48 * 48 * 3) % 251).astype(np.uint8).reshape(48, 48, 3)).save(tmp_path / "t.png")
    (tmp_path / "p.txt").write_text("# a comment\na gray square | t.png\n\njust a prompt\n")
    examples = grpo.read_examples(tmp_path / "p.txt", 64, 32)
    assert [e["prompt"] for e in examples] == ["a gray square", "just a prompt"] and examples[1]["target"] is None
    assert examples[0]["target"].shape == (3, 64, 32) and examples[0]["target"].dtype == torch.float32
    loaded = user_input.load_examples(user_input.read_prompts(tmp_path / "p.txt"), {}, 64, 32)
    assert torch.equal(examples[0]["target"], loaded[0]["target"])


def test_train(tmp_path, monkeypatch):
    """The loop a student reads is the loop that runs: `train` gives main's numbers step for step (rewards, loss, KL,
    ratios, clip fraction, gradient norm, lr) and main's final weights, bit for bit, at settings where each field of
    the loop matters (issue 84: G 8, 2 prompts a step, mu 2, the KL; a decode seed and a sampling seed apart, top-p
    below 1, shuffled prompts), with every weight trained and with LoRA. main samples here with the lesson's
    `generate`; the fast decode it runs by default draws the same tokens, log-probs within 1e-6
    (tests/test_fast_decode.py)."""
    Image.fromarray(np.full((64, 64, 3), 128, np.uint8)).save(tmp_path / "t.png")
    Image.fromarray(np.full((64, 64, 3), 30, np.uint8)).save(tmp_path / "u.png")
    (tmp_path / "prompts.txt").write_text("a gray square | t.png\nanother | u.png\na red circle | t.png\n")
    monkeypatch.setattr(trainer, "sample_groups", lambda lesson, *args, **kw: lesson.sample_groups(*args, **kw))
    for lora in ("0", "4"):
        argv = ["--device", DEVICE, "--prompts", str(tmp_path / "prompts.txt"), "--steps", "2", "--height", "64",
                "--width", "64", "--before-after", "0", "--image-every", "0", "--lr", "1e-3", "--seed", "1",
                "--decode-seed", "3", "--top-p", "0.9", "--shuffle", "--lora-rank", lora]
        out = tmp_path / f"run-{lora}"
        grpo.main([*argv, "--out", str(out)])
        logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        cfg = trainer.parse_config(grpo, argv)
        assert (cfg.group_size, cfg.prompts_per_step, cfg.mu, cfg.kl_beta) == (8, 2, 2, 0.1)  # the tiny defaults
        pipe = grpo.load_glm_image("tiny", DEVICE)
        history = grpo.train(cfg, pipe, grpo.read_examples(cfg.prompts, cfg.height, cfg.width))
        assert [h["step"] for h in history] == [x["step"] for x in logged] == [1, 2]
        for mine, theirs in zip(history, logged):
            for key in ("reward_mean", "loss", "kl", "ratio_min", "ratio_max", "clip_frac", "grad_norm", "lr"):
                assert mine[key] == theirs[key], (lora, mine["step"], key, mine[key], theirs[key])
        assert logged[-1]["kl"] > 0 and logged[-1]["ratio_max"] > logged[-1]["ratio_min"]  # the whole loss at work
        if lora == "0":  # every weight: the saved AR is the lesson's
            from transformers import GlmImageForConditionalGeneration
            final = GlmImageForConditionalGeneration.from_pretrained(out / "final")
            assert all(torch.equal(a.cpu(), b) for a, b in zip(pipe.vision_language_encoder.parameters(),
                                                              final.parameters()))
        else:  # the adapter: peft's keys are the lesson's trained parameters without the adapter's name
            from safetensors.torch import load_file
            saved = load_file(out / "final" / "adapter_model.safetensors")
            trained = {n.replace(".default.", "."): p for n, p in pipe.vision_language_encoder.named_parameters()
                       if p.requires_grad}
            assert len(saved) == len(trained) > 0
            assert all(torch.equal(trained[k.removeprefix("base_model.model.")].detach().cpu(), v)
                       for k, v in saved.items())


# ---- Editing: a source picture in the prompt (an addition; text-to-image reads without it) -------

def test_to_pil():
    """(3, H, W) in [0, 1] -> an RGB image, exact for 8-bit values (rounded, not truncated), clamped outside."""
    image = torch.tensor([0, 1, 254, 255], dtype=torch.float32).div(255).view(1, 2, 2).expand(3, 2, 2)
    assert np.asarray(grpo.to_pil(image))[..., 0].tolist() == [[0, 1], [254, 255]]
    assert np.asarray(grpo.to_pil(image * 1.5 - 0.2))[0, 0, 0] == 0
    assert grpo.to_pil(image).mode == "RGB" and grpo.to_pil(image).size == (2, 2)


def test_edit_prompt(pipe):
    """An edit's group: the source encoded in the prompt, the AR writes the large grid only (no preview)."""
    edit = grpo.edit_prompt(pipe, "make it red", 2, 64, 96, smooth_source(64, 64))
    assert (edit.preview_hw, edit.large_hw, edit.source.grid_hw) == ((0, 0), (2, 3), (2, 2))
    assert not (edit.inputs["input_ids"] == pipe.vision_language_encoder.config.image_token_id).any()


def test_encode_source(pipe):
    """The source's codes in place of its placeholders give the very logits the model computes from pixel_values."""
    ar = pipe.vision_language_encoder
    image = grpo.to_pil(smooth_source())
    inputs = grpo.group_inputs(pipe.processor, "make it red", 2, 64, 64, DEVICE, image)
    encoded, source = grpo.encode_source(ar, inputs, image)
    assert "pixel_values" not in encoded and source.grid_hw == (2, 2) and source.codes.shape == (4,)
    assert not (encoded["input_ids"] == ar.config.image_token_id).any()
    keys = ("input_ids", "attention_mask", "image_grid_thw", "images_per_sample")
    with torch.no_grad():
        from_pixels = ar(**{k: inputs[k] for k in keys}, pixel_values=inputs["pixel_values"].repeat(2, 1)).logits
        from_codes = ar(**{k: encoded[k] for k in keys}).logits
    assert torch.equal(from_pixels, from_codes)


def test_edit_inputs(pipe):
    """The pipeline's source inputs, one copy a sample: the picture, its codes upsampled 2x (as prior_ids), the grid."""
    source = grpo.edit_prompt(pipe, "make it red", 2, 64, 64, smooth_source(64, 64)).source
    given = grpo.edit_inputs(source, 3, DEVICE)
    assert given["image"] == [[source.image]] * 3 and len(given["prior_token_image_ids"]) == 3
    assert torch.equal(given["prior_token_image_ids"][0], grpo.prior_ids(source.codes[None], source.grid_hw)[0])
    assert given["source_image_grid_thw"][2].tolist() == [[1, 4, 4]]


# ---- main: the command line --------------------------------------------------------------------

def test_main(tmp_path):
    """A 2-step tiny run end to end with the tiny defaults (mu 2: the ratios logged span both updates), its metrics
    lines, image grids and final/, loadable with the trained weights. (Every other whole run: tests/test_main.py.)"""
    Image.fromarray(np.full((64, 64, 3), 128, np.uint8)).save(tmp_path / "t.png")
    (tmp_path / "prompts.txt").write_text("a gray square | t.png\nanother | t.png\n")
    out = tmp_path / "run"
    summary = grpo.main(["--device", DEVICE, "--prompts", str(tmp_path / "prompts.txt"), "--out", str(out),
                         "--steps", "2", "--group-size", "4", "--height", "64", "--width", "64",
                         "--before-after", "0", "--image-every", "1"])
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2] and all(x["ratio_min"] <= 1 <= x["ratio_max"] for x in lines)
    assert all(math.isfinite(x["loss"]) and x["skipped"] == 0 for x in lines) and summary["skipped"] == 0
    assert sorted(p.name for p in (out / "images").iterdir()) == ["step_00001.png", "step_00002.png"]
    from transformers import GlmImageForConditionalGeneration
    trained = GlmImageForConditionalGeneration.from_pretrained(out / "final")
    assert not torch.equal(trained.lm_head.weight, grpo.load_glm_image("tiny").vision_language_encoder.lm_head.weight)


def test_main_help():
    """--help lists every flag: the lesson's, the variants' and the run's, each with its default."""
    done = subprocess.run([sys.executable, str(ROOT / "grpo.py"), "--help"], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    assert done.returncode == 0 and "--group-size" in done.stdout and "--sampler-correction" in done.stdout
    assert "--resume" in done.stdout and "(default: 8 tiny, 4 real)" in done.stdout


COPIED_ALONE = """
import math, sys, torch
import grpo
assert not any(m.startswith("helpers.") for m in sys.modules)  # no module of this helpers/
try:
    grpo.main([])
    raise AssertionError("main ran without helpers/")
except SystemExit as refused:  # one line naming what it needs
    assert "needs helpers/ beside grpo.py" in str(refused) and "\\n" not in str(refused), refused
cfg = grpo.Config(group_size=4, height=64, width=64, num_inference_steps=1, steps=2)
pipe = grpo.load_glm_image({tiny!r})  # a model folder
examples = [dict(prompt=p, target=torch.zeros(3, 64, 64)) for p in ("a red circle", "two blue squares")]
history = grpo.train(cfg, pipe, examples)  # the loop: steps 1-5
m = history[-1]
assert math.isfinite(m["loss"]) and m["skipped"] == 0 and m["kl"] >= 0 and m["ratio_min"] <= 1 <= m["ratio_max"], m
print("copied alone:", len(history), "steps", round(m["loss"], 4))
"""


def run_alone(tmp_path, script: str) -> subprocess.CompletedProcess:
    """`script` run in `tmp_path` by a Python that sees the packages but not this repository."""
    path = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and os.path.realpath(p) != str(ROOT)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    (tmp_path / "script.py").write_text(script)
    return subprocess.run([sys.executable, "script.py"], cwd=tmp_path, capture_output=True, text=True, env=env,
                          timeout=300)


def test_grpo_copied_alone(tmp_path):
    """grpo.py copied alone into an empty folder runs its loop, `train`, on a model folder: every step (load, sample
    with the lesson's decode loop `generate`, decode, SSIM, advantages, `update` with the tiny defaults: KL, mu 2);
    the command line (main, --help, --prompts) refuses in one line naming what it needs. The folder has a project's
    own `helpers` package (without this one's modules): grpo.py runs alone beside it."""
    (tmp_path / "grpo.py").write_text((ROOT / "grpo.py").read_text())
    (tmp_path / "helpers").mkdir()
    (tmp_path / "helpers" / "__init__.py").write_text("# a project's own helpers\n")
    done = run_alone(tmp_path, COPIED_ALONE.format(tiny=str(ROOT / "tiny_glm_image")))
    assert done.returncode == 0 and "copied alone: 2 steps" in done.stdout, done.stderr[-3000:]
    for args in (["--help"], ["--prompts", "prompts.txt"]):
        refused = subprocess.run([sys.executable, "grpo.py", *args], cwd=tmp_path, capture_output=True, text=True,
                                 timeout=120, env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
        assert refused.returncode != 0 and "Traceback" not in refused.stderr, refused.stderr
        assert refused.stderr.strip() == ("grpo.py: the command line needs helpers/ beside grpo.py; copied alone, "
                                          "run train(Config(...), load_glm_image(...), read_examples(...)) from "
                                          "Python"), refused.stderr


COPIED_FUNCTIONS = {  # a function a reader copies -> the functions of grpo.py it calls (its docstring names them)
    "grpo_loss": ["k3_kl", "aggregate", "loss_metrics"], "k3_kl": [], "aggregate": [], "loss_metrics": [],
    "group_advantages": [], "code_logprobs": [], "ssim_reward": [], "rope_positions": [],
    "generate": ["code_logprobs", "rope_positions"],
}


def test_functions_copied_alone(tmp_path, pipe):
    """Each function a reader would copy runs with grpo.py's imports alone (and the functions its docstring names):
    grpo_loss (with k3_kl, aggregate and loss_metrics), group_advantages, code_logprobs, ssim_reward, rope_positions and generate give what
    grpo's give."""
    source = (ROOT / "grpo.py").read_text()
    tree = ast.parse(source)
    imports = "\n".join(ast.get_source_segment(source, node) for node in tree.body
                        if isinstance(node, (ast.Import, ast.ImportFrom)))
    defined = {node.name: ast.get_source_segment(source, node) for node in tree.body if isinstance(node, ast.FunctionDef)}
    for name, needs in COPIED_FUNCTIONS.items():
        namespace = {}
        exec(compile(imports + "\n" + "\n\n".join(defined[n] for n in [*needs, name]), name, "exec"), namespace)
        for called in {n.id for n in ast.walk(ast.parse(defined[name])) if isinstance(n, ast.Name)} & set(defined):
            assert called in needs or called == name, f"{name} calls {called}: name it in its docstring"
    g = torch.Generator().manual_seed(0)
    logp, old, ref = (-torch.rand(2, 3, generator=g) for _ in range(3))
    namespace = {}
    loss_functions = [defined[n] for n in [*COPIED_FUNCTIONS["grpo_loss"], "grpo_loss"]]
    exec(compile(imports + "\n" + "\n\n".join(loss_functions), "grpo_loss", "exec"), namespace)
    args = (logp, old, ref, torch.tensor([1.0, -1.0]), 0.2, 0.1)
    assert torch.equal(namespace["grpo_loss"](*args)[0], grpo.grpo_loss(*args)[0])
    exec(compile(imports + "\n" + "\n\n".join(defined[n] for n in ["code_logprobs", "rope_positions", "generate"]),
                 "generate", "exec"), namespace)
    group = grpo.group_prompt(pipe, "a cat", 2, 64, 64)
    tokens = namespace["generate"](pipe.vision_language_encoder, group, T, 3)[0]
    assert torch.equal(tokens, grpo.generate(pipe.vision_language_encoder, group, T, 3)[0])


def test_no_deprecated_names():
    """The project's code never asks transformers' old name for activation checkpointing (peft does, in
    get_peft_model; pytest.ini ignores that one), so that its FutureWarning stays away from a run of ours."""
    files = [ROOT / "grpo.py", ROOT / "dit_grpo.py", *(ROOT / "helpers").glob("*.py"), *(ROOT / "tools").glob("*.py")]
    assert not [f.name for f in files if ".is_gradient_checkpointing" in f.read_text()]


def test_imports_one_way():
    """Imports run one way, tools -> dit_grpo -> grpo -> helpers: no module under helpers/ imports grpo or dit_grpo
    (at the top or inside a function), and grpo.py registers no alias of itself in sys.modules."""
    backwards = []
    for path in sorted((ROOT / "helpers").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            backwards += [f"{path.name}:{node.lineno} {n}" for n in names if n.split(".")[0] in ("grpo", "dit_grpo")]
    assert not backwards, backwards
    assert "sys.modules[" not in (ROOT / "grpo.py").read_text().replace("sys.modules[__name__]", "")


def test_grpo_layout():
    """The lesson's shape: every function of grpo.py has a documented test here, in its section; no nested
    conditional expression, no two statements on a line, no one-line def; the sections numbered in order."""
    source = (ROOT / "grpo.py").read_text()
    tree = ast.parse(source)
    functions = [n for n in tree.body if isinstance(n, ast.FunctionDef)]
    tests = {name: test for name, test in globals().items() if name.startswith("test_")}
    untested = [f.name for f in functions if not any(t == f"test_{f.name}" or t.startswith(f"test_{f.name}_")
                                                     for t in tests)]
    assert len(functions) > 30 and not untested, untested
    assert not [name for name, test in tests.items() if not test.__doc__]  # each names the property it checks
    nested = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.IfExp)
              and any(isinstance(c, ast.IfExp) for c in ast.walk(n) if c is not n)]
    one_line = [n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.body[0].lineno == n.lineno]
    statements = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.stmt)]
    assert not nested and not one_line and len(statements) == len(set(statements)), (nested, one_line)
    def sections(text: str) -> list[str]:  # "# ---- Step 1. Sample: ... ----" -> "Step 1. Sample: ..."
        return [line.strip("# -") for line in text.splitlines() if line.startswith("# ---- ")]

    titles = sections(source)
    steps = [title.split(".")[0] for title in titles if title.startswith("Step ")]
    assert steps == [f"Step {i}" for i in range(1, 6)]  # the README's and the notebook's numbering
    assert sections((ROOT / "test_grpo.py").read_text()) == titles


def test_objective_defaults_match_cli():
    """A function copied alone trains what the command line trains: every default of a grpo.py function whose
    parameter names a setting of the objective equals the command line's default for the tiny model."""
    cli = trainer.parse_config(grpo, [])
    names = {"temperature": "temperature", "top_k": "top_k", "top_p": "top_p", "cap": "sampler_cap",
             "sampler_cap": "sampler_cap", "clip_eps": "clip_eps", "kl_beta": "kl_beta", "lora_rank": "lora_rank",
             "gradient_checkpointing": "gradient_checkpointing", "seed": "seed"}
    checked = []
    for name, fn in vars(grpo).items():
        if not inspect.isfunction(fn) or fn.__module__ != grpo.__name__:
            continue
        for param in inspect.signature(fn).parameters.values():
            field = names.get(param.name)
            if field and param.default is not inspect.Parameter.empty:
                assert param.default == getattr(cli, field), f"{name}({param.name}={param.default!r})"
                checked.append(f"{name}.{param.name}")
    assert {"importance_weights.cap", "micro_batch_loss.sampler_cap", "code_logprobs.top_p",
            "trained_model.gradient_checkpointing"} <= set(checked)
