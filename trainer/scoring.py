"""Turn engine completions into scored groups: reward (rule + soft overlong punishment) per sample.

    score_i = R_rule(o_i) + R_length(|o_i|)      R_rule = +1 / -1 (rl/reward.py), R_length = Eq. 13

The groups carry their samples as payload; dynamic sampling (rl/filter.py) reads `acc` (before the
overlong penalty, the recipe's default) or `score`.
"""

from __future__ import annotations

from dataclasses import dataclass

from rl.data import PromptExample
from rl.filter import ScoredGroup
from rl.reward import compute_score, overlong_penalty


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


@dataclass(frozen=True)
class RewardSettings:
    max_response_length: int
    overlong_penalty: bool = True
    overlong_buffer: int = 4096
    overlong_penalty_factor: float = 1.0
    strict_box: bool = False


class EngineFailure(RuntimeError):
    """The engine returned an aborted request or failed; carries how many requests were in flight."""


def decode_response(tokenizer, token_ids: list[int], stop_ids: set[int]) -> str:
    """Response text for the scorer: the stop token (kept in `token_ids` for training) is not text."""
    if token_ids and token_ids[-1] in stop_ids:
        token_ids = token_ids[:-1]
    return tokenizer.decode(token_ids)


def score_groups(examples: list[PromptExample], completions, n: int, tokenizer, settings: RewardSettings,
                 stop_ids: set[int], step: int = 0) -> list[ScoredGroup]:
    """Score the n completions of every prompt; one ScoredGroup (payload: list[Sample]) per prompt."""
    if len(completions) != len(examples) * n:
        raise EngineFailure(f"engine returned {len(completions)} completions for {len(examples)} prompts x {n} samples")
    aborted = [c for c in completions if c.finish_reason == "abort"]
    if aborted:
        raise EngineFailure(f"engine aborted {len(aborted)} of {len(completions)} requests "
                            f"(first: prompt {aborted[0].prompt_index}, sample {aborted[0].sample_index})")
    groups = []
    for p, example in enumerate(examples):
        samples = []
        for c in completions[p * n:(p + 1) * n]:
            if c.prompt_index != p:
                raise EngineFailure(f"completions are not grouped by prompt: expected prompt {p}, got {c.prompt_index}")
            result = compute_score(decode_response(tokenizer, c.token_ids, stop_ids), example.ground_truth,
                                   strict_box=settings.strict_box)
            score = result["score"]
            if settings.overlong_penalty:
                score += overlong_penalty(len(c.token_ids), settings.max_response_length, settings.overlong_buffer,
                                          settings.overlong_penalty_factor)
            samples.append(Sample(example, list(c.token_ids), list(c.logprobs), c.finish_reason,
                                  bool(result["acc"]), float(score), result["pred"], step))
        groups.append(ScoredGroup(payload=samples, acc=tuple(s.acc for s in samples),
                                  score=tuple(s.score for s in samples)))
    return groups
