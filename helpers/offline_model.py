"""GLM-Image built offline from the real transformers / diffusers classes, with random weights.

No model hub is needed. One function, `glm_image(configs, depths)`, builds a coherent pipeline from a
set of component configs and a tokenizer made with the `tokenizers` library:

  - `PUBLISHED`: zai-org/GLM-Image's published configs (the one copy in this repository; `tools/memory_plan.py`
    reads them too). `real_shapes_glm_image()` builds them at reduced depth: every width, head count,
    vocabulary size, special token id and rope setting as published, only fewer layers; `random_glm_image()` is
    `grpo.py --model random[:L]`.
  - `TINY`: the same layout at tiny sizes (~0.3M parameters). `tiny_glm_image()` is what
    `grpo.py --model tiny`, the tests and the notebook run on.
"""

import copy

import torch

# ---- Configs -------------------------------------------------------------------------------------

# Where the published values come from (public pages and repositories, read with a search tool, not downloaded here)
SOURCES = {
    "vision_language_encoder": "huggingface.co/zai-org/GLM-Image/blob/main/vision_language_encoder/config.json "
                               "(vq_config after initializer_range cut off: latent_channels, num_embeddings = "
                               "transformers defaults)",
    "transformer": "huggingface.co/xcreates/GLM-Image/blob/main/transformer/config.json (re-upload of the checkpoint); "
                   "same values in hao-ai-lab/FastVideo fastvideo/configs/models/dits/glm_image.py",
    "vae": "raw config not found; hao-ai-lab/FastVideo fastvideo/configs/models/vaes/glm_image.py (with the 16 "
           "latents_mean / latents_std values) and ollama/ollama x/imagegen/models/glm_image/vae.go (agree)",
    "text_encoder": "raw config not found; ollama/ollama x/imagegen/models/glm_image/text_encoder.go (comments)",
    "tokenizer": "GLM-4's special tokens (THUDM/glm-4-9b-chat tokenizer_config.json, <|endoftext|> = 151329 ...) "
                 "shifted by the 16512 visual ids: <|endoftext|> = 167841 = the AR's pad_token_id and <|image|> = "
                 "167855 = its image_token_id; <|dit_token_16384|> = bos = image start, <|dit_token_16385|> = eos",
}

# GLM-4's special tokens in their id order (the real tokenizer puts <|endoftext|> first, at the AR's text pad id)
GLM_SPECIALS = ["<|endoftext|>", "[MASK]", "[gMASK]", "[sMASK]", "<sop>", "<eop>", "<|system|>", "<|user|>",
                "<|assistant|>", "<|observation|>", "<|begin_of_image|>", "<|end_of_image|>", "<|begin_of_video|>",
                "<|end_of_video|>", "<|image|>"]

PUBLISHED = dict(
    ar=dict(  # GlmImageConfig
        image_start_token_id=16384, image_end_token_id=16385, image_token_id=167855, tie_word_embeddings=False,
        text_config=dict(
            vocab_size=168064, vision_vocab_size=16512, hidden_size=4096, intermediate_size=13696,
            num_hidden_layers=40, num_attention_heads=32, num_key_value_heads=2, hidden_act="silu",
            max_position_embeddings=131072, rms_norm_eps=1e-5, attention_dropout=0.0, eos_token_id=16385,
            pad_token_id=167841,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[8, 12, 12],
                                 partial_rotary_factor=0.5)),
        vision_config=dict(depth=40, hidden_size=1536, num_heads=16, intermediate_size=6144, image_size=2048,
                           patch_size=16, in_channels=3, hidden_act="gelu", attention_bias=True, layer_norm_eps=1e-6),
        vq_config=dict(embed_dim=2048, in_channels=3,
                       latent_channels=1536, num_embeddings=16384),  # these two: library defaults (cut off in the source)
    ),
    dit=dict(patch_size=2, in_channels=16, out_channels=16, num_layers=30, attention_head_dim=128,
             num_attention_heads=32, text_embed_dim=1472, time_embed_dim=512, condition_dim=256,
             prior_vq_quantizer_codebook_size=16384),
    vae=dict(in_channels=3, out_channels=3, latent_channels=16, block_out_channels=(128, 512, 1024, 1024),
             down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
             layers_per_block=3, norm_num_groups=32, act_fn="silu", sample_size=1024, scaling_factor=0.18215,
             force_upcast=True, use_quant_conv=False, use_post_quant_conv=False, mid_block_add_attention=False,
             # the pipeline un-normalises latents with these before the VAE decodes (it crashes without them)
             latents_mean=(-0.2080078125, 1.875, -0.470703125, -1.265625, -1.421875, 0.77734375, -0.3671875,
                           -0.9453125, 0.318359375, 0.7734375, -0.1884765625, -0.022216796875, -0.220703125,
                           -1.59375, -0.81640625, -0.255859375),
             latents_std=(3.0625, 2.203125, 2.265625, 4.84375, 2.5, 3.9375, 2.203125, 3.03125, 2.1875, 2.046875,
                          2.71875, 2.390625, 2.390625, 2.453125, 2.25, 2.15625)),
    t5=dict(vocab_size=384, d_model=1472, d_kv=64, d_ff=3584, num_layers=12, num_heads=6,
            feed_forward_proj="gated-gelu", relative_attention_num_buckets=32, relative_attention_max_distance=128,
            layer_norm_epsilon=1e-6, is_encoder_decoder=False),
    # id of every special token: GLM-4's specials start at the AR's text pad id
    specials={token: 167841 + i for i, token in enumerate(GLM_SPECIALS)},
)

K_TINY = 128  # the tiny codebook: ids 0..127 are codes, 128 image start (= bos), 129 image end (= eos = pad)
# the special tokens of the small models (TINY, WORLD), in this order right after the visual ids
SMALL_SPECIALS = ["<|endoftext|>", "[MASK]", "[gMASK]", "[sMASK]", "<|system|>", "<|user|>", "<|assistant|>",
                  "<|observation|>", "<|begin_of_image|>", "<|end_of_image|>", "<|image|>", "<sop>", "<eop>"]
TINY = dict(
    ar=dict(
        image_start_token_id=K_TINY, image_end_token_id=K_TINY + 1, image_token_id=K_TINY + 16 + 10,
        text_config=dict(vocab_size=413, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=1024,
                         vision_vocab_size=K_TINY + 16, pad_token_id=K_TINY + 1, eos_token_id=K_TINY + 1,
                         # mrope_section must sum to head_dim * partial_rotary_factor / 2 = 32 * 0.5 / 2
                         rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[2, 3, 3],
                                              partial_rotary_factor=0.5)),
        # patch 16 as published: the processor halves a source image, so its AR grid is (H/32, W/32) like the DiT's
        vision_config=dict(depth=1, hidden_size=32, num_heads=2, image_size=32, patch_size=16, intermediate_size=32),
        vq_config=dict(embed_dim=32, num_embeddings=K_TINY, latent_channels=32),
    ),
    # patch_size 2 x VAE scale factor 8 = 16: the DiT sees the AR grid upsampled 2x (H/16 x W/16)
    dit=dict(patch_size=2, in_channels=4, out_channels=4, num_layers=2, attention_head_dim=8, num_attention_heads=4,
             text_embed_dim=32, time_embed_dim=32, condition_dim=16, prior_vq_quantizer_codebook_size=K_TINY),
    vae=dict(block_out_channels=(8, 8, 16, 16), in_channels=3, out_channels=3, latent_channels=4,
             down_block_types=["DownEncoderBlock2D"] * 4, up_block_types=["UpDecoderBlock2D"] * 4,
             norm_num_groups=4, sample_size=64, latents_mean=[0.0] * 4, latents_std=[1.0] * 4),
    t5=dict(vocab_size=384, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4),
    # right after the 144 visual ids, in this order (the byte pieces follow)
    specials={token: K_TINY + 16 + i for i, token in enumerate(SMALL_SPECIALS)},
)

# The tiny GLM-Image that tools/train_tiny.py pre-trains on world.py's shapes (a few M parameters): 16 codes (a cell's
# code is its world label: 0 empty, 1..12 the objects), one token per caption word, a rope whose rotations tell the
# cells of a 3x3 grid apart (theta 10: the published 10000 turns a tiny head's width axis by < 0.01 rad a column).
K_WORLD = 16
WORLD_WORDS = ["a", "two", "three"] + [" " + w for w in (
    "a and at in on of the above below left right top bottom center red green blue yellow circle circles square "
    "squares triangle triangles").split()]
WORLD = dict(
    ar=dict(
        image_start_token_id=K_WORLD, image_end_token_id=K_WORLD + 1, image_token_id=K_WORLD + 16 + 10,
        text_config=dict(vocab_size=K_WORLD + 16 + 13 + 256 + 86, hidden_size=128, intermediate_size=256,
                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                         max_position_embeddings=1024, vision_vocab_size=K_WORLD + 16, pad_token_id=K_WORLD + 1,
                         eos_token_id=K_WORLD + 1,
                         rope_parameters=dict(rope_type="default", rope_theta=10.0, mrope_section=[2, 3, 3],
                                              partial_rotary_factor=0.5)),
        vision_config=dict(depth=1, hidden_size=32, num_heads=2, image_size=32, patch_size=16, intermediate_size=32),
        vq_config=dict(embed_dim=32, num_embeddings=K_WORLD, latent_channels=32),
    ),
    dit=dict(patch_size=2, in_channels=4, out_channels=4, num_layers=4, attention_head_dim=32, num_attention_heads=4,
             text_embed_dim=32, time_embed_dim=64, condition_dim=16, prior_vq_quantizer_codebook_size=K_WORLD),
    vae=dict(block_out_channels=(16, 16, 32, 32), in_channels=3, out_channels=3, latent_channels=4,
             down_block_types=["DownEncoderBlock2D"] * 4, up_block_types=["UpDecoderBlock2D"] * 4, layers_per_block=1,
             norm_num_groups=8, sample_size=96, mid_block_add_attention=False, latents_mean=[0.0] * 4,
             latents_std=[1.0] * 4),
    t5=dict(vocab_size=384, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4),
    specials={token: K_WORLD + 16 + i for i, token in enumerate(SMALL_SPECIALS)},
    words=WORLD_WORDS,
)

# The chat template: [gMASK]<sop>, the user turn, the assistant turn. A source image (editing) sits between the image
# start and end ids (bos / eos = <|dit_token_16384|> / <|dit_token_16385|> in the real model): those are the markers
# GlmImageModel.get_rope_index looks for to give the image 2D positions. The processor expands <|image|> to one
# placeholder per source token and appends the target grid(s) and the image start.
CHAT_TEMPLATE = ("[gMASK]<sop>{% for m in messages %}<|{{ m['role'] }}|>\n{% for c in m['content'] %}"
                 "{% if c['type'] == 'text' %}{{ c['text'] }}"
                 "{% elif c['type'] == 'image' %}{{ bos_token }}<|image|>{{ eos_token }}{% endif %}"
                 "{% endfor %}{% endfor %}<|assistant|>\n")


# ---- Building ------------------------------------------------------------------------------------

def with_depths(configs: dict, ar: int | None = None, vision: int | None = None, dit: int | None = None,
                t5: int | None = None) -> dict:
    """A copy of `configs` with fewer layers; every width, head count and id unchanged."""
    c = copy.deepcopy(configs)
    for value, (part, key) in [(ar, ("text_config", "num_hidden_layers")), (vision, ("vision_config", "depth"))]:
        if value is not None:
            c["ar"][part][key] = value
    if dit is not None:
        c["dit"]["num_layers"] = dit
    if t5 is not None:
        c["t5"]["num_layers"] = t5
    return c


def word_merges(words: list[str]) -> list[tuple[str, str]]:
    """Byte-level BPE merges that make each of `words` one token (" red": the chain (" ", r) -> " r", (" r", e) ->
    " re", (" re", d) -> " red"); a word that starts a text is given without its space."""
    from tokenizers import pre_tokenizers
    to_bytes = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    merges = []
    for word in words:
        pieces = [to_bytes.pre_tokenize_str(ch)[0][0] for ch in word]
        for i in range(1, len(pieces)):
            merge = ("".join(pieces[:i]), pieces[i])
            if merge not in merges:
                merges.append(merge)
    return merges


def glm_tokenizer(vocab_size: int, visual_ids: int, specials: dict, image_start: int, image_end: int,
                  words: list[str] = ()):
    """A byte-level BPE tokenizer (any string encodes) with GLM-Image's id layout.

    Ids 0..visual_ids-1 are `<|dit_token_i|>` (codes, image start = bos, image end = eos = pad, spare ids);
    `specials` sit at their given ids; the 256 byte pieces take the lowest free ids, then the pieces of the merges
    that make each of `words` one token (`word_merges`; none by default), `<|reserved_i|>` the rest.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    visual = [f"<|dit_token_{i}|>" for i in range(visual_ids)]
    by_id = dict(enumerate(visual)) | {i: t for t, i in specials.items()}
    free = (i for i in range(vocab_size) if i not in by_id)
    by_id |= {next(free): piece for piece in sorted(pre_tokenizers.ByteLevel.alphabet())}
    merges = word_merges(list(words))
    by_id |= {next(free): a + b for a, b in merges}
    by_id |= {i: f"<|reserved_{i}|>" for i in free}
    assert len(by_id) == vocab_size and max(by_id) == vocab_size - 1, "vocab_size too small for the ids"
    bpe = Tokenizer(models.BPE(vocab={t: i for i, t in by_id.items()}, merges=merges))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.add_special_tokens(visual + list(specials))
    return PreTrainedTokenizerFast(
        tokenizer_object=bpe, bos_token=visual[image_start], eos_token=visual[image_end], pad_token=visual[image_end],
        padding_side="left",
        extra_special_tokens={"image_token": "<|image|>", "grid_bos_token": "<sop>", "grid_eos_token": "<eop>"})


def glm_image(configs: dict, seed: int = 0, device: str | torch.device | None = None):
    """A GlmImagePipeline with random weights from `configs` (TINY, PUBLISHED, or `with_depths` of either).

    Deterministic for a seed (components are built in a fixed order: AR, T5, DiT, VAE). `device="meta"` builds
    the shapes without memory (for counting parameters).
    """
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, GlmImagePipeline, GlmImageTransformer2DModel
    from transformers import (ByT5Tokenizer, GlmImageConfig, GlmImageForConditionalGeneration, GlmImageImageProcessorPil,
                              GlmImageProcessor, T5Config, T5EncoderModel)

    ar_config = GlmImageConfig(**configs["ar"])
    text = ar_config.text_config
    tokenizer = glm_tokenizer(text.vocab_size, text.vision_vocab_size, configs["specials"],
                              ar_config.image_start_token_id, ar_config.image_end_token_id, configs.get("words", ()))
    assert tokenizer.convert_tokens_to_ids("<|image|>") == ar_config.image_token_id
    # a source image: 16-pixel patches after the processor halves it, one VQ code per patch (no merging, no time axis)
    patch = configs["ar"]["vision_config"]["patch_size"]
    image_processor = GlmImageImageProcessorPil(patch_size=patch, merge_size=1, temporal_patch_size=1,
                                                size={"shortest_edge": 32 * 32, "longest_edge": 2048 * 2048})
    processor = GlmImageProcessor(image_processor=image_processor, tokenizer=tokenizer, chat_template=CHAT_TEMPLATE)
    torch.manual_seed(seed)
    with torch.device(device or "cpu"):
        ar = GlmImageForConditionalGeneration(ar_config)
        text_encoder = T5EncoderModel(T5Config(**configs["t5"]))
        dit = GlmImageTransformer2DModel(**configs["dit"])
        vae = AutoencoderKL(**configs["vae"])
    return GlmImagePipeline(tokenizer=ByT5Tokenizer(), processor=processor, text_encoder=text_encoder,
                            vision_language_encoder=ar, vae=vae, transformer=dit,
                            scheduler=FlowMatchEulerDiscreteScheduler())


def random_glm_image(name: str, device: str | torch.device | None = None, dtype: torch.dtype | None = None):
    """--model 'random' (zai-org/GLM-Image's published configs) or 'random:L' (L layers in each part) with random
    weights, built in `dtype` on `device`: the real model's speed and memory without its download."""
    layers = int(name[len("random:"):]) if ":" in name else None
    configs = with_depths(PUBLISHED, *[layers] * 4) if layers else PUBLISHED
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype or default)
    try:
        return glm_image(configs, device=device)
    finally:
        torch.set_default_dtype(default)


def tiny_glm_image(seed: int = 0):
    """The tiny GLM-Image (~0.3M parameters, 128 codes): same token layout and classes as the real one."""
    return glm_image(TINY, seed)


def real_shapes_glm_image(ar: int = 2, vision: int = 1, dit: int = 1, t5: int = 1, seed: int = 0,
                          device: str | torch.device | None = None):
    """zai-org/GLM-Image's published widths, vocabularies and ids at reduced depth, random weights (float32).

    At the default depths about 2.9B parameters (the 168064 x 4096 token embedding alone is 0.69B): ~11 GiB.
    """
    return glm_image(with_depths(PUBLISHED, ar=ar, vision=vision, dit=dit, t5=t5), seed, device)


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
