"""The errors a person running the project can act on, and the one way train.py and eval.py report them.

    UserError            bad input: one line `<kind>: <message>` naming the file or key and the fix, exit 2
      ConfigError        a configuration key, file or flag (config/)
      DataError          a prompt data file (data/prompts.py)
      CheckpointError    an HF checkpoint directory, or one of the run's own checkpoints (model/, parallel/)
      RunFolderError     a run folder in use by another run, or one that cannot be prepared (trainer/)
      WriteError         a file the run writes, on a full disk, a read-only or forbidden folder, or past a file-size
                         limit (`writing`)
      RewardError        the user's reward function: not importable, not callable with a batch, a wrong return, an
                         exception inside, a hang past reward.timeout_s, a worker killed (rewards/); in training the
                         run stops with a checkpoint first
    RunStopped           the run stopped for a reason it names, with its work saved or left intact: one line
      StopRequested      a SIGTERM / SIGINT, after a checkpoint (exit 143 / 130; run/signals.py)
      EngineDied         the rollout engine's process ended (exit 1; rollout/engine.py)
      NonFiniteStateError  weights gone NaN or inf, never saved (exit 1; parallel/finite.py)

Everything else is a failure of the program and keeps its traceback (exit 1): a ValueError raised by a bug
is not bad input, so the entry points catch these classes and nothing wider.

Every file a run writes goes through `write_atomically` (whole or absent, never half-written) or `writing`
(a write's full disk, read-only file system, missing permission or file-size limit is a WriteError naming the
file and the fix).
"""

from __future__ import annotations

import contextlib
import errno
import os
import sys
from collections.abc import Callable, Iterator
from typing import IO


class UserError(Exception):
    """Bad input, reported as one line `<kind>: <message>` and exit code 2, before any work is lost."""

    kind = "error"
    exit_code = 2

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


class WriteError(UserError):
    """A file the run writes cannot be written for a reason the person running it can fix; nothing half-written
    is left behind."""


class RewardError(UserError):
    """The user's reward function failed or returned what cannot be a reward: the message names it and how."""

    kind = "reward error"


# What a person can fix, and how: a full disk or quota, a read-only file system, a folder they may not write to;
# a file larger than its file system (FAT32: 4 GB) or a file-size limit (`ulimit -f`) allows.
WRITE_ERROR_FIXES = {
    **dict.fromkeys(
        (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM), "make room or make its folder writable"
    ),
    errno.EFBIG: "a file-size limit (ulimit -f) or the file system (FAT32: 4 GB a file) caps it: raise the limit "
    "or write to another file system",
}


def first_os_error(exc: BaseException | None) -> OSError | None:
    """The OSError behind `exc`: itself, its cause or context, or one inside DCP's CheckpointException."""
    seen = set()
    stack = [exc]
    while stack:
        current = stack.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno is not None:
            return current
        failures = getattr(current, "failures", None)  # DCP: {rank: (exception, traceback)}
        if isinstance(failures, dict):
            stack += [failure[0] if isinstance(failure, tuple) else failure for failure in failures.values()]
        stack += [current.__cause__, current.__context__]
    return None


@contextlib.contextmanager
def writing(path: str) -> Iterator[None]:
    """Writes to `path` inside: an OSError of WRITE_ERROR_FIXES (itself, or behind the error raised, as DCP
    wraps one) becomes a WriteError naming `path`."""
    try:
        yield
    except BaseException as exc:
        os_error = None if isinstance(exc, WriteError) else first_os_error(exc)
        if os_error is None or os_error.errno not in WRITE_ERROR_FIXES:
            raise
        raise WriteError(
            f"cannot write {path}: {os_error.strerror or os_error}; {WRITE_ERROR_FIXES[os_error.errno]}, then run "
            "the same command again"
        ) from exc


def write_atomically(path: str, content: str | bytes | Callable[[IO[bytes]], object]) -> None:
    """`path` holds `content` (text, bytes, or what a function writes into the open file), whole or not at all:
    written to a temporary file in the same folder, fsynced, renamed over `path` (removed on failure).
    Errors as `writing`."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with writing(path):
        try:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            with open(tmp, "wb") as f:
                if callable(content):
                    content(f)
                else:
                    f.write(content.encode() if isinstance(content, str) else content)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.remove(tmp)
            raise


def broken_link(path: str) -> str | None:
    """Why `path` cannot be reached when a symbolic link is the cause ("is a symbolic link loop", "is a symbolic
    link to T, which does not exist"), for a line that names it; None when it is not (it exists, or is simply
    not there)."""
    try:
        os.stat(path)
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return "is a symbolic link loop" if os.path.islink(path) else "goes through a symbolic link loop"
    if os.path.islink(path):
        return f"is a symbolic link to {os.readlink(path)}, which does not exist"
    return None


class RunStopped(Exception):
    """The run stopped for a reason its message names; what it had done is saved or left intact."""

    exit_code = 1

    def line(self) -> str:
        return f"error: {self}"


def report(exc: BaseException, *, prefix: str = "", show: Callable[[str], None] | None = None) -> int | None:
    """Show the one line of a UserError or RunStopped (after `prefix`; default: on stderr) and return its exit
    code; None for every other exception, which the caller re-raises with its traceback."""
    if not isinstance(exc, UserError | RunStopped):
        return None
    (show or (lambda line: print(line, file=sys.stderr)))(prefix + exc.line())
    return exc.exit_code
