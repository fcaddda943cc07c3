"""helpers/variants.py: the options that are off in both presets, beside grpo.py's lesson.

Each option reproduces, on the tiny model, the metrics it gave inside grpo.py before it moved
(tests/data/variants_before.json, recorded at 47e9037 by tools/record_variants.py under torch 2.13.0's CPU build), and
each has a test by hand that fails when its term is dropped or planted wrong.
"""

import copy
import dataclasses
import functools
import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import grpo
from helpers import diagnostics, fast_decode, parallel, trainer, user_input, variants
from tests.conftest import CORRECTIONS, PARITY, T, TINY, run_record, sample_group, sampled_rows, write_example
from tests.conftest import pipe, random_pipe  # noqa: F401  the tiny pipelines (fixtures)
from tests.test_rewards import dino_folder  # noqa: F401  a tiny random DINOv2 (a fixture)
from tools.record_variants import ROWS, record

BEFORE = json.loads((Path(__file__).parent / "data" / "variants_before.json").read_text())
# --truncation-weight mass now reaches grpo_loss as A_it = A_i Z_t and beta_t = beta Z_t instead of a factor on each
# token's whole term: the same loss, summed in another order (the gradient's norm moved by 2e-6), and its logged
# policy_loss now includes the mass, as the loss does. kl_untruncated is no longer logged.
CHANGED = {"truncation_weight": {"policy_loss"}}
# Another torch build rounds otherwise, and 3 steps at lr 1e-3 carry the rounding on: under torch 2.14.1's default
# (CUDA) build on a CPU the metrics moved from the recorded ones by up to 2.7e-4 relative (sequence_mask's grad_norm;
# every other row below 5e-5). 1e-3 is that with room, and 100 times below what a dropped or misplaced term moves.
TOLERANCE = 1e-3


def cfg_with(**options):
    """The tiny config with the variants' flags given (the command line's defaults otherwise)."""
    argv = [arg for name, value in options.items() for arg in ("--" + name.replace("_", "-"), str(value))]
    return trainer.parse_config(grpo, argv)


def seam(z_scores, reward, rollouts, cfg, each=None):
    """variants.advantages on every group kept, `each` one reward (the sum itself) unless given."""
    kept = torch.ones(len(reward), dtype=torch.bool)
    return variants.advantages(z_scores, rollouts, reward, each or {"ssim": reward}, kept, cfg, grpo)


def rollout(tokens, q_logprobs=None, preview=0):
    """A Rollout of given (G, N) tokens (the last N - preview form a 1 x n large grid)."""
    G, N = tokens.shape
    q = torch.zeros(G, N) if q_logprobs is None else q_logprobs
    return grpo.Rollout(grpo.Prompt({}, (1, preview), (1, N - preview)), tokens, q, q)


# ---- the same metrics as before the move --------------------------------------------------------

@pytest.mark.parametrize("name", list(ROWS))
def test_variant_as_before(name):
    """Each option's 3-step tiny run gives the metrics it gave inside grpo.py, within the builds' rounding (TOLERANCE,
    relative above 1). The steps were recorded counting from 0; they count from 1 now."""
    now, = record(Path(grpo.__file__).parent, {name: ROWS[name]}).values()
    before = [{**line, "step": line["step"] + 1} for line in BEFORE[name]]
    changed = CHANGED.get(name, set())
    assert len(now) == len(before)
    for step, (a, b) in enumerate(zip(before, now)):
        newer = {"dropped_groups", "lr", "kl_peak", *(k for k in b if k.startswith("monitor/"))}
        assert set(a) - {"kl_untruncated"} == set(b) - newer, (step, set(a) ^ set(b))
        for key in set(a) & set(b) - changed:
            if isinstance(a[key], float):
                assert abs(a[key] - b[key]) <= TOLERANCE * max(1.0, abs(a[key])), (step, key, a[key], b[key])
            else:
                assert a[key] == b[key], (step, key)


# ---- step 4: the advantages ---------------------------------------------------------------------

def test_given_and_validate():
    """The flags a config turns on, by name; a negative bonus or a non-positive upper clip is refused in one line (its
    range: user_input.RULES), and so are options that do not go together (variants.validate)."""
    assert variants.given(cfg_with()) == [] and variants.given(cfg_with(diversity=0.2, kl_on="above_mean")) == [
        "--diversity", "--kl-on"]
    for options, message in [(dict(diversity=-1), "--diversity -1.0 is out of range"),
                             (dict(clip_eps_high=0), "--clip-eps-high 0.0 is out of range")]:
        with pytest.raises(ValueError, match=message):
            user_input.check_numbers(cfg_with(**options))
    with pytest.raises(ValueError, match="--scale-rewards none does not apply with --reward-aggregation normalize"):
        variants.validate(cfg_with(reward_aggregation="normalize", scale_rewards="none"))


def test_advantages_none_on():
    """With no option on, the seam returns the advantages it was given, the very tensor."""
    adv = torch.randn(2, 4)
    assert seam(adv, torch.randn(2, 4), [], cfg_with()) is adv


def test_repeats():
    """For each sample, how many of its group drew the same large grid (itself included)."""
    grids = [torch.tensor([[1, 2], [1, 2], [3, 4], [1, 2]]), torch.tensor([[5, 5], [6, 5], [5, 6], [5, 7]])]
    assert variants.repeats(grids).tolist() == [[3, 3, 1, 3], [1, 1, 1, 1]]


def test_advantages_diversity():
    """--diversity by hand: bonus / c added to each reward before the z-score, c the group's samples of the same
    large grid: in a group where every sample is right, repeats of one layout fall below a layout drawn once."""
    grids = [torch.tensor([[1, 2], [1, 2], [1, 2], [3, 4]]), torch.tensor([[1, 0], [0, 1], [1, 0], [2, 2]])]
    reward = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 0.4]])
    rollouts = [rollout(g) for g in grids]
    plain = grpo.group_advantages(reward)
    assert plain[0].eq(0).all()  # all right: no signal without the bonus
    adv = seam(plain, reward, rollouts, cfg_with(diversity=0.3))
    assert torch.allclose(adv, grpo.group_advantages(reward + 0.3 / variants.repeats(grids).float()))
    assert (adv[0, :3] < 0).all() and adv[0, 3] > 0  # three repeats below the one drawn once
    assert adv[1, 1] > adv[1, 0] == adv[1, 2] > adv[1, 3]  # the unique right one first, the wrong one last


def gardo_advantages(rewards, distance):
    """GARDO's advantages of one prompt's group, transcribed from its code (tinnerhrhe/GARDO 1cc77fb,
    flow_grpo/stat_tracking.py, PerPromptStatTracker.update, type 'gardo'), with the (G, G) distance matrix given
    (GARDO's is 1 - cosine of DINOv3 features) and one timestep: the nearest distance d_i; d / mean(d) where
    R - mean >= 0, else 1; A = (R - mean) x that (no division by the std)."""
    import numpy as np
    prompt_rewards = np.asarray(rewards, dtype=np.float64)[:, None]
    mean = np.mean(prompt_rewards, axis=0, keepdims=True)
    distance_matrix = np.asarray(distance, dtype=np.float64)
    avg_distances = np.zeros(len(distance_matrix))
    for i in range(len(distance_matrix)):
        mask = np.ones(len(distance_matrix), dtype=bool)
        mask[i] = False
        avg_distances[i] = np.min(distance_matrix[i, mask])
    prompt_dists = np.repeat(avg_distances[:, np.newaxis], prompt_rewards.shape[-1], axis=1)
    prompt_dists = np.where((prompt_rewards - mean) < 0, np.ones_like(prompt_dists),
                            prompt_dists / np.mean(prompt_dists))
    return torch.tensor((prompt_rewards - mean) * prompt_dists)[:, 0]


def test_gardo_diversity():
    """--gardo-diversity tokens: GARDO's diversity factor, d_i the share of codes in which sample i's large grid differs
    from its nearest group-mate's; with --scale-rewards none (A = R - mean, as GARDO's) the advantages equal GARDO's
    code on that distance. Samples below the mean keep A; a repeated grid (d = 0) loses its positive credit; a group
    whose grids all repeat keeps its advantages (GARDO's code would divide by 0); on z-scores the factor multiplies
    them alike."""
    grids = [torch.tensor([[0, 0, 0, 0], [0, 0, 0, 1], [1, 1, 1, 1], [0, 1, 1, 1]]),
             torch.tensor([[2, 2, 2, 2], [2, 2, 2, 2], [0, 2, 2, 0], [2, 3, 3, 3]]),
             torch.tensor([[5, 5, 5, 5]] * 4)]
    reward = torch.tensor([[1.0, 0.8, 0.3, 0.9], [0.9, 0.9, 0.2, 0.6], [1.0, 0.5, 0.7, 0.2]])
    assert torch.equal(variants.nearest_distance(grids[:2]), torch.tensor([[0.25, 0.25, 0.25, 0.25],
                                                                           [0.0, 0.0, 0.5, 0.75]]))
    rollouts = [rollout(g) for g in grids]
    adv = seam(grpo.group_advantages(reward), reward, rollouts, cfg_with(scale_rewards="none", gardo_diversity="tokens"))
    for g in range(2):
        distance = (grids[g][:, None] != grids[g][None]).float().mean(-1)
        assert torch.allclose(adv[g].double(), gardo_advantages(reward[g], distance), atol=1e-6), g
    assert adv[1, 0] == adv[1, 1] == 0  # the two repeats of the best grid: no credit left
    assert torch.allclose(adv[2], reward[2] - reward[2].mean())  # every grid the same: the factor is 1
    z = grpo.group_advantages(reward)
    on_z = seam(z, reward, rollouts, cfg_with(gardo_diversity="tokens"))
    factor = variants.gardo_factor(variants.nearest_distance(grids), z)
    assert torch.allclose(on_z, z * factor) and torch.equal(factor[z < 0], torch.ones_like(factor[z < 0]))


def nanstd(x, dim=None, keepdim=False):
    """TRL's nanstd (trl/trainer/utils.py): Bessel-corrected, NaNs left out."""
    mean = torch.nanmean(x, dim=dim, keepdim=True)
    count = torch.sum(~torch.isnan(x), dim=dim, keepdim=keepdim)
    variance = torch.nanmean((x - mean) ** 2, dim=dim, keepdim=keepdim) * count / (count - 1)
    return torch.sqrt(variance)


def trl_normalize_then_sum(rewards_per_func: torch.Tensor, reward_weights: torch.Tensor, num_generations: int):
    """TRL's advantages under multi_objective_aggregation="normalize_then_sum", transcribed from
    trl/trainer/grpo_trainer.py (huggingface/trl f2cd577, lines 2710-2719; nanstd from trl/trainer/utils.py: the std
    over n - 1): rewards_per_func (B, K), one column per reward function, B = groups x G in group order."""
    grouped = rewards_per_func.view(-1, num_generations, rewards_per_func.shape[1])
    mean_k = torch.nanmean(grouped, dim=1, keepdim=True)
    std_k = nanstd(grouped, dim=1, keepdim=True) if num_generations > 1 else torch.zeros_like(mean_k)
    reward_k = (grouped - mean_k) / (std_k + 1e-4)
    reward_k = reward_k.view(-1, len(reward_weights))
    rewards = (reward_k * reward_weights.unsqueeze(0)).nansum(dim=1)
    std_rewards = nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
    return (rewards - torch.nanmean(rewards)) / (std_rewards + 1e-4)


def trl_sum_then_normalize(rewards_per_func: torch.Tensor, reward_weights: torch.Tensor, num_generations: int):
    """TRL's default, multi_objective_aggregation="sum_then_normalize" with scale_rewards="group", transcribed from the
    same file (f2cd577, lines 2681-2708; docs/peer_readings.md 1a)."""
    rewards = (rewards_per_func * reward_weights.unsqueeze(0)).nansum(dim=1)
    mean_grouped_rewards = torch.nanmean(rewards.view(-1, num_generations), dim=1)
    std_rewards = nanstd(rewards.view(-1, num_generations), dim=1)
    mean_grouped_rewards = mean_grouped_rewards.repeat_interleave(num_generations, dim=0)
    std_rewards = std_rewards.repeat_interleave(num_generations, dim=0)
    return (rewards - mean_grouped_rewards) / (std_rewards + 1e-4)


def test_reward_aggregation():
    """--reward-aggregation normalize is TRL's normalize_then_sum (GDPO): each reward z-scored within its group, the
    weighted sum normalised over the whole batch. On two groups of two rewards, one where both agree and one where
    only one spreads, TRL keeps their difference (|A| 1.095 and 0.548), as we do; the plain sum z-scored per group
    gives both the same (1.0 here; 0.707 with TRL's std over n - 1). A reward's scale no longer weighs; a reward without spread adds nothing; a group left out (a
    NaN) stays 0 and out of the batch's statistics; a weight-0 reward, even NaN, changes nothing."""
    a = torch.tensor([[0.0, 1.0], [0.0, 1.0]])
    b = torch.tensor([[0.0, 1.0], [0.5, 0.5]])
    trl = trl_normalize_then_sum(torch.stack([a.flatten(), b.flatten()], dim=1), torch.tensor([1.0, 1.0]), 2)
    ours = variants.normalize_then_sum({"a": a, "b": b}, {"a": 1.0, "b": 1.0})
    assert torch.allclose(ours.flatten(), trl, atol=1e-6)
    z = 0.5 / (math.sqrt(0.5) + 1e-4)  # each spread reward's z-score: +-z (std over n - 1, + 1e-4)
    std = z * math.sqrt((4 + 4 + 1 + 1) / 3)  # of S = (-2z, 2z, -z, z), over n - 1
    assert ours.abs()[:, 1].tolist() == pytest.approx([2 * z / (std + 1e-4), z / (std + 1e-4)], abs=1e-6)
    assert ours.abs()[:, 1].tolist() == pytest.approx([1.0954, 0.5477], abs=1e-4)
    plain = grpo.group_advantages(a + b)  # the lesson's sum, z-scored per group: both groups alike
    assert torch.allclose(plain.abs(), torch.ones(2, 2))
    trl_default = trl_sum_then_normalize(torch.stack([a.flatten(), b.flatten()], dim=1), torch.tensor([1.0, 1.0]), 2)
    # docs/rewards.md: 0.707 in TRL's default (at G = 2 any std over n - 1 gives |A| 1 / sqrt(2), but for the 1e-4)
    want = [1 / (math.sqrt(2) + 1e-4)] * 2 + [0.5 / (math.sqrt(0.5) + 1e-4)] * 2
    assert trl_default.abs().tolist() == pytest.approx(want, abs=1e-7)
    one = torch.tensor([[0.7]])  # one value in the whole batch: as TRL, no std of it, a zero advantage (not NaN)
    trl_one = trl_normalize_then_sum(one.flatten()[:, None], torch.tensor([1.0]), 1).view(1, 1)
    assert variants.normalize_then_sum({"a": one}, {"a": 1.0}).tolist() == trl_one.tolist() == [[0.0]]

    g = torch.Generator().manual_seed(0)
    ocr, aesthetic = torch.rand(3, 4, generator=g), 1 + 9 * torch.rand(3, 4, generator=g)
    in_loss = torch.tensor([True, False, True])
    ocr[1, 2] = math.nan

    def normalized(weights: str, each: dict) -> torch.Tensor:
        cfg = cfg_with(reward=weights, reward_aggregation="normalize")
        total = sum(w * each[n] for n, w in user_input.reward_weights(weights).items() if w != 0)
        return variants.advantages(grpo.group_advantages(total), [], total, each, in_loss, cfg, grpo)

    want = trl_normalize_then_sum(torch.stack([ocr[in_loss].flatten(), aesthetic[in_loss].flatten()], dim=1),
                                  torch.tensor([1.0, 0.2]), 4).view(2, 4)
    got = normalized("ocr=1,aesthetic=0.2", {"ocr": ocr, "aesthetic": aesthetic})
    assert torch.allclose(got[in_loss], want, atol=1e-6) and got[1].eq(0).all()
    tenfold = normalized("ocr=1,aesthetic=0.2", {"ocr": ocr, "aesthetic": 10 * aesthetic})
    assert torch.allclose(tenfold, got, atol=1e-3)  # the same but for TRL's + 1e-4 beside each std
    summed = grpo.group_advantages(ocr[in_loss] + 0.2 * aesthetic[in_loss])  # the plain sum: the aesthetic score wins
    assert not torch.allclose(summed, want, atol=1e-2)
    flat = normalized("ocr=1,aesthetic=0.2", {"ocr": ocr, "aesthetic": torch.full_like(ocr, 5.0)})
    alone = trl_normalize_then_sum(ocr[in_loss].flatten()[:, None], torch.tensor([1.0]), 4).view(2, 4)
    assert torch.allclose(flat[in_loss], alone, atol=1e-6)
    flaky = torch.full_like(ocr, math.nan)  # a weight-0 reward: logged, never in the advantages
    logged = normalized("ocr=1,aesthetic=0.2,flaky=0", {"ocr": ocr, "aesthetic": aesthetic, "flaky": flaky})
    assert torch.equal(logged, got)


def test_main_reward_aggregation(tmp_path, monkeypatch):
    """With --reward-aggregation normalize a run trains the same whatever a reward's scale, as long as its std within
    a group is well above TRL's 1e-4: -MSE times 100 or 1000 gives the same advantages and losses; with the plain sum
    -MSE times 1 or 10 does not. (The weights still weigh, after the normalisation, as in TRL's normalize_then_sum.)"""
    for scale in (10, 100, 1000):
        monkeypatch.setitem(grpo.REWARDS, f"mse{scale}", lambda images, example, k=scale: k * grpo.mse_reward(images,
                                                                                                             example))
        grpo.REWARDS[f"mse{scale}"].needs = ("target",)
    prompts = write_example(tmp_path, ["a red circle | t.png", "two blue squares | t.png"])
    runs = {}
    for aggregation, mse in [("normalize", "mse100"), ("normalize", "mse1000"), ("sum", "mse"), ("sum", "mse10")]:
        out = tmp_path / f"{aggregation}_{mse}"
        grpo.main([*TINY, "--prompts", str(prompts), "--out", str(out), "--steps", "2", "--reward", f"ssim=1,{mse}=0.5",
                   "--reward-aggregation", aggregation, "--temperature", "2.0", "--image-every", "0", "--lr", "1e-3"])
        rows = [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines()]
        runs[aggregation, mse] = run_record(out), torch.tensor([row["advantage"] for row in rows])
    keys = ("advantage/max", "advantage/min", "advantage/abs_mean", "loss")
    for a, b in zip(runs["normalize", "mse100"][0], runs["normalize", "mse1000"][0]):
        assert all(a[key] == pytest.approx(b[key], abs=1e-3) for key in keys), [(k, a[k], b[k]) for k in keys]
    assert torch.allclose(runs["normalize", "mse100"][1], runs["normalize", "mse1000"][1], atol=1e-3)
    assert runs["sum", "mse"][1].abs().mean() > 0.5  # the plain sum: the larger -MSE moves the advantages
    assert not torch.allclose(runs["sum", "mse"][1], runs["sum", "mse10"][1], atol=1e-2)


def test_rescaled():
    """--scale-rewards by hand: batch (the std of every reward of the step), none (Dr. GRPO: centred only); a group
    without spread stays zero."""
    r = torch.tensor([[1.0, 3.0], [0.0, 4.0], [5.0, 5.0]])
    z = grpo.group_advantages(r)
    assert torch.allclose(variants.rescaled(z, r, "none"), torch.tensor([[-1.0, 1.0], [-2.0, 2.0], [0, 0]]))
    batch_std = math.sqrt(((1 - 3) ** 2 + 0 + (0 - 3) ** 2 + 1 + 4 + 4) / 6)  # the population std of all 6, mean 3
    want = torch.tensor([[-1.0, 1.0], [-2.0, 2.0], [0, 0]]) / batch_std
    assert torch.allclose(variants.rescaled(z, r, "batch"), want)
    assert torch.allclose(seam(z, r, [], cfg_with(scale_rewards="batch")), want)


def test_credit_to_unlikely():
    """--unlikeliness: each group's best samples share their credit out toward the least likely of them (+U/2 for the
    least likely, -U/2 for the likeliest, linear in rank, ties in the order drawn); the others and the sum unchanged."""
    loglik = torch.tensor([[-1.0, -3.0, -9.0, -2.0], [-4.0, -3.0, -2.0, -1.0], [-1.0, -2.0, -3.0, -4.0]])
    reward = torch.tensor([[1.0, 1.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0], [0.9, 0.5, 0.2, 0.85]])
    shift = variants.credit_to_unlikely(reward, loglik, 0.5)
    rank = torch.tensor([[1.0, 0.0, 0.0, 0.5], [0.0, 1 / 3, 2 / 3, 1.0]]) - 0.5  # 0 the least likely, over k - 1
    rank[0, 2] = 0.0  # the wrong sample keeps its advantage
    assert torch.allclose(shift[:2], -0.5 * rank) and torch.equal(shift[2], torch.zeros(4))  # one best: nothing
    assert torch.allclose(shift.sum(-1), torch.zeros(3), atol=1e-6)  # moved, not added
    # through the seam: each sample's likelihood is its large grid's, as drawn (a preview that reverses the order)
    rollouts = [rollout(torch.zeros(4, 2, dtype=torch.long), torch.stack([-2 * lik, lik], 1), preview=1)
                for lik in loglik]
    plain = grpo.group_advantages(reward)
    assert torch.allclose(seam(plain, reward, rollouts, cfg_with(unlikeliness=0.5)), plain + shift)


def test_main_unlikeliness(tmp_path, monkeypatch):
    """--unlikeliness in a run: the least likely of a group whose samples all tie gains U/2, the likeliest loses U/2,
    by the log-probs the sampler drew the large grid with (the trainer's agree)."""
    monkeypatch.setitem(grpo.REWARDS, "flat", lambda images, example: torch.zeros(len(images)))  # all tie: all best
    calls, seam = [], variants.advantages
    monkeypatch.setattr(variants, "advantages", lambda *args: calls.append((args, seam(*args))) or calls[-1][1])
    prompts = write_example(tmp_path, ["a red circle"])
    grpo.main([*TINY, "--prompts", str(prompts), "--out", str(tmp_path / "run"), "--steps", "1", "--reward", "flat",
               "--unlikeliness", "0.5", "--image-every", "0"])
    ((_, rollouts, *_), adv), = calls
    loglik = variants.grid_logprob(rollouts[0])  # (G,)
    order = sorted(range(len(loglik)), key=lambda i: (loglik[i].item(), i))  # the least likely first
    assert torch.allclose(adv[0][order], -0.5 * (torch.arange(4) / 3 - 0.5)) and adv[0].sum().abs() < 1e-6
    record, = run_record(tmp_path / "run")
    assert abs(loglik.sum().item() / rollouts[0].tokens[:, -4:].numel() - record["large/logprob"]) < 1e-5


# ---- step 5: the loss ---------------------------------------------------------------------------

def lesson_loss(cfg):
    """grpo.micro_batch_loss with the settings of `cfg` bound, as main builds it."""
    return functools.partial(grpo.micro_batch_loss, clip_eps=cfg.clip_eps, kl_beta=cfg.kl_beta,
                             sampler_cap=cfg.sampler_cap)


def loss_of(distribution, mb, old, ref, cfg, threshold=None):
    """variants.update's loss for `cfg` on one micro-batch (its lesson loss built as main builds it)."""
    return variants.variant_loss(distribution, mb, old, ref, lesson_loss=lesson_loss(cfg), cfg=cfg,
                                 threshold=threshold)


def test_update_none_on(pipe):
    """With no option on, the seam returns the micro-batches and the loss it was given."""
    batches, loss = [object()], object()
    assert variants.update(batches, loss, pipe.vision_language_encoder, cfg_with(), grpo) == (batches, loss)


def test_clip_range():
    """--clip-eps-high by hand: the ratio clipped to [1 - 0.2, 1 + 0.28]: 1.25 with A > 0 keeps its gradient (the
    symmetric 0.2 would clip it), 1.3 is clipped at 1.28, 0.75 with A < 0 at 0.8."""
    logp = torch.log(torch.tensor([[1.25], [1.3], [0.75]])).requires_grad_()
    adv = torch.tensor([1.0, 1.0, -1.0])
    eps = variants.clip_range(adv, 0.2, 0.28)
    loss, m = grpo.grpo_loss(logp, torch.zeros(3, 1), None, adv, eps, 0.0)
    (grad,) = torch.autograd.grad(loss, logp)
    assert abs(loss.item() - -(1.25 + 1.28 - 0.8) / 3) < 1e-6 and m["clip_frac"] == pytest.approx(2 / 3)
    assert grad[0, 0] == pytest.approx(-1.25 / 3) and grad[1, 0] == 0 and grad[2, 0] == 0
    symmetric, m_sym = grpo.grpo_loss(logp, torch.zeros(3, 1), None, adv, variants.clip_range(adv, 0.2, None), 0.0)
    assert abs(symmetric.item() - -(1.2 + 1.2 - 0.8) / 3) < 1e-6 and m_sym["clip_frac"] == 1.0


def test_variant_loss_kl_on():
    """--kl-on above_mean: the KL acts on the samples with A >= 0 only, a sample below its group's mean goes free; the
    KL logged is the KL itself, gated or not."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 4, 6, generator=g)
    mb = sampled_rows(logits, 1.0, g, advantages=(1.0, -1.0, 0.0))
    distribution = grpo.code_logprobs(logits, T, 6).requires_grad_()
    old = grpo.logprob_of(distribution, mb.tokens).detach()
    ref = old + torch.randn(3, 4, generator=g) * 0.3
    every, m = loss_of(distribution, mb, old, ref, cfg_with(kl_beta=0.5))
    gated, gm = loss_of(distribution, mb, old, ref, cfg_with(kl_beta=0.5, kl_on="above_mean"))
    d = ref - old
    k3 = d.exp() - d - 1
    assert torch.allclose(every - gated, 0.5 * k3[1].mean() / 3)  # row 1 (A < 0) lost its KL, rows 0, 2 kept it
    assert m["kl"] == gm["kl"] == pytest.approx(k3.mean().item())


def test_variant_loss_mass(random_pipe):
    """--truncation-weight mass: each loss token's whole term (the surrogate and the KL) times Z_t = p / q, the mass p
    puts on the sampler's nucleus; never under --policy-dist truncated (its samples are q's own)."""
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(2, 5, 8, generator=g) * 2
    mb = sampled_rows(logits, 0.75, g, advantages=(1.0, -2.0))
    distribution = grpo.code_logprobs(logits, T, 8)
    logp = grpo.logprob_of(distribution, mb.tokens)
    old, ref = logp - 0.05, logp + 0.1
    z = (mb.rollout.p_logprobs - mb.rollout.q_logprobs).exp()
    assert 0 < z.min() < 1
    loss, _ = loss_of(distribution, mb, old, ref, cfg_with(kl_beta=2.0, truncation_weight="mass"))
    r, d = torch.exp(logp - old), ref - logp
    A = mb.advantages[:, None]
    w = variants.sampler_correction(old, mb.sampler_logprobs)
    surrogate = torch.min(r * A, r.clamp(0.8, 1.2) * A)
    assert torch.allclose(loss, (-(w * surrogate - 2.0 * (d.exp() - d - 1)) * z).mean())
    truncated = cfg_with(kl_beta=2.0, truncation_weight="mass", policy_dist="truncated")
    assert torch.equal(loss_of(distribution, mb, old, ref, truncated)[0],
                       loss_of(distribution, mb, old, ref, cfg_with(kl_beta=2.0))[0])


def test_variant_loss_train_tokens():
    """--train-tokens all: the preview's tokens join the loss (the lesson trains the large grid only)."""
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(2, 6, 8, generator=g)
    mb = sampled_rows(logits, 1.0, g)._replace(n_preview=2)
    distribution = grpo.code_logprobs(logits, T, 8)
    logp = grpo.logprob_of(distribution, mb.tokens)
    old = logp + torch.randn(2, 6, generator=g) * 0.1
    everything, _ = loss_of(distribution, mb, old, None, cfg_with(train_tokens="all"))
    lesson, _ = loss_of(distribution, mb, old, None, cfg_with())
    w = variants.sampler_correction(old, mb.sampler_logprobs)
    for cols, loss in ((slice(None), everything), (slice(2, None), lesson)):
        want, _ = grpo.grpo_loss(logp[:, cols], old[:, cols], None, mb.advantages, 0.2, 0.0, w[:, cols])
        assert torch.allclose(loss, want)


def test_variant_loss_entropy_bonus():
    """--entropy-bonus B by hand: minus B times the mean over the loss tokens of H_t [H_t > threshold], H the trained
    distribution's entropy; the threshold is given (the step's mean), not the micro-batch's."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 6, 12, generator=g) * torch.tensor([0.1, 3.0] * 3)[:, None]  # flat and peaked rows
    mb = sampled_rows(logits, 1.0, g)._replace(n_preview=2)
    distribution = grpo.code_logprobs(logits, T, 12)
    old = grpo.logprob_of(distribution, mb.tokens)
    plain, _ = loss_of(distribution, mb, old, None, cfg_with())
    H = variants.entropy(distribution)[:, 2:]  # (2, 4)
    for threshold in (H.mean().item(), 0.5 * H.mean().item()):
        bonus, m = loss_of(distribution, mb, old, None, cfg_with(entropy_bonus=0.1), threshold)
        assert torch.allclose(bonus, plain - 0.1 * (H * (H > threshold)).mean()) and m["loss"] == bonus.item()
    assert (H > H.mean()).any() and not (H > H.mean()).all()  # the selection keeps some tokens, not all


def test_mean_entropy_any_micro_batch(random_pipe):
    """The entropy bonus's threshold is the step's, so its gradient is the same at any --micro-batch-size (with the
    micro-batch's own mean, the selection and so the gradient would change with the micro-batches)."""
    rollouts = [sample_group(random_pipe, p, 4, 64, 64, T, seed=s) for s, p in enumerate(["a cat", "a dog"])]
    advantages = torch.tensor([[1.0, -1.0, 0.5, -0.5], [0.3, 0.3, -0.9, 0.3]])
    cfg = cfg_with(entropy_bonus=1.0, kl_beta=0.0)
    grads, thresholds = [], []
    for size in (4, 1):
        policy = copy.deepcopy(random_pipe.vision_language_encoder)
        batches = trainer.micro_batches(rollouts, advantages, size)
        batches, loss = variants.update(batches, lesson_loss(cfg), policy, cfg, grpo)
        thresholds.append(variants.mean_entropy(policy, batches, T, cfg.train_tokens, grpo))
        opt = torch.optim.SGD([p for p in policy.parameters() if p.requires_grad], lr=0.0)
        trainer.train_step(grpo, policy, opt, batches, None, loss, temperature=T, mu=1, max_grad_norm=math.inf)
        grads.append({n: p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None})
    assert thresholds[0] == pytest.approx(thresholds[1], rel=1e-6)
    norm = torch.sqrt(sum((g ** 2).sum() for g in grads[0].values()))
    assert torch.sqrt(sum(((grads[0][k] - grads[1][k]) ** 2).sum() for k in grads[0])) / norm < 1e-5


def test_nucleus_mass():
    """Z_t = p / q from the sampler's two log-probs, 1 where nothing was cut, at most 1."""
    q, p = torch.tensor([[-0.1, -1.0, -0.2]]), torch.tensor([[-0.4, -1.0, -0.1]])
    assert torch.allclose(variants.nucleus_mass(q, p), torch.tensor([[math.exp(-0.3), 1.0, 1.0]]))


def test_on_truncation(random_pipe):
    """--policy-dist truncated trains the sampler's nucleus: the micro-batch gets the codes each draw kept (unpacked)
    and the sampler's log-probs under q; without top-k / top-p it stays as it was; rollouts without the kept codes
    (the lesson's `generate` records none) under top-p are refused in one line, not trained on p."""
    K = random_pipe.vision_language_encoder.config.vq_config.num_embeddings
    r = sample_group(random_pipe, "a red circle", 4, 64, 64, T, seed=2, top_p=0.75)
    mb = trainer.micro_batches([r], torch.zeros(1, 4), 2)[1]
    cut = variants.on_truncation(mb, K)
    assert torch.equal(cut.support, fast_decode.code_support(r.support[2:], K))
    assert torch.equal(cut.sampler_logprobs, r.q_logprobs[2:]) and mb.support is None
    plain = trainer.micro_batches([r._replace(support=None)], torch.zeros(1, 4), 2)[0]
    assert variants.on_truncation(plain, K, truncating=False) is plain
    with pytest.raises(ValueError, match="--policy-dist truncated trains on the codes each draw kept"):
        variants.on_truncation(plain, K, truncating=True)


def narrowed(r, K):
    """Rollout `r` as if each draw had kept the sampled code alone (a one-code nucleus: log q = 0)."""
    kept = torch.nn.functional.one_hot(r.tokens, K).bool()
    return r._replace(support=fast_decode.support_bits(kept), q_logprobs=torch.zeros_like(r.q_logprobs))


def widened(r, K):
    """Rollout `r` as if each draw had kept every code (no truncation: q = p)."""
    kept = torch.ones(*r.tokens.shape, K, dtype=torch.bool)
    return r._replace(support=fast_decode.support_bits(kept), q_logprobs=r.p_logprobs)


def step_gradients(pipe, rollouts, advantages, cfg, micro_batch_size=2, lr=1.0):
    """The trainer's step through the variants' seam, as main runs it -> the last update's gradients and the metrics."""
    policy = copy.deepcopy(pipe.vision_language_encoder)
    ref = grpo.reference_model(policy, cfg.kl_beta)
    opt = torch.optim.SGD([p for p in policy.parameters() if p.requires_grad], lr=lr)
    batches = trainer.micro_batches(rollouts, advantages, micro_batch_size)
    batches, loss = variants.update(batches, lesson_loss(cfg), policy, cfg, grpo)
    readings = diagnostics.reader(cfg, policy.config.vq_config.num_embeddings, grpo)
    m = trainer.train_step(grpo, policy, opt, batches, ref, loss, temperature=T, mu=cfg.mu, max_grad_norm=math.inf,
                           readings=readings)
    return {n: p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None}, m


@pytest.mark.parametrize("kl_beta", [0.0, 0.1], ids=["no-kl", "kl"])
def test_truncated_follows_support(random_pipe, kl_beta):
    """Under --policy-dist truncated the policy, pi_old, the reference and the loss follow the kept codes the rollout
    carries: widened to every code the step equals the lesson's (the whole softmax); narrowed to the sampled code
    every log-prob is 0, so no gradient at all; the lesson ignores them."""
    K = random_pipe.vision_language_encoder.config.vq_config.num_embeddings
    r = sample_group(random_pipe, "a red circle", 4, 64, 64, T, seed=2, top_p=0.75)
    adv = torch.tensor([[1.0, -1.0, 0.5, -0.5]])
    cfg = cfg_with(kl_beta=kl_beta, mu=2, train_tokens="all", top_p=0.75, policy_dist="truncated")
    plain, m_plain = step_gradients(random_pipe, [r], adv, dataclasses.replace(cfg, policy_dist="full"))
    wide, m_wide = step_gradients(random_pipe, [widened(r, K)], adv, cfg)
    assert all(torch.allclose(wide[k], plain[k], atol=1e-7) for k in plain)
    for key in ("loss", "kl", "ratio_min", "ratio_max", "large/logprob", "no_gradient_frac"):
        assert m_wide[key] == pytest.approx(m_plain[key], abs=1e-6), key
    narrow, m_narrow = step_gradients(random_pipe, [narrowed(r, K)], adv, cfg)
    assert all(g.abs().max() == 0 for g in narrow.values()) and m_narrow["no_gradient_frac"] == 1.0
    assert m_narrow["ratio_min"] == m_narrow["ratio_max"] == 1.0 and m_narrow["kl"] == 0.0
    lesson = dataclasses.replace(cfg, policy_dist="full")
    full = [step_gradients(random_pipe, [rollout], adv, lesson)[0] for rollout in (widened(r, K), narrowed(r, K))]
    assert all(torch.equal(full[0][k], full[1][k]) for k in full[0]) and any(g.abs().max() > 0 for g in full[1].values())


@pytest.mark.parametrize("policy_dist", ["truncated", "full"])
def test_corrections_on_the_trained_distribution(pipe, policy_dist):
    """Every --sampler-correction mode against its formula, with a sampler that disagrees with the trainer on the
    TRAINED distribution (the nucleus q's log-probs under truncated, the whole softmax p's under full): weights
    exp(old - sampled) per token on the loss's tokens, or per sequence over ALL its tokens, truncated or masked at
    the cap, times the nucleus' mass under full with --truncation-weight mass."""
    r = sample_group(pipe, "two blue squares", 4, 64, 64, T, seed=3, top_p=0.9)
    noise = 0.3 * torch.randn(r.q_logprobs.shape, generator=torch.Generator().manual_seed(0)).to(r.tokens.device)
    full = policy_dist == "full"
    r = r._replace(p_logprobs=r.p_logprobs + noise) if full else r._replace(q_logprobs=r.q_logprobs + noise)
    ar, adv, n_preview = pipe.vision_language_encoder, torch.tensor([1.0, -1.0, 0.5, -0.5]), 256
    mb = trainer.micro_batches([r], adv[None], 4)[0]
    if not full:
        mb = variants.on_truncation(mb, ar.config.vq_config.num_embeddings)
    with torch.no_grad():
        logits = grpo.token_logits(ar, r.prompt.inputs, r.tokens)
    distribution = variants.distribution(grpo, logits, T, ar.config.vq_config.num_embeddings, mb.support)
    logp = grpo.logprob_of(distribution, r.tokens)
    mass = variants.nucleus_mass(r.q_logprobs, r.p_logprobs)[:, n_preview:] if full else 1.0
    d_all = logp - mb.sampler_logprobs  # (G, N)
    d, seq = d_all[:, n_preview:], d_all.sum(1, keepdim=True)
    cap = 1.2
    by_hand = {"none": torch.ones_like(d), "token_truncate": d.exp().clamp(max=cap),
               "token_mask": d.exp() * (d.exp() <= cap), "sequence_truncate": seq.clamp(max=20).exp().clamp(max=cap),
               "sequence_mask": seq.clamp(max=20).exp() * (seq.exp() <= cap)}
    for mode, weights in by_hand.items():
        cfg = cfg_with(sampler_correction=mode, sampler_cap=cap, policy_dist=policy_dist, truncation_weight="mass",
                       top_p=0.9)
        loss, _ = loss_of(distribution, mb, logp, None, cfg)
        want = (-(weights * adv[:, None] * mass)).mean()  # ratio 1 at the first update: the surrogate is A
        assert loss.item() == pytest.approx(want.item(), abs=1e-5), mode
    assert 0 < by_hand["token_mask"].eq(0).float().mean() < 1  # the cap acted on some tokens, not all


def test_float32_corrections(random_pipe):
    """At the real model's top-p 0.75 in float32 with a real sampler (the KV-cached decode's float error against the
    teacher-forced trainer): every --sampler-correction mode reads a gap <= 1e-5 and weights 1 +- 1e-4, and its
    gradient is the uncorrected one within 1e-4; the nucleus' mass is below 1 and weighs the gradient down."""
    r = sample_group(random_pipe, "a red circle", 4, 64, 64, T, seed=2, top_p=0.75)
    adv = torch.tensor([[1.0, -1.0, 0.5, -0.5]])
    options = dict(top_p=0.75, truncation_weight="mass", kl_beta=0.0, mu=1)
    plain, _ = step_gradients(random_pipe, [r], adv, cfg_with(sampler_correction="none", **options), 4, lr=0.0)
    norm = torch.sqrt(sum((g ** 2).sum() for g in plain.values()))
    for mode in CORRECTIONS:
        grads, m = step_gradients(random_pipe, [r], adv, cfg_with(sampler_correction=mode, **options), 4, lr=0.0)
        assert m["sampling/sampling_logp_difference/max"] <= PARITY, mode
        assert 1 - 1e-4 <= m["sampling/importance_sampling_ratio/min"] <= m["sampling/importance_sampling_ratio/max"] \
            <= 1 + 1e-4, mode
        assert torch.sqrt(sum(((grads[k] - g) ** 2).sum() for k, g in plain.items())) <= 1e-4 * norm, mode
    assert m["truncation/nucleus_mass/mean"] < 0.95 and m["truncation/nucleus_mass/min"] >= 0.75 - 1e-6
    unweighted, _ = step_gradients(random_pipe, [r], adv, cfg_with(**{**options, "truncation_weight": "none"}), 4, lr=0.0)
    assert torch.sqrt(sum((g ** 2).sum() for g in unweighted.values())) > 1.05 * norm


# ---- issue 67: GARDO's gate and reset, DiverseGRPO's clusters --------------------------------------

def test_cluster_bonus():
    """--cluster-bonus: clusters by single linkage within --cluster-radius (a chain links 0-1-2 though 0 and 2 are two
    cells apart), radius 0 gives the identical grids (`repeats`); the bonus B / c goes to each group's best samples
    only, before the z-score."""
    grids = [torch.tensor([[0, 0, 0, 0], [0, 0, 0, 1], [0, 0, 1, 1], [2, 2, 2, 2]]),
             torch.tensor([[1, 1, 1, 1], [1, 1, 1, 1], [3, 3, 3, 3], [1, 1, 1, 2]])]
    assert torch.equal(variants.cluster_sizes(grids, 0.25), torch.tensor([[3, 3, 3, 1], [3, 3, 1, 3]]))
    assert torch.equal(variants.cluster_sizes(grids, 0.0), variants.repeats(grids))
    reward = torch.tensor([[1.0, 1.0, 0.5, 1.0], [1.0, 1.0, 1.0, 0.0]])
    adv = seam(grpo.group_advantages(reward), reward, [rollout(g) for g in grids],
               cfg_with(cluster_bonus=0.3, cluster_radius=0.25))
    bonus = torch.tensor([[1 / 3, 1 / 3, 0.0, 1.0], [1 / 3, 1 / 3, 1.0, 0.0]])  # sample (0, 2) is not among the best
    assert torch.allclose(adv, grpo.group_advantages(reward + 0.3 * bonus))
    assert adv[0, 3] > adv[0, 0] == adv[0, 1] and adv[1, 2] > adv[1, 0]  # the lone right layout above its cluster


class GardoRiskCompensator:
    """GARDO's RiskCompensator, transcribed from tinnerhrhe/GARDO 1cc77fb, scripts/train_sd3_grpo_gardo.py L219-238."""
    def __init__(self, base=0.1, beta=0.1):
        import numpy as np
        self.np = np
        self.risk_buffer, self.base, self.alpha, self.beta, self.beta_min, self.beta_max = [], base, 0.1, beta, 0.02, 0.2

    def update(self, pad_scores):
        np = self.np
        if len(self.risk_buffer) == 0:
            self.beta = self.base
        elif np.mean(pad_scores) > max(self.risk_buffer):
            self.beta = self.beta * (1 + self.alpha)
        elif np.mean(pad_scores) < min(self.risk_buffer):
            self.beta = self.beta * (1 - self.alpha)
        self.beta = np.clip(self.beta, self.beta_min, self.beta_max)
        self.risk_buffer.append(np.mean(pad_scores))
        if len(self.risk_buffer) > 20:
            self.risk_buffer = self.risk_buffer[-20:]


def gardo_gate(main, aux, controller):
    """GARDO's uncertainty gate over a batch, transcribed from the same file, L825-837 (its two auxiliary rewards,
    aesthetic and imagereward, are `aux`)."""
    import numpy as np
    reward_std = []
    for item in [*aux, main]:
        _, indices = torch.sort(torch.tensor(item), descending=True)
        ranks = torch.empty_like(torch.tensor(item)).long()
        ranks[indices] = torch.arange(1, len(item) + 1)
        reward_std.append(ranks.float())
    reward_std = reward_std[-1] - (reward_std[0] + reward_std[1]) / 2
    controller.update(np.array([p for p in reward_std.cpu().numpy() if p >= 0]))
    threshold = np.percentile(np.array([p for p in reward_std.cpu().numpy() if p >= 0]), 100 - controller.beta * 100)
    return reward_std > threshold


def test_uncertain_kl_weights():
    """--kl-on uncertain gates as GARDO's code, step after step (its controller's b moving): on 30 random batches of
    3 groups of 8, one out of the loss, the gated samples are GARDO's less those with A = 0 (which GARDO's update
    leaves out), each weighs S / n and the rest 0, the groups out of the loss 0, and b is GARDO's."""
    g = torch.Generator().manual_seed(0)
    ours, theirs = variants.RiskCompensator(), GardoRiskCompensator()
    in_loss = torch.tensor([True, False, True])
    shares, gated = set(), 0
    for step in range(30):
        spread = 1 + 3 * (step % 7 == 3)  # now and then a step far more uncertain: b moves
        reward = torch.rand(3, 8, generator=g)
        each = {"main": reward, "a": reward + spread * torch.rand(3, 8, generator=g),
                "b": reward + spread * torch.rand(3, 8, generator=g)}
        A = torch.randn(3, 8, generator=g)
        A[2, :2] = 0  # GARDO's update leaves out the samples with A = 0: no KL on them
        w = variants.uncertain_kl_weights(reward, each, in_loss, A, ["a", "b"], ours)
        gate = gardo_gate(reward[in_loss].flatten().numpy(), [each[n][in_loss].flatten().numpy() for n in "ab"], theirs)
        gate &= A[in_loss].flatten() != 0
        assert torch.equal(w[in_loss].flatten() > 0, gate), step
        assert torch.allclose(w[in_loss].flatten()[gate], 16 / gate.sum().clamp(min=1).float())
        gated += int(gate.sum())
        assert w[1].eq(0).all() and ours.share == pytest.approx(float(theirs.beta)), step
        shares.add(round(ours.share, 6))
    assert len(shares) > 2 and gated > 10  # b moved, and samples were gated


def test_ranks_ties():
    """Ranks as GARDO's descending sort gives distinct values (1 the highest); tied values share their mean rank (so
    a tie's order in the batch does not decide who is uncertain); NaN ranks last."""
    assert variants.ranks(torch.tensor([0.2, 0.9, 0.5])).tolist() == [3, 1, 2]
    assert variants.ranks(torch.tensor([1.0, 0.5, 1.0, 0.5, 0.0])).tolist() == [1.5, 3.5, 1.5, 3.5, 5]
    assert variants.ranks(torch.tensor([float("nan"), 0.1, 0.3])).tolist() == [3, 2, 1]
    trained, aux = torch.tensor([1.0, 1.0, 0.0, 0.0]), torch.tensor([0.4, 0.9, 0.1, 0.2])
    assert variants.uncertainty(trained, [aux]).tolist() == [-0.5, 0.5, -0.5, 0.5]  # within a tie, the aux decides


def test_variant_loss_kl_uncertain():
    """--kl-on uncertain: the KL term is beta times the mean k3 of the gated samples (weights S / n), the others go
    free; the logged KL is over every sample."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 4, 6, generator=g)
    mb = sampled_rows(logits, 1.0, g, advantages=(1.0, -1.0, 0.0))
    distribution = grpo.code_logprobs(logits, T, 6).requires_grad_()
    old = grpo.logprob_of(distribution, mb.tokens).detach()
    ref = old + torch.randn(3, 4, generator=g) * 0.3
    cfg = cfg_with(kl_beta=0.5, kl_on="uncertain", reward="shapes,size=0")
    weights = {id(mb.rollout): torch.tensor([0.0, 3.0, 0.0])}  # one of three gated
    gated, m = variants.variant_loss(distribution, mb, old, ref, lesson_loss=lesson_loss(cfg), cfg=cfg,
                                     threshold=None, kl_weights=weights)
    free, _ = loss_of(distribution, mb, old, ref, cfg_with(kl_beta=0.0))
    d = ref - old
    k3 = d.exp() - d - 1
    assert torch.allclose(gated - free, 0.5 * k3[1].mean())
    assert m["kl"] == pytest.approx(k3.mean().item())


def test_validate_gardo():
    """The gate needs a weight-0 reward and the KL; the reset needs the KL; the radius is a share."""
    with pytest.raises(ValueError, match="weight-0 rewards.*--reward shapes,size=0"):
        variants.validate(cfg_with(kl_on="uncertain", reward="shapes", kl_beta=0.1))
    with pytest.raises(ValueError, match="--kl-beta 0"):
        variants.validate(cfg_with(reference_reset_every=5, kl_beta=0))
    with pytest.raises(ValueError, match="--cluster-radius 1.0"):
        user_input.check_numbers(cfg_with(cluster_radius=1.0))
    with pytest.raises(ValueError, match="--reference-reset-kl 0.001 triggers .* give both"):
        variants.validate(cfg_with(reference_reset_kl=1e-3, kl_beta=0.1))
    variants.validate(cfg_with(kl_on="uncertain", reward="shapes,size=0", kl_beta=0.1, reference_reset_every=5,
                               reference_reset_kl=1e-3))


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_reference_reset(random_pipe, lora):
    """--reference-reset-every: the reference is the initial policy until a reset, then the policy as it was at the
    reset (bit for bit, in float32), while the policy moves on; reading it leaves the policy's weights untouched; its
    state_dict restores it, and the step of the reset, in a fresh run (resume)."""
    from tests.conftest import lora_policy
    rollout_ = sample_group(random_pipe, "a red circle", 2, 64, 64, 1.0, 0)
    mb, = trainer.micro_batches([rollout_], torch.zeros(1, 2), 2)

    def make():
        ar = copy.deepcopy(random_pipe.vision_language_encoder)
        policy = lora_policy(type("P", (), {"vision_language_encoder": ar})(), rank=2) if lora else ar.requires_grad_()
        return policy, variants.Reference(policy, grpo.reference_model(policy, 0.1))

    def logp(model):
        return grpo.token_logprobs(model, mb.inputs, mb.tokens, 1.0).detach()

    def move(policy, seed):
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in policy.parameters():
                if p.requires_grad:
                    p.add_(torch.randn(p.shape, generator=g) * 0.05)

    policy, ref = make()
    initial = grpo.reference_logprobs(ref, mb, 1.0)
    move(policy, 1)
    assert torch.equal(grpo.reference_logprobs(ref, mb, 1.0), initial)  # not reset: the initial weights
    ref.reset(7)
    at_reset, weights = logp(policy), [p.detach().clone() for p in policy.parameters()]
    move(policy, 2)
    assert torch.equal(grpo.reference_logprobs(ref, mb, 1.0), at_reset)
    assert not torch.equal(logp(policy), at_reset)
    again, ref2 = make()  # a resumed run: its policy from the checkpoint, its reference from the state
    ref2.load_state_dict(ref.state_dict())
    assert torch.equal(grpo.reference_logprobs(ref2, mb, 1.0), at_reset) and ref2.last == 7
    moved = [p.detach().clone() for p in policy.parameters()]
    grpo.reference_logprobs(ref, mb, 1.0)
    assert all(torch.equal(p, q) for p, q in zip(policy.parameters(), moved))  # the reading swapped back
    assert not all(torch.equal(p, q) for p, q in zip(moved, weights))


def test_main_gardo_resume(tmp_path):
    """GARDO whole in a run (--kl-on uncertain with the size reward at weight 0, --reference-reset-every 3 with its
    KL trigger, --gardo-diversity tokens) and DiverseGRPO's bonus, with LoRA: 7 steps == 5 steps + resume + 2 steps
    (the controller's b and the reset reference come back from the checkpoint); at mu 1 the KL logged (the first
    update's) is 0 right after a reset, the reference being the policy bit for bit. Resumed after step 5's reset, the
    KL's: without its step in the checkpoint the count would reset again after step 6."""
    from tests.conftest import tiny_run
    flags = ["--kl-beta", "0.1", "--kl-on", "uncertain", "--reward", "shapes,size=0", "--reference-reset-every", "3",
             "--reference-reset-kl", "1e-6",
             "--gardo-diversity", "tokens", "--cluster-bonus", "0.2", "--lora-rank", "2", "--mu", "1",
             "--prompts", str(Path(grpo.__file__).parent / "examples" / "shapes.txt"), "--lr", "1e-2"]
    tiny_run(tmp_path, tmp_path / "whole", "--steps", "7", *flags)
    tiny_run(tmp_path, tmp_path / "part", "--steps", "5", *flags)  # its checkpoint: after step 5's reset
    grpo.main(["--resume", str(tmp_path / "part"), "--steps", "7"])
    whole = run_record(tmp_path / "whole")
    assert whole == run_record(tmp_path / "part")
    assert whole[0]["kl_share"] == 0.1 and whole[4]["kl_share"] != 0.1  # a fresh controller would start at 0.1
    # step 1's samples all score 0: nothing moves before step 2; resets after step 3 (its count) and 5 (its KL; the
    # count alone would reset after 6), not after 6 (one step after the last)
    assert [r["kl"] > 0 for r in whole] == [False, False, True, False, True, False, True]


def test_reset_schedule_as_gardo():
    """GARDO's reset schedule (scripts/train_sd3_grpo_gardo.py L789 and L1042-1043, docs/peer_readings.md 5),
    transcribed: at the start of epoch e (0-based: e rounds done) it resets when more than reset_freq epochs have
    passed since the last reset, or when one of the last epoch's optimizer steps logged a KL above kl_thres; this code
    after step s (1-based: s rounds done), N = reset_freq + 1, its mu = 2 updates' KL merged as train_step merges
    them. Without the trigger (T = 0): every 16th. With it: the same resets as GARDO's, also where only the first of
    a step's updates went above T, and across a resume from a checkpoint (the last reset's step comes back)."""
    kls = [[0.1, 0.1] for _ in range(64)]  # each round's two updates' KL, above T = 0.3 in rounds 5 and 30:
    kls[4] = [0.5, 0.1]  # only the first update (the last update's kl alone would miss it)
    kls[29] = [0.1, 0.6]  # only the last

    def gardo(thres: float) -> list[int]:
        resets, prev_epoch, reset = [], 0, False
        for epoch in range(65):
            if (epoch != 0 and reset) or (epoch - prev_epoch) > 15:  # GARDO's L789
                resets.append(epoch)
                reset, prev_epoch = False, epoch
            for kl in kls[epoch] if epoch < 64 else []:  # the epoch's optimizer steps
                if kl > thres:  # GARDO's L1042 (its thres is config.kl_thres)
                    reset = True
        return resets

    def ours(T: float, resume_at: int | None = None, legacy: bool = False) -> list[int]:
        resets, cfg = [], SimpleNamespace(reference_reset_every=16, reference_reset_kl=T)
        policy = torch.nn.Linear(2, 2)

        def fresh():  # a Reference that notes its resets
            reference = variants.Reference(policy, copy.deepcopy(policy))
            reset = reference.reset
            reference.reset = lambda step: (resets.append(step), reset(step))
            return reference

        reference = fresh()
        for step in range(1, 65):
            if step == resume_at:  # a fresh run loads the checkpoint saved after step - 1
                saved, reference = reference.state_dict(), fresh()
                reference.load_state_dict({k: v for k, v in saved.items() if not (legacy and k == "last")})
            metrics = parallel.merge_metrics([[({"kl": kl}, 1.0)] for kl in kls[step - 1]])
            variants.after_step(variants.State(reference=reference), step, cfg, metrics)
        return resets

    assert ours(0.0) == gardo(float("inf")) == [16, 32, 48, 64]  # T = 0: the trigger off
    assert ours(0.3) == gardo(0.3) == [5, 21, 30, 46, 62]  # the count of 16 starts again at each reset
    assert ours(0.3, resume_at=10) == gardo(0.3)  # the last reset (5, the KL's) comes back: the next is at 21
    assert ours(0.0, resume_at=32, legacy=True) == [16, 32, 48, 64]  # saved before the trigger (no "last") after 31


def test_gardo_diversity_dino(dino_folder):
    """--gardo-diversity dino: d is 1 - cosine of the pictures' DINOv2 features (the dino reward's checkpoint, here
    --reward's dino@FOLDER), nearest group-mate's; two copies of one picture give d = 0 and lose their credit."""
    from helpers import rewards
    g = torch.Generator().manual_seed(0)
    pictures = torch.rand(4, 3, 32, 32, generator=g)
    pictures[1] = pictures[0]
    reward = torch.tensor([[1.0, 1.0, 0.2, 0.9]])
    cfg = cfg_with(gardo_diversity="dino", reward=f"ssim,dino@{dino_folder}=0")
    kept = torch.ones(1, dtype=torch.bool)
    z = grpo.group_advantages(reward)
    adv = variants.advantages(z, [rollout(torch.zeros(4, 4, dtype=torch.long))], reward, {"ssim": reward}, kept, cfg,
                              grpo, [pictures])
    f = rewards.dino_features(pictures, str(dino_folder))
    d = variants.nearest(1 - (f @ f.T).clamp(-1, 1))  # a copy's cosine can round above 1 (torch 2.14: d = -1e-7)
    assert torch.allclose(adv[0], z[0] * variants.gardo_factor(d, z[0]), atol=1e-6)
    assert adv[0, :2].abs().max() < 1e-5 and adv[0, 3] > 0  # the copies lose their credit, the other right one keeps it


def test_feature_similarity_clamped(monkeypatch):
    """The cosine of a picture with its copy rounds above 1 in float32 for some unit vectors: feature_similarity clamps
    it, so that d = 1 - cosine is never below 0 (GARDO clips so too). (test_gardo_diversity_dino meets such a vector
    only on some builds and thread counts.)"""
    from helpers import rewards
    g = torch.Generator().manual_seed(0)
    for _ in range(100):  # a unit vector whose dot with itself rounds above 1
        v = torch.nn.functional.normalize(torch.randn(1, 384, generator=g), dim=-1)
        if (v @ v.T).item() > 1:
            break
    assert (v @ v.T).item() > 1
    monkeypatch.setattr(rewards, "dino_features", lambda images, checkpoint: torch.cat([v, v]))
    similarity = variants.feature_similarity(torch.zeros(2, 3, 8, 8), "unused")
    assert similarity.max() <= 1 and variants.nearest(1 - similarity).min() >= 0


def test_uncertain_kl_weights_two_processes(monkeypatch):
    """Under torchrun the gate reads the whole batch and each process takes its own rows: as rank 1 of 2 (the other
    process's samples made up), the weights equal the last group's of one process holding both groups."""
    def other(t):  # what rank 0 holds: another batch of the same sizes
        return t.flip(0) * 0.5 + 0.1 if t.is_floating_point() else t

    g = torch.Generator().manual_seed(1)
    reward = torch.rand(1, 8, generator=g)
    each = {"main": reward, "a": torch.rand(1, 8, generator=g), "b": torch.rand(1, 8, generator=g)}
    A = torch.randn(1, 8, generator=g)
    both = {"reward": torch.stack([other(reward.flatten()), reward.flatten()]),
            "a": torch.stack([other(each["a"].flatten()), each["a"].flatten()]),
            "b": torch.stack([other(each["b"].flatten()), each["b"].flatten()]),
            "A": torch.stack([other(A.flatten()), A.flatten()])}
    one = variants.uncertain_kl_weights(both["reward"], {"a": both["a"], "b": both["b"]}, torch.ones(2, dtype=torch.bool),
                                        both["A"], ["a", "b"], variants.RiskCompensator(base=0.2))
    monkeypatch.setattr(variants, "gather_rows", lambda t: torch.cat([other(t), t]))
    monkeypatch.setattr(parallel, "distributed", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda: 1)
    mine = variants.uncertain_kl_weights(reward, each, torch.ones(1, dtype=torch.bool), A, ["a", "b"],
                                         variants.RiskCompensator(base=0.2))
    assert one.sum() > 0 and torch.equal(mine[0], one[1])


def test_gardo_dino_checked_first(tmp_path, monkeypatch, capsys):
    """--gardo-diversity dino loads its DINOv2 before the run starts: a checkpoint that is not there stops it in one
    line, with nothing written."""
    from tests.conftest import expect_exit
    monkeypatch.setattr(variants, "dino_checkpoint", lambda spec: str(tmp_path / "no-dino"))
    prompts = write_example(tmp_path, ["a red circle"])
    expect_exit([*TINY, "--prompts", str(prompts), "--out", str(tmp_path / "run"), "--reward", "shapes",
                 "--gardo-diversity", "dino"], 2,
                "no-dino", capsys)
    assert not (tmp_path / "run").exists()


# ---- the KL-regularised objective (--kl-in-reward, --mara-threshold; tools/bandit.py measures where they land) ---

def test_kl_in_reward_by_hand():
    """--kl-in-reward's advantages: R - beta log(pi_old / ref), each log-prob a sample's sum over its tokens, minus
    the group's mean, no std (a std would rescale the KL's weight group by group)."""
    reward, policy, ref = torch.tensor([[1.0, 0.0, 0.5]]), torch.tensor([[-2.0, -1.0, -3.0]]), torch.tensor(
        [[-1.0, -1.5, -3.0]])
    shaped = [1.0 - 0.1 * (-2.0 + 1.0), 0.0 - 0.1 * (-1.0 + 1.5), 0.5]
    want = torch.tensor([[x - sum(shaped) / 3 for x in shaped]])
    assert torch.allclose(variants.kl_in_reward(reward, policy, ref, 0.1), want)


def kl_regularised_case():
    """Two groups of 4 (1 preview code, a 1 x 2 large grid), stand-in (G, N) log-probs under pi_old and the reference
    for each rollout, the second group out of the loss."""
    g = torch.Generator().manual_seed(0)
    rollouts = [rollout(torch.zeros(4, 3, dtype=torch.long), -torch.rand(4, 3, generator=g), preview=1)
                for _ in range(2)]
    logprobs = [(-torch.rand(4, 3, generator=g), -3 * torch.rand(4, 3, generator=g)) for _ in rollouts]
    reward = torch.tensor([[1.0, 0.9, 0.2, 1.0], [0.3, 0.1, 0.2, 0.0]])
    return rollouts, logprobs, reward, torch.tensor([True, False])


@pytest.mark.parametrize("train_tokens, scale_rewards", [("large", "group"), ("all", "group"), ("large", "none")])
def test_kl_regularised(train_tokens, scale_rewards):
    """The seam with --kl-in-reward and --mara-threshold 0.85, by hand: the samples at or above tau get the anchor's
    reward plus beta log(ref(z) / ref(y)) (z: the likeliest of them under the reference), then beta log(pi_old / ref)
    comes off, each a sum over the loss tokens (the large grid, the preview's code left out; with --train-tokens all
    every code), then the group's mean, then the group's std (population's) but with --scale-rewards none; the group
    out of the loss stays 0, but its log-probs are still read (under torchrun every process runs the same forwards);
    the readings."""
    rollouts, logprobs, reward, in_loss = kl_regularised_case()
    read = []

    def sequence_logprobs(r):
        read.append(r)
        return logprobs[[id(x) for x in rollouts].index(id(r))]

    cfg = dataclasses.replace(cfg_with(mara_threshold=0.85, train_tokens=train_tokens, scale_rewards=scale_rewards),
                              kl_in_reward=True)
    state = variants.State()
    A = variants.advantages(grpo.group_advantages(reward), rollouts, reward, {"ssim": reward}, in_loss, cfg, grpo,
                            None, sequence_logprobs, state)
    first = 1 if train_tokens == "large" else 0
    policy, ref = (x[:, first:].sum(-1).tolist() for x in logprobs[0])
    high = [0, 1, 3]
    z = max(high, key=lambda i: ref[i])
    mara = [reward[0, z].item() + 0.1 * (ref[z] - ref[i]) if i in high else reward[0, i].item() for i in range(4)]
    shaped = [mara[i] - 0.1 * (policy[i] - ref[i]) for i in range(4)]
    centred = [x - sum(shaped) / 4 for x in shaped]
    std = math.sqrt(sum(x * x for x in centred) / 4) if scale_rewards == "group" else 1.0
    assert torch.allclose(A[0], torch.tensor(centred) / std, atol=1e-6) and torch.equal(A[1], torch.zeros(4))
    assert [id(r) for r in read] == [id(r) for r in rollouts]
    assert state.readings == pytest.approx({"mara/augmented_share": 3 / 4, "mara/anchor_reward": reward[0, z].item(),
                                            "kl_in_reward/penalty": sum(0.1 * (p - q) for p, q in zip(policy, ref)) / 4})


def test_kl_regularised_readings_every_process(monkeypatch):
    """Under torchrun the readings are every process's: the share, the anchors and the penalty gathered (here a
    stand-in second process with no sample at or above tau and a penalty of 0)."""
    rollouts, logprobs, reward, in_loss = kl_regularised_case()
    cfg = dataclasses.replace(cfg_with(mara_threshold=0.85), kl_in_reward=True)
    monkeypatch.setattr(variants, "gather_rows", lambda t: torch.cat([t, torch.zeros_like(t)]))
    state = variants.State()
    variants.advantages(None, rollouts, reward, {}, in_loss, cfg, grpo, None,
                        lambda r: logprobs[[id(x) for x in rollouts].index(id(r))], state)
    ref = logprobs[0][1][:, 1:].sum(-1)
    anchor = max([0, 1, 3], key=lambda i: ref[i].item())
    assert state.readings["mara/augmented_share"] == pytest.approx(3 / 8)
    assert state.readings["mara/anchor_reward"] == pytest.approx(reward[0, anchor].item() / 2)  # its anchor, and 0


def test_kl_in_reward_loss_has_no_kl():
    """--kl-in-reward takes the KL term out of the loss (beta 0): its loss is the lesson's at --kl-beta 0, and the KL
    it logs is still measured."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 4, 6, generator=g)
    mb = sampled_rows(logits, 1.0, g, advantages=(1.0, -1.0))
    distribution = grpo.code_logprobs(logits, T, 6).requires_grad_()
    old = grpo.logprob_of(distribution, mb.tokens).detach()
    ref = old + torch.randn(2, 4, generator=g) * 0.3
    moved, m = loss_of(distribution, mb, old, ref, dataclasses.replace(cfg_with(kl_beta=0.5), kl_in_reward=True))
    without, _ = loss_of(distribution, mb, old, ref, cfg_with(kl_beta=0.0))
    with_kl, km = loss_of(distribution, mb, old, ref, cfg_with(kl_beta=0.5))
    assert torch.equal(moved, without) and not torch.allclose(moved, with_kl) and m["kl"] == km["kl"] > 0


def test_validate_kl_in_reward():
    """The KL-regularised options refuse, in one line each, what would make them another objective: MARA without the
    KL in the reward (it collapses: tools/bandit.py), no KL's weight, another option's advantages, top-k / top-p (the
    log-ratio is a KL estimate only for samples from pi), a gated KL."""
    kl = lambda **options: dataclasses.replace(cfg_with(**options), kl_in_reward=True)  # noqa: E731
    for cfg, message in [(cfg_with(mara_threshold=0.9), "--mara-threshold 0.9 sets the target .* add --kl-in-reward"),
                         (kl(kl_beta=0.0), "--kl-in-reward weighs the reference's log-probs by --kl-beta, which is 0"),
                         (kl(reward_aggregation="normalize"), "own advantages .* --reward-aggregation would change"),
                         (kl(diversity=0.2, unlikeliness=1.0), "--diversity, --unlikeliness would change"),
                         (kl(top_p=0.75), "give --top-p 1 --top-k 0"), (kl(top_k=5), "give --top-p 1 --top-k 0"),
                         (kl(kl_on="above_mean"), "--kl-on above_mean gates the KL term")]:
        with pytest.raises(ValueError, match=message):
            variants.validate(cfg)
    variants.validate(kl(mara_threshold=0.9, train_tokens="all"))
    variants.validate(kl(scale_rewards="none"))
    variants.validate(kl(scale_rewards="batch"))


def test_main_kl_in_reward(tmp_path):
    """--kl-in-reward --mara-threshold in a 2-step tiny run: the readings on each step's line; at step 1 the policy is
    the reference, read teacher-forced as the reference is, so the KL taken off the reward is 0 exactly; at step 2 it
    is not."""
    prompts = write_example(tmp_path, ["a red circle", "a blue square"])
    grpo.main([*TINY, "--prompts", str(prompts), "--out", str(tmp_path / "run"), "--steps", "2", "--reward", "shapes",
               "--kl-beta", "0.1", "--kl-in-reward", "--mara-threshold", "0.5", "--image-every", "0"])
    first, second = run_record(tmp_path / "run")
    assert first["kl_in_reward/penalty"] == 0.0 and 0 <= first["mara/augmented_share"] <= 1
    assert second["kl_in_reward/penalty"] != 0.0
