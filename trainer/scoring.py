"""Turn engine completions into scored groups: reward (rule + soft overlong punishment) per sample.

    score_i = R_rule(o_i) + R_length(|o_i|)      R_rule = +1 / -1 (rl/reward.py), R_length = Eq. 13

R_rule reads `response_text(o_i)` (rl/reward.py), the text evaluation (evaluation/) scores too: the same tokens
get the same reward in training and in evaluation.

The groups carry their samples as payload; dynamic sampling (rl/filter.py) reads `acc` (before the
overlong penalty, the recipe's default) or `score`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rl.filter import ScoredGroup
from rl.reward import overlong_penalty, rule_score
from rollout.engine import Completion, check_completions
from trainer.types import RolloutGroup, Sample

if TYPE_CHECKING:
    from config import Config
    from model.tokenizer import Tokenizer
    from rl.data import PromptExample


@dataclass(frozen=True)
class RewardSettings:
    """The reward's settings: L_max (rollout.max_response_length) and the soft overlong punishment's buffer
    L_cache and factor (Eq. 13), and the rule reward's boxed-only mode."""

    max_response_length: int
    overlong_penalty: bool = True
    overlong_buffer: int = 4096
    overlong_penalty_factor: float = 1.0
    strict_box: bool = False

    @classmethod
    def from_config(cls, cfg: Config) -> RewardSettings:
        alg = cfg.algorithm
        return cls(
            cfg.rollout.max_response_length,
            alg.overlong_penalty,
            alg.overlong_buffer,
            alg.overlong_penalty_factor,
            alg.strict_box,
        )


def score_groups(
    examples: list[PromptExample],
    completions: Sequence[Completion],
    n: int,
    tokenizer: Tokenizer,
    settings: RewardSettings,
    stop_ids: set[int],
    step: int = 0,
) -> list[RolloutGroup]:
    """Score the n completions of every prompt; one RolloutGroup per prompt."""
    check_completions(completions, len(examples), n)
    groups = []
    for p, example in enumerate(examples):
        samples = []
        for c in completions[p * n : (p + 1) * n]:
            result = rule_score(
                tokenizer, c.token_ids, example.ground_truth, stop_ids=stop_ids, strict_box=settings.strict_box
            )
            score = result["score"]
            if settings.overlong_penalty:
                score += overlong_penalty(
                    len(c.token_ids),
                    settings.max_response_length,
                    settings.overlong_buffer,
                    settings.overlong_penalty_factor,
                )
            samples.append(
                Sample(
                    example,
                    list(c.token_ids),
                    list(c.logprobs),
                    c.finish_reason,
                    bool(result["acc"]),
                    float(score),
                    result["pred"],
                    step,
                )
            )
        groups.append(
            ScoredGroup(payload=samples, acc=tuple(s.acc for s in samples), score=tuple(s.score for s in samples))
        )
    return groups
