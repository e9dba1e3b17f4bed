"""The coin task: a reward that carries no signal, for the clip-bias probe (bench/mechanisms.py, configs/probes/).

A problem asks for the hidden coin of a numbered draw ("What is the hidden coin of draw 4817?"). Its ground
truth, 0 or 1, is drawn at random per problem, and the prompt says nothing about it: whatever the policy writes,
an answer of 0 or 1 is right with probability 1/2, so the rule reward is a fair coin (+1 / -1) and its expected
policy gradient is zero. Only the clip of Eq. 10, which treats positive and negative advantages differently, can
move the policy in a systematic direction.

The worked solutions of the supervised warm-up give the policy many free choices for the clip to act on: a line
of digits drawn independently with P(d) proportional to decay^d (d = 0..9), then a coin of its own:

    "Digits: 0310020101\\nAnswer: 1"

The coin in a worked solution is drawn independently of the ground truth, so the warm-up teaches nothing about
it either. Digits are single tokens, so each digit is one free choice of known distribution.
"""

from __future__ import annotations

import random

from tasks.catalog import COIN_LEVELS, in_eval_split, problem_limit, task_row


def digit_weights(decay: float) -> list[float]:
    """P(d) for d = 0..9, proportional to decay^d."""
    weights = [decay**d for d in range(10)]
    return [w / sum(weights) for w in weights]


def coin_solution(digits: str, coin: int) -> str:
    """A worked solution: the line of free digits, then the coin on the "Answer:" line the reward reads."""
    return f"Digits: {digits}\nAnswer: {coin}"


def synthetic_coin_rows(
    num: int, *, difficulty: int = 1, split: str = "train", seed: int = 0, eval_share: float = 0.2
) -> list[dict]:
    """`num` distinct draws of one split, as DAPO-schema rows: ground truth a random coin (0 or 1), a worked
    solution of COIN_LEVELS[difficulty] = (digits, decay) free digits and an independent coin."""
    most = problem_limit("coin", difficulty, split, eval_share)
    if num > most:
        raise ValueError(f"coin level {difficulty} has at most {most} distinct {split} problems; asked for {num}")
    length, decay, draws = COIN_LEVELS[difficulty]
    weights = digit_weights(decay)
    rng = random.Random(f"coin-{seed}-{difficulty}")
    truth_rng = random.Random(f"coin-{seed}-{difficulty}-{split}-truth")  # the hidden coins
    solution_rng = random.Random(f"coin-{seed}-{difficulty}-{split}-solution")  # the worked solutions
    rows: list[dict] = []
    seen: set[int] = set()
    while len(rows) < num:
        draw = rng.randrange(draws)
        question = f"the hidden coin of draw {draw}"
        if draw in seen or in_eval_split(question, eval_share) != (split == "eval"):
            continue
        seen.add(draw)
        truth = truth_rng.randrange(2)
        digits = "".join(map(str, solution_rng.choices(range(10), weights=weights, k=length)))
        solution = coin_solution(digits, solution_rng.randrange(2))
        extra = {"index": len(rows), "split": split, "solution": solution}
        rows.append(task_row(f"synthetic_coin_l{difficulty}", question, truth, extra))
    return rows
