"""The chain-sum task (tasks/chain.py): its worked solutions, splits, styles and configuration."""

import re

import pytest

from config import ConfigError, load_config
from data.prompts import synthetic_task_rows
from rl.reward import compute_score
from tasks.catalog import CHAIN_LEVELS, problem_limit
from tasks.chain import chain_solution, synthetic_chain_rows


def _terms(row) -> tuple[int, ...]:
    text = re.search(r"What is ([0-9 +]+)\?", row["prompt"][0]["content"]).group(1)
    return tuple(int(t) for t in text.split(" + "))


def test_the_three_styles_of_one_problem_written_out():
    terms = (17, 4, 23, 9)
    assert chain_solution(terms, "direct") == "17 + 4 + 23 + 9 = 53\nAnswer: 53"
    assert chain_solution(terms, "stepwise") == "17 + 4 = 21\n21 + 23 = 44\n44 + 9 = 53\nAnswer: 53"
    assert chain_solution(terms, "split") == "17 + 4 = 21\n21 + 20 = 41\n41 + 3 = 44\n44 + 9 = 53\nAnswer: 53"
    # A two-digit second term is split too; a round ten is one line.
    assert chain_solution((5, 12, 30), "split") == "5 + 10 = 15\n15 + 2 = 17\n17 + 30 = 47\nAnswer: 47"
    with pytest.raises(ValueError, match="style must be one of"):
        chain_solution(terms, "verbose")


def test_rows_are_distinct_correct_and_every_worked_line_adds_up():
    rows = synthetic_chain_rows(300, difficulty=2, split="train", seed=3)
    fewest, most, limit = CHAIN_LEVELS[2]
    assert len({_terms(r) for r in rows}) == 300
    for row in rows:
        terms, extra = _terms(row), row["extra_info"]
        assert fewest <= len(terms) == extra["terms"] <= most and all(1 <= t < limit for t in terms)
        assert row["reward_model"]["ground_truth"] == str(sum(terms))
        assert compute_score(extra["solution"], row["reward_model"]["ground_truth"])["acc"]
        lines = extra["solution"].split("\n")[:-1]
        for line in lines:
            left, right = line.split(" = ")
            assert sum(int(t) for t in left.split(" + ")) == int(right), line
        expected = {"direct": 1, "stepwise": len(terms) - 1}.get(extra["style"])
        if expected is not None:
            assert len(lines) == expected
        else:  # split: one more line per operand after the first with both tens and ones
            assert len(lines) == len(terms) - 1 + sum(t % 10 != 0 and t > 10 for t in terms[1:])


def test_train_and_eval_never_share_a_problem_or_a_reordering_of_it():
    train = synthetic_chain_rows(2000, split="train", seed=0)
    held_out = synthetic_chain_rows(200, split="eval", seed=0)
    assert not {tuple(sorted(_terms(r))) for r in train} & {tuple(sorted(_terms(r))) for r in held_out}
    assert synthetic_chain_rows(50, split="eval", seed=0) == held_out[:50]  # deterministic


def test_style_shares_choose_the_worked_solutions_and_are_checked():
    rows = synthetic_chain_rows(100, style_shares=(0.0, 1.0, 0.0))
    assert {r["extra_info"]["style"] for r in rows} == {"stepwise"}
    mixed = [r["extra_info"]["style"] for r in synthetic_chain_rows(900)]
    assert all(250 < mixed.count(style) < 350 for style in ("direct", "stepwise", "split"))  # thirds, 900 draws
    with pytest.raises(ValueError, match="style_shares"):
        synthetic_chain_rows(10, style_shares=(0.5, 0.5))


def test_the_limit_is_ninety_percent_of_the_splits_distinct_chains():
    # Level 1: 2 or 3 terms from 1..9: 9^2 + 9^3 = 810 ordered chains, 20% held out.
    assert problem_limit("chain", 1, "eval") == int(0.9 * 810 * 0.2)
    assert problem_limit("chain", 1, "train") == int(0.9 * 810 * 0.8)
    with pytest.raises(ValueError, match="has at most 145 distinct eval problems"):
        synthetic_chain_rows(146, difficulty=1, split="eval")
    assert len(synthetic_chain_rows(145, difficulty=1, split="eval")) == 145  # the limit itself is reachable


def test_the_data_section_selects_the_chain_task_and_checks_its_settings():
    cfg = load_config(None, ["data.synthetic_task=chain", "data.synthetic_num_train=40", "data.synthetic_num_eval=8"])
    rows = synthetic_task_rows(cfg.data, "eval")
    assert len(rows) == 8 and rows[0]["data_source"] == "synthetic_chain_l2"
    with pytest.raises(ConfigError, match=r"synthetic_difficulty = 5 .*one of the chain task's levels \[1, 2, 3\]"):
        load_config(None, ["data.synthetic_task=chain", "data.synthetic_difficulty=5"])
    with pytest.raises(ConfigError, match=r"synthetic_answer_share = 0\.5 .*must be 1 with data\.synthetic_task"):
        load_config(None, ["data.synthetic_task=chain", "data.synthetic_answer_share=0.5"])
    with pytest.raises(ConfigError, match=r"synthetic_num_eval = 200 .*must be <= 145"):
        load_config(None, ["data.synthetic_task=chain", "data.synthetic_difficulty=1", "data.synthetic_num_train=5"])
