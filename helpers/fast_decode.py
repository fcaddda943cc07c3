"""The fast decode: what grpo.py's `generate` computes, faster. grpo.py's `sample_groups` uses it when
this folder sits beside grpo.py (`main` always does); tests/test_fast_decode.py proves, in float32 on the
CPU, that it draws the same tokens as `generate` for the same seeds, with log-probs within 1e-6.

What only makes sampling fast lives here, the lesson (prefill, then one token a step) in grpo.py:
  - many prompts in one decode: the groups of one length N left-padded to one batch, each row at its
    own 3D positions, a float mask blocking the padding (`decode_mask`);
  - on a GPU, a fixed-shape (static) KV cache and ONE CUDA graph of the token step, replayed N - 1
    times (`repeat_step`): a real AR step is ~2,000 small kernels (11.8 ms a step at full depth, G 4,
    H200; docs/real_model.md);
  - the codes each top-k / top-p draw kept, packed 8 to a byte (`support_bits`), so that the trainer
    can replay the sampler's truncation exactly (`Rollout.support`; `code_support` unpacks them).
It never imports grpo.py: grpo.py's `code_logprobs` and `rope_positions` arrive as arguments.
"""

from typing import NamedTuple

import torch
import torch.nn.functional as F

from tqdm.auto import tqdm

from .parallel import distributed, inner_bar


class Draws(NamedTuple):  # one group's draws: grpo.Rollout's first fields, and the kept codes
    tokens: torch.Tensor  # (G, N) codes
    q_logprobs: torch.Tensor  # (G, N) their log-probs under q, what each draw used (top-k / top-p)
    p_logprobs: torch.Tensor  # (G, N) under p, the whole softmax
    support: torch.Tensor | None  # (G, N, K/8) bits of the codes each draw kept; None: all of them


@torch.no_grad()
def sample_groups(model, groups: list, temperature: float, seeds: list[int], top_k: int, top_p: float,
                  prompts: list[str], code_logprobs, rope_positions) -> list[Draws]:
    """grpo.sample_groups' groups (grpo.Prompt: inputs, preview_hw, large_hw, source) -> for each,
    its Draws: (G, N) tokens, their log-probs under q and under p, and the kept codes' bits (None
    without top-k / top-p): ONE decode of all P*G rows of each length N, left-padded, each at its own
    positions. Group p draws from a generator seeded with seeds[p]: the tokens it gets alone."""
    lengths = [a[0] * a[1] + b[0] * b[1] for _, a, b, _ in groups]  # N of each group
    drawn, config = [None] * len(groups), model.config
    for n in sorted(set(lengths)):
        mine = [i for i, length in enumerate(lengths) if length == n]
        inputs = [groups[i].inputs for i in mine]
        G = inputs[0]["input_ids"].shape[0]
        prompt_ids = [x["input_ids"][0] for x in inputs]  # (P_i,) each
        grids = [x["image_grid_thw"][:int(x["images_per_sample"][0])] for x in inputs]
        positions = [rope_positions(ids, grid, n + 1, config.image_start_token_id,
                                    config.image_end_token_id)
                     for ids, grid in zip(prompt_ids, grids)]  # (3, 1, P_i + N): the last fed too
        width = max(len(ids) for ids in prompt_ids)  # left padding: every prompt ends in one column

        def left_pad(x, dim=-1):  # each prompt's tensor padded on the left to `width` (+ N), G rows
            return torch.cat([F.pad(v, (width - len(ids), 0)) for v, ids in zip(x, prompt_ids)],
                             dim).repeat_interleave(G, dim)

        valid = [torch.ones_like(ids[None], dtype=torch.bool) for ids in prompt_ids]
        tokens, q_logprobs, p_logprobs, support = decode(
            model, left_pad([ids[None] for ids in prompt_ids], 0),  # (P*G, width), pad id 0
            left_pad(valid, 0),  # False on the padding
            left_pad(positions, 1),  # (3, P*G, width + N)
            n, temperature, top_k, top_p, [torch.Generator(model.device).manual_seed(seeds[i])
                                           for i in mine], code_logprobs)
        for j, i in enumerate(mine):
            rows = slice(j * G, (j + 1) * G)
            check_tokens(tokens[rows], n, config.vq_config.num_embeddings, prompts[i])
            kept = None if support is None else support[rows]
            drawn[i] = Draws(tokens[rows], q_logprobs[rows], p_logprobs[rows], kept)
    return drawn


def check_tokens(tokens: torch.Tensor, n_tokens: int, codebook_size: int, prompt: str) -> None:
    """A group's (G, N') tokens must fill its N grid cells with codes: a sample cut short (an
    end-of-image drawn early, as other clients allow) or off the codebook cannot be decoded. decode
    draws N codes by construction: this guards a decoder put in its place."""
    if tokens.shape[1] != n_tokens or not ((0 <= tokens) & (tokens < codebook_size)).all():
        codes = f"codes {int(tokens.min())}..{int(tokens.max())}" if tokens.numel() else "no codes"
        raise ValueError(f"sample_groups: '{prompt}' was sampled {tokens.shape[1]} tokens "
                         f"({codes}) for its {n_tokens} grid cells of codes < {codebook_size}; "
                         "the decode loop must draw every cell")


@torch.no_grad()
def decode(model, input_ids: torch.Tensor, valid: torch.Tensor, positions: torch.Tensor,
           n_tokens: int, temperature: float, top_k: int, top_p: float, generators: list,
           code_logprobs, static: bool | None = None) -> tuple[torch.Tensor, ...]:
    """grpo.generate for many prompts at once: prefill once, then a token a step with a KV cache.
    (B, P) left-padded prompts, `valid` False on padding, (3, B, P + N) positions, a generator per
    group -> (B, N) codes, their log-probs under the distribution drawn from (q: after top-k /
    top-p) and under the whole softmax (p: before them) and, with top-k / top-p, the bits of the
    codes each draw kept (else None). `static` (default on a GPU): a pre-allocated cache, for a
    CUDA graph."""
    from transformers import DynamicCache, StaticCache
    K, V = model.config.vq_config.num_embeddings, model.lm_head.out_features
    (B, P), N, device = input_ids.shape, n_tokens, input_ids.device
    L = P + N  # slots: the prompt, then every generated token (the last one is fed too)
    attention = model.config.text_config._attn_implementation
    if attention not in ("sdpa", "eager"):  # flash: no 4D mask; flex: another kind of mask
        raise ValueError(f"decode needs sdpa or eager attention to mask left padding, and the AR "
                         f"uses {attention}; load it with attn_implementation='sdpa'")
    static = device.type == "cuda" if static is None else static
    text_config = model.config.text_config
    cache = (StaticCache(config=text_config, max_cache_len=L) if static
             else DynamicCache(config=text_config))
    seen = F.pad(valid, (0, N), value=True)  # (B, L): slots that hold a token (padding never)
    slot = torch.arange(L, device=device)

    def forward(ids, slots):  # (B, S) tokens at `slots` (S,) -> (B, V) logits after the last one
        kv = L if static else int(slots[-1]) + 1  # the slots attended to
        mask = decode_mask(seen, slots, kv, model.dtype)  # (B, 1, S, kv)
        return model(input_ids=ids, attention_mask=mask, position_ids=positions[:, :, slots],
                     cache=cache, logits_to_keep=1).logits[:, -1]  # the trainer's forward, a token

    tokens = torch.zeros(B, N, dtype=torch.long, device=device)
    q_logprobs, p_logprobs = torch.zeros(B, N, device=device), torch.zeros(B, N, device=device)
    truncated = 0 < top_k < K or top_p < 1
    support = (torch.zeros(B, N, (K + 7) // 8, dtype=torch.uint8, device=device) if truncated
               else None)
    t = torch.zeros(1, dtype=torch.long, device=device)  # the step, on the device: graph-safe
    logits = forward(input_ids, slot[:P])  # prefill: (B, V) logits of the first token

    G, noise = B // len(generators), torch.empty(B, V, device=device)
    bar = tqdm(total=N, **inner_bar("tokens"))  # shown on a slow draw only (the real model's)

    def draw():  # each group's (G, V) noise for the next token, as grpo.generate draws it
        for i, g in enumerate(generators):
            noise[i * G:(i + 1) * G].exponential_(generator=g)
        bar.update()

    def step():  # draw token t from code_logprobs, then feed it: the logits of token t + 1
        logp = code_logprobs(logits, temperature, K, top_k, top_p)  # (B, K)
        token = (logp.exp() / noise[:, :K]).argmax(dim=-1, keepdim=True)  # torch.multinomial(p, 1)
        tokens.index_copy_(1, t, token)
        q_logprobs.index_copy_(1, t, logp.gather(-1, token))
        full = code_logprobs(logits, temperature, K) if truncated else logp  # the whole softmax
        p_logprobs.index_copy_(1, t, full.gather(-1, token))
        if truncated:  # the sampling mask, kept for the trainer
            support.index_copy_(1, t, support_bits(logp.isfinite())[:, None])
        logits.copy_(forward(token, P + t))
        t.add_(1)

    try:
        repeat_step(step, N, draw, capture=static and device.type == "cuda")
    finally:
        bar.close()
    return tokens, q_logprobs, p_logprobs, support


def decode_mask(seen: torch.Tensor, slots: torch.Tensor, kv: int, dtype: torch.dtype
                ) -> torch.Tensor:
    """(B, L) slots that hold a token, (S,) slots fed -> (B, 1, S, kv) mask: causal, padding blocked
    (a pad slot sees itself: no NaN). Additive float: eager attention adds a mask, sdpa would read a
    bool one as "attend where True", so only this form means the same to both."""
    slot = torch.arange(seen.shape[1], device=seen.device)
    attend = (seen[:, None, None, :] & (slot <= slots[:, None])) | (slot == slots[:, None])
    blocked = torch.finfo(dtype).min  # added to masked scores, by eager and sdpa alike
    return torch.zeros(attend[..., :kv].shape, dtype=dtype, device=seen.device).masked_fill(
        ~attend[..., :kv], blocked)


def repeat_step(step, n: int, draw, capture: bool = False) -> None:
    """draw(); step(), n times. With `capture` the first step runs eagerly and the rest replay ONE
    CUDA graph of it (a real AR step is ~2,000 small kernels). draw(), the noise, stays outside the
    graph: no generator state in it (docs/real_model.md)."""
    draw()
    step()
    if n == 1 or not capture or distributed():  # FSDP's hooks are not captured
        for _ in range(n - 1):
            draw()
            step()
        return
    graph = torch.cuda.CUDAGraph()
    autocast = torch.autocast("cuda", torch.get_autocast_dtype("cuda"),
                              torch.is_autocast_enabled("cuda"), cache_enabled=False)  # graph-safe
    with torch.cuda.graph(graph), autocast:
        step()
    for _ in range(n - 1):
        draw()
        graph.replay()


def support_bits(kept: torch.Tensor) -> torch.Tensor:
    """(..., K) bool -> (..., K/8) uint8: the codes a truncation kept, 8 to a byte (code_support
    unpacks them)."""
    kept = F.pad(kept, (0, -kept.shape[-1] % 8)).unflatten(-1, (-1, 8)).to(torch.uint8)
    shifts = torch.arange(8, device=kept.device, dtype=torch.uint8)
    return (kept << shifts).sum(-1, dtype=torch.uint8)


def code_support(bits: torch.Tensor, codebook_size: int) -> torch.Tensor:
    """(..., K/8) uint8 bits of kept codes (grpo.Rollout.support) -> the (..., K) bool set."""
    shifts = torch.arange(8, device=bits.device, dtype=torch.uint8)
    return ((bits[..., None] >> shifts) & 1).bool().flatten(-2)[..., :codebook_size]
