"""GRPO on GLM-Image, in one file you can read top to bottom.

GLM-Image draws in two stages: an autoregressive model (the AR, a 9B GLM) writes a grid of visual
tokens, and a diffusion transformer (the DiT, 7B) paints pixels from them. This file trains the AR
with GRPO (Group Relative Policy Optimization, Shao et al. 2024): for each prompt x, sample a group
of G token grids o_1..o_G, decode them to images, score them, and maximise

    J = 1/G sum_i 1/|o_i| sum_t [ min(r_it A_i, clip(r_it, 1-eps, 1+eps) A_i) - beta KL_it ]

r_it = pi(o_it | x, o_i<t) / pi_old(o_it | x, o_i<t): the policy now over pi_old, the policy before
the step's first update; A_i = (R_i - mean(R)) / std(R): sample i's reward against its
group's; KL_it: the k3 estimate of KL(pi || ref), ref a frozen copy of the initial AR
(k3 = ref/pi - log(ref/pi) - 1 per token, >= 0: grpo_loss).

The outline. Each step is a section below; `train`, near the end, runs them in a loop.
  Config              every setting, one field each (their defaults: the shipped tiny model's)
  Loading GLM-Image   the pipeline, the trained AR (LoRA or every weight), the frozen reference
  Step 1. Sample      G token grids per prompt, each token's log-prob     sample_groups (generate)
  Step 2. Decode      tokens -> pictures, by the frozen DiT               decode_images
  Step 3. Score       SSIM or -MSE to a target picture                    group_rewards
  Step 4. Advantages  the rewards z-scored within each group              group_advantages
  Step 5. Update      5a the trainer's log-probs, 5b the loss (grpo_loss), 5c mu updates (update:
                      cfg.mu optimizer steps on the same samples, cleanrl's update_epochs)
  The loop            steps 1-5, cfg.steps times                          train
  Editing             an addition: a source picture in the prompt
  main                the command line
Step 1 starts after the config and the loading (a hundred lines): a policy must exist to sample.
GRPO alone is about 210 lines: group_advantages (Step 4), grpo_loss with k3_kl, aggregate and
loss_metrics (5b), update with micro_batches and micro_batch_loss (5c), and train (the loop). Steps
1-3 are GLM-Image's: how its AR samples, how its DiT paints, how a picture scores.

Where this departs from the paper (pi here is p, the softmax of the AR's logits over the image
codes at the sampling temperature; q is p cut to top-k / top-p, what the sampler draws from;
pi_sampler is p as the sampler's own kernels computed it):
  - only the large grid's tokens (H/32 x W/32: 32x32 at 1024x1024, 3x3 at the tiny 96x96) are in
    the loss: the DiT paints from them. The AR first writes a preview grid, a fixed 16x16 thumbnail
    that conditions the large grid and is never painted. It is part of the action: leaving it out
    drops its A grad log pi term and its KL, a choice with a cost (the preview's part in the
    reward gets no credit, its drift no KL; the command line's --train-tokens all keeps them:
    helpers/variants.py);
  - the AR's 3D rotary positions are rebuilt for the trainer's forward (`rope_positions`), or the
    log-probs are several nats wrong;
  - sampler and trainer call one definition of the policy (`code_logprobs`); pi_old is the
    trainer's first forward of the step, so r = 1 at the first update by construction;
  - with top-p (the real model's preset) the sampler draws from its nucleus q, while p, the whole
    softmax, trains: the ratio, the KL and the loss are p's, and q != p is left uncorrected;
  - truncated importance weights pi_old / pi_sampler (TRL's, cut at sampler_cap) absorb the
    sampler's rounding (bf16 kernels on a GPU); on a CPU in float32 they are 1 within 1e-5. Both
    are p's here; TRL's pi_sampler is vLLM's processed q, so with top-p its weights also carry p/q.

  python grpo.py --prompts prompts.txt                          # the tiny GLM-Image, on a CPU
  python grpo.py --prompts examples/shapes.txt --reward shapes  # draw what the caption asks
  python grpo.py --prompts my_prompts.txt --model zai-org/GLM-Image   # the real model (GPU, bf16)
  python -m pytest -q test_grpo.py                              # a test for every function here

The command line runs these steps inside helpers/trainer.py (checks, checkpoints, logging, many
GPUs, a faster sampler), giving the numbers `train` gives (test_grpo.py::test_train). Copied alone,
with requirements.txt's packages, this file runs `train` from Python.
"""

import copy
import dataclasses
import math
import sys
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image


# ---- Config --------------------------------------------------------------------------------------

def arg(default, help: str):
    """A config field whose doc becomes its --help."""
    return dataclasses.field(default=default, metadata={"help": help})


@dataclasses.dataclass
class Config:  # a field per flag (--group-size ...); the defaults are the tiny model's
    # the algorithm: a group per prompt, its advantages, the clipped loss and the KL
    group_size: int = arg(8, "samples per prompt (G)")
    prompts_per_step: int = arg(2, "prompts (groups) per step")
    reward: str = arg("ssim=1,mse=0", "rewards and weights, e.g. ssim=1,ocr=0.5 (docs/rewards.md)")
    clip_eps: float = arg(0.2, "PPO clip: the ratio is clipped to [1 - eps, 1 + eps]")
    kl_beta: float = arg(0.1, "weight of the k3 KL to the frozen reference")
    mu: int = arg(2, "updates per batch of samples (cleanrl's update_epochs with one minibatch: "
                     "one optimizer step per epoch); the clip acts from the second update")
    lr: float = arg(1e-4, "AdamW learning rate")
    weight_decay: float = arg(0.01, "AdamW weight decay")
    max_grad_norm: float = arg(1.0, "gradient-norm clip")
    steps: int = arg(100, "optimizer steps")
    micro_batch_size: int = arg(0, "sequences per forward pass (0: a whole group)")
    lora_rank: int = arg(0, "LoRA rank (0: train every weight)")
    gradient_checkpointing: bool = arg(False, "recompute activations in backward")
    # sampling, as GLM-Image is deployed, and the sampler's rounding
    temperature: float = arg(0.9, "sampling temperature (GLM-Image: 0.9)")
    top_p: float = arg(1.0, "nucleus sampling: the fewest codes holding this much probability "
                            "(1: off)")
    top_k: int = arg(0, "sample from the k most likely codes only (0: off)")
    sampler_cap: float = arg(2.0, "truncated importance weights pi_old / pi_sampler: at most this")
    seed: int = arg(0, "seed of the AR sampling")
    # the model, the pictures, the data
    model: str = arg("tiny", "hub id, folder, tiny, tiny-edit (the command line also takes random: "
                             "the published configs, random weights)")
    revision: str = arg("", "the hub model's revision: a commit hash, branch or tag ('': its main)")
    height: int = arg(96, "image height")
    width: int = arg(96, "image width")
    num_inference_steps: int = arg(2, "DiT denoising steps")
    guidance_scale: float = arg(1.0, "DiT guidance")
    decode_seed: int = arg(0, "seed of the DiT latent noise (fixed per run)")
    prompts: str = arg("prompts.txt", "'prompt | target.png' lines, or .jsonl (docs/editing.md)")
    shuffle: bool = arg(False, "the prompts in a new order each epoch, drawn from --seed")


TINY = Path(__file__).resolve().parent / "tiny_glm_image"  # pre-trained by tools/train_tiny.py
# the tiny model and its editing sibling (tools/train_tiny_edit.py: an AR that edits, the same DiT)
TINY_MODELS = {"tiny": TINY, "tiny-edit": TINY.with_name("tiny_glm_image_edit")}


# ---- Loading GLM-Image ---------------------------------------------------------------------------

def load_glm_image(name: str, device: str = "cpu", dtype: torch.dtype = torch.float32,
                   revision: str = ""):
    """GlmImagePipeline from a hub id (at `revision`: a commit, branch or tag), a folder, or a
    name of TINY_MODELS, on `device`, with only the AR trainable."""
    from diffusers import GlmImagePipeline
    pipe = GlmImagePipeline.from_pretrained(TINY_MODELS.get(name, name), dtype=dtype,
                                            revision=revision or None)
    return only_ar_trains(pipe.to(device))


def only_ar_trains(pipe):
    """Freeze all but the AR (its vision tower and VQ only encode sources); eval, no dropout."""
    pipe.set_progress_bar_config(disable=True)
    ar = pipe.vision_language_encoder.eval()  # models built in code start in train mode
    frozen = (pipe.text_encoder, pipe.transformer, pipe.vae, ar.model.visual, ar.model.vqmodel)
    for module in frozen:
        module.requires_grad_(False).eval()
    disable_dropout(ar)
    return pipe


def disable_dropout(model) -> None:
    """Zero every dropout (GLM-Image's are 0): dropout in training only would make pi != pi_old."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        if isinstance(getattr(module, "attention_dropout", None), float):
            module.attention_dropout = 0.0


def trained_model(pipe, lora_rank: int, gradient_checkpointing: bool = False, seed: int = 0):
    """The AR as it trains: with LoRA (peft, rank `lora_rank`, dropout 0) on its language model's
    attention and MLP, injected in place (the pipeline samples with it; the A matrices from `seed`),
    else every weight of it; activations recomputed in backward if asked."""
    policy = pipe.vision_language_encoder
    if lora_rank:
        from peft import LoraConfig, get_peft_model  # only for LoRA
        projections = r"(self_attn\.(q|k|v|o)_proj|mlp\.(gate_up|down)_proj)"
        lora = LoraConfig(r=lora_rank, lora_alpha=lora_rank, lora_dropout=0.0,
                          target_modules=r".*language_model\.layers\.\d+\." + projections)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            policy = get_peft_model(policy, lora)
    if gradient_checkpointing:
        policy.activation_checkpointing_enable(
            activation_checkpointing_kwargs={"use_reentrant": False})
    return policy


def reference_model(policy, kl_beta: float):
    """The frozen KL reference: None when beta is 0 (no KL term); with LoRA the policy itself, whose
    adapter is switched off to read it (no copy); else a frozen copy of the initial weights."""
    if kl_beta == 0:
        return None
    if hasattr(policy, "disable_adapter"):
        return policy
    return copy.deepcopy(policy).requires_grad_(False).eval()


# ---- Step 1. Sample: a group of token grids per prompt, and their log-probs ----------------------

class Prompt(NamedTuple):  # one prompt's group, ready for the AR (group_prompt)
    inputs: dict  # input_ids, attention_mask (G, L), image_grid_thw (2G, 3), images_per_sample (G,)
    preview_hw: tuple[int, int]  # the grid the AR writes FIRST (h', w'); (0, 0) when editing
    large_hw: tuple[int, int]  # the grid it writes last (H/32, W/32): the only one the DiT sees
    source: "Source | None" = None  # a picture to edit (the Editing section), or None


class Rollout(NamedTuple):  # a group's samples (sample_groups)
    prompt: Prompt
    tokens: torch.Tensor  # (G, N) long codes: the preview grid, then the large grid
    q_logprobs: torch.Tensor  # (G, N) float32: each code's log-prob under q, what the draw used
    # (kept for the variants that train on q: helpers/variants.py; this file trains p)
    p_logprobs: torch.Tensor  # (G, N) float32: under p, the whole softmax (q = p without top-k/p)


def code_logprobs(logits: torch.Tensor, temperature: float, codebook_size: int, top_k: int = 0,
                  top_p: float = 1.0) -> torch.Tensor:
    """(..., V) AR logits -> (..., K) float32 log-probs over the K codes of the codebook:
    softmax(logits / T), cut to `top_k` / `top_p` and renormalised, -inf outside: the policy.
    Without top-k / top-p it is p, the whole softmax, which trains; with them q, what the sampler
    draws from. One definition: the sampler draws from it, the trainer scores it."""
    scores = logits[..., :codebook_size].float() / temperature  # ids >= K are never drawn
    if 0 < top_k < codebook_size:  # as transformers' TopKLogitsWarper
        kth_best = scores.topk(top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth_best, -math.inf)
    if top_p < 1.0:  # as TopPLogitsWarper: drop the least likely codes while their sum <= 1 - p
        ascending, order = scores.sort(dim=-1, stable=True)  # order[j]: the code in place j
        dropped = ascending.softmax(dim=-1).cumsum(dim=-1) <= 1 - top_p
        dropped[..., -1] = False  # the most likely code always stays
        # back to code order: code order[j] gets dropped[j]. Scores [2, 0, 1] sort to order
        # [1, 2, 0]; at p 0.75 place 0 goes (its share 0.09 <= 0.25), so code 1 does.
        dropped = torch.zeros_like(dropped).scatter(-1, order, dropped)
        scores = scores.masked_fill(dropped, -math.inf)
    return torch.log_softmax(scores, dim=-1)


def group_inputs(processor, prompt: str, group_size: int, height: int, width: int, device,
                 source: Image.Image | None = None) -> dict:
    """One prompt (and, to edit, a source picture) -> its AR inputs repeated G times (Prompt.inputs;
    editing: and the source's pixel_values), image_grid_thw a sample's rows together."""
    content = [{"type": "image", "image": source}] if source is not None else []
    one = processor.apply_chat_template(
        [[{"role": "user", "content": content + [{"type": "text", "text": prompt}]}]],
        tokenize=True, return_dict=True,
        processor_kwargs=dict(target_h=height, target_w=width, return_tensors="pt"))
    inputs = {k: one[k].repeat(group_size, 1).to(device)
              for k in ("input_ids", "attention_mask", "image_grid_thw")}
    inputs["images_per_sample"] = one["images_per_sample"].repeat(group_size).to(device)
    if source is not None:
        inputs["pixel_values"] = one["pixel_values"].to(device)
    return inputs


def group_prompt(pipe, prompt: str, group_size: int, height: int, width: int) -> Prompt:
    """One prompt -> its group's Prompt. The processor lists a sample's grids as [large, preview],
    but the AR WRITES the preview first: at 96x96 image_grid_thw [1, 3, 3], [1, 16, 16] means the
    16x16 preview, then the 3x3 large grid (N = 256 + 9 tokens)."""
    model = pipe.vision_language_encoder
    inputs = group_inputs(pipe.processor, prompt, group_size, height, width, model.device)
    large, preview = [tuple(row[1:]) for row in inputs["image_grid_thw"][:2].tolist()]
    return Prompt(inputs, preview_hw=preview, large_hw=large)


def rope_positions(input_ids: torch.Tensor, image_grid_thw: torch.Tensor, num_tokens: int,
                   image_start_id: int, image_end_id: int) -> torch.Tensor:
    """3D rotary positions (3, 1, L + N - 1) of an L-token prompt and its N tokens but the last, as
    GlmImageModel.get_rope_index gives generate: text is a ramp on all 3 axes; a grid h x w at p
    puts cell (row, col) at (p, p + row, p + col) and the ramp resumes at p + max(h, w). Generated
    grids come in REVERSE order of image_grid_thw (text-to-image: preview, then large). Example:
    a 5-token prompt, then a 2x3 preview and a 4x4 large grid (image_grid_thw [[1,4,4], [1,2,3]]):
        prompt  (0,0,0) (1,1,1) (2,2,2) (3,3,3) (4,4,4)
        preview (5,5,5) (5,5,6) (5,5,7) (5,6,5) (5,6,6) (5,6,7)        the ramp resumes at 5 + 3
        large   (8,8,8) (8,8,9) (8,8,10) (8,8,11) (8,9,8) ... (8,11,11)  (its last is never fed)
    Editing: each source image in the prompt (between an image start and an image end) is a grid
    too, in the order listed; the grids after them are the generated ones. (On a first read, skip
    the body: test_rope_positions checks it against transformers' own get_rope_index.)"""

    def ramp(p: int, n: int) -> torch.Tensor:  # (3, n): n text tokens from position p
        return torch.arange(p, p + n).expand(3, -1)

    def grid(p: int, h: int, w: int) -> torch.Tensor:  # (3, h*w): t = p, rows and columns from p
        rows, cols = torch.arange(h).repeat_interleave(w), torch.arange(w).repeat(h)
        return torch.stack([torch.full_like(rows, p), p + rows, p + cols])

    ids = input_ids.tolist()
    ends = [i for i, t in enumerate(ids) if t == image_end_id]  # only a source image is closed
    starts = [i + 1 for i, t in enumerate(ids) if t == image_start_id][:len(ends)]  # the last opens
    grids = [tuple(row[1:]) for row in image_grid_thw.tolist()]  # the generated image: not closed
    sources, generated = grids[:len(ends)], grids[len(ends):]
    positions, p, placed = [], 0, 0  # p: the next position; placed: prompt tokens given one
    for start, end, (h, w) in zip(starts, ends, sources, strict=True):
        text = start - placed  # the text before this source image, its image-start token included
        positions += [ramp(p, text), grid(p + text, h, w)]
        p += text + max(h, w)
        placed = end
    positions.append(ramp(p, len(ids) - placed))  # the rest of the prompt, its image-start last
    p += len(ids) - placed
    for h, w in reversed(generated):  # the generated grids: the preview first
        positions.append(grid(p, h, w))
        p += max(h, w)
    positions = torch.cat(positions, dim=1)[:, : len(ids) + num_tokens - 1]  # the last: never fed
    return positions[:, None, :].to(image_grid_thw.device)  # (3, 1, L + N - 1)


@torch.no_grad()
def generate(model, prompt: "Prompt", temperature: float, seed: int, top_k: int = 0,
             top_p: float = 1.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The AR's decode loop, in the shape of gpt-fast's generate.py (its functions `prefill` and
    `decode_one_token`): the prompt fed once, then N steps of one token each (logits ->
    code_logprobs -> draw -> feed), a KV cache holding the past. Returns (G, N) codes, their
    log-probs under q (what the draw used: top-k / top-p) and under p (the whole softmax). Needs
    `code_logprobs`, `rope_positions` and a `prompt` with .inputs, .preview_hw, .large_hw."""
    from transformers import DynamicCache
    ids = prompt.inputs["input_ids"]  # (G, L): one L-token prompt, G times
    G, L = ids.shape
    N = math.prod(prompt.preview_hw) + math.prod(prompt.large_hw)  # the tokens to draw
    K, V = model.config.vq_config.num_embeddings, model.lm_head.out_features
    grids = prompt.inputs["image_grid_thw"][:int(prompt.inputs["images_per_sample"][0])]
    positions = rope_positions(ids[0], grids, N, model.config.image_start_token_id,
                               model.config.image_end_token_id).expand(-1, G, -1)  # (3, G, L+N-1)
    generator = torch.Generator(ids.device).manual_seed(seed)
    cache = DynamicCache(config=model.config.text_config)
    fed, at = ids, slice(0, L)  # the prefill feeds the prompt; each step after it one token
    tokens, q_logprobs, p_logprobs = [], [], []  # each step's (G, 1)
    for t in range(N):
        logits = model(input_ids=fed, position_ids=positions[:, :, at], cache=cache,
                       logits_to_keep=1).logits[:, -1]  # (G, V): the next token's, cache updated
        q = code_logprobs(logits, temperature, K, top_k, top_p)  # (G, K): what the draw uses
        p = code_logprobs(logits, temperature, K)  # the whole softmax (= q without top-k / top-p)
        # torch.multinomial(q.exp(), 1) written as a race: code k wins with the largest q_k / E_k,
        # E_k ~ exponential(1), and P(k wins) = q_k (the Gumbel-max trick in exponential form). The
        # noise is drawn over all V ids and cut to K so that the random numbers are the ones
        # transformers' generate uses: same seed, same codes.
        noise = torch.empty(G, V, device=ids.device).exponential_(generator=generator)[:, :K]
        fed = (q.exp() / noise).argmax(dim=-1, keepdim=True)  # (G, 1): the drawn codes
        tokens.append(fed)
        q_logprobs.append(q.gather(-1, fed))
        p_logprobs.append(p.gather(-1, fed))
        at = slice(L + t, L + t + 1)  # the code just drawn is fed next, at its own position
    return torch.cat(tokens, dim=1), torch.cat(q_logprobs, dim=1), torch.cat(p_logprobs, dim=1)


def group_seed(run_seed: int, group_id: int) -> int:
    """The sampling seed of the group numbered `group_id` (over the whole run: step and prompt) in
    the run seeded `run_seed`. 1_000_003 exceeds any run's number of groups (steps x prompts a
    step), so runs of different seeds never share a group's seed."""
    return run_seed * 1_000_003 + group_id


@torch.no_grad()
def sample_groups(pipe, prompts: list[str], group_size: int, height: int, width: int,
                  temperature: float, seeds: list[int], top_k: int = 0, top_p: float = 1.0,
                  sources: list | None = None) -> list[Rollout]:
    """G samples for each of P prompts, group p drawn from seeds[p] by `generate` (to edit, a
    (3, H, W) source picture per prompt: `edit_prompt`, in the Editing section)."""
    model = pipe.vision_language_encoder.eval()  # no dropout: one distribution
    rollouts = []
    for text, seed, source in zip(prompts, seeds, sources or [None] * len(prompts), strict=True):
        if source is None:
            prompt = group_prompt(pipe, text, group_size, height, width)
        else:
            prompt = edit_prompt(pipe, text, group_size, height, width, source)
        tokens, q_logprobs, p_logprobs = generate(model, prompt, temperature, seed, top_k, top_p)
        rollouts.append(Rollout(prompt, tokens, q_logprobs, p_logprobs))
    return rollouts


# ---- Step 2. Decode: tokens to pictures ----------------------------------------------------------

def prior_ids(tokens: torch.Tensor, large_hw: tuple[int, int]) -> torch.Tensor:
    """(G, N) tokens -> (G, 4hw) the DiT's prior ids: the large grid upsampled 2x (nearest)."""
    G, (h, w) = tokens.shape[0], large_hw
    large = tokens[:, -h * w:].reshape(G, 1, h, w).float()  # the large grid: (G, 1, H/32, W/32)
    return F.interpolate(large, scale_factor=2, mode="nearest").long().reshape(G, -1)


@torch.no_grad()
def decode_images(pipe, prompt: str, tokens: torch.Tensor, large_hw: tuple[int, int], height: int,
                  width: int, num_inference_steps: int, seed: int, guidance_scale: float = 1.5,
                  source: "Source | None" = None) -> torch.Tensor:
    """(G, N) tokens -> (G, 3, H, W) float32 pictures in [0, 1] by the pipeline (prior ids, DiT,
    VAE), the group from one latent noise: they differ by their tokens only, and with one noise
    for the whole run (--decode-seed) the reward is a function of the tokens alone, the AR's
    action (the cost: the policy may fit that one noise; evaluate with other seeds). A run passes
    its --guidance-scale (1.0 for the tiny model; above 1 the DiT's classifier-free guidance);
    the default 1.5 is the one tools/make_targets.py made the targets with, calling it bare. (To
    edit, the source joins the pipeline's inputs: `edit_inputs`, in the Editing section.)"""
    G, device, dtype = tokens.shape[0], pipe.transformer.device, pipe.transformer.dtype
    prior = prior_ids(tokens, large_hw)  # (G, 4hw) at H/16
    embeds, negative = pipe.encode_prompt(prompt, do_classifier_free_guidance=guidance_scale > 1,
                                          device=device, dtype=dtype)
    if negative is not None:
        negative = negative.repeat(G, 1, 1)
    f, generator = pipe.vae_scale_factor, torch.Generator("cpu").manual_seed(seed)
    shape = (1, pipe.transformer.config.in_channels, height // f, width // f)  # one noise for all G
    latents = torch.randn(shape, generator=generator).to(device, dtype).repeat(G, 1, 1, 1)
    edit = edit_inputs(source, G, device) if source is not None else {}
    images = pipe(prompt_embeds=embeds.repeat(G, 1, 1), negative_prompt_embeds=negative,
                  prior_token_ids=prior, latents=latents, height=height, width=width,
                  num_inference_steps=num_inference_steps, guidance_scale=guidance_scale,
                  output_type="pt", **edit).images
    return images.float().clamp(0, 1)  # (G, 3, H, W)


# ---- Step 3. Score: rewards ----------------------------------------------------------------------
# A reward: any fn(images, example) -> (G,) float, higher is better; images (G, 3, H, W) float32 in
# [0, 1], example a prompts line ("target": a (3, H, W) tensor in [0, 1], or None).

def mse_reward(images: torch.Tensor, example: dict) -> torch.Tensor:
    """(G, 3, H, W) in [0, 1], example["target"] (3, H, W) -> (G,) -MSE, in [-1, 0]."""
    return -((images - example["target"]) ** 2).mean(dim=(1, 2, 3))


def ssim_reward(images: torch.Tensor, example: dict) -> torch.Tensor:
    """(G, 3, H, W) in [0, 1], example["target"] (3, H, W) -> (G,) SSIM (Wang et al. 2004) in
    [-1, 1]: 11-tap Gaussian window (sigma 1.5), K1 0.01, K2 0.03, valid windows."""
    C1, C2 = 0.01 ** 2, 0.03 ** 2
    g = torch.exp(-((torch.arange(11, dtype=torch.float32) - 5) ** 2) / (2 * 1.5 ** 2))
    g = (g / g.sum()).to(images.device)
    window = (g[:, None] * g[None, :]).expand(3, 1, 11, 11)  # (3, 1, 11, 11), one per channel

    def blur(x: torch.Tensor) -> torch.Tensor:  # (G, 3, H, W) -> (G, 3, H-10, W-10) local means
        return F.conv2d(x, window, groups=3)

    x, y = images.float(), example["target"].float().expand_as(images)  # (G, 3, H, W)
    mu_x, mu_y = blur(x), blur(y)
    var_x = blur(x * x) - mu_x ** 2
    var_y = blur(y * y) - mu_y ** 2
    cov = blur(x * y) - mu_x * mu_y
    ssim_map = (((2 * mu_x * mu_y + C1) * (2 * cov + C2))
                / ((mu_x ** 2 + mu_y ** 2 + C1) * (var_x + var_y + C2)))
    return ssim_map.mean(dim=(1, 2, 3))


mse_reward.needs = ("target",)  # the fields a reward needs in every example (checked at the start)
ssim_reward.needs = ("target",)
REWARDS = {"ssim": ssim_reward, "mse": mse_reward}  # helpers/rewards.py has more: shapes, ocr, ...


def reward_functions(spec: str, table: dict = REWARDS) -> dict[str, tuple]:
    """'ssim=1,mse=0' (a name alone weighs 1) -> {name: (fn, weight)} of the rewards in `table`."""
    rewards = {}
    for part in spec.split(","):
        name, _, weight = part.partition("=")
        rewards[name.strip()] = (table[name.strip()], float(weight or 1))
    return rewards


def group_rewards(images: list[torch.Tensor], examples: list[dict], rewards: dict[str, tuple]
                  ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """P groups of (G, 3, H, W) images and their examples, rewards {name: (fn, weight)} -> the
    (P, G) weighted sum and each reward's (P, G). A reward of weight 0 is computed and returned
    (logged) but is not in the sum: even a NaN of it (0 * nan is nan) leaves the sum alone."""
    each = {}
    for name, (fn, _) in rewards.items():
        values = [fn(group, example).float().reshape(-1).to(group.device)
                  for group, example in zip(images, examples, strict=True)]
        each[name] = torch.stack(values)  # (P, G)
    total = torch.zeros_like(next(iter(each.values())))
    for name, (_, weight) in rewards.items():
        if weight != 0:
            total = total + weight * each[name]
    return total, each


# ---- Step 4. Advantages --------------------------------------------------------------------------

def group_advantages(rewards: torch.Tensor, rel_tol: float = 1e-6) -> torch.Tensor:
    """(P, G) or (G,) rewards R -> advantages A_i = (R_i - mean(R)) / std(R) within each group. The
    std is the population's (/ G; TRL divides by the sample std + 1e-4): where the spread is well
    above 1e-4 these are sqrt(G / (G - 1)) times TRL's (1.07x at G = 8); a spread near 1e-4 TRL
    shrinks, this does not. A group whose rewards do not spread (std at most rel_tol times its
    largest |R|: equal up to rounding) gets zeros: it has nothing to teach; so does a group with a
    NaN or inf reward (`train` leaves it out of the update)."""
    mean = rewards.mean(dim=-1, keepdim=True)
    std = rewards.std(dim=-1, unbiased=False, keepdim=True)
    spread = std > rel_tol * rewards.abs().amax(dim=-1, keepdim=True)  # False where a reward is NaN
    z = (rewards - mean) / std.clamp_min(torch.finfo(std.dtype).tiny)
    return torch.where(spread, z, torch.zeros_like(rewards))


# ---- Step 5. Update. 5a: the trainer's log-probs of the sampled tokens ---------------------------

def token_logits(model, inputs: dict, tokens: torch.Tensor) -> torch.Tensor:
    """(S, N) tokens, S samples of ONE prompt (its group's inputs) -> (S, N, V) logits that predict
    each of them: one teacher-forced forward at generation's positions (rope_positions, not the
    text ramp that a plain forward would use: several nats off on a peaked model)."""
    ids = inputs["input_ids"]
    S, N = tokens.shape
    if not (ids == ids[:1]).all():
        raise ValueError("token_logits scores one prompt's samples: call it once per group")
    input_ids = torch.cat([ids[:1].expand(S, -1), tokens[:, :-1]], dim=1)  # (S, L+N-1)
    grids = inputs["image_grid_thw"][:int(inputs["images_per_sample"][0])]  # a sample's grid rows
    positions = rope_positions(ids[0], grids, N, model.config.image_start_token_id,
                               model.config.image_end_token_id).expand(-1, S, -1)
    return model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),  # no padding
                 position_ids=positions, use_cache=False, logits_to_keep=N).logits  # (S, N, V)


def logprob_of(distribution: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """(S, N, K) log-probs of every code, (S, N) tokens -> (S, N) each token's log-prob."""
    return distribution.gather(-1, tokens[..., None]).squeeze(-1)


def token_logprobs(model, inputs: dict, tokens: torch.Tensor, temperature: float, top_k: int = 0,
                   top_p: float = 1.0) -> torch.Tensor:
    """(S, N) float32 log-probs of `tokens` from one teacher-forced forward, under code_logprobs.
    Differentiable."""
    K = model.config.vq_config.num_embeddings
    logits = token_logits(model, inputs, tokens)  # (S, N, V)
    return logprob_of(code_logprobs(logits, temperature, K, top_k, top_p), tokens)


# ---- 5b: the loss --------------------------------------------------------------------------------

def k3_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor | None) -> torch.Tensor:
    """(S, n) log-probs of the drawn tokens under pi and the reference -> (S, n) Schulman's k3
    estimator of KL(pi || ref), exp(d) - d - 1 with d = ref_logprobs - logprobs; zeros without a
    reference. Schulman: >= 0, unbiased when the tokens are drawn from pi itself. Here they are the
    sampler's (pi_old's; with top-p its nucleus q's, not p's), and at mu > 1 pi has moved since.
    Per token, given its prefix, in expectation under pi its gradient is KL(ref || pi)'s: the
    gradient is (1 - ref / pi) grad log pi, and E_pi[(ref / pi) grad log pi] = sum ref grad log pi.
    Both KLs are 0 only at pi = ref, so the term pulls pi toward ref either way (as the paper's and
    TRL's do); its value reads KL(pi || ref), its pull is the forward KL's. d is capped at 20 so
    that exp stays finite (tools/bench_kl_cap.py); past the cap (pi gives the token 20 nats less
    log-prob than the reference) the KL's gradient is 0."""
    if ref_logprobs is None:
        return torch.zeros_like(logprobs)
    d = (ref_logprobs - logprobs).clamp(max=20.0)  # exp(20) stays finite; below, no cap
    return torch.exp(d) - d - 1  # >= 0 up to rounding (-6e-8); a clamp would zero its gradient


def aggregate(per_token: torch.Tensor, mask: torch.Tensor | None = None, loss_type: str = "grpo",
              num_items_in_batch: float | None = None,
              max_completion_length: int | None = None) -> torch.Tensor:
    """(S, n) per-token values -> one number, as TRL's GRPOTrainer aggregates its loss. `mask`
    (S, n) 0/1 marks each sequence's real tokens (default: all n). loss_type:
      "grpo"     the paper's: each sequence's token mean, then the mean over the S sequences (a
                 short answer's tokens weigh more: the length bias Dr. GRPO points out);
      "bnpo"     the mean over every real token of the S sequences;
      "dapo"     TRL's default: the token sum over num_items_in_batch, the loss tokens of the whole
                 accumulated batch per process (TRL's num_items_in_batch, counted over all
                 processes, / num_processes; default: these S sequences' own, as bnpo);
      "dr_grpo"  the token sum over S times max_completion_length (default: the padded length n).
    GLM-Image's sequences all fill the same grids, so every type gives the plain mean here (with
    its default normaliser). Raises ValueError for another loss_type."""
    if mask is None:
        mask = torch.ones_like(per_token)
    masked = per_token * mask  # (S, n): the padding's values are 0
    if loss_type == "grpo":
        return (masked.sum(dim=1) / mask.sum(dim=1).clamp(min=1)).mean()
    if loss_type == "bnpo" or (loss_type == "dapo" and num_items_in_batch is None):
        return masked.sum() / mask.sum().clamp(min=1)
    if loss_type == "dapo":
        return masked.sum() / num_items_in_batch
    if loss_type == "dr_grpo":
        return masked.sum() / (mask.shape[0] * (max_completion_length or mask.shape[1]))
    raise ValueError(f"loss_type {loss_type!r}: use grpo, bnpo, dapo or dr_grpo")


@torch.no_grad()
def loss_metrics(ratio: torch.Tensor, advantages: torch.Tensor, clip_eps: float | torch.Tensor,
                 kl: torch.Tensor, policy_loss: torch.Tensor,
                 mask: torch.Tensor | None = None) -> dict:
    """The loss's metrics, from its (S, n) ratios and k3 KLs, its (S, 1) or (S, n) advantages and
    its aggregated policy term: policy_loss; kl, the tokens' mean; clip_frac, the share of tokens
    whose gradient the clip stops (r > 1 + eps with A > 0, r < 1 - eps with A < 0; cleanrl's
    clipfracs count every token with |r - 1| > eps); the ratio's min, mean and max. Over the
    mask's real tokens when one is given."""
    above, below = ratio > 1 + clip_eps, ratio < 1 - clip_eps
    clipped = (above & (advantages > 0)) | (below & (advantages < 0))
    if mask is not None:  # the answers' tokens only, not their padding: (T,) each
        real = mask.bool()
        kl, clipped, ratio = kl[real], clipped[real], ratio[real]
    return {"policy_loss": policy_loss.item(),
            "kl": kl.mean().clamp_min(0).item(), "clip_frac": clipped.float().mean().item(),
            "ratio_min": ratio.min().item(), "ratio_mean": ratio.mean().item(),
            "ratio_max": ratio.max().item()}


def grpo_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, ref_logprobs: torch.Tensor | None,
              advantages: torch.Tensor, clip_eps: float | torch.Tensor,
              kl_beta: float | torch.Tensor, weights: float | torch.Tensor = 1.0,
              mask: torch.Tensor | None = None, loss_type: str = "grpo",
              num_items_in_batch: float | None = None,
              max_completion_length: int | None = None) -> tuple[torch.Tensor, dict]:
    """The GRPO loss of S sampled sequences of n tokens, from their (S, n) log-probs to a scalar:

        loss = -1/S sum_i 1/n sum_t [ w_it min(r_it A_i, clip(r_it, 1 - eps, 1 + eps) A_i)
                                      - beta KL_it ]

    r_it = exp(logprobs - old_logprobs); A_i = advantages, (S,); w_it the sampler's truncated
    importance weights (importance_weights; 1 for an exact sampler); KL_it the k3 estimator of
    KL(pi || ref) (k3_kl), 0 without a reference. A, eps, beta and w may also be tensors that
    broadcast to (S, n): one per sample or token. Returns the loss, differentiable in logprobs,
    and its metrics (loss_metrics).

    A copier's note: copy k3_kl, aggregate and loss_metrics with it; the 1/S 1/n above is
    aggregate's "grpo", the one `update` uses (it passes no mask: every sequence here is full). For
    an LLM, whose answers differ in length, pass the (S, n) 0/1 padding `mask` and pick TRL's
    loss_type (with its num_items_in_batch or max_completion_length); a "dapo" over
    num_items_in_batch already divides by the accumulated batch, so do not also weigh it by
    `update`'s share."""
    A = advantages.reshape(len(advantages), -1).to(logprobs)  # (S, 1): A_i on each of its tokens
    ratio = torch.exp(logprobs - old_logprobs)  # (S, n)
    clipped_ratio = torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps)
    surrogate = torch.min(ratio * A, clipped_ratio * A)  # the pessimistic bound of PPO
    kl = k3_kl(logprobs, ref_logprobs)  # (S, n)
    per_token = weights * surrogate - kl_beta * kl  # (S, n)
    loss = -aggregate(per_token, mask, loss_type, num_items_in_batch, max_completion_length)
    with torch.no_grad():  # the policy term alone, aggregated as the loss is
        policy_loss = -aggregate((weights * surrogate).expand_as(ratio), mask, loss_type,
                                 num_items_in_batch, max_completion_length)
    return loss, loss_metrics(ratio, A, clip_eps, kl, policy_loss, mask)


def importance_weights(old_logprobs: torch.Tensor, sampler_logprobs: torch.Tensor,
                       cap: float = 2.0) -> torch.Tensor:
    """Truncated importance weights (TIS; TRL's importance-sampling correction in its
    token_truncate mode, where TRL's default is sequence_mask at 3):
    (S, T) log-probs of the drawn tokens under the trained distribution as the trainer computes
    them (pi_old) and as the sampler did (its kernels, bf16 on a GPU) -> (S, T) weights
    pi_old / pi_sampler, cut to `cap`. An exact sampler gets 1 (float32: 1 +- 1e-5). Not
    differentiable: a weight, not a term of the policy. Both are p's, so the weights read the
    kernels' drift alone; TRL divides by vLLM's processed log-probs (q: after top-k / top-p), so
    with top-p its weights also hold p / q, the nucleus' mass (docs/real_model.md)."""
    ratio = torch.exp((old_logprobs - sampler_logprobs).clamp(max=20.0)).detach()
    return ratio.clamp(max=cap)


# ---- 5c: mu updates, a micro-batch at a time -----------------------------------------------------

class MicroBatch(NamedTuple):  # some of one group's samples: what one forward pass trains on
    inputs: dict  # its prompt's AR inputs (the group's)
    tokens: torch.Tensor  # (mb, N) the sampled codes
    sampler_logprobs: torch.Tensor  # (mb, N): their log-probs under p as the sampler computed them
    advantages: torch.Tensor  # (mb,)
    n_preview: int  # the preview grid's tokens, first in `tokens` (0 when editing): not in the loss


def micro_batches(rollouts: list[Rollout], advantages: torch.Tensor, size: int) -> list[MicroBatch]:
    """P rollouts and their (P, G) advantages -> MicroBatches of `size` rows, a group's in order."""
    batches = []
    for rollout, A in zip(rollouts, advantages, strict=True):  # A: the group's (G,)
        for start in range(0, len(A), size):
            rows = slice(start, start + size)
            batches.append(MicroBatch(
                inputs=rollout.prompt.inputs, tokens=rollout.tokens[rows],
                sampler_logprobs=rollout.p_logprobs[rows], advantages=A[rows],
                n_preview=math.prod(rollout.prompt.preview_hw)))
    return batches


@torch.no_grad()
def reference_logprobs(ref_model, mb: MicroBatch, temperature: float) -> torch.Tensor | None:
    """(mb, N) log-probs of a micro-batch's tokens under the frozen reference; None without one
    (beta 0). With LoRA the reference is the policy with its adapter switched off."""
    if ref_model is None:
        return None
    if hasattr(ref_model, "disable_adapter"):
        with ref_model.disable_adapter():
            return token_logprobs(ref_model, mb.inputs, mb.tokens, temperature)
    return token_logprobs(ref_model, mb.inputs, mb.tokens, temperature)


def micro_batch_loss(distribution: torch.Tensor, mb: MicroBatch, old_logprobs: torch.Tensor,
                     ref_logprobs: torch.Tensor | None, clip_eps: float | torch.Tensor,
                     kl_beta: float | torch.Tensor, sampler_cap: float = 2.0,
                     weights: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
    """A micro-batch's GRPO loss: (mb, N, K) log-probs of pi_theta (code_logprobs of its logits,
    differentiable), (mb, N) pi_old's and the reference's of the drawn tokens -> grpo_loss on the
    large grid, the tokens the DiT sees, with the truncated importance weights (or `weights`,
    (mb, N)); and its metrics."""
    logprobs = logprob_of(distribution, mb.tokens)  # (mb, N) log pi_theta of the drawn codes
    if weights is None:
        weights = importance_weights(old_logprobs, mb.sampler_logprobs, sampler_cap)  # (mb, N)
    large = slice(mb.n_preview, None)  # the preview: sampled, conditioning, never painted
    if ref_logprobs is not None:
        ref_logprobs = ref_logprobs[:, large]
    loss, metrics = grpo_loss(logprobs[:, large], old_logprobs[:, large], ref_logprobs,
                              mb.advantages, clip_eps, kl_beta, weights[:, large])
    return loss, {"loss": loss.item(), **metrics}


def update(policy, optimizer, batches: list[MicroBatch], ref_model, cfg: Config) -> dict:
    """Step 5 on one screen: cfg.mu updates of the policy on one step's micro-batches (cleanrl's
    update_epochs), each one optimizer step on the gradient accumulated over all micro-batches ->
    the last update's metrics (the ratio's extremes over every update). Raises ValueError for
    cfg.mu < 1."""
    if cfg.mu < 1:
        raise ValueError(f"mu {cfg.mu}: update_epochs is at least 1")
    # transformers checkpoints in train mode only; with dropout 0 (disable_dropout) both modes
    # compute the same policy, and eval mode is the sampler's
    policy.train(cfg.gradient_checkpointing)
    K = policy.config.vq_config.num_embeddings
    ref_logprobs = [reference_logprobs(ref_model, mb, cfg.temperature) for mb in batches]
    # pi_old: the first update's own log-probs, detached; not the sampler's, which only feed the
    # importance weights (another computation of p: their ratio is the sampler's rounding)
    old_logprobs = [None] * len(batches)
    n_rows = sum(len(mb.tokens) for mb in batches)  # the loss is a mean over the step's sequences
    ratio_min, ratio_max, skipped = math.inf, -math.inf, 0
    for epoch in range(cfg.mu):  # update_epochs over the same samples
        optimizer.zero_grad(set_to_none=True)
        parts = []  # each micro-batch's (metrics, share of the mean)
        for k, mb in enumerate(batches):  # gradient accumulation: a forward and backward each
            logits = token_logits(policy, mb.inputs, mb.tokens)  # (mb, N, V), with grad
            distribution = code_logprobs(logits, cfg.temperature, K)  # log pi_theta over the codes
            if epoch == 0:  # no weight has moved since sampling (the optimizer steps after the
                # last micro-batch): pi_theta IS pi_old, and r = 1
                old_logprobs[k] = logprob_of(distribution, mb.tokens).detach()
            loss, metrics = micro_batch_loss(distribution, mb, old_logprobs[k], ref_logprobs[k],
                                             cfg.clip_eps, cfg.kl_beta, cfg.sampler_cap)
            share = len(mb.tokens) / n_rows  # its sequences' share of the step's mean
            (loss * share).backward()  # the sum over micro-batches is the whole step's gradient
            parts.append((metrics, share))
            ratio_min = min(ratio_min, metrics["ratio_min"])
            ratio_max = max(ratio_max, metrics["ratio_max"])
        params = [p for group in optimizer.param_groups for p in group["params"]]
        grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm).item()
        if math.isfinite(grad_norm) and all(math.isfinite(m["loss"]) for m, _ in parts):
            optimizer.step()
        else:  # a NaN or inf never reaches the weights
            optimizer.zero_grad(set_to_none=True)
            skipped += 1
    metrics = {key: sum(m[key] * share for m, share in parts) for key in parts[0][0]}
    return metrics | {"ratio_min": ratio_min, "ratio_max": ratio_max, "grad_norm": grad_norm,
                      "skipped": skipped, "lr": optimizer.param_groups[0]["lr"]}


# ---- The loop: steps 1-5, a step at a time -------------------------------------------------------

def example_index(group: int, n_examples: int, seed: int, shuffle: bool) -> int:
    """The example the group numbered `group` trains on: epoch group // n goes through the n
    examples in the file's order, or with `shuffle` in a permutation drawn from (seed, epoch)."""
    epoch, position = divmod(group, n_examples)
    if not shuffle:
        return position
    generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(n_examples, generator=generator)[position].item()


def read_examples(path: str, height: int, width: int) -> list[dict]:
    """A prompts file of 'prompt | target.png' lines (a prompt alone: no target; target paths
    relative to the file) -> [{"prompt", "target": (3, H, W) float32 in [0, 1] or None}], each
    target resized (bicubic) to H x W. (The command line reads more: JSON Lines, sources to edit,
    any image a viewer shows: helpers/user_input.py.)"""
    examples = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        if not line.strip() or line.strip().startswith("#"):
            continue
        prompt, bar, target = (part.strip() for part in line.rpartition("|"))
        if not bar:
            prompt, target = target, ""
        image = None
        if target:
            image = Image.open(Path(path).parent / target).convert("RGB")
            pixels = np.asarray(image, np.float32) / 255  # (h, w, 3) in [0, 1]
            if pixels.shape[:2] != (height, width):  # per channel in float, as the command line
                channels = [Image.fromarray(pixels[..., c], "F").resize((width, height),
                                                                         Image.BICUBIC)
                            for c in range(3)]
                pixels = np.clip(np.stack([np.asarray(c) for c in channels], axis=-1), 0, 1)
            image = torch.from_numpy(np.ascontiguousarray(pixels)).permute(2, 0, 1).contiguous()
        examples.append({"prompt": prompt, "target": image})
    return examples


def train(cfg: Config, pipe, examples: list[dict]) -> list[dict]:
    """GRPO's loop: cfg.steps steps, each on the next cfg.prompts_per_step `examples`
    (read_examples' dicts: "prompt", "target"), rewarded by cfg.reward -> each step's metrics. The
    pipeline's AR trains in place. `main` runs these steps inside helpers/trainer.py, with the same
    numbers in one process (test_grpo.py::test_train)."""
    policy = trained_model(pipe, cfg.lora_rank, cfg.gradient_checkpointing, cfg.seed)
    ref_model = reference_model(policy, cfg.kl_beta)  # before any update: the initial weights
    optimizer = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=cfg.lr,
                                  weight_decay=cfg.weight_decay)
    rewards = reward_functions(cfg.reward)
    history = []
    for step in range(cfg.steps):
        P = cfg.prompts_per_step
        groups = [step * P + j for j in range(P)]  # numbered over the run
        batch = [examples[example_index(g, len(examples), cfg.seed, cfg.shuffle)] for g in groups]
        rollouts = sample_groups(  # 1. sample a group of G token grids per prompt
            pipe, [ex["prompt"] for ex in batch], cfg.group_size, cfg.height, cfg.width,
            cfg.temperature, [group_seed(cfg.seed, g) for g in groups], cfg.top_k, cfg.top_p,
            [ex.get("source") for ex in batch])
        images = [decode_images(  # 2. decode them to pictures, a group from one noise
            pipe, ex["prompt"], rollout.tokens, rollout.prompt.large_hw, cfg.height, cfg.width,
            cfg.num_inference_steps, cfg.decode_seed, cfg.guidance_scale, rollout.prompt.source)
            for ex, rollout in zip(batch, rollouts)]
        reward, _ = group_rewards(images, batch, rewards)  # 3. score: (P, G)
        advantages = group_advantages(reward)  # 4. z-scores within each group
        finite = reward.isfinite().all(dim=-1)  # a group with a NaN or inf reward leaves the step
        kept = [rollout for rollout, keep in zip(rollouts, finite) if keep]
        if not kept:  # no update: the step's line says so, with NaN where a value would be
            history.append({"step": step + 1, "reward_mean": math.nan, "loss": math.nan,
                            "skipped": cfg.mu})
            continue
        batches = micro_batches(kept, advantages[finite], cfg.micro_batch_size or cfg.group_size)
        metrics = update(policy, optimizer, batches, ref_model, cfg)  # 5. the clipped update
        history.append({"step": step + 1, "reward_mean": reward[finite].mean().item(), **metrics})
    return history


# ---- Editing: a source picture in the prompt (an addition; text-to-image reads without it) -------

class Source(NamedTuple):
    image: Image.Image  # the picture being edited, as the DiT's VAE sees it
    codes: torch.Tensor  # (h_s * w_s,) long, its VQ codes from the AR's vision tower
    grid_hw: tuple[int, int]  # (h_s, w_s) = its size / 32


def to_pil(image: torch.Tensor) -> Image.Image:
    """(3, H, W) float in [0, 1] -> PIL (exact for 8-bit images)."""
    array = (image.float().clamp(0, 1).permute(1, 2, 0).cpu().numpy() * 255).round()
    return Image.fromarray(array.astype(np.uint8))


def edit_prompt(pipe, prompt: str, group_size: int, height: int, width: int,
                source: torch.Tensor) -> Prompt:
    """One instruction and the (3, H, W) picture it edits -> its group's Prompt: the source is in
    the AR's prompt (as VQ codes: encode_source) and the AR writes the large grid only."""
    model, image = pipe.vision_language_encoder, to_pil(source)
    inputs = group_inputs(pipe.processor, prompt, group_size, height, width, model.device, image)
    large = tuple(inputs["image_grid_thw"][1].tolist()[1:])  # a sample's rows: [source, large]
    inputs, encoded = encode_source(model, inputs, image)
    return Prompt(inputs, preview_hw=(0, 0), large_hw=large, source=encoded)


@torch.no_grad()
def encode_source(model, inputs: dict, source: Image.Image) -> tuple[dict, Source]:
    """The source's VQ codes written into input_ids in place of its placeholders, ONCE per group (as
    GlmImageModel.forward does with pixel_values): sampler and trainer see the same tokens."""
    core, grid = model.model, inputs["image_grid_thw"][:1]  # (1, 3): the source row of sample 0
    features = core.get_image_features(inputs["pixel_values"], grid, return_dict=True).pooler_output
    codes = core.get_image_tokens(features).view(-1)  # (h_s * w_s,)
    ids = inputs["input_ids"]
    filled = ids.masked_scatter(ids == model.config.image_token_id, codes.repeat(ids.shape[0]))
    inputs = {k: v for k, v in inputs.items() if k != "pixel_values"} | {"input_ids": filled}
    _, h, w = grid[0].tolist()
    if (32 * h, 32 * w) != (source.height, source.width):  # the DiT needs the source at size / 32
        raise ValueError(f"the processor made a {h}x{w} token grid of a {source.width}x"
                         f"{source.height} source; the DiT needs size / 32: resize the sources")
    return inputs, Source(source, codes, (h, w))


def edit_inputs(source: Source, group_size: int, device) -> dict:
    """The pipeline's inputs for the source of an edit, one copy per sample (its batch is the
    group): the picture, its prior ids (the codes upsampled 2x, as prior_ids) and their grid."""
    hs, ws = source.grid_hw
    codes = prior_ids(source.codes[None], source.grid_hw)[0].to(device)
    grid = torch.tensor([[1, 2 * hs, 2 * ws]], device=device)
    return dict(image=[[source.image]] * group_size, prior_token_image_ids=[codes] * group_size,
                source_image_grid_thw=[grid] * group_size)


# ---- main: the command line --------------------------------------------------------------------

def main(argv: list[str] | None = None) -> dict:
    """`python grpo.py --prompts ...`: `train`'s steps inside the full trainer, helpers/trainer.py
    (the checks, torchrun, checkpoints, logging, evaluation, the variants of the algorithm)."""
    try:
        from helpers import trainer
    except ImportError:  # grpo.py copied alone (or beside another project's helpers)
        raise SystemExit("grpo.py: the command line needs helpers/ beside grpo.py; copied alone, "
                         "run train(Config(...), load_glm_image(...), read_examples(...)) from "
                         "Python") from None
    return trainer.main(sys.modules[__name__], argv)


if __name__ == "__main__":
    main()
