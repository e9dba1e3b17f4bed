"""How far the engine's log-probs are from the trainer's, measured once per step (rl/correction.py).

Both sides score the same sampled tokens with the weights of the step's start: the trainer's pi_old
(recomputed), or, where the engine's log-probs serve as pi_old, the first mini-batch's loss pass (its
weights have not moved yet). A probe collects those (trainer log-probs, micro-batch) pairs during the step
and reduces them over every rank at its end.

    mean |delta|, max |delta|, k3 = E[exp(delta) - 1 - delta], share of |p_trainer - p_engine| > 0.1
    with delta = log p_trainer - log p_engine over the valid tokens of fresh samples
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from rl.correction import mismatch_metrics

if TYPE_CHECKING:
    from parallel.dist_env import DistEnv
    from trainer.packing import MicroBatch

MISMATCH_KEYS = ("mismatch/mean_abs_logp", "mismatch/max_abs_logp", "mismatch/k3_kl", "mismatch/prob_diff_gt_0.1")


@dataclass(frozen=True)
class Mismatch:
    """The step's engine vs trainer log-prob gap (NaN when no fresh sample was measured)."""

    mean_abs_logp: float = math.nan
    max_abs_logp: float = math.nan
    k3_kl: float = math.nan
    prob_diff_gt_0_1: float = math.nan

    def metrics(self) -> dict[str, float]:
        values = (self.mean_abs_logp, self.max_abs_logp, self.k3_kl, self.prob_diff_gt_0_1)
        return dict(zip(MISMATCH_KEYS, values))


@dataclass
class MismatchProbe:
    """The (trainer log-probs at the step-start weights [S, L], micro-batch) pairs of one step."""

    measured: list[tuple[torch.Tensor, MicroBatch]] = field(default_factory=list)

    def add(self, trainer_logp: torch.Tensor, mb: MicroBatch) -> None:
        self.measured.append((trainer_logp, mb))

    def result(self, dist_env: DistEnv) -> Mismatch:
        """The gap over every rank's measured tokens (two all-reduces: every rank calls it)."""
        sums = [0.0, 0.0, 0.0, 0.0]  # tokens, |delta| sum, k3 sum, |delta p| > 0.1 count
        worst = 0.0
        for trainer_logp, mb in self.measured:
            # Fresh samples only: carried-over ones differ by design (an older policy drew them).
            m = mismatch_metrics(trainer_logp, mb.rollout_logp, mb.mask * ~mb.stale.unsqueeze(1))
            n = float(m["mismatch_num_tokens"])
            sums[0] += n
            sums[1] += float(m["mismatch_abs_logp_mean"]) * n
            sums[2] += float(m["mismatch_k3_kl"]) * n
            sums[3] += float(m["mismatch_prob_diff_frac"]) * n
            worst = max(worst, float(m["mismatch_abs_logp_max"]))
        tokens, abs_sum, k3_sum, far = dist_env.all_reduce(sums)
        worst = dist_env.all_reduce([worst], op="max")[0]
        if not tokens:  # no fresh sample to compare: nothing measured
            return Mismatch()
        return Mismatch(abs_sum / tokens, worst, k3_sum / tokens, far / tokens)
