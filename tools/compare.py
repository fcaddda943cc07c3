"""Base vs trained: a grpo.py run's weights and the untouched base model, evaluated on the same eval prompts with the
same seeds (`helpers/run.evaluate`, as the run's own eval lines are: with the run's settings the numbers are equal), as a
table per reward and category (base, trained, difference) and one side-by-side image grid.

  python tools/compare.py runs/shapes                   # the run's latest checkpoint, its --eval-prompts
  python tools/compare.py runs/shapes/checkpoints/step-200   # an earlier checkpoint
  python tools/compare.py runs/shapes/final --eval-prompts examples/shapes_heldout.jsonl --eval-reward shapes_exact

RUN is a grpo.py --out directory (its latest checkpoint is evaluated), one of its checkpoints/step-N/ folders, or its
final/ folder (the saved AR or DiT, or the LoRA adapter). The model, sampling and decoding settings are the run's (config.json); --eval-prompts, --eval-samples and
--eval-reward default to the run's. Writes RUN/images/compare.png (base left, trained right, the first --grid
prompts, default run.EVAL_GRID).
"""

import argparse
import dataclasses
import functools
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # grpo.py and its helpers live in the repository root

import dit_grpo  # noqa: E402
import grpo  # noqa: E402
from helpers import trainer, user_input  # noqa: E402
from helpers import run_io  # noqa: E402
from helpers import run  # noqa: E402
from helpers import setup  # noqa: E402
from helpers.parallel import load_trainable_state, start_processes  # noqa: E402


def load_trained(policy, optimizer, path: Path, train: str = "ar") -> int | None:
    """The run's trained weights into `policy` (set up as helpers/setup.setup_training does): from a checkpoint's
    trainer state (a run directory: its latest; or RUN/checkpoints/step-N; returns its step) or from a final/ folder
    (the whole AR or DiT, or the LoRA adapter; returns None)."""
    if any((path / name).exists() for name in (run_io.STATE, "checkpoints", "checkpoint.pt")):  # not final/
        state = run_io.read_checkpoint(run_io.resume_point(path)[1])
        load_trainable_state(policy, optimizer, state)
        return state["step"]
    if (path / "adapter_config.json").exists():  # the AR's LoRA, in peft's format
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file
        set_peft_model_state_dict(policy, load_file(path / "adapter_model.safetensors"))
    elif (path / "pytorch_lora_weights.safetensors").exists():  # the DiT's LoRA, in diffusers' format
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file
        weights = load_file(path / "pytorch_lora_weights.safetensors")
        set_peft_model_state_dict(policy, {"base_model.model." + k.removeprefix("transformer."): v
                                           for k, v in weights.items()})
    elif train == "dit":  # the DiT of a --train dit run
        from diffusers import GlmImageTransformer2DModel
        policy.load_state_dict(GlmImageTransformer2DModel.from_pretrained(path).state_dict())
    else:
        from transformers import GlmImageForConditionalGeneration
        policy.load_state_dict(GlmImageForConditionalGeneration.from_pretrained(path).state_dict())
    return None


def compare(path: Path, eval_prompts: str | None = None, eval_samples: int | None = None,
            eval_reward: str | None = None, grid: int = run.EVAL_GRID) -> dict:
    """{"base", "trained": run.eval_record's dicts, "step": the checkpoint's step (None for final/), "prompts",
    "samples", "grid": the image written}. Raises ValueError for a path that is not a run."""
    run_dir = path  # a run directory, or a folder in it: final/ or checkpoints/step-N/
    if path.name == "final":
        run_dir = path.parent
    elif path.parent.name == "checkpoints":
        run_dir = path.parent.parent
    if not (run_dir / "config.json").exists():
        raise ValueError(f"{path} is neither a grpo.py run directory nor its final/ folder (no config.json beside it)")
    saved = json.loads((run_dir / "config.json").read_text())
    cfg = run.with_run_settings(dit_grpo.DitConfig if saved.get("train") == "dit" else grpo.Config)(**saved)
    given = {k: v for k, v in dict(eval_prompts=eval_prompts, eval_samples=eval_samples,
                                   eval_reward=eval_reward).items() if v is not None}
    cfg = dataclasses.replace(cfg, **given)
    if not cfg.eval_prompts:
        raise ValueError(f"{run_dir} was trained without --eval-prompts; give --eval-prompts FILE")
    run.validate(cfg)
    evals = run.load_evals(cfg, user_input.parse_rewards(cfg.reward, trainer.reward_table(grpo)), trainer.reward_table(grpo))
    run.quiet_libraries()
    _, _, device = start_processes(cfg.device)  # one process: grpo.py's device choice, nothing started
    dtype = run.compute_settings(device, cfg.dtype, cfg.model)  # as grpo.py: the same threads give the same sums and samples
    pipe = trainer.load(grpo, cfg, device, dtype)
    no_kl = dataclasses.replace(cfg, kl_beta=0.0)  # as the run did, without the reference
    policy, _, optimizer = (dit_grpo.setup_training(pipe, no_kl, dtype, world=1) if cfg.train == "dit" else
                            setup.setup_training(pipe, no_kl, dtype, 1, grpo.reference_model,
                                                 trainer.trained_model(grpo, pipe, no_kl)))
    autocast = torch.autocast(device, dtype=torch.bfloat16, enabled=dtype == torch.bfloat16)
    examples = [{k: v.to(device) if torch.is_tensor(v) else v for k, v in e.items()} for e in evals[0]]
    result, grids = {}, []

    def evaluate(examples: list[dict], seeds: list[int], rewards: dict, n_samples: int):
        return run.evaluate(pipe, examples, seeds, rewards, n_samples, cfg,
                            (functools.partial(trainer.sample_groups, grpo), grpo.decode_images, grpo.group_rewards))
    for name in ("base", "trained"):
        if name == "trained":
            result["step"] = load_trained(policy, optimizer, path, cfg.train)
        signals = {}  # the monitor's picture signals, as the run's evaluation lines hold them
        with autocast:
            images, total, each, layouts = run.evaluate_shared(evaluate, examples, evals[1], cfg.eval_samples,
                                                               run.EVAL_SEED, grid, signals=signals)  # one process
        result[name] = run.eval_record(0, examples, total, each, layouts, 0.0, signals)
        grids.append((images, total))
    with tempfile.TemporaryDirectory() as tmp:
        for (images, total), name in zip(grids, ("base", "trained")):
            shown = examples[:grid]
            run.save_grid(Path(tmp) / f"{name}.png", shown, images, total[:grid],
                           [f"{name}: {ex['prompt']}" for ex in shown])
        (run_dir / "images").mkdir(exist_ok=True)
        run_io.save_image(run_io.side_by_side(Path(tmp) / "base.png", Path(tmp) / "trained.png"),
                        run_dir / "images" / "compare.png")
    return {**result, "prompts": len(examples), "samples": cfg.eval_samples, "grid": run_dir / "images" / "compare.png"}


def table(result: dict) -> str:
    keys = [k for k in result["base"] if k.startswith("eval/")]
    width = max(len(k) for k in keys) - 5
    lines = [f"{'':{width}}  {'base':>8}  {'trained':>8}  {'diff':>8}"]
    for key in keys:
        base, trained = result["base"][key], result["trained"][key]
        lines.append(f"{key[5:]:{width}}  {base:8.4f}  {trained:8.4f}  {trained - base:+8.4f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path, help="a grpo.py --out directory, or its final/ folder")
    parser.add_argument("--eval-prompts", help="prompts file (default: the run's --eval-prompts)")
    parser.add_argument("--eval-samples", type=int, help="images per prompt (default: the run's)")
    parser.add_argument("--eval-reward", help="rewards only measured (default: the run's --eval-reward)")
    parser.add_argument("--grid", type=int, default=run.EVAL_GRID, help="prompts shown in the image grid (the first)")
    args = parser.parse_args(argv)
    try:
        result = compare(args.run, args.eval_prompts, args.eval_samples, args.eval_reward, args.grid)
    except ValueError as error:
        raise SystemExit(f"compare.py: error: {error}") from None
    step = f"the checkpoint of step {result['step']}" if result["step"] is not None else "final/"
    print(f"{args.run}: base vs trained ({step}) on {result['prompts']} prompts x {result['samples']} images, "
          "the same seeds")
    print(table(result))
    print(f"image grid: {result['grid']}")
    return result


if __name__ == "__main__":
    main()
