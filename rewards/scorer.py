"""The reward of a batch of responses, as training (trainer/scoring.py) and evaluation (evaluation/evaluate.py) both
read it: one `Verdict` per response, from the paper's rule reward or from the user's functions.

    reward.function = ""                      the rule reward of rl/reward.py `compute_score`, in the trainer's own
                                              process (a few microseconds a response; algorithm.strict_box applies)
    reward.function = "pkg.module:fn"         the user's function(s), in a pool of worker processes (rewards/pool.py)
    reward.function = ["a.py:fn", "b:g"]      several, their scores summed with reward.weights (TRL's reward_weights)

A user's function is called with a batch, as TRL calls its reward_funcs:

    fn(responses: list[str], ground_truths: list[str | tuple[str, ...]], **columns) -> list[float | dict]

responses: the decoded responses (rl/reward.py `response_text`); ground_truths: each prompt's data.answer_key;
columns: every other column of the prompt set (data/prompt_row.py), one list each, as keyword arguments (a function
that needs none takes **kwargs). It returns one value per response: a number (the score), or a dict with a "score"
and optionally "acc" (the verdict dynamic sampling and avg@k read: any value, taken as its truth), "pred" (the
extracted answer, a str or None: rollout dumps and maj@k read it) and other numbers, logged each step as
`reward/<function>/<key>`, the mean over the step's responses. Without an "acc", a response is correct when its
score is above 0. Every return of a function has the same form (the same keys); numbers are finite.

With several functions the score is sum_k w_k score_k; "acc" and "pred" are the first function's (the task's
verdict; the others shape the score), and each function's own score is logged as `reward/<function>/score`.

Before any training (and before eval.py evaluates) the functions are `check`ed: imported and called once on the
first rows of the prompt set, each row's ground truth standing in for a response; what fails is one line, exit 2.
The soft overlong punishment (Eq. 13), overlong filtering and dynamic sampling apply on top, unchanged.
"""

from __future__ import annotations

import logging
import math
import numbers
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from errors import RewardError
from rewards.pool import WorkerPool
from rl import reward as rule

if TYPE_CHECKING:
    from config.schema import Config
    from data.prompts import PromptExample

log = logging.getLogger(__name__)
CHECK_ROWS = 4  # rows of the prompt set a function is first called on


@dataclass(frozen=True)
class Verdict:
    """One response's reward: its score, whether it is correct, the answer read from it, and other numbers."""

    score: float
    acc: bool
    pred: str | None = None
    metrics: dict[str, float] = field(default_factory=dict)


class Scorer(Protocol):
    metric_names: tuple[str, ...]  # the `Verdict.metrics` every verdict carries (logged under reward/)

    def score(self, responses: Sequence[str], examples: Sequence[PromptExample]) -> list[Verdict]: ...

    def check(self, examples: Sequence[PromptExample]) -> None: ...

    def close(self) -> None: ...


class RuleScorer:
    """The paper's rule reward (rl/reward.py `compute_score`), in this process; strict_box: boxed answers only."""

    metric_names: tuple[str, ...] = ()

    def __init__(self, strict_box: bool = False):
        self.strict_box = strict_box

    def score(self, responses: Sequence[str], examples: Sequence[PromptExample]) -> list[Verdict]:
        return [Verdict(**rule.compute_score(r, e.ground_truth, self.strict_box)) for r, e in zip(responses, examples)]

    def check(self, examples: Sequence[PromptExample]) -> None:
        pass

    def close(self) -> None:
        pass


def resolve_spec(spec: str) -> str:
    """A "path/file.py:function" spec with its path made absolute, as a relative path in a configuration is
    read (the working directory's); a "package.module:function" spec as it is."""
    target, _, name = spec.rpartition(":")
    return f"{os.path.abspath(target)}:{name}" if target.endswith(".py") else spec


class FunctionScorer:
    """The user's functions `specs` with `weights`, in a WorkerPool (module docstring)."""

    def __init__(self, specs: Sequence[str], weights: Sequence[float] = (), **pool: Any):
        self.specs, self.weights = list(specs), list(weights) or [1.0] * len(specs)
        self.names = [spec.rpartition(":")[2] for spec in self.specs]
        self.pool = WorkerPool([resolve_spec(s) for s in self.specs], **pool)
        self.forms: list[frozenset[str] | None] = []  # each function's form: None (numbers) or its dicts' keys
        self.metric_names: tuple[str, ...] = ()

    def check(self, examples: Sequence[PromptExample]) -> None:
        """Import the functions and call them on the first rows, their ground truths as responses; log the scores."""
        rows = list(examples[:CHECK_ROWS])
        truths = [e.ground_truth if isinstance(e.ground_truth, str) else e.ground_truth[0] for e in rows]
        verdicts = self.score(truths, rows)
        self.metric_names = tuple(verdicts[0].metrics) if verdicts else ()
        log.info(
            "reward %s in %d worker processes: on %d rows, their ground truths as responses, scores %s",
            " + ".join(self.specs),
            len(self.pool.workers),
            len(rows),
            ", ".join(f"{v.score:g}" for v in verdicts),
        )

    def score(self, responses: Sequence[str], examples: Sequence[PromptExample]) -> list[Verdict]:
        truths = [e.ground_truth for e in examples]
        columns = {name: [e.extra.get(name) for e in examples] for name in (examples[0].extra if examples else {})}
        returns = self.pool.run(list(responses), truths, columns)
        if not self.forms and responses:  # the form every later return must have
            self.forms = [_form(values[0]) for values in returns]
        read = [[self._read(k, i, value) for i, value in enumerate(values)] for k, values in enumerate(returns)]
        return [self._combined([parts[i] for parts in read]) for i in range(len(responses))]

    def close(self) -> None:
        self.pool.close()

    def _read(self, k: int, i: int, value: object) -> dict[str, Any]:
        """Function k's return for response i as a dict with a finite "score"; a RewardError naming what is wrong."""
        form, problem = _form(value), None
        if isinstance(value, dict) and "score" not in value:
            problem = "a dict without a 'score'"
        elif not isinstance(value, dict) and not _number(value):
            problem = f"{_shown(value)}, not a number or a dict with a 'score'"
        elif form != self.forms[k]:
            keys = self.forms[k]
            was = "numbers" if keys is None else f"dicts with the keys {', '.join(sorted(keys))}"
            problem = f"{_shown(value)}, where its first return was {was}: return the same form every time"
        elif isinstance(value, dict):
            bad = [key for key, v in value.items() if key not in ("acc", "pred") and not _finite(v)]
            pred = value.get("pred")
            if bad:
                problem = f"a dict whose {bad[0]!r} is {_shown(value[bad[0]])}, not a finite number"
            elif pred is not None and not isinstance(pred, str):
                problem = f"a dict whose 'pred' is {_shown(pred)}, not a str or None"
        elif not _finite(value):
            problem = f"{_shown(value)}, not a finite number"
        if problem:
            self.pool.close()
            raise RewardError(f"reward function {self.specs[k]} returned {problem} for response {i}")
        return dict(value) if isinstance(value, dict) else {"score": value}

    def _combined(self, parts: list[dict[str, Any]]) -> Verdict:
        """One response's verdict from every function's return (module docstring)."""
        first = parts[0]
        score = math.fsum(w * float(p["score"]) for w, p in zip(self.weights, parts))
        metrics = {}
        for name, part in zip(self.names, parts):
            others = {k: v for k, v in part.items() if k not in ("acc", "pred") and (k != "score" or len(parts) > 1)}
            metrics.update({f"{name}/{k}": float(v) for k, v in others.items()})
        acc = bool(first["acc"]) if "acc" in first else float(first["score"]) > 0
        return Verdict(score, acc, first.get("pred"), metrics)


def _form(value: object) -> frozenset[str] | None:
    """A return's form: its keys for a dict, None for anything else."""
    return frozenset(value) if isinstance(value, dict) else None


def _number(value: object) -> bool:
    return isinstance(value, numbers.Real)  # a bool too: True scores 1


def _finite(value: object) -> bool:
    return _number(value) and math.isfinite(value)  # type: ignore[arg-type]


def _shown(value: object) -> str:
    return repr(value) if _number(value) else f"a {type(value).__name__}"


def build_scorer(cfg: Config) -> Scorer:
    """The reward the configuration names (module docstring); its worker processes started."""
    rw = cfg.reward
    if not rw.functions:
        return RuleScorer(cfg.algorithm.strict_box)
    pool = {"workers": rw.workers, "timeout_s": rw.timeout_s}
    pool |= {"recycle_batches": rw.recycle_batches, "recycle_rss_mb": rw.recycle_rss_mb}
    return FunctionScorer(rw.functions, rw.weights, **pool)
