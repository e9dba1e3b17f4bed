"""Graceful stop on SIGTERM / SIGINT: the first signal asks the loop to stop at the next phase boundary
(during a generation: its next poll, run/guard.py; it then writes a checkpoint and exits non-zero); a second
signal exits at once. The rollout engine's process ignores both (rollout/engine_process.py): the trainer shuts it
down on its way out. Once training and its final evaluation are done, a signal stops nothing: the rest of the
run's end (its last checkpoint, HF export) is short next to a phase, and a run that exits 0 is not requeued
by its launcher. A finished run answers both with a line and exits 0, until its process is gone. `exit_with_codes`
gives an entry point's failures the exit codes a shell expects."""

from __future__ import annotations

import logging
import os
import signal
import sys
from collections.abc import Callable
from types import FrameType
from typing import TYPE_CHECKING, Any

from errors import RunStopped, report
from observe.console import once_per_job

if TYPE_CHECKING:
    from parallel.dist_env import DistEnv

log = logging.getLogger("train")

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopRequested(RunStopped):
    """Raised by the loop after it saved a checkpoint in response to a signal (exit 130 for SIGINT, else 143)."""

    def __init__(self, signal_name: str, step: int, phase: str = "step"):
        super().__init__(f"stopped by {signal_name} after {phase} {step}")
        self.signal_name, self.step = signal_name, step
        self.exit_code = 130 if signal_name == "SIGINT" else 143

    def line(self) -> str:
        return f"training {self}; a checkpoint was saved: run the same command again to resume"


class GracefulStop:
    def __init__(self) -> None:
        self.signal_name: str | None = None  # what stopped the run (this process's signal, or another rank's)
        self.received: str | None = None  # the signal this process itself received
        self.ending = False  # only the run's end is left: a signal from now on stops nothing
        self._previous: dict[int, Any] = {}

    def install(self) -> GracefulStop:
        for sig in SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def take_over(self, other: GracefulStop) -> GracefulStop:
        """Listen in `other`'s place, with no moment between the two when a signal meets the default handler
        (which kills: exit 143); `restore` then sets back what `other` found."""
        self._previous, other._previous = other._previous, {}
        for sig in self._previous:
            signal.signal(sig, self._handle)
        return self

    def only_the_end_left(self) -> None:
        """From now on a signal stops nothing (the run's end follows); one that came before still stops the run
        at the next `requested`, which the caller asks after this."""
        self.ending = True

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.ending:
            log.info("%s received: training is done; the run ends as planned (checkpoint, HF export), exit 0", name)
            return
        # Only this process's own second signal exits at once: a stop first seen on another rank (launchers
        # do not deliver to every rank at the same instant) must not turn this rank's first one into it.
        if self.received is not None:
            log.error("second signal (%s): exiting at once without a checkpoint", name)
            os._exit(128 + signum)
        self.received = self.signal_name = name
        log.warning(
            "%s received: finishing the current phase, then saving a checkpoint (send it again to exit at once)", name
        )

    def requested(self, dist_env: DistEnv, anyone: bool | None = None) -> bool:
        """True on every rank if any rank received a signal (ranks must stop at the same boundary); `anyone`:
        what the ranks already agreed on, else one all-reduce."""
        if anyone is None:
            anyone = dist_env.all_reduce([float(self.signal_name is not None)], op="max", group="world")[0] > 0
        if anyone and self.signal_name is None:
            self.signal_name = "a signal on another rank"
        return anyone


class NothingToStop(GracefulStop):
    """From the moment the run is finished: a SIGTERM / SIGINT stops nothing, says so, and the run exits 0.

    Inside `exit_with_codes` the process ends once its entry point returns, so `restore` ignores both signals
    instead of handing back the default handler: a signal during the interpreter's teardown (seconds for a
    large job) would otherwise turn the finished run's exit 0 into 143, and a launcher would requeue it."""

    process_ends_after = False  # set by exit_with_codes while it runs an entry point

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        log.info("%s received: the run is finished; nothing to stop", signal.Signals(signum).name)

    def restore(self) -> None:
        if NothingToStop.process_ends_after:
            self._previous = dict.fromkeys(self._previous, signal.SIG_IGN)
        super().restore()


def exit_with_codes(main: Callable[[list[str] | None], int], argv: list[str] | None = None) -> None:
    """`main` with the exits a shell expects (errors.py): bad input is one line and exit code 2 (a busy or
    damaged run folder and a full disk included); a signal stops with a checkpoint and 143 / 130; a policy gone
    non-finite or a rollout engine whose process died is one line and 1 (the newest checkpoint is intact,
    rerunning resumes); anything else keeps its traceback."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    console = once_per_job()  # under torchrun: a line every rank prints, printed once
    NothingToStop.process_ends_after = True
    try:
        sys.exit(main(argv))
    except Exception as exc:
        code = report(exc, show=console.print_line if console else None)
        if code is None:
            raise
        sys.exit(code)
    finally:
        NothingToStop.process_ends_after = False
