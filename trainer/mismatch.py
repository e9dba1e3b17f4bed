"""How far the engine's log-probs are from the trainer's, measured once per step (rl/correction.py).

Both sides score the same sampled tokens with the weights of the step's start: the trainer's pi_old where
it is recomputed, and, where the engine's log-probs serve as pi_old, the first mini-batch's loss pass (its
weights have not moved yet). The update hands the probe every log-prob it computes at those weights
(`MismatchProbe.saw`); the probe measures each micro-batch once, into the step's metrics.

    mean |delta|, max |delta|, k3 = E[exp(delta) - 1 - delta], share of |p_trainer - p_engine| > 0.1
    with delta = log p_trainer - log p_engine over the valid tokens of fresh samples
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from observe.records import Max, Mean, logged
from rl.correction import mismatch_metrics

if TYPE_CHECKING:
    import torch

    from trainer.packing import MicroBatch

log = logging.getLogger(__name__)

ROLLOUT_LOGP_TOLERANCE = 1e-3  # largest engine/trainer log-prob gap at which the engine's may serve as pi_old


@dataclass
class MismatchMetrics:
    """The step's engine vs trainer log-prob gap over the measured tokens (NaN where none was measured)."""

    mean_abs_logp: Mean = logged("mean_abs_logp", Mean)
    max_abs_logp: Max = logged("max_abs_logp", Max)
    k3_kl: Mean = logged("k3_kl", Mean)
    prob_diff: Mean = logged("prob_diff_gt_0.1", Mean)


class MismatchProbe:
    """The update's hook for one step: measures the micro-batches `first` (the first mini-batch's, whose
    loss pass runs at the step-start weights) and every recomputed pi_old, each once."""

    def __init__(self, metrics: MismatchMetrics, first: list[MicroBatch]):
        self.metrics, self.unmeasured = metrics, list(first)

    def saw(self, trainer_logp: torch.Tensor, mb: MicroBatch, *, step_start: bool = False) -> None:
        """The trainer's log-probs of `mb`: measured if they are at the step-start weights (`step_start`, or
        `mb` is one of the first mini-batch's, not measured yet)."""
        if not step_start and not any(mb is m for m in self.unmeasured):
            return
        self.unmeasured = [m for m in self.unmeasured if m is not mb]
        # Fresh tokens: carried-over samples differ by design (an older policy drew them).
        fresh = mb.mask * ~mb.stale.unsqueeze(1)
        _add(self.metrics, mismatch_metrics(trainer_logp, mb.rollout_logp, fresh))

    def warn_if_above(self, step: int, setting: str, tolerance: float = ROLLOUT_LOGP_TOLERANCE) -> None:
        """Where the engine's log-probs serve as pi_old: warn when they differ from the trainer's by more."""
        worst = self.metrics.max_abs_logp.result()
        if worst > tolerance:
            log.warning(
                "step %d: the engine's log-probs differ from the trainer's by up to %.2g, yet serve as pi_old "
                "(algorithm.old_logprobs = %r); set it to 'recompute'",
                step,
                worst,
                setting,
            )


def _add(metrics: MismatchMetrics, m: dict[str, torch.Tensor]) -> None:
    n = float(m["mismatch_num_tokens"])
    if n:
        metrics.mean_abs_logp.add(float(m["mismatch_abs_logp_mean"]) * n, n)
        metrics.max_abs_logp.add(float(m["mismatch_abs_logp_max"]))
        metrics.k3_kl.add(float(m["mismatch_k3_kl"]) * n, n)
        metrics.prob_diff.add(float(m["mismatch_prob_diff_frac"]) * n, n)
