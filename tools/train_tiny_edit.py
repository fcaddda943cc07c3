"""Teach the tiny GLM-Image to edit world.py's pictures: tiny_glm_image_edit/, loaded as `--model tiny-edit`.

  python tools/train_tiny_edit.py                        # ~14 min on 2 CPU cores; rewrites tiny_glm_image_edit/
  python tools/train_tiny_edit.py --quick --out /tmp/e   # a few steps (what the test runs)
  python tools/train_tiny_edit.py --examples             # rewrite examples/edits/ (sources and the two splits)
  python tools/train_tiny_edit.py --check-only           # re-measure the held-out checks of tiny_glm_image_edit/

GLM-Image edits with the source in the AR's prompt: its VQ codes (the tiny model's VQ gives each 32-pixel cell its
label) sit between the instruction's image tokens, and the AR writes the large grid of the result; the DiT paints
it with the source attended. Only the AR learns here: the DiT, VAE, T5 and processor are tiny_glm_image/'s, linked
(the tiny DiT already paints any grid of codes right, with or without the source attended).

  1. Data: instructions of the four kinds (world.EDIT_KINDS) over the training combinations of world.edit_split()
     (a quarter of the (kind, object, argument) combinations are held out and never trained on), each with a source
     scene it applies to (world.edit_source) and the scene it asks for (world.apply_edit). A share of the pairs
     (--noise, 0.4) has a wrong result, as a careless editor makes: the edit not done, done to the wrong place or in
     the wrong colour, or another object lost on the way. The model learns those mistakes too: room for GRPO.
  2. AR: next-token prediction of the result's 9 codes after the instruction and the source's codes, at the 3D
     positions grpo.py gives an edit (grpo.rope_positions), starting from tiny_glm_image/'s AR.
  3. save_pretrained (the AR; the other parts linked), reloaded, and its held-out accuracy measured through
     grpo.py's own sampling and decoding and the `edit` reward on examples/edits_heldout.jsonl: the share of
     (pair, sample) drawn fully right; and the DiT's part: the share of the pairs' right results (their codes) it
     paints, with the source attended, into a picture read as fully right.
"""

import argparse
import json
import os
import random
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # grpo.py and the files it imports live in the repository root

import grpo  # noqa: E402
from helpers import trainer, user_input  # noqa: E402
from helpers import run  # noqa: E402
from helpers import world  # noqa: E402
from helpers import rewards  # noqa: E402
from helpers.rewards import edit_reward  # noqa: E402
from train_tiny import cosine_lr, left_padded, set_lr, swap_in  # noqa: E402  (tools/, beside this file)

SIZE, N_LARGE = world.SIZE, world.GRID * world.GRID
EXAMPLES = ROOT / "examples"
LINKED = ("processor", "scheduler", "text_encoder", "tokenizer", "transformer", "vae")  # tiny_glm_image's own
TRAIN_PAIRS, HELD_OUT_PAIRS = 150, 40  # per kind, in examples/


def log(message: str) -> None:
    print(message, flush=True)


# ---- 1. Data -------------------------------------------------------------------------------------

def mistake(source: dict, want: dict, key: tuple, rng: random.Random) -> dict:
    """The result of a careless edit: not done, done to the wrong cell or in the wrong colour, or another object
    lost. Never the result asked for."""
    kind, obj, arg = key
    free = [c for c in world.CELL_NAMES if c not in want]
    while True:
        wrong, how = dict(want), rng.choice(["undone", "place", "colour", "lost"])
        if how == "undone":
            wrong = dict(source)
        elif how == "place" and kind in ("move", "add") and free:
            wrong[rng.choice(free)] = wrong.pop(arg)
        elif how == "colour" and kind in ("recolour", "add"):
            cell = arg if kind == "add" else next(c for c, o in source.items() if o == obj)
            wrong[cell] = (rng.choice([c for c in world.COLOURS if c not in (obj[0], arg)]), obj[1])
        elif how == "lost" and len(wrong) > 1:
            del wrong[rng.choice(sorted(wrong))]
        if wrong != want:
            return wrong


def draw_pair(rng: random.Random, by_kind: dict, noise: float) -> tuple[str, dict, dict]:
    """An instruction (a kind, then a training combination of it, uniformly), its source and its result (with
    probability `noise` a careless one)."""
    key = rng.choice(by_kind[rng.choice(world.EDIT_KINDS)])
    source = world.edit_source(key, rng)
    want = world.apply_edit(source, key)
    return world.edit_of(*key), source, mistake(source, want, key, rng) if rng.random() < noise else want


def write_examples(seed: int = 0) -> None:
    """examples/edits/*.png (the sources, rendered) and examples/edits_train.jsonl / edits_heldout.jsonl: per kind
    TRAIN_PAIRS pairs of training combinations and HELD_OUT_PAIRS of held-out ones ("category": the kind)."""
    train, held = world.edit_split()
    folder = EXAMPLES / "edits"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir()
    for split, keys, per_kind in (("train", train, TRAIN_PAIRS), ("heldout", held, HELD_OUT_PAIRS)):
        rng, lines = random.Random(f"{seed}-{split}"), []
        for kind in world.EDIT_KINDS:
            mine = [k for k in keys if k[0] == kind]
            for i in range(per_kind):
                key = mine[i % len(mine)] if i < len(mine) else rng.choice(mine)
                source = world.edit_source(key, rng)
                name = f"edits/{split}_{kind}_{i:02d}.png"
                world.render(source, rng).save(EXAMPLES / name)
                lines.append({"prompt": world.edit_of(*key), "source": name, "category": kind})
        rng.shuffle(lines)  # kinds mixed, so that a run's first steps see all four
        (EXAMPLES / f"edits_{split}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
        log(f"examples/edits_{split}.jsonl: {len(lines)} pairs")


# ---- 2. AR ---------------------------------------------------------------------------------------

class Prompts:
    """Each instruction's prompt ids (the source's N_LARGE image tokens as placeholders) and the 3D positions of
    prompt + result grid, as grpo.group_prompt and grpo.token_logits build them for an edit (cached)."""

    def __init__(self, pipe):
        self.pipe, self.cache = pipe, {}
        config = pipe.vision_language_encoder.config
        self.ids = (config.image_start_token_id, config.image_end_token_id)
        self.image_token = config.image_token_id
        self.blank = world.render({})

    def __call__(self, instruction: str) -> tuple[torch.Tensor, torch.Tensor]:
        if instruction not in self.cache:
            inputs = grpo.group_inputs(self.pipe.processor, instruction, 1, SIZE, SIZE, "cpu", self.blank)
            ids = inputs["input_ids"][0]
            assert int((ids == self.image_token).sum()) == N_LARGE, "a 96x96 source is 3x3 tokens"
            positions = grpo.rope_positions(ids, inputs["image_grid_thw"][:2], N_LARGE, *self.ids)
            self.cache[instruction] = (ids, positions[:, 0])
        return self.cache[instruction]


def ar_batch(prompts: Prompts, pairs: list[tuple], pad_id: int):
    """Left-padded teacher-forcing inputs for (instruction, source, result) triples -> input_ids, attention_mask,
    position_ids (3, B, L) and targets (B, L) (-100: no loss; the last N_LARGE are the result's codes)."""
    rows = []
    for instruction, source, result in pairs:
        ids, positions = prompts(instruction)
        ids = ids.masked_scatter(ids == prompts.image_token, torch.tensor(world.labels(source)))  # the source's codes
        tokens = torch.tensor(world.labels(result))
        rows.append((torch.cat([ids, tokens[:-1]]), positions,
                     torch.cat([torch.full((len(ids) - 1,), -100), tokens])))
    return left_padded(rows, pad_id)


def train_ar(pipe, steps: int, seed: int, noise: float, batch: int = 64, peak: float = 1e-3) -> float:
    """Next-token prediction of the result's codes (cosine lr, AdamW); returns the last 100 steps' mean loss."""
    ar = pipe.vision_language_encoder
    ar.train().requires_grad_(True)
    ar.model.visual.requires_grad_(False), ar.model.vqmodel.requires_grad_(False)
    K, pad = ar.config.vq_config.num_embeddings, ar.config.image_end_token_id
    train, _ = world.edit_split()
    by_kind = {kind: [k for k in train if k[0] == kind] for kind in world.EDIT_KINDS}
    prompts, rng = Prompts(pipe), random.Random(seed)
    optimizer = torch.optim.AdamW([p for p in ar.parameters() if p.requires_grad], lr=peak, betas=(0.9, 0.98),
                                  weight_decay=0.01)
    start, losses = time.perf_counter(), []
    for step in range(steps):
        input_ids, mask, positions, targets = ar_batch(prompts, [draw_pair(rng, by_kind, noise) for _ in range(batch)],
                                                       pad)
        logits = ar(input_ids=input_ids, attention_mask=mask, position_ids=positions, use_cache=False).logits
        loss = F.cross_entropy(logits[..., :K].float().flatten(0, 1), targets.flatten(), ignore_index=-100)
        set_lr(optimizer, cosine_lr(step, steps, peak))
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ar.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.item())
        if (step + 1) % 250 == 0:
            log(f"  ar step {step + 1}: loss {np.mean(losses[-250:]):.4f}, {time.perf_counter() - start:.0f} s")
    ar.eval().requires_grad_(False)
    return float(np.mean(losses[-100:]))


# ---- 3. Save and check ---------------------------------------------------------------------------

def save(pipe, tmp: Path) -> None:
    """The pipeline's folder at `tmp` (beside the one it will replace): the trained AR, and tiny_glm_image/'s
    model_index.json and other parts, which this script never changes, as relative links to them."""
    shutil.rmtree(tmp, ignore_errors=True)
    pipe.vision_language_encoder.save_pretrained(tmp / "vision_language_encoder")
    shutil.copy(grpo.TINY / "model_index.json", tmp / "model_index.json")
    for part in LINKED:
        (tmp / part).symlink_to(Path(os.path.relpath(grpo.TINY / part, tmp)))


def held_out_accuracy(pipe, pairs: list[dict], samples: int = 8, seed: int = 0) -> dict:
    """`samples` results of each held-out pair (seeds fixed per pair), through grpo.sample_groups and
    grpo.decode_images at the tiny settings, scored by the edit reward -> {"accuracy", "reward", each kind's}."""
    cfg = trainer.parse_config(grpo, ["--model", "tiny-edit"])
    right, scores, kinds = [], [], []
    for i, pair in enumerate(pairs):
        source = user_input.load_image(EXAMPLES / pair["source"], SIZE, SIZE, "source")  # as grpo.py loads it
        with torch.no_grad():
            rollout, = trainer.sample_groups(grpo, pipe, [pair["prompt"]], samples, cfg.height, cfg.width,
                                             cfg.temperature, [seed * 1_000_003 + i], cfg.top_k, cfg.top_p, [source])
            images = grpo.decode_images(pipe, pair["prompt"], rollout.tokens, rollout.prompt.large_hw, cfg.height,
                                        cfg.width, cfg.num_inference_steps, cfg.decode_seed, cfg.guidance_scale,
                                        rollout.prompt.source)
        score = edit_reward(images, {"prompt": pair["prompt"], "source": source})
        right += (score == 1).tolist()
        scores += score.tolist()
        kinds += [pair["category"]] * samples
    per_kind = {k: float(np.mean([r for r, kk in zip(right, kinds) if kk == k])) for k in world.EDIT_KINDS}
    return {"accuracy": float(np.mean(right)), "reward": float(np.mean(scores)), **per_kind}


def dit_check(pipe, pairs: list[dict]) -> float:
    """The share of the pairs whose RIGHT result (their codes: the source's scene with the edit applied) the DiT
    paints, with the source attended, into a picture the edit reward reads as fully right: the decoder's part of
    the accuracy, which GRPO on the AR cannot change."""
    cfg = trainer.parse_config(grpo, ["--model", "tiny-edit"])
    right = []
    for pair in pairs:
        source = user_input.load_image(EXAMPLES / pair["source"], SIZE, SIZE, "source")  # as grpo.py loads it
        _, want = rewards.edit_asked({**pair, "source": source})
        _, _, large_hw, src = grpo.edit_prompt(pipe, pair["prompt"], 1, SIZE, SIZE, source)
        images = grpo.decode_images(pipe, pair["prompt"], torch.tensor([world.labels(want)]), large_hw, SIZE, SIZE,
                                    cfg.num_inference_steps, cfg.decode_seed, cfg.guidance_scale, src)
        right.append(float(edit_reward(images, {"prompt": pair["prompt"], "source": source})[0] == 1.0))
    return float(np.mean(right))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(grpo.TINY_MODELS["tiny-edit"]), help="checkpoint folder to write")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=4000, help="AR training steps (batches of 64 pairs)")
    parser.add_argument("--noise", type=float, default=0.4, help="share of pre-training pairs with a careless result")
    parser.add_argument("--quick", action="store_true", help="a few steps (for the test)")
    parser.add_argument("--examples", action="store_true", help="only rewrite examples/edits/ and its two splits")
    parser.add_argument("--check-only", action="store_true", help="re-measure the checks of the model in --out")
    args = parser.parse_args(argv)
    run.quiet_libraries()
    if args.examples:
        write_examples(args.seed)
        return {}
    pairs = [json.loads(x) for x in (EXAMPLES / "edits_heldout.jsonl").read_text().splitlines()]
    pairs = pairs[:4] if args.quick else pairs
    if args.check_only:  # the held-out numbers of the model in --out, into its report; the weights untouched
        out = Path(args.out)
        report = json.loads((out / "training_report.json").read_text())
        pipe = grpo.load_glm_image(str(out))
        report |= {"held_out": held_out_accuracy(pipe, pairs, 2 if args.quick else 8, report["seed"]),
                   "dit_decoded_right": dit_check(pipe, pairs)}
        (out / "training_report.json").write_text(json.dumps(report, indent=1) + "\n")
        log(f"re-checked {out}: held-out edits fully right {report['held_out']['accuracy']:.3f}, right results "
            f"decoded right {report['dit_decoded_right']:.3f}")
        return report
    torch.manual_seed(args.seed)
    total = time.perf_counter()
    pipe = grpo.load_glm_image("tiny")
    loss = train_ar(pipe, 3 if args.quick else args.steps, args.seed, args.noise)
    log(f"2. ar: loss {loss:.4f}, {time.perf_counter() - total:.0f} s")
    out = Path(args.out)
    tmp = out.with_name(out.name + ".tmp")  # written in full, checked, then swapped in: never half-written
    save(pipe, tmp)
    from diffusers import GlmImagePipeline
    loaded = grpo.only_ar_trains(GlmImagePipeline.from_pretrained(tmp))
    result = held_out_accuracy(loaded, pairs, 2 if args.quick else 8, args.seed)
    report = {"seed": args.seed, "noise": args.noise, "steps": args.steps, "loss": loss, "held_out": result,
              "dit_decoded_right": dit_check(loaded, pairs), "minutes": (time.perf_counter() - total) / 60,
              "torch_threads": torch.get_num_threads()}
    (tmp / "training_report.json").write_text(json.dumps(report, indent=1) + "\n")
    swap_in(tmp, out)
    log(f"3. saved {out}; held-out edits fully right {result['accuracy']:.3f} (reward {result['reward']:.3f}; "
        + ", ".join(f"{k} {result[k]:.2f}" for k in world.EDIT_KINDS) + f"), total {report['minutes']:.1f} min")
    return report


if __name__ == "__main__":
    main()
