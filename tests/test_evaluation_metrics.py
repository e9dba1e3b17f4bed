"""avg@k, unbiased pass@k and maj@k on hand-computed examples (evaluation/metrics.py)."""

import itertools
import math
import random
from fractions import Fraction

import pytest

from evaluation.metrics import (
    ProblemResult,
    avg_at_k,
    maj_at_k,
    majority_vote,
    mean_pass_at_k,
    pass_at_k,
    summarize,
    vote_key,
)


def _enumerated_pass_at_k(n: int, c: int, k: int) -> Fraction:
    """Naive reference: the share of all k-subsets of the n samples that hold a correct sample."""
    samples = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    return Fraction(sum(any(samples[i] for i in s) for s in subsets), len(subsets))


# ------------------------------------------------------------------------------------------ pass@k


@pytest.mark.parametrize(
    "n, c, k, expected",
    [
        (5, 2, 2, 0.7),  # 1 - C(3,2)/C(5,2) = 1 - 3/10
        (4, 1, 2, 0.5),  # 1 - C(3,2)/C(4,2) = 1 - 3/6
        (4, 2, 2, 5 / 6),  # 1 - C(2,2)/C(4,2) = 1 - 1/6
        (10, 3, 1, 0.3),  # pass@1 = c / n
        (4, 3, 2, 1.0),  # n - c < k: every pair holds a correct sample
        (8, 0, 8, 0.0),  # nothing correct
        (32, 1, 32, 1.0),  # pass@n = 1 when c > 0
        (200, 1, 100, 0.5),  # c = 1: 1 - C(n-1,k)/C(n,k) = k/n
    ],
)
def test_pass_at_k_hand_computed(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-15)


def test_pass_at_k_equals_enumeration_over_all_subsets():
    for n in range(1, 9):
        for c in range(n + 1):
            for k in range(1, n + 1):
                # Exact integer arithmetic rounded once: equal to the correctly rounded reference.
                assert pass_at_k(n, c, k) == float(_enumerated_pass_at_k(n, c, k)), (n, c, k)


def test_pass_at_k_large_n_neither_overflows_nor_loses_precision():
    # C(2000, 1000) ~ 2e600 is no float: a naive comb(n-c,k)/comb(n,k) in floats overflows.
    with pytest.raises(OverflowError):
        float(2**2000)
    assert pass_at_k(2000, 1, 1000) == 0.5
    # Tiny probabilities keep their relative precision (no 1 - (1 - tiny) cancellation):
    # pass@1 with c = 1 of n = 10**6 is exactly 1e-6.
    assert pass_at_k(10**6, 1, 1) == 1e-6
    # Near-1 values: 1 - C(n-c,k)/C(n,k) with n = 100, c = 50, k = 20.
    expected = 1 - Fraction(math.comb(50, 20), math.comb(100, 20))
    assert pass_at_k(100, 50, 20) == float(expected)


@pytest.mark.parametrize(
    "n, c, k, message",
    [
        (0, 0, 1, "n >= 1"),
        (4, 5, 1, "0 <= c <= n"),
        (4, -1, 1, "0 <= c <= n"),
        (4, 1, 0, "1 <= k <= n"),
        (4, 1, 5, "1 <= k <= n"),
    ],
)
def test_pass_at_k_refuses_bad_counts(n, c, k, message):
    with pytest.raises(ValueError, match=message):
        pass_at_k(n, c, k)


def test_pass_at_k_refuses_non_integers():
    with pytest.raises(TypeError, match="k must be an int"):
        pass_at_k(4, 1, 2.0)
    with pytest.raises(TypeError, match="c must be an int"):
        pass_at_k(4, True, 2)


# ------------------------------------------------------------------------------------------ maj@k


def test_majority_vote_tie_goes_to_first_occurrence_and_non_answers_never_win():
    # "4" and "3" have two votes each, "4" comes first; three non-answers cast no vote.
    assert majority_vote(["4", "3", "3", "4", None, None, None]) == 0
    assert majority_vote(["3", "4", "4"]) == 1  # a clear majority wins wherever it starts
    assert majority_vote([None, None, "7"]) == 2  # one answer beats any number of non-answers
    assert majority_vote(["9", "8", "7"]) == 0  # all tied: the first sample's answer
    assert majority_vote([None, None]) is None
    assert majority_vote([]) is None


def test_votes_are_cast_for_normalized_predictions():
    assert vote_key("\\frac12") == vote_key("\\frac{1}{2}") == "\\frac{1}{2}"
    assert vote_key(None) is None
    # Raw strings would be a three-way tie won by the wrong "5"; normalised, 1/2 has two votes.
    problem = ProblemResult("s", acc=[False, True, True], pred=["5", "\\frac12", "\\frac{1}{2}"])
    assert problem.majority_correct() is True


def test_majority_answer_is_judged_by_its_first_sample():
    assert ProblemResult("s", acc=[True, False], pred=["x", "x"]).majority_correct() is True
    assert ProblemResult("s", acc=[False, True], pred=["x", "x"]).majority_correct() is False


def test_no_answer_anywhere_counts_as_wrong_for_maj():
    assert ProblemResult("s", acc=[False] * 3, pred=[None] * 3).majority_correct() is False


def test_maj_at_1_equals_avg_at_1():
    rng = random.Random(0)
    results = []
    for _ in range(50):
        pred = rng.choice([None, "1", "2"])
        results.append(ProblemResult("s", acc=[pred == "1"], pred=[pred]))
    assert maj_at_k(results) == avg_at_k(results)


# ------------------------------------------------------------------------------------------ aggregation


def _results():
    # Source "a": c = 4, 1, 2 of n = 4; source "b": c = 2, 1, 0.
    return [
        ProblemResult("a", [True] * 4, ["7"] * 4, [10, 10, 10, 10], [False] * 4),
        ProblemResult(
            "a", [False, True, False, False], ["6", "7", "6", None], [8, 8, 8, 40], [False, False, False, True]
        ),
        ProblemResult("a", [False, False, True, True], ["5", "6", "7", "7"], [4, 4, 4, 4], [False] * 4),
        ProblemResult("b", [False, True, True, False], ["1", "2", "2", "1"], [2, 2, 2, 2], [False] * 4),
        ProblemResult("b", [False, False, False, True], [None, None, None, "3"], [6, 6, 6, 6], [False] * 4),
        ProblemResult("b", [False] * 4, [None] * 4, [40] * 4, [True] * 4),
    ]


def test_avg_pass_maj_hand_computed_per_source_and_overall():
    report = summarize(_results(), ks=(1, 2, 4))
    a, b, overall = report["by_source"]["a"], report["by_source"]["b"], report["overall"]
    assert report["k"] == 4 and list(report["by_source"]) == ["a", "b"]
    # avg@4: a = (1 + 1/4 + 1/2) / 3; b = (1/2 + 1/4 + 0) / 3; overall = 2.5 / 6.
    assert a["avg@4"] == pytest.approx(1.75 / 3)
    assert b["avg@4"] == pytest.approx(0.75 / 3)
    assert overall["avg@4"] == pytest.approx(2.5 / 6)
    # pass@1 = avg@n.
    assert overall["pass@1"] == pytest.approx(overall["avg@4"])
    # pass@2 per problem: c=4 -> 1, c=1 -> 1/2, c=2 -> 5/6, c=0 -> 0.
    assert a["pass@2"] == pytest.approx((1 + 0.5 + 5 / 6) / 3)
    assert b["pass@2"] == pytest.approx((5 / 6 + 0.5 + 0) / 3)
    assert overall["pass@2"] == pytest.approx((1 + 0.5 + 5 / 6 + 5 / 6 + 0.5) / 6)
    # pass@4: 1 wherever c > 0.
    assert (a["pass@4"], b["pass@4"], overall["pass@4"]) == pytest.approx((1.0, 2 / 3, 5 / 6))
    # maj@4: a = [7 wins, 6 wins (2 votes vs 1), 7 wins (2 votes)] -> 2/3;
    # b = [1 and 2 tie, 1 first -> wrong; 3 beats non-answers -> right; no answer -> wrong] -> 1/3.
    assert (a["maj@4"], b["maj@4"], overall["maj@4"]) == pytest.approx((2 / 3, 1 / 3, 0.5))
    # Lengths and truncation over all 24 samples.
    assert overall["response_length/mean"] == pytest.approx((40 + 64 + 16 + 8 + 24 + 160) / 24)
    assert overall["truncated_share"] == pytest.approx(5 / 24)
    assert (overall["num_problems"], a["num_problems"], overall["num_samples"]) == (6, 3, 4)


def test_overall_weighs_problems_not_sources():
    results = [ProblemResult("big", [True], ["1"]) for _ in range(3)] + [ProblemResult("small", [False], ["2"])]
    report = summarize(results)
    assert report["overall"]["avg@1"] == 0.75  # not (1.0 + 0.0) / 2
    assert list(report["overall"]) == ["num_problems", "num_samples", "avg@1", "pass@1", "maj@1"]


def test_default_pass_ks_are_1_and_k():
    report = summarize([ProblemResult("s", [True, False, False], ["1", "2", "3"])])
    assert [key for key in report["overall"] if key.startswith("pass@")] == ["pass@1", "pass@3"]


def test_mean_pass_at_k_averages_the_per_problem_estimator():
    # c = 4, 1, 2, 2, 1, 0 of n = 4; pass@3 per problem: 1, 1 - C(3,3)/C(4,3) = 3/4, 1, 1, 3/4, 0.
    assert mean_pass_at_k(_results(), 3) == pytest.approx((1 + 0.75 + 1 + 1 + 0.75 + 0) / 6)


def test_bad_results_are_refused_with_a_named_problem():
    with pytest.raises(ValueError, match="no samples"):
        ProblemResult("s", [], [])
    with pytest.raises(ValueError, match="2 verdicts but 1 predictions"):
        ProblemResult("s", [True, False], ["1"])
    with pytest.raises(ValueError, match="response_length"):
        ProblemResult("s", [True, False], ["1", "2"], response_length=[3])
    with pytest.raises(ValueError, match=r"different sample counts \[1, 2\]"):
        summarize([ProblemResult("s", [True], ["1"]), ProblemResult("s", [True, True], ["1", "1"])])
    with pytest.raises(ValueError, match="no problems"):
        summarize([])
    with pytest.raises(TypeError, match="str or None"):
        vote_key(3)
