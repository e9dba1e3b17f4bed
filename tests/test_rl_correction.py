"""Rollout/trainer mismatch metrics and truncated importance-sampling weights."""

import math

import pytest
import torch

from rl.correction import mismatch_metrics, truncated_is_weights
from tests.loss_calls import loss_with

# Four valid tokens and one masked one holding garbage. delta = old - rollout = [0, -1, 0.1, 1].
OLD = [[-1.0, -2.0, -0.5, -0.5, float("nan")]]
ROLLOUT = [[-1.0, -1.0, -0.6, -1.5, float("-inf")]]
MASK = [[1, 1, 1, 1, 0]]


def _t(values):
    return torch.tensor(values, dtype=torch.float64)


def test_mismatch_metrics_hand_computed():
    metrics = mismatch_metrics(_t(OLD), _t(ROLLOUT), torch.tensor(MASK))
    assert metrics["mismatch_abs_logp_mean"].item() == pytest.approx((0 + 1 + 0.1 + 1) / 4)
    assert metrics["mismatch_abs_logp_max"].item() == pytest.approx(1.0)
    k3 = [0.0, math.exp(-1) - 1 + 1, math.exp(0.1) - 1 - 0.1, math.exp(1) - 1 - 1]
    assert metrics["mismatch_k3_kl"].item() == pytest.approx(sum(k3) / 4)
    # |exp(old) - exp(rollout)|: 0, 0.2325, 0.0577, 0.3834 -> two of four above 0.1
    assert metrics["mismatch_prob_diff_frac"].item() == pytest.approx(0.5)
    assert metrics["mismatch_num_tokens"].item() == 4


def test_mismatch_metrics_identical_and_empty():
    logp = _t([[-0.3, -4.0]])
    metrics = mismatch_metrics(logp, logp.clone(), torch.ones(1, 2))
    assert all(v.item() == 0 for k, v in metrics.items() if k != "mismatch_num_tokens")
    empty = mismatch_metrics(_t(OLD), _t(ROLLOUT), torch.zeros(1, 5))
    assert all(v.item() == 0 for v in empty.values())


def test_prob_threshold_is_configurable():
    metrics = mismatch_metrics(_t(OLD), _t(ROLLOUT), torch.tensor(MASK), prob_threshold=0.05)
    assert metrics["mismatch_prob_diff_frac"].item() == pytest.approx(0.75)


def test_k3_is_nonnegative_and_clamped_for_extreme_gaps():
    metrics = mismatch_metrics(_t([[0.0]]), _t([[-100.0]]), torch.ones(1, 1))
    assert metrics["mismatch_k3_kl"].item() == pytest.approx(math.exp(20) - 21)
    assert metrics["mismatch_abs_logp_max"].item() == pytest.approx(100.0)


def test_truncated_is_weights_hand_computed():
    weights = truncated_is_weights(_t(OLD), _t(ROLLOUT), torch.tensor(MASK))
    expected = _t([[1.0, math.exp(-1), math.exp(0.1), 2.0, 0.0]])  # e^1 > 2 is capped; masked -> 0
    torch.testing.assert_close(weights, expected, rtol=0, atol=1e-12)
    torch.testing.assert_close(
        truncated_is_weights(_t(OLD), _t(ROLLOUT), torch.tensor(MASK), cap=3.0)[0, 3],
        torch.tensor(math.e, dtype=torch.float64),
    )


def test_truncated_is_weights_are_constants_and_never_overflow():
    old = _t([[0.0, 500.0]]).requires_grad_()
    weights = truncated_is_weights(old, _t([[0.0, -500.0]]))
    assert not weights.requires_grad and weights.tolist() == [[1.0, 2.0]]


def test_weights_feed_the_policy_loss():
    # token-mean of -A * r * w with r = 1 (logp == old_logp) and A = 1: -(mean of the weights)
    old, rollout, mask = _t(OLD), _t(ROLLOUT), torch.tensor(MASK)
    weights = truncated_is_weights(old, rollout, mask)
    logp = torch.where(mask.bool(), old, 0.0)
    loss, _ = loss_with(logp, logp, torch.ones_like(logp), mask, token_weights=weights)
    assert loss.item() == pytest.approx(-(1 + math.exp(-1) + math.exp(0.1) + 2) / 4)


def test_bad_input_is_named():
    with pytest.raises(ValueError, match=r"both be \[B, T\]"):
        mismatch_metrics(_t([[0.0, 1.0]]), _t([[0.0]]), torch.ones(1, 2))
    with pytest.raises(ValueError, match="mask has shape"):
        truncated_is_weights(_t([[0.0]]), _t([[0.0]]), torch.ones(2, 1))
    with pytest.raises(ValueError, match="cap must be > 0"):
        truncated_is_weights(_t([[0.0]]), _t([[0.0]]), cap=0.0)
