"""The reward of a batch of responses, as training (trainer/scoring.py) and evaluation (evaluation/evaluate.py) both
read it: one `Verdict` per response, from the paper's rule reward or from the user's functions.

    reward.function = ""                      the rule reward of rl/reward.py `compute_score`, in the trainer's own
                                              process (a few microseconds a response; algorithm.strict_box applies)
    reward.function = "pkg.module:fn"         the user's function, in a pool of worker processes (rewards/pool.py)
    reward.function = "path/to/file.py:fn"    the same, from a file

A user's function is called with a batch, as TRL calls its reward_funcs:

    fn(responses: list[str], ground_truths: list[str | tuple[str, ...]], **columns) -> list[float | dict]

responses: the decoded responses (rl/reward.py `response_text`); ground_truths: each prompt's data.answer_key;
columns: every other column of the prompt set (data/prompt_row.py), one list each, as keyword arguments (a function
that needs none takes **kwargs). It returns one value per response: a number (the score), or a dict with a "score"
and optionally "acc" (the verdict dynamic sampling and avg@k read: any value, taken as its truth), "pred" (the
extracted answer, a str or None: rollout dumps and maj@k read it) and other numbers, logged each step as
`reward/<function>/<key>`, the mean over the step's responses (the keys of its first answers, at the check: every
rank logs the same). Without an "acc", a response is correct when its score is above 0. Numbers are finite.
(One function: several, as TRL's reward_weights combine them, are a sum the user's own function can compute.)

Before any training (and before eval.py evaluates) the functions are `check`ed: imported and called once on the
first rows of the prompt set, each row's ground truth standing in for a response; what fails is one line, exit 2.
The soft overlong punishment (Eq. 13), overlong filtering and dynamic sampling apply on top, unchanged.
"""

from __future__ import annotations

import logging
import math
import numbers
import os
import reprlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from config.cli import absolute_spec
from errors import RewardError
from rewards.pool import WorkerPool
from rl import reward as rule

if TYPE_CHECKING:
    from config.schema import Config
    from data.prompts import PromptExample
    from model.tokenizer import Tokenizer
    from rollout.engine import Completion

log = logging.getLogger(__name__)
CHECK_ROWS = 4  # rows of the prompt set a function is first called on
KEPT = ("acc", "pred")  # a dict's keys that are not numbers
WANTED = "a reward is a finite number, or a dict of a finite 'score', 'acc', 'pred' (str or None), finite numbers"


@dataclass(frozen=True)
class Verdict:
    """One response's reward: its score, whether it is correct, the answer read from it, and other numbers."""

    score: float
    acc: bool
    pred: str | None = None
    metrics: dict[str, float] = field(default_factory=dict)


class Scorer:
    """The rule reward (no `spec`; strict_box: boxed answers only), or the user's function `spec` in a WorkerPool
    started at once (`pool`: its settings); `metric_names`: the Verdict.metrics logged."""

    def __init__(self, spec: str = "", strict_box: bool = False, **pool: Any):
        self.spec, self.name, self.strict_box = spec, spec.rpartition(":")[2], strict_box
        # A loaded configuration's file is absolute already (config/cli.py); another is the working directory's
        self.pool = WorkerPool(absolute_spec(spec, os.getcwd()), **pool) if spec else None
        self.metric_names: tuple[str, ...] = ()

    def score(self, responses: Sequence[str], examples: Sequence[PromptExample]) -> list[Verdict]:
        if self.pool is None:  # rl.reward's, looked up at each call (tests plant their own)
            scored = (rule.compute_score(r, e.ground_truth, self.strict_box) for r, e in zip(responses, examples))
            return [Verdict(**s) for s in scored]
        columns = {name: [e.extra.get(name) for e in examples] for name in (examples[0].extra if examples else {})}
        values = self.pool.run(list(responses), [e.ground_truth for e in examples], columns)
        return [self._verdict(i, value) for i, value in enumerate(values)]

    def score_completions(
        self,
        tokenizer: Tokenizer,
        completions: Sequence[Completion],
        examples: Sequence[PromptExample],
        stop_ids: Sequence[int],
    ) -> list[Verdict]:
        """The verdicts of completions grouped by prompt (the same number of each example's, in order), each on its
        rl/reward.py `response_text` (special tokens, such as the final <|im_end|>, are not part of the answer):
        training and evaluation both score here, so the same tokens get the same reward in both."""
        k = len(completions) // max(len(examples), 1)
        texts = [rule.response_text(tokenizer, c.token_ids, stop_ids) for c in completions]
        return self.score(texts, [e for e in examples for _ in range(k)])

    def check(self, examples: Sequence[PromptExample]) -> None:
        """The functions called on the first rows, their ground truths as responses; the scores logged."""
        if self.pool is None:
            return
        rows = list(examples[:CHECK_ROWS])
        truths = [r.ground_truth if isinstance(r.ground_truth, str) else r.ground_truth[0] for r in rows]
        verdicts = self.score(truths, rows)
        self.metric_names = tuple(verdicts[0].metrics) if verdicts else ()
        scores = ", ".join(f"{v.score:g}" for v in verdicts)
        log.info("reward %s: on %d rows, their ground truths as responses, it scores %s", self.spec, len(rows), scores)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()

    def _verdict(self, i: int, value: Any) -> Verdict:
        """Response i's verdict from the function's value (module docstring); a RewardError showing a wrong one."""
        part = value if isinstance(value, dict) else {"score": value}
        numbers_ok = all(isinstance(v, numbers.Real) and math.isfinite(v) for k, v in part.items() if k not in KEPT)
        if "score" not in part or not numbers_ok or not isinstance(part.get("pred"), (str, type(None))):
            self.close()
            raise RewardError(f"reward function {self.spec} returned {reprlib.repr(value)} for response {i}: {WANTED}")
        metrics = {f"{self.name}/{key}": float(v) for key, v in part.items() if key not in ("score", *KEPT)}
        acc = bool(part["acc"]) if "acc" in part else part["score"] > 0
        return Verdict(float(part["score"]), acc, part.get("pred"), metrics)


def build_scorer(cfg: Config) -> Scorer:
    """The reward the configuration names (module docstring); a user's function's worker processes started."""
    rw = cfg.reward
    recycle = (rw.recycle_batches, rw.recycle_rss_mb)
    return Scorer(rw.function, cfg.algorithm.strict_box, workers=rw.workers, timeout_s=rw.timeout_s, recycle=recycle)
