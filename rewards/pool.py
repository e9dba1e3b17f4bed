"""The user's reward functions in worker processes, so that a function that hangs, crashes its process or leaks
memory can neither take the trainer down nor hang it.

    pool = WorkerPool(["examples/gsm8k_reward.py:gsm8k_reward"], workers=2, timeout_s=300)
    returns = pool.run(responses, ground_truths, {"data_source": [...]})   # one list per function
    pool.close()

Why processes of our own, started as `python -c` (subprocess.Popen), each with a socket to the pool:
  * a fresh interpreter: nothing of the trainer's threads, CUDA context or process groups is inherited (fork
    would copy them mid-state), and, unlike multiprocessing's spawn and forkserver, nothing of the trainer's
    `__main__` is imported again (train.py would bring torch into every worker: ~1.3 s and ~250 MB each);
  * its own session (start_new_session): a Ctrl-C at the terminal reaches the trainer only, which stops at its
    next boundary while the workers finish; and the pool kills the worker's whole process group (SIGKILL), so
    what the function started (a compiler, a test runner) goes with it;
  * on Linux the kernel kills a worker whose trainer died (PR_SET_PDEATHSIG, rewards/worker.py), even mid-call.
concurrent.futures' ProcessPoolExecutor and multiprocessing.Pool were the alternatives: neither can kill a worker
that hangs (the executor leaves it running after a timeout; Pool.terminate sends a SIGTERM the worker may ignore,
then joins it), the executor reports a killed worker as BrokenProcessPool without its signal, and Pool silently
replaces a killed worker and waits for its lost task forever.

`run` splits a batch into `workers` contiguous parts, one per worker, and waits at most `timeout_s` for all of
them (a worker still importing the functions counts against it). Anything but every part back in time is a
RewardError (errors.py), after every worker is killed: a timeout ("took longer than reward.timeout_s = 300 s on a
batch of 64 responses"), a worker's death ("was killed by SIGKILL", "exited with code 3"), an exception inside
the function ("raised ValueError: ..."), an import or a signature that does not fit. The pool is then closed;
the trainer stops with a checkpoint (run/guard.py). What the functions returned is checked by rewards/scorer.py.

Recycling: a worker is replaced by a fresh one after `recycle_batches` batches, or once its peak resident
memory passes `recycle_rss_mb`, so a leak is bounded. `close` (also at garbage collection and at exit) kills
every worker; nothing outlives the pool.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import socket
import subprocess
import sys
import time
import weakref
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any, NoReturn

from errors import RewardError

log = logging.getLogger(__name__)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_START = "import sys; sys.path.insert(0, sys.argv[1]); from rewards.worker import serve; serve(int(sys.argv[2]))"


@dataclass(eq=False)
class _Worker:
    process: subprocess.Popen
    conn: Connection
    ready: bool = False
    batches: int = 0


def _start(specs: list[str]) -> _Worker:
    """A worker process in its own session, sent the trainer's sys.path and the functions to import."""
    mine, theirs = socket.socketpair()
    with mine, theirs:
        fd = theirs.fileno()
        process = subprocess.Popen([sys.executable, "-c", _START, ROOT, str(fd)], pass_fds=[fd], start_new_session=True)
        conn = Connection(os.dup(mine.fileno()))
    conn.send((list(sys.path), specs))
    return _Worker(process, conn)


def _kill(workers: list[_Worker]) -> None:
    """SIGKILL to every worker's process group, then reap it."""
    for worker in workers:
        try:
            os.killpg(worker.process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass  # gone already (its group with it)
        worker.process.wait()
        worker.conn.close()


def _death(worker: _Worker) -> str:
    """How a worker whose connection closed ended."""
    try:
        code = worker.process.wait(timeout=5)
    except subprocess.TimeoutExpired:
        return "closed its connection to the trainer"
    if code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"


class WorkerPool:
    """`workers` processes running `specs` (module docstring), each batch within `timeout_s`."""

    def __init__(
        self,
        specs: list[str],
        *,
        workers: int = 2,
        timeout_s: float = 300.0,
        recycle_batches: int = 0,
        recycle_rss_mb: float = 0,
    ):
        self.specs, self.timeout_s, self.name = specs, timeout_s, " + ".join(specs)
        self.recycle_batches, self.recycle_rss_mb = recycle_batches, recycle_rss_mb
        self.workers = [_start(specs) for _ in range(workers)]
        self.close = weakref.finalize(self, _kill, self.workers)  # at close(), garbage collection or exit

    def run(self, responses: list[str], truths: list[Any], columns: dict[str, list]) -> list[list]:
        """Each function's returns on the batch, in order (module docstring); a RewardError on any failure."""
        if not self.close.alive:
            raise RewardError(f"reward function {self.name}: its worker pool was closed")
        share = math.ceil(len(responses) / len(self.workers)) or 1
        parts = {w: slice(i * share, (i + 1) * share) for i, w in enumerate(self.workers) if i * share < len(responses)}
        batches = {w: (responses[p], truths[p], {c: v[p] for c, v in columns.items()}) for w, p in parts.items()}
        for worker in [w for w in parts if w.ready]:
            self._send(worker, batches[worker])
        deadline, pending, returns = time.monotonic() + self.timeout_s, set(parts), {}
        while pending:
            ready = wait([w.conn for w in pending], max(0.0, deadline - time.monotonic()))
            if not ready:
                self._fail(
                    f"took longer than reward.timeout_s = {self.timeout_s:g} s on a batch of {len(responses)} responses"
                )
            for worker in [w for w in pending if w.conn in ready]:
                answer = self._receive(worker)
                if not worker.ready:  # its functions are imported: its part can go
                    worker.ready = True
                    self._send(worker, batches[worker])
                    continue
                returns[worker] = [self._checked(r, i, len(batches[worker][0])) for i, r in enumerate(answer[1])]
                pending.discard(worker)
                self._recycle_if_due(worker, answer[2])
        return [[value for w in parts for value in returns[w][i]] for i in range(len(self.specs))]

    def _checked(self, returned: Any, index: int, expected: int) -> list:
        """One function's returns on a part, as a list of its length (a numpy array's or a tensor's values too)."""
        returned = returned.tolist() if hasattr(returned, "tolist") else returned
        if not isinstance(returned, (list, tuple)):
            self._fail(f"returned {type(returned).__name__}, not a list of one value per response", index)
        if len(returned) != expected:
            self._fail(f"returned {len(returned)} values for {expected} responses", index)
        return list(returned)

    def _receive(self, worker: _Worker) -> tuple:
        try:
            answer = worker.conn.recv()
        except (EOFError, OSError):  # its end closed, or reset by a kill
            self._fail(f"stopped: its worker process {_death(worker)}")
        except Exception as exc:  # a class the trainer cannot import, say
            self._fail(f"returned what the trainer cannot read back: {type(exc).__name__}: {exc}")
        if answer[0] == "error":
            self._fail(answer[2], answer[1])
        return answer

    def _send(self, worker: _Worker, batch: tuple) -> None:
        try:
            worker.conn.send(batch)
        except OSError:
            self._fail(f"stopped: its worker process {_death(worker)}")

    def _recycle_if_due(self, worker: _Worker, peak_mb: float) -> None:
        """A worker replaced by a fresh one after recycle_batches batches or past recycle_rss_mb."""
        worker.batches += 1
        by_count = self.recycle_batches and worker.batches >= self.recycle_batches
        if by_count or (self.recycle_rss_mb and peak_mb >= self.recycle_rss_mb):
            log.info("reward worker replaced after %d batches at a peak of %.0f MB", worker.batches, peak_mb)
            _kill([worker])
            fresh = _start(self.specs)
            worker.process, worker.conn, worker.ready, worker.batches = fresh.process, fresh.conn, False, 0

    def _fail(self, what: str, index: int | None = None) -> NoReturn:
        """Every worker killed, then the RewardError naming the function (`index`; None: all of them)."""
        self.close()
        raise RewardError(f"reward function {self.name if index is None else self.specs[index]} {what}")
