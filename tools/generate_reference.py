"""The sampler grpo.py had before its own decode loop, kept as a reference for the tests and tools/bench.py.

One transformers `generate` for a group (its DynamicCache, its own 3D rotary positions from get_rope_index) drawing
from grpo.code_logprobs as a logits processor, seeded with torch.manual_seed(seed). grpo.sample_groups must draw the
very same tokens for a seed (test_grpo.test_generate) and be no slower (bench.py
--sampler).
"""

import math

import torch
import torch.nn.functional as F

import grpo


@torch.no_grad()
def generate_group(pipe, prompt: str, group_size: int, height: int, width: int, temperature: float, seed: int,
                   source: torch.Tensor | None = None, top_k: int = 0, top_p: float = 1.0, max_new_tokens=None):
    """G samples of one prompt through `generate`. Returns the (G, N) tokens, their (G, N) log-probs under
    code_logprobs, the (G, N, V) processed scores and (G, N, V) raw logits (V: the lm_head's rows). `max_new_tokens`
    stops early (timing a prefix); default: the whole N = preview + large grid."""
    from transformers import LogitsProcessorList
    model = pipe.vision_language_encoder.eval()
    K = model.config.vq_config.num_embeddings
    group = (grpo.group_prompt(pipe, prompt, group_size, height, width) if source is None else
             grpo.edit_prompt(pipe, prompt, group_size, height, width, source))
    inputs, preview_hw, large_hw = group.inputs, group.preview_hw, group.large_hw

    def processor(input_ids, scores):  # what generate draws from: code_logprobs, -inf beyond the codebook
        return F.pad(grpo.code_logprobs(scores, temperature, K, top_k, top_p), (0, scores.shape[-1] - K),
                     value=-math.inf)

    n = max_new_tokens or preview_hw[0] * preview_hw[1] + large_hw[0] * large_hw[1]
    with torch.random.fork_rng(devices=[model.device] if model.device.type == "cuda" else []):
        torch.manual_seed(seed)
        out = model.generate(**inputs, do_sample=True, temperature=1.0, top_k=0, top_p=1.0, repetition_penalty=1.0,
                             logits_processor=LogitsProcessorList([processor]), max_new_tokens=n,
                             min_new_tokens=n, output_logits=True, output_scores=True, return_dict_in_generate=True,
                             synced_gpus=False)
    tokens = out.sequences[:, inputs["input_ids"].shape[1]:]
    scores, logits = torch.stack(out.scores, 1), torch.stack(out.logits, 1)
    logprobs = grpo.code_logprobs(logits, temperature, K, top_k, top_p).gather(-1, tokens[..., None]).squeeze(-1)
    return tokens, logprobs, scores, logits
