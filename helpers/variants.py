"""The options that are off in both presets, beside grpo.py's lesson (as cleanrl keeps its variants
beside ppo.py): each was measured (docs/evaluation.md) and none beat the defaults, but each is a
method people reach for. They reach the trainer (helpers/trainer.py's run_steps, grpo.py's steps 4 and 5) through
two seams, each one call:

  - `advantages` (step 4): --reward-aggregation normalize, --diversity, --gardo-diversity,
    --unlikeliness, --scale-rewards batch | none, --cluster-bonus; and the KL-regularised objective's own
    advantages, --kl-in-reward and --mara-threshold (tools/bandit.py measures where each update lands);
  - `update` (step 5): the micro-batches and the micro-batch loss, for --policy-dist
    truncated, --train-tokens all, --clip-eps-high, --kl-on above_mean, --truncation-weight mass
    and --entropy-bonus;

and through grpo_loss' symbols, which may vary by sample or token. With none of the options on,
both seams return what they were given: the lesson runs as written. Each builds on grpo.py's
functions, never a copy: they arrive as an argument, `lesson` (grpo.py itself), since imports run
one way (grpo.py -> helpers/, never back). The flags: `VariantSettings`, which helpers/run.py adds
to grpo.py's command line.
"""

import contextlib
import dataclasses
import functools
import math

import torch

from .user_input import reward_weights, split_reward
from .parallel import gather_rows


def _setting(default, help: str, choices: tuple = ()):
    """A variant's field whose doc becomes its --help, as grpo.arg."""
    return dataclasses.field(default=default, metadata={"help": help, "choices": choices})


@dataclasses.dataclass
class VariantSettings:  # grpo.py's flags for the options beside the lesson: all off in both presets
    # step 4, the advantages
    reward_aggregation: str = _setting("sum", "the rewards' weighted sum, or each z-scored within its group, "
                                              "summed, then normalised over the batch (TRL's normalize_then_sum)",
                                       ("sum", "normalize"))
    scale_rewards: str = _setting("group", "advantages / the std of the group, of the step (batch) "
                                           "or none (Dr. GRPO's A = R - mean)", ("group", "batch", "none"))
    diversity: float = _setting(0.0, "a bonus diversity / c on each reward, c its group's "
                                      "samples of the same large grid")
    gardo_diversity: str = _setting("none", "GARDO's diversity factor: each advantage >= 0 times d / mean(d) of "
                                            "its group, d a sample's distance to its nearest group-mate (tokens: "
                                            "the share of its large grid's codes that differ; dino: 1 - cosine of "
                                            "the pictures' DINOv2 features; GARDO: DINOv3's)",
                                    ("none", "tokens", "dino"))
    cluster_bonus: float = _setting(0.0, "DiverseGRPO's cluster bonus: + bonus / c on each of a group's best "
                                         "samples, c the samples of its cluster (large grids linked when they differ "
                                         "in at most --cluster-radius of their codes)")
    cluster_radius: float = _setting(0.15, "--cluster-bonus: the share of codes two samples' large grids may "
                                           "differ in and share a cluster (0: identical grids only)")
    unlikeliness: float = _setting(0.0, "+-U/2 among a group's best samples, toward the least likely "
                                        "(after He et al.'s unlikeliness reward; docs/claims.md)")
    kl_in_reward: bool = _setting(False, "the KL in the reward: R - beta log(pi_old / ref), the log-probs summed "
                                         "over each sample's loss tokens, z-scored within its group (--scale-rewards "
                                         "none: minus its group's mean only), and no KL term in the loss: the "
                                         "estimator whose expected gradient is E[R] - beta KL(pi || ref)'s, up to "
                                         "each group's positive scale (tools/bandit.py). beta then weighs a "
                                         "sequence's log-ratio in reward units: at the same --kl-beta about n / "
                                         "std(R) times the loss KL's weight (n the loss tokens: 9 tiny, 1024 real)")
    mara_threshold: float | None = _setting(None, "MARA (GX-Chen et al. 2025), with --kl-in-reward: each sample whose "
                                                  "reward is at or above this gets R(z) + beta (log ref(z) - log "
                                                  "ref(y)), z its group's sample at or above it that the reference "
                                                  "likes most: the target spreads evenly over them")
    # step 5, the loss
    clip_eps_high: float | None = _setting(None, "DAPO's clip-higher: the upper clip 1 + this "
                                                 "(default: --clip-eps)")
    kl_on: str = _setting("all", "the KL on every sample; only on those with A >= 0 (above_mean: a gate by the "
                                 "advantage's sign); or GARDO's gate, on the samples the trained reward ranks "
                                 "furthest below where the weight-0 rewards of --reward rank them (uncertain)",
                          ("all", "above_mean", "uncertain"))
    reference_reset_every: int = _setting(0, "GARDO's reset: N steps after its last reset the KL's reference "
                                             "becomes the policy as it is (0: never; the reference stays the "
                                             "initial weights)")
    reference_reset_kl: float = _setting(0.0, "GARDO's KL trigger, with --reference-reset-every: a reset also after "
                                              "a step one of whose updates had a mean kl above this (0: off; GARDO's "
                                              "kl_thres, whose 3e-4 is on another KL's scale: not measured here)")
    entropy_bonus: float = _setting(0.0, "+ bonus x entropy on the tokens less certain than the step's "
                                         "mean (after EG-GRPO's idea; its code differs: docs/claims.md)")
    train_tokens: str = _setting("large", "tokens in the loss: the large grid, or all (the "
                                          "preview too)", ("large", "all"))
    policy_dist: str = _setting("full", "trained: the whole softmax p, or the sampler's truncated "
                                        "q (docs/real_model.md)", ("full", "truncated"))
    truncation_weight: str = _setting("none", "--policy-dist full with top-k / top-p: each loss "
                                              "token's term times its nucleus' mass p / q",
                                      ("mass", "none"))
    sampler_correction: str = _setting("token_truncate", "TRL's mismatch weights pi_old / pi_sampler: per token or "
                                                         "per sequence, above --sampler-cap cut to it (truncate) or "
                                                         "to 0 (mask), or none (grpo.py: token_truncate)",
                                       ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask",
                                        "none"))


DEFAULTS = VariantSettings()


def given(cfg) -> list[str]:
    """The variant flags `cfg` turns on (those not at their default), as --flag names."""
    return ["--" + field.name.replace("_", "-") for field in dataclasses.fields(VariantSettings)
            if getattr(cfg, field.name) != getattr(DEFAULTS, field.name)]


def validate(cfg) -> None:
    """Raise ValueError with a one-line fix for variant settings that cannot go together (each number's own range:
    helpers/user_input.py's RULES)."""
    for flag, on in (("--kl-on uncertain", cfg.kl_on == "uncertain"),
                     (f"--reference-reset-every {cfg.reference_reset_every}", cfg.reference_reset_every > 0)):
        if on and cfg.kl_beta == 0:
            raise ValueError(f"{flag} acts on the KL, which --kl-beta 0 turns off; give --kl-beta > 0 or drop it")
    if cfg.reference_reset_kl > 0 and not cfg.reference_reset_every > 0:
        raise ValueError(f"--reference-reset-kl {cfg.reference_reset_kl} triggers the reset that "
                         "--reference-reset-every N schedules; give both (GARDO's: N 16)")
    if cfg.kl_on == "uncertain" and not auxiliary(cfg.reward):
        raise ValueError(f"--kl-on uncertain ranks the samples by the weight-0 rewards of --reward too, and "
                         f"'{cfg.reward}' has none: add one, e.g. --reward {cfg.reward.split(',')[0]},size=0")
    if cfg.mara_threshold is not None and not cfg.kl_in_reward:
        raise ValueError(f"--mara-threshold {cfg.mara_threshold:g} sets the target of E[R] - beta KL(pi || ref), which "
                         "only the KL in the reward reaches (with the KL in the loss the policy collapses onto the "
                         "right answer the reference likes least: tools/bandit.py); add --kl-in-reward")
    if cfg.kl_in_reward and cfg.kl_beta == 0:
        raise ValueError("--kl-in-reward weighs the reference's log-probs by --kl-beta, which is 0; give --kl-beta > 0")
    others = {"--reward-aggregation": cfg.reward_aggregation != "sum",
              "--diversity": cfg.diversity > 0, "--cluster-bonus": cfg.cluster_bonus > 0,
              "--gardo-diversity": cfg.gardo_diversity != "none", "--unlikeliness": cfg.unlikeliness > 0}
    if cfg.kl_in_reward and any(others.values()):
        raise ValueError(f"--kl-in-reward makes its own advantages (the shaped reward, z-scored), which "
                         f"{', '.join(flag for flag, on in others.items() if on)} would change; drop one of them")
    if cfg.kl_in_reward and (cfg.top_p < 1 or cfg.top_k > 0):
        raise ValueError("--kl-in-reward's log(pi / ref) estimates KL(pi || ref) only for samples drawn from pi, and "
                         "top-k / top-p draws from a nucleus of it; give --top-p 1 --top-k 0")
    if cfg.kl_in_reward and cfg.kl_on != "all":
        raise ValueError(f"--kl-on {cfg.kl_on} gates the KL term of the loss, which --kl-in-reward moves into the "
                         "reward; drop one of the two")
    if cfg.reward_aggregation == "normalize" and cfg.scale_rewards != "group":
        raise ValueError(f"--scale-rewards {cfg.scale_rewards} does not apply with --reward-aggregation normalize, "
                         "whose last step normalises over the whole batch (as TRL's); drop one of the two")


# ---- Step 4: the advantages ---------------------------------------------------------------------

def advantages(z_scores: torch.Tensor, rollouts: list, reward: torch.Tensor, each: dict,
               in_loss: torch.Tensor, cfg, lesson, images: list | None = None, reference=None,
               state: "State | None" = None) -> torch.Tensor:
    """The seam of step 4: grpo.group_advantages' (P, G) z-scores of the step's rewards (`rollouts`: its groups;
    `reward`, `each`: the (P, G) weighted sum and each reward's; `in_loss`: (P,) bool, False for a group with a
    non-finite reward; `images`: each group's (G, 3, H, W) pictures, which --gardo-diversity dino reads) -> the
    (P, G) advantages with the options on: TRL's normalize_then_sum (--reward-aggregation normalize), or the
    z-scores of the rewards plus the --diversity and --cluster-bonus bonuses, scaled by the step's std or by none
    (--scale-rewards); GARDO's diversity factor on the advantages >= 0 (--gardo-diversity); then each group's best
    samples' credit moved toward the least likely (--unlikeliness). The groups out of the loss stay 0; a step with
    none in it gives zeros (and, under torchrun, joins the other processes' collectives). None on: `z_scores`
    itself. `lesson`: grpo.py (its group_advantages z-scores the shaped rewards). With --kl-in-reward (and MARA's
    rewards, --mara-threshold) the advantages are kl_regularised's instead, from `reference` (a rollout -> its (G, N)
    log-probs under pi_old and the frozen reference); their step's readings go to `state.readings`."""
    if cfg.kl_in_reward:  # (--mara-threshold needs it: validate)
        return kl_regularised(reward, rollouts, in_loss, cfg, reference, lesson, state)
    options = (cfg.reward_aggregation != "sum", cfg.diversity > 0, cfg.scale_rewards != "group", cfg.unlikeliness > 0,
               cfg.gardo_diversity != "none", cfg.cluster_bonus > 0)
    if not any(options):
        return z_scores
    reward, each = reward[in_loss], {name: values[in_loss] for name, values in each.items()}
    kept = [rollout for rollout, keep in zip(rollouts, in_loss) if keep]  # empty when every group left
    A = z_scores[in_loss]  # (P', G)
    shaped = reward
    bonus = torch.zeros_like(reward)  # --diversity: 1 / c, c the group's samples of the same large grid
    if cfg.diversity > 0 and kept:
        bonus = 1 / repeats(large_grids(kept)).to(reward)
    clustered = torch.zeros_like(reward)  # --cluster-bonus: 1 / c on the best, c the samples of its cluster
    if cfg.cluster_bonus > 0 and kept:
        best = reward == reward.amax(dim=-1, keepdim=True)
        clustered = best / cluster_sizes(large_grids(kept), cfg.cluster_radius).to(reward)
    if (cfg.diversity > 0 or cfg.cluster_bonus > 0) and kept:
        shaped = shaped + cfg.diversity * bonus + cfg.cluster_bonus * clustered
        A = lesson.group_advantages(shaped)
    if cfg.reward_aggregation == "normalize":  # a reward's scale no longer weighs: each has std 1
        # the bonuses join as more rewards, of weights --diversity and --cluster-bonus
        A = normalize_then_sum(each | {"diversity": bonus, "clusters": clustered},
                               reward_weights(cfg.reward) | {"diversity": cfg.diversity, "clusters": cfg.cluster_bonus})
    elif cfg.scale_rewards != "group":
        A = rescaled(A, shaped, cfg.scale_rewards)
    if cfg.gardo_diversity != "none" and kept:  # GARDO: the better samples' credit grows with their novelty
        if cfg.gardo_diversity == "dino":
            pictures = [group for group, keep in zip(images, in_loss) if keep]
            d = torch.stack([nearest(1 - feature_similarity(group, dino_checkpoint(cfg.reward)))
                             for group in pictures])
        else:
            d = nearest_distance(large_grids(kept))
        A = A * gardo_factor(d.to(A), A)
    if cfg.unlikeliness > 0 and kept:
        loglik = torch.stack([grid_logprob(rollout) for rollout in kept])  # (P', G)
        A = A + credit_to_unlikely(reward, loglik, cfg.unlikeliness)
    out = torch.zeros_like(z_scores)
    out[in_loss] = A
    return out


def kl_regularised(reward: torch.Tensor, rollouts: list, in_loss: torch.Tensor, cfg, sequence_logprobs, lesson,
                   state: "State | None" = None) -> torch.Tensor:
    """The advantages of E[R] - beta KL(pi || ref), beta --kl-beta, for the (P, G) rewards of the step's groups:
    MARA's rewards first (--mara-threshold tau: mara_rewards), then each sample's R - beta log(pi_old / ref), the
    log-probs summed over its loss tokens (the large grid; all N with --train-tokens all), minus its group's mean
    (kl_in_reward), then divided by its group's std (lesson.group_advantages: grpo.py's z-score; --scale-rewards batch:
    the step's std; none: not divided). `sequence_logprobs`: a rollout -> its (G, N) log-probs under the policy
    before the step's update (pi_old) and under the frozen reference, both teacher-forced in one precision (helpers/trainer.py's
    sequence_logprobs: the sampler's rounding, summed over a thousand tokens, would enter the advantage). Called for
    every group, kept or not: under torchrun each process runs the same forwards (FSDP's collectives). Groups out of
    the loss stay 0. Readings (`state.readings`, this step's, every process's): the share of the samples MARA
    augmented, their anchors' mean reward (absent when no group reached tau), the mean beta log(pi_old / ref) taken
    off. The target is G given the preview: with the default --train-tokens large the preview's tokens are in neither
    sum."""
    readings = {}
    if state is not None:
        state.readings = readings
    start = 0 if cfg.train_tokens == "all" else None  # the loss tokens' first column
    sums = []  # (G,) pi_old, (G,) ref: each rollout's, summed over its loss tokens
    for rollout in rollouts:
        policy, ref = sequence_logprobs(rollout)
        first = math.prod(rollout.prompt.preview_hw) if start is None else start
        sums.append((policy[:, first:].sum(dim=-1), ref[:, first:].sum(dim=-1)))
    G = reward.shape[1]
    policy = torch.stack([p for (p, _), keep in zip(sums, in_loss) if keep]).to(reward) if in_loss.any() else \
        reward.new_zeros(0, G)  # (P', G)
    ref = torch.stack([q for (_, q), keep in zip(sums, in_loss) if keep]).to(reward) if in_loss.any() else \
        reward.new_zeros(0, G)
    shaped = reward[in_loss]  # (P', G)
    if cfg.mara_threshold is not None:
        high = shaped >= cfg.mara_threshold
        anchors = [r[torch.where(h, q, -math.inf).argmax()] for r, q, h in zip(shaped, ref, high) if h.any()]
        anchors = torch.stack(anchors)[:, None] if anchors else shaped.new_zeros(0, 1)  # (groups that reached tau, 1)
        readings["mara/augmented_share"] = gather_rows(high.float()).mean().item()
        anchors = gather_rows(anchors)  # (every process's anchors, 1)
        if anchors.numel():
            readings["mara/anchor_reward"] = anchors.mean().item()
        shaped = torch.stack([mara_rewards(r, q, cfg.kl_beta, cfg.mara_threshold) for r, q in zip(shaped, ref)]) \
            if len(shaped) else shaped
    readings["kl_in_reward/penalty"] = gather_rows(cfg.kl_beta * (policy - ref)).mean().item()
    A = kl_in_reward(shaped, policy, ref, cfg.kl_beta)  # (P', G): the shaped reward minus its group's mean
    if cfg.scale_rewards != "none":  # z-scored; at G every shaped reward is beta log Z, and A is 0 either way
        z = lesson.group_advantages(A)
        A = rescaled(z, A, "batch") if cfg.scale_rewards == "batch" else z
    out = torch.zeros_like(reward)
    out[in_loss] = A
    return out


def kl_in_reward(reward: torch.Tensor, policy_logprobs: torch.Tensor, ref_logprobs: torch.Tensor,
                 beta: float) -> torch.Tensor:
    """The advantages of the KL in the reward, (P, G) each -> (P, G): the shaped reward R - beta log(pi_old / ref) (the
    log-probs summed over a sample's tokens: the sequence's), minus its group's mean, no std. Its expected gradient
    with the ratio's is that of E[R] - beta KL(pi || ref) (the score-function estimator of the KL-regularised
    objective, whose maximiser is known in closed form: e.g. Korbak et al. 2022, Rafailov et al. 2023's DPO), so the
    update's fixed point is G = ref exp(R / beta) / Z (tools/bandit.py measures it: within 0.001 in total variation,
    where the defaults land 0.11 away). kl_regularised then divides by the group's std (--scale-rewards group, the
    default): the same fixed point, since at G every shaped reward is beta log Z and the advantages are 0."""
    shaped = reward - beta * (policy_logprobs - ref_logprobs)
    return shaped - shaped.mean(dim=-1, keepdim=True)


def mara_rewards(reward: torch.Tensor, ref_logprobs: torch.Tensor, beta: float, tau: float) -> torch.Tensor:
    """MARA's augmented rewards of one group (GX-Chen, Prakash, Guo, Fergus and Ranganath 2025, "KL-Regularized
    Reinforcement Learning is Designed to Mode Collapse", arXiv 2510.20817, Mode Anchored Reward Augmentation): (G,)
    rewards and the samples' reference log-probs (summed over their tokens) -> (G,): each sample at or above `tau` gets
    R(z) + beta (log ref(z) - log ref(y)), z the one of them the reference likes most (the anchor), so that the
    optimum ref exp(R / beta) / Z gives every one of them the anchor's mass; the others keep theirs. A group with none
    at or above tau is as it was. The anchor is the group's own: the high samples' offset R(z) + beta log ref(z)
    moves with what a group drew, so the target is even over them as far as groups share an anchor (tools/bandit.py's
    rows at G = 16 and G = 4 measure it). The paper's equations could not be read here (no network): this is the rule
    its text states (raise the high samples' rewards so the target is even over them, anchored on the likeliest), and
    tests/test_bandit.py checks the property, not a transcription (docs/claims.md)."""
    high = reward >= tau
    if not high.any():
        return reward
    anchor = torch.where(high, ref_logprobs, -math.inf).argmax()
    return torch.where(high, reward[anchor] + beta * (ref_logprobs[anchor] - ref_logprobs), reward)


def normalize_then_sum(each: dict, weights: dict) -> torch.Tensor:
    """TRL's multi_objective_aggregation="normalize_then_sum" (GDPO's advantages), as trl/trainer/grpo_trainer.py
    computes them: each reward's (P, G) values z-scored within its group, (r - mean) / (std + 1e-4); their weighted
    sum S; then S normalised over the step's whole batch, every group of every process: (S - mean) / (std + 1e-4).
    Both stds divide by n - 1, as TRL's. A reward of weight 0 is left out (TRL would sum 0 * its z-score)."""
    S = torch.zeros_like(next(iter(each.values())))  # (P, G); P may be 0: a process with no group left
    for name, weight in weights.items():
        if weight != 0 and len(S):
            values = each[name]
            std = values.std(dim=-1, keepdim=True) if values.shape[-1] > 1 else torch.zeros_like(values[..., :1])
            S = S + weight * (values - values.mean(dim=-1, keepdim=True)) / (std + 1e-4)
    batch = gather_rows(S).flatten()  # every process's groups
    if batch.numel() < 2:  # as TRL: no std of one value, zero advantages
        return torch.zeros_like(S)
    return (S - batch.mean()) / (batch.std() + 1e-4)


def large_grids(rollouts: list) -> list[torch.Tensor]:
    """Each rollout's (G, h*w) large grids: the tokens the DiT sees."""
    return [rollout.tokens[:, -math.prod(rollout.prompt.large_hw):] for rollout in rollouts]


def repeats(grids: list[torch.Tensor]) -> torch.Tensor:
    """Each group's (G, n) large grids -> (P, G) c: how many of its group drew the same grid."""
    return torch.stack([(grid[:, None] == grid[None]).all(-1).sum(-1) for grid in grids])


def nearest_distance(grids: list[torch.Tensor]) -> torch.Tensor:
    """Each group's (G, n) large grids -> (P, G) d: each sample's distance to its nearest group-mate, the share of
    its grid's codes that differ from that sample's (0: a group-mate drew the same grid). GARDO measures 1 - cosine of
    DINOv3 features of the pictures (--gardo-diversity dino: DINOv2's); the codes are this model's own description of
    a picture, on both models."""
    return torch.stack([nearest(code_distance(grid)) for grid in grids])


def code_distance(grid: torch.Tensor) -> torch.Tensor:
    """(G, n) large grids -> (G, G) the share of codes in which each two differ."""
    return (grid[:, None] != grid[None]).float().mean(-1)


def nearest(D: torch.Tensor) -> torch.Tensor:
    """(G, G) distances -> (G,) each sample's distance to its nearest other sample (GARDO's min over j != i)."""
    return D.clone().fill_diagonal_(math.inf).min(-1).values


@torch.no_grad()
def feature_similarity(images: torch.Tensor, checkpoint: str) -> torch.Tensor:
    """(G, 3, H, W) pictures in [0, 1] -> (G, G) cosine similarity of their DINOv2 features (helpers/rewards.py's
    dino_features, the dino reward's, from `checkpoint`). GARDO's code uses DINOv3's."""
    from helpers.rewards import dino_features
    features = dino_features(images, checkpoint)  # (G, D), unit length
    return (features @ features.T).clamp(-1, 1)  # as GARDO's clip: d = 1 - cosine >= 0


def dino_checkpoint(spec: str) -> str:
    """The DINOv2 checkpoint --gardo-diversity dino reads: the one --reward `spec` gives the dino reward
    (dino@where), else the dino reward's default."""
    from helpers.rewards import LEARNED
    given = [where for name, where, _ in map(split_reward, spec.split(",")) if name == "dino" and where]
    return given[0] if given else LEARNED["dino"][0]


def cluster_sizes(grids: list[torch.Tensor], radius: float) -> torch.Tensor:
    """Each group's (G, n) large grids -> (P, G) c: the samples of each one's cluster, two samples linked when their
    grids differ in at most `radius` of their codes, a cluster everything linked through a chain of links (single
    linkage, this repository's choice, for DiverseGRPO's clusters of similar samples; radius 0 gives `repeats`)."""
    out = []
    for grid in grids:
        linked = code_distance(grid) <= radius + 1e-6  # (G, G), the diagonal included; 1e-6: k / n rounding
        reach = linked
        for _ in range(len(grid)):  # a chain has at most G - 1 links
            reach = (reach.float() @ linked.float()) > 0
        out.append(reach.sum(-1))
    return torch.stack(out)


def gardo_factor(d: torch.Tensor, advantages: torch.Tensor) -> torch.Tensor:
    """GARDO's diversity factor, as its code (flow_grpo/stat_tracking.py, PerPromptStatTracker.update, type 'gardo')
    computes it: (P, G) nearest distances d and advantages -> d / mean(d) over the group where A >= 0, 1 where A < 0
    (a sample below its group's mean keeps its advantage). A group whose samples all repeat (mean d below 1e-6, a
    feature distance's rounding) keeps 1.
    GARDO multiplies R - mean, not divided by the std; here the factor multiplies the lesson's advantages, which
    --scale-rewards none makes R - mean."""
    mean = d.mean(-1, keepdim=True)
    relative = torch.where(mean > 1e-6, d / mean.clamp(min=1e-6), torch.ones_like(d))
    return torch.where(advantages < 0, torch.ones_like(d), relative)


def rescaled(advantages: torch.Tensor, rewards: torch.Tensor, scale: str) -> torch.Tensor:
    """z-scores (R - mean) / std_group -> (R - mean) / std of every group of the step, on every
    process ("batch"), or R - mean ("none": Dr. GRPO, in reward units). A group without spread
    stays 0. A process with no group (rewards (0, G)) still joins the step's gather."""
    everything = gather_rows(rewards) if scale == "batch" else rewards  # the step's, over all processes
    if not rewards.numel():  # no group left here (after the gather, which every process joins)
        return advantages
    group_std = rewards.std(dim=-1, unbiased=False, keepdim=True)
    if scale == "none":
        return advantages * group_std
    step_std = everything.std(unbiased=False)
    return advantages * group_std / step_std.clamp_min(torch.finfo(step_std.dtype).tiny)


def grid_logprob(rollout) -> torch.Tensor:
    """(G,) the log-probability of each sample's large grid, as the sampler drew it (under q)."""
    return rollout.q_logprobs[:, -math.prod(rollout.prompt.large_hw):].sum(dim=-1)


def credit_to_unlikely(reward: torch.Tensor, loglik: torch.Tensor, unlikeliness: float
                       ) -> torch.Tensor:
    """After He et al.'s unlikeliness reward (arXiv 2506.02355), but added after the z-score: (P, G)
    rewards and each sample's log-likelihood -> (P, G) shifts among each group's best samples (those
    tied at its top reward): ranked from the least likely to the likeliest (ties in the order
    drawn), they get +U/2 down to -U/2, linear in rank; the shifts sum to 0. A group with one best
    sample is left as it is. He et al.'s code instead scales each reward, r (1 - 0.25 rank / G),
    rank by mean token log-prob over all G samples, before the z-score; there an all-right group's
    tiny reward gaps would become whole advantages (docs/claims.md)."""
    best = reward == reward.amax(dim=-1, keepdim=True)
    rank = torch.where(best, loglik, math.inf).argsort(dim=-1, stable=True).argsort(dim=-1)
    k = best.sum(dim=-1, keepdim=True)  # each group's best samples: ranks 0 .. k - 1
    share = rank / (k - 1).clamp_min(1) - 0.5  # -0.5 for the least likely .. +0.5 the likeliest
    return -unlikeliness * share * best * (k > 1)


# ---- Step 5: the micro-batches and their loss ---------------------------------------------------

def update(batches: list, loss_fn, policy, cfg, lesson, reward: torch.Tensor | None = None, each: dict | None = None,
           state=None) -> tuple[list, object]:
    """The seam of step 5: grpo.micro_batches' MicroBatches and `loss_fn` (grpo.micro_batch_loss, or any
    function of its signature) -> those train_step uses: the micro-batches on the sampler's truncation
    (--policy-dist truncated) and the loss with the options on (`variant_loss`, around `loss_fn`). None on: both as
    given. `lesson`: grpo.py (the entropy bonus's threshold reads the policy through it). --kl-on uncertain ranks
    the step's samples by `reward` and `each` ((P, G), step 3's) with `state`'s GARDO controller (a `State`)."""
    if cfg.policy_dist == "truncated":
        truncating = 0 < cfg.top_k or cfg.top_p < 1
        K = policy.config.vq_config.num_embeddings
        batches = [on_truncation(mb, K, truncating) for mb in batches]
    loss_options = (cfg.train_tokens != "large", cfg.clip_eps_high is not None,
                    cfg.kl_on != "all", cfg.truncation_weight == "mass", cfg.entropy_bonus > 0,
                    cfg.sampler_correction != "token_truncate", cfg.kl_in_reward)
    if not any(loss_options):
        return batches, loss_fn
    threshold = None
    if cfg.entropy_bonus > 0:  # the step's, before any update, kept for all mu updates
        threshold = mean_entropy(policy, batches, cfg.temperature, cfg.train_tokens, lesson)
    kl_weights = None
    if cfg.kl_on == "uncertain":  # (P, G) each sample's weight on the KL, by rollout
        rollouts = list({id(mb.rollout): mb.rollout for mb in batches}.values())  # the groups, in order
        in_loss = torch.tensor([next(mb.in_loss for mb in batches if mb.rollout is r) for r in rollouts])
        A = torch.stack([torch.cat([mb.advantages for mb in batches if mb.rollout is r]) for r in rollouts])
        weights = uncertain_kl_weights(reward, each, in_loss, A.to(reward), auxiliary(cfg.reward), state.risk)
        kl_weights = {id(r): w for r, w in zip(rollouts, weights)}
    return batches, functools.partial(variant_loss, lesson_loss=loss_fn, cfg=cfg, threshold=threshold,
                                      kl_weights=kl_weights)


def auxiliary(spec: str) -> list[str]:
    """The rewards of --reward `spec` weighed 0: logged, out of the trained sum; --kl-on uncertain ranks by them."""
    return [name for name, weight in reward_weights(spec).items() if weight == 0]


class RiskCompensator:
    """GARDO's share b of the samples the KL binds (scripts/train_sd3_grpo_gardo.py, class RiskCompensator, at its
    defaults): b starts at 0.1; each step, with m the mean of the step's uncertainties >= 0, b grows 10% when m is
    above every m of the last 20 steps and shrinks 10% when below every one, within [0.02, 0.2]."""

    def __init__(self, base: float = 0.1):
        self.base, self.share, self.window = base, base, []

    def update(self, uncertain: torch.Tensor) -> float:
        """The step's uncertainties >= 0 -> b for this step (GARDO updates before it gates)."""
        m = uncertain.double().mean().item()
        if not self.window:
            self.share = self.base
        elif m > max(self.window):
            self.share = self.share * 1.1
        elif m < min(self.window):
            self.share = self.share * 0.9
        self.share = min(max(self.share, 0.02), 0.2)
        self.window = (self.window + [m])[-20:]
        return self.share

    def state_dict(self) -> dict:
        return {"share": self.share, "window": list(self.window)}

    def load_state_dict(self, state: dict) -> None:
        self.share, self.window = state["share"], list(state["window"])


def ranks(values: torch.Tensor) -> torch.Tensor:
    """(S,) -> (S,) float64 each value's rank, 1 the highest, as GARDO's descending sort ranks distinct values; tied
    values share their mean rank (GARDO's sort orders ties as its kernel does, so a tie's ranks would follow the
    samples' places in the batch); a value that is not finite ranks last."""
    v = torch.nan_to_num(values.double(), nan=-math.inf)  # NaN last, as -inf
    above = (v[None, :] > v[:, None]).sum(-1)  # (S,) values above each
    tied = (v[None, :] == v[:, None]).sum(-1)  # itself included
    return 1 + above + (tied - 1) / 2


def uncertainty(trained: torch.Tensor, aux: list[torch.Tensor]) -> torch.Tensor:
    """GARDO's uncertainty of each sample of a batch: (S,) the trained reward, (S,) each auxiliary reward -> (S,)
    its rank under the trained reward minus the mean of its ranks under the auxiliary ones (1: the best). It sums to
    0; u > 0 where the trained reward ranks the sample below where the others do."""
    return ranks(trained) - torch.stack([ranks(r) for r in aux]).mean(0)


def uncertain_kl_weights(reward: torch.Tensor, each: dict, in_loss: torch.Tensor, advantages: torch.Tensor,
                         aux: list[str], risk: RiskCompensator) -> torch.Tensor:
    """--kl-on uncertain: (P, G) rewards (the trained sum, and each by name), (P,) groups in the loss, (P, G)
    advantages -> (P, G) each sample's weight on the KL. As GARDO's code gates, over the step's whole batch (every
    group of every process in the loss): the samples with u > the (100 - 100 b) percentile of the u >= 0
    (`uncertainty`; b from `risk`), less those with A = 0, which GARDO's code leaves out of its update. Each of those
    weighs S / n (S the batch's samples, n those gated), the others 0, so the KL term is beta times the mean KL of
    the step's gated samples (no sample gated: no KL). GARDO's code averages over the gated samples within each
    micro-batch (scripts/train_sd3_grpo_gardo.py L984); the two agree when every micro-batch gates as many.
    It moves `risk` (its window of the steps' mean uncertainty): call it once a step."""
    from .parallel import distributed
    mine = reward[in_loss].flatten().cpu()
    counts = gather_rows(torch.tensor([len(mine)]))  # each process's samples, in rank order
    offset = int(counts[:torch.distributed.get_rank()].sum()) if distributed() else 0
    u = uncertainty(gather_rows(mine), [gather_rows(each[name][in_loss].flatten().cpu()) for name in aux])
    trained = gather_rows(advantages[in_loss].flatten().cpu()) != 0
    out = torch.zeros_like(reward)
    if not len(u):  # no group in the loss anywhere: train_step skips the step
        return out
    positive = u[u >= 0]  # never empty: u sums to 0
    share = risk.update(positive)
    gated = (u > torch.quantile(positive, (100 - 100 * share) / 100)) & trained  # numpy's percentile: linear
    weight = gated.double() * len(u) / max(int(gated.sum()), 1)
    out[in_loss] = weight[offset:offset + len(mine)].to(reward).reshape(-1, reward.shape[-1])
    return out


def on_truncation(mb, codebook_size: int, truncating: bool = True):
    """A MicroBatch trained on the sampler's truncation q (--policy-dist truncated): its kept codes
    at each token (the bits the fast decode recorded) and its log-probs under q. Without top-k /
    top-p (`truncating` False) q is p, and the micro-batch stays as it is."""
    from helpers import fast_decode
    rollout = mb.rollout
    kept = getattr(rollout, "support", None)  # (the lesson's grpo.Rollout records none)
    if kept is None and truncating:
        raise ValueError("--policy-dist truncated trains on the codes each draw kept, which "
                         "helpers/fast_decode.py records (helpers/trainer.py's sample_groups); "
                         "these rollouts have none")
    if kept is None:
        return mb
    support = fast_decode.code_support(kept[mb.rows], codebook_size)  # (mb, N, K) bool
    return mb._replace(support=support, sampler_logprobs=rollout.q_logprobs[mb.rows])


def distribution(lesson, logits: torch.Tensor, temperature: float, codebook_size: int,
                 support: torch.Tensor | None = None) -> torch.Tensor:
    """The trained distribution: grpo.code_logprobs (the whole softmax p), or, given a (..., K) bool `support`
    (--policy-dist truncated: the codes each draw kept), the softmax cut to those codes and renormalised, -inf
    outside."""
    if support is None:
        return lesson.code_logprobs(logits, temperature, codebook_size)
    scores = logits[..., :codebook_size].float() / temperature
    return torch.log_softmax(scores.masked_fill(~support, -math.inf), dim=-1)


def sampler_correction(old_logprobs: torch.Tensor, sampler_logprobs: torch.Tensor,
                       mode: str = "token_truncate", cap: float = 2.0) -> torch.Tensor:
    """TRL's mismatch weights in each of its modes (vllm_importance_sampling_mode): (S, T) log-probs of the drawn
    tokens under ONE distribution, the trained one, as the trainer computes them (pi_old) and as the sampler did ->
    (S, T) weights pi_old / pi_sampler, per token or, in the sequence modes, one per sequence (the product of its
    tokens' ratios) on each of its tokens; above `cap` cut to it (truncate) or to 0 (mask); "none": 1.
    token_truncate is grpo.importance_weights. Not differentiable: a weight, not a term of the policy."""
    log_ratio = old_logprobs - sampler_logprobs  # (S, T)
    if mode.startswith("sequence"):
        log_ratio = log_ratio.sum(dim=1, keepdim=True).expand_as(old_logprobs)
    ratio = torch.exp(log_ratio.clamp(max=20.0)).detach()  # a sequence's sum can be large
    if mode.endswith("truncate"):
        return ratio.clamp(max=cap)
    if mode.endswith("mask"):
        return ratio.masked_fill(ratio > cap, 0.0)
    return torch.ones_like(ratio)


@torch.no_grad()
def mean_entropy(policy, batches: list, temperature: float, train_tokens: str, lesson) -> float:
    """--entropy-bonus' threshold: the mean entropy (nats) of the trained distribution over the
    step's loss tokens, on every process, before any update (one no-grad forward per
    micro-batch, those out of the loss too: under FSDP every process joins each forward): the
    same whatever the micro-batches. `lesson`: grpo.py (token_logits, code_logprobs)."""
    K = policy.config.vq_config.num_embeddings
    total, count = 0.0, 0
    for mb in batches:
        logits = lesson.token_logits(policy, mb.inputs, mb.tokens)
        if not mb.in_loss:
            continue
        H = entropy(distribution(lesson, logits, temperature, K, mb.support))
        H = H[:, loss_tokens(mb, train_tokens)]
        total, count = total + H.sum().item(), count + H.numel()
    both = gather_rows(torch.tensor([[total, count]], dtype=torch.float64)).sum(dim=0)
    return (both[0] / both[1]).item()


def entropy(distribution: torch.Tensor) -> torch.Tensor:
    """(..., K) log-probs (a log-softmax) -> (...) entropy in nats, >= 0: each term -p log p is, as a log-softmax
    never rounds a log-prob above 0; codes outside a truncation (-inf) add 0."""
    return -(distribution.exp() * distribution.nan_to_num(neginf=0.0)).sum(dim=-1)


def loss_tokens(mb, train_tokens: str) -> slice:
    """The tokens in the loss: the large grid (the lesson), or every token (--train-tokens all)."""
    if train_tokens == "all":
        return slice(None)
    return slice(mb.n_preview, None)


def variant_loss(trained: torch.Tensor, mb, old_logprobs: torch.Tensor,
                 ref_logprobs: torch.Tensor | None, *, lesson_loss, cfg, threshold: float | None,
                 kl_weights: dict | None = None) -> tuple[torch.Tensor, dict]:
    """grpo.micro_batch_loss (`lesson_loss`: with its settings bound, clip_eps, kl_beta, sampler_cap) with the
    options on, through grpo_loss' symbols (`trained`: the (mb, N, K) log-probs of pi_theta):
      --sampler-correction: TRL's other mismatch weights (sampler_correction) in place of the lesson's;
      --train-tokens all: the preview's tokens in the loss too;
      --clip-eps-high H: eps per sample, H where A > 0 (the upper clip acts only there), else eps;
      --kl-on above_mean: beta per sample, 0 where A < 0 (the mistakes go free of the KL);
      --kl-on uncertain: beta per sample times its weight in `kl_weights` (by id of its rollout: (G,) each);
      --kl-in-reward: beta 0 (the KL is in the reward: kl_regularised);
      --truncation-weight mass: each loss token's whole term times Z_t, the mass p puts on the
        sampler's nucleus (A_it = A_i Z_t and beta_t = beta Z_t, Z_t > 0);
    then --entropy-bonus B: - B mean(H_t [H_t > threshold]) over the loss tokens, H_t the trained
    distribution's entropy, `threshold` the step's mean (mean_entropy)."""
    cols = loss_tokens(mb, cfg.train_tokens)
    eps = clip_range(mb.advantages, cfg.clip_eps, cfg.clip_eps_high)
    A = mb.advantages[:, None]  # (mb, 1): a sample's advantage, on each of its tokens
    beta = torch.full_like(A, 0.0 if cfg.kl_in_reward else cfg.kl_beta)  # (mb, 1): --kl-in-reward moved it
    if cfg.kl_on == "above_mean":
        beta = beta * (A >= 0)
    if cfg.kl_on == "uncertain":
        beta = beta * kl_weights[id(mb.rollout)][mb.rows, None].to(beta)
    if cfg.truncation_weight == "mass" and cfg.policy_dist == "full":
        mass = nucleus_mass(mb.rollout.q_logprobs[mb.rows], mb.rollout.p_logprobs[mb.rows])
        A, beta = A * mass[:, cols], beta * mass[:, cols]  # (mb, n): per token
    # the lesson's loss starts after the preview: with --train-tokens all, from the first token
    first_loss_token = 0 if cfg.train_tokens == "all" else mb.n_preview
    as_lesson = mb._replace(advantages=A, n_preview=first_loss_token)
    weights = None  # the lesson's: token_truncate at --sampler-cap
    if cfg.sampler_correction != "token_truncate":
        weights = sampler_correction(old_logprobs, mb.sampler_logprobs, cfg.sampler_correction, cfg.sampler_cap)
    loss, metrics = lesson_loss(trained, as_lesson, old_logprobs, ref_logprobs, clip_eps=eps, kl_beta=beta,
                                sampler_cap=cfg.sampler_cap, weights=weights)
    if cfg.entropy_bonus > 0:
        H = entropy(trained)[:, cols]  # (mb, n)
        loss = loss - cfg.entropy_bonus * (H * (H.detach() > threshold)).mean()
        metrics["loss"] = loss.item()
    return loss, metrics


def clip_range(advantages: torch.Tensor, clip_eps: float, clip_eps_high: float | None):
    """grpo_loss' eps for DAPO's clip-higher: (S,) advantages -> (S, 1) eps per sample, `clip_eps_high`
    where A > 0 (only there does the upper clip act: min(r A, clip(r) A) = A min(r, 1 + eps) for
    A > 0) and `clip_eps` elsewhere (the lower clip acts only where A < 0). None: `clip_eps`."""
    if clip_eps_high is None:
        return clip_eps
    return torch.where(advantages[:, None] > 0, clip_eps_high, clip_eps)


def nucleus_mass(q_logprobs: torch.Tensor, p_logprobs: torch.Tensor) -> torch.Tensor:
    """(S, T) log-probs of the drawn tokens under the sampler's nucleus q and its whole softmax p ->
    Z_t = p / q, the mass p puts on the nucleus, in (0, 1] (1 without top-k / top-p)."""
    return torch.exp(p_logprobs - q_logprobs).clamp(max=1.0)


# ---- Carried from step to step: GARDO's controller and reference (saved in each checkpoint) ---------

class Reference:
    """--reference-reset-every N: the KL's reference, reset to the policy N steps after its last reset, or sooner
    under --reference-reset-kl (after_step: GARDO copies its trained LoRA into a second adapter, "old", when more than
    reset_freq epochs have passed since the last reset, every 16th at its reset_freq 15, or after an epoch one of whose
    updates' KL went above its kl_thres). Passed to train_step as its `ref_model`:
    grpo.reference_logprobs reads it as it reads the frozen reference. `frozen`: grpo.reference_model's. With LoRA
    (`frozen` is the policy) the reference is the adapter switched off until the first reset, then the adapter's
    weights of the last reset, swapped in for the reading (a copy of the adapter, not of the model); with every
    weight trained, `frozen` is the copy, and a reset copies the policy's weights into it (in its dtype)."""

    def __init__(self, policy, frozen):
        self.policy, self.frozen = policy, frozen
        self.lora = frozen is policy
        self.anchor = None if self.lora else list(frozen.parameters())  # the reference's own weights
        self.was_reset = False  # before a reset the reference is the initial weights, rebuilt from the model
        self.last = 0  # the step of the last reset (0: none yet)

    def __getattr__(self, name):  # the model's config, its forward ...: the frozen reference's
        if name == "frozen":  # before __init__ set it (a copy being made): no endless recursion
            raise AttributeError(name)
        return getattr(self.frozen, name)

    def __call__(self, *args, **kwargs):
        return self.frozen(*args, **kwargs)

    def trained(self) -> list:
        return [p for p in self.policy.parameters() if p.requires_grad]

    @torch.no_grad()
    def reset(self, step: int) -> None:
        """The reference becomes the policy as it is after `step`."""
        if self.lora:
            self.anchor = [p.detach().clone() for p in self.trained()]
        else:
            for mine, policy in zip(self.anchor, self.policy.parameters(), strict=True):
                mine.copy_(policy.detach())
        self.was_reset, self.last = True, step

    def disable_adapter(self):
        """What grpo.reference_logprobs enters to read the reference (hence the name, peft's): the adapter off (no
        reset yet), the last reset's adapter swapped in and out again, or (every weight trained) nothing."""
        if self.lora and self.anchor is None:
            return self.policy.disable_adapter()
        if self.lora:
            return swapped(self.trained(), self.anchor)
        return contextlib.nullcontext()

    def state_dict(self) -> dict:
        """The reference's weights, whole (gathered from every process under FSDP; kept on rank 0, which saves
        them), on the CPU, and the step of the last reset; {} before the first reset (the initial weights: the model,
        or the adapter off)."""
        if not self.was_reset:
            return {}
        return {"weights": [gathered(w) for w in self.anchor], "last": self.last}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        if not state:
            return
        like = self.trained() if self.lora else self.anchor
        weights = [sharded_like(saved, w) for saved, w in zip(state["weights"], like, strict=True)]
        if self.lora:
            self.anchor = weights
        else:
            for mine, saved in zip(self.anchor, weights):
                mine.copy_(saved)
        self.was_reset, self.last = True, state.get("last")  # None: saved before --reference-reset-kl (after_step)


@contextlib.contextmanager
def swapped(params: list, values: list):
    """`params` hold `values` inside the block, their own weights again after it (bit for bit)."""
    with torch.no_grad():
        own = [p.detach().clone() for p in params]
        for p, v in zip(params, values):
            p.copy_(v)
    torch.clear_autocast_cache()  # bf16 autocast's copies of the weights it cast would outlive the swap
    try:
        yield
    finally:
        with torch.no_grad():
            for p, v in zip(params, own):
                p.copy_(v)
        torch.clear_autocast_cache()


def gathered(t: torch.Tensor) -> torch.Tensor | None:
    """A weight, whole (a DTensor gathered from its shards: every process must call it), on the CPU of rank 0;
    None on the other processes, which save nothing."""
    from .parallel import distributed
    whole = (t.full_tensor() if hasattr(t, "full_tensor") else t).detach()
    return None if distributed() and torch.distributed.get_rank() else whole.cpu()


def sharded_like(saved: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A whole saved weight -> one like `like` (its device and dtype; sharded as it is, for a DTensor)."""
    if hasattr(like, "device_mesh"):
        from torch.distributed.tensor import distribute_tensor
        return distribute_tensor(saved.to(like.device, like.dtype), like.device_mesh, like.placements)
    return saved.to(like.device, like.dtype).clone()


@dataclasses.dataclass
class State:
    """The variants' state carried from step to step, saved in each checkpoint (trainer_state.pt's "variants") so
    that --resume continues as if never stopped: GARDO's controller (--kl-on uncertain) and the resettable reference
    (--reference-reset-every)."""
    risk: RiskCompensator | None = None
    reference: Reference | None = None
    readings: dict = dataclasses.field(default_factory=dict)  # the step's readings of a variant (not saved: the
    # step's line holds them)

    @classmethod
    def of(cls, cfg, ref_model) -> "State":
        return cls(risk=RiskCompensator() if getattr(cfg, "kl_on", "all") == "uncertain" else None,
                   reference=ref_model if isinstance(ref_model, Reference) else None)

    def state_dict(self) -> dict:
        state = {"risk": self.risk and self.risk.state_dict(), "reference": self.reference and self.reference.state_dict()}
        return {key: value for key, value in state.items() if value}

    def load_state_dict(self, state: dict) -> None:
        if self.risk and state.get("risk"):
            self.risk.load_state_dict(state["risk"])
        if self.reference and state.get("reference"):
            self.reference.load_state_dict(state["reference"])


def after_step(state: State, step: int, cfg, metrics: dict) -> None:
    """After step `step` (before its checkpoint), given its logged `metrics`: GARDO's reset of the reference, on its
    loop's schedule (L789 and L1042, docs/peer_readings.md 5): N = --reference-reset-every steps after the last reset
    (more than its reset_freq = N - 1 epochs), or after a step one of whose updates had a mean KL above
    T = --reference-reset-kl (its kl_thres; kl_peak, the largest of the step's --mu updates' kl), which starts the
    count of N again. What it compares differs: GARDO's KL is its denoising steps' Gaussian KL, averaged over the
    samples its gate lets the KL bind, and its configs take two optimizer steps an epoch, each on half the samples;
    here the logged kl, over every sample's loss tokens (the same under --kl-on all), each update on the whole batch."""
    reference = state.reference
    if reference is None:
        return
    if reference.last is None:  # a checkpoint saved before the KL trigger: its resets came on every N-th step
        reference.last = (step - 1) // cfg.reference_reset_every * cfg.reference_reset_every
    kl = metrics.get("kl_peak", metrics.get("kl", 0.0))  # a skipped step has none
    if step - reference.last >= cfg.reference_reset_every or 0 < cfg.reference_reset_kl < kl:
        reference.reset(step)
