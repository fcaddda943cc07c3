"""The lab's trainer around grpo.py's lesson: `python grpo.py ...` runs `main` here.

grpo.py is the algorithm for one process, read top to bottom: its `train` runs steps 1-5. A lab's run needs more
around the same steps, and this file wraps them:
  - the presets (PRESETS: the real model's settings where the command line leaves them out) and the command line
    (helpers/run.py: every flag checked before anything is written);
  - the fast sampler (helpers/fast_decode.py: the same tokens as grpo.generate, many prompts in one decode, CUDA
    graphs on a GPU), as `sample_groups`;
  - `train_step`, grpo.update made robust for many processes: under torchrun a group with a NaN reward still runs
    its forward and backward with its loss times 0 (every process joins each of FSDP's collectives), the loss shares
    count every process's sequences, the processes agree on skipping an update; the learning-rate schedule; the
    diagnostics (helpers/diagnostics.py) and the options beside the lesson (helpers/variants.py: its two seams);
  - checkpoints, logging, trackers, evaluation, the before / after grids, stops that resume exactly (helpers/run.py).
In one process, at the lesson's settings, `main` gives `train`'s numbers bit for bit (test_grpo.py::test_train), and
`train_step` gives `update`'s (test_grpo.py::test_update_and_the_trainers_step).

It never imports grpo.py: the lesson arrives as an argument, `lesson` (imports run one way: grpo.py -> helpers/).
"""

import contextlib
import dataclasses
import functools
import math
import sys
import warnings
from typing import NamedTuple

import torch

from . import diagnostics, fast_decode, run, setup, variants
from .parallel import all_agree, merge_metrics, rows_per_process, unsharded
from .rewards import MORE_REWARDS


# ---- The presets and the command line -----------------------------------------------------------

PRESETS = run.PRESETS  # the real model's settings where the command line leaves them out: (tiny, real)
TINY_NAMES = run.TINY_NAMES


def reward_table(lesson) -> dict:
    """Every reward a --reward name may name: grpo.py's (ssim, mse) and helpers/rewards.py's (shapes, ocr, ...)."""
    return {**lesson.REWARDS, **MORE_REWARDS}


def parse_config(lesson, argv: list[str] | None = None, config: type | None = None, presets: dict | None = None):
    """The command line (a --config file's keys, then the flags) -> the run's config: grpo.Config's fields (or
    `config`'s: dit_grpo.DitConfig), the variants' and the run's; where the model is not tiny, PRESETS' real value for
    each setting the command line leaves out, and `presets` ({field: value}) for those too; micro_batch_size 0 is the
    group size."""
    config = run.with_run_settings(config or lesson.Config)
    flags = run.parse_flags(config, argv)
    given = run.given_flags(config, argv)
    real = flags.get("model", "tiny") not in TINY_NAMES
    defaults = {name: pair[1] for name, pair in PRESETS.items() if real} | (presets or {})
    cfg = config(**(flags | {name: value for name, value in defaults.items() if name not in given}))
    if cfg.micro_batch_size == 0:  # a whole group in one forward pass
        cfg = dataclasses.replace(cfg, micro_batch_size=cfg.group_size)
    return cfg


# ---- Sampling: the fast decode, the lesson's tokens --------------------------------------------

class Sampled(NamedTuple):  # grpo.Rollout's fields, and the codes each top-k / top-p draw kept
    prompt: object  # grpo.Prompt
    tokens: torch.Tensor  # (G, N)
    q_logprobs: torch.Tensor  # (G, N)
    p_logprobs: torch.Tensor  # (G, N)
    support: torch.Tensor | None = None  # (G, N, ceil(K/8)) uint8, 8 codes a byte (fast_decode.support_bits)


@torch.no_grad()
def sample_groups(lesson, pipe, prompts: list[str], group_size: int, height: int, width: int, temperature: float,
                  seeds: list[int], top_k: int = 0, top_p: float = 1.0, sources: list | None = None) -> list[Sampled]:
    """grpo.sample_groups' groups, drawn by helpers/fast_decode.py: the same tokens as grpo.generate for the same
    seeds (tests/test_fast_decode.py), all P groups in one padded decode."""
    model = pipe.vision_language_encoder.eval()
    encoded = [lesson.group_prompt(pipe, text, group_size, height, width) if source is None else
               lesson.edit_prompt(pipe, text, group_size, height, width, source)
               for text, source in zip(prompts, sources or [None] * len(prompts), strict=True)]
    drawn = fast_decode.sample_groups(model, encoded, temperature, seeds, top_k, top_p, prompts,
                                      lesson.code_logprobs, lesson.rope_positions)
    return [Sampled(prompt, d.tokens, d.q_logprobs, d.p_logprobs, d.support) for prompt, d in zip(encoded, drawn)]


# ---- The update, robust for many processes -----------------------------------------------------

class MicroBatch(NamedTuple):  # grpo.MicroBatch's fields, and what the trainer and the variants read
    inputs: dict
    tokens: torch.Tensor  # (mb, N)
    sampler_logprobs: torch.Tensor  # (mb, N)
    advantages: torch.Tensor  # (mb,)
    n_preview: int
    rollout: Sampled  # where they come from: rollout.tokens[rows] is `tokens`
    rows: slice
    support: torch.Tensor | None = None  # (mb, N, K) bool: the trained distribution's codes at each token; None: all
    # K, the whole softmax p (helpers/variants.py: --policy-dist truncated sets it)
    in_loss: bool = True  # False: its group's reward was not finite. It still runs its forward and backward (under
    # torchrun every process must join each collective), with its loss times 0


def micro_batches(rollouts: list, advantages: torch.Tensor, size: int,
                  in_loss: torch.Tensor | None = None) -> list[MicroBatch]:
    """grpo.micro_batches, every group kept: P rollouts, their (P, G) advantages and (P,) bool `in_loss` (default:
    all) -> MicroBatches of `size` rows, a group's in order."""
    if in_loss is None:
        in_loss = torch.ones(len(rollouts), dtype=torch.bool)
    batches = []
    for rollout, A, trained in zip(rollouts, advantages, in_loss, strict=True):
        for start in range(0, len(A), size):
            rows = slice(start, start + size)
            batches.append(MicroBatch(
                inputs=rollout.prompt.inputs, tokens=rollout.tokens[rows], sampler_logprobs=rollout.p_logprobs[rows],
                advantages=A[rows], n_preview=math.prod(rollout.prompt.preview_hw), rollout=rollout, rows=rows,
                in_loss=bool(trained)))
    return batches


@torch.no_grad()
def reference_logprobs(lesson, ref_model, mb: MicroBatch, temperature: float) -> torch.Tensor | None:
    """grpo.reference_logprobs on the micro-batch's trained distribution (its support's codes, all by default)."""
    if ref_model is None:
        return None
    if mb.support is None:
        return lesson.reference_logprobs(ref_model, mb, temperature)
    K = ref_model.config.vq_config.num_embeddings
    with getattr(ref_model, "disable_adapter", contextlib.nullcontext)():
        logits = lesson.token_logits(ref_model, mb.inputs, mb.tokens)
    return lesson.logprob_of(variants.distribution(lesson, logits, temperature, K, mb.support), mb.tokens)


@torch.no_grad()
def sequence_logprobs(lesson, policy, ref_model, temperature: float, size: int, autocast, rollout) -> tuple:
    """A rollout's (G, N) log-probs under the policy as it is before the step's update (pi_old) and under the frozen
    reference, both teacher-forced (grpo.token_logprobs) under the run's autocast, `size` rows at a time
    (--micro-batch-size): what --kl-in-reward and --mara-threshold read (helpers/variants.py's kl_regularised). Read
    from the trainer, not the sampler: its rounding (bf16 kernels on a GPU) would be summed into the advantage."""
    batches = micro_batches([rollout], torch.zeros(1, len(rollout.tokens)), size)
    with autocast:  # (with LoRA the reference is the policy, its adapter switched off: grpo.reference_logprobs)
        ref = torch.cat([reference_logprobs(lesson, ref_model, mb, temperature).float() for mb in batches])
        policy_logprobs = torch.cat([lesson.token_logprobs(policy, mb.inputs, mb.tokens, temperature).float()
                                     for mb in batches])
    return policy_logprobs, ref


def active_dropout(model) -> list[str]:
    """The names of `model`'s modules that drop out now: in train mode with a dropout p > 0."""
    dropping = []
    for name, module in model.named_modules():
        p = module.p if isinstance(module, torch.nn.Dropout) else 0.0
        attention = getattr(module, "attention_dropout", None)
        if isinstance(attention, float):  # (a Dropout module there is found as a module)
            p = max(p, attention)
        if module.training and p > 0:
            dropping.append(name or type(module).__name__)
    return dropping


def train_mode(policy) -> None:
    """The policy in the mode train_step trains it in, or a one-line refusal: transformers only checkpoints
    activations in train mode, and without dropout train and eval mode are one policy; with a dropout on, each
    forward would draw another policy, so pi_old would not be the sampler's and the ratio would leave 1 at lr 0."""
    policy.train(policy.is_activation_checkpointing)
    dropping = active_dropout(policy)
    if dropping:
        raise ValueError(f"train_step: {dropping[0]} drops out in train mode, so pi != pi_old; "
                         "set its p to 0 (disable_dropout) or put the model in eval mode")


def train_step(lesson, policy, optimizer, batches: list[MicroBatch], ref_model, loss_fn, *, temperature: float,
               mu: int, max_grad_norm: float, readings=None, scheduler=None) -> dict:
    """grpo.update for many processes: `mu` updates of the policy on one step's micro-batches -> metrics.
    `loss_fn(distribution, mb, old_logprobs, ref_logprobs)`: grpo.micro_batch_loss with its settings, or a variant's
    wrapper of it (helpers/variants.py). `readings(logits, mb, old_logprobs, ref_logprobs)`: docs/healthy_training.md's
    measurements beside the loss (helpers/diagnostics.py), or None. `scheduler`: a learning-rate schedule stepped after
    each update applied (transformers' get_scheduler; metrics' "lr": the first update's rate), or None.
    A micro-batch out of the loss (mb.in_loss False: its group's reward was not finite) runs with its loss times 0;
    the step is skipped only when no process has one in the loss. The metrics' "sequences": those in the loss here
    (helpers/parallel.py averages the processes' metrics by them)."""
    train_mode(policy)
    if all_agree(not any(mb.in_loss for mb in batches)):  # every group left (non-finite rewards)
        return {"skipped": mu}
    K = policy.config.vq_config.num_embeddings
    shares = loss_shares(batches)  # the loss is a mean over sequences: each micro-batch's weight
    ref_logprobs = [reference_logprobs(lesson, ref_model, mb, temperature) for mb in batches]  # no gradient
    rate = optimizer.param_groups[0]["lr"]  # the first update's learning rate (logged)
    old_logprobs = [None] * len(batches)  # pi_old's, filled by the first update
    updates, skipped = [], 0  # each update's micro-batches: (metrics, share)
    for _ in range(mu):
        optimizer.zero_grad(set_to_none=True)
        update = []
        for k, mb in enumerate(batches):  # gradient accumulation, a micro-batch at a time
            logits = lesson.token_logits(policy, mb.inputs, mb.tokens)  # (rows, N, V), with grad
            trained = variants.distribution(lesson, logits, temperature, K, mb.support)  # pi_theta
            if old_logprobs[k] is None:  # the first update: pi_theta IS pi_old, r = 1
                old_logprobs[k] = lesson.logprob_of(trained, mb.tokens).detach()
            loss, metrics = loss_fn(trained, mb, old_logprobs[k], ref_logprobs[k])
            (loss * shares[k]).backward()  # even out of the loss: every process joins FSDP's sync
            if mb.in_loss:
                if readings is not None:
                    metrics |= readings(logits.detach(), mb, old_logprobs[k], ref_logprobs[k])
                update.append((metrics, shares[k]))
        updates.append(update)
        grad_norm, stepped = optimizer_step(optimizer, update, max_grad_norm)  # one step an update
        skipped += not stepped
        if stepped and scheduler is not None:  # the next update's rate (a skipped update moves none)
            scheduler.step()
    sequences = sum(len(mb.tokens) for mb in batches if mb.in_loss)  # in the loss, this process
    return merge_metrics(updates) | {"grad_norm": grad_norm,  # the last update's, before its clip
                                     "skipped": skipped, "sequences": sequences, "lr": rate}


def loss_shares(batches: list[MicroBatch]) -> list[float]:
    """Each micro-batch's weight in the step's loss, a mean over the sequences in the loss: its rows over the rows in
    the loss (0 out of the loss). Under torchrun FSDP averages the processes' gradients, so the rows counted are the
    mean over the processes of each one's (rows_per_process), which makes the gradient the mean over every sequence of
    every process."""
    sequences = sum(len(mb.tokens) for mb in batches if mb.in_loss)
    n_rows = rows_per_process(sequences)
    return [len(mb.tokens) / n_rows if mb.in_loss else 0.0 for mb in batches]


def optimizer_step(optimizer, parts: list[tuple[dict, float]], max_grad_norm: float) -> tuple[float, bool]:
    """Clip the accumulated gradient and step -> its norm before the clip, and whether it stepped: a non-finite loss
    (in `parts`: each micro-batch's metrics and share) or gradient in any process skips the step, and never reaches
    the weights."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    grad_norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm).item()
    finite = math.isfinite(grad_norm) and all(math.isfinite(m["loss"]) for m, _ in parts)
    if all_agree(finite):  # every process steps, or none
        optimizer.step()
        # bf16 autocast keeps the copies of the weights it cast until its region ends, and train_step runs in one:
        # without this the next update would read the weights before this step (pi = pi_old, r = 1, no clip)
        torch.clear_autocast_cache()
        return grad_norm, True
    optimizer.zero_grad(set_to_none=True)
    return grad_norm, False


def trained_model(lesson, pipe, cfg):
    """grpo.trained_model with peft's one FutureWarning quieted (it asks transformers' old name for activation
    checkpointing): the AR with LoRA or every weight, activations recomputed if asked."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning)
        return lesson.trained_model(pipe, cfg.lora_rank, cfg.gradient_checkpointing, cfg.seed)


def load(lesson, cfg, device: str, dtype: torch.dtype):
    """The pipeline: grpo.load_glm_image, or for random[:L] GLM-Image built from its published configs with random
    weights, L layers a part (helpers/offline_model.py)."""
    if cfg.model.split(":")[0] == "random":
        from .offline_model import random_glm_image
        return lesson.only_ar_trains(random_glm_image(cfg.model, device, dtype))
    return lesson.load_glm_image(cfg.model, device, dtype, cfg.revision)


# ---- The loop with the run's plumbing around it ---------------------------------------------------

def main(lesson, argv: list[str] | None = None) -> dict:
    """The command line's run (`lesson`: grpo.py): grpo.train's steps 1-5 with the run's plumbing around them
    (helpers/run.py: the checks, processes, timing, checkpoints, logging, evaluation) and the two seams of the options
    beside the lesson (helpers/variants.py). Returns the run's summary."""
    try:
        summary = run_steps(lesson, argv)
    except KeyboardInterrupt:  # Ctrl-C while loading or checking (training handles its own)
        print(f"{run.PROG['name']}: interrupted", file=sys.stderr)
        raise SystemExit(130) from None
    run.leave()  # torchrun: a finished process exits before a gloo thread can abort it
    return summary


def run_steps(lesson, argv: list[str] | None) -> dict:
    """`main`'s run itself."""
    job = run.prepare(parse_config(lesson, argv), argv, reward_table(lesson), lesson)  # all checked, none written
    cfg = job.cfg
    run.start(job)  # torchrun: one process per GPU (else rank 0 of 1), the device and dtype
    with run.timed({}, "load", job), run.loading(cfg.model):
        pipe = load(lesson, cfg, job.device, job.dtype)
    with run.timed({}, "setup", job):
        policy, ref_model, optimizer = setup.setup_training(  # the AR: LoRA, FSDP2, AdamW
            pipe, cfg, job.dtype, job.world, lesson.reference_model, trained_model(lesson, pipe, cfg))
        run.open_run(job, policy, optimizer, ref_model)  # --resume's checkpoint; the run directory
    sample = functools.partial(sample_groups, lesson)
    # the before / after grids and --eval-prompts: steps 1-3 on fixed seeds (helpers/run.py)
    job.evaluate = run.evaluator(job, pipe, policy, (sample, lesson.decode_images, lesson.group_rewards))
    loss = functools.partial(lesson.micro_batch_loss, clip_eps=cfg.clip_eps, kl_beta=cfg.kl_beta,
                             sampler_cap=cfg.sampler_cap)
    readings = diagnostics.reader(cfg, policy.config.vq_config.num_embeddings, lesson)  # docs/healthy_training.md's
    with run.training(job):  # Ctrl-C: a checkpoint, exit 130; a full disk: one line, exit 1
        # each step: P examples (prompts, targets, sources), numbered over the run by group_ids
        for step, group_ids, examples, seconds in run.steps(job):
            with run.timed(seconds, "sample", job), job.autocast, unsharded(policy):
                rollouts = sample(  # 1. sample a group of token grids per prompt
                    pipe, prompts=[ex["prompt"] for ex in examples], group_size=cfg.group_size, height=cfg.height,
                    width=cfg.width, temperature=cfg.temperature,
                    seeds=[lesson.group_seed(cfg.seed, g) for g in group_ids], top_k=cfg.top_k, top_p=cfg.top_p,
                    sources=[ex.get("source") for ex in examples])
            with run.timed(seconds, "decode", job), run.decoder_on(pipe, job.device, cfg.offload):
                images = [lesson.decode_images(  # 2. decode the tokens to pictures
                    pipe, prompt=ex["prompt"], tokens=rollout.tokens, large_hw=rollout.prompt.large_hw,
                    height=cfg.height, width=cfg.width, num_inference_steps=cfg.num_inference_steps,
                    seed=cfg.decode_seed, guidance_scale=cfg.guidance_scale, source=rollout.prompt.source)
                    for ex, rollout in zip(examples, rollouts)]
            with run.timed(seconds, "reward", job):
                reward, each = lesson.group_rewards(images, examples, job.rewards)  # 3. score: (P, G)
                # (P,) bool, False for a group with a NaN / inf reward (warned): A 0, loss out
                in_loss = run.finite_groups(job, step, reward, each, examples)
                advantages = variants.advantages(  # 4. z-scores within each group (and the variants' seam)
                    lesson.group_advantages(reward), rollouts, reward, each, in_loss, cfg, lesson, images,
                    functools.partial(sequence_logprobs, lesson, policy, ref_model, cfg.temperature,
                                      cfg.micro_batch_size, job.autocast), job.variants)
            with run.landing():  # from here the step lands whole or not at all: a stop waits
                with run.timed(seconds, "train", job), job.autocast:  # 5. the clipped update
                    # the variants' seam of step 5: their micro-batches and loss (else as given)
                    micro, loss_fn = variants.update(
                        micro_batches(rollouts, advantages, cfg.micro_batch_size, in_loss), loss, policy, cfg,
                        lesson, reward, each, job.variants)
                    metrics = train_step(lesson, policy, optimizer, micro, ref_model, loss_fn,
                                         temperature=cfg.temperature, mu=cfg.mu, max_grad_norm=cfg.max_grad_norm,
                                         readings=readings, scheduler=job.scheduler)
                run.log_step(job, step, group_ids, reward, each, advantages, in_loss, rollouts, metrics, seconds,
                             images)
                run.after_step(job, step, examples, images, reward, each)  # reference, checkpoint
            run.evaluation(job, step)  # --eval-prompts, when due
    return run.finish(job)  # the last checkpoint, final/, curves.png, the after grid, the summary
