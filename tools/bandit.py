"""A known answer for GRPO's update: a bandit of 12 arms (a one-token "sequence"), trained with grpo.py's own
functions, against the closed-form optimum of the objective it is meant to maximise.

The objective E_pi[R] - beta KL(pi || ref) has one maximiser, G(y) = ref(y) exp(R(y) / beta) / Z (GX-Chen, Prakash, Guo,
Fergus and Ranganath, "KL-Regularized Reinforcement Learning is Designed to Mode Collapse", arXiv 2510.20817, 2025).
Where every right answer gets the same reward, G keeps the reference's odds among them; MARA (their Mode Anchored
Reward Augmentation) raises the reward of every sample at or above a threshold tau to R(z) + beta (log ref(z) -
log ref(y)), z the sample of the group at or above tau that the reference likes most: its target, G with those rewards,
puts the anchor's mass on every such sample, so mass spreads evenly over the right answers.

Each configuration below starts from the reference and trains the arm logits for `steps` steps of 64 samples (4 groups
of 16, or 16 of 4), then reports where it lands: the policy averaged over the last fifth of the steps, its
total-variation distance to G and to MARA's target, and its mass on the right answers. The update has grpo.update's
shape, written out for one token: mu epochs over the batch, each one Adam step on grpo.grpo_loss (its clip and its k3
KL), pi_old the first epoch's own log-probs; the advantages are grpo.group_advantages' or, for the KL in the reward and
MARA, helpers/variants.py's kl_in_reward and mara_rewards (the flags' own functions). Not exercised here: AdamW's decay,
the gradient's clip, the sampler's importance weights, sums over many tokens (test_variants.py checks those parts of
--kl-in-reward by hand). MARA's anchor is each group's: at G = 16 the best-liked right arm (1/6 of the target's mass) is in
95% of the groups, at G = 4 in 52%.

    python tools/bandit.py            # the table of docs/evaluation.md ("Where GRPO's update lands"), about 30 s
"""

import math
import sys
from pathlib import Path
from typing import NamedTuple

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # grpo.py, when run as a script

import grpo  # noqa: E402
from helpers.variants import kl_in_reward, mara_rewards  # noqa: E402  (--kl-in-reward, --mara-threshold)

# the bandit: 12 arms; arms 0-3 right (reward 1), arms 4-5 nearly right (0.9), the rest wrong (0); the reference
# uneven among the right answers (arm 0 four times as likely as arm 3) and on the wrong ones
REWARD = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.9, 0.9, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0])
REF_LOGITS = torch.tensor([1.4, 1.0, 0.6, 0.0, 0.8, 0.2, 1.2, 1.0, 0.5, 0.5, 0.0, -0.5])
BETA = 0.1  # the KL's weight (grpo.py's tiny default)
TAU = 0.85  # MARA's threshold: the right and the nearly right answers


class Setting(NamedTuple):
    name: str
    advantages: str  # "z-score" (grpo.group_advantages), "centred" (Dr. GRPO: R - mean), as the loss sees them
    kl: str  # "loss" (k3 in grpo_loss, beta), "reward" (R - beta log(pi_old / ref), no KL term in the loss)
    mu: int = 2  # updates per batch (the clip acts from the second)
    mara: bool = False  # MARA's augmented rewards before the rest
    group_size: int = 16


SETTINGS = [
    Setting("defaults: z-score, k3 in the loss, mu 2, clip", "z-score", "loss"),
    Setting("Dr. GRPO: R - mean, k3 in the loss, mu 2, clip", "centred", "loss"),
    Setting("KL in the reward: R - beta log(pi / ref), R - mean, mu 2, clip", "centred", "reward"),
    Setting("KL in the reward, z-scored", "z-score", "reward"),  # --kl-in-reward's default (the line above: none)
    Setting("MARA (tau 0.85) + KL in the reward", "z-score", "reward", mara=True),
    Setting("MARA (tau 0.85) + KL in the reward, G = 4 (16 groups)", "z-score", "reward", mara=True, group_size=4),
    Setting("MARA (tau 0.85) + the defaults", "z-score", "loss", mara=True),
]


def optimum(reward: torch.Tensor, ref_logprobs: torch.Tensor, beta: float) -> torch.Tensor:
    """G = ref exp(R / beta) / Z, the maximiser of E_pi[R] - beta KL(pi || ref), as (K,) probabilities."""
    return torch.softmax(ref_logprobs + reward / beta, dim=-1)


def mara_target(reward: torch.Tensor, ref_logprobs: torch.Tensor, beta: float, tau: float) -> torch.Tensor:
    """The optimum with MARA's rewards over the whole support (the anchor: the best-liked arm at or above tau)."""
    return optimum(mara_rewards(reward, ref_logprobs, beta, tau), ref_logprobs, beta)


def total_variation(p: torch.Tensor, q: torch.Tensor) -> float:
    return 0.5 * (p - q).abs().sum().item()


def train(setting: Setting, steps: int = 1500, samples: int = 64, lr: float = 0.05, beta: float = BETA,
          tau: float = TAU, seed: int = 0) -> torch.Tensor:
    """The arm logits trained from the reference with `setting` -> the (K,) policy averaged over the last fifth of
    the steps. Each step: `samples` arms drawn from pi_old in groups of setting.group_size, their rewards (MARA's if
    asked), the KL in the reward if asked, advantages, then mu epochs of grpo_loss (clip 0.2) over the whole batch, one Adam
    step each, pi_old the first epoch's own log-probs (as grpo.update)."""
    generator = torch.Generator().manual_seed(seed)
    ref_logprobs = torch.log_softmax(REF_LOGITS, dim=-1)
    logits = ref_logprobs.clone().requires_grad_()
    optimizer = torch.optim.Adam([logits], lr=lr)
    average, counted = torch.zeros_like(ref_logprobs), 0
    for step in range(steps):
        with torch.no_grad():
            pi_old = torch.log_softmax(logits, dim=-1)
            arms = torch.multinomial(pi_old.exp(), samples, replacement=True,
                                     generator=generator).view(-1, setting.group_size)
        reward = REWARD[arms]  # (P, G)
        if setting.mara:
            reward = torch.stack([mara_rewards(r, ref_logprobs[a], beta, tau) for r, a in zip(reward, arms)])
        if setting.kl == "reward":  # --kl-in-reward's advantages: centred (--scale-rewards none), or z-scored
            advantages = kl_in_reward(reward, pi_old[arms], ref_logprobs[arms], beta)
            advantages = grpo.group_advantages(advantages) if setting.advantages == "z-score" else advantages
        elif setting.advantages == "z-score":
            advantages = grpo.group_advantages(reward)
        else:  # Dr. GRPO's: the group mean as the baseline, no std
            advantages = reward - reward.mean(dim=-1, keepdim=True)
        kl_beta = beta if setting.kl == "loss" else 0.0
        old = None
        for _ in range(setting.mu):
            optimizer.zero_grad()
            logprobs = torch.log_softmax(logits, dim=-1)[arms].reshape(-1, 1)  # (P*G, 1): one token each
            if old is None:
                old = logprobs.detach()  # pi_old: no step yet, r = 1
            ref = ref_logprobs[arms].reshape(-1, 1)
            loss, _ = grpo.grpo_loss(logprobs, old, ref, advantages.reshape(-1), 0.2, kl_beta)
            loss.backward()
            optimizer.step()
        if step >= steps * 4 // 5:
            average += torch.softmax(logits.detach(), dim=-1)
            counted += 1
    return average / counted


def table(steps: int = 1500, seed: int = 0) -> list[dict]:
    """Every setting's landing: its TV distance to G and to MARA's target, and its mass on the right answers."""
    ref_logprobs = torch.log_softmax(REF_LOGITS, dim=-1)
    G = optimum(REWARD, ref_logprobs, BETA)
    mara = mara_target(REWARD, ref_logprobs, BETA, TAU)
    rows = []
    for setting in SETTINGS:
        pi = train(setting, steps=steps, seed=seed)
        rows.append({"setting": setting.name, "tv_to_G": total_variation(pi, G),
                     "tv_to_mara": total_variation(pi, mara), "right": pi[REWARD >= TAU].sum().item(),
                     "policy": [round(x, 3) for x in pi.tolist()]})
    return rows


def main() -> None:
    ref = torch.softmax(REF_LOGITS, dim=-1)
    G = optimum(REWARD, ref.log(), BETA)
    print(f"reference {[round(x, 3) for x in ref.tolist()]}")
    print(f"G         {[round(x, 3) for x in G.tolist()]}  (beta {BETA})")
    print(f"MARA      {[round(x, 3) for x in mara_target(REWARD, ref.log(), BETA, TAU).tolist()]}  (tau {TAU})")
    print("| setting | TV to G | TV to MARA's target | mass on R >= tau |")
    print("|---|---|---|---|")
    for row in table():
        print(f"| {row['setting']} | {row['tv_to_G']:.3f} | {row['tv_to_mara']:.3f} | {row['right']:.3f} |")


if __name__ == "__main__":
    main()
