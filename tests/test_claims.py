"""Each peer the docs name, checked against the peer's own code (docs/claims.md lists every such sentence).

Each test transcribes the peer's lines, as read in its repository (the commit in the docstring; docs/claims.md quotes
them), and compares this project's function with them on the same numbers. Where this project differs on purpose, the
test measures the difference the docs state.
"""

import math
import re
from bisect import bisect_right
from pathlib import Path

import pytest
import torch

import grpo
from helpers import variants


def random_logprobs(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [-torch.rand(*shape, generator=g) * 3 for _ in range(3)]


def trl_importance_weights(old_per_token_logps, sampling_per_token_logps, mode, clip_max, clip_min=None):
    """TRL's vLLM importance-sampling weights, transcribed from trl/trainer/grpo_trainer.py (huggingface/trl f2cd577,
    lines 2578-2619), no padding (mask all ones)."""
    mask = torch.ones_like(old_per_token_logps)
    per_token_logps_diff = (old_per_token_logps - sampling_per_token_logps) * mask
    sequence_level_is = mode in ["sequence_mask", "sequence_truncate"]
    if sequence_level_is:
        logps_diff = per_token_logps_diff.sum(dim=-1, keepdim=True)
    else:
        logps_diff = per_token_logps_diff
    ratio = torch.exp(logps_diff)
    min_val = clip_min if clip_min is not None else -math.inf
    if mode in ["sequence_truncate", "token_truncate"]:
        ratio = torch.clamp(ratio, min=clip_min, max=clip_max)
    else:
        invalid = (ratio < min_val) | (ratio > clip_max)
        ratio = ratio.masked_fill(invalid, value=0.0)
    return ratio.expand_as(old_per_token_logps)


def test_trl_mismatch_weights():
    """variants.sampler_correction (token_truncate: grpo.importance_weights) is TRL's vllm_importance_sampling_mode weights, in each of TRL's four modes (TRL's
    default is sequence_mask at 3.0, this project's token_truncate at 2.0; the modes and the cap mean the same)."""
    old, sampled, _ = random_logprobs(3, 7)
    sampled = old + 0.4 * (sampled + 1.5)  # gaps of both signs, some sequences' sums past the cap
    for mode in ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask"):
        for cap in (2.0, 3.0):
            want = trl_importance_weights(old, sampled, mode, cap)
            assert torch.allclose(variants.sampler_correction(old, sampled, mode, cap), want, rtol=1e-6), (mode, cap)
    masked = variants.sampler_correction(old, sampled, "sequence_mask", 2.0)
    assert masked.eq(0).any() and masked.ne(0).any()  # the example exercises the mask


def test_trl_mismatch_weights_carry_the_nucleus_mass():
    """grpo.py's header: "TRL's pi_sampler is vLLM's processed q, so with top-p its weights also carry p/q". TRL
    builds vLLM with logprobs_mode="processed_logprobs" (after temperature and top_k / top_p: q) and scores
    old_per_token_logps with logits / temperature alone (p); its token_truncate weight is then each step's nucleus
    mass, the sum of p over the codes q keeps, counted here from p directly; its default sequence_mask weight is their
    product. The lesson's weights, p over the sampler's p, stay 1."""
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(3, 6, 64, generator=g) * 2  # 3 sequences of 6 tokens over 64 codes
    p = grpo.code_logprobs(logits, 0.9, 64)  # (3, 6, 64)
    q = grpo.code_logprobs(logits, 0.9, 64, 0, 0.75)
    tokens = torch.multinomial(q.exp().reshape(-1, 64), 1, generator=g).reshape(3, 6)
    p_drawn, q_drawn = grpo.logprob_of(p, tokens), grpo.logprob_of(q, tokens)
    mass = torch.where(q.isfinite(), p.exp(), torch.zeros(())).sum(dim=-1)  # (3, 6): p's mass on the nucleus
    trl = trl_importance_weights(p_drawn, q_drawn, "token_truncate", 2.0)
    assert torch.allclose(trl, mass, rtol=1e-5) and (mass < 1).all() and (mass >= 0.75).all()
    sequence = trl_importance_weights(p_drawn, q_drawn, "sequence_mask", 3.0)
    assert torch.allclose(sequence[:, 0], mass.prod(dim=1), rtol=1e-5)
    assert grpo.importance_weights(p_drawn, p_drawn.clone()).eq(1).all()


def trl_per_token_loss(per_token_logps, old_per_token_logps, ref_per_token_logps, advantages, epsilon_low,
                       epsilon_high, beta, importance_sampling_ratio):
    """TRL's per-token GRPO loss, transcribed from trl/trainer/grpo_trainer.py (f2cd577, lines 3071-3121):
    the k3 KL, the two-sided clip (epsilon_high: DAPO's clip-higher), the mismatch weight, then + beta KL."""
    per_token_kl = torch.exp(ref_per_token_logps - per_token_logps) - (ref_per_token_logps - per_token_logps) - 1
    log_ratio = per_token_logps - old_per_token_logps
    coef_1 = torch.exp(log_ratio)
    coef_2 = torch.clamp(coef_1, 1 - epsilon_low, 1 + epsilon_high)
    per_token_loss1 = coef_1 * advantages.unsqueeze(1)
    per_token_loss2 = coef_2 * advantages.unsqueeze(1)
    per_token_loss = -torch.min(per_token_loss1, per_token_loss2)
    per_token_loss = per_token_loss * importance_sampling_ratio
    per_token_loss = per_token_loss + beta * per_token_kl
    return per_token_loss, per_token_kl


def trl_aggregate(per_token_loss, mask, loss_type):
    """TRL's loss aggregation (f2cd577, lines 3124-3145), one process, one accumulation step: "grpo" the mean of each
    sequence's token mean, "dapo" (TRL's default) the mean over every token of the batch."""
    if loss_type == "grpo":
        return ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    normalizer = mask.sum().clamp(min=1.0)  # num_items_in_batch / num_processes, one process
    return (per_token_loss * mask).sum() / normalizer


def test_trl_loss():
    """grpo_loss is TRL's per-token loss (k3 KL to the reference, the clipped surrogate times the mismatch weights,
    + beta KL), and with equal-length samples TRL's default loss_type "dapo" (a token mean over the batch) and "grpo"
    (1/|o_i| per sequence, as grpo.py's docstring writes it) give grpo_loss's number; with unequal lengths, as an
    LLM's, they differ, which is why grpo_loss's copier's note points at the token mean."""
    logp, old, ref = random_logprobs(4, 6, seed=1)
    logp = old + 0.3 * (logp + 1.5) / 3  # ratios around 1, some past the clip
    A = torch.tensor([1.2, -0.4, 0.7, -1.5])
    w = variants.sampler_correction(old, old - 0.1)
    loss, metrics = grpo.grpo_loss(logp, old, ref, A, 0.2, 0.04, w)
    per_token, kl = trl_per_token_loss(logp, old, ref, A, 0.2, 0.2, 0.04, w)
    mask = torch.ones_like(logp)
    for loss_type in ("dapo", "grpo"):
        assert loss.item() == pytest.approx(trl_aggregate(per_token, mask, loss_type).item(), rel=1e-6), loss_type
    assert metrics["kl"] == pytest.approx(kl.mean().item(), rel=1e-6)  # Schulman's k3, as TRL computes it
    mask[0, 3:] = 0  # a shorter first sample: the two aggregations part
    assert trl_aggregate(per_token, mask, "dapo").item() != pytest.approx(trl_aggregate(per_token, mask, "grpo").item())


def verl_clip_higher_loss(old_log_prob, log_prob, advantages, cliprange_low, cliprange_high):
    """verl's compute_policy_loss_vanilla without dual-clip, transcribed from verl/trainer/ppo/core_algos.py
    (volcengine/verl b178a3c, lines 1195-1222): DAPO's clip-higher, per token."""
    negative_approx_kl = log_prob - old_log_prob
    ratio = torch.exp(negative_approx_kl)
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - cliprange_low, 1 + cliprange_high)
    return torch.maximum(pg_losses1, pg_losses2)


def test_dapo_clip_higher():
    """--clip-eps-high H passes grpo_loss eps = H where A > 0 and eps elsewhere (variants.clip_range): the same loss
    and gradient as verl's and TRL's clamp(r, 1 - eps, 1 + H) on every token (DAPO: eps 0.2, H 0.28)."""
    _, old, _ = random_logprobs(4, 5, seed=2)
    log_ratio = torch.tensor([0.1, 0.2, 0.25, 0.4, -0.3]).repeat(4, 1)  # ratios 0.74 .. 1.49: each clip reached
    logp = (old + log_ratio).requires_grad_()
    A = torch.tensor([1.0, -1.0, 0.5, -2.0])
    ours, _ = grpo.grpo_loss(logp, old, None, A, variants.clip_range(A, 0.2, 0.28), 0.0)
    (ours_grad,) = torch.autograd.grad(ours, logp)
    verl = verl_clip_higher_loss(old, logp, A[:, None], 0.2, 0.28).mean()
    (verl_grad,) = torch.autograd.grad(verl, logp)
    trl = trl_aggregate(trl_per_token_loss(logp, old, old, A, 0.2, 0.28, 0.0, 1.0)[0], torch.ones_like(old), "dapo")
    assert ours.item() == pytest.approx(verl.item(), rel=1e-6) == pytest.approx(trl.item(), rel=1e-6)
    assert torch.allclose(ours_grad, verl_grad, atol=1e-8)
    symmetric, _ = grpo.grpo_loss(logp, old, None, A, 0.2, 0.0)
    assert symmetric.item() != pytest.approx(ours.item())  # the example reaches the upper clip


def test_dr_grpo():
    """--scale-rewards none is Dr. GRPO here: its advantages are R - mean (sail-sg/understand-r1-zero
    train_zero_math.py, lines 286-307: no std), and its other change, each sequence's token sum over a constant
    (generate_max_length) instead of over |o_i|, is already grpo_loss's 1/T when every sample has T tokens."""
    reward = torch.tensor([[0.2, 0.9, 0.4, 0.4], [1.0, 3.0, 2.0, 6.0]])
    z = grpo.group_advantages(reward)
    rewards = reward.flatten()
    values = rewards.view(-1, 4).mean(dim=1).repeat_interleave(4)  # oat's MC baseline: the group mean
    dr_grpo = (rewards - values).view(2, 4)
    assert torch.allclose(variants.rescaled(z, reward, "none"), dr_grpo, atol=1e-6)
    logp, old, _ = random_logprobs(8, 5, seed=3)
    A = dr_grpo.flatten()
    per_token = -torch.min(torch.exp(logp - old) * A[:, None],
                           torch.clamp(torch.exp(logp - old), 0.8, 1.2) * A[:, None])
    generate_max_length = 5  # every sample fills the same grid: |o_i| = T = the maximum length
    dr_loss = ((per_token.sum(dim=1)) / generate_max_length).mean()  # oat's masked_sum, then the batch mean
    assert grpo.grpo_loss(logp, old, None, A, 0.2, 0.0)[0].item() == pytest.approx(dr_loss.item(), rel=1e-6)


def trl_advantages(rewards):
    """TRL's default advantages (scale_rewards "group"), transcribed from trl/trainer/grpo_trainer.py (f2cd577): the
    group mean subtracted, divided by the group's sample std (torch.std, / G - 1) plus 1e-4."""
    mean_grouped_rewards = rewards.mean(dim=1, keepdim=True)
    std_rewards = rewards.std(dim=1, keepdim=True)
    return (rewards - mean_grouped_rewards) / (std_rewards + 1e-4)


def test_trl_group_std():
    """grpo.group_advantages divides by the population std (/ G); TRL's default by the sample std (/ G - 1) + 1e-4.
    Where the std is well above 1e-4, TRL's advantages are sqrt((G - 1) / G) of ours (1.07x smaller at G = 8); at a
    spread near 1e-4 or below, TRL's 1e-4 shrinks them toward 0 while ours stay z-scores: one reward of 8 above the
    others by 1e-5, near 0.9, gets 2.63 here and 0.084 in TRL (README's step 4)."""
    g = torch.Generator().manual_seed(4)
    reward = torch.rand(3, 8, generator=g)
    ratio = grpo.group_advantages(reward) / trl_advantages(reward)
    assert torch.allclose(ratio, torch.full_like(ratio, math.sqrt(8 / 7)), rtol=1e-3)
    assert math.sqrt(8 / 7) == pytest.approx(1.069, abs=1e-3)
    tiny = torch.tensor([[0.9] * 7 + [0.9 + 1e-5]])  # a spread of 1e-5
    assert grpo.group_advantages(tiny).max().item() == pytest.approx(2.63, abs=0.01)
    assert trl_advantages(tiny).max().item() == pytest.approx(0.084, abs=0.001)


def test_schulman_k3_unbiased():
    """Schulman's k3, r - 1 - log r with r = ref / pi, averaged over tokens drawn from pi, estimates KL(pi || ref)
    without bias (the mean of 200k draws within 3 standard errors); drawn from another distribution (pi_old at a later
    update, or a top-p nucleus) it does not."""
    g = torch.Generator().manual_seed(5)
    pi = torch.softmax(torch.randn(6, generator=g), 0)
    ref = torch.softmax(torch.randn(6, generator=g), 0)
    exact = (pi * (pi / ref).log()).sum().item()
    draws = torch.multinomial(pi, 200_000, replacement=True, generator=g)
    d = ref.log()[draws] - pi.log()[draws]
    k3 = torch.exp(d) - d - 1  # grpo_loss's kl, per token
    assert abs(k3.mean().item() - exact) < 3 * k3.std().item() / math.sqrt(len(k3))
    other = torch.softmax(torch.randn(6, generator=g), 0)
    elsewhere = torch.multinomial(other, 200_000, replacement=True, generator=g)
    d = ref.log()[elsewhere] - pi.log()[elsewhere]
    assert abs((torch.exp(d) - d - 1).mean().item() - exact) > 0.05


def test_transformers_warpers():
    """grpo.code_logprobs' top-k and top-p cut the codes as transformers' TopKLogitsWarper and TopPLogitsWarper do
    (the same codes kept, ties and the always-kept most likely code included), then renormalise."""
    from transformers import TopKLogitsWarper, TopPLogitsWarper
    g = torch.Generator().manual_seed(6)
    logits = torch.randn(5, 40, generator=g) * 2
    logits[0, :4] = 3.0  # ties at the top
    for top_k, top_p in [(7, 1.0), (0, 0.75), (0, 0.3), (0, 0.999), (12, 0.6)]:
        scores = logits / 0.9
        if top_k:
            scores = TopKLogitsWarper(top_k)(None, scores)
        if top_p < 1:
            scores = TopPLogitsWarper(top_p)(None, scores)
        want = torch.log_softmax(scores, dim=-1)
        got = grpo.code_logprobs(logits, 0.9, 40, top_k, top_p)
        assert torch.equal(got.isfinite(), want.isfinite()), (top_k, top_p)
        assert torch.allclose(got[got.isfinite()], want[want.isfinite()], atol=1e-6), (top_k, top_p)


def test_k3_gradient():
    """grpo_loss's KL term (k3, on tokens drawn from pi) has, in expectation, the gradient of KL(ref || pi) with
    respect to pi's logits: sum_x pi(x) d k3(x) = sum_x (pi - ref)(x) d log pi(x) = d KL(ref || pi)."""
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(6, generator=g, requires_grad=True)
    ref = torch.softmax(torch.randn(6, generator=g), 0)
    logp = torch.log_softmax(logits, 0)
    d = ref.log() - logp
    k3 = torch.exp(d) - d - 1  # every code's k3; the expectation weighs it by pi, held fixed (the draws)
    (expected,) = torch.autograd.grad((logp.exp().detach() * k3).sum(), logits)
    kl_ref_pi = (ref * (ref.log() - torch.log_softmax(logits, 0))).sum()
    (want,) = torch.autograd.grad(kl_ref_pi, logits)
    assert torch.allclose(expected, want, atol=1e-6)
    kl_pi_ref = (torch.softmax(logits, 0) * (torch.log_softmax(logits, 0) - ref.log())).sum()
    (other,) = torch.autograd.grad(kl_pi_ref, logits)
    assert not torch.allclose(expected, other, atol=1e-3)  # not KL(pi || ref)'s


def verl_k3_kl(old_log_prob, rollout_log_prob, response_mask):
    """verl's `rollout_corr/k3_kl`, transcribed from verl/trainer/ppo/rollout_corr_helper.py (volcengine/verl 0b4e2a8,
    compute_offpolicy_metrics, 2b; verl_F.masked_mean(x, mask) of verl/utils/torch_functional.py is
    (x * mask).sum() / (mask.sum() + 1e-8)): old_log_prob the trainer's, rollout_log_prob the sampler's."""
    log_ratio = old_log_prob - rollout_log_prob
    k3_kl_matrix = torch.exp(log_ratio) - log_ratio - 1
    return ((k3_kl_matrix * response_mask).sum() / (response_mask.sum() + 1e-8)).item()


def test_verl_k3_kl():
    """helpers/diagnostics.mismatch's `sampling/k3_kl` is verl's `rollout_corr/k3_kl` (docs/real_model.md,
    docs/healthy_training.md): the k3 of KL(sampler || trainer) over the tokens, the trainer's log-prob minus the
    sampler's in the exponent, not the reverse."""
    from helpers import diagnostics
    old, sampled, _ = random_logprobs(4, 6, seed=3)
    ours = diagnostics.mismatch(old, sampled, "token_truncate", 2.0, grpo)["sampling/k3_kl"]
    assert ours == pytest.approx(verl_k3_kl(old, sampled, torch.ones_like(old)), rel=1e-6)
    assert ours != pytest.approx(verl_k3_kl(sampled, old, torch.ones_like(old)), rel=1e-3)  # the direction matters


# ---- docs/claims.md's quotes, against the files they cite (text only) ----------------------------------------------

CLAIMS = Path(__file__).resolve().parent.parent / "docs" / "claims.md"
PLACE = re.compile(r"([\w./-]+\.(?:md|py|yaml))((?::\d+(?:-\d+)?(?:, \d+(?:-\d+)?)*)?)")  # path[:LINE[-END][, LINE]]


def normalised(text: str, python: bool = False) -> tuple[str, list[int], list[int]]:
    """`text` as claims.md's quotes are compared with it: markdown's `**`, backticks and `#` dropped, `\\|` read as `|`,
    each run of whitespace one space; `python`: adjacent string literals joined (`"a " "b"` reads `a b`), so that a
    help string split over lines reads whole. Returns the text and, for the line lookup, the offsets at which its
    stretches start and each stretch's line (a stretch never spans a line break)."""
    out, starts, lines = [], [], []
    size, line, pos, space = 0, 1, 0, True
    for m in re.finditer(r'\*\*|`|#|\\\||\s+' + (r'|"\s*f?"' if python else ""), text):
        piece = text[pos:m.start()] + ("|" if m.group() == "\\|" else "")
        if piece:
            starts.append(size)
            lines.append(line)
            out.append(piece)
            size, space = size + len(piece), False
        if m.group()[0].isspace() and not space:
            out.append(" ")
            size, space = size + 1, True
        line, pos = line + m.group().count("\n"), m.end()
    starts.append(size)
    lines.append(line)
    out.append(text[pos:])
    return "".join(out), starts, lines


def claimed_quotes(sentence: str) -> list[list[str]]:
    """A row's "the sentence" cell -> its quotes, each as its verbatim fragments: the stretches between `...` of 8
    characters or more, normalised. Quotes are separated by `"; "` (or `", "`, `" / "`); a row that gives an earlier
    wording (`was: "..."; now: "..."`) is read from `now:` on."""
    if "now:" in sentence:
        sentence = sentence.split("now:", 1)[1]
    if sentence.count('"') < 2:
        return []
    inner = sentence[sentence.index('"') + 1:sentence.rindex('"')]
    return [[f for f in (normalised(part)[0].strip() for part in re.split(r"\.\.\.|…", quote)) if len(f) >= 8]
            for quote in re.split(r'"\s*[;,/]\s*"', inner)]


def occurrences(versions: list, fragments: list[str]) -> list[tuple[int, int, int]]:
    """Each place where `fragments` occur in order, as (first line, last line, length), in the first of a file's
    normalised `versions` that has one."""
    found = []
    for text, starts, lines in versions:
        begin = text.find(fragments[0])
        while begin >= 0:
            end = begin + len(fragments[0])
            for fragment in fragments[1:]:
                at = text.find(fragment, end)
                end = -1 if at < 0 else at + len(fragment)
                if end < 0:
                    break
            if end >= 0:
                found.append((lines[bisect_right(starts, begin) - 1], lines[bisect_right(starts, end - 1) - 1],
                              end - begin))
            begin = text.find(fragments[0], begin + 1)
        if found:
            return found
    return found


def test_claims_quotes_are_in_their_files():
    """Every quoted sentence of docs/claims.md is where its row says: each fragment of the quote (between `...`) in
    each file the row's `where` cites, in order, the first starting at the cited line; a `LINE-END` place's quotes
    all within its lines, the last ending at END.
    Quotes and places pair up in order when a row has as many of each; one quote holds at each place; several quotes
    of one place all hold in its file, the first at its line. A failure names the row and the line to write
    (`python tools/fix_claims.py` writes them)."""
    checked, wrong = claim_problems()
    assert checked > 100
    assert not wrong, "stale quotes or lines in docs/claims.md:\n" + "\n".join(wrong)


def claim_problems() -> tuple[int, list[str]]:
    """(the quotes checked, a line for each quote not where its row says)."""
    root, files, wrong, checked = CLAIMS.parent.parent, {}, [], 0
    for number, row in enumerate(CLAIMS.read_text().splitlines(), 1):
        cells = [cell.strip() for cell in re.split(r"(?<!\\)\|", row)[1:-1]]
        if not row.startswith("| ") or len(cells) < 4 or cells[0] == "where" or not cells[0].strip("-"):
            continue
        places = [(m.group(1), *((int(n.split("-")[0]), int(n.split("-")[1]) if "-" in n else None) if n else (None, None)))
                  for m in PLACE.finditer(cells[0]) for n in (m.group(2)[1:].split(", ") if m.group(2) else [""])]
        quotes = claimed_quotes(cells[1])
        if not places or not quotes:
            continue
        if len(quotes) == len(places) or len(quotes) == 1:  # (quote, path, its first line, the place's span)
            pairs = [(quote, path, line, line, last) for quote, (path, line, last) in
                     (zip(quotes, places) if len(quotes) == len(places) else ((quotes[0], p) for p in places))]
        elif len(places) == 1:  # several quotes of one place: the first at its line, all within its span
            path, line, last = places[0]
            pairs = [(quote, path, line if i == 0 else None, line, last) for i, quote in enumerate(quotes)]
        else:
            wrong.append(f"docs/claims.md:{number}: {len(quotes)} quotes for {len(places)} places (give one place, "
                         f"one quote, or as many places as quotes)")
            continue
        for i, (fragments, path, line, low, last) in enumerate(pairs):
            if not fragments:
                wrong.append(f"docs/claims.md:{number}: a quote without 8 verbatim characters to look for")
                continue
            if path not in files:
                text = (root / path).read_text() if (root / path).is_file() else None
                files[path] = text and [normalised(text)] + ([normalised(text, True)] if path.endswith(".py") else [])
            if not files[path]:
                wrong.append(f"docs/claims.md:{number}: {path} does not exist")
                continue
            checked += 1
            found = occurrences(files[path], fragments)
            final = i == len(pairs) - 1 or pairs[i + 1][1:] != (path, None, low, last)  # the place's last quote
            if not found:
                missing = [f for f in fragments if not any(f in text for text, _, _ in files[path])]
                wrong.append(f"docs/claims.md:{number}: not in {path}: "
                             + (repr(missing[0]) if missing else "the fragments, but not in this order"))
            elif line is not None and not any(start == line for start, _, _ in found):
                start, end, _ = min(found, key=lambda f: (f[2], abs(f[0] - line)))
                wrong.append(f"docs/claims.md:{number}: {path}:{line} should be {path}:{start}"
                             + (f" (the quote ends at line {end})" if end > start else ""))
            elif last is not None and not any((start == line if line else start >= low) and end <= last
                                              and (end == last or not final) for start, end, _ in found):
                end = min((end for start, end, _ in found if (start == line if line else start >= low)),
                          default=None)
                wrong.append(f"docs/claims.md:{number}: {path}:{low}-{last} should be {path}:{low}-{end} (where its "
                             f"{'last ' if line is None else ''}quote ends)" if end else
                             f"docs/claims.md:{number}: a quote of {path}:{low}-{last} is not within those lines")
    return checked, wrong

