"""The plain baseline GRPO has to beat: rejection sampling (best-of-G fine-tuning, as RAFT), from grpo.py's own pieces.

Each step samples G images per prompt exactly as grpo.py does and scores them; the AR is then fine-tuned on each
group's best sample alone: grpo.py's train_step with advantage 1 for the best sample (the first, on a tie) and 0 for
the others. With one update per batch (mu 1) the ratio is 1 and the loss is minus the best sample's mean log-prob
over the group: a supervised step on the best of G. No KL, no clip, no diversity shaping; the same number of samples
as a grpo.py run with the same flags. The loop, evaluation, checkpoints and curves are grpo.main's.

  python tools/rejection_sampling.py --prompts examples/shapes.txt --reward shapes --steps 400 --out runs/rs
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # grpo.py and its helpers live in the repository root

import grpo  # noqa: E402

GRPO_ADVANTAGES = grpo.group_advantages


def best_of_group(reward: torch.Tensor) -> torch.Tensor:
    """(P, G) rewards -> (P, G) advantages: 1 for each group's best sample (the first of a tie), 0 for the rest."""
    return torch.nn.functional.one_hot(reward.argmax(dim=-1), reward.shape[-1]).to(reward)


def main(argv: list[str] | None = None) -> dict:
    """grpo.main with rejection sampling's advantages (best_of_group in place of grpo.group_advantages) and the plain
    supervised update (--mu 1, --kl-beta 0, no variant of the advantages)."""
    argv = sys.argv[1:] if argv is None else argv
    grpo.group_advantages = best_of_group  # main looks the step up by name, so it takes this one
    try:
        return grpo.main([*argv, "--mu", "1", "--kl-beta", "0", "--diversity", "0", "--unlikeliness", "0",
                          "--scale-rewards", "group"])
    finally:
        grpo.group_advantages = GRPO_ADVANTAGES


if __name__ == "__main__":
    main()
