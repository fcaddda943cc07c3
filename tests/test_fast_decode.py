"""Tests for helpers/fast_decode.py, the engine beside grpo.py's lesson: it draws the same tokens as grpo.generate
(the loop grpo.py copied alone runs) for the same seeds, with log-probs within 1e-6, in float32 on the CPU; and each of
its parts (the static cache a CUDA graph replays, the padded many-prompt decode, the mask, the packed supports).

    python -m pytest -q tests/test_fast_decode.py
"""

import copy
import functools
import re

import pytest
import torch

import grpo
from helpers import fast_decode, trainer
from conftest import DEVICE, PARITY, T, run_record, sample_group, smooth_source, tiny_run
from tools.generate_reference import generate_group  # grpo.py's sampler before its decode loop


def lesson(pipe, prompts, group_size, height, width, seeds, sources=None, top_p=1.0):
    """grpo.sample_groups, the lesson's: grpo.generate a group at a time."""
    return grpo.sample_groups(pipe, prompts, group_size, height, width, T, seeds, top_p=top_p, sources=sources)


def fast(pipe, prompts, group_size, height, width, seeds, sources=None, top_p=1.0):
    """helpers/trainer.py's sample_groups: every group in one decode of the engine."""
    return trainer.sample_groups(grpo, pipe, prompts, group_size, height, width, T, seeds, top_p=top_p,
                                 sources=sources)


@pytest.mark.parametrize("top_p", [1.0, 0.75], ids=["full", "top-p"])
def test_same_tokens_as_the_lesson(random_pipe, top_p):
    """The engine (every group in one left-padded decode) against grpo.generate, group by group: G = 8, two prompts
    of different lengths and an edit, the same seeds -> the same tokens, log-probs under q and p within 1e-6, the same
    Rollout otherwise; its recorded supports hold every drawn token. On the random model: no token is forced."""
    prompts = ["a red circle", "two blue squares above a green triangle on the left", "make it red"]
    sources, seeds = [None, None, smooth_source(64, 64)], [21, 22, 23]
    drawn = fast(random_pipe, prompts, 8, 64, 64, seeds, sources, top_p)
    slow = lesson(random_pipe, prompts, 8, 64, 64, seeds, sources, top_p)
    assert len({r.prompt.inputs["input_ids"].shape[1] for r in drawn}) == 3  # three prompt lengths: padding at work
    assert all(r.q_logprobs.exp().mean() < 0.2 for r in slow)  # no token is forced: the check has teeth
    K = random_pipe.vision_language_encoder.config.vq_config.num_embeddings
    for f, s in zip(drawn, slow):
        assert torch.equal(f.tokens, s.tokens)
        assert (f.q_logprobs - s.q_logprobs).abs().max() <= 1e-6
        assert (f.p_logprobs - s.p_logprobs).abs().max() <= 1e-6
        assert (f.prompt.preview_hw, f.prompt.large_hw, f.prompt.source is None) == (s.prompt.preview_hw, s.prompt.large_hw, s.prompt.source is None)
        assert torch.equal(f.prompt.inputs["input_ids"], s.prompt.inputs["input_ids"])
        if top_p < 1:
            assert fast_decode.code_support(f.support, K).gather(-1, f.tokens[..., None]).all()
            assert (f.p_logprobs < f.q_logprobs - 1e-3).any()  # the nucleus cut codes: q and p differ
        else:
            assert f.support is None and torch.equal(f.p_logprobs, f.q_logprobs)


def test_decode_static_cache(pipe, monkeypatch):
    """The fixed-shape step a GPU captures as a CUDA graph (pre-allocated cache, masks over every slot), run eagerly
    here: the same tokens as generate, log-probs within 1e-5, for one group and for groups of different lengths."""
    monkeypatch.setattr(fast_decode, "decode", functools.partial(fast_decode.decode, static=True))
    r = sample_group(pipe, "a red circle", 4, 96, 64, T, seed=5, top_p=0.9)
    tokens, logprobs, _, _ = generate_group(pipe, "a red circle", 4, 96, 64, T, 5, top_p=0.9)
    assert torch.equal(r.tokens, tokens) and (r.q_logprobs - logprobs).abs().max() <= 1e-5
    both = fast(pipe, ["a red circle", "two blue squares above a green triangle"], 2, 96, 96, [1, 2])
    for prompt, seed, r in zip(["a red circle", "two blue squares above a green triangle"], [1, 2], both):
        tokens, logprobs, _, _ = generate_group(pipe, prompt, 2, 96, 96, T, seed)
        assert torch.equal(r.tokens, tokens) and (r.q_logprobs - logprobs).abs().max() <= 1e-5


def test_decode_eager_attention(random_pipe):
    """The sampler's distribution whatever the attention implementation: with eager attention (which ADDS a 4D mask to
    the scores, where sdpa reads a bool one as "attend where True"), prompts of different lengths left-padded in one
    decode keep sampler and trainer within 1e-5; an implementation that cannot take the mask is refused."""
    pipe = copy.deepcopy(random_pipe)
    ar = pipe.vision_language_encoder
    ar.set_attn_implementation("eager")
    assert ar.config.text_config._attn_implementation == "eager"
    prompts = ["a red circle", "two blue squares above a green triangle on the left"]
    for r in fast(pipe, prompts, 2, 64, 64, [1, 2]):
        with torch.no_grad():
            scored = grpo.token_logprobs(ar, r.prompt.inputs, r.tokens, T)
        assert (scored - r.q_logprobs).abs().max() <= PARITY
    ar.config.text_config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match="sdpa or eager attention"):
        fast(pipe, prompts, 2, 64, 64, [1, 2])


def test_repeat_step(pipe, monkeypatch):
    """A CUDA graph is captured only for a step of fixed shapes on a GPU: decode asks for it exactly when its cache is
    static there, and repeat_step runs every step eagerly otherwise (a growing cache syncs with the host: not
    capturable). The noise is drawn outside the step (outside the graph), before each step: the step itself draws
    nothing, and a group's generator advances once per token."""
    asked = []
    monkeypatch.setattr(fast_decode, "repeat_step", lambda step, n, draw, capture=False: asked.append(capture))
    ids = torch.tensor([[5, 6]], device=DEVICE)
    for static in (False, True):
        fast_decode.decode(pipe.vision_language_encoder, ids, torch.ones_like(ids, dtype=torch.bool),
                           torch.arange(4, device=DEVICE).expand(3, 1, 4), 2, T, 0, 1.0, [torch.Generator(DEVICE)],
                           grpo.code_logprobs, static=static)
    assert asked == [False, DEVICE == "cuda"]
    monkeypatch.undo()
    generators, states = [torch.Generator(DEVICE).manual_seed(s) for s in (1, 2)], []

    def watched(step, n, draw, capture=False):  # decode's steps, eagerly, the generators' states around each part
        for _ in range(n):
            draw()
            before = [g.get_state() for g in generators]
            step()
            states.append((before, [g.get_state() for g in generators]))
    monkeypatch.setattr(fast_decode, "repeat_step", watched)
    ids = torch.tensor([[5, 6], [5, 6]], device=DEVICE)
    fast_decode.decode(pipe.vision_language_encoder, ids, torch.ones_like(ids, dtype=torch.bool),
                       torch.arange(5, device=DEVICE).expand(3, 2, 5), 3, T, 0, 1.0, generators, grpo.code_logprobs)
    assert len(states) == 3 and all(all(map(torch.equal, a, b)) for a, b in states)  # the step drew nothing
    assert all(not torch.equal(a[0], b[0]) for (a, _), (b, _) in zip(states, states[1:]))  # draw() did
    monkeypatch.undo()
    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: pytest.fail("a graph was captured"))
    calls = []
    fast_decode.repeat_step(lambda: calls.append("step"), 3, lambda: calls.append("draw"), capture=False)
    assert calls == ["draw", "step"] * 3


def test_support_bits():
    """support_bits packs a (..., K) bool set 8 codes to a byte and code_support gives it back, K a multiple of 8 or
    not; the packed set of a whole group at K = 16384 is 2 KiB a token."""
    g = torch.Generator().manual_seed(0)
    for K in (16, 13, 16384):
        kept = torch.rand(2, 3, K, generator=g) < 0.3
        bits = fast_decode.support_bits(kept)
        assert bits.dtype == torch.uint8 and bits.shape == (2, 3, (K + 7) // 8)
        assert torch.equal(fast_decode.code_support(bits, K), kept)
    assert fast_decode.support_bits(torch.ones(1, 16384, dtype=torch.bool)).numel() == 2048


def test_code_support():
    """code_support unpacks the sampler's bits, 8 codes to a byte, lowest code in the lowest bit, K not a multiple of
    8 cut to K."""
    bits = torch.tensor([[0b00000101, 0b00000010]], dtype=torch.uint8)
    assert fast_decode.code_support(bits, 10).tolist() == [[True, False, True] + [False] * 5 + [False, True]]
    kept = torch.rand(3, 13) < 0.5
    assert torch.equal(fast_decode.code_support(fast_decode.support_bits(kept), 13), kept)


def test_decode_keeps_sampling_mask(sharp_pipe):
    """With top-k / top-p the sampler records each draw's kept codes (Rollout.support): exactly the truncation of
    code_logprobs on generate's logits, every sampled token inside; without truncation it records nothing."""
    model = sharp_pipe.vision_language_encoder
    K = model.config.vq_config.num_embeddings
    r = sample_group(sharp_pipe, "a cat", 3, 64, 96, T, seed=4, top_k=20, top_p=0.8)
    tokens, _, _, logits = generate_group(sharp_pipe, "a cat", 3, 64, 96, T, 4, top_k=20, top_p=0.8)
    kept = fast_decode.code_support(r.support, K)
    assert torch.equal(r.tokens, tokens) and torch.equal(kept, grpo.code_logprobs(logits, T, K, 20, 0.8).isfinite())
    assert kept.gather(-1, r.tokens[..., None]).all() and 0 < kept.sum(-1).float().mean() < 20
    assert sample_group(sharp_pipe, "a cat", 3, 64, 96, T, seed=4).support is None


def test_check_tokens():
    """A group's tokens must fill its grid with codes: the full grid passes; a sample cut short (an early end of the
    image) or a token off the codebook is a one-line error naming the prompt."""
    fast_decode.check_tokens(torch.zeros(2, 9, dtype=torch.long), 9, 16, "a cat")
    with pytest.raises(ValueError, match=r"^sample_groups: 'a cat' was sampled 8 tokens .* for its 9 grid cells"):
        fast_decode.check_tokens(torch.zeros(2, 8, dtype=torch.long), 9, 16, "a cat")
    with pytest.raises(ValueError, match=r"'a dog' .*codes 0\.\.16\) for its 3 grid cells of codes < 16"):
        fast_decode.check_tokens(torch.tensor([[0, 16, 3]]), 3, 16, "a dog")


def test_main_short_sample(tmp_path, monkeypatch, capsys):
    """A decode that stops one token early (as a client that lets the AR end the image may): the run stops with one
    line naming the prompt, exit 1, no traceback."""
    decode = fast_decode.decode

    def short(*args, **kw):
        return tuple(x if x is None else x[:, :-1] for x in decode(*args, **kw))
    monkeypatch.setattr(fast_decode, "decode", short)
    with pytest.raises(SystemExit) as stop:
        tiny_run(tmp_path, tmp_path / "out", "--steps", "1")
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert stop.value.code == 1 and "Traceback" not in err
    assert re.search(r"error: 'a gray square' was sampled \d+ tokens .* grid cells", err), err


def test_sample_groups_one_decode(random_pipe):
    """One decode of several prompts of different lengths (left-padded), editing beside text-to-image: each group's
    tokens equal sampling it alone with its seed, log-probs within 1e-5, the inputs are the group's own. On the random
    model (not peaked: a sampled token's probability is small, so a wrong row, position or generator changes it)."""
    pipe = random_pipe
    prompts = ["a red circle", "two blue squares above a green triangle on the left", "make it red"]
    sources = [None, None, smooth_source(64, 64)]
    together = fast(pipe, prompts, 3, 64, 64, [11, 12, 13], sources)
    assert len({r.prompt.inputs["input_ids"].shape[1] for r in together}) == 3  # three prompt lengths
    assert all(r.q_logprobs.exp().mean() < 0.2 for r in together)  # no token is forced: the check has teeth
    for prompt, source, seed, r in zip(prompts, sources, [11, 12, 13], together):
        alone = sample_group(pipe, prompt, 3, 64, 64, T, seed, source)
        assert torch.equal(r.tokens, alone.tokens) and (r.q_logprobs - alone.q_logprobs).abs().max() <= 1e-5
        assert torch.equal(r.prompt.inputs["input_ids"], alone.prompt.inputs["input_ids"]) and r.prompt.large_hw == alone.prompt.large_hw
        assert r.prompt.preview_hw == alone.prompt.preview_hw and (r.prompt.source is None) == (source is None)
