"""The plumbing of a GRPO run, kept out of grpo.py so that grpo.py reads as the algorithm: input files and their
checks, the run's set-up on one or many processes, the training loop's bookkeeping (metrics lines, image grids,
checkpoints, evaluation output, Ctrl-C, out of memory, a full disk) and the summary.

grpo.py (the AR) and dit_grpo.py (the DiT) import this file; it imports neither: what it needs of them arrives as
arguments (the config, the reward table, an evaluation function), as cleanrl's helpers receive the script's pieces.
Everything here is checked before anything is written, and a problem is one line on stderr and exit 2 (`fail`).
"""

import argparse
import contextlib
import dataclasses
import errno
import functools
import json
import math
import os
import re
import sys
import time
import warnings
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from tqdm.auto import tqdm

from .parallel import (INTERRUPT, bars_shown, final_weights, gather_list, gather_rows, inner_bar, interrupts_caught,
                       interrupts_held,
                       load_trainable_state, reduce_metrics, start_processes, stop_processes, stop_requested,
                       trainable_state, unsharded)
from .rewards import folder_path, hub_cached, unreachable_hub
from .served_reward import RETRY_WAITS, is_url
from .user_input import (RULES, RewardError, changed_inputs, check_numbers, check_rewards, field_kind, input_digests,
                         load_examples, parse_rewards, read_config_file, read_prompts, split_reward)
from .variants import State as VariantState, VariantSettings
from . import monitor, variants
from .run_io import (RUN_FILES, Reporter, append_metrics, atomic_folder, atomic_write, check_out_dir, check_reporter,
                     checkpoint_steps, failed_start, hold_run_dir, image_grid, open_run_dir, plot_curves,
                     prune_checkpoints, read_checkpoint, read_inputs, read_metrics, read_resume, release_run_dir,
                     restore_rng, resume_point, rng_kept, rng_state, save_checkpoint, save_image, save_trained,
                     seed_everything, side_by_side, what_trained)

SCRIPTS = {"ar": "grpo.py", "dit": "dit_grpo.py"}  # the entry point of each --train
PROG = {"name": "grpo.py"}  # the script the messages name: set by prepare
TINY_NAMES = ("tiny", "tiny-edit")  # grpo.TINY_MODELS' names: shipped folders, the tiny defaults, float32
RESUMABLE = ("steps", "device", "report_to", "save_every", "save_total_limit", "save_merged", "image_every",
             "eval_every", "overwrite", "push_to_hub", "hub_model_id", "hub_private", "wandb_project", "wandb_entity",
             "run_name", "reward_timeout", "reward_wait", "monitor_threshold")  # what --resume may change: when to stop, where, how long
# to wait, bookkeeping; not the objective (--reward and --eval-reward only where a served reward moved: served_moves)


@dataclasses.dataclass
class Run:
    """One run, as the helpers below share it (instead of ten-argument tails)."""
    cfg: object  # grpo.Config
    out: Path  # the run directory (--out, or --resume's)
    start: int  # the steps done before this invocation (0, or --resume's checkpoint)
    checkpoint: Path | None  # --resume's trainer_state.pt (checkpoints/step-N/), or None
    examples: list[dict]  # the prompts file, images loaded (on the device once `open_run` ran)
    rewards: dict  # --reward: {name: (fn, weight)}
    evals: tuple | None  # --eval-prompts: (examples, rewards), or None
    lesson: object  # grpo.py itself (its TINY_MODELS, load_glm_image): passed in, never imported
    rank: int = 0  # this process, of `world` (torchrun)
    world: int = 1
    device: str = "cpu"
    dtype: torch.dtype = torch.float32
    autocast: object = contextlib.nullcontext()  # bf16 autocast on the device when --dtype is bf16
    policy: object = None  # the trained model and its optimizer, for checkpoints
    optimizer: object = None
    scheduler: object = None  # --lr-scheduler's, stepped after each optimizer update (lr_schedule)
    variants: VariantState = dataclasses.field(default_factory=VariantState)  # carried from step to step (variants.py)
    evaluate: Callable | None = None  # (examples, seeds, rewards, n_samples) -> images, total, each, layouts: one
    # process's `evaluate`, with the policy ready to sample (`evaluator`; evaluate_shared shares the examples out)
    reporter: Reporter | None = None
    progress: object = None
    history: list = dataclasses.field(default_factory=list)  # the training metrics lines, this run's and before
    evaluated: set = dataclasses.field(default_factory=set)  # steps evaluated before a --resume
    skipped: int = 0  # updates skipped for a non-finite loss or gradient
    done: int = 0  # steps whose update is applied and logged
    saved: int = -1  # the step of the last checkpoint written (or resumed from)
    rng: dict | None = None  # the RNG states as the last landed step left them: what a checkpoint saves
    inputs: dict | None = None  # inputs.json: the directory the run started in and {file: sha256} of all it reads


# ---- The command line and its checks, before anything is written ---------------------------------

def _setting(default, help: str, choices: tuple = ()):
    """A run field whose doc becomes its --help, as grpo.arg."""
    return dataclasses.field(default=default, metadata={"help": help, "choices": choices})


@dataclasses.dataclass
class RunSettings:  # the run's flags, after the algorithm's (grpo.Config): where it writes, what it evaluates
    out: str = _setting("runs/grpo", "output directory")
    before_after: int = _setting(4, "prompts drawn before and after training, side by side")
    offload: bool = _setting(False, "keep DiT, VAE, T5 on CPU except to decode")
    image_every: int = _setting(10, "save an image grid every N steps (0: never)")
    eval_prompts: str = _setting("", "held-out prompts (as --prompts; .jsonl may add a \"category\")")
    eval_every: int = _setting(25, "evaluate every N steps (0: only before the first and after the end)")
    eval_samples: int = _setting(4, "images per eval prompt")
    eval_inference_steps: int = _setting(0, "DiT steps of the evaluations and the before / after grids (0: "
                                            "--num-inference-steps; Flow-GRPO trains at 10, evaluates at 40)")
    eval_reward: str = _setting("", "rewards only measured on the eval prompts, e.g. shapes_exact")
    monitor_threshold: float = _setting(6.0, "the reward-hacking monitor warns (one line, once a signal; the run goes "
                                             "on) when a picture statistic, the pictures' diversity or a measured-only "
                                             "reward moves this many spreads of the first 20 steps' (0: no warnings; "
                                             "helpers/monitor.py, docs/healthy_training.md)")
    reward_timeout: float = _setting(600.0, "seconds a served reward (--reward http://HOST:PORT/NAME) may take to "
                                            "answer a group, from connecting to its answer's last byte, before it is "
                                            "tried again (docs/rewards.md)")
    reward_wait: float = _setting(0.0, "seconds the start-up check waits for a served reward whose server is still "
                                       "starting, trying every 2 s (0: one try)")
    save_every: int = _setting(50, "save a checkpoint (<out>/checkpoints/step-N/) every N steps (0: only at the end)")
    save_total_limit: int = _setting(0, "keep only the latest K checkpoints (0: keep all)")
    save_merged: bool = _setting(False, "also write <out>/final/pipeline/: the whole pipeline, LoRA merged, that "
                                        "GlmImagePipeline.from_pretrained loads alone")
    resume: str = _setting("", "continue a run: its directory (from its latest checkpoint) or RUN/checkpoints/step-N "
                               "(--steps is the total)")
    overwrite: bool = _setting(False, "replace the run in --out (with --resume RUN/checkpoints/step-N: delete the "
                                      "later checkpoints)")
    train: str = _setting("ar", "ar (grpo.py) or dit (python dit_grpo.py, with its own flags)", ("ar", "dit"))
    device: str = _setting("auto", "cpu | cuda | auto", ("auto", "cpu", "cuda"))
    report_to: str = _setting("none", "also log to: none, tensorboard, wandb, or a comma list (wandb runs online unless "
                                      "WANDB_MODE says otherwise, e.g. offline)")
    wandb_project: str = _setting("grpo-glm-image", "the wandb project (--report-to wandb)")
    wandb_entity: str = _setting("", "the wandb team or user ('': your default)")
    run_name: str = _setting("", "the run's name in the trackers ('': --out's folder name)")
    push_to_hub: bool = _setting(False, "at the end, upload final/ (with --save-merged, its pipeline/ too) to the "
                                        "hub as --hub-model-id (huggingface_hub; needs a token: hf auth login)")
    hub_model_id: str = _setting("", "the hub repository --push-to-hub creates or updates, e.g. you/glm-image-grpo")
    hub_private: bool = _setting(True, "a repository --push-to-hub creates is private (make it public on the hub, or "
                                       "--no-hub-private)")
    lr_scheduler: str = _setting("constant", "the learning rate over --steps, after the warmup: constant, linear "
                                             "(toward 0) or cosine (toward 0), transformers' get_scheduler stepped "
                                             "after each optimizer update (--mu a step), as Trainer and TRL step it",
                                 ("constant", "linear", "cosine"))
    warmup_steps: int = _setting(0, "steps (--warmup-steps x --mu optimizer updates) whose rate rises linearly from "
                                    "0 to --lr (the first update at 0, as in transformers' schedules)")
    dtype: str = _setting("auto", "float32 | bfloat16 | auto", ("auto", "float32", "bfloat16"))


_WITH_RUN = {}  # one combined class per config class: configs of one run compare equal


def with_run_settings(config: type) -> type:
    """The dataclass `config` (grpo.Config, DitConfig) with the variants' fields (helpers/variants.py) and RunSettings'
    after its own, under its name: what the command line sets and config.json holds."""
    if config not in _WITH_RUN:
        fields = [(f.name, f.type, dataclasses.field(default=f.default, metadata=f.metadata))
                  for settings in (VariantSettings, RunSettings) for f in dataclasses.fields(settings)]
        _WITH_RUN[config] = dataclasses.make_dataclass(config.__name__, fields, bases=(config,))
        _WITH_RUN[config].__module__ = config.__module__
    return _WITH_RUN[config]


PRESETS = {  # the real model's settings, where grpo.Config's defaults (and the run's) are the tiny model's: (tiny, real)
    "group_size": (8, 4), "prompts_per_step": (2, 1), "kl_beta": (0.1, 0.04), "mu": (2, 1), "lr": (1e-4, 1e-5),
    "micro_batch_size": (0, 1), "top_p": (1.0, 0.75), "shuffle": (False, True), "height": (96, 1024),
    "width": (96, 1024), "num_inference_steps": (2, 50), "guidance_scale": (1.0, 1.5), "lora_rank": (0, 16),
    "before_after": (4, 0),
}


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """--help with each flag's default, except where the default is None or the help says its own (a preset's: its
    tiny and real defaults)."""

    def _get_help_string(self, action):
        if action.default is None or "(default: " in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def config_parser(config, default=None) -> argparse.ArgumentParser:
    """One flag per field of the dataclass `config` (the name with dashes), defaulting to the field's default (or to
    `default`); a field's metadata gives its --help. --config FILE: the fields in a file (parse_flags reads it)."""
    parser = argparse.ArgumentParser(description="GRPO on GLM-Image", formatter_class=DefaultsHelpFormatter)
    parser.add_argument("--config", default=argparse.SUPPRESS, metavar="FILE", help=(
        "a YAML or JSON file of flags by field name (group_size: 4), a run's config.json included; the command line "
        "overrides it, and resume / overwrite are read from the command line only (default: none)"))
    for f in dataclasses.fields(config):
        flag, kind = "--" + f.name.replace("_", "-"), field_kind(f)
        value = f.default if default is None else default
        rule = f" [{RULES[f.name].text()}]" if f.name in RULES else ""  # a number's range, as validate checks it
        text = f.metadata["help"]
        if f.name in PRESETS:  # its default depends on the model
            text += " (default: {} tiny, {} real)".format(*PRESETS[f.name])
        if kind is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=value, help=text)
        else:
            parser.add_argument(flag, type=kind, default=value, help=text + rule)
    return parser


def parse_flags(config, argv: list[str] | None = None) -> dict:
    """The command line -> {field: value} for the dataclass `config`. With --config FILE the file's values replace
    the fields' defaults, and the flags given on the command line override them (as TRL's TrlParser does: the file
    sets the parser's defaults)."""
    parser = config_parser(config)
    file = config_file(argv)
    if file:
        try:
            parser.set_defaults(**read_config_file(file, config))
        except ValueError as error:
            fail(str(error))
    flags = vars(parser.parse_args(argv))
    flags.pop("config", None)
    return flags


def config_file(argv: list[str] | None) -> str | None:
    """--config's value on the command line `argv` (sys.argv's when None), or None."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config")
    return pre.parse_known_args(sys.argv[1:] if argv is None else argv)[0].config


def given_flags(config, argv: list[str] | None = None, saved: dict | None = None) -> set[str]:
    """The fields of `config` the command line sets itself (not left at their defaults), its --config file's
    included; with `saved` (a resumed run's config.json) only the file's values that differ from it (a job script
    that always passes its --config can resume)."""
    file = config_file(argv)
    in_file = {key for key, value in (read_config_file(file, config) if file else {}).items()
               if saved is None or saved.get(key) != value}
    return in_file | set(vars(config_parser(config, default=argparse.SUPPRESS).parse_args(argv))) - {"config"}


def validate(cfg) -> None:
    """Raise ValueError with a one-line fix for a configuration that cannot run: every number in its range
    (user_input.RULES), every field with choices at one of them, and the settings that cannot go together."""
    check_numbers(cfg)
    if cfg.group_size % cfg.micro_batch_size:
        raise ValueError(f"--micro-batch-size {cfg.micro_batch_size} must divide --group-size {cfg.group_size}")
    for field in dataclasses.fields(cfg):  # fields with a fixed set of values (--train-tokens, --dtype, ...)
        choices, value = field.metadata.get("choices"), getattr(cfg, field.name)
        if choices and value not in choices:
            flag, listed = "--" + field.name.replace("_", "-"), ", ".join(choices[:-1])
            raise ValueError(f"{flag} {value}: use {listed} or {choices[-1]}")
    variants.validate(cfg)
    ar_only = [flag for flag in variants.given(cfg)
               if flag not in ("--scale-rewards", "--clip-eps-high", "--reward-aggregation")]
    if cfg.train == "dit" and ar_only:  # --diversity included: its layouts are the AR's large grids
        raise ValueError(f"{', '.join(ar_only)}: the options of the AR's tokens' loss or ranks; dit_grpo.py does not "
                         "use them: leave them out")
    if cfg.train == "dit" and cfg.mu != 1:
        raise ValueError(f"--mu {cfg.mu}: --train dit makes one update per batch of chains for now; drop --mu")
    if cfg.save_merged and cfg.model.split(":")[0] == "random":
        raise ValueError("--save-merged loads the base model again to merge into it, and random weights cannot be "
                         "loaded again: drop --save-merged (final/ holds what was trained)")
    if cfg.warmup_steps >= cfg.steps:
        raise ValueError(f"--warmup-steps {cfg.warmup_steps} must be below --steps {cfg.steps} (the rate reaches --lr "
                         "after the warmup)")
    if cfg.push_to_hub and not re.fullmatch(r"[\w.-]+/[\w.-]+", cfg.hub_model_id):
        raise ValueError(f"--push-to-hub uploads to --hub-model-id, and {cfg.hub_model_id or 'none'!r} is not a hub "
                         "repository id: give one, e.g. --hub-model-id you/glm-image-grpo")
    if cfg.hub_model_id and not cfg.push_to_hub:
        raise ValueError("--hub-model-id names where --push-to-hub uploads: add --push-to-hub (or drop it)")
    if cfg.eval_reward and not cfg.eval_prompts:
        raise ValueError("--eval-reward is measured on --eval-prompts; give an --eval-prompts file too")
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device cuda, but torch {torch.__version__} sees no CUDA GPU here; use --device cpu (or "
                         "auto), or install a CUDA build of torch on a machine with a GPU")


def is_hub_id(model: str) -> bool:
    """Whether --model names a hub repository (owner/name), not a shipped model, random weights or a folder."""
    return not (model in TINY_NAMES or model.split(":")[0] == "random" or folder_path(model))


def check_push(cfg) -> None:
    """--push-to-hub, before anything trains: a hub token and a hub not switched off, else ValueError (hours of
    training should not end in a push that could never work)."""
    if not cfg.push_to_hub:
        return
    from huggingface_hub import constants, get_token
    if constants.HF_HUB_OFFLINE:
        raise ValueError("--push-to-hub, but HF_HUB_OFFLINE is set: unset it, or drop --push-to-hub and upload final/ "
                         "later (hf upload ID RUN/final)")
    if get_token() is None:
        raise ValueError("--push-to-hub needs a hub token with write access: run hf auth login (or set HF_TOKEN)")


def check_model(model: str, revision: str = "") -> None:
    """--model, before anything is read or loaded: a shipped name, random[:L], a pipeline folder, or a hub id (at
    --revision) in the local hub cache or on a hub this machine reaches. Raises ValueError naming the fix at once (not
    after the hub's retries, nor after the prompts' notes)."""
    path = Path(model).expanduser()
    local = not is_hub_id(model)
    if revision and local:
        raise ValueError(f"--revision pins a hub model, and --model {model} is not a hub id: drop --revision (or give "
                         "the hub id, e.g. zai-org/GLM-Image)")
    if model in TINY_NAMES or model.split(":")[0] == "random":
        return
    if local:
        if not (path / "model_index.json").is_file():
            raise ValueError(f"--model {model}: no pipeline folder there (a folder needs model_index.json, as "
                             "GlmImagePipeline.save_pretrained writes it); give such a folder, a hub id, or tiny")
        return
    host = None if hub_cached(model, "model_index.json", revision) else unreachable_hub()
    if host:
        raise ValueError(f"--model {model} is not in the hub cache and {host} cannot be reached (offline?); download "
                         f"it where there is a network (hf download {model}), or use --model tiny or a local folder")


def load_evals(cfg, rewards: dict, table: dict, base: Path | None = None, served: dict | None = None
               ) -> tuple[list[dict], dict] | None:
    """The --eval-prompts examples and what is measured on them: the rewards of --reward (weighted as in training) and
    those of --eval-reward (weight 0: measured, never optimised; relative paths from `base`, as parse_rewards). None
    without --eval-prompts. Raises ValueError."""
    if not cfg.eval_prompts:
        return None
    measured = (parse_rewards(cfg.eval_reward, table, "--eval-reward", cfg.reward_timeout, base, cfg.reward_wait,
                              served) if cfg.eval_reward else {})
    eval_rewards = {**rewards, **{name: (fn, 0.0) for name, (fn, _) in measured.items() if name not in rewards}}
    examples = load_examples(read_prompts(cfg.eval_prompts, "--eval-prompts"), eval_rewards, cfg.height, cfg.width)
    check_rewards(measured, examples[0], cfg.height, cfg.width)
    return examples, eval_rewards


def prepare(cfg, argv: list[str] | None, table: dict, lesson, train: str = "ar") -> Run:
    """Check everything before anything is written: the config (`cfg`, parsed from the command line `argv`; with
    --resume the saved config instead), the prompts and their images, the rewards (names from `table`), --out or
    --resume, and that `train` (ar: grpo.py, dit: dit_grpo.py) is what this script trains; `lesson` is grpo.py (the
    module), which the run's end needs (its model folders, its loader). Returns the Run."""
    PROG["name"] = SCRIPTS[train]
    out, start, trains, state = Path(cfg.resume or cfg.out), 0, cfg.train, None
    try:
        if cfg.resume:
            out, state = resume_point(out)  # the run directory, its latest (or the named) checkpoint
            saved, start, total = read_resume(out, state)  # config.json; `state`'s step and groups a step
            trains = saved.get("train", "ar")
        if trains != train and trains in SCRIPTS:  # one entry point per trained model (each its own Config)
            what = f"{out} trains the {trains.upper()}" if cfg.resume else f"--train {trains}"
            raise ValueError(f"{what} is {SCRIPTS[trains]}'s to run: python {SCRIPTS[trains]} with the same flags")
        inputs, base = None, None  # a resumed run: the files it read and its start directory (inputs.json)
        if cfg.resume:
            inputs = read_inputs(out)
            base = Path(inputs["cwd"]) if inputs else None
            given = given_flags(type(cfg), argv, saved)
            moved = {key: served_moves(saved.get(key, ""), getattr(cfg, key)) for key in ("reward", "eval_reward")
                     if key in given}  # a served reward at a new address: the same reward, its name kept
            refused = sorted(given - {"resume", *RESUMABLE, *(key for key, moves in moved.items() if moves)})
            if refused:
                raise ValueError(f"--resume continues {out} with its saved settings, so it cannot take "
                                 f"{', '.join('--' + f.replace('_', '-') for f in refused)}: drop them (or start a new "
                                 "run with another --out)")
            keep = {f: getattr(cfg, f) for f in RESUMABLE if f in given}
            served = {**(inputs or {}).get("served", {}), **{k: v for moves in moved.values() for k, v in moves.items()}}
            for name, address in served.items():
                if int(os.environ.get("RANK", 0)) == 0 and any(name in m for m in moved.values()):
                    print(f"note: reward '{name}' is served at {address} now (its metrics keep its name)",
                          file=sys.stderr)
            inputs = {**(inputs or {"cwd": str(Path.cwd()), "files": {}}), "served": served} if served else inputs
            try:
                cfg = dataclasses.replace(type(cfg)(**saved), **{"overwrite": False, **keep}, resume=cfg.resume,
                                          out=str(out))
            except TypeError:
                raise ValueError(f"{out / 'config.json'} is not a grpo.py config (its fields differ); restore it from "
                                 f"the checkpoint's copy (torch.load('{state}')['config'])") from None
            world = int(os.environ.get("WORLD_SIZE", 1))
            if total % world:  # the same groups per step on another number of processes, or refuse
                raise ValueError(f"{out} trains {total} groups per step; {world} processes cannot share them evenly: "
                                 f"resume on a number of processes that divides {total}")
            cfg = dataclasses.replace(cfg, prompts_per_step=total // world)
            if any(line["step"] == 0 and not line.get("eval") for line in read_metrics(out)):
                raise ValueError(f"{out} counts its steps from 0 (an older grpo.py wrote it; steps count from 1 now), "
                                 "so a resume would number them twice: finish it with the version that started it, "
                                 "or start a new run")
            if cfg.steps != saved["steps"] and saved.get("lr_scheduler", "constant") != "constant":
                raise ValueError(f"--steps {cfg.steps}: {out}'s --lr-scheduler {saved['lr_scheduler']} runs over its "
                                 f"{saved['steps']} steps, and a new length would make the rate jump; resume with "
                                 f"--steps {saved['steps']}, or start a new run")
            if cfg.steps < start:
                raise ValueError(f"--steps {cfg.steps} is below the {start} steps {out} has done; --steps is the "
                                 f"total, so pass more than {start}")
            later = [folder.name for step, folder in checkpoint_steps(out) if step > start]
            if later and not cfg.overwrite:  # going back: what came after would be redone and replaced
                final = " and final/" if (out / "final").exists() else ""
                raise ValueError(f"--resume {cfg.resume} goes back to step {start}, and {out} has later checkpoints "
                                 f"({', '.join(later)}){final} that the run would replace: keep a copy of what you "
                                 f"need, then add --overwrite to delete them (or resume the latest: --resume {out})")
        cfg = dataclasses.replace(cfg, **absolute_inputs(cfg, base or Path.cwd()))  # what config.json keeps
        changed = changed_inputs(inputs["files"]) if inputs else None
        if changed:
            raise ValueError(f"--resume {out}: {changed} since the run started, and a resumed run reads the inputs it "
                             "started with: put it back as it was, or start a new run (another --out)")
        validate(cfg)
        check_model(cfg.model, cfg.revision)
        if int(os.environ.get("RANK", 0)) == 0:  # rank 0 alone pushes
            check_push(cfg)
        check_reporter(cfg.report_to)
        check_out_dir(out)
        served = (inputs or {}).get("served", {})  # {a served reward's name: where it is served now}
        rewards = parse_rewards(cfg.reward, table, timeout=cfg.reward_timeout, base=base, wait=cfg.reward_wait,
                                served=served)
        examples = load_examples(read_prompts(cfg.prompts), rewards, cfg.height, cfg.width)
        check_rewards(rewards, examples[0], cfg.height, cfg.width)
        if getattr(cfg, "gardo_diversity", "none") == "dino":  # its DINOv2 loads now, not at step 1
            variants.feature_similarity(torch.full((2, 3, cfg.height, cfg.width), 0.5), variants.dino_checkpoint(cfg.reward))
        if cfg.train == "dit" and any(e["source"] is not None for e in examples):
            raise ValueError(f"--train dit is text-to-image only for now, and {cfg.prompts} has source images; train "
                             "the AR on edits (--train ar)")
        evals = load_evals(cfg, rewards, table, base, served)
        if int(os.environ.get("RANK", 0)) == 0 and out.is_dir():  # the directory is this run's alone (its rank 0
            hold_run_dir(out)  # holds it; open_run holds a directory this run makes, before it writes there)
        if (not cfg.resume and not cfg.overwrite and any((out / name).exists() for name in RUN_FILES)
                and not failed_start(out)):  # (a run that stopped before its first checkpoint and step: started again)
            raise ValueError(f"--out {out} holds another run; pass --resume {out} to continue it, --overwrite to "
                             "replace it, or another --out")
    except ValueError as error:
        fail(str(error))
    if cfg.resume and cfg.steps == start and finished(out) == start:
        print(f"{out} has done all {start} steps of --steps {cfg.steps}: nothing to do (pass a larger --steps to "
              "train on)")
        raise SystemExit(0)  # (a run that stopped while writing final/ has no step to do, then its end again)
    inputs = inputs or {"cwd": str(Path.cwd()), "files": input_digests(cfg)}
    return Run(cfg, out, start, state, examples, rewards, evals, lesson, inputs=inputs)


def served_moves(saved: str, given: str) -> dict[str, str]:
    """{a served reward's URL as the run named it: its URL now} when the --reward spec `given` is the `saved` one with
    only served rewards' host and port changed (the same rewards, weights, order and paths: a server that moved); {}
    when anything else differs (or nothing)."""
    import urllib.parse
    before, after = saved.split(",") if saved else [], given.split(",") if given else []
    if len(before) != len(after):
        return {}
    moves = {}
    for old_part, new_part in zip(before, after):
        old, new = split_reward(old_part), split_reward(new_part)
        if old == new:
            continue
        a, b = urllib.parse.urlsplit(old[0]), urllib.parse.urlsplit(new[0])
        if not (is_url(old[0]) and is_url(new[0]) and (a.scheme, a.path, a.query) == (b.scheme, b.path, b.query)
                and old[1:] == new[1:]):
            return {}
        moves[old[0]] = new[0]
    return moves


def absolute_inputs(cfg, base: Path) -> dict:
    """The input paths of `cfg` made absolute from `base` (the directory the run started in), as config.json keeps
    them: prompts, eval_prompts, and model when it names a folder (not tiny, a hub id or random). A resume from
    another directory then reads the same files; --out stays as given (the run's lines name it so)."""
    paths = {key: str((base / Path(getattr(cfg, key)).expanduser()).absolute())
             for key in ("prompts", "eval_prompts") if getattr(cfg, key, "")}
    model = Path(cfg.model).expanduser()
    if cfg.model not in TINY_NAMES and cfg.model.split(":")[0] != "random" and (base / model).is_dir():
        paths["model"] = str((base / model).absolute())
    return paths


def leave() -> None:
    """The end of a finished run's process. Under torchrun it exits at once (exit code 0, its output flushed), without
    the interpreter's teardown: there a gloo thread still alive can abort a process that finished its work
    ("terminate called without an active exception", exit -6; seen in CI, and once in this session's four runs of
    the suite, after parallel.stop_processes had left the process group). Everything the run writes is on disk by
    then (atomic writes, the trackers closed). One process: returns."""
    if int(os.environ.get("WORLD_SIZE", 1)) > 1:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def finished(out: Path) -> int | None:
    """The steps of the model in out/final/, as final/run.json (written last) records them; None when final/ is
    missing or was left unfinished."""
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        return json.loads((out / "final" / "run.json").read_text())["steps"]
    return None


def fail(message: str, code: int = 2) -> None:
    """One line on stderr (from the first process only, under torchrun), no traceback, exit `code` (2: bad input).
    The other processes wait a moment before they exit, so that torchrun does not stop the first one before it has
    said why (seen once: no line at all)."""
    if int(os.environ.get("RANK", 0)) == 0:
        print(f"{PROG['name']}: error: {message}", file=sys.stderr)
    else:
        time.sleep(3)
    raise SystemExit(code)


# ---- Set-up: processes, device, the model, the run directory --------------------------------------

def start(r: Run) -> None:
    """Quiet the libraries, start torchrun's processes (one per GPU; else rank 0 of 1), pick the device and dtype, and
    check that the model fits in the host's memory before minutes go into building or loading it."""
    quiet_libraries()  # after the checks: --help and bad input never wait for diffusers to import
    r.rank, r.world, r.device = start_processes(r.cfg.device, collective_timeout(r))
    r.dtype = compute_settings(r.device, r.cfg.dtype, r.cfg.model)  # the real model in bf16 on GPUs
    r.autocast = torch.autocast(r.device.split(":")[0], dtype=torch.bfloat16, enabled=r.dtype == torch.bfloat16)
    problem = host_memory_problem(r.cfg, r.device, r.dtype)
    if problem:
        fail(problem)


COLLECTIVE_TIMEOUT = 600.0  # torch's own for NCCL: seconds a process waits in a collective for the others


def collective_timeout(r: Run) -> float:
    """Seconds a process may wait in a collective for the others under torchrun before it is failed: torch's 10
    minutes for the step's own work, plus the longest a served reward can keep one process from the next collective:
    each try up to --reward-timeout, 7 tries (the first and RETRY_WAITS' six) with their 63 s of waits, for every
    served reward of every group the process scores in between (a step's --prompts-per-step groups, or its share of
    the --eval-prompts). Without served rewards: 10 minutes. A reward that fails for good stops the run with its own
    line before then (torchrun then stops the other processes)."""
    tries, waits = 1 + len(RETRY_WAITS), sum(RETRY_WAITS)
    worst = tries * r.cfg.reward_timeout + waits  # one served reward of one group
    served = sum(is_url(name) for name in r.rewards)
    longest = r.cfg.prompts_per_step * served * worst
    if r.evals:
        world = int(os.environ.get("WORLD_SIZE", 1))
        share = -(-len(r.evals[0]) // world)  # the most eval prompts one process scores
        longest = max(longest, share * sum(is_url(name) for name in r.evals[1]) * worst)
    return COLLECTIVE_TIMEOUT + longest


# ---- Host memory, before the model is built or loaded --------------------------------------------

COMPONENTS = ("vision_language_encoder", "transformer", "vae", "text_encoder")  # the pipeline's parts with weights


def parameter_counts(model: str) -> dict[str, int] | None:
    """{"total", "ar", "ar_trained" (the language model and lm_head: what full fine-tuning trains), "dit"} parameters
    of --model: 'random[:L]' counted on the meta device (no memory), a folder (or the hub's local cache) from its
    safetensors headers; None where it cannot be told without loading (a hub id not downloaded yet, 'tiny')."""
    if model.split(":")[0] == "random":
        from .offline_model import random_glm_image
        pipe = random_glm_image(model, device="meta")
        named = {part: dict(getattr(pipe, part).named_parameters()) for part in COMPONENTS}
        counts = {part: {name: p.numel() for name, p in params.items()} for part, params in named.items()}
    else:
        folder = Path(model)
        if not folder.is_dir() and model not in TINY_NAMES:
            with contextlib.suppress(Exception):
                from huggingface_hub import snapshot_download
                folder = Path(snapshot_download(model, local_files_only=True))
        if model in TINY_NAMES or not folder.is_dir():
            return None
        counts = {part: safetensors_counts(folder / part) for part in COMPONENTS}
    ar = counts["vision_language_encoder"]
    trained = sum(n for name, n in ar.items() if "language_model." in name or name.startswith("lm_head."))
    return {"total": sum(sum(c.values()) for c in counts.values()), "ar": sum(ar.values()), "ar_trained": trained,
            "dit": sum(counts["transformer"].values())}


def safetensors_counts(folder: Path) -> dict[str, int]:
    """{tensor name: elements} of every .safetensors file in `folder`, read from their headers (8 bytes of length, then
    JSON): nothing is loaded."""
    counts = {}
    for path in sorted(folder.glob("*.safetensors")):
        with open(path, "rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        counts.update({name: math.prod(t["shape"]) for name, t in header.items() if name != "__metadata__"})
    return counts


def available_host_memory() -> int:
    """Bytes this process can still take: /proc/meminfo's MemAvailable, or a cgroup's limit if that is lower."""
    available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    with contextlib.suppress(OSError, ValueError):
        available = int(re.search(r"MemAvailable:\s+(\d+) kB", Path("/proc/meminfo").read_text())[1]) * 1024
    with contextlib.suppress(OSError, ValueError):
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            used = int(Path("/sys/fs/cgroup/memory.current").read_text())
            available = min(available, int(limit) - used)
    return available


def host_memory_problem(cfg, device: str, dtype: torch.dtype) -> str | None:
    """What stops the run before the model is built or loaded, if the host cannot hold it (the memory plan's terms
    that live on the host, tools/memory_plan.py): on the CPU every weight in `dtype`, and for full fine-tuning the
    trained weights in float32 with their gradients and AdamW's two moments (16 bytes a parameter) and the KL
    reference's copy; on a GPU only what loading passes through the host (one copy of the weights per process of this
    machine; 'random' is built on the GPU itself). Activations come on top. None when it fits or cannot be told."""
    counts = None if device.startswith("cuda") and cfg.model.startswith("random") else parameter_counts(cfg.model)
    if counts is None:
        return None
    size = torch.finfo(dtype).bits // 8
    if device.startswith("cuda"):
        need, what = counts["total"] * size * int(os.environ.get("LOCAL_WORLD_SIZE", 1)), "its weights, while loading"
    else:
        trained = counts["ar_trained"] if cfg.train == "ar" else counts["dit"]
        full = cfg.lora_rank == 0
        need = counts["total"] * size + full * trained * (16 - size)
        need += full * (cfg.kl_beta > 0) * (counts["ar"] if cfg.train == "ar" else counts["dit"]) * size
        what = f"its {counts['total'] / 1e9:.1f}B parameters in {str(dtype)[6:]}" + (
            ", with AdamW's state for full fine-tuning" if full else "")
    available = available_host_memory()
    if need <= available:
        return None
    levers = [(f"--model {cfg.model.split(':')[0]}:2 (2 layers a part)", cfg.model.startswith("random")),
              ("--dtype bfloat16", dtype == torch.float32), ("--lora-rank 16", cfg.lora_rank == 0),
              ("a GPU (--device cuda)", not device.startswith("cuda")), ("a machine with more memory", True)]
    return (f"--model {cfg.model} needs about {need / 1e9:.1f} GB of host memory ({what}) and this machine has "
            f"{available / 1e9:.1f} GB free; use {', '.join(lever for lever, applies in levers if applies)}")


def quiet_libraries() -> None:
    """Keep the terminal for our progress bar and one-line errors, and the hub's download bars: the first download
    of GLM-Image is about 40 GB, which a user wants to see move."""
    import diffusers
    import transformers
    from huggingface_hub.utils import enable_progress_bars
    diffusers.logging.set_verbosity_error()
    diffusers.utils.logging.disable_progress_bar()  # from_pretrained's "Loading pipeline components" bar
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()  # save_pretrained's "Writing model shards" bar
    enable_progress_bars()  # both switched the hub's off too: its download bars come back


def compute_settings(device: str, dtype: str, model: str = "tiny") -> torch.dtype:
    """The dtype for --dtype on `device` (auto: float32 for the tiny model everywhere, which draws worse in bf16 (0.836
    before training instead of 0.906 on an H100); for the real model bf16 on a GPU, float32 on the CPU). On the CPU
    one thread unless OMP_NUM_THREADS says otherwise: on 2 cores the tiny demo ran 1.2x faster with 2 threads but used
    1.5x the CPU, and more threads than free cores stalled a busy machine 10-60x."""
    if device == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)
    tiny = model in TINY_NAMES
    return {"auto": torch.bfloat16 if device.startswith("cuda") and not tiny else torch.float32,
            "float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]


@contextlib.contextmanager
def loading(model: str):
    """Around loading `model`: a failure (offline hub, wrong path, ...) is one line naming why, exit 2, no traceback;
    out of memory is left to `timed`."""
    try:
        yield
    except torch.OutOfMemoryError:
        raise
    except Exception as error:
        cause = (str(error).strip().splitlines() or [""])[0]
        if len(cause) > 240:  # cut at a word, and say so
            cause = cause[:240].rsplit(" ", 1)[0] + " ..."
        hint = ("tools/train_tiny.py rebuilds it" if model == "tiny" else "tools/train_tiny_edit.py rebuilds it"
                if model == "tiny-edit" else "offline? use --model tiny or a local path")
        fail(f"cannot load --model {model} ({type(error).__name__}: {cause}); {hint}")


def open_run(r: Run, policy, optimizer, ref_model=None) -> None:
    """The trained model, its optimizer and KL reference join the run (with --resume: their checkpoint loaded); the
    run directory is opened (config.json, the metrics before `start`) and the examples move to the device, where
    rewards meet samples. `job.variants`: the variants' state carried from step to step (helpers/variants.py)."""
    r.policy, r.optimizer = policy, optimizer
    r.scheduler = lr_schedule(optimizer, r.cfg)  # before a checkpoint's optimizer state: that state's rate stays
    r.variants = variants.State.of(r.cfg, ref_model)
    if r.checkpoint:
        state = read_checkpoint(r.checkpoint)
        load_trainable_state(policy, optimizer, state)
        restore_rng(state["rng"])
        if "scheduler" in state:  # (a checkpoint from before --lr-scheduler was constant: nothing to restore)
            load_schedule(r.scheduler, state["scheduler"], r.cfg.mu)
        r.variants.load_state_dict(state.get("variants", {}))
        r.evaluated = {h["step"] for h in read_metrics(r.out) if h.get("eval") and h["step"] <= r.start}  # kept
    if r.rank == 0:
        try:  # a run started at the same moment into the same new --out: the first to get here holds it
            hold_run_dir(r.out)
        except ValueError as error:
            fail(str(error))
    r.history = open_run_dir(r.out, r.cfg, r.start, r.inputs) if r.rank == 0 else []  # the metrics before `start`
    r.skipped, r.done, r.saved = sum(h["skipped"] for h in r.history), r.start, r.start if r.checkpoint else -1
    if not r.checkpoint:
        seed_everything(r.cfg.seed)
    r.rng = rng_state()  # a new run's, or the checkpoint's
    r.examples = on_device(r.examples, r.device)
    r.evals = r.evals and (on_device(r.evals[0], r.device), r.evals[1])


def lr_schedule(optimizer, cfg):
    """--lr-scheduler after --warmup-steps, over --steps: transformers' schedule (a LambdaLR) over the run's optimizer
    updates, --mu a step (trainer.train_step steps it after each update it applies, as transformers' Trainer and TRL
    do): at mu 2 with a warmup of 1 step the updates' rates are 0, 0.5 lr, then lr. An update skipped for a non-finite
    loss moves no rate (as Accelerate skips its scheduler after a skipped step): the schedule counts applied updates."""
    from transformers import get_scheduler
    name = {"constant": "constant_with_warmup"}.get(cfg.lr_scheduler, cfg.lr_scheduler)
    return get_scheduler(name, optimizer, num_warmup_steps=cfg.warmup_steps * cfg.mu,
                         num_training_steps=cfg.steps * cfg.mu)


def load_schedule(scheduler, state: dict, mu: int) -> None:
    """A checkpoint's schedule state into `scheduler`. A checkpoint written while the schedule stepped once a step
    (before it stepped once an update; no "unit" in its state) is counted in updates: its steps times mu."""
    state = dict(state)
    if state.pop("unit", None) != "update":
        state["last_epoch"] *= mu
        state["_step_count"] = state["last_epoch"] + 1
    scheduler.load_state_dict(state)
    for group, base, factor in zip(scheduler.optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas):
        group["lr"] = base * factor(scheduler.last_epoch)  # the rate of the next update, as the schedule says


def on_device(examples: list[dict], device: str) -> list[dict]:
    """The examples with their images (targets, sources) on `device`, where the rewards meet the samples."""
    return [{k: v.to(device) if torch.is_tensor(v) else v for k, v in e.items()} for e in examples]


# ---- The loop's bookkeeping -----------------------------------------------------------------------

PHASES = {"load": "loading the model onto the device", "setup": "setting up training (LoRA, the KL reference, "
          "the optimizer, a checkpoint)", "sample": "sampling (the decode loop)", "decode": "decoding (DiT + VAE)",
          "reward": "scoring the images", "train": "the update (train_step)", "show": "sampling the before / after "
          "grids", "eval": "evaluating --eval-prompts"}


def memory_levers(phase: str, cfg) -> list[str]:
    """The settings that would lower the memory of `phase`, among those this run does not use already."""
    full, trains = cfg.lora_rank == 0, phase in ("setup", "train")
    levers = [("--lora-rank 16", full and trains),
              ("--kl-beta 0 (no reference copy)", full and cfg.kl_beta > 0 and phase == "setup"),
              ("--micro-batch-size 1", cfg.micro_batch_size > 1 and phase == "train"),
              ("--gradient-checkpointing", not cfg.gradient_checkpointing and phase == "train"),
              ("--offload", not cfg.offload and phase in ("setup", "sample", "train")),
              ("a smaller --group-size", cfg.group_size > 2 and phase in ("sample", "decode", "train", "show")),
              ("fewer --prompts-per-step", cfg.prompts_per_step > 1 and phase == "sample"),
              ("fewer --eval-samples", cfg.eval_samples > 1 and phase == "eval"),
              ("a smaller --height / --width", phase in ("decode", "show", "eval")),
              ("more GPUs (torchrun shards the trained model)", trains),
              ("a GPU with more memory", True)]
    return [lever for lever, applies in levers if applies]


@contextlib.contextmanager
def timed(seconds: dict, phase: str, r: Run):
    """seconds[phase] = the wall-clock time the block took. Running out of (GPU) memory in it stops the run like bad
    input: one line naming the phase, the levers this run does not use yet and what is kept (`to_continue`), exit 2;
    the step is not saved."""
    began = time.perf_counter()
    try:
        yield
    except torch.OutOfMemoryError:
        rank = int(os.environ.get("RANK", 0))
        tqdm.write(f"{PROG['name']}: error: out of memory while {PHASES.get(phase, phase)}"
                   f"{f' (process {rank})' if rank else ''}. To fit: {', '.join(memory_levers(phase, r.cfg))}; "
                   f"{to_continue(r, 'then ')}", file=sys.stderr)
        raise SystemExit(2) from None
    seconds[phase] = time.perf_counter() - began


def saved_step(r: Run) -> int:
    """The step of the checkpoint a resume reads now: the last one written, or --resume's own before any; -1: none."""
    return r.saved if r.saved >= 0 else (r.start if r.checkpoint else -1)


def to_continue(r: Run, fix: str = "") -> str:
    """How every stop's line ends (a signal, a failing reward, a full disk, out of memory): the checkpoint kept and
    the command that continues from it; before any checkpoint, that nothing is saved and what to run instead (a new
    start into the same --out when no step has landed: prepare takes a run directory that holds only a failed start;
    else with --overwrite, as the logged steps cannot be continued). `fix`: what to do first ("fix it, then ")."""
    step = saved_step(r)
    if step >= 0:
        return f"checkpoint at step {step} in {r.out}: {fix}continue it with: {resume_command(r)}"
    if r.done == 0:
        return f"nothing saved yet: {fix}start the run again (into the same --out)"
    return (f"nothing saved yet (no checkpoint of the {plural(r.done, 'step')} logged in {r.out}): {fix}start the run "
            "again with --overwrite")


@contextlib.contextmanager
def training(r: Run):
    """Around the training loop: the before grid (--before-after), the progress bar and --report-to, the held-out
    evaluation before any update; Ctrl-C or SIGTERM saves the finished steps and exits 130 (parallel.on_interrupt),
    a failed write (a full disk) is one line and exit 1 with the last checkpoint good."""
    if r.rank == 0:
        print("\n".join(start_summary(r)), file=sys.stderr, flush=True)
    r.reporter = Reporter(r.cfg.report_to if r.rank == 0 else "none", r.out, dataclasses.asdict(r.cfg), r.start)
    r.progress = tqdm(range(r.start, r.cfg.steps), desc=PROG["name"][:-3], initial=r.start, total=r.cfg.steps,
                      disable=r.rank != 0 or not bars_shown())
    try:
        with interrupts_caught():  # Ctrl-C and SIGTERM: see parallel.on_interrupt
            if r.cfg.before_after and r.start == 0:  # sampled with fixed seeds now and after training: by eye
                show(r, "before.png", "before training")
            if r.evals and eval_due(r.start, r.cfg) and r.start not in r.evaluated:  # before any update
                run_evaluation(r, r.start)
            yield
    except KeyboardInterrupt:
        interrupted(r)
    except RewardError as error:  # a reward raised or returned what is not scores: outside the landing, as a stop
        reward_failed(r, error)
    except ValueError as error:  # fast_decode.check_tokens: a sample that does not fill its grid
        if not str(error).startswith("sample_groups:"):
            raise
        fail(f"{str(error).removeprefix('sample_groups: ')}; {to_continue(r)}", code=1)
    except OSError as error:  # a full disk, a vanished directory: the last checkpoint stays good
        write_failed(r, error)
    finally:
        r.reporter.close()


def write_failed(r: Run, error: OSError, then: str = "") -> None:
    """A write into the run directory failed: one line with the file, the cause as the system names it, its fix (a
    full disk: make room; a read-only one or a refused permission: another --out, a copy of the run there), and what
    is kept (`to_continue`), exit 1."""
    fixes = {errno.ENOSPC: "make room, then ", errno.EDQUOT: "make room (a disk quota), then ",
             errno.EROFS: f"the file system is read-only: remount it, or copy {r.out} where you can write, then ",
             errno.EACCES: f"check the permissions of {r.out}, then ", errno.EPERM: f"check the permissions of "
             f"{r.out}, then "}
    fix = fixes.get(error.errno, "fix it, then ")
    fail(f"cannot write {error.filename or r.out} ({error.strerror or error}); {then or to_continue(r, fix)}", code=1)


def start_summary(r: Run) -> list[str]:
    """The lines before the first step: the model, device and dtype, what trains, the global batch, the steps and
    the schedule, where the run writes."""
    cfg = r.cfg
    trainable = sum(p.numel() for p in r.policy.parameters() if p.requires_grad)
    total = sum(p.numel() for p in r.policy.parameters())
    trained, how, _ = what_trained(cfg)
    what = trained.split(" (")[0]  # the AR / the DiT
    processes = f"{r.world} processes (FSDP2)" if r.world > 1 else "1 process"
    dtype = str(r.dtype).removeprefix("torch.")
    schedule = cfg.lr_scheduler + (f" after {cfg.warmup_steps} warmup steps" if cfg.warmup_steps else "")
    begin = f"from step {r.start + 1} (--resume)" if r.start else "from step 1"
    return [f"{PROG['name']}: --model {cfg.model}{'@' + cfg.revision if cfg.revision else ''} on {r.device}, {dtype}, "
            f"{processes}",
            f"  trains {what}, {how}: {trainable:,} of {total:,} parameters",
            f"  a step: {plural(cfg.prompts_per_step * r.world, 'prompt')} x {cfg.group_size} samples = "
            f"{cfg.prompts_per_step * r.world * cfg.group_size} images (all processes), micro-batches of "
            f"{cfg.micro_batch_size}, {plural(cfg.mu, 'update')}",
            f"  {plural(cfg.steps, 'step')} {begin}, lr {cfg.lr:g} {schedule}, reward {cfg.reward}",
            f"  writes {r.out} (metrics.jsonl; checkpoints every {cfg.save_every or cfg.steps} steps)"
            + ("; the real model's memory: python tools/memory_plan.py" if cfg.model not in TINY_NAMES else "")] + (
        [f"  a process waits up to {collective_timeout(r):g} s in a collective for the others (served rewards' "
         "tries: --reward-timeout)"] if r.world > 1 and collective_timeout(r) > COLLECTIVE_TIMEOUT else [])


def plural(n: int, noun: str) -> str:
    return f"{n} {noun}{'s' * (n != 1)}"


def steps(r: Run):
    """The steps of the loop: (step, groups, batch, seconds), `step` counted from 1 (after it, `step` updates are done:
    checkpoints/step-N, metrics.jsonl's "step" and the images name the same). Groups are numbered from 0 over all
    processes (process r of W takes groups ((step - 1) W + r) P + j); a group's number picks its prompt and seeds its
    sampling. Under torchrun a stop asked for during an evaluation stops every process here, before the next step."""
    for done in r.progress:
        if stop_requested():
            raise KeyboardInterrupt
        groups = [(done * r.world + r.rank) * r.cfg.prompts_per_step + j for j in range(r.cfg.prompts_per_step)]
        yield done + 1, groups, [r.examples[example_index(r, g)] for g in groups], {}


@contextlib.contextmanager
def landing():
    """Around the part of a step that changes what the run carries: the update, its log line (log_step) and
    after_step's bookkeeping (the learning-rate schedule, the reference, the variants' state, the RNG states, the
    image grid, the checkpoint when due). It lands whole or not at all: a Ctrl-C or SIGTERM waits for its end
    (parallel.on_interrupt); before it, the step is dropped and redone on resume (docs/robustness.md)."""
    with interrupts_held():
        yield


def example_index(r: Run, group: int) -> int:
    """The example group `group` trains on: the (g mod n)-th of epoch g // n (n examples), in the file's order, or with
    --shuffle in that epoch's permutation of the examples, drawn from --seed: every example once an epoch, the same
    order again after --resume."""
    return r.lesson.example_index(group, len(r.examples), r.cfg.seed, bool(r.cfg.shuffle))  # (None: a run saved
    # before --shuffle existed, in file order)


def finite_groups(r: Run, step: int, reward: torch.Tensor, each: dict, batch: list[dict]) -> torch.Tensor:
    """(P,) bool: the groups whose weighted reward sum is finite. A group with a NaN or inf in a reward that weighs
    leaves the loss (advantage 0, its loss times 0: under torchrun its process still joins every collective, and the
    other groups train), with a warning line naming the reward and the prompt. A reward of weight 0 is only logged:
    its NaN is named in a warning, and the group trains."""
    kept = reward.isfinite().all(dim=-1)
    weights = {name: weight for name, (_, weight) in r.rewards.items()}
    for p in range(len(batch)):
        bad = [name for name, value in each.items() if not value[p].isfinite().all()]
        if not bad and kept[p]:
            continue
        where = f"'{batch[p]['prompt']}' ({batch[p]['where']})"
        if kept[p]:
            logged = ", ".join(repr(name) for name in bad)
            tqdm.write(f"warning: step {step}: reward {logged} (weight 0, logged only) is not finite for {where}; "
                       "the group trains on the others", file=sys.stderr)
            continue
        weighed = [repr(name) for name in bad if weights.get(name, 1) != 0] or ["sum (each finite, their weighted "
                                                                               "sum overflows)"]
        tqdm.write(f"warning: step {step}: reward {', '.join(weighed)} is not finite for {where}; its group is left "
                   "out of this step's loss", file=sys.stderr)
    return kept


def log_step(r: Run, step: int, groups: list[int], reward: torch.Tensor, each: dict, advantages: torch.Tensor,
             kept: torch.Tensor, samples: list, metrics: dict, seconds: dict, images: list | None = None) -> None:
    """The step's metrics line (step_record, every process) into metrics.jsonl and --report-to, the progress bar,
    and a warning for a skipped update (rank 0); with `images` (each group's (G, 3, H, W) pictures) the monitor's
    signals and its warnings (monitor_step). `advantages`: every group's (P, G), `kept`: (P,) the groups in the
    loss (finite_groups); `samples`: each
    group's rollout (grpo.Rollout: its large grids are logged) or a tensor (dit_grpo.py's final latents). The bar shows
    the step's reward, its mean over the last 20 steps (steps differ by prompt) and, when there is a KL term, the
    KL."""
    samples = [s.tokens[:, -math.prod(s.prompt.large_hw):] if hasattr(s, "prompt") else s for s in samples]
    indices = [example_index(r, g) for g in groups]  # the examples of the step's groups
    record = step_record(step, indices, reward, each, advantages, kept, samples, reduce_metrics(metrics), seconds)
    record["lr"] = metrics.get("lr", r.optimizer.param_groups[0]["lr"])  # the step's first update's
    if r.variants.risk is not None:  # --kl-on uncertain: the share of the samples GARDO's gate let the KL bind
        record["kl_share"] = r.variants.risk.share
    record |= r.variants.readings  # --mara-threshold, --kl-in-reward: the step's readings
    warned = monitor_step(r, step, record, images, reward, each, indices) if images is not None else []
    rows = sample_rows(step, groups, [r.examples[i]["prompt"] for i in indices], reward, each, advantages, kept)
    r.skipped, r.done = r.skipped + record["skipped"], step
    r.history.append(record)
    if r.rank != 0:
        return
    append_metrics(r.out, {**record, "skipped_total": r.skipped})
    append_metrics(r.out, rows, "samples.jsonl")
    r.reporter.log(record)
    r.reporter.table("samples", rows, step)
    recent = [h["reward_mean"] for h in r.history[-20:] if math.isfinite(h["reward_mean"])]  # no group left: NaN
    recent = np.mean(recent) if recent else math.nan
    r.progress.set_postfix(reward=f"{record['reward_mean']:.3f}", reward_avg20=f"{recent:.3f}",
                           **({"kl": f"{record.get('kl', math.nan):.4f}"} if r.cfg.kl_beta > 0 else {}),
                           clip_frac=f"{record.get('clip_frac', math.nan):.3f}", lr=f"{record['lr']:.2g}")
    if not bars_shown():  # a log file: a plain line a step
        print(f"step {step}/{r.cfg.steps}: reward {record['reward_mean']:.4f} (last 20: {recent:.4f}), "
              f"kl {record.get('kl', math.nan):.4f}, clip_frac {record.get('clip_frac', math.nan):.3f}, "
              f"lr {record['lr']:.3g}, {sum(seconds.values()):.1f} s", file=sys.stderr, flush=True)
    if record["skipped"]:
        left = record["dropped_groups"] == len(record["prompts"])  # on every process
        why = "no group left (non-finite rewards)" if left else "non-finite loss or gradient"
        r.progress.write(f"warning: step {step}: {why}, update skipped ({r.skipped} so far)", file=sys.stderr)
    if record.get("rollout/collapsed_groups"):
        r.progress.write(f"warning: step {step}: {record['rollout/collapsed_groups']} group(s) collapsed to a few codes "
                         f"(the fewest: {record['rollout/group_codes_min']} distinct codes in all its images): a bypassed "
                         "processor, a broken sampler or a policy gone bad; see docs/healthy_training.md",
                         file=sys.stderr)
    for line in warned:
        r.progress.write(line, file=sys.stderr)


def monitor_step(r: Run, step: int, record: dict, images: list, reward: torch.Tensor, each: dict,
                 indices: list[int]) -> list[str]:
    """The reward-hacking monitor's part of a step's line (helpers/monitor.py): its signals (every process's pictures)
    into `record`; on rank 0 their z-scores against the run's first steps, and for each signal that warns now its z
    ("monitor/warning/<signal>") and a grid of the group to look at (images/monitor_<step>_<signal>.png; this
    process's groups). Returns the warning lines."""
    record |= monitor.step_signals(images, gather_rows)
    if r.rank != 0:
        return []
    weights = {name: weight for name, (_, weight) in r.rewards.items()}
    zs, warn = monitor.check([*r.history, record], weights, r.cfg.monitor_threshold)
    record |= zs
    lines = []
    for name in warn:
        z = zs[f"monitor/{name}/z"]
        record[f"monitor/warning/{name}"] = z
        group, sample = monitor.extreme(images, name, z, reward, each)
        path = r.out / "images" / f"monitor_{step:05d}_{name.replace('/', '_')}.png"
        example = r.examples[indices[group]]
        save_grid(path, [example], [images[group]], reward[group:group + 1],
                  [f"step {step}: {name} {z:+.1f} spreads, sample {sample}: {example['prompt']}"],
                  {key: value[group:group + 1] for key, value in weighted(each, r.rewards).items()})
        lines.append(monitor.warning_line(name, step, z, record, [*r.history, record],
                                          f"{path} (sample {sample})"))
        r.reporter.image("monitor", path, step)
    return lines


def sample_rows(step: int, groups: list[int], prompts: list[str], reward: torch.Tensor, each: dict,
                advantages: torch.Tensor, kept: torch.Tensor) -> list[dict]:
    """One row per sample of the step, every process's in rank order (samples.jsonl, --report-to's table): its group
    and prompt, its weighted reward and each reward's value, and its advantage (None: the group was left out for a
    non-finite reward)."""
    rows = []
    for p, group in enumerate(groups):
        for i in range(reward.shape[1]):
            rows.append({"step": step, "group": group, "prompt": prompts[p],
                         "sample": i, "reward": reward[p, i].item(),
                         **{name: values[p, i].item() for name, values in each.items()},
                         "advantage": advantages[p, i].item() if kept[p] else None})
    return gather_list(rows)


def step_record(step: int, prompts: list[int], reward: torch.Tensor, each: dict, advantages: torch.Tensor,
                kept: torch.Tensor, samples: list[torch.Tensor], metrics: dict, seconds: dict) -> dict:
    """The metrics line of one step: reward statistics over the kept groups of every process (`dropped_groups`: those
    left out for a non-finite reward), advantage statistics, `distinct_in_group` (how many of a group's G samples
    differ, on average: grpo.py passes the large grids, the layouts in the tiny world; dit_grpo.py the final latents),
    the update's metrics, and the seconds of each phase (this process)."""
    dropped = int(gather_rows((~kept)[:, None]).sum())
    reward, each = reward[kept], {name: value[kept] for name, value in each.items()}
    reward, advantages, prompts = gather_rows(reward), gather_rows(advantages[kept]), gather_list(prompts)
    if not advantages.numel():  # no group left: the statistics of nothing are NaN
        advantages = torch.full((1, 1), math.nan)
    distinct = gather_rows(torch.tensor([[len({tuple(t) for t in s.flatten(1).tolist()})] for s in samples]))
    codes = code_health(samples) if samples and not samples[0].is_floating_point() else {}
    return {"step": step, "prompts": prompts, "reward_mean": reward.mean().item(),
            "reward_std": reward.std(dim=-1, unbiased=False).mean().item() if reward.numel() else math.nan,  # in groups
            **{f"reward/{name}": gather_rows(value).mean().item() for name, value in each.items()},
            "advantage/max": advantages.max().item(), "advantage/min": advantages.min().item(),
            "advantage/abs_mean": advantages.abs().mean().item(),
            "zero_std_groups": int((advantages == 0).all(dim=-1).sum()),  # groups that carry no signal
            "dropped_groups": dropped,
            "distinct_in_group": distinct.float().mean().item(), **codes, **metrics,
            **{f"sec_{phase}": value for phase, value in seconds.items()}}


def code_health(grids: list[torch.Tensor]) -> dict:
    """Each group's (G, hw) large grids (every process's) -> the distinct codes per image (mean, min), the fewest a
    group used in all its images, and how many groups collapsed: at most max(1, hw / 64) codes in all G images (a
    1024-cell grid of 16 codes or fewer; the tiny model's 9 cells, one code). GLM-Image's users saw 15 codes of 16384
    (white pictures) when the processor was bypassed."""
    per_image = gather_rows(torch.stack([g.sort(-1).values.diff(dim=-1).ne(0).sum(-1) + 1 for g in grids]))
    per_group = gather_rows(torch.tensor([[len(g.unique())] for g in grids]))
    limit = max(1, grids[0].shape[-1] // 64)
    return {"rollout/unique_codes": per_image.float().mean().item(), "rollout/unique_codes_min": int(per_image.min()),
            "rollout/group_codes_min": int(per_group.min()), "rollout/collapsed_groups": int((per_group <= limit).sum())}


def after_step(r: Run, step: int, batch: list[dict], images: list[torch.Tensor], reward: torch.Tensor,
               each: dict | None = None) -> None:
    """The step's bookkeeping, the end of its landing (the learning rate moved with each update: lr_schedule): the
    variants' state (the reference's reset), the RNG states, every --image-every steps an image grid (rank 0; and to
    --report-to), every --save-every steps a checkpoint (all processes)."""
    cfg = r.cfg
    variants.after_step(r.variants, step, cfg, r.history[-1])  # --reference-reset-every (a checkpoint below saves it)
    r.rng = rng_state()  # as the step leaves them (a user's reward may draw): what any checkpoint until the next saves
    if r.rank == 0 and cfg.image_every and ((step - 1) % cfg.image_every == 0 or step == cfg.steps):
        path = r.out / "images" / f"step_{step:05d}.png"
        save_grid(path, batch, images, reward, [f"step {step}: {ex['prompt']}" for ex in batch],
                  weighted(each or {}, r.rewards))
        r.reporter.image("samples", path, step)
    if cfg.save_every and step % cfg.save_every == 0:
        save_run(r, step)


def evaluation(r: Run, step: int) -> None:
    """After step `step` has landed: the held-out evaluation when due (every --eval-every steps and after the last).
    Outside the landing: a stop here (or a reward that fails) leaves it undone, and a resume from this step does it."""
    if r.evals and eval_due(step, r.cfg):  # the policy after `step` updates
        run_evaluation(r, step)


def interrupted(r: Run) -> None:
    """After Ctrl-C or SIGTERM: a checkpoint of the landed steps (unless the user forced an immediate stop: then the
    last one, if any), one line saying what is kept and what to run (`to_continue`), exit 130."""
    r.progress.close()
    if not INTERRUPT["forced"]:
        try:
            save_run(r, r.done)  # the steps after `done` did not land: redone on resume
        except OSError as error:  # a full disk while saving: the last checkpoint stays
            tqdm.write(f"interrupted: cannot write {error.filename or r.out} ({error.strerror or error})",
                       file=sys.stderr)
    if r.rank == 0:
        print(f"interrupted: {to_continue(r)}", file=sys.stderr)
    raise SystemExit(130)


def resume_command(r: Run) -> str:
    """The command that continues the run in r.out, on this many processes."""
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", r.world))
    nodes = f"--nnodes {r.world // per_node} ... " if per_node < r.world else ""  # each node's own flags
    launch = f"torchrun {nodes}--nproc-per-node {per_node}" if r.world > 1 else "python"
    return f"{launch} {PROG['name']} --resume {r.out}"


def reward_failed(r: Run, error: RewardError) -> None:
    """A reward raised, or returned what is not one score per image, in a step, an evaluation or the before / after
    grids (never in a landing: rewards are scored before it): one line naming it, its traceback in <out>/error.txt,
    a checkpoint of the landed steps (one process; under torchrun the other processes wait in a collective, so the
    last checkpoint stays, and before any there is nothing to resume: the line says to start again), exit 1."""
    r.progress.close()
    if r.world == 1:
        with contextlib.suppress(OSError):  # a full disk too: then the last checkpoint stays
            save_run(r, r.done)
    then = to_continue(r, "fix it, then ")
    where = "its traceback: " + str(r.out / "error.txt")
    with contextlib.suppress(OSError):
        atomic_write(r.out / "error.txt", lambda f: f.write((error.details or str(error)).encode()))
    example = f" on {error.where}" if error.where else ""
    fail(f"{error}{example} ({where}); {then}", code=1)


def save_grid(path: Path, batch: list[dict], images: list[torch.Tensor], reward: torch.Tensor,
              titles: list[str], each: dict | None = None) -> None:
    """An image grid of groups (source and target, then the samples, each with its rewards) under their titles; a
    failed write only warns."""
    rows = [[(role, ex.get(role)) for role in ("source", "target") if any(e.get(role) is not None for e in batch)]
            + [("", im) for im in group] for ex, group in zip(batch, images)]
    try:
        save_image(image_grid(rows, reward, titles, each), path)
    except OSError as error:
        tqdm.write(f"warning: could not write {path} ({error.strerror or error}); training goes on", file=sys.stderr)


def weighted(each: dict, rewards: dict) -> dict:
    """Each reward's values, for those --reward weighs above 0 (the grids write them under each picture when there
    are two or more: with the default ssim=1,mse=0 the grid shows the sum alone, as before)."""
    return {name: values for name, values in each.items() if rewards[name][1] > 0}


@contextlib.contextmanager
def decoder_on(pipe, device: str, offload: bool):
    """With --offload the T5, DiT and VAE sit on the CPU and come to `device` only in this block. The pipeline's bar
    of DiT steps shows on a slow decode (the real model's)."""
    pipe.set_progress_bar_config(**inner_bar("DiT steps"))
    modules = (pipe.text_encoder, pipe.transformer, pipe.vae) if offload else ()
    for module in modules:
        module.to(device)
    try:
        yield
    finally:
        for module in modules:
            module.to("cpu")


# ---- Evaluation output: the before / after grids, --eval-prompts --------------------------------

SHOW_SEED = 20_260_000  # the sampling seeds of the before / after grids: fixed, whatever --seed
EVAL_SEED = 30_260_000  # the sampling seeds of --eval-prompts: prompt i gets EVAL_SEED + i at every evaluation
EVAL_GRID = 4  # the eval prompts shown in each evaluation's image grid (the first ones of the file)


def show(r: Run, name: str, when: str) -> float:
    """G samples of each of the first --before-after examples with fixed seeds (evaluate_shared), into images/`name`
    (rank 0); after training also images/before_after.png beside the grid from before. Returns the mean reward."""
    examples, path = r.examples[:r.cfg.before_after], r.out / "images" / name
    with timed({}, "show", r), rng_kept():  # what training draws after it stays as without it
        images, reward, each, _ = evaluate_shared(r.evaluate, examples, r.rewards, r.cfg.group_size, SHOW_SEED,
                                                  len(examples), r.rank, r.world)
    if r.rank == 0:
        save_grid(path, examples, images, reward, [f"{ex['prompt']} ({when})" for ex in examples],
                  weighted(each, r.rewards))
        with contextlib.suppress(OSError):  # the mean reward, for the summary line of a resumed run
            record = json.dumps({"reward": reward.mean().item()}).encode()
            atomic_write(path.with_suffix(".json"), lambda f: f.write(record))
        if path.name == "after.png" and (path.parent / "before.png").exists():
            with contextlib.suppress(OSError):
                save_image(side_by_side(path.parent / "before.png", path), path.parent / "before_after.png")
    return reward.mean().item()


@torch.no_grad()
def evaluate(pipe, examples: list[dict], seeds: list[int], rewards: dict, n_samples: int, cfg, steps: tuple) -> tuple:
    """`n_samples` images of each example (AR seed seeds[i]) sampled and decoded as in training -> the images, the
    (P, K) total reward, each reward's (P, K) and the (P,) distinct large grids. `steps`: grpo.py's sample_groups,
    decode_images and group_rewards. Seeds fixed per prompt: two evaluations differ only by the weights."""
    sample_groups, decode_images, group_rewards = steps
    chunk = max(1, cfg.prompts_per_step * cfg.group_size // n_samples)  # a training step's rows
    rollouts = []
    for c in range(0, len(examples), chunk):
        some = examples[c:c + chunk]
        rollouts += sample_groups(pipe, [ex["prompt"] for ex in some], n_samples, cfg.height, cfg.width,
                                  cfg.temperature, seeds[c:c + chunk], top_k=cfg.top_k, top_p=cfg.top_p,
                                  sources=[ex.get("source") for ex in some])
    dit_steps = cfg.eval_inference_steps or cfg.num_inference_steps  # the evaluation's own, if given
    shown = tqdm(zip(examples, rollouts), total=len(examples), **inner_bar("evaluation"))  # a slow one shows
    images = [decode_images(pipe, ex["prompt"], r.tokens, r.prompt.large_hw, cfg.height, cfg.width, dit_steps,
                            cfg.decode_seed, cfg.guidance_scale, r.prompt.source) for ex, r in shown]
    layouts = torch.tensor([float(len(r.tokens[:, -math.prod(r.prompt.large_hw):].unique(dim=0)))
                            for r in rollouts])  # the large grids: what the DiT sees
    if not examples:  # a process with no share of the examples
        none = torch.zeros(0, n_samples)
        return [], none, {k: none for k in rewards}, layouts
    return (images, *group_rewards(images, examples, rewards), layouts)


def evaluator(r: Run, pipe, policy, steps: tuple) -> Callable:
    """Run.evaluate for `policy`: `evaluate` with the policy gathered (FSDP2), bf16 autocast and the decoder on the
    device (--offload)."""
    def evaluate_policy(examples: list[dict], seeds: list[int], rewards: dict, n_samples: int) -> tuple:
        with r.autocast, unsharded(policy), decoder_on(pipe, r.device, r.cfg.offload):
            return evaluate(pipe, examples, seeds, rewards, n_samples, r.cfg, steps)
    return evaluate_policy


def evaluate_shared(evaluate: Callable, examples: list[dict], rewards: dict, n_samples: int, seed: int,
                    keep_images: int, rank: int = 0, world: int = 1, signals: dict | None = None) -> tuple:
    """`evaluate` (Run.evaluate's signature) on every process, process `rank` taking examples rank, rank + world, ...
    (example i drawn with seed + i) -> on every process, in example order: the images of the first `keep_images`
    examples (rounded to 8 bits, as a PNG keeps them), the (P, K) total reward, each reward's (P, K) and the (P,)
    distinct layouts. A dict `signals` receives the monitor's signals of every picture (helpers/monitor.py)."""
    mine = list(range(rank, len(examples), world))  # every process calls evaluate: FSDP gathers in each
    images, total, each, layouts = evaluate([examples[i] for i in mine], [seed + i for i in mine], rewards, n_samples)
    if signals is not None:  # before the pictures past keep_images are let go
        signals |= monitor.step_signals(images, gather_rows)  # (every process takes part, with or without pictures)
    order = torch.tensor(gather_list(mine)).argsort()  # rows arrive in rank order: example order
    total, layouts = gather_rows(total).cpu()[order], gather_rows(layouts).cpu()[order]
    each = {name: gather_rows(v).cpu()[order] for name, v in each.items()}
    kept = gather_list([(i, (im * 255).round().to(torch.uint8).cpu())
                        for i, im in zip(mine, images) if i < keep_images])
    return [im.float() / 255 for _, im in sorted(kept, key=lambda pair: pair[0])], total, each, layouts


def eval_due(step: int, cfg) -> bool:
    """Whether the policy after `step` updates is evaluated: before the first update, every --eval-every, the last."""
    return step == 0 or step == cfg.steps or (cfg.eval_every > 0 and step % cfg.eval_every == 0)


def run_evaluation(r: Run, step: int) -> None:
    """Evaluate the policy after `step` updates on the eval set: a line in metrics.jsonl ("eval": true), an image grid
    of the first EVAL_GRID prompts (images/eval_<step>.png: the same prompts and seeds every time, so one prompt can be
    followed through training) and a line on the terminal (rank 0). Every process takes part."""
    (examples, rewards), seconds = r.evals, {}
    signals = {}
    with timed(seconds, "eval", r), rng_kept():  # training's draws after it are as without it
        images, total, each, layouts = evaluate_shared(r.evaluate, examples, rewards, r.cfg.eval_samples, EVAL_SEED,
                                                       EVAL_GRID, r.rank, r.world, signals)
    record = eval_record(step, examples, total, each, layouts, seconds["eval"], signals)
    if r.rank == 0:
        evals = [h for h in read_metrics(r.out) if h.get("eval")] + [record]  # (the monitor reads the run's first)
        weights = {name: weight for name, (_, weight) in r.rewards.items()}
        for name, z in monitor.eval_check(evals, weights, r.cfg.monitor_threshold):
            record[f"eval/monitor/warning/{name}"] = z
            tqdm.write(f"warning: eval at step {step}: monitor: {name} fell {-z:.1f} standard errors below the first "
                       f"evaluation's ({evals[0]['eval/' + name]:.4f} -> {record['eval/' + name]:.4f}) while the "
                       f"trained reward rose; look at images/eval_{step:05d}.png (docs/healthy_training.md, \"When the "
                       "reward is being gamed\"; the run goes on)", file=sys.stderr)
        append_metrics(r.out, record)
        r.reporter.log(record)
        path = r.out / "images" / f"eval_{step:05d}.png"
        save_grid(path, examples[:EVAL_GRID], images, total[:EVAL_GRID],
                  [f"eval, step {step}: {ex['prompt']}" for ex in examples[:EVAL_GRID]],
                  {name: values[:EVAL_GRID] for name, values in weighted(each, rewards).items()})
        r.reporter.image("eval", path, step)
        means = ", ".join(f"{key[5:]} {value:.4f}" for key, value in record.items() if key.count("/") == 1)
        tqdm.write(f"eval at step {step} ({len(examples)} prompts x {r.cfg.eval_samples}): {means} "
                   f"({seconds['eval']:.1f} s)")


def eval_record(step: int, examples: list[dict], total: torch.Tensor, each: dict, layouts: torch.Tensor,
                seconds: float, signals: dict | None = None) -> dict:
    """The metrics line of an evaluation: each reward's mean over prompts and samples ("eval/reward" is the weighted
    total of --reward), the diversity of the prompts that leave the layout free (all but the .jsonl lines that say
    "free_layout": false): "eval/distinct_layouts", the mean number of distinct large grids among a prompt's K
    samples, and "eval/one_layout", the share of prompts drawn with a single one; all per category too, for the
    examples whose line has a "category". The monitor's: each reward's standard error, over its prompts' means (a
    prompt's K samples are not independent), "eval/monitor/se/<name>", and the pictures' `signals`
    ("eval/monitor/<signal>"; helpers/monitor.py)."""
    scores = {"reward": total, **each}
    free = torch.tensor([ex.get("free_layout", True) is not False for ex in examples])

    def measured(rows: torch.Tensor, suffix: str = "") -> dict:  # rows: (P,) bool, the examples measured
        record = {f"eval/{name}{suffix}": v[rows].mean().item() for name, v in scores.items()}
        if (rows & free).any():
            record |= {f"eval/distinct_layouts{suffix}": layouts[rows & free].mean().item(),
                       f"eval/one_layout{suffix}": (layouts[rows & free] == 1).float().mean().item()}
        return record

    record = {"step": step, "eval": True, **measured(torch.ones(len(examples), dtype=torch.bool))}
    categories = [str(ex["category"]) if "category" in ex else None for ex in examples]
    for category in sorted(set(categories) - {None}):
        record |= measured(torch.tensor([c == category for c in categories]), f"/{category}")
    record |= {f"eval/monitor/se/{name}": (v.mean(dim=-1).std() / math.sqrt(len(v))).item()  # over prompts' means
               for name, v in scores.items() if len(v) > 1}
    record |= {f"eval/{key}": value for key, value in (signals or {}).items()}
    return {**record, "sec_eval": seconds}


# ---- The end: checkpoints, final/, curves, the summary ----------------------------------------------

def save_run(r: Run, step: int) -> None:
    """checkpoints/step-N/: the trainer state and the trained model, gathered from every process, written by rank 0
    (whole or not at all); then only the latest --save-total-limit kept. A step already saved is not written twice."""
    if step == r.saved:
        return
    weights, optimizer_state = trainable_state(r.policy, r.optimizer)  # every process takes part; rank 0 gets them
    model_weights = final_weights(r.policy)
    carried = r.variants.state_dict()  # (every process: a reset reference's weights are gathered)
    if r.rank == 0:
        save_checkpoint(r.out / "checkpoints" / f"step-{step}", r.policy, model_weights, weights, optimizer_state,
                        step, r.cfg, r.world, base_model(r.cfg.model, r.lesson.TINY_MODELS),
                        {**r.scheduler.state_dict(), "unit": "update"},
                        carried, r.rng)
        prune_checkpoints(r.out, r.cfg.save_total_limit)
    r.saved = step


def base_model(model: str, tiny_models: dict) -> str:
    """What a saved adapter names as its base (adapter_config.json, the model card): a hub id as given, a folder as
    its absolute path (the tiny models' included), nothing for random weights (they cannot be loaded again)."""
    if model.split(":")[0] == "random":
        return ""
    folder = Path(tiny_models.get(model, model))
    return str(folder.resolve()) if folder.is_dir() else model


def finish(r: Run) -> dict:
    """The last checkpoint; final/ (the trained model as save_trained writes it, with a model card); curves.png; the
    after grid (--before-after); with --save-merged final/pipeline/; the summary line; final/run.json last (the steps
    and the summary: what `finished` reads). Leaves torchrun's process
    group. Returns the summary."""
    try:
        save_run(r, r.cfg.steps)
        weights = final_weights(r.policy)  # every process takes part; only rank 0 gets the tensors
        if r.rank == 0:
            base = base_model(r.cfg.model, r.lesson.TINY_MODELS)
            atomic_folder(r.out / "final", lambda tmp: save_trained(r.policy, tmp, weights, base))
    except OSError as error:
        write_failed(r, error)
    try:
        if r.rank == 0:
            plot_curves(r.out)  # rewards (training and eval), KL, clip fraction, groups with no signal
    except Exception as error:  # everything is saved; a picture that fails is only a warning
        tqdm.write(f"warning: could not draw {r.out / 'curves.png'} ({type(error).__name__}: {error}); "
                   f"python tools/plot_run.py {r.out} draws it later", file=sys.stderr)
    try:
        after = show(r, "after.png", f"after {r.cfg.steps} steps") if r.cfg.before_after else None
    except RewardError as error:  # the model is saved; a resume (no step left to do) writes the end again
        reward_failed(r, error)
    summary = summarize(r.out, r.history, len(r.examples), r.skipped, r.rank, after)
    stop_processes()  # torchrun: leave the process group cleanly
    if r.rank == 0:
        write_model_card(r, summary)
        if r.cfg.save_merged:
            save_merged(r.cfg, r.out, r.dtype, r.lesson.load_glm_image)
        with contextlib.suppress(OSError):  # final/ is complete: a --resume with no step to do has nothing to do
            record = json.dumps({"steps": r.cfg.steps, **summary}).encode()
            atomic_write(r.out / "final" / "run.json", lambda f: f.write(record))
        if r.cfg.push_to_hub:
            push(r)
    release_run_dir(r.out)  # (a process that goes on, as a notebook's: the directory is free again)
    return summary


def write_model_card(r: Run, summary: dict) -> None:
    """final/README.md, a hub model card (huggingface_hub's ModelCard): metadata (pipeline_tag text-to-image, the
    base model's hub id, library_name, tags, the base model's license where its card says it, the held-out rewards as
    model-index results when --eval-prompts ran), what was trained on which reward and flags, the numbers (training,
    before / after, held-out), the before / after picture (copied beside it) and the lines that load it. A card that
    cannot be written only warns: the model is saved."""
    from huggingface_hub import EvalResult, ModelCard, ModelCardData
    cfg, final, base = r.cfg, r.out / "final", base_model(r.cfg.model, r.lesson.TINY_MODELS)
    trained, how, library = what_trained(cfg)
    at = f" at revision `{cfg.revision}`" if cfg.revision else ""
    lines = [f"# {cfg.hub_model_id or r.out.name}: GLM-Image's {trained.split(' (')[0].removeprefix('the ')}, "
             "trained with GRPO", "",
             f"- base model: `{cfg.model}`{at}; trained: {trained}, {how}",
             f"- {cfg.steps} steps, each {cfg.prompts_per_step * r.world} prompts of `{Path(cfg.prompts).name}` x "
             f"{cfg.group_size} samples",
             f"- reward: `{cfg.reward}` (aggregation: {cfg.reward_aggregation})",
             f"- training reward, the mean of the first and of the last quarter of the steps (whole passes over the "
             f"prompts where one fits): {summary['reward_first']:.4f} -> {summary['reward_last']:.4f}"]
    if "shown_after" in summary:
        lines.append(f"- the same prompts and seeds before -> after training: {summary['shown_before']:.4f} -> "
                     f"{summary['shown_after']:.4f}")
    evals, results = [h for h in read_metrics(r.out) if h.get("eval")], []
    if evals:  # the weighted reward, then each reward measured (--reward and --eval-reward)
        first, last = evals[0], evals[-1]
        names = [name for name in ["reward", *(r.evals[1] if r.evals else {})]
                 if f"eval/{name}" in first and f"eval/{name}" in last]
        numbers = ", ".join(f"{name} {first[f'eval/{name}']:.4f} -> {last[f'eval/{name}']:.4f}" for name in names)
        lines.append(f"- held-out (`{Path(cfg.eval_prompts).name}`, {cfg.eval_samples} samples a prompt), step {first['step']} "
                     f"-> step {last['step']}: {numbers}")
        results = [EvalResult(task_type="text-to-image", dataset_type=Path(cfg.eval_prompts).name,  # not a hub dataset
                              dataset_name=Path(cfg.eval_prompts).name,
                              metric_type=name, metric_name=f"{name}, held-out, after step {last['step']}",
                              metric_value=round(last[f"eval/{name}"], 4))
                   for name in names if math.isfinite(last[f"eval/{name}"])]
    picture = r.out / "images" / "before_after.png"
    if picture.exists():
        with contextlib.suppress(OSError):
            atomic_write(final / "before_after.png", lambda f: f.write(picture.read_bytes()))
            lines += ["", "Before (left) and after (right), the same prompts and seeds:", "",
                      "![before and after](before_after.png)"]
    lines += ["", "## Use it", "", *usage(cfg, base, cfg.hub_model_id or str(final), r.examples[0]["prompt"])]
    given = {k: Path(v).name if k in ("prompts", "eval_prompts") and v else v  # file names, not this machine's paths
             for k, v in dataclasses.asdict(cfg).items()
             if k not in ("out", "resume", "overwrite", "device", "report_to", "wandb_entity", "run_name")}
    lines += ["", "## Training flags", "", "```json", json.dumps(given, indent=1), "```", ""]
    data = ModelCardData(base_model=cfg.model if is_hub_id(cfg.model) else None, library_name=library,
                         pipeline_tag="text-to-image", license=base_license(cfg.model, cfg.revision),
                         tags=["grpo", "glm-image", "text-to-image", "reinforcement-learning"],
                         model_name=cfg.hub_model_id or r.out.name, eval_results=results or None)
    card = ModelCard(f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(lines))
    try:
        atomic_write(final / "README.md", lambda f: f.write(str(card).encode()))
    except OSError as error:
        tqdm.write(f"warning: could not write {final / 'README.md'} ({error.strerror or error}); the model is saved",
                   file=sys.stderr)


def base_license(model: str, revision: str = "") -> str | None:
    """The base model's license, as its own model card's metadata says: a hub id's README.md in the local hub cache,
    or a folder's README.md; None where there is none (the shipped tiny models have no card)."""
    from huggingface_hub import ModelCard, try_to_load_from_cache
    if is_hub_id(model):
        card = try_to_load_from_cache(model, "README.md", revision=revision or None)
    else:
        card = Path(model).expanduser() / "README.md"
    try:
        return ModelCard.load(card).data.license if isinstance(card, (str, Path)) and Path(card).is_file() else None
    except Exception:  # a card that does not parse: no license to copy
        return None


def usage(cfg, base: str, final: str, prompt: str) -> list[str]:
    """The model card's lines that load `final` (a hub id, or the folder as the run names it) onto `base` (a hub id, at
    --revision; a folder as a path relative to here) and draw `prompt`."""
    if not base:
        return [f"`--model {cfg.model}` is GLM-Image's published shape with random weights (helpers/offline_model.py): "
                "there is no base model to load this onto; it measures speed and memory."]
    if Path(base).is_absolute():  # a folder (the tiny models): relative to where the run started
        base = os.path.relpath(base)
    imports = ["import torch", "from diffusers import GlmImagePipeline"]
    tiny = cfg.model in TINY_NAMES  # float32 on the CPU; the real model bf16 on a GPU
    dtype, to = ("torch.float32", "") if tiny else ("torch.bfloat16", '.to("cuda")')
    revision = f', revision="{cfg.revision}"' if cfg.revision else ""
    if cfg.lora_rank and cfg.train == "ar":
        load = f'pipe.vision_language_encoder.load_adapter("{final}")'
    elif cfg.lora_rank:
        load = f'pipe.transformer.load_lora_adapter("{final}")'
    elif cfg.train == "ar":
        imports.append("from transformers import GlmImageForConditionalGeneration")
        load = (f'pipe.vision_language_encoder = GlmImageForConditionalGeneration.from_pretrained("{final}", '
                f'dtype={dtype}){to}')
    else:
        imports[1] += ", GlmImageTransformer2DModel"
        load = f'pipe.transformer = GlmImageTransformer2DModel.from_pretrained("{final}", dtype={dtype}){to}'
    lines = ["```python", *imports,
             f'pipe = GlmImagePipeline.from_pretrained("{base}"{revision}, dtype={dtype}){to}', load,
             f"image = pipe({json.dumps(prompt)}, height={cfg.height}, width={cfg.width}).images[0]", "```"]
    if cfg.save_merged:
        merged = f"{final}/pipeline" if not cfg.hub_model_id else f'{final}", subfolder="pipeline'
        lines += ["", f'Or the whole pipeline with it merged in: `GlmImagePipeline.from_pretrained("{merged}")`.']
    return lines


def push(r: Run) -> None:
    """--push-to-hub: final/ (its model, card and, with --save-merged, pipeline/) uploaded to --hub-model-id through
    huggingface_hub (the repository created if new). A failed upload is one line and exit 1: the run is saved, and the
    line gives the command that uploads it later."""
    from huggingface_hub import HfApi
    final, repo = r.out / "final", r.cfg.hub_model_id
    try:
        api = HfApi()
        api.create_repo(repo, exist_ok=True, private=r.cfg.hub_private)  # (an existing repository keeps its own)
        api.upload_folder(repo_id=repo, folder_path=final, delete_patterns="*",  # files of an earlier push go
                          commit_message=f"GRPO on GLM-Image: {r.out.name}, {r.cfg.steps} steps")
    except Exception as error:  # network, permissions, quota: the run itself is complete
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        fail(f"could not push {final} to {repo} ({reason}); the run is saved: hf upload {repo} {final} pushes it",
             code=1)
    print(f"pushed {final} to https://huggingface.co/{repo}")


def save_merged(cfg, out: Path, dtype: torch.dtype, load_pipeline) -> None:
    """--save-merged (or tools/merge.py, after a run): out/final/pipeline/, the whole GlmImagePipeline with the trained
    part in it (LoRA merged into its weights), which GlmImagePipeline.from_pretrained(folder) loads alone. Built as a
    user would: the base pipeline (`cfg.model`) loaded again on the CPU in `dtype`, final/ loaded into it with the
    standard calls, merged, saved (whole or not at all). `load_pipeline`: grpo.load_glm_image."""
    final = out / "final"
    with loading(cfg.model):
        pipe = load_pipeline(cfg.model, "cpu", dtype, cfg.revision)
    if cfg.train == "ar" and cfg.lora_rank:
        from peft import PeftModel
        with warnings.catch_warnings():  # peft asks transformers' deprecated name itself (as in setup.apply_lora)
            warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning)
            peft_model = PeftModel.from_pretrained(pipe.vision_language_encoder, final)
        pipe.vision_language_encoder = peft_model.merge_and_unload()
    elif cfg.train == "ar":
        from transformers import GlmImageForConditionalGeneration
        pipe.vision_language_encoder = GlmImageForConditionalGeneration.from_pretrained(final, dtype=dtype)
    elif cfg.lora_rank:
        pipe.transformer.load_lora_adapter(final)
        pipe.transformer.fuse_lora()
        pipe.transformer.unload_lora()
    else:
        from diffusers import GlmImageTransformer2DModel
        pipe.transformer = GlmImageTransformer2DModel.from_pretrained(final, dtype=dtype)
    try:
        atomic_folder(final / "pipeline", pipe.save_pretrained)
    except OSError as error:
        fail(f"cannot write {final / 'pipeline'} ({error.strerror or error}); make room, then run python tools/"
             f"merge.py {out}", code=1)
    print(f"merged pipeline: {final / 'pipeline'} (GlmImagePipeline.from_pretrained loads it)")


def summarize(out: Path, history: list[dict], n_examples: int, skipped: int, rank: int, after: float | None) -> dict:
    """The summary line: the mean training reward of the first and of the last quarter of the steps (whole cycles over
    the prompts where a cycle fits in a quarter, so both sides saw the same prompts) and, with --before-after, the
    mean reward of the same prompts and seeds before and after training. Steps without a finite reward (every group
    left out) are not counted. The monitor's warnings, if any fired, follow on a line of their own
    ("monitor_warnings")."""
    warned = monitor.summary(history, [h for h in read_metrics(out) if h.get("eval")] if rank == 0 else [])
    history = [h for h in history if math.isfinite(h["reward_mean"])]
    quarter = max(1, len(history) // 4)
    cycle = math.ceil(n_examples / max(1, len(history[0]["prompts"]))) if history else 1  # steps per pass
    window = quarter // cycle * cycle if cycle <= quarter else quarter
    first, last = history[:window], history[-window:]
    summary = {"reward_first": float(np.mean([h["reward_mean"] for h in first])) if first else math.nan,
               "reward_last": float(np.mean([h["reward_mean"] for h in last])) if last else math.nan,
               "skipped": skipped}
    before = out / "images" / "before.json"
    if after is not None and before.exists():
        summary.update(shown_before=json.loads(before.read_text())["reward"], shown_after=after)
    if rank == 0:
        shown = (f"; same prompts and seeds before -> after: {summary['shown_before']:.4f} -> {after:.4f} "
                 f"(images/before_after.png)" if "shown_after" in summary else "")
        rewards = (f"reward (mean of first {len(first)} steps) {summary['reward_first']:.4f} -> "
                   f"(mean of last {len(last)} steps) {summary['reward_last']:.4f}" if history else
                   "reward: no step had a finite reward (every group was left out)")
        print(f"{rewards}{shown}; saved to {out}")
        if warned:
            print(f"monitor: {plural(len(warned), 'warning')}: {', '.join(warned)} (docs/healthy_training.md, \"When "
                  "the reward is being gamed\")")
    if warned:
        summary["monitor_warnings"] = warned
    return summary

