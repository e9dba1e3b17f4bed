"""The chain-sum task: a built-in CPU task on which every DAPO technique has something to act on.

A problem adds k small numbers ("What is 17 + 4 + 23 + 9?"), k from a level's range. Its worked solutions,
which the supervised warm-up fits, come in three styles of very different length and reliability, as a
base model's reasoning does:

    direct    "17 + 4 + 23 + 9 = 53\\nAnswer: 53"                 short; the whole sum in one go (error-prone)
    stepwise  "17 + 4 = 21\\n21 + 23 = 44\\n44 + 9 = 53\\nAnswer: 53"  one line per partial sum
    split     "17 + 4 = 21\\n21 + 20 = 41\\n41 + 3 = 44\\n44 + 9 = 53\\nAnswer: 53"
              as stepwise, but a two-digit operand is added in two easy lines (tens, then ones)

Every digit is its own token (Qwen2's pre-tokenisation), so a line costs about 11 tokens and the split style of
a long chain runs past a short generation budget: one group of samples holds short, medium and truncated
responses, and the longer styles are the more reliable ones where they fit. The rows have the DAPO-Math-17k
schema of tasks/arithmetic.py; the style of each worked solution is in
`extra_info["style"]`.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from tasks.catalog import CHAIN_LEVELS, in_eval_split, problem_limit, task_row

CHAIN_STYLES = ("direct", "stepwise", "split")


def _is_eval_chain(terms: Sequence[int], eval_share: float) -> bool:
    """`in_eval_split` of the sorted terms: reorderings of one problem (same sum) fall in one split."""
    return in_eval_split(" + ".join(map(str, sorted(terms))), eval_share)


def _add_lines(total: int, operand: int, style: str) -> list[str]:
    """The lines that add `operand` to the running `total` in a stepwise or split solution."""
    tens, ones = operand - operand % 10, operand % 10
    if style == "split" and tens and ones:
        return [f"{total} + {tens} = {total + tens}", f"{total + tens} + {ones} = {total + operand}"]
    return [f"{total} + {operand} = {total + operand}"]


def chain_solution(terms: Sequence[int], style: str) -> str:
    """The worked solution of `terms` in one of CHAIN_STYLES (see the module docstring), ending with the
    "Answer: S" line the rule reward reads."""
    if style not in CHAIN_STYLES:
        raise ValueError(f"chain-sum style must be one of {CHAIN_STYLES}, got {style!r}")
    answer = sum(terms)
    if style == "direct":
        lines = [f"{' + '.join(map(str, terms))} = {answer}"]
    else:
        # The first two terms in one line (as the direct style writes them), then one operand at a time.
        lines, total = [f"{terms[0]} + {terms[1]} = {terms[0] + terms[1]}"], terms[0] + terms[1]
        if style == "split":
            lines = _add_lines(terms[0], terms[1], style)
        for operand in terms[2:]:
            lines += _add_lines(total, operand, style)
            total += operand
    return "\n".join(lines + [f"Answer: {answer}"])


def synthetic_chain_rows(
    num: int,
    *,
    difficulty: int = 2,
    split: str = "train",
    seed: int = 0,
    eval_share: float = 0.2,
    style_shares: Sequence[float] = (1 / 3, 1 / 3, 1 / 3),
) -> list[dict]:
    """`num` distinct chain sums of one split, as DAPO-schema rows with worked solutions.

    The number of terms is drawn uniformly from the level's range, then the terms; a problem already drawn
    (or of the other split) is drawn again, number of terms included, so a level whose short chains run out
    of distinct problems gets more long ones. style_shares: the shares of CHAIN_STYLES among the worked
    solutions (drawn per problem from a separate generator: the problems do not depend on them).
    """
    if len(style_shares) != len(CHAIN_STYLES) or min(style_shares) < 0 or abs(sum(style_shares) - 1) > 1e-9:
        raise ValueError(f"style_shares must be {len(CHAIN_STYLES)} shares >= 0 summing to 1, got {style_shares}")
    most = problem_limit("chain", difficulty, split, eval_share)
    if num > most:
        raise ValueError(f"chain-sum level {difficulty} has at most {most} distinct {split} problems; asked for {num}")
    fewest, longest, limit = CHAIN_LEVELS[difficulty]
    rng = random.Random(f"chain-{seed}-{difficulty}")
    style_rng = random.Random(f"chain-{seed}-{difficulty}-{split}-style")
    rows: list[dict] = []
    seen: set[tuple[int, ...]] = set()
    while len(rows) < num:
        terms = tuple(rng.randrange(1, limit) for _ in range(rng.randint(fewest, longest)))
        if terms in seen or _is_eval_chain(terms, eval_share) != (split == "eval"):
            continue
        seen.add(terms)
        text = " + ".join(map(str, terms))
        style = style_rng.choices(CHAIN_STYLES, weights=style_shares)[0]
        solution = chain_solution(terms, style)
        extra = {"index": len(rows), "split": split, "terms": len(terms), "style": style, "solution": solution}
        rows.append(task_row(f"synthetic_chain_l{difficulty}", text, sum(terms), extra))
    return rows
