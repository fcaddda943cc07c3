"""GRPO for GLM-Image's decoder: the DiT's denoising chain as a policy (Flow-GRPO), beside grpo.py's AR.

`python dit_grpo.py --prompts prompts.txt ...` (grpo.py's flags and DitConfig's; `main` last): one AR sample per
prompt, shared by the group, G pictures from the SDE sampler, the same rewards and advantages (grpo.group_rewards,
grpo.group_advantages and helpers/variants.py's --scale-rewards), and
`train_step` below (grpo_loss with each denoising step as a token). It imports grpo.py and helpers/run.py, neither
imports it. Text-to-image, one process or torchrun (FSDP2 over the DiT's blocks: parallel.shard); not yet: editing,
PPO epochs (--mu > 1). The demo of docs/dit.md: `--reward shapes,size=0.3` (the DiT alone decides how large objects
are painted).

The DiT is sampled by integrating a flow-matching ODE, x_{t+1} = x_t + (sigma_{t+1} - sigma_t) v, with the velocity
v = DiT(x_t, t) guided as the pipeline guides it. A deterministic chain has no log-probs, so Flow-GRPO (Liu et al.
2025) replaces each step by a Gaussian step of an SDE with the same marginals. With sigma = sigma_t,
sigma' = sigma_{t+1} < sigma, dt = sigma' - sigma < 0 and the noise level a (`noise_level`),

    s    = a sqrt(sigma / (1 - sigma))          (at sigma = 1: sigma_1 in the denominator, as Flow-GRPO)
    mean = x_t (1 + s^2 dt / (2 sigma)) + v (1 + s^2 (1 - sigma) / (2 sigma)) dt
    x_{t+1} ~ N(mean, s^2 |dt| I)

and a step's log-prob is that Gaussian's log-density of the x_{t+1} drawn, averaged over the latent's elements (as
Flow-GRPO does: the ratio of a step is then a per-element mean, near 1). With a = 0 the step is the pipeline's own
Euler step, exactly. The KL between the policy's and the frozen reference's step is closed-form: both are Gaussians
of the same std, so KL = |mean - mean_ref|^2 / (2 s^2 |dt|), averaged over the latent's elements likewise.

Where this departs from Flow-GRPO: the group shares one sample of GLM-Image's AR tokens (the DiT's prior), so
rewards differ by decoder noise alone; the timesteps are the pipeline's own (GLM-Image's shifted schedule);
`--sde-window N` makes the first N steps SDE steps and trains them, the rest ODE steps (Flow-GRPO-Fast slides its
window along the chain; this one stays at the start, where the layout is decided); one update per batch of chains
(no PPO epochs yet), so the clip idles at the first update.

Sampling runs the pipeline itself (`GlmImagePipeline.__call__`: its timesteps, guidance and VAE) with its scheduler
swapped for `SDEScheduler`, a FlowMatchEulerDiscreteScheduler whose `step` draws the Gaussian step and records it; the
trainer recomputes the same steps with `velocity` (the pipeline's two transformer calls and guidance, written out).
"""

import contextlib
import dataclasses
import functools
import math
import sys
from typing import NamedTuple

import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from diffusers.schedulers.scheduling_flow_match_euler_discrete import FlowMatchEulerDiscreteSchedulerOutput

import grpo  # the AR's sampler, the decoder, rewards, the loss and the set-up: shared with the AR's GRPO
from helpers import run, setup, trainer, variants  # the run's plumbing, the trainer, the variants, as grpo.py's
from helpers.parallel import all_agree, rows_per_process, unsharded


def sde_step(x: torch.Tensor, v: torch.Tensor, sigma: torch.Tensor, sigma_next: torch.Tensor,
             sigma_1: torch.Tensor, noise_level: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, C, h, w) latents x_t and velocities v (float32), the step's sigmas (0-dim) -> the Gaussian step's mean
    (B, C, h, w) and its std (0-dim): Flow-GRPO's SDE step (see the top of the file). std 0 when noise_level is 0,
    and then the mean is the Euler step x + dt v, bit for bit."""
    dt = sigma_next - sigma
    s = noise_level * torch.sqrt(sigma / (1 - torch.where(sigma == 1, sigma_1, sigma)))
    mean = x * (1 + s ** 2 / (2 * sigma) * dt) + v * (1 + s ** 2 * (1 - sigma) / (2 * sigma)) * dt
    return mean, s * torch.sqrt(-dt)


def gaussian_logprob(x: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """(B, ...) samples of N(mean, std^2 I) -> (B,) log-density averaged over the elements of a sample."""
    logp = -((x - mean) ** 2) / (2 * std ** 2) - torch.log(std) - 0.5 * math.log(2 * math.pi)
    return logp.flatten(1).mean(dim=1)


def gaussian_kl(mean: torch.Tensor, ref_mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """KL(N(mean, std^2 I) || N(ref_mean, std^2 I)) per element, averaged over a sample's elements: (B,) >= 0."""
    return (((mean - ref_mean) ** 2) / (2 * std ** 2)).flatten(1).mean(dim=1)


class SDEScheduler(FlowMatchEulerDiscreteScheduler):
    """The pipeline's scheduler with `step` replaced by Flow-GRPO's SDE step. Set `noise_level` and `generator` (the
    Gaussian noise, drawn on the CPU) before sampling; every step appends (x_t, x_{t+1}, log-prob or None) to
    `steps`. A subclass (not a copy of the pipeline's loop) so the pipeline's own timesteps and guidance run."""

    noise_level: float = 0.0
    generator: torch.Generator | None = None
    sde_window: int = 0

    def begin(self, noise_level: float, generator: torch.Generator, sde_window: int = 0) -> "SDEScheduler":
        """Stochastic steps: the first `sde_window` (0: all); the steps after them are the ODE's (Euler) steps."""
        self.noise_level, self.generator, self.sde_window, self.steps = noise_level, generator, sde_window, []
        return self

    def step(self, model_output, timestep, sample, *args, return_dict: bool = True, **kwargs):
        if self.step_index is None:
            self._init_step_index(timestep)
        sigma, sigma_next = self.sigmas[self.step_index], self.sigmas[self.step_index + 1]
        x, v = sample.to(torch.float32), model_output.to(torch.float32)
        level = self.noise_level if self.step_index in window(len(self.timesteps), self.sde_window) else 0.0
        mean, std = sde_step(x, v, sigma, sigma_next, self.sigmas[1], level)
        std = std.to(x.device)
        if level > 0:
            noise = torch.randn(x.shape, generator=self.generator).to(x.device)
            prev = mean + std * noise
            self.steps.append((x, prev, gaussian_logprob(prev, mean, std)))
        else:
            prev = mean
            self.steps.append((x, prev, None))
        self._step_index += 1
        prev = prev.to(model_output.dtype)
        return FlowMatchEulerDiscreteSchedulerOutput(prev_sample=prev) if return_dict else (prev,)


class Chain(NamedTuple):
    images: torch.Tensor  # (G, 3, H, W) float32 in [0, 1]
    latents: torch.Tensor  # (G, T + 1, C, h, w) float32: x_0 (pure noise) ... x_T (the decoded latent)
    logprobs: torch.Tensor | None  # (G, S) float32, the sampler's log-prob of each SDE step (the first S of the T;
    #                                 None at noise level 0)
    timesteps: torch.Tensor  # (T,) the pipeline's timesteps
    sigmas: torch.Tensor  # (T + 1,) their sigmas, ending in 0
    cond: dict  # what the transformer is called with besides the latents and timestep (see `velocity`)


@torch.no_grad()
def sample_chain(pipe, prompt: str, tokens: torch.Tensor, large_hw: tuple[int, int], height: int, width: int,
                 num_inference_steps: int, guidance_scale: float, seed: int, noise_level: float,
                 sde_window: int = 0) -> Chain:
    """G pictures of one prompt from the same (G, N) AR tokens (one row repeated: the group shares them), differing
    only by the decoder's noise (initial latents and SDE steps, all from `seed`), through the pipeline itself with
    SDEScheduler: SDE steps on the first `sde_window` steps (0: all), ODE steps after. Text-to-image only for now
    (no source image)."""
    G, device, dtype = tokens.shape[0], pipe.transformer.device, pipe.transformer.dtype
    prior = grpo.prior_ids(tokens, large_hw).to(device)
    embeds, negative = pipe.encode_prompt(prompt, do_classifier_free_guidance=guidance_scale > 1, device=device,
                                          dtype=dtype)
    generator = torch.Generator("cpu").manual_seed(seed)
    shape = (G, pipe.transformer.config.in_channels, height // pipe.vae_scale_factor, width // pipe.vae_scale_factor)
    latents = torch.randn(shape, generator=generator).to(device, dtype)
    sde = SDEScheduler.from_config(pipe.scheduler.config).begin(noise_level, generator, sde_window)
    stock, pipe.scheduler = pipe.scheduler, sde
    try:
        images = pipe(prompt_embeds=embeds.repeat(G, 1, 1),
                      negative_prompt_embeds=None if negative is None else negative.repeat(G, 1, 1),
                      prior_token_ids=prior, latents=latents, height=height, width=width,
                      num_inference_steps=num_inference_steps, guidance_scale=guidance_scale, output_type="pt").images
    finally:
        pipe.scheduler = stock
    states = torch.stack([sde.steps[0][0]] + [prev for _, prev, _ in sde.steps], dim=1)  # (G, T + 1, C, h, w)
    logprobs = [lp for *_, lp in sde.steps if lp is not None]
    logprobs = torch.stack(logprobs, dim=1) if logprobs else None  # (G, S)
    cond = {"embeds": embeds.repeat(G, 1, 1), "negative": None if negative is None else negative.repeat(G, 1, 1),
            "prior": prior, "guidance_scale": guidance_scale, "height": height, "width": width}
    return Chain(images.float().clamp(0, 1), states, logprobs, sde.timesteps.clone(), sde.sigmas.clone(), cond)


def velocity(transformer, x: torch.Tensor, t: torch.Tensor, cond: dict, rows: slice = slice(None)) -> torch.Tensor:
    """(B, C, h, w) latents at timestep t -> (B, C, h, w) float32 guided velocity, exactly as GlmImagePipeline
    computes it: the conditional call, and with guidance > 1 the unconditional one (negative prompt, prior tokens
    dropped) and v_u + g (v_c - v_u). `rows` picks the samples of `cond` that x holds."""
    B, prior = x.shape[0], cond["prior"][rows]
    common = dict(hidden_states=x.to(transformer.dtype), prior_token_id=prior, timestep=t.expand(B) - 1,
                  target_size=torch.tensor([[cond["height"], cond["width"]]], dtype=cond["embeds"].dtype,
                                           device=x.device).repeat(B, 1),
                  crop_coords=torch.zeros(B, 2, dtype=cond["embeds"].dtype, device=x.device), return_dict=False)
    v = transformer(encoder_hidden_states=cond["embeds"][rows], prior_token_drop=torch.zeros_like(prior, dtype=torch.bool),
                    **common)[0].float()
    if cond["guidance_scale"] > 1:
        v_u = transformer(encoder_hidden_states=cond["negative"][rows],
                          prior_token_drop=torch.ones_like(prior, dtype=torch.bool), **common)[0].float()
        v = v_u + cond["guidance_scale"] * (v - v_u)
    return v


def chain_logprobs(transformer, chain: Chain, steps: list[int], noise_level: float, rows: slice = slice(None)
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The trainer's side: the log-probs of the chain's recorded steps `steps` for samples `rows`, recomputed with
    `transformer` (with gradient when enabled). Returns (B, S) log-probs, (B, S, C, h, w) step means (for the KL)
    and the (S,) stds."""
    logps, means, stds = [], [], []
    for i in steps:
        x, x_next = chain.latents[rows, i], chain.latents[rows, i + 1]
        v = velocity(transformer, x, chain.timesteps[i], chain.cond, rows)
        mean, std = sde_step(x, v, chain.sigmas[i], chain.sigmas[i + 1], chain.sigmas[1], noise_level)
        logps.append(gaussian_logprob(x_next, mean, std.to(x.device)))
        means.append(mean)
        stds.append(std)
    return torch.stack(logps, dim=1), torch.stack(means, dim=1), torch.stack(stds)


def train_step(policy, optimizer, chains: list[Chain], advantages: torch.Tensor, ref_model, *, noise_level: float,
               steps: list[int], clip_eps: float, kl_beta: float, micro_batch_size: int, max_grad_norm: float,
               clip_eps_high: float | None = None, in_loss: torch.Tensor | None = None, scheduler=None) -> dict:
    """One optimizer step of the DiT on P groups of chains with (P, G) advantages; returns metrics.

    Each denoising step in `steps` (all of them, or a window: fewer steps, less compute) is one "token" of
    grpo.grpo_loss: ratio pi / pi_old of the step's Gaussian, PPO clip, the group's advantage; plus beta times the
    closed-form KL to the reference's step (`ref_model`: a frozen copy, or the policy itself with its LoRA adapter
    switched off). The old policy is the current one (one update per batch of chains), so the first ratio is exactly
    1. The backward runs per micro-batch of samples and per denoising step (as Flow-GRPO loops over timesteps), each
    piece weighted by its share of the samples in the loss (over every process) x S steps: the gradient is the full batch's, and the memory that of
    one step's graph for `micro_batch_size` samples, whatever the window. A group out of the loss (`in_loss` False:
    a non-finite reward) runs its pieces with their loss times 0 (under torchrun every process joins each
    collective); the step is skipped only when no process has a group in the loss. `scheduler`: stepped after the
    update if it applied (helpers/trainer.py's train_step's), or None.
    """
    policy.eval()  # no dropout: the trainer's Gaussian must be the sampler's
    if in_loss is None:
        in_loss = torch.ones(len(chains), dtype=torch.bool)
    if all_agree(not in_loss.any()):  # every group left the step (a non-finite reward): nothing to learn from
        return {"skipped": 1}
    optimizer.zero_grad(set_to_none=True)
    # the loss is a mean over samples and steps: each piece weighs its share of this process's (FSDP averages the
    # processes' gradients: over the mean count of every process's, for the gradient)
    n, n_all, S = advantages[in_loss].numel(), rows_per_process(advantages[in_loss].numel()), len(steps)
    totals, gap, ratio_min, ratio_max, finite = {}, 0.0, math.inf, -math.inf, True
    pieces = [(chain, adv, keep, slice(start, start + micro_batch_size), i)  # micro-batches of samples x single steps
              for chain, adv, keep in zip(chains, advantages, in_loss) for start in range(0, len(adv), micro_batch_size)
              for i in steps]
    for chain, adv, keep, rows, i in pieces:
        logp, means, stds = chain_logprobs(policy, chain, [i], noise_level, rows)  # (mb, 1), with grad
        eps = variants.clip_range(adv[rows], clip_eps, clip_eps_high)  # --clip-eps-high: per sample
        loss, m = grpo.grpo_loss(logp, logp.detach(), None, adv[rows], eps, 0.0)  # a step = a token
        kl = torch.zeros_like(logp)
        if kl_beta > 0:
            with torch.no_grad(), (ref_model.disable_adapter() if hasattr(ref_model, "disable_adapter")
                                   else contextlib.nullcontext()):
                ref_means = chain_logprobs(ref_model, chain, [i], noise_level, rows)[1]
            kl = gaussian_kl(means[:, 0], ref_means[:, 0], stds[0].to(means.device))[:, None]  # (mb, 1)
            loss = loss + kl_beta * kl.mean()
        share = logp.shape[0] / n / S if keep else 0.0
        finite = finite and (bool(torch.isfinite(loss)) or not keep)
        (loss * share * n / n_all).backward()  # one step's graph at a time: memory of one step, whatever the window
        gap = max(gap, (logp.detach()[:, 0] - chain.logprobs[rows][:, i]).abs().max().item())
        ratio_min, ratio_max = min(ratio_min, m["ratio_min"]), max(ratio_max, m["ratio_max"])
        for key, value in (("loss", loss.item()), ("policy_loss", m["policy_loss"]), ("kl", kl.mean().item()),
                           ("clip_frac", m["clip_frac"]), ("logprob", logp.mean().item())):
            if keep:  # a process whose groups all left the loss logs none of them
                totals[key] = totals.get(key, 0.0) + value * share
    params = [p for group in optimizer.param_groups for p in group["params"]]
    totals["grad_norm"] = torch.nn.utils.clip_grad_norm_(params, max_grad_norm).item()
    skipped, rate = 0, optimizer.param_groups[0]["lr"]
    if all_agree(finite) and math.isfinite(totals["grad_norm"]):  # every process steps, or none
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
    else:  # a NaN / inf never reaches the weights
        optimizer.zero_grad(set_to_none=True)
        skipped = 1
    return {**totals, "ratio_min": ratio_min, "ratio_max": ratio_max, "sampler_gap": gap, "skipped": skipped,
            "sequences": n, "lr": rate}


LORA_TARGETS = r".*transformer_blocks\.\d+\.(attn1\.(to_q|to_k|to_v|to_out\.0)|ff\.net\.(0\.proj|2))"


def apply_lora(transformer, rank: int, seed: int = 0):
    """LoRA adapters (peft) on the DiT's attention and MLP projections, the rest frozen; seeded like setup.apply_lora.
    Injected in place, so the pipeline samples with them; the returned PeftModel switches them off (the reference)
    and saves the adapter alone."""
    from peft import LoraConfig, get_peft_model
    config = LoraConfig(r=rank, lora_alpha=rank, lora_dropout=0.0, target_modules=LORA_TARGETS)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return get_peft_model(transformer, config)


def setup_training(pipe, cfg, dtype: torch.dtype, world: int):
    """helpers/setup.setup_training with the DiT as the policy (LoRA: `apply_lora`); the AR frozen, as it only samples the
    tokens the DiT paints from. Returns the policy, the KL reference (or None) and the optimizer."""
    pipe.vision_language_encoder.requires_grad_(False)
    policy = pipe.transformer.requires_grad_(True)
    if cfg.lora_rank:  # adapters in float32 (peft's default), the DiT's own weights frozen
        policy = apply_lora(policy, cfg.lora_rank, cfg.seed)
    if cfg.gradient_checkpointing:
        policy.enable_gradient_checkpointing()
    return setup.setup_training(pipe, cfg, dtype, world, grpo.reference_model, policy)


def window(chain_steps: int, sde_window: int) -> list[int]:
    """The denoising steps that are SDE steps and trained: the first `sde_window` of the chain (0: all); the sampler
    takes ODE steps after them, so the group's rewards differ only by what the trained steps drew (and the initial
    noise). Fewer steps cost proportionally less in the update (Flow-GRPO-Fast trains a window of the chain too)."""
    return list(range(min(sde_window, chain_steps) if sde_window else chain_steps))


@dataclasses.dataclass
class DitConfig(grpo.Config):  # grpo.py's flags, and the SDE sampler's
    sde_noise: float = grpo.arg(0.7, "noise level of the SDE step (Flow-GRPO's a)")
    sde_steps: int = grpo.arg(0, "steps of the training chains (0: --num-inference-steps)")
    sde_window: int = grpo.arg(0, "SDE (trained) steps first, ODE steps after (0: all SDE)")


def parse_config(argv: list[str]) -> DitConfig:
    """Command line -> DitConfig: grpo.py's defaults and presets, but one update per batch of chains (--mu 1), no KL on
    the tiny model, gradient checkpointing on the real DiT (where the command line leaves them out)."""
    argv = ["--train", "dit", *argv]
    tiny = run.parse_flags(run.with_run_settings(DitConfig), argv)["model"] in grpo.TINY_MODELS
    dit = {"mu": 1, "gradient_checkpointing": not tiny} | ({"kl_beta": 0.0} if tiny else {})
    return trainer.parse_config(grpo, argv, DitConfig, dit)


def main(argv: list[str] | None = None) -> dict:
    """grpo.py's main with the DiT as the policy: the same checks, set-up, logging and checkpoints (helpers/run.py)."""
    argv = sys.argv[1:] if argv is None else argv
    job = run.prepare(parse_config(argv), argv, trainer.reward_table(grpo), grpo, train="dit")  # the Run
    cfg = job.cfg
    run.start(job)
    with run.timed({}, "load", job), run.loading(cfg.model):
        pipe = trainer.load(grpo, cfg, job.device, job.dtype)
    with run.timed({}, "setup", job):
        policy, ref_model, optimizer = setup_training(pipe, cfg, job.dtype, job.world)
        run.open_run(job, policy, optimizer)

    # the pipeline's ODE, as grpo.py evaluates
    sample = functools.partial(trainer.sample_groups, grpo)  # grpo.py's sampler, by the fast decode
    job.evaluate = run.evaluator(job, pipe, policy, (sample, grpo.decode_images, grpo.group_rewards))

    with run.training(job):
        for step, group_ids, examples, seconds in run.steps(job):
            seeds = [grpo.group_seed(cfg.seed, g) for g in group_ids]  # the AR's sample and the decoder's noise
            with run.timed(seconds, "sample", job), job.autocast:  # 1. ONE token grid per prompt, shared by the group
                tokens = sample(pipe, prompts=[ex["prompt"] for ex in examples], group_size=1, height=cfg.height,
                                width=cfg.width, temperature=cfg.temperature, seeds=seeds, top_k=cfg.top_k,
                                top_p=cfg.top_p)
            with run.timed(seconds, "decode", job), run.decoder_on(pipe, job.device, cfg.offload), unsharded(policy):
                chains = [sample_chain(pipe, ex["prompt"], t.tokens.repeat(cfg.group_size, 1), t.prompt.large_hw, cfg.height,
                                       cfg.width, cfg.sde_steps or cfg.num_inference_steps, cfg.guidance_scale, s,
                                       cfg.sde_noise, cfg.sde_window)  # 2. G pictures by the SDE sampler
                          for ex, t, s in zip(examples, tokens, seeds)]
            with run.timed(seconds, "reward", job):  # 3.-4. as for the AR
                reward, each = grpo.group_rewards([c.images for c in chains], examples, job.rewards)
                in_loss = run.finite_groups(job, step, reward, each, examples)  # (P,): NaN / inf: A = 0, out, warned
                advantages = variants.advantages(grpo.group_advantages(reward), [], reward, each, in_loss,
                                                 cfg, grpo)  # --scale-rewards
            with run.landing():  # from here the step lands whole or not at all: a stop waits
                with run.timed(seconds, "train", job), job.autocast:  # 5. the update, each trained step a token
                    metrics = train_step(policy, optimizer, chains, advantages, ref_model, noise_level=cfg.sde_noise,
                                         steps=window(len(chains[0].timesteps), cfg.sde_window),
                                         clip_eps=cfg.clip_eps, clip_eps_high=cfg.clip_eps_high,
                                         kl_beta=cfg.kl_beta, micro_batch_size=cfg.micro_batch_size,
                                         max_grad_norm=cfg.max_grad_norm, in_loss=in_loss,
                                         scheduler=job.scheduler)
                run.log_step(job, step, group_ids, reward, each, advantages, in_loss,
                             [c.latents[:, -1] for c in chains], metrics, seconds, [c.images for c in chains])
                run.after_step(job, step, examples, [c.images for c in chains], reward, each)
            run.evaluation(job, step)
    return run.finish(job)


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:  # Ctrl-C while loading or checking (the training loop handles its own): no traceback
        print("dit_grpo.py: interrupted", file=sys.stderr)
        raise SystemExit(130) from None
    run.leave()  # torchrun: a finished process exits before a gloo thread can abort it
