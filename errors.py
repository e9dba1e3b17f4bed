"""The errors a person running the project can act on, and the one way train.py and eval.py report them.

    UserError            bad input: one line `<kind>: <message>` naming the file or key and the fix, exit 2
      ConfigError        a configuration key, file or flag (config/)
      DataError          a prompt data file (rl/data.py)
      CheckpointError    an HF checkpoint directory, or one of the run's own checkpoints (model/, parallel/)
      RunFolderError     a run folder in use by another run, or one that cannot be prepared (trainer/)
    RunStopped           the run stopped for a reason it names, with its work saved or left intact: one line
      StopRequested      a SIGTERM / SIGINT, after a checkpoint (exit 143 / 130; run/signals.py)
      EngineDied         the rollout engine's process ended (exit 1; rollout/engine.py)
      NonFiniteStateError  weights gone NaN or inf, never saved (exit 1; parallel/finite.py)

Everything else is a failure of the program and keeps its traceback (exit 1): a ValueError raised by a bug
is not bad input, so the entry points catch these classes and nothing wider.
"""

from __future__ import annotations

import sys
from typing import TextIO

EXIT_BAD_INPUT = 2


class UserError(Exception):
    """Bad input, reported as one line `<kind>: <message>` and exit code 2, before any work is lost."""

    kind = "error"
    exit_code = EXIT_BAD_INPUT

    def line(self) -> str:
        return f"{self.kind}: {self}"


class ConfigError(UserError, ValueError):
    """A configuration problem; the message names the key, its source and the failed rule."""

    kind = "configuration error"


class DataError(UserError, ValueError):
    """A data file that cannot be used: the message names the file and what is wrong with it."""

    kind = "data error"


class CheckpointError(UserError):
    """A checkpoint that cannot be loaded or written: the message names the file and what to do."""

    kind = "checkpoint error"


class RunFolderError(UserError):
    """The run folder cannot be used (another run holds it, or it cannot be prepared); raised before any work."""


class RunStopped(Exception):
    """The run stopped for a reason its message names; what it had done is saved or left intact."""

    exit_code = 1

    def line(self) -> str:
        return f"error: {self}"


def report(exc: BaseException, *, prefix: str = "", stream: TextIO | None = None) -> int | None:
    """Print the one line of a UserError or RunStopped (after `prefix`) to `stream` (stderr) and return its
    exit code; None for every other exception, which the caller re-raises with its traceback."""
    if not isinstance(exc, UserError | RunStopped):
        return None
    print(prefix + exc.line(), file=stream or sys.stderr)
    return exc.exit_code
