"""A tiny, randomly initialised GLM-Image built offline from the real transformers / diffusers classes.

No model hub is needed: the tokenizer is made with the `tokenizers` library and every component gets
a small config whose token ids agree with each other. `grpo.py --model tiny`, the tests and the
notebook run on it; `grpo.load_glm_image("tiny")` calls it.
"""

import torch


def tiny_glm_image(seed: int = 0, codebook_size: int = 128):
    """A randomly initialised GLM-Image built offline from the real classes, ~0.3M parameters.

    Same token layout as the real model: ids 0..K-1 are VQ codes, K is image start (= bos), K+1 is
    image end (= eos = pad), then spare visual ids, the GLM special tokens and 256 byte pieces.
    Deterministic for a seed.
    """
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, GlmImagePipeline, GlmImageTransformer2DModel
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import (ByT5Tokenizer, GlmImageConfig, GlmImageForConditionalGeneration, GlmImageImageProcessorPil,
                              GlmImageProcessor, PreTrainedTokenizerFast, T5Config, T5EncoderModel)

    K = codebook_size
    visual = [f"<|dit_token_{i}|>" for i in range(K + 16)]  # codes, image start, image end, 14 spare
    specials = ["<|endoftext|>", "[MASK]", "[gMASK]", "[sMASK]", "<|system|>", "<|user|>", "<|assistant|>",
                "<|observation|>", "<|begin_of_image|>", "<|end_of_image|>", "<|image|>", "<sop>", "<eop>"]
    vocab = {t: i for i, t in enumerate(visual + specials + sorted(pre_tokenizers.ByteLevel.alphabet()))}
    bpe = Tokenizer(models.BPE(vocab=vocab, merges=[]))  # no merges: every string encodes byte by byte
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.add_special_tokens(visual + specials)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe, bos_token=visual[K], eos_token=visual[K + 1], pad_token=visual[K + 1], padding_side="left",
        extra_special_tokens={"image_token": "<|image|>", "grid_bos_token": "<sop>", "grid_eos_token": "<eop>"})
    template = ("[gMASK]<sop>{% for m in messages %}<|{{ m['role'] }}|>\n{% for c in m['content'] %}"
                "{% if c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}{% endfor %}<|assistant|>\n")
    processor = GlmImageProcessor(image_processor=GlmImageImageProcessorPil(), tokenizer=tokenizer, chat_template=template)

    torch.manual_seed(seed)
    ar_config = GlmImageConfig(
        text_config=dict(vocab_size=len(vocab), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=1024,
                         vision_vocab_size=K + 16, pad_token_id=K + 1, eos_token_id=K + 1,
                         # mrope_section must sum to head_dim * partial_rotary_factor / 2 = 32 * 0.5 / 2
                         rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[2, 3, 3],
                                              partial_rotary_factor=0.5)),
        vision_config=dict(depth=1, hidden_size=32, num_heads=2, image_size=32, patch_size=8, intermediate_size=32),
        vq_config=dict(embed_dim=32, num_embeddings=K, latent_channels=32),
        image_token_id=vocab["<|image|>"], image_start_token_id=K, image_end_token_id=K + 1)
    ar = GlmImageForConditionalGeneration(ar_config)
    text_encoder = T5EncoderModel(T5Config(vocab_size=384, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4))
    # patch_size 2 x VAE scale factor 8 = 16: the DiT sees the AR grid upsampled 2x (H/16 x W/16)
    dit = GlmImageTransformer2DModel(patch_size=2, in_channels=4, out_channels=4, num_layers=2, attention_head_dim=8,
                                     num_attention_heads=4, text_embed_dim=32, time_embed_dim=32, condition_dim=16,
                                     prior_vq_quantizer_codebook_size=K)
    vae = AutoencoderKL(block_out_channels=(8, 8, 16, 16), in_channels=3, out_channels=3, latent_channels=4,
                        down_block_types=["DownEncoderBlock2D"] * 4, up_block_types=["UpDecoderBlock2D"] * 4,
                        norm_num_groups=4, sample_size=64, latents_mean=[0.0] * 4, latents_std=[1.0] * 4)
    return GlmImagePipeline(tokenizer=ByT5Tokenizer(), processor=processor, text_encoder=text_encoder,
                            vision_language_encoder=ar, vae=vae, transformer=dit,
                            scheduler=FlowMatchEulerDiscreteScheduler())


def sharpen(pipe):
    """Make the tiny AR peaked (entropy ~2.6 nats instead of ~4.8), in place; returns `pipe`.

    Scaling only the language-model matrices is undone by the final RMSNorm, so lm_head is scaled
    too. On a peaked model, wrong log-probs (e.g. without the 3D positions) are far from right ones.
    """
    ar = pipe.vision_language_encoder
    with torch.no_grad():
        for name, p in ar.model.language_model.named_parameters():
            if p.ndim == 2 and "embed" not in name:
                p.mul_(4.0)
        ar.lm_head.weight.mul_(16.0)
    return pipe
