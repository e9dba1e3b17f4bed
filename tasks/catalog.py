"""The built-in synthetic tasks by name, as the [data] section names them: their difficulty levels (tables
the configuration reads without importing the tasks), how many distinct problems a level's split holds, and
the rows of a split, in the DAPO-Math-17k schema (tasks/arithmetic.py, tasks/chain.py; the mechanism probes'
tasks/coin.py,
tasks/fork.py, tasks/scan.py).
"""

from __future__ import annotations

import hashlib
from typing import Any

# The instruction DAPO-Math-17k wraps around every problem; the synthetic tasks ask theirs in it.
DAPO_PROMPT_TEMPLATE = (
    "Solve the following math problem step by step. The last line of your response should be of the form "
    "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n{problem}\n\n"
    'Remember to put your answer on its own line after "Answer:".'
)

# arithmetic: (operators, operands drawn from [0, limit)) per level
ARITHMETIC_LEVELS = {1: ("+", 10), 2: ("+", 100), 3: ("+-", 100), 4: ("+-*", 100), 5: ("+-*", 1000)}
# chain: (fewest terms, most terms, operands drawn from [1, limit)) per level
CHAIN_LEVELS = {1: (2, 3, 10), 2: (2, 5, 30), 3: (2, 6, 100)}
# coin: (free digits per worked solution, their decay, draws numbered from [0, draws)) per level
COIN_LEVELS = {1: (12, 0.5, 100_000)}
# fork: (share of the fork's problems, the rest asked in words; share of the fork's solutions that go exactly;
# operands from [low, high)) per level
FORK_LEVELS = {1: (0.5, 0.03, (10, 80))}
# scan: (two-digit numbers per problem, one of them even; share of short worked solutions) per level
SCAN_LEVELS = {1: (10, 0.25)}
TASKS: dict[str, dict[int, tuple[Any, ...]]] = {
    "arithmetic": ARITHMETIC_LEVELS,
    "chain": CHAIN_LEVELS,
    "coin": COIN_LEVELS,
    "fork": FORK_LEVELS,
    "scan": SCAN_LEVELS,
}


def problem_limit(task: str, difficulty: int, split: str, eval_share: float = 0.2) -> int:
    """The most problems one split of a task's level may ask for: 90% of the split's expected number of
    distinct problems (beyond that, drawing distinct ones would take ever longer). A problem falls in the
    held-out split with probability eval_share."""
    levels = TASKS[task]
    if difficulty not in levels:
        raise ValueError(f"{task} difficulty must be one of {sorted(levels)}, got {difficulty}")
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    if task == "chain":
        fewest, most, limit = CHAIN_LEVELS[difficulty]
        total = sum((limit - 1) ** k for k in range(fewest, most + 1))  # ordered chains
    elif task == "coin":
        total = COIN_LEVELS[difficulty][2]
    elif task == "fork":  # the held-out split asks the fork's problems only; training draws both wordings
        fork_share, _, (low, high) = FORK_LEVELS[difficulty]
        pairs = (high - low) ** 2
        total = pairs if split == "eval" else int(min(pairs / fork_share, pairs / (1 - fork_share)))
    elif task == "scan":  # the even number's position, its value (45 even), the others' (45 odd each)
        k = SCAN_LEVELS[difficulty][0]
        total = k * 45**k
    else:
        operators, limit = ARITHMETIC_LEVELS[difficulty]
        total = len(operators) * limit * limit
    return int(0.9 * total * (eval_share if split == "eval" else 1 - eval_share))


def in_eval_split(problem: str, eval_share: float) -> bool:
    """Split by a hash of the problem's text: train and eval are disjoint by construction."""
    return int(hashlib.sha256(problem.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF < eval_share


def task_row(source: str, question: str, answer: int, extra_info: dict[str, object]) -> dict[str, Any]:
    """A row of the DAPO-Math-17k schema asking `question` inside DAPO's prompt template."""
    return {
        "data_source": source,
        "prompt": [{"role": "user", "content": DAPO_PROMPT_TEMPLATE.format(problem=f"What is {question}?")}],
        "ability": "MATH",
        "reward_model": {"style": "rule", "ground_truth": str(answer)},
        "extra_info": extra_info,
    }
