"""helpers/offline_model.py: the tiny GLM-Image built in code, and GLM-Image at its published widths (random weights,
reduced depth), neither needing the hub."""

import torch

import grpo
from helpers.offline_model import tiny_glm_image
from tests.conftest import DEVICE


def test_tiny_glm_image():
    """Deterministic per seed; token ids coherent across tokenizer, AR, VQ and DiT; a few 100k parameters."""
    a, b, c = tiny_glm_image(0), tiny_glm_image(0), tiny_glm_image(1)
    wa, wb, wc = (p.vision_language_encoder.lm_head.weight for p in (a, b, c))
    assert torch.equal(wa, wb) and not torch.equal(wa, wc)
    assert torch.equal(a.transformer.prior_token_embedding.weight, b.transformer.prior_token_embedding.weight)
    cfg, tok = a.vision_language_encoder.config, a.processor.tokenizer
    K = cfg.vq_config.num_embeddings
    assert tok.bos_token_id == cfg.image_start_token_id == K
    assert tok.eos_token_id == tok.pad_token_id == cfg.image_end_token_id == cfg.text_config.eos_token_id == K + 1
    assert cfg.text_config.vision_vocab_size > K + 1
    assert a.transformer.config.prior_vq_quantizer_codebook_size == K
    assert a.vae_scale_factor * a.transformer.config.patch_size == 16
    n = sum(p.numel() for m in (a.vision_language_encoder, a.transformer, a.vae, a.text_encoder) for p in m.parameters())
    assert 1e5 < n < 1e6


def test_real_shapes_glm_image():
    """The reduced-depth builder keeps every published width, head count, vocabulary, special id and rope setting."""
    from helpers.offline_model import PUBLISHED, real_shapes_glm_image
    pipe = real_shapes_glm_image(ar=1, vision=1, dit=1, t5=1, device="meta")
    ar, tok = pipe.vision_language_encoder, pipe.processor.tokenizer
    text = ar.config.text_config
    published = PUBLISHED["ar"]["text_config"]
    for key in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "vocab_size",
                "vision_vocab_size", "pad_token_id", "eos_token_id"):
        assert getattr(text, key) == published[key], key
    assert text.rope_parameters["mrope_section"] == [8, 12, 12] and text.rope_parameters["partial_rotary_factor"] == 0.5
    assert text.num_hidden_layers == 1 and ar.model.visual.config.depth == 1
    assert ar.lm_head.weight.shape == (16512, 4096) and ar.model.language_model.embed_tokens.weight.shape == (168064, 4096)
    assert pipe.transformer.config.num_attention_heads * pipe.transformer.config.attention_head_dim == 4096
    assert pipe.transformer.config.num_layers == 1 and pipe.vae.config.latent_channels == 16
    assert len(pipe.vae.config.latents_mean) == len(pipe.vae.config.latents_std) == 16  # the pipeline needs them
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (16384, 16385, 16385) and len(tok) == 168064
    assert tok.convert_tokens_to_ids(["<|endoftext|>", "[gMASK]", "<sop>", "<|user|>", "<|image|>"]) == [
        167841, 167843, 167845, 167848, ar.config.image_token_id]
    inputs = grpo.group_inputs(pipe.processor, "a cat", 2, 1024, 1024, DEVICE)
    assert inputs["image_grid_thw"].tolist() == [[1, 32, 32], [1, 16, 16]] * 2
    assert inputs["input_ids"][0, -1] == ar.config.image_start_token_id == 16384
