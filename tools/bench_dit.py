"""What --sde-steps and --sde-window cost: one dit_grpo.py step on the tiny model, timed by phase.

  OMP_NUM_THREADS=2 python tools/bench_dit.py            # 6 settings x 5 steps (about 20 s on 2 cores, alone)

A step = sampling 2 prompts x 8 chains through the pipeline with the SDE scheduler (dit_grpo.sample_chain) and one
update (dit_grpo.train_step, micro-batches of 4, guidance 1.5 so every step calls the DiT twice, as the real model's
default does). Sampling costs one DiT call per denoising step (two with guidance); the update costs a forward and a
backward per TRAINED step (the window), so --sde-window cuts the update and --sde-steps cuts both. Printed: seconds
per step by phase and each setting's total as a ratio to the first (all steps of the tiny model's 2 trained).
"""

import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # grpo.py and the files it imports live in the repository root

import dit_grpo  # noqa: E402
import grpo  # noqa: E402
from helpers import trainer  # noqa: E402
from helpers import run  # noqa: E402

SETTINGS = [(2, 0), (2, 1), (4, 0), (4, 1), (8, 0), (8, 2)]  # (denoising steps in training, window; 0 = all)
CAPTIONS = ["two red circles", "a blue square left of a yellow triangle"]


def main(repeats: int = 5) -> list[dict]:
    run.quiet_libraries()
    pipe = grpo.load_glm_image("tiny")
    dit = pipe.transformer.requires_grad_(True)
    optimizer = torch.optim.AdamW(dit.parameters(), lr=0.0)  # lr 0: the weights, hence every step's work, stay put
    rollouts = trainer.sample_groups(grpo, pipe, CAPTIONS, 1, 96, 96, 0.9, list(range(len(CAPTIONS))))
    rows = []
    for steps, window in SETTINGS:
        times = {"sample": 0.0, "update": 0.0}
        for repeat in range(repeats + 1):  # the first is a warm-up
            start = time.perf_counter()
            chains = [dit_grpo.sample_chain(pipe, c, r.tokens.repeat(8, 1), r.prompt.large_hw, 96, 96, steps, 1.5,
                                            repeat * 10 + i, 0.7, window)
                      for i, (c, r) in enumerate(zip(CAPTIONS, rollouts))]
            middle = time.perf_counter()
            advantages = grpo.group_advantages(torch.stack([c.images.mean(dim=(1, 2, 3)) for c in chains]))
            dit_grpo.train_step(dit, optimizer, chains, advantages, None, noise_level=0.7,
                                steps=dit_grpo.window(steps, window), clip_eps=0.2, kl_beta=0.0, micro_batch_size=4,
                                max_grad_norm=1.0)
            if repeat:
                times["sample"] += (middle - start) / repeats
                times["update"] += (time.perf_counter() - middle) / repeats
        rows.append({"sde_steps": steps, "sde_window": window, **times, "total": times["sample"] + times["update"]})
    print("| --sde-steps | --sde-window | trained steps | sample s | update s | step s | vs first |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        trained = len(dit_grpo.window(row["sde_steps"], row["sde_window"]))
        print(f"| {row['sde_steps']} | {row['sde_window'] or 'all'} | {trained} | {row['sample']:.2f} | "
              f"{row['update']:.2f} | {row['total']:.2f} | {row['total'] / rows[0]['total']:.2f}x |")
    return rows


if __name__ == "__main__":
    main()
