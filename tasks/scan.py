"""The scan task: valid reasoning whose length varies, for the length-budget probe (bench/mechanisms.py).

A problem lists k two-digit numbers of which exactly one is even ("What is the even number in 23 45 17 38 11 59
71 93 25 67?"), at a position drawn uniformly from 1..k. A worked solution checks the numbers in order until it
finds it, one line per number, in one of two styles:

    long    "23 is odd, not it\\n45 is odd, not it\\n38 is even, found it\\nAnswer: 38"   (most solutions)
    short   "23 odd\\n45 odd\\n38 even\\nAnswer: 38"                                  (the others)

Both are right; a long line costs twice the tokens of a short one. A solution's length grows with the answer's
position, so a length cap that binds on the long style's latest answers truncates valid reasoning: what overlong
filtering, the soft punishment and the token-level loss act on. A response that gives its answer before its
lines reach the even number has answered early (a guess). `read_scan` reads a response back.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from dataclasses import dataclass

from tasks.catalog import SCAN_LEVELS, in_eval_split, problem_limit, task_row

STYLES = ("long", "short")
_LINES = {
    "long": ("{} is odd, not it", "{} is even, found it"),
    "short": ("{} odd", "{} even"),
}
_CHECK = re.compile(r"^(\d+) (?:is )?(odd|even)(?:, (?:not|found) it)?$")
_ANSWER = re.compile(r"^Answer: (\d+)$")


def scan_solution(numbers: Sequence[int], style: str) -> str:
    """The worked solution of a problem (exactly one even number in `numbers`) in one of STYLES."""
    if style not in STYLES:
        raise ValueError(f"scan style must be one of {STYLES}, got {style!r}")
    odd, even = _LINES[style]
    lines = []
    for n in numbers:
        lines.append((even if n % 2 == 0 else odd).format(n))
        if n % 2 == 0:
            return "\n".join([*lines, f"Answer: {n}"])
    raise ValueError(f"no even number in {list(numbers)}")


@dataclass(frozen=True)
class ScanReading:
    """What a response did: its style ("long", "short", "mixed", or "none" without a check line), the numbers its
    check lines named, in order, and its answer (None without an "Answer:" line)."""

    style: str
    checked: tuple[int, ...]
    answer: int | None


def read_scan(text: str) -> ScanReading:
    """Read a response line by line: check lines (either style), then the first "Answer: N" line."""
    styles, checked, answer = set(), [], None
    for line in text.split("\n"):
        line = line.strip()
        if match := _ANSWER.match(line):
            answer = int(match.group(1))
            break
        if match := _CHECK.match(line):
            checked.append(int(match.group(1)))
            styles.add("long" if " is " in line else "short")
    style = "none" if not styles else styles.pop() if len(styles) == 1 else "mixed"
    return ScanReading(style, tuple(checked), answer)


def answered_early(reading: ScanReading, numbers: Sequence[int], position: int) -> bool:
    """Whether the response answered before its check lines reached the even number (at 1-based `position`)."""
    return reading.answer is not None and numbers[position - 1] not in reading.checked


def synthetic_scan_rows(
    num: int, *, difficulty: int = 1, split: str = "train", seed: int = 0, eval_share: float = 0.2
) -> list[dict]:
    """`num` distinct problems of one split as DAPO-schema rows with worked solutions; SCAN_LEVELS[difficulty] =
    (numbers per problem, share of short solutions). extra_info: "numbers", "position" (1-based, of the even one),
    "style"."""
    most = problem_limit("scan", difficulty, split, eval_share)
    if num > most:
        raise ValueError(f"scan level {difficulty} has at most {most} distinct {split} problems; asked for {num}")
    k, short_share = SCAN_LEVELS[difficulty]
    rng = random.Random(f"scan-{seed}-{difficulty}")
    style_rng = random.Random(f"scan-{seed}-{difficulty}-{split}-style")
    rows: list[dict] = []
    seen: set[tuple[int, ...]] = set()
    while len(rows) < num:
        position = rng.randint(1, k)
        numbers = [rng.randrange(11, 100, 2) for _ in range(k)]
        numbers[position - 1] = rng.randrange(10, 100, 2)
        text = " ".join(map(str, numbers))
        if tuple(numbers) in seen or in_eval_split(text, eval_share) != (split == "eval"):
            continue
        seen.add(tuple(numbers))
        style = "short" if style_rng.random() < short_share else "long"
        extra = {"index": len(rows), "split": split, "numbers": numbers, "position": position, "style": style}
        extra["solution"] = scan_solution(numbers, style)
        question = f"the even number in {text}"
        rows.append(task_row(f"synthetic_scan_l{difficulty}", question, numbers[position - 1], extra))
    return rows
