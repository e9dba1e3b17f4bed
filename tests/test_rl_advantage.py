"""Group-normalised advantage (Eq. 9): hand-computed cases, conventions, properties."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rl.advantage import group_advantages

EPS = 1e-6


def _t(values, dtype=torch.float64):
    return torch.tensor(values, dtype=dtype)


def test_balanced_binary_group():
    # mean 0, unbiased std sqrt(4 / 3)
    adv = group_advantages(_t([1, -1, -1, 1]), group_size=4)
    a = 1 / (math.sqrt(4 / 3) + EPS)
    torch.testing.assert_close(adv, _t([a, -a, -a, a]), rtol=0, atol=1e-12)


def test_one_correct_of_four():
    # mean -0.5; squared deviations 2.25 + 3 * 0.25 = 3; unbiased variance 3 / 3 = 1
    adv = group_advantages(_t([1, -1, -1, -1]), group_size=4)
    expected = _t([1.5, -0.5, -0.5, -0.5]) / (1 + EPS)
    torch.testing.assert_close(adv, expected, rtol=0, atol=1e-12)


def test_shaped_rewards():
    # rewards with an overlong penalty: mean 1/12, squared deviations sum 67/24, variance 67/48
    adv = group_advantages(_t([1.0, -1.25, 0.5]), group_size=3)
    std = math.sqrt(67 / 48)
    expected = _t([11 / 12, -4 / 3, 5 / 12]) / (std + EPS)
    torch.testing.assert_close(adv, expected, rtol=0, atol=1e-12)


def test_constant_group_has_zero_advantage():
    adv = group_advantages(_t([1, 1, 1, -1, -1, -1]), group_size=3)
    assert torch.equal(adv, torch.zeros(6, dtype=torch.float64))


def test_singleton_group_uses_mean_zero_std_one():
    adv = group_advantages(_t([0.7, -1.0]), group_size=1)
    torch.testing.assert_close(adv, _t([0.7, -1.0]) / (1 + EPS), rtol=0, atol=1e-12)
    assert torch.equal(group_advantages(_t([0.7]), group_size=1, norm_by_std=False), _t([0.7]))


def test_dr_grpo_skips_std_division():
    adv = group_advantages(_t([1, -1, -1, -1, 1, 1]), group_size=3, norm_by_std=False)
    torch.testing.assert_close(adv, _t([4 / 3, -2 / 3, -2 / 3, -4 / 3, 2 / 3, 2 / 3]), rtol=0, atol=1e-12)


def by_ids(scores, ids, **kwargs):
    """Eq. 9 over groups given by one id per sample, in any order (tensor ints or any hashable values): each
    group's samples through group_advantages, put back in place."""
    ids = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
    out = torch.empty_like(scores)
    for gid in dict.fromkeys(ids):
        rows = torch.tensor([i for i, x in enumerate(ids) if x == gid])
        out[rows] = group_advantages(scores[rows], group_size=len(rows), **kwargs)
    return out


def test_groups_by_ids_in_any_order():
    # id 7: [1, 3] -> mean 2, std sqrt(2); id 3: [2, 5] -> mean 3.5, std sqrt(4.5)
    adv = by_ids(_t([1, 2, 3, 5]), torch.tensor([7, 3, 7, 3]))
    a, b = 1 / (math.sqrt(2) + EPS), 1.5 / (math.sqrt(4.5) + EPS)
    torch.testing.assert_close(adv, _t([-a, -b, a, b]), rtol=0, atol=1e-12)
    by_names = by_ids(_t([1, 2, 3, 5]), ["q7", "q3", "q7", "q3"])
    torch.testing.assert_close(by_names, adv, rtol=0, atol=0)


def test_one_call_over_many_groups_is_each_group_alone_and_mixed_group_sizes_work():
    scores = torch.randn(12, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    together = group_advantages(scores, group_size=4)
    alone = by_ids(scores, torch.arange(12) // 4)
    torch.testing.assert_close(together, alone, rtol=0, atol=0)
    # a singleton next to a pair: the singleton is R / (1 + eps), the pair is +-1/sqrt(2)
    adv = by_ids(_t([5.0, 1.0, 3.0]), [0, 1, 1])
    pair = 1 / (math.sqrt(2) + EPS)
    torch.testing.assert_close(adv, _t([5 / (1 + EPS), -pair, pair]), rtol=0, atol=1e-12)


def test_dtype_is_preserved():
    adv = group_advantages(torch.tensor([1.0, -1.0], dtype=torch.float32), group_size=2)
    assert adv.dtype == torch.float32
    torch.testing.assert_close(adv, torch.tensor([1.0, -1.0]) / (math.sqrt(2) + EPS))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"group_size": 3}, "do not split into groups of 3"),
        ({"group_size": 0}, "positive int"),
        ({"group_size": 2.0}, "positive int"),
        ({"group_size": 2, "eps": -1.0}, "eps must be > 0"),
        ({"group_size": 2, "eps": 0.0}, "eps must be > 0 when dividing by the group std"),
    ],
)
def test_bad_arguments_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        group_advantages(_t([1, 2, 3, 4]), **kwargs)


def test_bad_scores_are_refused():
    with pytest.raises(ValueError, match="1-D"):
        group_advantages(torch.zeros(2, 2), group_size=2)
    with pytest.raises(ValueError, match="NaN or inf"):
        group_advantages(_t([1.0, float("nan")]), group_size=2)


@settings(max_examples=100, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 6), min_size=1, max_size=6),
    seed=st.integers(0, 2**31 - 1),
    binary=st.booleans(),
    norm_by_std=st.booleans(),
)
def test_group_advantages_sum_to_zero(sizes, seed, binary, norm_by_std):
    gen = torch.Generator().manual_seed(seed)
    n = sum(sizes)
    if binary:
        scores = torch.randint(0, 2, (n,), generator=gen).double() * 2 - 1
    else:
        scores = torch.randn(n, generator=gen, dtype=torch.float64) * 3
    ids = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))
    ids = ids[torch.randperm(n, generator=gen)]  # groups interleaved
    adv = by_ids(scores, ids, norm_by_std=norm_by_std)
    assert torch.isfinite(adv).all()
    for g, size in enumerate(sizes):
        members = adv[ids == g]
        if size == 1:
            expected = scores[ids == g] / ((1 + EPS) if norm_by_std else 1)
            torch.testing.assert_close(members, expected, rtol=0, atol=1e-12)
            continue
        assert abs(members.sum().item()) < 1e-9
        spread = scores[ids == g].std().item()
        if norm_by_std and spread > 1e-3:
            # normalised advantages have unbiased std std / (std + eps), i.e. 1 up to eps
            assert members.std().item() == pytest.approx(spread / (spread + EPS), rel=1e-9)
