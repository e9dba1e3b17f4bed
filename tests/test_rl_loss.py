"""Policy loss (Eq. 8, 10): hand-computed values per aggregation mode, metrics, gradient, global
normalisation invariance under micro-batching and data-parallel splits, and property tests."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rl.loss import AGG_MODES, POLICY_LOSSES
from tests.loss_calls import loss_with

# Hand example. Ratios r, advantages A (one per row), mask; eps_low 0.2, eps_high 0.28, c = 10.
#   row 0, A = +1:  r 1.5 -> max(-1.5, -1.28) = -1.28 (clipped)   r 0.5 -> -0.5   r 1 -> -1
#   row 1, A = -2:  r 0.7 -> max(1.4, 1.6) = 1.6 (clipped)   r 20 -> max(40, 2.56) = 40, dual clip
#                   min(40, 2 * 10) = 20   r 1.1 masked
#   row 2, A = 0.5: r 1 -> -0.5   (r 3, r 1 masked)
# Valid per-token losses: [-1.28, -0.5, -1], [1.6, 20], [-0.5]; total 18.32 over 6 tokens.
RATIOS = [[1.5, 0.5, 1.0], [0.7, 20.0, 1.1], [1.0, 3.0, 1.0]]
ADVANTAGES = [1.0, -2.0, 0.5]
MASK = [[1, 1, 1], [1, 1, 0], [1, 0, 0]]


def hand_example(dtype=torch.float64):
    old_logp = torch.full((3, 3), -2.0, dtype=dtype)
    logp = (old_logp + torch.tensor(RATIOS, dtype=dtype).log()).requires_grad_()
    advantages = torch.tensor(ADVANTAGES, dtype=dtype)[:, None].expand(3, 3)
    return logp, old_logp, advantages, torch.tensor(MASK)


@pytest.mark.parametrize(
    "agg, kwargs, expected",
    [
        ("token-mean", {}, 18.32 / 6),
        ("seq-mean-token-mean", {}, (-2.78 / 3 + 21.6 / 2 - 0.5 / 1) / 3),
        ("seq-mean-token-sum", {}, 18.32 / 3),
        ("seq-mean-token-sum-norm", {}, 18.32 / 3),  # no sequence average; norm_len defaults to T = 3
        ("seq-mean-token-sum-norm", {"norm_len": 4}, 18.32 / 4),
        # groups {0, 2} and {1}: (-3.28 / 4 + 21.6 / 2) / 2
        ("group-token-mean", {"group_ids": torch.tensor([0, 1, 0])}, (-0.82 + 10.8) / 2),
        ("token-mean", {"global_num_tokens": 12}, 18.32 / 12),
        ("token-mean", {"global_num_tokens": torch.tensor(12)}, 18.32 / 12),
        ("seq-mean-token-sum", {"global_num_seqs": 6}, 18.32 / 6),
        ("seq-mean-token-mean", {"global_num_seqs": 6}, (-2.78 / 3 + 21.6 / 2 - 0.5) / 6),
        ("seq-mean-token-sum-norm", {"global_num_seqs": 6, "norm_len": 10}, 18.32 / 10),  # needs no count
        (
            "group-token-mean",
            {"group_ids": torch.tensor([0, 1, 0]), "group_num_tokens": torch.tensor([8, 4, 8]), "global_num_groups": 5},
            (-3.28 / 8 + 21.6 / 4) / 5,
        ),
    ],
)
def test_hand_computed_aggregation(agg, kwargs, expected):
    logp, old_logp, advantages, mask = hand_example()
    loss, _ = loss_with(logp, old_logp, advantages, mask, agg=agg, **kwargs)
    assert loss.item() == pytest.approx(expected, rel=1e-12)


def test_hand_computed_metrics():
    loss, metrics = loss_with(*hand_example())
    assert metrics.pg_clipfrac.result() == pytest.approx(2 / 6)  # r 1.5 (A > 0) and r 0.7 (A < 0)
    assert metrics.pg_clipfrac_lower.result() == pytest.approx(1 / 6)  # r 20 with A < 0
    # Clipped at the upper bound: only r 1.5 with A > 0 (r 3 is masked); its pi_old probability is e^-2.
    assert metrics.pg_clipfrac_upper.result() == pytest.approx(1 / 6)
    assert metrics.clipped_upper_prob.result() == pytest.approx(math.exp(-2.0), rel=1e-12)
    assert metrics.ppo_kl.result() == pytest.approx(-math.log(1.5 * 0.5 * 0.7 * 20) / 6)
    assert metrics.ratio_max == pytest.approx(20.0)
    assert metrics.num_tokens == 6 and metrics.num_nonempty_seqs == 3
    # The responses' first tokens (column 0): r 1.5 with A > 0 is clipped at the upper bound; r 0.7 (A < 0) at the
    # lower one, r 1 not at all.
    assert metrics.first_token_upper.result() == pytest.approx(1 / 3)


def test_hand_computed_gradient():
    logp, old_logp, advantages, mask = hand_example()
    loss, _ = loss_with(logp, old_logp, advantages, mask)
    loss.backward()
    # d/dlogp of -A r is -A r where the unclipped term is active; clipped, dual-clipped and masked
    # tokens get no gradient; token-mean divides by 6.
    expected = torch.tensor([[0.0, -0.5 / 6, -1 / 6], [0.0, 0.0, 0.0], [-0.5 / 6, 0.0, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(logp.grad, expected, rtol=0, atol=1e-12)


def test_dual_clip_and_clip_higher_switches():
    loss, metrics = loss_with(*hand_example(), clip_c=None)  # r 20 token keeps its loss of 40
    assert loss.item() == pytest.approx(38.32 / 6) and metrics.pg_clipfrac_lower.result() == 0
    loss, _ = loss_with(*hand_example(), clip_c=3.0)  # dual clip at 2 * 3 = 6
    assert loss.item() == pytest.approx((18.32 - 20 + 6) / 6)
    loss, _ = loss_with(*hand_example(), clip_high=0.2)  # symmetric clip: r 1.5 -> -1.2
    assert loss.item() == pytest.approx((18.32 + 0.08) / 6)
    _, metrics = loss_with(*hand_example(), clip_high=0.6)  # r 1.5 is inside [0.8, 1.6]: nothing up-clipped
    assert metrics.pg_clipfrac_upper.result() == 0 and math.isnan(metrics.clipped_upper_prob.result())  # none: no mean
    assert metrics.first_token_upper.result() == 0


def test_token_weights_multiply_the_per_token_loss():
    weights = torch.tensor([[2.0, 1.0, 1.0], [0.5, 1.0, 1.0], [1.0, 1.0, 1.0]], dtype=torch.float64)
    loss, metrics = loss_with(*hand_example(), token_weights=weights)
    assert loss.item() == pytest.approx((-2.56 - 0.5 - 1.0 + 0.8 + 20.0 - 0.5) / 6)
    assert metrics.pg_clipfrac.result() == pytest.approx(2 / 6)  # metrics ignore the weights


def test_fully_masked_rows_and_groups_are_not_counted():
    # The hand example plus row 3, fully masked (an overlong-filtered sample), alone in group 2.
    logp, old_logp, advantages, mask = hand_example()
    logp4 = torch.cat([logp.detach(), torch.zeros(1, 3, dtype=torch.float64)])
    old4 = torch.cat([old_logp, torch.zeros(1, 3, dtype=torch.float64)])
    adv4 = torch.cat([advantages, torch.ones(1, 3, dtype=torch.float64)])
    mask4 = torch.cat([mask, torch.zeros(1, 3, dtype=mask.dtype)])
    expect = {
        "token-mean": 18.32 / 6,
        "seq-mean-token-mean": (-2.78 / 3 + 21.6 / 2 - 0.5) / 3,  # 3 rows with tokens, not 4
        "seq-mean-token-sum": 18.32 / 3,
        "seq-mean-token-sum-norm": 18.32 / 3,  # sum / T, no row count at all
        "group-token-mean": (-3.28 / 4 + 21.6 / 2) / 2,  # groups {0, 2}, {1}; group 2 has no token
    }
    for agg, value in expect.items():
        loss, metrics = loss_with(logp4, old4, adv4, mask4, agg=agg, group_ids=torch.tensor([0, 1, 0, 2]))
        assert loss.item() == pytest.approx(value, rel=1e-12), agg
    assert metrics.num_nonempty_seqs == 3


def test_empty_mask_gives_zero_loss_and_zero_metrics():
    logp = torch.randn(2, 4, requires_grad=True)
    for agg in AGG_MODES:
        kwargs = {"group_ids": torch.tensor([0, 1])} if agg == "group-token-mean" else {}
        loss, metrics = loss_with(logp, logp.detach() + 1, torch.ones(2, 4), torch.zeros(2, 4), agg=agg, **kwargs)
        loss.backward()
        assert loss.item() == 0 and torch.equal(logp.grad, torch.zeros(2, 4))
        assert math.isnan(metrics.pg_clipfrac.result()) and metrics.ratio_max == 0  # no valid token: no share
        logp.grad = None


def test_garbage_in_masked_positions_does_not_leak():
    logp, old_logp, advantages, mask = hand_example()
    valid = mask.bool()
    dirty_logp = torch.where(valid, logp.detach(), float("nan")).requires_grad_()
    dirty_old = torch.where(valid, old_logp, float("-inf"))
    dirty_adv = torch.where(valid, advantages, float("inf"))
    loss, metrics = loss_with(dirty_logp, dirty_old, dirty_adv, mask)
    loss.backward()
    assert loss.item() == pytest.approx(18.32 / 6) and torch.isfinite(dirty_logp.grad).all()
    assert metrics.ppo_kl.result() == pytest.approx(-math.log(10.5) / 6)


def test_low_precision_inputs_are_computed_in_float32():
    logp, old_logp, advantages, mask = hand_example(torch.bfloat16)
    loss, _ = loss_with(logp, old_logp, advantages, mask)
    assert loss.dtype == torch.float32


def test_log_ratio_is_clamped():
    logp = torch.tensor([[100.0]], requires_grad=True)
    loss, metrics = loss_with(logp, torch.zeros(1, 1), -torch.ones(1, 1), torch.ones(1, 1), clip_c=None)
    assert loss.item() == pytest.approx(math.exp(20), rel=1e-6) and metrics.ppo_kl.result() == -20


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"agg": "seq-sum"}, "unknown agg"),
        ({"clip_c": 1.0}, "clip_c must be > 1"),
        ({"clip_low": 1.0}, "clip_low"),
        ({"clip_high": -0.1}, "clip_high"),
        ({"agg": "group-token-mean"}, "needs integer group_ids"),
        ({"agg": "group-token-mean", "group_ids": torch.tensor([0.0, 1.0, 2.0])}, "needs integer group_ids"),
        ({"agg": "group-token-mean", "group_ids": torch.tensor([0, 1])}, "needs integer group_ids"),
        (
            {"agg": "group-token-mean", "group_ids": torch.tensor([0, 1, 0]), "group_num_tokens": torch.ones(2)},
            "group_num_tokens",
        ),
        ({"global_num_tokens": -1}, "counts.tokens must be a count"),
        ({"global_num_tokens": torch.tensor([1, 2])}, "counts.tokens must be a scalar"),
        ({"agg": "seq-mean-token-sum", "global_num_seqs": -3}, "counts.seqs"),
        ({"agg": "seq-mean-token-sum-norm", "norm_len": 0}, "norm_len"),
        ({"token_weights": torch.ones(3, 2)}, "token_weights has shape"),
    ],
)
def test_bad_arguments_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        loss_with(*hand_example(), **kwargs)


def test_bad_shapes_are_named():
    logp, old_logp, advantages, mask = hand_example()
    with pytest.raises(ValueError, match="logp must be"):
        loss_with(logp[0], old_logp[0], advantages[0], mask[0])
    with pytest.raises(ValueError, match="mask has shape"):
        loss_with(logp, old_logp, advantages, mask[:, :2])


# -- global normalisation: micro-batch and data-parallel invariance ---------------------------------


def _random_minibatch(seed, batch=12, length=9, group=3):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, length + 1, (batch,), generator=gen)
    lengths[0] = length  # one row fills the padding width, one is empty (fully masked) ...
    lengths[1] = 0
    lengths[9:12] = 0  # ... and so is the whole last group (every sample overlong-filtered)
    mask = torch.arange(length)[None, :] < lengths[:, None]
    old_logp = -torch.rand(batch, length, generator=gen, dtype=torch.float64) * 3
    # log-ratios up to +-1.5 (ratios 0.22 to 4.5) so that both clips and the dual clip (c = 3) bind
    logp = old_logp + (torch.rand(batch, length, generator=gen, dtype=torch.float64) - 0.5) * 3.0
    advantages = (torch.randn(batch, generator=gen, dtype=torch.float64) * 2)[:, None].expand(batch, length)
    weights = torch.rand(batch, length, generator=gen, dtype=torch.float64) + 0.5
    group_ids = torch.arange(batch) // group
    return logp.requires_grad_(), old_logp, advantages, mask, weights, group_ids


def _global_counts(mask, group_ids):
    """The whole mini-batch's counts; rows and groups without a valid token are not counted."""
    row_tokens = mask.sum(-1)
    per_group = torch.zeros(int(group_ids.max()) + 1, dtype=torch.long).index_add(0, group_ids, row_tokens)
    return {
        "global_num_tokens": int(mask.sum()),
        "global_num_seqs": int((row_tokens > 0).sum()),
        "group_num_tokens": per_group[group_ids],
        "global_num_groups": int((per_group > 0).sum()),
    }


def _grad_of_chunks(agg, data, chunks, use_global=True, clip_c=3.0, variant="dapo"):
    """Sum of gradients over row chunks; each chunk is cut to its own padding width."""
    logp, old_logp, advantages, mask, weights, group_ids = data
    counts = _global_counts(mask, group_ids)
    logp.grad = None
    total = 0.0
    for rows in chunks:
        rows = torch.tensor(rows)
        width = max(int(mask[rows].sum(-1).max()), 1)
        kwargs = {"agg": agg, "token_weights": weights[rows, :width], "norm_len": mask.shape[1], "clip_c": clip_c}
        kwargs["variant"] = variant
        if agg == "group-token-mean":
            kwargs["group_ids"] = group_ids[rows]
        if use_global:
            kwargs |= {k: (v[rows] if k == "group_num_tokens" else v) for k, v in counts.items()}
        loss, _ = loss_with(
            logp[rows, :width], old_logp[rows, :width], advantages[rows, :width], mask[rows, :width], **kwargs
        )
        (loss if use_global else loss / len(chunks)).backward()
        total += loss.item() if use_global else loss.item() / len(chunks)
    return logp.grad.clone(), total


# Each data-parallel rank holds whole groups (rows 0-5 and 6-11) and splits them into micro-batches.
ONE_PASS = [list(range(12))]
MICRO_BATCHES = [[0, 1, 2, 3, 4], [5, 6, 7], [8, 9, 10, 11]]
DP_SHARDS_X_MICRO = [[0, 1, 2], [3, 4, 5], [6, 7], [8, 9, 10, 11]]  # rank 0: first two, rank 1: rest


@pytest.mark.parametrize("variant", POLICY_LOSSES)
@pytest.mark.parametrize("agg", AGG_MODES)
@pytest.mark.parametrize("split", [MICRO_BATCHES, DP_SHARDS_X_MICRO])
def test_summed_gradients_with_global_counts_equal_the_one_pass_gradient(agg, split, variant):
    data = _random_minibatch(seed=1)
    logp, old_logp, advantages, mask = data[:4]
    _, metrics = loss_with(logp, old_logp, advantages, mask, clip_c=3.0)
    assert metrics.pg_clipfrac.result() > 0.1 and metrics.pg_clipfrac_lower.result() > 0.01  # every branch is exercised
    full_grad, full_loss = _grad_of_chunks(agg, data, ONE_PASS, variant=variant)
    split_grad, split_loss = _grad_of_chunks(agg, data, split, variant=variant)
    assert full_grad.abs().max() > 1e-3  # a non-trivial gradient
    # float64 sums of at most 108 terms of size < 50 (ratios up to 4.5 x advantages up to ~6; CISPO's terms: a
    # weight <= 1.28 x ~6 x |log pi| <= 4.5): rounding below 108 x eps64 x 50 = 1.2e-12 on either side, whatever
    # the summation order. GSPO's row ratio is a mean over one row, which every split keeps whole.
    assert (split_grad - full_grad).abs().max().item() <= 2.5e-12
    assert split_loss == pytest.approx(full_loss, rel=0, abs=2.5e-12)


def test_without_global_counts_micro_batch_means_differ():
    # Averaging per-micro-batch token means is not the mini-batch token mean: the invariance above
    # is owed to the global counts.
    data = _random_minibatch(seed=1)
    full_grad, _ = _grad_of_chunks("token-mean", data, ONE_PASS)
    local_grad, _ = _grad_of_chunks("token-mean", data, MICRO_BATCHES, use_global=False)
    assert (local_grad - full_grad).abs().max().item() > 1e-3


def test_one_pass_with_own_counts_equals_no_counts():
    data = _random_minibatch(seed=2)
    logp, old_logp, advantages, mask, weights, group_ids = data
    counts = _global_counts(mask, group_ids)
    for agg in AGG_MODES:
        extra = {"group_ids": group_ids} if agg == "group-token-mean" else {}
        plain, _ = loss_with(logp, old_logp, advantages, mask, agg=agg, **extra)
        given_counts, _ = loss_with(
            logp, old_logp, advantages, mask, agg=agg, **extra, **counts, norm_len=mask.shape[1]
        )
        assert plain.item() == pytest.approx(given_counts.item(), rel=1e-12), agg


# -- properties ------------------------------------------------------------------------------------


@settings(max_examples=120, deadline=None)
@given(
    batch=st.integers(1, 5),
    length=st.integers(1, 6),
    seed=st.integers(0, 2**31 - 1),
    log_ratio_scale=st.sampled_from([0.01, 0.5, 5.0, 60.0]),
    agg=st.sampled_from(AGG_MODES),
    clip_low=st.floats(0.0, 0.95),
    clip_high=st.floats(0.0, 5.0),
    clip_c=st.none() | st.floats(1.01, 50.0),
)
def test_loss_is_finite_and_clip_fractions_are_shares(
    batch, length, seed, log_ratio_scale, agg, clip_low, clip_high, clip_c
):
    gen = torch.Generator().manual_seed(seed)
    old_logp = -torch.rand(batch, length, generator=gen) * 10
    logp = (old_logp + torch.randn(batch, length, generator=gen) * log_ratio_scale).requires_grad_()
    advantages = torch.randn(batch, 1, generator=gen).expand(batch, length) * 3
    mask = torch.rand(batch, length, generator=gen) < 0.7
    extra = {"group_ids": torch.randint(0, 3, (batch,), generator=gen)} if agg == "group-token-mean" else {}
    loss, metrics = loss_with(
        logp, old_logp, advantages, mask, agg=agg, clip_low=clip_low, clip_high=clip_high, clip_c=clip_c, **extra
    )
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logp.grad).all()
    for name in ("pg_clipfrac", "pg_clipfrac_lower"):  # shares of the valid tokens (NaN without any)
        share = getattr(metrics, name).result()
        assert 0.0 <= share <= 1.0 or (math.isnan(share) and not mask.any())
    negative_share = ((advantages < 0) & mask).sum().item() / max(int(mask.sum()), 1)
    lower = metrics.pg_clipfrac_lower.result()
    assert math.isnan(lower) or lower <= negative_share + 1e-7  # only A < 0 tokens can bind
    kl = metrics.ppo_kl.result()
    assert (math.isfinite(kl) and abs(kl) <= 20.0) or (math.isnan(kl) and not mask.any())
