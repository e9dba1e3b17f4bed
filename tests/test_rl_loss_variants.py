"""GSPO and CISPO (rl/loss.py, algorithm.policy_loss) against plain float64 transcriptions of their papers'
formulas, values and gradients, on awkward rows: fully masked, one token long, ratios far outside the clip on
both sides, advantages of both signs, token weights; their clip statistics; and the configuration switch.

The references are written from the papers, token by token in Python loops:
- GSPO, arXiv 2507.18071: the sequence objective min(s_i A_i, clip(s_i, 1 - eps_low, 1 + eps_high) A_i),
  s_i = (pi(o_i) / pi_old(o_i))^(1 / |o_i|), averaged over the group's sequences; and its GSPO-token form with
  s_{i,t} = sg[s_i] pi_t / sg[pi_t], whose value is s_i and whose gradient at one advantage per sequence equals
  the sequence objective's (the paper's claim, checked below).
- CISPO, arXiv 2506.13585 (MiniMax-M1): sum_{i,t} sg(clip(r_{i,t}, 1 - eps_low, 1 + eps_high)) A_{i,t}
  log pi_{i,t} / sum_i |o_i|.
verl's compute_policy_loss_gspo and compute_policy_loss_cispo (verl/trainer/ppo/core_algos.py) compute the same
per-token terms; the references here do not follow their code.
"""

import math

import pytest
import torch

import train
from config import ConfigError, load_config
from rl.loss import AGG_MODES, POLICY_LOSSES
from tests.loss_calls import loss_with

EPS64 = torch.finfo(torch.float64).eps
# Rows of the awkward batch: the log-ratios of its valid tokens (LOG_RATIOS) and its advantage; width 5.
#   0: a one-token response, ratio e^3 far above the clip, A > 0      1: fully masked (overlong-filtered)
#   2: ratios far below the clip (e^-3), A < 0                         3: ratios on both sides of 1, A < 0
#   4: ratios e^+-3 that average near 1, A > 0                          5: ratio e^2.5 above the clip, A < 0
LOG_RATIOS = [[3.0], [], [-3.0, -2.5, -3.2], [0.4, -0.3, 0.2, 0.1, -0.05], [3.0, -3.0, 2.9, -2.8], [2.5, 2.4]]
ROW_ADVANTAGES = [1.5, 0.7, -1.2, -0.8, 2.0, -2.5]
WIDTH = 5


def awkward_batch(per_token_advantages=False, seed=0):
    """logp [6, 5] (with a gradient), old_logp, advantages, mask and token weights; NaN in the padding of logp."""
    gen = torch.Generator().manual_seed(seed)
    rows = len(LOG_RATIOS)
    old_logp = -torch.rand(rows, WIDTH, generator=gen, dtype=torch.float64) * 4 - 0.05
    logp = torch.full((rows, WIDTH), math.nan, dtype=torch.float64)  # padding garbage must not reach anything
    mask = torch.zeros(rows, WIDTH, dtype=torch.bool)
    for i, ratios in enumerate(LOG_RATIOS):
        for t, log_ratio in enumerate(ratios):
            logp[i, t] = old_logp[i, t] + log_ratio
            mask[i, t] = True
    advantages = torch.tensor(ROW_ADVANTAGES, dtype=torch.float64)[:, None].expand(rows, WIDTH).clone()
    if per_token_advantages:
        advantages *= torch.rand(rows, WIDTH, generator=gen, dtype=torch.float64) + 0.5
    weights = torch.rand(rows, WIDTH, generator=gen, dtype=torch.float64) + 0.5
    return logp.requires_grad_(), old_logp, advantages, mask, weights


def valid_tokens(mask, i):
    return [t for t in range(mask.shape[1]) if mask[i, t]]


def gspo_sequence_objective_loss(logp, old_logp, advantages, mask, eps_low, eps_high):
    """-J_GSPO, the mean over the sequences that have a token of min(s_i A_i, clip(s_i) A_i), and those terms."""
    terms = []
    for i in range(logp.shape[0]):
        tokens = valid_tokens(mask, i)
        if not tokens:
            continue
        log_s = sum(logp[i, t] - old_logp[i, t] for t in tokens) / len(tokens)  # log of the |o_i|-th root
        s = torch.exp(log_s)
        a = advantages[i, tokens[0]]
        terms.append(torch.minimum(s * a, torch.clamp(s, 1 - eps_low, 1 + eps_high) * a))
    return -sum(terms) / len(terms), terms


def gspo_token_losses(logp, old_logp, advantages, mask, eps_low, eps_high, weights=None):
    """GSPO-token: {(i, t): -min(s_{i,t} A_{i,t}, clip(s_{i,t}) A_{i,t}) w_{i,t}} over the valid tokens."""
    losses = {}
    for i in range(logp.shape[0]):
        tokens = valid_tokens(mask, i)
        if not tokens:
            continue
        log_s = sum(logp[i, t] - old_logp[i, t] for t in tokens) / len(tokens)
        for t in tokens:
            s_it = torch.exp(log_s.detach() + logp[i, t] - logp[i, t].detach())
            a = advantages[i, t]
            loss = -torch.minimum(s_it * a, torch.clamp(s_it, 1 - eps_low, 1 + eps_high) * a)
            losses[i, t] = loss * (1.0 if weights is None else weights[i, t])
    return losses


def cispo_token_losses(logp, old_logp, advantages, mask, eps_low, eps_high, weights=None):
    """{(i, t): -sg(clip(r_{i,t}, 1 - eps_low, 1 + eps_high)) A_{i,t} log pi_{i,t} w_{i,t}} over the valid tokens."""
    losses = {}
    for i in range(logp.shape[0]):
        for t in valid_tokens(mask, i):
            r = torch.exp(logp[i, t] - old_logp[i, t])
            weight = torch.clamp(r, 1 - eps_low, 1 + eps_high).detach()
            losses[i, t] = -weight * advantages[i, t] * logp[i, t] * (1.0 if weights is None else weights[i, t])
    return losses


def aggregate(losses, agg):
    """token-mean (MiniMax-M1: over all the tokens) or seq-mean-token-mean, over the valid tokens."""
    if agg == "token-mean":
        return sum(losses.values()) / len(losses)
    rows = {}
    for (i, _), loss in losses.items():
        rows.setdefault(i, []).append(loss)
    return sum(sum(row) / len(row) for row in rows.values()) / len(rows)


REFERENCES = {"gspo": gspo_token_losses, "cispo": cispo_token_losses}


def check_close(ours, reference, terms, logp):
    """Loss and gradient agree. Both sides compute each token's term as a product of float64 factors, one of them
    exp of a row's mean log-ratio (at most WIDTH terms, |log r| <= 3.2), in another order: each term, and each
    gradient entry (a product too: every token's gradient comes from one term, or from its row's one ratio),
    differs by less than 2 (WIDTH x 3.2 + 16) eps64 < 64 eps64 relative; the loss sums the terms (its
    rounding below len(terms) eps64 x the sum of their sizes). 128 eps64 (relative) leaves a factor of 2."""
    grad_ours = torch.autograd.grad(ours, logp, retain_graph=True)[0]
    grad_ref = torch.autograd.grad(reference, logp)[0]
    size = sum(abs(term.item()) for term in terms)
    assert ours.item() == pytest.approx(reference.item(), rel=0, abs=(128 + len(terms)) * EPS64 * size)
    assert ((grad_ours - grad_ref).abs() <= 128 * EPS64 * grad_ref.abs()).all()
    return grad_ours


@pytest.mark.parametrize("variant", ["gspo", "cispo"])
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("with_weights", [False, True])
@pytest.mark.parametrize("clips", [(0.2, 0.28), (3e-4, 4e-4), (0.999, 0.28)])
def test_each_variant_equals_its_papers_formula(variant, agg, with_weights, clips):
    logp, old_logp, advantages, mask, weights = awkward_batch(per_token_advantages=True)
    token_weights = weights if with_weights else None
    eps_low, eps_high = clips
    ours, _ = loss_with(
        logp, old_logp, advantages, mask, clip_low=eps_low, clip_high=eps_high, agg=agg, token_weights=token_weights,
        variant=variant,
    )  # fmt: skip
    terms = REFERENCES[variant](logp, old_logp, advantages, mask, eps_low, eps_high, token_weights)
    grad = check_close(ours, aggregate(terms, agg), list(terms.values()), logp)
    assert grad[1].abs().max() == 0 and grad[~mask].abs().max() == 0  # masked rows and padding: no gradient
    assert grad.abs().max() > 1e-3


@pytest.mark.parametrize("clips", [(0.2, 0.28), (3e-4, 4e-4)])
def test_gspo_with_the_sequence_mean_is_the_papers_sequence_objective(clips):
    # One advantage per response: GSPO-token's loss and gradient are the sequence objective's (the paper).
    logp, old_logp, advantages, mask, _ = awkward_batch()
    ours, _ = loss_with(
        logp, old_logp, advantages, mask, clip_low=clips[0], clip_high=clips[1], agg="seq-mean-token-mean",
        variant="gspo",
    )  # fmt: skip
    reference, terms = gspo_sequence_objective_loss(logp, old_logp, advantages, mask, *clips)
    check_close(ours, reference, terms, logp)


def test_a_clipped_sequence_gives_no_gradient_in_gspo_and_every_token_one_in_cispo():
    logp, old_logp, advantages, mask, _ = awkward_batch()
    grads = {}
    for variant in POLICY_LOSSES:
        loss, _ = loss_with(logp, old_logp, advantages, mask, variant=variant)
        grads[variant] = torch.autograd.grad(loss, logp)[0]
    assert grads["dapo"][0, 0] == 0 and grads["gspo"][0, 0] == 0  # above 1 + eps_high with A > 0: clipped out
    assert (grads["cispo"][mask] != 0).all()  # CISPO drops no token's gradient
    # Row 4: its tokens' ratios e^+-3 are far outside the clip one by one, but their mean log-ratio is 0.025: GSPO
    # keeps all four tokens, DAPO drops the two above 1 + eps_high.
    assert (grads["gspo"][4, :4] != 0).all() and (grads["dapo"][4, [0, 2]] == 0).all()


def test_dual_clip_constant_does_not_change_gspo_or_cispo():
    logp, old_logp, advantages, mask, weights = awkward_batch()
    for variant in ("gspo", "cispo"):
        runs = [
            loss_with(logp, old_logp, advantages, mask, clip_c=c, token_weights=weights, variant=variant)
            for c in (None, 1.01, 10.0)
        ]
        assert all(torch.equal(loss, runs[0][0]) for loss, _ in runs)
        assert all(stats.pg_clipfrac_lower.result() == 0 for _, stats in runs)


def test_clip_statistics():
    logp, old_logp, advantages, mask, _ = awkward_batch()
    _, gspo = loss_with(logp, old_logp, advantages, mask, variant="gspo")
    _, cispo = loss_with(logp, old_logp, advantages, mask, variant="cispo")
    # GSPO, eps 0.2 / 0.28, 15 valid tokens: row 0 (s = e^3, A > 0) clipped above, row 2 (s = e^-2.9, A < 0)
    # clipped below (3 tokens); row 5 (s = e^2.45, A < 0): the unclipped side binds; rows 3, 4: s within the range.
    assert gspo.pg_clipfrac.result() == pytest.approx(4 / 15, rel=1e-12)
    assert gspo.pg_clipfrac_upper.result() == pytest.approx(1 / 15, rel=1e-12)
    assert gspo.first_token_upper.result() == pytest.approx(1 / 5, rel=1e-12)  # 5 rows have a first token
    assert gspo.ratio_max == pytest.approx(math.exp(3.0), rel=1e-12)
    # CISPO: each token whose ratio lies outside [0.8, 1.28], whatever A's sign. Above: row 0's one, row 3's e^0.4,
    # row 4's e^3 and e^2.9, row 5's two (6); below: row 2's three, row 3's e^-0.3, row 4's e^-3 and e^-2.8 (6).
    assert cispo.pg_clipfrac.result() == pytest.approx(12 / 15, rel=1e-12)
    assert cispo.pg_clipfrac_upper.result() == pytest.approx(6 / 15, rel=1e-12)
    assert cispo.first_token_upper.result() == pytest.approx(4 / 5, rel=1e-12)  # rows 0, 3, 4, 5
    assert cispo.ratio_max == pytest.approx(math.exp(3.0), rel=1e-12)
    assert gspo.pg_clipfrac_lower.result() == cispo.pg_clipfrac_lower.result() == 0  # no dual clip
    for stats in (gspo, cispo):
        ppo_kl = -sum(sum(ratios) for ratios in LOG_RATIOS) / 15
        assert stats.ppo_kl.result() == pytest.approx(ppo_kl, rel=1e-9)  # the token-level estimate, as DAPO's
        assert (stats.num_tokens, stats.num_nonempty_seqs) == (15, 5)


def test_an_unknown_variant_is_refused():
    logp, old_logp, advantages, mask, _ = awkward_batch()
    with pytest.raises(ValueError, match=r"policy_loss: unknown variant 'ppo'; choose one of \('dapo', 'gspo'"):
        loss_with(logp, old_logp, advantages, mask, variant="ppo")


@pytest.mark.parametrize("agg", AGG_MODES)
def test_every_aggregation_runs_each_variant_with_a_finite_gradient(agg):
    logp, old_logp, advantages, mask, weights = awkward_batch()
    extra = {"group_ids": torch.tensor([0, 0, 1, 1, 2, 2])} if agg == "group-token-mean" else {}
    for variant in ("gspo", "cispo"):
        loss, _ = loss_with(logp, old_logp, advantages, mask, agg=agg, token_weights=weights, variant=variant, **extra)
        grad = torch.autograd.grad(loss, logp)[0]
        assert torch.isfinite(loss) and torch.isfinite(grad).all() and grad.abs().max() > 1e-3


# -- the switch --------------------------------------------------------------------------------------


def test_the_switch_defaults_to_dapo_and_takes_each_variant():
    assert load_config(None, []).algorithm.policy_loss == "dapo"
    for variant in POLICY_LOSSES:
        assert load_config(None, [f"algorithm.policy_loss={variant}"]).algorithm.policy_loss == variant
    with pytest.raises(ConfigError, match=r"algorithm\.policy_loss = 'ppo' \(command line\): unknown value"):
        load_config(None, ["algorithm.policy_loss=ppo"])


def test_train_refuses_an_unknown_policy_loss_in_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        train.run_cli(["--config", "configs/demo_cpu.toml", "--algorithm.policy_loss=ppo", f"--job.run_dir={tmp_path}"])
    err = capsys.readouterr().err.strip()
    assert info.value.code == 2 and len(err.splitlines()) == 1, err
    assert "algorithm.policy_loss = 'ppo'" in err and "'dapo', 'gspo', 'cispo'" in err, err
