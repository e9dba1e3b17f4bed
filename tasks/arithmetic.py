"""The synthetic arithmetic task: one operation on two numbers ("What is 84 + 32?"), asked inside
DAPO-Math-17k's prompt template, with a worked solution per problem for the supervised warm-up. Its levels
are in tasks/catalog.py; the CPU demo (configs/demo_cpu.toml) runs level 2.
"""

from __future__ import annotations

import random

from tasks.catalog import ARITHMETIC_LEVELS, in_eval_split, problem_limit, task_row


def _is_eval_problem(a: int, op: str, b: int, eval_share: float) -> bool:
    """`in_eval_split` of the problem; "a + b" and "b + a" (likewise "*") are one problem with one worked
    solution, so the hash sees them in one order."""
    if op in "+*":
        a, b = min(a, b), max(a, b)
    return in_eval_split(f"{a} {op} {b}", eval_share)


def synthetic_arithmetic_rows(
    num: int,
    *,
    difficulty: int = 2,
    split: str = "train",
    seed: int = 0,
    eval_share: float = 0.2,
    answer_line_share: float = 1.0,
) -> list[dict]:
    """`num` distinct arithmetic problems of one split, as DAPO-schema rows with worked solutions.

    The problem `a op b` with `a, b` drawn from [0, range) is asked inside DAPO's prompt template; the
    solution is "a op b = c" followed by "Answer: c". Train and eval splits never share a problem, nor
    its commuted twin ("b + a" for "a + b").

    answer_line_share: the share of worked solutions that end with the "Answer: c" line the reward
    reads; the others state the result in prose ("a op b = c, so the result is c."), which the rule
    reward scores as wrong. Below 1, a model fitted to these solutions follows the requested answer
    format only part of the time, as base models do: something DAPO's verifiable reward teaches.
    """
    if not 0.0 <= answer_line_share <= 1.0:
        raise ValueError(f"answer_line_share must be in [0, 1], got {answer_line_share}")
    most = problem_limit("arithmetic", difficulty, split, eval_share)
    if num > most:
        raise ValueError(f"difficulty {difficulty} gives at most {most} distinct {split} problems; asked for {num}")
    operators, limit = ARITHMETIC_LEVELS[difficulty]
    rng = random.Random(f"{seed}-{difficulty}")
    style_rng = random.Random(f"{seed}-{difficulty}-{split}-style")
    rows: list[dict[str, object]] = []
    seen: set[str] = set()
    while len(rows) < num:
        a, b, op = rng.randrange(limit), rng.randrange(limit), rng.choice(operators)
        text = f"{a} {op} {b}"
        if text in seen or _is_eval_problem(a, op, b, eval_share) != (split == "eval"):
            continue
        seen.add(text)
        value = a + b if op == "+" else a - b if op == "-" else a * b
        answer_line = style_rng.random() < answer_line_share
        solution = (
            f"{text} = {value}\nAnswer: {value}" if answer_line else f"{text} = {value}, so the result is {value}."
        )
        extra = {"index": len(rows), "split": split, "solution": solution}
        rows.append(task_row(f"synthetic_arithmetic_l{difficulty}", text, value, extra))
    return rows
