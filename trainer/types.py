"""The data of one DAPO step, in the order it flows (a reader's first stop):

PromptExample (data/prompts.py)     a prompt's token ids, its chat messages and the ground truth
Sample                         one response to it: tokens, the engine's log-probs, how it ended, its reward
RolloutGroup                   a prompt's G samples, scored: dynamic sampling (Eq. 11) reads their accuracy
PackItem, MicroBatch           samples with their advantages (Eq. 9), packed into token-budgeted rows
                               (trainer/packing.py)
GlobalCounts, PassStats        a mini-batch's counts for Eq. 8 (rl/loss_modes.py), and what one loss pass tells
                               the metrics (trainer/losses.py)
StepRecord                     the step's line of metrics.jsonl (trainer/step_metrics.py)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TypeAlias

from data.prompts import PromptExample
from rl.filter import ScoredGroup


@dataclass
class Sample:
    example: PromptExample
    response_ids: list[int]
    rollout_logprobs: list[float]
    finish_reason: str  # "stop" | "length"
    acc: bool
    score: float  # rule reward + overlong penalty
    pred: str | None
    step: int = 0  # the training step whose rollout generated it (carried-over samples are older)
    reward_metrics: dict[str, float] = field(default_factory=dict)  # a reward function's other numbers


# A prompt's G samples from generation to packing: dynamic sampling (rl/filter.py) reads their acc or score,
# the update packs the samples.
RolloutGroup: TypeAlias = ScoredGroup[list[Sample]]


@dataclass
class SkippedUpdates:
    """Updates skipped in a row for a non-finite gradient norm (trainer/optimizer.py counts them; the loop's
    checkpoints carry the count over restarts)."""

    in_a_row: int = 0
