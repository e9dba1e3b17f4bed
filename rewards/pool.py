"""The user's reward functions in worker processes, so that a function that hangs, crashes its process or leaks
memory can neither take the trainer down nor hang it.

    pool = WorkerPool("/abs/examples/gsm8k_reward.py:gsm8k_reward", workers=2, timeout_s=300)
    values = pool.run(responses, ground_truths, {"data_source": [...]})   # one value per response
    pool.close()

Why processes of our own, each `python -c "... serve(FD)"` (subprocess.Popen) with a socket to the pool:
  * a fresh interpreter: nothing of the trainer's threads, CUDA context or process groups is inherited (fork
    would copy them mid-state), and, unlike multiprocessing's spawn and forkserver (Python 3.11), nothing of the
    trainer's `__main__` is imported again (train.py would bring torch into every worker: ~1.3 s and ~250 MB
    each); a worker costs the standard library and the user's module (~16 MB for examples/gsm8k_reward.py);
  * its own session (start_new_session): a Ctrl-C at the terminal reaches the trainer only, which stops at its
    next boundary; and the pool kills a worker's whole process group with SIGKILL, so what the function started
    (a compiler, a test runner) goes with it, and a worker that ignores SIGTERM cannot stall the shutdown;
  * on Linux the kernel kills a worker whose trainer died (PR_SET_PDEATHSIG), even in the middle of a call.
concurrent.futures' ProcessPoolExecutor and multiprocessing.Pool were the alternatives: neither kills a worker that
hangs (the executor leaves it running after a timeout; Pool.terminate sends a SIGTERM the worker may ignore, then
joins it), the executor reports a killed worker as BrokenProcessPool without its signal, and Pool replaces a
killed worker silently and waits for its lost task forever. Pebble and loky would fit, but are not dependencies.

The protocol, over multiprocessing's Connection (pickles, length-prefixed): the pool sends (sys.path, the function's
spec); the worker imports it (`load_function`) and answers ("ready",) within `timeout_s`. Then each message is a
part of a batch, (responses, ground truths, {column: values}), answered ("ok", one value per response, peak RSS in
MB). A failure is ("error", what): `what` completes the one line "reward function <spec> <what>". The traceback of
an exception the user's code raised goes to the worker's stderr, the trainer's (`_report`; so does one of a return
pickle cannot send back: the worker then exits with code 1); a spec that names no file, module or function, or a
function that cannot take the batch's arguments, is the one line alone.

`run` splits a batch into `workers` contiguous parts and waits at most `timeout_s` for all of them. Anything but
every part back in time is a RewardError (errors.py) after every worker is killed: a timeout ("took longer than
reward.timeout_s = 300 s on a batch of 64 responses"), a worker's death ("stopped: its worker process was killed by
SIGKILL", "... exited with code 3"), an exception inside ("raised ValueError: ..."), an import or a signature that
does not fit, a return that is not one value per response. The pool is then closed; in training the run stops with
a checkpoint (run/guard.py). What the values are is checked by rewards/scorer.py.

Recycling (`recycle`): a worker is replaced by a fresh one after that many batches, or once its peak resident
memory passes that many MB, so a leak stays bounded. `close` (also at garbage collection and at exit) kills every
worker; nothing outlives the pool.
"""

from __future__ import annotations

import contextlib
import importlib
import math
import os
import reprlib
import resource
import runpy
import signal
import socket
import subprocess
import sys
import time
import traceback
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any, NoReturn

from errors import RewardError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_START = "import sys; sys.path.insert(0, sys.argv[1]); from rewards.pool import serve; serve(int(sys.argv[2]))"


# -- in the worker -----------------------------------------------------------------------------------------


def load_function(spec: str) -> Callable[..., Any]:
    """The function `spec` names: "package.module:function" (from sys.path) or "/abs/path/file.py:function" (the
    file run as a script would be, without its `if __name__ == "__main__"` part)."""
    target, _, name = spec.rpartition(":")
    namespace = runpy.run_path(target) if target.endswith(".py") else vars(importlib.import_module(target))
    if not callable(function := namespace.get(name)):
        raise LookupError(f"{target} has no function {name!r}")
    return function


def _report(exc: BaseException) -> None:
    """The traceback of `exc` to stderr when a frame of the user's code is in it; not when finding the function
    (this file, importlib's, runpy's) or binding the batch to its signature failed, which the one line says whole."""
    finding = (__file__, importlib.__file__)
    files = [frame.filename for frame in traceback.extract_tb(exc.__traceback__)]
    if any(file not in finding and not file.startswith("<frozen ") for file in files):
        traceback.print_exception(exc)


def _call(function: Callable[..., Any], responses: list, truths: list, columns: dict[str, list]) -> tuple:
    """The function on a part; a TypeError (its signature, most likely) shows how it was called."""
    try:
        values = function(responses, truths, **columns)
    except BaseException as exc:  # SystemExit and KeyboardInterrupt from the user's code too
        _report(exc)
        signature = ", ".join(["responses", "ground_truths", *(f"{c}=..." for c in columns)])
        hint = f" (called as f({signature}))" if isinstance(exc, TypeError) else ""
        return ("error", f"raised {type(exc).__name__}: {exc}{hint}")
    values = values.tolist() if hasattr(values, "tolist") else values  # a numpy array, a tensor
    if not isinstance(values, (list, tuple)) or len(values) != len(responses):
        wanted = f"for {len(responses)} responses, not a list of one value each"
        return ("error", f"returned {reprlib.repr(values)} {wanted}")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KB on Linux, bytes on macOS
    return ("ok", list(values), peak / (2**20 if sys.platform == "darwin" else 2**10))


def serve(fd: int) -> None:
    """A worker's life (module docstring), on the connection `fd`."""
    if sys.platform == "linux":
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: die with the trainer
    conn = Connection(fd)
    sys.path[:], spec = conn.recv()
    try:
        function = load_function(spec)
    except BaseException as exc:
        _report(exc)
        return conn.send(("error", f"cannot be imported: {type(exc).__name__}: {exc}"))
    conn.send(("ready",))
    while True:
        try:
            conn.send(_call(function, *conn.recv()))
        except EOFError:  # the pool closed its end: the trainer is done or gone
            return


# -- in the trainer ----------------------------------------------------------------------------------------


@dataclass(eq=False)
class _Worker:
    process: subprocess.Popen
    conn: Connection
    batches: int = 0


def _kill(workers: list[_Worker]) -> None:
    """SIGKILL to every worker's process group, then reap it."""
    for worker in workers:
        with contextlib.suppress(ProcessLookupError, PermissionError):  # gone already, its group with it
            os.killpg(worker.process.pid, signal.SIGKILL)
        worker.process.wait()
        worker.conn.close()


class WorkerPool:
    """`workers` processes running the function `spec` (module docstring), each batch within `timeout_s`."""

    def __init__(self, spec: str, *, workers: int = 2, timeout_s: float = 300.0, recycle: tuple[int, float] = (0, 0)):
        self.spec, self.timeout_s, self.recycle = spec, timeout_s, recycle  # (batches, peak RSS MB); 0: never
        self.workers: list[_Worker] = []
        self.close = weakref.finalize(self, _kill, self.workers)  # at close(), garbage collection or exit
        for slot in range(workers):
            self._spawn(slot)

    def run(self, responses: list[str], truths: list[Any], columns: dict[str, list]) -> list:
        """The function's values on the batch, in order (module docstring); a RewardError on any failure."""
        if not self.close.alive:
            self._fail("was stopped by an earlier failure (its worker pool is closed)")
        share = math.ceil(len(responses) / len(self.workers)) or 1
        parts = {w: slice(i * share, (i + 1) * share) for i, w in enumerate(self.workers) if i * share < len(responses)}
        for worker, part in parts.items():
            with contextlib.suppress(OSError):  # a dead worker: its end reads as closed below
                worker.conn.send((responses[part], truths[part], {c: v[part] for c, v in columns.items()}))
        deadline, pending, answers = time.monotonic() + self.timeout_s, list(parts), {}
        while pending:
            ready = wait([w.conn for w in pending], max(0.0, deadline - time.monotonic()))
            for worker in [w for w in pending if w.conn in ready] or pending[:1]:  # none: past the deadline
                answers[worker] = self._answer(worker, deadline, f"on a batch of {len(responses)} responses")
                pending.remove(worker)
        for i, worker in enumerate(self.workers):
            worker.batches, peak_mb = worker.batches + 1, answers[worker][2] if worker in answers else 0.0
            batches, rss_mb = self.recycle
            if (batches and worker.batches >= batches) or (rss_mb and peak_mb >= rss_mb):
                _kill([worker])
                self._spawn(i)
        return [value for worker in parts for value in answers[worker][1]]

    def _spawn(self, slot: int) -> None:
        """Worker `slot`, a new process in its own session, sent the trainer's sys.path and the function, which it
        imports within timeout_s."""
        mine, theirs = socket.socketpair()
        with mine, theirs:
            command, fd = [sys.executable, "-c", _START, ROOT, str(theirs.fileno())], theirs.fileno()
            worker = _Worker(
                subprocess.Popen(command, pass_fds=[fd], start_new_session=True), Connection(os.dup(mine.fileno()))
            )
        self.workers[slot : slot + 1] = [worker]  # in the pool before it can fail: killed with the others
        worker.conn.send((sys.path, self.spec))
        self._answer(worker, time.monotonic() + self.timeout_s, "importing its module")

    def _answer(self, worker: _Worker, deadline: float, doing: str) -> tuple:
        """The worker's next answer by `deadline`; a RewardError for anything else."""
        if not worker.conn.poll(max(0.0, deadline - time.monotonic())):
            self._fail(f"took longer than reward.timeout_s = {self.timeout_s:g} s {doing}")
        try:
            answer = worker.conn.recv()
        except (EOFError, OSError):  # its end closed, or reset by its death
            self._died(worker)
        except Exception as exc:  # a class of the worker's the trainer cannot import, say
            self._fail(f"returned what the trainer cannot read back: {type(exc).__name__}: {exc}")
        if answer[0] == "error":
            self._fail(answer[1])
        return answer

    def _died(self, worker: _Worker) -> NoReturn:
        with contextlib.suppress(subprocess.TimeoutExpired):
            worker.process.wait(timeout=5)  # its connection closed as it exits: its own status, not our kill's
        self.close()
        code = worker.process.returncode
        how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
        self._fail(f"stopped: its worker process {how}")

    def _fail(self, what: str) -> NoReturn:
        """Every worker killed, then the RewardError naming the function."""
        self.close()
        raise RewardError(f"reward function {self.spec} {what}")
