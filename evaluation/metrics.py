"""Evaluation estimators: avg@k, unbiased pass@k and maj@k, per data source and overall.

Every problem is evaluated with n sampled responses, each scored by rl/reward.py. With c the number
of correct responses of a problem:

  * avg@n   = mean over problems of c / n (the DAPO paper's headline metric, avg@32 on AIME 2024).
  * pass@k  = mean over problems of the unbiased estimator of "at least one of k samples is correct"
              from n >= k samples (Chen et al. 2021, "Evaluating Large Language Models Trained on Code"):

                  pass@k = 1 - C(n - c, k) / C(n, k)

              i.e. one minus the chance that k samples drawn without replacement from the n are all
              wrong. pass@1 equals avg@n; pass@n is 1 exactly when c > 0.
  * maj@n   = mean over problems of [the majority-vote answer of the n samples is correct].

Majority vote (`majority_vote`), decided here once for every caller:
  * votes are cast for the *normalised* prediction (`vote_key`: rl/math_normalize.py's
    `normalize_final_answer`), so "\\frac12" and "\\frac{1}{2}" count as one answer;
  * a sample with no extractable answer (prediction None) casts no vote: "no answer" never wins
    while at least one sample answered; when none did, there is no winner and the problem counts
    as wrong;
  * ties between answers with the same number of votes go to the answer that occurs first in
    sample order (the lowest sample index), so the result never depends on hashing or sort order;
  * the winning answer is correct when the scorer judged its first sample correct. Samples of one
    vote class can only disagree when one was scored by the verbatim \\boxed{} rule and another by
    the normalised "Answer:" rule; taking the first sample keeps maj@1 == avg@1.

Aggregation: the overall row averages over all problems (each problem weighs the same), not over
the per-source averages.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from rl.checks import require_int
from rl.math_normalize import normalize_final_answer


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one problem from n samples with c correct: 1 - C(n - c, k) / C(n, k).

    Computed exactly in integers and rounded once: (C(n, k) - C(n - c, k)) / C(n, k) with Python's
    correctly rounded int / int division. Nothing overflows (C(2000, 1000) has 600 digits and is no
    float) and nothing cancels (the subtraction is exact), so tiny and near-1 values keep full
    precision. C(n - c, k) = 0 when n - c < k: every k-subset then holds a correct sample.
    """
    n, c, k = require_int("n", n), require_int("c", c), require_int("k", k)
    if n < 1:
        raise ValueError(f"pass@k needs n >= 1 samples, got n={n}")
    if not 0 <= c <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n correct samples, got c={c} with n={n}")
    if not 1 <= k <= n:
        raise ValueError(f"pass@k needs 1 <= k <= n (the estimator draws k of the n samples), got k={k} with n={n}")
    total = math.comb(n, k)
    return (total - math.comb(n - c, k)) / total


def vote_key(pred: str | None) -> str | None:
    """The answer a sample votes for: its normalised prediction, or None (no vote) when it has none."""
    if pred is None:
        return None
    if not isinstance(pred, str):
        raise TypeError(f"a prediction must be a str or None, got {type(pred).__name__}")
    return normalize_final_answer(pred)


def majority_vote(keys: Sequence[str | None]) -> int | None:
    """Index of the winning answer's first sample by the module docstring's rules (`keys` from `vote_key`),
    or None when no sample answered: ["4", "3", "3", "4", None, None, None] -> 0 ("4" and "3" tie, "4" came
    first; the three non-answers cast no vote)."""
    counts = Counter(key for key in keys if key is not None)
    if not counts:
        return None
    # most_common orders equal counts by first occurrence (documented), so a tie goes to the first answer.
    return list(keys).index(counts.most_common(1)[0][0])


@dataclass
class ProblemResult:
    """The n scored samples of one problem.

    acc[i]: sample i was judged correct; pred[i]: its extracted prediction (None: none found);
    response_length[i]: its length in tokens; truncated[i]: it hit the generation limit.
    """

    data_source: str
    acc: list[bool]
    pred: list[str | None]
    response_length: list[int] = field(default_factory=list)
    truncated: list[bool] = field(default_factory=list)

    def __post_init__(self) -> None:
        n = len(self.acc)
        if n == 0:
            raise ValueError(f"a problem of {self.data_source!r} has no samples")
        if len(self.pred) != n:
            raise ValueError(f"a problem of {self.data_source!r} has {n} verdicts but {len(self.pred)} predictions")
        for name in ("response_length", "truncated"):
            got = len(getattr(self, name))
            if got not in (0, n):
                raise ValueError(f"a problem of {self.data_source!r} has {n} samples but {got} {name} entries")

    @property
    def n(self) -> int:
        return len(self.acc)

    @property
    def num_correct(self) -> int:
        return sum(bool(a) for a in self.acc)

    def majority_correct(self) -> bool:
        """maj@n of this problem (the rules in the module docstring)."""
        winner = majority_vote([vote_key(p) for p in self.pred])
        return winner is not None and bool(self.acc[winner])


def avg_at_k(results: Sequence[ProblemResult]) -> float:
    """avg@n: mean over problems of (correct samples / samples)."""
    _require(results)
    return sum(r.num_correct / r.n for r in results) / len(results)


def mean_pass_at_k(results: Sequence[ProblemResult], k: int) -> float:
    """pass@k averaged over problems (each problem: `pass_at_k(n, c, k)`)."""
    _require(results)
    return sum(pass_at_k(r.n, r.num_correct, k) for r in results) / len(results)


def maj_at_k(results: Sequence[ProblemResult]) -> float:
    """maj@n: share of problems whose majority-vote answer is correct."""
    _require(results)
    return sum(r.majority_correct() for r in results) / len(results)


def _require(results: Sequence[ProblemResult]) -> None:
    if not results:
        raise ValueError("no problems to evaluate")


def pass_ks(k: int) -> tuple[int, ...]:
    """The pass@ values reported by default for k samples: 1 and k."""
    return (1,) if k == 1 else (1, k)


def summarize_group(results: Sequence[ProblemResult], ks: Iterable[int]) -> dict:
    """Metrics of one set of problems that all have the same number of samples n.

    Keys: num_problems, num_samples (n), avg@n, pass@j for every j in `ks`, maj@n, and, when the
    results carry them, response_length/mean (tokens, over all samples) and truncated_share.
    """
    _require(results)
    n = results[0].n
    if any(r.n != n for r in results):
        sizes = sorted({r.n for r in results})
        raise ValueError(f"problems have different sample counts {sizes}; avg@k / pass@k / maj@k need the same n")
    row: dict = {"num_problems": len(results), "num_samples": n, f"avg@{n}": avg_at_k(results)}
    for j in sorted(set(require_int("k", j) for j in ks)):
        row[f"pass@{j}"] = mean_pass_at_k(results, j)
    row[f"maj@{n}"] = maj_at_k(results)
    lengths = [x for r in results for x in r.response_length]
    if lengths:
        row["response_length/mean"] = sum(lengths) / len(lengths)
    flags = [bool(x) for r in results for x in r.truncated]
    if flags:
        row["truncated_share"] = sum(flags) / len(flags)
    return row


def summarize(results: Sequence[ProblemResult], ks: Iterable[int] | None = None) -> dict:
    """{"k": n, "overall": row, "by_source": {data_source: row}} (rows from `summarize_group`).

    Sources are listed in sorted order. `ks` defaults to `pass_ks(n)`.
    """
    _require(results)
    n = results[0].n
    ks = tuple(pass_ks(n) if ks is None else ks)
    by_source: dict[str, list[ProblemResult]] = {}
    for r in results:
        by_source.setdefault(r.data_source, []).append(r)
    return {
        "k": n,
        "overall": summarize_group(results, ks),
        "by_source": {source: summarize_group(by_source[source], ks) for source in sorted(by_source)},
    }
