"""Engine completions -> scored groups: the reward of every sample, plus the soft overlong punishment (Eq. 13).

    score_i = R(o_i) + R_length(|o_i|)      R = the rule reward, +1 / -1 (rl/reward.py), or the user's function
                                            (rewards/scorer.py); R_length = Eq. 13

R reads `response_text(o_i)` (rl/reward.py) in rewards/scorer.py Scorer.score_completions, where evaluation
(evaluation/) scores too: the same tokens get the same reward in training and in evaluation.

The groups carry their samples as payload; dynamic sampling (rl/filter.py) reads `acc` (before the overlong
penalty, the recipe's default) or `score`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from errors import RewardError
from rewards.scorer import Scorer
from rl.filter import ScoredGroup
from rl.reward import overlong_penalty
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
    scorer: Scorer | None = None,
) -> list[RolloutGroup]:
    """One RolloutGroup per prompt from its n completions (grouped by prompt, as the engine's generate returns
    them). The reward of each (`scorer`; None: the rule reward, algorithm.strict_box: boxed answers only), plus,
    with algorithm.overlong_penalty, Eq. 13 with L_max = rollout.max_response_length, L_cache =
    algorithm.overlong_buffer."""
    n, alg = len(completions) // max(len(examples), 1), cfg.algorithm
    try:
        verdicts = (scorer or Scorer(strict_box=alg.strict_box)).score_completions(
            tokenizer, completions, examples, tokenizer.stop_ids
        )
    except RewardError as exc:
        fix = "the run stops with a checkpoint of its last completed step: fix it, then rerun the same command"
        raise RewardError(f"{exc}; {fix}") from None
    groups = []
    for p, example in enumerate(examples):
        samples = []
        for c, verdict in zip(completions[p * n : (p + 1) * n], verdicts[p * n : (p + 1) * n]):
            score = verdict.score
            if alg.overlong_penalty:
                length, l_max = len(c.token_ids), cfg.rollout.max_response_length
                score += overlong_penalty(length, l_max, alg.overlong_buffer, alg.overlong_penalty_factor)
            ids, logprobs, acc, pred = list(c.token_ids), list(c.logprobs), verdict.acc, verdict.pred
            samples.append(Sample(example, ids, logprobs, c.finish_reason, acc, score, pred, step, verdict.metrics))
        groups.append(ScoredGroup(samples, acc=tuple(s.acc for s in samples), score=tuple(s.score for s in samples)))
    return groups
