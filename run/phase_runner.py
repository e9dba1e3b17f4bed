"""What every phase of a run does around its steps, in one place for the supervised warm-up and the DAPO loop:

    resume       the phase's newest intact checkpoint (parallel/checkpoint.py verifies it first)
    interval     a checkpoint every `interval` steps (0: none)
    stop         after a first SIGTERM / SIGINT on any rank (run/signals.py): a checkpoint of the last
                 completed step, then StopRequested on every rank (train.py exits 143 / 130)
    failure      a checkpoint of the last completed step, then the error (`stop_with_checkpoint`)

A phase hands the runner what it checkpoints (`Checkpointed`: the model, its optimizer and schedule) and,
at each save, its own state as plain data (`extra`); a checkpoint that exists already is not written twice.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn

import torch

from parallel.finite import NonFiniteStateError
from run.signals import StopRequested

if TYPE_CHECKING:
    from parallel.checkpoint import CheckpointManager
    from parallel.dist_env import DistEnv
    from run.signals import GracefulStop

Extra = Callable[[], dict[str, Any]]  # the phase's own state, as plain data, at the moment of a save


@dataclass(frozen=True)
class Checkpointed:
    """What a phase's checkpoints hold besides its own state."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler


class PhaseRunner:
    """Resume, interval checkpoints and stop -> checkpoint -> exit for one phase.

    checkpoints: the phase's folder; interval: steps between checkpoints (0: none); last_step: a step whose
    end is checkpointed by whoever ends the phase, so no interval checkpoint is written there (None: every
    interval step); step_name: how a stop names the step it saved ("step", "supervised warm-up step"); stop:
    the run's signal listener (None: no stops).
    """

    def __init__(
        self,
        checkpoints: CheckpointManager,
        state: Checkpointed,
        stop: GracefulStop | None,
        dist_env: DistEnv,
        *,
        interval: int,
        step_name: str = "step",
        last_step: int | None = None,
    ):
        self.checkpoints, self.state, self.stop, self.dist = checkpoints, state, stop, dist_env
        self.interval, self.step_name, self.last_step = interval, step_name, last_step

    def resume(self) -> dict[str, Any] | None:
        """The newest intact checkpoint loaded into the model, optimizer and schedule; its extra state (None:
        nothing to resume)."""
        s = self.state
        return self.checkpoints.resume(s.model, s.optimizer, s.scheduler)

    def save(self, step: int, extra: Extra) -> None:
        """A checkpoint of `step` (none when it exists already)."""
        if step in self.checkpoints.complete_steps():
            return
        s = self.state
        self.checkpoints.save(step, s.model, s.optimizer, s.scheduler, extra())

    def end_of_step(self, step: int, extra: Extra) -> None:
        """After `step` completed: its interval checkpoint when due, then a stop when one was asked for."""
        if self.interval and step % self.interval == 0 and step != self.last_step:
            self.save(step, extra)
        self.stop_if_requested(step, extra)

    def stop_if_requested(self, step: int, extra: Extra | None) -> None:
        """At a phase boundary: after a first SIGTERM / SIGINT on any rank (a collective), checkpoint `step`
        (extra None: no checkpoint) and raise StopRequested."""
        if self.stop is not None and self.stop.requested(self.dist):
            error = StopRequested(self.stop.signal_name or "a signal", step, phase=self.step_name)
            self.stop_with_checkpoint(step, extra, error)

    def stop_with_checkpoint(
        self, step: int, extra: Extra | None, error: BaseException, cause: BaseException | None = None
    ) -> NoReturn:
        """Checkpoint `step` (extra None: no checkpoint), then raise `error`. A policy gone non-finite is not
        saved: the refusal is then the error (parallel/finite.py)."""
        if extra is not None:
            try:
                self.save(step, extra)
            except NonFiniteStateError as refused:
                raise refused from error
        raise error from cause
