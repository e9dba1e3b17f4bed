"""The mechanism probes' tasks (tasks/coin.py, tasks/fork.py, tasks/scan.py): their generators, worked solutions and
what the rule reward makes of them, and how a response is read back."""

import math
import re
from collections import Counter

import pytest

from config import load_config
from data.prompts import synthetic_task_rows
from rl.reward import compute_score
from tasks.catalog import COIN_LEVELS, FORK_LEVELS, SCAN_LEVELS, problem_limit
from tasks.coin import coin_solution, digit_weights, synthetic_coin_rows
from tasks.fork import COMMON, RARE, fork_solution, response_strategy, rounded, synthetic_fork_rows
from tasks.scan import ScanReading, answered_early, read_scan, scan_solution, synthetic_scan_rows


def _question(row) -> str:
    return re.search(r"What is (.+)\?", row["prompt"][0]["content"]).group(1)


def _binomial_bound(n: int, p: float) -> float:
    """Six standard deviations of a binomial count: a draw outside it has probability below 1e-8."""
    return 6 * math.sqrt(n * p * (1 - p))


# ---------------------------------------------------------------------------------------------- coin


def test_a_coin_solution_is_right_exactly_when_its_coin_is_the_hidden_one():
    assert coin_solution("0310", 1) == "Digits: 0310\nAnswer: 1"
    assert compute_score(coin_solution("0310", 1), "1")["acc"]
    assert not compute_score(coin_solution("0310", 0), "1")["acc"]
    assert digit_weights(0.5)[0] == pytest.approx(0.5 / (1 - 0.5**10))
    assert sum(digit_weights(0.5)) == pytest.approx(1.0, abs=1e-15)


def test_the_coin_reward_carries_no_signal():
    """The hidden coins are fair and independent of what the worked solutions say, whose digits follow P(d)."""
    n = 4000
    rows = synthetic_coin_rows(n, seed=1)
    truths = [int(r["reward_model"]["ground_truth"]) for r in rows]
    solved = [compute_score(r["extra_info"]["solution"], r["reward_model"]["ground_truth"])["acc"] for r in rows]
    assert abs(sum(truths) - n / 2) < _binomial_bound(n, 0.5)
    assert abs(sum(solved) - n / 2) < _binomial_bound(n, 0.5)  # a worked solution's coin is right half the time
    length, decay, _ = COIN_LEVELS[1]
    digits = Counter(ch for r in rows for ch in r["extra_info"]["solution"].split("\n")[0][len("Digits: ") :])
    assert sum(digits.values()) == n * length
    for d, p in enumerate(digit_weights(decay)):
        assert abs(digits[str(d)] - n * length * p) < _binomial_bound(n * length, p), d
    assert len({_question(r) for r in rows}) == n  # distinct draws


def test_coin_splits_are_disjoint_and_bounded():
    train, held_out = synthetic_coin_rows(500, split="train"), synthetic_coin_rows(100, split="eval")
    assert not {_question(r) for r in train} & {_question(r) for r in held_out}
    most = problem_limit("coin", 1, "eval")
    assert most == int(0.9 * COIN_LEVELS[1][2] * 0.2)
    with pytest.raises(ValueError, match=f"at most {most} distinct eval problems"):
        synthetic_coin_rows(most + 1, split="eval")


# ---------------------------------------------------------------------------------------------- fork


def test_the_two_strategies_written_out_and_read_back():
    assert fork_solution((37, 45), COMMON) == "roughly\n37 + 45 is about 80\nAnswer: 80"
    assert fork_solution((37, 45), RARE) == "exactly\n37 + 45 = 82\nAnswer: 82"
    assert fork_solution((30, 45), COMMON).endswith("Answer: 80")  # 75: halves round up
    assert [rounded(x) for x in (20, 24, 25, 99, 104)] == [20, 20, 30, 100, 100]
    assert response_strategy(fork_solution((1, 2), RARE)) == RARE
    assert response_strategy(fork_solution((1, 2), COMMON)) == COMMON
    assert response_strategy("Answer: 3") is None and response_strategy("") is None
    with pytest.raises(ValueError, match="strategy must be one of"):
        fork_solution((1, 2), "guess")


def _terms(row) -> tuple[int, int]:
    a, b = map(int, re.findall(r"\d+", _question(row)))
    return a, b


def test_an_estimate_is_right_only_on_multiples_of_ten_and_the_exact_sum_always():
    for row in synthetic_fork_rows(500, seed=4):
        a, b = _terms(row)
        truth = row["reward_model"]["ground_truth"]
        assert truth == str(a + b)
        assert compute_score(fork_solution((a, b), RARE), truth)["acc"]
        assert compute_score(fork_solution((a, b), COMMON), truth)["acc"] == ((a + b) % 10 == 0)
        assert compute_score(row["extra_info"]["solution"], truth)["acc"] == (
            row["extra_info"]["strategy"] == RARE or (a + b) % 10 == 0
        )


def test_fork_rows_teach_exact_sums_in_words_and_keep_the_rare_strategy_rare_at_the_fork():
    n = 6000
    rows = synthetic_fork_rows(n, seed=2)
    fork_share, rare_share, (low, high) = FORK_LEVELS[1]
    fork = [r for r in rows if r["extra_info"]["kind"] == "fork"]
    assert abs(len(fork) - n * fork_share) < _binomial_bound(n, fork_share)
    rare = sum(r["extra_info"]["strategy"] == RARE for r in fork)
    assert abs(rare - len(fork) * rare_share) < _binomial_bound(len(fork), rare_share)
    for row in rows:
        extra, (a, b) = row["extra_info"], _terms(row)
        assert low <= a < high and low <= b < high
        if extra["kind"] == "worded":
            assert _question(row) == f"the sum of {a} and {b}" and extra["strategy"] == RARE
        else:
            assert _question(row) == f"{a} + {b}"
        assert response_strategy(extra["solution"]) == extra["strategy"]


def test_the_fork_held_out_split_asks_the_fork_and_never_a_training_problem():
    train, held_out = synthetic_fork_rows(3000, split="train"), synthetic_fork_rows(300, split="eval")
    assert all(r["extra_info"]["kind"] == "fork" for r in held_out)
    sums = [{tuple(sorted(_terms(r))) for r in rows} for rows in (train, held_out)]  # either order, either wording
    assert not sums[0] & sums[1]
    low, high = FORK_LEVELS[1][2]
    assert problem_limit("fork", 1, "eval") == int(0.9 * (high - low) ** 2 * 0.2)


# ---------------------------------------------------------------------------------------------- scan


def test_the_two_scan_styles_written_out_and_read_back():
    numbers = [23, 45, 38, 11]
    long, short = scan_solution(numbers, "long"), scan_solution(numbers, "short")
    assert long == "23 is odd, not it\n45 is odd, not it\n38 is even, found it\nAnswer: 38"
    assert short == "23 odd\n45 odd\n38 even\nAnswer: 38"
    assert read_scan(long) == ScanReading("long", (23, 45, 38), 38)
    assert read_scan(short) == ScanReading("short", (23, 45, 38), 38)
    assert read_scan("23 odd\n45 is odd, not it\nAnswer: 45") == ScanReading("mixed", (23, 45), 45)
    assert read_scan("Answer: 11") == ScanReading("none", (), 11)
    assert read_scan("23 odd\n45 od") == ScanReading("short", (23,), None)  # cut off: no answer
    with pytest.raises(ValueError, match="no even number"):
        scan_solution([1, 3], "long")


def test_an_early_answer_is_one_given_before_the_lines_reach_the_even_number():
    numbers, position = [23, 45, 38, 11], 3
    assert answered_early(read_scan("23 odd\nAnswer: 45"), numbers, position)
    assert not answered_early(read_scan(scan_solution(numbers, "short")), numbers, position)
    assert not answered_early(read_scan("23 odd\n45 odd\n38 even\n11 odd"), numbers, position)  # never answered


def test_scan_rows_have_one_even_number_at_a_uniform_position_and_right_solutions():
    n = 3000
    rows = synthetic_scan_rows(n, seed=3)
    k, short_share = SCAN_LEVELS[1]
    positions = Counter(r["extra_info"]["position"] for r in rows)
    assert set(positions) == set(range(1, k + 1))
    assert all(abs(count - n / k) < _binomial_bound(n, 1 / k) for count in positions.values())
    short = sum(r["extra_info"]["style"] == "short" for r in rows)
    assert abs(short - n * short_share) < _binomial_bound(n, short_share)
    for row in rows:
        extra = row["extra_info"]
        numbers = [int(t) for t in _question(row).removeprefix("the even number in ").split()]
        assert numbers == extra["numbers"] and len(numbers) == k and all(10 <= x < 100 for x in numbers)
        assert [x % 2 for x in numbers].count(0) == 1 and numbers[extra["position"] - 1] % 2 == 0
        assert compute_score(extra["solution"], row["reward_model"]["ground_truth"])["acc"]
        reading = read_scan(extra["solution"])
        assert reading == ScanReading(
            extra["style"], tuple(numbers[: extra["position"]]), numbers[extra["position"] - 1]
        )
    held_out = synthetic_scan_rows(200, split="eval", seed=3)
    assert not {_question(r) for r in rows} & {_question(r) for r in held_out}


def test_the_data_section_selects_each_probe_task():
    for task in ("coin", "fork", "scan"):
        cfg = load_config(None, [f"data.synthetic_task={task}", "data.synthetic_difficulty=1"])
        rows = synthetic_task_rows(cfg.data, "eval")
        assert len(rows) == cfg.data.synthetic_num_eval and rows[0]["data_source"] == f"synthetic_{task}_l1"
