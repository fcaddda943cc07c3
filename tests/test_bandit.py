"""Where GRPO's update lands, against the known optimum of its objective (tools/bandit.py): a 12-armed bandit with an
uneven reference and right answers of equal and of unequal reward, trained with grpo.py's own group_advantages and
grpo_loss (its clip, its k3 KL, mu 2) to convergence. The optimum of E[R] - beta KL(pi || ref) is G = ref exp(R / beta)
/ Z (GX-Chen et al. 2025); MARA's augmented rewards make its optimum even over the right answers.

    python -m pytest -q tests/test_bandit.py      # about 40 s on 2 cores
"""

import math

import pytest
import torch

from tools import bandit

REF = torch.log_softmax(bandit.REF_LOGITS, dim=-1)
SETTING = dict(zip(["defaults", "Dr. GRPO", "KL in the reward", "KL in the reward, z-scored", "MARA + KL in the reward",
                    "MARA, G = 4", "MARA + the defaults"], bandit.SETTINGS))


@pytest.fixture(scope="module")
def landed():
    """Each setting's policy after training (the mean over the last fifth of 1500 steps), by its short name."""
    return {name: bandit.train(setting) for name, setting in SETTING.items()}


def test_optimum_by_hand():
    """G by hand, arm by arm: ref_i exp(R_i / beta) over their sum; MARA's target: the anchor's mass on every arm at or
    above tau (the arm the reference likes most among them is arm 0)."""
    ref = bandit.REF_LOGITS.exp() / bandit.REF_LOGITS.exp().sum()
    weights = [ref[i].item() * math.exp(bandit.REWARD[i].item() / bandit.BETA) for i in range(12)]
    G = torch.tensor([w / sum(weights) for w in weights])
    assert torch.allclose(bandit.optimum(bandit.REWARD, REF, bandit.BETA), G, atol=1e-6)
    high = bandit.REWARD >= bandit.TAU
    target = bandit.mara_target(bandit.REWARD, REF, bandit.BETA, bandit.TAU)
    assert torch.allclose(target[high], torch.full((6,), target[0].item()), atol=1e-6) and target[~high].sum() < 1e-3


def test_mara_rewards():
    """MARA on a group by hand: the samples at or above tau get R(z) + beta (log ref(z) - log ref(y)), z the one the
    reference likes most among them; the others keep theirs; a group with none at or above tau is left alone."""
    reward, ref = torch.tensor([1.0, 0.9, 0.2, 1.0]), torch.log(torch.tensor([0.1, 0.4, 0.3, 0.2]))
    got = bandit.mara_rewards(reward, ref, 0.1, 0.85)  # anchor: sample 1 (ref 0.4), reward 0.9
    want = [0.9 + 0.1 * math.log(0.4 / 0.1), 0.9, 0.2, 0.9 + 0.1 * math.log(0.4 / 0.2)]
    assert torch.allclose(got, torch.tensor(want), atol=1e-6)
    assert torch.equal(bandit.mara_rewards(torch.tensor([0.1, 0.2]), ref[:2], 0.1, 0.85), torch.tensor([0.1, 0.2]))


def test_kl_in_the_reward_reaches_the_optimum(landed):
    """R - beta log(pi_old / ref), the group mean as baseline (no std): the estimator whose expected gradient is that
    of E[R] - beta KL(pi || ref) lands on G, within 0.005 in total variation (the table's 0.000: a beta 10% off lands
    0.02 away), through grpo_loss's clip at mu 2; z-scored too, --kl-in-reward's default (at G the shaped rewards are
    equal, whatever divides them)."""
    G = bandit.optimum(bandit.REWARD, REF, bandit.BETA)
    assert bandit.total_variation(landed["KL in the reward"], G) < 0.005
    assert bandit.total_variation(landed["KL in the reward, z-scored"], G) < 0.005


def test_mara_reaches_its_target(landed):
    """MARA with the KL in the reward lands on its target, even over the six right answers, within 0.005 at G = 16,
    where 95% of the groups hold the anchor (arm 0, 1/6 of the target's mass); at G = 4 52% do, and a group's
    anchor is often another right arm, and the landing is further from the target (measured: see the table), still nearer it than G."""
    target = bandit.mara_target(bandit.REWARD, REF, bandit.BETA, bandit.TAU)
    G = bandit.optimum(bandit.REWARD, REF, bandit.BETA)
    assert bandit.total_variation(landed["MARA + KL in the reward"], target) < 0.005
    small = landed["MARA, G = 4"]
    assert bandit.total_variation(small, target) < bandit.total_variation(small, G)


def test_the_defaults_land_elsewhere(landed):
    """The defaults (z-scores, k3 in the loss) land 0.11 from G: they keep the reference's odds among the equal right
    answers (arm 0 over arm 3 as the reference has it, 4x), drop the nearly right ones (0.9 of the reward: G gives
    them 12%, the defaults under 1%) and keep a little on the wrong ones; Dr. GRPO's advantages land nearer, 0.05."""
    G = bandit.optimum(bandit.REWARD, REF, bandit.BETA)
    defaults = landed["defaults"]
    assert 0.08 < bandit.total_variation(defaults, G) < 0.15
    assert defaults[4:6].sum() < 0.01 < 0.1 < G[4:6].sum()
    assert defaults[0] / defaults[3] == pytest.approx((REF[0] - REF[3]).exp().item(), rel=0.15)
    assert 0.02 < bandit.total_variation(landed["Dr. GRPO"], G) < 0.08


def test_mara_with_the_defaults_collapses(landed):
    """MARA's rewards need the KL in the reward: with the defaults' z-scores and k3 in the loss they favour the right
    answer the reference likes least (its augmented reward is the largest), and the policy collapses onto it."""
    collapsed = landed["MARA + the defaults"]
    assert collapsed.argmax().item() == 3 and collapsed.max() > 0.9
