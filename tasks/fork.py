"""The fork task: a rare but better first move, for the clip-higher probe (bench/mechanisms.py, configs/probes/).

The fork's problems add two numbers ("What is 37 + 45?"), and their worked solutions choose one of two strategies
with their first word:

    roughly   "roughly\\n37 + 45 is about 80\\nAnswer: 80"   the sum rounded to tens (most of them)
    exactly   "exactly\\n37 + 45 = 82\\nAnswer: 82"          the exact sum (a few percent)

The same sums asked in words ("What is the sum of 37 and 45?") are always worked exactly: they teach the exact
sums, so a policy fitted to these solutions can carry out the rare strategy at the fork although it seldom chooses
it there. An estimate is right only when the sum is a multiple of ten (one problem in ten), and a policy fitted to
these solutions never samples another last digit after "roughly", so no gradient can mend that strategy: the rare
strategy is the better one, by as much as the policy's exact sums are right, and a policy gradient should move its
first word's probability from the warm-up's few percent towards one. The held-out split asks the fork's problems
only. The two strategies' first words are different tokens.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from tasks.catalog import FORK_LEVELS, in_eval_split, problem_limit, task_row

STRATEGIES = ("roughly", "exactly")  # the common and the rare first move
COMMON, RARE = STRATEGIES
KINDS = ("fork", "worded")


def rounded(total: int) -> int:
    """`total` to the nearest ten, halves up."""
    return (total + 5) // 10 * 10


def fork_solution(terms: Sequence[int], strategy: str) -> str:
    """The worked solution of a + b in one of STRATEGIES; its "Answer:" line holds the estimate or the sum."""
    if strategy not in STRATEGIES:
        raise ValueError(f"fork strategy must be one of {STRATEGIES}, got {strategy!r}")
    a, b = terms
    if strategy == COMMON:
        estimate = rounded(a + b)
        return f"{COMMON}\n{a} + {b} is about {estimate}\nAnswer: {estimate}"
    return f"{RARE}\n{a} + {b} = {a + b}\nAnswer: {a + b}"


def response_strategy(text: str) -> str | None:
    """The strategy a response's first line names, or None when it names neither."""
    first = text.split("\n", 1)[0].strip()
    return first if first in STRATEGIES else None


def _question(a: int, b: int, kind: str) -> str:
    return f"the sum of {a} and {b}" if kind == "worded" else f"{a} + {b}"


def synthetic_fork_rows(
    num: int, *, difficulty: int = 1, split: str = "train", seed: int = 0, eval_share: float = 0.2
) -> list[dict]:
    """`num` distinct problems of one split as DAPO-schema rows with worked solutions; FORK_LEVELS[difficulty] =
    (the share of the fork's problems, the share of their solutions that go exactly, the operands' range).
    extra_info: "kind" (one of KINDS) and "strategy"."""
    most = problem_limit("fork", difficulty, split, eval_share)
    if num > most:
        raise ValueError(f"fork level {difficulty} has at most {most} distinct {split} problems; asked for {num}")
    fork_share, rare_share, (low, high) = FORK_LEVELS[difficulty]
    rng = random.Random(f"fork-{seed}-{difficulty}")
    style_rng = random.Random(f"fork-{seed}-{difficulty}-{split}-strategy")
    rows: list[dict] = []
    seen: set[tuple] = set()
    while len(rows) < num:
        kind = "fork" if split == "eval" or rng.random() < fork_share else "worded"
        a, b = rng.randrange(low, high), rng.randrange(low, high)
        # A sum and its commuted twin, in either wording, fall in one split.
        if (kind, a, b) in seen or in_eval_split(f"{min(a, b)} + {max(a, b)}", eval_share) != (split == "eval"):
            continue
        seen.add((kind, a, b))
        strategy = RARE if kind == "worded" or style_rng.random() < rare_share else COMMON
        extra = {"index": len(rows), "split": split, "kind": kind, "strategy": strategy}
        extra["solution"] = fork_solution((a, b), strategy)
        rows.append(task_row(f"synthetic_fork_l{difficulty}", _question(a, b, kind), a + b, extra))
    return rows
