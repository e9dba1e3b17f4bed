"""Engine completions -> scored groups: the rule reward of every sample, plus the soft overlong punishment (Eq. 13).

    score_i = R_rule(o_i) + R_length(|o_i|)      R_rule = +1 / -1 (rl/reward.py), R_length = Eq. 13

R_rule reads `response_text(o_i)` (rl/reward.py), the text evaluation (evaluation/) scores too: the same tokens
get the same reward in training and in evaluation.

The groups carry their samples as payload; dynamic sampling (rl/filter.py) reads `acc` (before the
overlong penalty, the recipe's default) or `score`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from rl.filter import ScoredGroup
from rl.reward import overlong_penalty, rule_score
from trainer.types import RolloutGroup, Sample

if TYPE_CHECKING:
    from config import Config
    from data.prompts import PromptExample
    from model.tokenizer import Tokenizer
    from rollout.engine import Completion


def score_groups(
    examples: Sequence[PromptExample],
    completions: Sequence[Completion],
    tokenizer: Tokenizer,
    cfg: Config,
    step: int = 0,
) -> list[RolloutGroup]:
    """One RolloutGroup per prompt from its n completions (grouped by prompt, as the engine's generate returns
    them). The rule reward of each (algorithm.strict_box: boxed answers only), plus, with
    algorithm.overlong_penalty, Eq. 13 with L_max = rollout.max_response_length, L_cache = algorithm.overlong_buffer."""
    n, alg, stop_ids = len(completions) // max(len(examples), 1), cfg.algorithm, tokenizer.stop_ids
    groups = []
    for p, example in enumerate(examples):
        samples = []
        for c in completions[p * n : (p + 1) * n]:
            result = rule_score(
                tokenizer, c.token_ids, example.ground_truth, stop_ids=stop_ids, strict_box=alg.strict_box
            )
            score = result["score"]
            if alg.overlong_penalty:
                length, l_max = len(c.token_ids), cfg.rollout.max_response_length
                score += overlong_penalty(length, l_max, alg.overlong_buffer, alg.overlong_penalty_factor)
            acc, pred = bool(result["acc"]), result["pred"]
            samples.append(
                Sample(example, list(c.token_ids), list(c.logprobs), c.finish_reason, acc, score, pred, step)
            )
        groups.append(ScoredGroup(samples, acc=tuple(s.acc for s in samples), score=tuple(s.score for s in samples)))
    return groups
