"""What every phase of a run does around its steps, in one place for the supervised warm-up and the DAPO loop:

    resume       the phase's newest intact checkpoint (checkpoint/manager.py verifies it first)
    interval     a checkpoint every `interval` steps (0: none)
    stop         after a first SIGTERM / SIGINT on any rank (run/signals.py): a checkpoint of the last
                 completed step, then StopRequested on every rank (train.py exits 143 / 130)
    failure      a checkpoint of the last completed step, then the error (`stop_with_checkpoint`; the guard
                 around engine calls, run/guard.py, stops this way)

A phase hands the runner what it checkpoints (`Checkpointed`: the model, its optimizer and schedule, and how
to read the last completed step and the phase's own state as plain data); a checkpoint that exists already is
not written twice.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn

import torch

from parallel.finite import NonFiniteStateError
from run.signals import StopRequested

if TYPE_CHECKING:
    from checkpoint.manager import CheckpointManager
    from parallel.dist_env import DistEnv
    from run.signals import GracefulStop


@dataclass(frozen=True)
class Checkpointed:
    """What a phase's checkpoints hold: the model, its optimizer and schedule, and at the moment of a save the
    last completed step (`step`) and the phase's own state as plain data (`extra`)."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    step: Callable[[], int]
    extra: Callable[[], dict[str, Any]]


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
        return self.checkpoints.resume(self.state.model, self.state.optimizer, self.state.scheduler)

    def save(self) -> None:
        """A checkpoint of the last completed step (none when it exists already)."""
        s, step = self.state, self.state.step()
        if step not in self.checkpoints.complete_steps():
            self.checkpoints.save(step, s.model, s.optimizer, s.scheduler, s.extra())

    def end_of_step(self) -> None:
        """After a step completed: its interval checkpoint when due, then a stop when one was asked for."""
        step = self.state.step()
        if self.interval and step % self.interval == 0 and step != self.last_step:
            self.save()
        self.stop_if_requested()

    def stop_if_requested(self, *, anyone: bool | None = None) -> None:
        """At a phase boundary: after a first SIGTERM / SIGINT on any rank (a collective, unless the caller
        already agreed on it: `anyone`), checkpoint and raise StopRequested."""
        if self.stop is not None and self.stop.requested(self.dist, anyone):
            error = StopRequested(self.stop.signal_name or "a signal", self.state.step(), phase=self.step_name)
            self.stop_with_checkpoint(error)

    def stop_with_checkpoint(self, error: BaseException, cause: BaseException | None = None) -> NoReturn:
        """Checkpoint the last completed step, then raise `error`. A policy gone non-finite is not saved: the
        refusal is then the error (parallel/finite.py)."""
        try:
            self.save()
        except NonFiniteStateError as refused:
            raise refused from error
        raise error from cause
