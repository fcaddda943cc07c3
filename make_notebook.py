"""Build walkthrough.ipynb from the cells below and execute it top to bottom, saving the outputs.

    python make_notebook.py              # build + execute (about a minute on 2 CPU cores)
    python make_notebook.py --no-execute # build only, no outputs

The notebook imports everything from grpo.py; edit the cells here, not the .ipynb, and re-run this script
so the committed notebook always comes from one clean run.
"""

import argparse
import sys
import textwrap
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient

HERE = Path(__file__).resolve().parent
NOTEBOOK = HERE / "walkthrough.ipynb"
CELLS = []


def md(text: str) -> None:
    CELLS.append(nbformat.v4.new_markdown_cell(textwrap.dedent(text).strip()))


def code(text: str, tag: str | None = None) -> None:
    cell = nbformat.v4.new_code_cell(textwrap.dedent(text).strip())
    if tag:  # test_notebook.py finds the cells it checks by tag
        cell.metadata["tags"] = [tag]
    CELLS.append(cell)


# ---- 0. Intro -----------------------------------------------------------------------------------

md(r"""
# GRPO on GLM-Image, one step at a time

This notebook walks through one GRPO step on [GLM-Image](https://huggingface.co/zai-org/GLM-Image) in the
same order as `grpo.py`, then runs a short training. Every function it calls comes from `grpo.py`; the
notebook only adds plots. It uses the **tiny GLM-Image built in code** (random weights, the real
`transformers` / `diffusers` classes), so it runs top to bottom on a 2-core CPU in about a minute.

GLM-Image draws in two stages: an autoregressive model (the **AR**, 9B in the real model) writes a grid
of visual tokens, and a diffusion transformer (the **DiT**) paints pixels conditioned on them. GRPO
trains the AR. For a prompt $q$ it samples a group of $G$ token sequences $o_1, \dots, o_G$, decodes and
scores them ($R_i$), and maximises

$$
J(\theta) = \frac{1}{G}\sum_{i=1}^{G} \frac{1}{|o_i|}\sum_{t=1}^{|o_i|}
\Big[\min\big(r_{i,t} A_i,\ \mathrm{clip}(r_{i,t}, 1-\varepsilon, 1+\varepsilon) A_i\big) - \beta\, \mathrm{KL}_{i,t}\Big],
\qquad r_{i,t} = \frac{\pi_\theta(o_{i,t} \mid q, o_{i,<t})}{\pi_{\theta_\text{old}}(o_{i,t} \mid q, o_{i,<t})}
$$

with the group-relative advantage $A_i = (R_i - \mathrm{mean}(R)) / \mathrm{std}(R)$ and the k3 estimator of
the KL to a frozen reference.

| section | `grpo.py` |
|---|---|
| 1. Load the model, a prompt and its target | `load_glm_image`, `read_prompts`, `load_target` |
| 2. The prompt as the AR sees it | `group_inputs`, `rope_positions` |
| 3. Sample and decode one group | `sample_group`, `decode_images` |
| 4. Rewards | `mse_reward`, `ssim_reward`, `group_rewards`, `image_grid` |
| 5. Advantages | `group_advantages` |
| 6. The objective | `grpo_loss` |
| 7. The log-prob pitfall, live | `token_logprobs`, `code_logprobs` |
| 8. A short training run | `main` |
| 9. The real model | |
""")

code("""
%matplotlib inline
import contextlib
import dataclasses
import io
import json
import shutil
import tempfile
import warnings
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import torch

import grpo

warnings.filterwarnings("ignore", message="IProgress not found")  # tqdm's note about notebook widgets
torch.manual_seed(0)  # every sampler and decoder below also gets its own explicit seed
torch.set_num_threads(1)  # the tiny model is too small to gain from threads, and one thread never stalls on a busy CPU
plt.rcParams.update({"figure.dpi": 80, "font.size": 9, "axes.titlesize": 9})

cfg = grpo.parse_config(["--model", "tiny"])  # the defaults grpo.py uses for the tiny model
H, W, G, T = cfg.height, cfg.width, cfg.group_size, cfg.temperature
print(f"image {H}x{W}, group size G={G}, temperature T={T}, clip eps={cfg.clip_eps}, "
      f"DiT steps={cfg.num_inference_steps}, reward '{cfg.reward}'")


def as_hwc(image: torch.Tensor) -> np.ndarray:
    \"\"\"(3, H, W) in [0, 1] -> (H, W, 3) numpy, for imshow (a plotting helper).\"\"\"
    return image.permute(1, 2, 0).detach().cpu().numpy()


def show_row(images, titles, size=1.6):
    \"\"\"Pictures side by side with titles (a plotting helper).\"\"\"
    fig, axes = plt.subplots(1, len(images), figsize=(size * len(images), size + 0.3))
    for ax, image, title in zip(np.atleast_1d(axes), images, titles):
        ax.imshow(image, interpolation="nearest")
        ax.set_title(title)
        ax.axis("off")
    plt.tight_layout()
    plt.show()
""")

# ---- 1. Load ------------------------------------------------------------------------------------

md("""
## 1. Load the tiny model, a prompt and its target

`grpo.load_glm_image("tiny")` builds the whole `GlmImagePipeline` offline with the same token layout as
the real model (codebook ids first, then image start / end, then the GLM special tokens) and freezes
everything except the AR's language model and head. Its weights never depend on a seed, so the
targets shipped in `examples/` (decodes of random token grids by this very model, made by
`make_targets.py`) are reachable. The prompt texts are labels only: the random tiny model knows no
language, and the targets look nothing like their captions.
""")

code("""
pipe = grpo.load_glm_image("tiny")
ar = pipe.vision_language_encoder
K = ar.config.vq_config.num_embeddings  # codebook size: token ids 0..K-1 are visual codes

for name in ["vision_language_encoder", "transformer", "vae", "text_encoder"]:
    module = getattr(pipe, name)
    total = sum(p.numel() for p in module.parameters())
    trainable = sum(p.numel() for p in module.parameters() if p.requires_grad)
    print(f"{name:24s} {total:8,d} parameters, {trainable:8,d} trainable")
print(f"codebook size K = {K}")

examples = grpo.read_prompts("prompts.txt")
for prompt, path in examples:
    print(f"  {prompt!r:40s} -> {path}")
prompt, target_path = examples[0]
target = grpo.load_target(target_path, H, W)  # (3, H, W) in [0, 1]
print(f"target {tuple(target.shape)}, {target.dtype}, range [{target.min():.2f}, {target.max():.2f}]")
show_row([as_hwc(target)], [f"target: {prompt}"], size=2.2)
""")

# ---- 2. Prompt ----------------------------------------------------------------------------------

md("""
## 2. The prompt as the AR sees it

`grpo.group_inputs` runs the processor's chat template once and repeats it $G$ times. The template ends
with two **grid strings** and the image-start token: `<sop>H/32 W/32<eop>` for the large grid, then
`<sop>h' w'<eop>` for the small preview grid. `image_grid_thw` holds the same two grids as rows
`[1, H/32, W/32]` and `[1, h', w']`, per sample. (The tiny tokenizer has no merges, so the text is one
token per byte.)
""")

code("""
inputs = grpo.group_inputs(pipe.processor, prompt, G, H, W, "cpu")
for key, value in inputs.items():
    print(f"{key:18s} {tuple(value.shape)}")
tokenizer = pipe.processor.tokenizer
ids = inputs["input_ids"][0].tolist()
pieces = tokenizer.convert_ids_to_tokens(ids)
print(f"\\n{len(ids)} prompt tokens (id:token):")
for start in range(0, len(ids), 10):
    print("  " + "  ".join(f"{i}:{t}" for i, t in zip(ids[start:start + 10], pieces[start:start + 10])))
print("\\ndecoded:", repr(tokenizer.decode(ids)))
print("image_grid_thw of sample 0 (large, preview):", inputs["image_grid_thw"][:2].tolist())
""")

md("""
The preview grid is about 16x16 whatever the size; the large grid is $H/32 \\times W/32$. Same processor,
other sizes:
""")

code("""
print(f"{'size':>10s}  {'grid strings':34s} {'preview':>8s} {'large':>6s} {'tokens N':>9s}")
for h, w in [(64, 64), (64, 96), (128, 128), (1024, 1024), (768, 1344)]:
    one = grpo.group_inputs(pipe.processor, prompt, 1, h, w, "cpu")
    (_, lh, lw), (_, ph, pw) = one["image_grid_thw"].tolist()
    grids = tokenizer.decode(one["input_ids"][0]).split("<|assistant|>")[1].replace(tokenizer.bos_token, "")
    print(f"{h:>4d}x{w:<5d}  {grids:34s} {ph:>3d}x{pw:<4d} {lh:>2d}x{lw:<3d} {ph * pw + lh * lw:>9d}")
""")

md("""
**Generation order.** The AR writes the grids in the *reverse* order of `image_grid_thw`: the whole
preview grid first, row by row, then the large grid. Only the large grid reaches the DiT; the preview
tokens condition it. At 64x64 that is 256 preview tokens and just 4 large-grid tokens. Each cell below
shows its generation index:
""")

code("""
(_, large_h, large_w), (_, prev_h, prev_w) = inputs["image_grid_thw"][:2].tolist()
n_prev, n_large = prev_h * prev_w, large_h * large_w
N = n_prev + n_large
order_prev = np.arange(n_prev).reshape(prev_h, prev_w)
order_large = n_prev + np.arange(n_large).reshape(large_h, large_w)

fig, axes = plt.subplots(1, 2, figsize=(8.4, 4.2))
for ax, order, title in [(axes[0], order_prev, f"1st: preview grid {prev_h}x{prev_w}"),
                         (axes[1], order_large, f"2nd: large grid {large_h}x{large_w} (to the DiT)")]:
    ax.imshow(order, cmap="viridis", vmin=order.min(), vmax=order.max() + 0.3 * order.size)
    for (row, col), index in np.ndenumerate(order):
        ax.text(col, row, str(index), ha="center", va="center", fontsize=5.5 if order.size > 16 else 14,
                color="white" if index - order.min() < 0.6 * order.size else "black")
    ax.set_title(title)
    ax.set_xticks([])
    ax.set_yticks([])
plt.suptitle(f"generation index of each visual token ({N} in all), both grids cover the whole {H}x{W} image")
plt.tight_layout()
plt.show()
""")

md("""
**3D positions.** The AR uses rotary positions on three axes (temporal, height, width). The prompt is
a 1D ramp on all three; a grid $h \\times w$ that starts at $p$ puts cell (row, col) at
$(p,\\ p+\\text{row},\\ p+\\text{col})$, and the next grid starts at $p + \\max(h, w)$.
`grpo.rope_positions` rebuilds exactly the positions that `generate` used, for the prompt and every
generated token but the last (the input of a teacher-forced forward). A forward without
`position_ids` would instead put every generated token on the 1D text ramp (dashed), section 7
shows what that costs.
""")

code("""
P = inputs["input_ids"].shape[1]
positions = grpo.rope_positions(inputs["image_grid_thw"], P, N)  # (3, 1, P+N-1)
print(f"positions {tuple(positions.shape)} = (3 axes, broadcast over the group, P + N - 1 = {P} + {N} - 1)")
for label, index in [("last prompt token (image start)", P - 1), ("preview (0, 0)", P), ("preview (0, 1)", P + 1),
                     ("preview (1, 0)", P + prev_w), ("preview last", P + n_prev - 1),
                     ("large (0, 0)", P + n_prev), ("large (0, 1)", P + n_prev + 1), ("large (1, 0)", P + n_prev + 2)]:
    print(f"  {label:32s} sequence index {index:3d} -> (t, h, w) = {tuple(positions[:, 0, index].tolist())}")

fig, axes = plt.subplots(1, 2, figsize=(10, 3))
x = np.arange(P + N - 1)
for ax, lo, hi in [(axes[0], 0, P + N - 1), (axes[1], P - 4, P + 40)]:
    for axis, name in enumerate(["temporal", "height", "width"]):
        ax.plot(x[lo:hi], positions[axis, 0, lo:hi], label=name, lw=1.2, marker="." if hi - lo < 100 else None)
    ax.plot(x[lo:hi], x[lo:hi], "k--", lw=0.8, label="1D ramp (no position_ids)")
    for boundary in (P - 0.5, P + n_prev - 0.5):
        if lo < boundary < hi:
            ax.axvline(boundary, color="gray", lw=0.6)
    ax.set_xlim(lo - 0.5, hi - 0.5)
    ax.set_xlabel("sequence index")
    ax.set_ylabel("rotary position")
axes[0].set_title("prompt | preview grid | large grid")
axes[1].set_title("zoom: the first rows of the preview grid")
axes[1].legend(fontsize=7)
plt.tight_layout()
plt.show()
""")

# ---- 3. Sample ----------------------------------------------------------------------------------

md("""
## 3. Sample one group, decode it

`grpo.sample_group` draws the $G$ samples in **one** batched `generate` (KV cache), restricted to the
codebook ids and never stopping early, so every sample has exactly $N$ tokens. It also returns each
token's log-probability under the distribution it was drawn from,
$\\log \\mathrm{softmax}(\\text{logits} / T)$ over the codebook (`grpo.code_logprobs`): these are
$\\log \\pi_{\\theta_\\text{old}}$.
""")

code("""
rollout = grpo.sample_group(pipe, prompt, G, H, W, T, seed=cfg.seed)
print(f"tokens   {tuple(rollout.tokens.shape)} {rollout.tokens.dtype}, ids in [{rollout.tokens.min()}, {rollout.tokens.max()}]")
print(f"logprobs {tuple(rollout.logprobs.shape)} {rollout.logprobs.dtype}, "
      f"mean {rollout.logprobs.mean():.3f} (uniform over K codes: {-np.log(K):.3f})")
print(f"preview grid {rollout.preview_hw}, large grid {rollout.large_hw}")
print("large-grid tokens per sample:", rollout.tokens[:, -n_large:].tolist())
""")

code("""
fig, axes = plt.subplots(2, G, figsize=(1.9 * G, 4.0))
for i in range(G):
    preview = rollout.tokens[i, :n_prev].reshape(prev_h, prev_w)
    large = rollout.tokens[i, n_prev:].reshape(large_h, large_w)
    axes[0, i].imshow(preview, cmap="tab20", vmin=0, vmax=K - 1, interpolation="nearest")
    axes[0, i].set_title(f"sample {i}: preview")
    axes[1, i].imshow(large, cmap="tab20", vmin=0, vmax=K - 1, interpolation="nearest")
    for (row, col), code_id in np.ndenumerate(large.numpy()):
        axes[1, i].text(col, row, str(code_id), ha="center", va="center", fontsize=12,
                        bbox=dict(facecolor="white", alpha=0.7, lw=0))
    axes[1, i].set_title(f"sample {i}: large grid")
for ax in axes.flat:
    ax.set_xticks([])
    ax.set_yticks([])
plt.suptitle("sampled code ids (colour = id); only the large grid reaches the DiT")
plt.tight_layout()
plt.show()

fig, axes = plt.subplots(1, 2, figsize=(10, 2.0), gridspec_kw=dict(width_ratios=[5, 1]))
lo, hi = rollout.logprobs.min().item(), rollout.logprobs.max().item()
for ax, cols, title in [(axes[0], slice(0, n_prev), "preview tokens"), (axes[1], slice(n_prev, N), "large grid")]:
    im = ax.imshow(rollout.logprobs[:, cols], aspect="auto", cmap="magma", vmin=lo, vmax=hi,
                   interpolation="nearest", extent=(cols.start - 0.5, cols.stop - 0.5, G - 0.5, -0.5))
    ax.set_title(f"log p of the sampled {title}")
    ax.set_xlabel("generation index")
    ax.set_yticks(range(G))
axes[0].set_ylabel("sample")
plt.colorbar(im, ax=axes, label="log p", fraction=0.03)
plt.show()
""")

md("""
`grpo.decode_images` turns the large grid into images: reshape to $(H/32, W/32)$, upsample 2x to the
DiT's prior-token grid, and run the frozen DiT + VAE for the whole group in one call, **with the same
latent noise for every sample**, so the images differ only through their tokens.
""")

code("""
images = grpo.decode_images(pipe, prompt, rollout.tokens, rollout.large_hw, H, W, cfg.num_inference_steps,
                            cfg.decode_seed, cfg.guidance_scale)  # (G, 3, H, W) in [0, 1]
print(f"images {tuple(images.shape)} {images.dtype}, range [{images.min():.3f}, {images.max():.3f}]")
show_row([as_hwc(target)] + [as_hwc(x) for x in images], ["target"] + [f"sample {i}" for i in range(G)])

# the preview tokens never reach the decoder: re-randomise them and the images do not change
other_preview = rollout.tokens.clone()
other_preview[:, :n_prev] = torch.randint(0, K, (G, n_prev), generator=torch.Generator().manual_seed(0))
same = grpo.decode_images(pipe, prompt, other_preview, rollout.large_hw, H, W, cfg.num_inference_steps,
                          cfg.decode_seed, cfg.guidance_scale)
print(f"max pixel change after re-randomising all {n_prev} preview tokens: {(same - images).abs().max():.1e}")
""")

# ---- 4. Rewards ---------------------------------------------------------------------------------

md("""
## 4. Rewards

Two rewards compare each image with the target: $-\\mathrm{MSE}$ in $[-1, 0]$ and SSIM in $[-1, 1]$
(Wang et al. 2004: 11-tap Gaussian window, $\\sigma = 1.5$, over valid windows, averaged over channels
and pixels). `--reward ssim=1,mse=0` (the default) weights them; `grpo.group_rewards` applies the
weights per group.
""")

code("""
mse = grpo.mse_reward(images, target)  # (G,)
ssim = grpo.ssim_reward(images, target)  # (G,)
weights = grpo.parse_reward_weights(cfg.reward)
rewards = grpo.group_rewards([images], [target], weights)  # (1, G): one group
print(f"| sample | -MSE    | SSIM   | reward ({cfg.reward}) |")
print("|--------|---------|--------|--------------------|")
for i in range(G):
    print(f"| {i:6d} | {mse[i]:7.4f} | {ssim[i]:6.4f} | {rewards[0, i]:18.4f} |")
print(f"| mean   | {mse.mean():7.4f} | {ssim.mean():6.4f} | {rewards.mean():18.4f} |")
""", tag="rewards")

code("""
grid = grpo.image_grid([target], [images], rewards)  # what grpo.py saves under images/ every --image-every steps
print(f"image_grid: a {grid.size[0]}x{grid.size[1]} PIL image (target, then the samples with their rewards)")
fig, ax = plt.subplots(figsize=(grid.size[0] / 40, grid.size[1] / 40))
ax.imshow(grid, interpolation="nearest")
ax.axis("off")
plt.show()
""")

md("""
**The SSIM map of one sample.** `grpo.ssim_reward` returns only the mean. To *see* where an image
matches, the cell below recomputes the per-window map with the same formulas. This is a display helper
of the notebook, not a second reward; it is checked against `grpo.ssim_reward`.

$$
\\mathrm{SSIM}(x, y) = \\frac{(2\\mu_x\\mu_y + C_1)(2\\sigma_{xy} + C_2)}{(\\mu_x^2 + \\mu_y^2 + C_1)(\\sigma_x^2 + \\sigma_y^2 + C_2)},
\\qquad C_1 = 0.01^2,\\ C_2 = 0.03^2
$$
""")

code("""
def ssim_map_for_display(images: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    \"\"\"DISPLAY HELPER: the per-window SSIM map (G, 3, H-10, W-10) with grpo.ssim_reward's formulas.\"\"\"
    g = torch.exp(-((torch.arange(11, dtype=torch.float32) - 5) ** 2) / (2 * 1.5 ** 2))
    g = g / g.sum()
    window = (g[:, None] * g[None, :]).expand(3, 1, 11, 11)
    blur = lambda z: torch.nn.functional.conv2d(z, window, groups=3)
    x, y = images.float(), target.float().expand_as(images)
    mu_x, mu_y = blur(x), blur(y)
    var_x, var_y, cov = blur(x * x) - mu_x ** 2, blur(y * y) - mu_y ** 2, blur(x * y) - mu_x * mu_y
    return ((2 * mu_x * mu_y + 1e-4) * (2 * cov + 9e-4)) / ((mu_x ** 2 + mu_y ** 2 + 1e-4) * (var_x + var_y + 9e-4))


maps = ssim_map_for_display(images, target)
gap = (maps.mean(dim=(1, 2, 3)) - grpo.ssim_reward(images, target)).abs().max().item()
print(f"max |mean of the map - grpo.ssim_reward| over the group: {gap:.1e}")
assert gap < 1e-6
best = int(ssim.argmax())
fig, axes = plt.subplots(1, 3, figsize=(7, 2.5))
axes[0].imshow(as_hwc(target))
axes[0].set_title("target")
axes[1].imshow(as_hwc(images[best]))
axes[1].set_title(f"sample {best} (SSIM {ssim[best]:.3f})")
im = axes[2].imshow(maps[best].mean(0), cmap="RdYlGn", vmin=-1, vmax=1)
axes[2].set_title(f"SSIM map {maps.shape[-2]}x{maps.shape[-1]} (valid windows)")
plt.colorbar(im, ax=axes[2], fraction=0.046)
for ax in axes:
    ax.axis("off")
plt.tight_layout()
plt.show()
""")

# ---- 5. Advantages ------------------------------------------------------------------------------

md("""
## 5. Advantages

GRPO needs no value network: each sample is compared with its own group,

$$
A_i = \\frac{R_i - \\mathrm{mean}(R_1..R_G)}{\\mathrm{std}(R_1..R_G)} \\quad\\text{(population std, per group)}.
$$

Every token of sample $i$ gets the same $A_i$. Above-average samples are pushed up, below-average ones
down, and the advantages of a group sum to zero.
""")

code("""
advantages = grpo.group_advantages(rewards)  # (1, G)
print("reward    ", [f"{r:+.4f}" for r in rewards[0].tolist()])
print("advantage ", [f"{a:+.4f}" for a in advantages[0].tolist()])
print(f"sum {advantages.sum():+.1e}, population std {advantages.std(unbiased=False):.4f}")
print("same advantages for 10 * R + 3 (scale- and shift-free):",
      torch.allclose(grpo.group_advantages(10 * rewards + 3), advantages, atol=1e-5))
""")

md("""
When all samples of a group get the same reward (a collapsed policy, or identical images), the std is
0 and a plain z-score divides 0 by 0. `grpo.group_advantages` gives such a group **zero** advantage
(it carries no signal) instead of NaN, which would poison the weights through the gradient. Three
groups at once, shape $(P, G)$:
""")

code("""
batch = torch.tensor([[0.61, 0.55, 0.70, 0.58],  # a normal group
                      [0.72, 0.72, 0.72, 0.72],  # no spread: every sample alike
                      [0.40, 0.40, 0.40, 0.90]])  # one outlier
naive = (batch - batch.mean(-1, keepdim=True)) / batch.std(-1, unbiased=False, keepdim=True)
safe = grpo.group_advantages(batch)
for p in range(3):
    print(f"group {p}: plain z-score {[round(v, 3) for v in naive[p].tolist()]}")
    print(f"         group_advantages {[round(v, 3) for v in safe[p].tolist()]}")
assert not safe.isnan().any() and (safe[1] == 0).all()
""")

# ---- 6. Objective -------------------------------------------------------------------------------

md("""
## 6. The objective

Per token, `grpo.grpo_loss` computes the ratio $r = \\exp(\\log\\pi_\\theta - \\log\\pi_\\text{old})$,
the clipped surrogate $\\min(rA,\\ \\mathrm{clip}(r, 1-\\varepsilon, 1+\\varepsilon)A)$, and the loss
$-(\\text{surrogate} - \\beta\\,\\mathrm{KL})$ averaged over the tokens of a sequence, then over
sequences. The curves below are `grpo.grpo_loss` evaluated on one-token "sequences" with
$\\log\\pi_\\text{old} = 0$ and $\\log\\pi_\\theta = \\log r$. Where the clip is active (grey), the
surrogate is flat and its gradient is zero: the objective stops rewarding moves of more than
$\\varepsilon$ away from the sampler in the direction of $A$. With $\\mu = 1$ update per batch
(the default) $r = 1$ exactly and the clip never acts; with `--mu 2` and more it does.
""")

code("""
eps = cfg.clip_eps
ratios = torch.linspace(0.05, 2.5, 491)


def surrogate_and_grad(r: float, advantage: float):
    \"\"\"grpo_loss on a single token with log pi_old = 0: surrogate, d surrogate / d log pi, clipped?\"\"\"
    logp = torch.tensor([[np.log(r)]], requires_grad=True)
    loss, metrics = grpo.grpo_loss(logp, torch.zeros(1, 1), None, torch.tensor([advantage]), eps, 0.0)
    loss.backward()
    return -loss.item(), -logp.grad.item(), metrics["clip_frac"]


fig, axes = plt.subplots(1, 2, figsize=(9, 3))
for ax, advantage in zip(axes, [1.0, -1.0]):
    values = np.array([surrogate_and_grad(r, advantage) for r in ratios.tolist()])
    ax.plot(ratios, ratios * advantage, "k:", lw=1, label="unclipped r A")
    ax.plot(ratios, values[:, 0], lw=2, label="min(r A, clip(r) A)")
    ax.fill_between(ratios, -3, 3, where=values[:, 2] > 0, color="gray", alpha=0.25, label="clipped: no gradient")
    for edge in (1 - eps, 1 + eps):
        ax.axvline(edge, color="C3", lw=0.8, ls="--")
    ax.set_ylim(-2.6, 2.6)
    ax.set_xlabel("ratio r = pi / pi_old")
    ax.set_title(f"A = {advantage:+.0f}: clip range [{1 - eps:.1f}, {1 + eps:.1f}] dashed")
    ax.legend(fontsize=7, loc="upper left" if advantage > 0 else "lower left")
axes[0].set_ylabel("surrogate (per token)")
plt.tight_layout()
plt.show()

print(f"{'r':>5s} {'A':>3s} {'surrogate':>10s} {'d/dlogp':>8s} clipped")
for r, advantage in [(0.7, 1), (1.0, 1), (1.3, 1), (0.7, -1), (1.0, -1), (1.3, -1)]:
    s, g, c = surrogate_and_grad(r, advantage)
    print(f"{r:5.1f} {advantage:+3d} {s:10.3f} {g:8.3f} {'yes' if c else 'no'}")
""")

md("""
**The k3 KL estimator.** With a frozen reference $\\pi_\\text{ref}$ and $x = \\log\\pi_\\text{ref} - \\log\\pi_\\theta$
on the sampled token,

$$
\\mathrm{KL}_{t} = e^{x} - x - 1 \\ \\ge 0,
$$

an unbiased estimate of $\\mathrm{KL}(\\pi_\\theta \\Vert \\pi_\\text{ref})$ when tokens come from
$\\pi_\\theta$ (Schulman's k3). Unlike the plain $-x$ (k1, also unbiased) it is never negative,
token by token. Computed below with `grpo.grpo_loss` itself: with $A = 0$ and $\\beta = 1$ the loss *is* the mean KL.
""")

code("""
def k3(log_ratio: torch.Tensor) -> torch.Tensor:
    \"\"\"grpo_loss with A = 0, beta = 1 on tokens whose log pi_ref - log pi = log_ratio: the mean k3 KL.\"\"\"
    logp = torch.zeros(1, log_ratio.numel())
    loss, _ = grpo.grpo_loss(logp, logp, log_ratio.view(1, -1), torch.zeros(1), eps, 1.0)
    return loss


xs = torch.linspace(-3, 3, 241)
kl_curve = torch.stack([k3(x.view(1)) for x in xs])
assert (kl_curve >= 0).all()
fig, ax = plt.subplots(figsize=(4.5, 3))
ax.plot(xs, kl_curve, lw=2, label="k3 = exp(x) - x - 1  (grpo_loss)")
ax.plot(xs, -xs, "k:", label="k1 = -x (can be negative)")
ax.axhline(0, color="gray", lw=0.6)
ax.set_xlabel("x = log pi_ref - log pi")
ax.set_ylabel("per-token KL estimate")
ax.set_ylim(-3, 8)
ax.legend(fontsize=7)
plt.tight_layout()
plt.show()
print(f"min of k3 over x in [-3, 3]: {kl_curve.min():.2e} (at x = {xs[kl_curve.argmin()]:.2f})")

# unbiased: tokens drawn from pi, the mean of k3 matches the exact KL(pi || ref) of two random distributions
gen = torch.Generator().manual_seed(0)
log_pi = torch.log_softmax(torch.randn(K, generator=gen), -1)
log_ref = torch.log_softmax(torch.randn(K, generator=gen), -1)
draws = torch.multinomial(log_pi.exp(), 200_000, replacement=True, generator=gen)
exact = (log_pi.exp() * (log_pi - log_ref)).sum()
print(f"exact KL(pi || ref) {exact:.4f}; mean k3 over 200k sampled tokens {k3(log_ref[draws] - log_pi[draws]):.4f}")
""")

# ---- 7. Pitfall ---------------------------------------------------------------------------------

md("""
## 7. The log-prob pitfall, live

The ratio $r$ is only meaningful if the trainer scores the sampled tokens under **the same
distribution** the sampler drew them from. Before any update, $r$ must be exactly 1. The trap on
GLM-Image: a teacher-forced forward `model(input_ids=prompt + tokens[:, :-1])` without `position_ids`
puts every image token on the 1D text ramp (section 2), not at the 3D positions `generate` used.
`grpo.token_logprobs` passes the positions from `grpo.rope_positions`.

On the random tiny model the error is small, because its output is almost uniform. To see it clearly
we use a **sharpened copy**: every 2D weight of the language model except the embeddings times 4, and
`lm_head` times 16 (the final RMSNorm would cancel the first scale alone); `offline_model.sharpen`, the
same one the tests use.
""")

code("""
from offline_model import sharpen  # the same sharpening the tests use


def naive_logprobs(model, inputs, tokens, temperature):
    \"\"\"THE PITFALL: teacher forcing without position_ids (what not to do).\"\"\"
    ids = torch.cat([inputs["input_ids"], tokens[:, :-1]], dim=1)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), logits_to_keep=tokens.shape[1]).logits
    return grpo.code_logprobs(logits, temperature, K).gather(-1, tokens[..., None]).squeeze(-1)


sharp = sharpen(grpo.load_glm_image("tiny"))
results = {}
for name, p in [("plain", pipe), ("sharpened", sharp)]:
    r = grpo.sample_group(p, prompt, G, H, W, T, seed=1)
    with torch.no_grad():
        explicit = grpo.token_logprobs(p.vision_language_encoder, r.inputs, r.tokens, T)
    wrong = naive_logprobs(p.vision_language_encoder, r.inputs, r.tokens, T)
    results[name] = (r, explicit, wrong)
    print(f"{name:9s} model: mean -log p of sampled tokens (entropy estimate) {-r.logprobs.mean():.2f} nats")
    print(f"   naive forward, no position_ids: max |log p - sampler| = {(wrong - r.logprobs).abs().max():.2e}")
    print(f"   grpo.token_logprobs (explicit): max |log p - sampler| = {(explicit - r.logprobs).abs().max():.2e}")
""")

code("""
r, explicit, wrong = results["sharpened"]
parity = (explicit - r.logprobs).abs().max().item()
naive_error = (wrong - r.logprobs).abs().max().item()
ratio_naive = (wrong - r.logprobs).exp().flatten()
ratio_explicit = (explicit - r.logprobs).exp().flatten()
outside = ((ratio_naive < 1 - eps) | (ratio_naive > 1 + eps)).float().mean().item()
print(f"parity (explicit positions): {parity:.2e}")
print(f"naive error: {naive_error:.2f} nats")
print(f"step-0 ratios, naive:    min {ratio_naive.min():.1e}, max {ratio_naive.max():.1e}, "
      f"{100 * outside:.0f}% outside [{1 - eps:.1f}, {1 + eps:.1f}]")
print(f"step-0 ratios, explicit: min {ratio_explicit.min():.7f}, max {ratio_explicit.max():.7f}")
assert parity <= 1e-5 and naive_error > 1.0

bins = np.logspace(-3.05, 2.05, 52)  # a bin centred on 1
fig, ax = plt.subplots(figsize=(6, 2.8))
ax.hist(ratio_naive.clamp(1e-3, 99).numpy(), bins=bins, color="C3", alpha=0.7, label="naive forward")
ax.hist(ratio_explicit.numpy(), bins=bins, color="C2", alpha=0.9, label="grpo.token_logprobs")
ax.axvspan(1 - eps, 1 + eps, color="gray", alpha=0.25, label="clip range")
ax.set_xscale("log")
ax.set_xlabel("ratio pi_trainer / pi_sampler at step 0 (should be exactly 1)")
ax.set_ylabel("tokens")
ax.set_title(f"sharpened tiny model, {r.tokens.numel()} tokens")
ax.legend(fontsize=7)
plt.tight_layout()
plt.show()
""", tag="parity")

md("""
With the naive forward, most step-0 ratios sit outside the clip range: the clip would treat the very
first update as if the policy had already moved, and the gradient would push on noise. The same
happens with other classic mistakes, for instance scoring at $T = 1$ what was sampled at $T = 0.9$:
""")

code("""
with torch.no_grad():
    at_t1 = grpo.token_logprobs(sharp.vision_language_encoder, r.inputs, r.tokens, 1.0)
_, metrics = grpo.grpo_loss(at_t1, r.logprobs, None, torch.ones(G), eps, 0.0)
print(f"scored at T=1, sampled at T={T}: step-0 ratio in [{metrics['ratio_min']:.2f}, {metrics['ratio_max']:.2f}], "
      f"clip fraction {metrics['clip_frac']:.2f}")
""")

# ---- 8. Training --------------------------------------------------------------------------------

md("""
## 8. A short training run

`grpo.main` takes the same arguments as the command line and runs the loop: sample a group, decode,
reward, advantages, `train_step`. 30 steps cycle over the three prompts of `prompts.txt`. Two flags
differ from the tiny defaults so that every curve below has something to show:

* `--mu 2`: two updates per batch of rollouts. The first sees $r = 1$; the second sees the
  moved policy, so the ratio spreads and the clip acts.
* `--kl-beta 0.01`: a small KL to the initial weights (the tiny default is 0: no reference copy).

`--image-every 0` skips the image grids; we make our own below from the saved weights.
""")

code("""
import transformers
from transformers import GlmImageForConditionalGeneration

work = Path(tempfile.mkdtemp(prefix="grpo_walkthrough_"))
run_dir = work / "run"
args = ["--model", "tiny", "--prompts", "prompts.txt", "--out", str(run_dir), "--steps", "30", "--seed", "0",
        "--mu", "2", "--kl-beta", "0.01", "--image-every", "0", "--save-every", "0"]
print("python grpo.py " + " ".join(a if a != str(run_dir) else "<tmp>/run" for a in args))
transformers.utils.logging.disable_progress_bar()  # no "Writing model shards" bar when main saves final/
with contextlib.redirect_stderr(io.StringIO()) as log, contextlib.redirect_stdout(io.StringIO()) as out:
    summary = grpo.main(args)  # its progress bar (stderr) is made for a terminal: we keep the other lines
for line in (out.getvalue() + log.getvalue()).replace("\\r", "\\n").splitlines():
    if line.strip() and not line.startswith("grpo:"):
        print(line.replace(str(run_dir), "<tmp>/run"))
print(summary)
print("run directory:", sorted(p.name for p in run_dir.iterdir()))
""", tag="train")

code("""
history = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
steps = np.array([h["step"] for h in history])
which = np.array([h["prompts"][0] for h in history])
print(f"{len(history)} steps; keys: {', '.join(sorted(k for k in history[0] if not k.startswith('sec_')))}")

fig, axes = plt.subplots(2, 2, figsize=(10, 5.5))
ax = axes[0, 0]
for p, (text, _) in enumerate(examples):
    sel = which == p
    ax.errorbar(steps[sel], [h["reward_mean"] for h, s in zip(history, sel) if s],
                yerr=[h["reward_std"] for h, s in zip(history, sel) if s], fmt="o-", ms=3, capsize=2, label=text)
ax.set_title("reward: group mean, error bar = group std")
ax.legend(fontsize=7)
ax = axes[0, 1]
ax.plot(steps, [h["kl"] for h in history], "o-", ms=3, label="large grid (in the loss)")
ax.plot(steps, [h["preview/kl"] for h in history], "s--", ms=3, label="preview grid")
ax.set_title("k3 KL to the initial weights, per token")
ax.legend(fontsize=7)
ax = axes[1, 0]
ax.plot(steps, [h["clip_frac"] for h in history], "o-", ms=3)
ax.set_title("clip fraction (second update of each step)")
ax.set_xlabel("step")
ax = axes[1, 1]
ax.fill_between(steps, [h["ratio_min"] for h in history], [h["ratio_max"] for h in history], alpha=0.3,
                label="[min, max] over both updates")
ax.plot(steps, [h["ratio_mean"] for h in history], "o-", ms=3, label="mean")
ax.axhspan(1 - eps, 1 + eps, color="gray", alpha=0.2, label="clip range")
ax.set_title("ratio pi / pi_old")
ax.set_xlabel("step")
ax.legend(fontsize=7)
plt.tight_layout()
plt.show()
""")

md("""
**Before and after.** `main` returns only a summary; the trained AR is in `final/` (`save_pretrained`).
We load it into a second tiny pipeline and sample every prompt with the same seeds from both, one row
per prompt (target, then the $G$ samples with their rewards).
""")

code("""
trained = GlmImageForConditionalGeneration.from_pretrained(run_dir / "final")
pipe_after = grpo.load_glm_image("tiny")
pipe_after.vision_language_encoder.load_state_dict(trained.state_dict())

targets = [grpo.load_target(path, H, W) for _, path in examples]
grids, means = [], []
for p in (pipe, pipe_after):
    groups = []
    for i, (text, _) in enumerate(examples):
        r = grpo.sample_group(p, text, G, H, W, T, seed=10_000 + i)
        groups.append(grpo.decode_images(p, text, r.tokens, r.large_hw, H, W, cfg.num_inference_steps,
                                         cfg.decode_seed, cfg.guidance_scale))
    scores = grpo.group_rewards(groups, targets, weights)  # (3, G)
    grids.append(grpo.image_grid(targets, groups, scores))
    means.append(scores.mean(dim=1))
fig, axes = plt.subplots(1, 2, figsize=(9, 3.2))
for ax, grid, m, title in zip(axes, grids, means, ["before training", "after 30 steps"]):
    ax.imshow(grid, interpolation="nearest")
    ax.set_title(f"{title}: mean reward {m.mean():.3f}")
    ax.axis("off")
plt.tight_layout()
plt.show()
for i, (text, _) in enumerate(examples):
    print(f"{text!r:40s} mean reward {means[0][i]:.3f} -> {means[1][i]:.3f}")
shutil.rmtree(work)
""")

md("""
The reward rises, then plateaus: at 64x64 only 4 large-grid tokens reach the DiT, and without a strong
KL the policy soon collapses to one code map per prompt (the group std goes to 0, such groups get zero
advantage and stop teaching). `metrics.jsonl` logs `reward_std` and `distinct_samples` so that shows.
`python bench_learning.py` measures the gain over several seeds.
""")

# ---- 9. Real model ------------------------------------------------------------------------------

md("""
## 9. The real model

The same code runs `zai-org/GLM-Image` (AR about 9B parameters, DiT about 7B) on a GPU in bfloat16:

```bash
pip install -r requirements.txt
python grpo.py --prompts my_prompts.txt                                   # 1024x1024, bf16, from the hub
python grpo.py --prompts my_prompts.txt --model /path/to/local/GLM-Image  # a local copy
python grpo.py --help                                                     # every flag, with its default
```

`prompts.txt` lines are `prompt | path/to/target.png`; pick targets the model can reach. Without
`--model tiny`, `grpo.py` fills in other defaults; these are the ones that differ:
""")

code("""
tiny_cfg, real_cfg = grpo.parse_config(["--model", "tiny"]), grpo.parse_config([])
print(f"{'flag':26s} {'tiny':>10s}   real")
for field in dataclasses.fields(grpo.Config):
    tiny_value, real_value = getattr(tiny_cfg, field.name), getattr(real_cfg, field.name)
    if tiny_value != real_value:
        print(f"--{field.name.replace('_', '-'):24s} {str(tiny_value):>10s}   {real_value}")
one = grpo.group_inputs(pipe.processor, prompt, 1, real_cfg.height, real_cfg.width, "cpu")
(_, lh, lw), (_, ph, pw) = one["image_grid_thw"].tolist()
print(f"at {real_cfg.height}x{real_cfg.width}: a {ph}x{pw} preview then a {lh}x{lw} large grid, "
      f"N = {ph * pw + lh * lw} tokens per sample")
""")

md("""
**Memory, a first estimate** of weights and optimizer state only (activations, the KV cache of
sampling and the DiT's working memory come on top). The README has the current numbers and plan:
""")

code("""
GB = 1e9
ar_params, dit_params = 9e9, 7e9  # rounded
full = [("DiT + VAE + glyph T5 weights, bf16, frozen", 2 * dit_params),
        ("AR weights, float32 (trainable weights stay float32)", 4 * ar_params),
        ("AR gradients, float32", 4 * ar_params),
        ("AdamW moments, 2 x float32", 8 * ar_params),
        ("frozen reference copy of the AR (beta > 0)", 4 * ar_params)]
print("full fine-tuning of the AR (--lora-rank 0):")
for name, size in full:
    print(f"  {name:52s} {size / GB:5.0f} GB")
print(f"  {'total':52s} {sum(s for _, s in full) / GB:5.0f} GB  (--kl-beta 0 drops the reference)")
print(f"LoRA on the AR: bf16 AR + DiT weights, frozen, {2 * (ar_params + dit_params) / GB:.0f} GB, plus small adapters; "
      "the base weights with the adapters switched off are the reference, no copy")
""")

md("""
Full fine-tuning does not fit one 80 GB GPU; LoRA (`--lora-rank`), micro-batches
(`--micro-batch-size`), gradient checkpointing (`--gradient-checkpointing`) and keeping the DiT on
the CPU between decodes (`--offload`) are the levers. See the README for what has been measured.

**Where to go next**

* `grpo.py`: one section per step, in the order of this notebook; its top docstring lists where it
  departs from the paper.
* `test_grpo.py`: one test per function, including the log-prob parity (<= 1e-5) and the naive
  forward failing on the sharpened model.
* Try: `--height 128 --width 128` (16 large-grid tokens instead of 4: more room to learn),
  `--train-tokens all` (the preview tokens in the loss too), `--group-size 8`, `--kl-beta 0.04`,
  `--reward ssim=1,mse=0.5`, and `python bench_learning.py` to compare settings over seeds.
* This notebook is built by `python make_notebook.py` (edit the cells there and re-run it);
  `python -m pytest -q test_notebook.py` runs it top to bottom.
""")


# ---- build --------------------------------------------------------------------------------------

def build() -> nbformat.NotebookNode:
    nb = nbformat.v4.new_notebook()
    nb.cells = CELLS
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.metadata["language_info"] = {"name": "python"}
    return nb


def execute(nb: nbformat.NotebookNode, timeout: int = 300) -> nbformat.NotebookNode:
    """Run every cell in a fresh python3 kernel with the repository root as working directory."""
    client = NotebookClient(nb, timeout=timeout, kernel_name="python3", record_timing=False,
                            resources={"metadata": {"path": str(HERE)}})
    client.execute()
    return nb


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-execute", action="store_true", help="write the notebook without running it")
    parser.add_argument("--out", default=str(NOTEBOOK), help="where to write the notebook")
    args = parser.parse_args(argv)
    nb = build()
    if not args.no_execute:
        start = time.perf_counter()
        execute(nb)
        print(f"executed in {time.perf_counter() - start:.0f} s", file=sys.stderr)
    nb.metadata["language_info"] = {"name": "python"}  # drop the kernel's exact version: fewer diffs
    nbformat.validate(nb)
    nbformat.write(nb, args.out)
    print(f"wrote {args.out} ({Path(args.out).stat().st_size / 1e6:.2f} MB)", file=sys.stderr)


if __name__ == "__main__":
    main()
