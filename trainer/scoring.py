"""Turn engine completions into scored groups: reward (rule + soft overlong punishment) per sample.

    score_i = R_rule(o_i) + R_length(|o_i|)      R_rule = +1 / -1 (rl/reward.py), R_length = Eq. 13

R_rule reads `response_text(o_i)`, the text evaluation (evaluation/evaluate.py) scores too: the same tokens get the
same reward in training and in evaluation.

The groups carry their samples as payload; dynamic sampling (rl/filter.py) reads `acc` (before the
overlong penalty, the recipe's default) or `score`.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

from rl.data import PromptExample
from rl.filter import ScoredGroup
from rl.prompt_row import GroundTruth
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


def response_text(tokenizer, token_ids: Sequence[int], stop_ids: Collection[int] = ()) -> str:
    """The text the reward reads, in training and in evaluation alike.

    A completion holds the generated ids only (no padding), ending with the stop token when it finished
    with "stop". The ids are decoded with special tokens skipped, as verl's reward managers decode the
    valid response ids: the stop token (<|im_end|>, <|endoftext|>) and any other special token the policy
    wrote inside its text are not text. A final stop id that is not a special token of the tokenizer is
    dropped as well: it ended the response and is no part of the answer.
    """
    ids = list(token_ids)
    if ids and ids[-1] in stop_ids:
        ids.pop()
    return tokenizer.decode(ids, skip_special_tokens=True)


def rule_score(
    tokenizer,
    token_ids: Sequence[int],
    ground_truth: GroundTruth,
    *,
    stop_ids: Collection[int] = (),
    strict_box: bool = False,
) -> dict:
    """compute_score (rl/reward.py) of a completion's `response_text`: {"score", "acc", "pred"}."""
    return compute_score(response_text(tokenizer, token_ids, stop_ids), ground_truth, strict_box=strict_box)


def check_completions(completions: Sequence, num_prompts: int, n: int) -> None:
    """Raise EngineFailure unless the engine returned n completions per prompt, none aborted, grouped by
    prompt (prompt p's at positions p * n ... p * n + n - 1). Scoring the rest of an incomplete answer
    would bias the reward and the accuracy."""
    expected = num_prompts * n
    if len(completions) != expected:
        raise EngineFailure(
            f"the engine returned {len(completions)} completions for {num_prompts} prompts x "
            f"{n} samples (expected {expected})"
        )
    aborted = [c for c in completions if c.finish_reason == "abort"]
    if aborted:
        raise EngineFailure(
            f"the engine aborted {len(aborted)} of {expected} requests (finish reason 'abort'), "
            f"first: prompt {aborted[0].prompt_index}, sample {aborted[0].sample_index}"
        )
    for p in range(num_prompts):
        found = [c.prompt_index for c in completions[p * n : (p + 1) * n]]
        if any(index != p for index in found):
            raise EngineFailure(
                f"completions are not grouped by prompt: positions {p * n} to {(p + 1) * n - 1} "
                f"should all belong to prompt {p}, got prompt indices {found}"
            )


def score_groups(
    examples: list[PromptExample],
    completions,
    n: int,
    tokenizer,
    settings: RewardSettings,
    stop_ids: set[int],
    step: int = 0,
) -> list[ScoredGroup]:
    """Score the n completions of every prompt; one ScoredGroup (payload: list[Sample]) per prompt."""
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
