"""The policy's optimizer and its one step, shared by the DAPO update, the supervised warm-up and the rehearsal.

    build_optimizer   AdamW with the [optimizer] section's settings and its schedule
    OptimizerStep     clip the global gradient norm at optimizer.grad_clip, AdamW step, zero the gradients,
                      check that the weights are finite

A non-finite gradient norm skips the update (the weights and AdamW's state stay as they were) and is counted
(`SkippedUpdates`: in a row, across steps; the loop checkpoints the count and stops after
training.max_nonfinite_steps). Weights gone NaN or inf in a step cannot be taken back without a second copy of
the policy and its moments, so the run stops without saving that state (NonFiniteStateError) and a rerun
resumes from the newest checkpoint, which was verified finite when it was written (parallel/finite.py).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
from torch import nn

from parallel.finite import NonFiniteStateError, nonfinite_state
from parallel.grad_clip import clip_grad_norm_
from trainer.types import SkippedUpdates

if TYPE_CHECKING:
    from config.schema import OptimizerConfig

log = logging.getLogger(__name__)


def build_optimizer(
    params: Iterable[nn.Parameter],
    opt: OptimizerConfig,
    *,
    fused: bool | None = None,
    foreach: bool | None = None,
) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW over the trained ones of `params` (those that require a gradient: with LoRA the adapters, not the
    frozen base, parallel/lora.py) with the [optimizer] section's settings, and its schedule: a linear warm-up over
    the first `warmup_steps` rollout steps that update the policy (TrainPhase.run), then constant (the
    paper's schedule). fused / foreach: the kernel (parallel/adamw.py chooses it for a run; None: torch's)."""
    optimizer = torch.optim.AdamW(
        [p for p in params if p.requires_grad],
        lr=opt.lr,
        betas=(opt.betas[0], opt.betas[1]),
        eps=opt.eps,
        weight_decay=opt.weight_decay,
        fused=fused,
        foreach=foreach,
    )
    warmup = max(1, opt.warmup_steps)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup))


class OptimizerStep:
    """One update of `model` by `optimizer` (module docstring), with the [optimizer] section's grad_clip (0: the
    norm is measured, not clipped)."""

    def __init__(self, opt: OptimizerConfig, model: nn.Module, optimizer: torch.optim.Optimizer):
        self.model, self.optimizer, self.grad_clip = model, optimizer, opt.grad_clip
        self.skipped = SkippedUpdates()

    def __call__(self, where: str) -> float | None:
        """Clip, step, zero, check; returns the gradient norm, or None for a skipped update. `where` names the
        update in the log and in errors ("step 3, mini-batch 1")."""
        max_norm = self.grad_clip if self.grad_clip > 0 else float("inf")
        norm = float(clip_grad_norm_([p for p in self.model.parameters() if p.grad is not None], max_norm))
        self.skipped.in_a_row = 0 if math.isfinite(norm) else self.skipped.in_a_row + 1
        if not math.isfinite(norm):
            self.optimizer.zero_grad(set_to_none=True)
            log.warning("%s: non-finite gradient norm %s; update skipped", where, norm)
            return None
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        after = nonfinite_state(self.model)
        if after is not None:
            raise NonFiniteStateError(
                f"{where}: after the optimizer step {after} (gradient norm {norm:.4g}); stopping without saving "
                "this state: rerun the same command to resume from the newest checkpoint"
            )
        return norm
