"""An inference engine in a process of its own, driven over a pipe.

Why: SGLang 0.5.21's crash and signal handling assume SGLang owns the process it runs in (paths inside
the sglang 0.5.21 wheel):
  * a scheduler that hits an exception sends SIGQUIT to its parent process (srt/managers/scheduler.py
    run_scheduler_process), whose handler kills its own process tree, itself included, with SIGKILL
    (srt/entrypoints/engine.py launch_phase_sigquit_handler, replaced at the first request by
    srt/managers/tokenizer_manager.py SignalHandler.running_phase_sigquit_handler; both call
    srt/utils/common.py kill_process_tree); with SGLANG_KILLPG_ON_SCHEDULER_EXCEPTION the scheduler
    SIGKILLs its whole process group as well;
  * the first request installs a SIGTERM handler that drains the requests and ends the engine
    (tokenizer_manager.py TokenizerManager.auto_create_handle_loop, sigterm_watchdog).
With `sglang.Engine` inside a trainer rank, an engine crash SIGKILLs the rank (no checkpoint) and a
preemption's SIGTERM ends the engine under the trainer's feet. So the engine lives in a child process that
owns it: SGLang's "parent" is that child, and its handlers end the child and its subtree, never the trainer.

The child (spawned: a fresh interpreter that inherits no CUDA state):
  * starts a session of its own (os.setsid): a terminal's Ctrl-C, sent to the foreground process group,
    does not reach it, and SGLang's process-group kill stays inside the engine's own group;
  * does not act on SIGINT and SIGTERM from its first instruction (blocked around the spawn, the mask is
    inherited), then ignores them, and again after every call (SGLang's first request installs its own
    SIGTERM handler): ending the engine is the trainer's decision. On a signal the trainer finishes its
    phase, checkpoints and shuts the engine down (run/signals.py); SGLang's own processes inherit the ignored
    signals;
  * dies with the trainer (prctl PR_SET_PDEATHSIG = SIGKILL), as SGLang's schedulers die with it
    (srt/utils/common.py kill_itself_when_parent_died): a trainer killed outright leaves no engine behind;
  * serves one call at a time: (method, args, kwargs) in, ("ok", result) or ("error", "Type: message") out.
    Weight updates stay in place: their CUDA IPC payloads are already strings (SGLang's
    MultiprocessingSerializer, output_str=True), which the child passes on as they came.

The trainer sees the child's end as EngineDied (the pipe closed, or the process gone while it waited), with
its exit status: a SIGKILL is how SGLang's own crash handling ends. A live engine that does not answer is the
same failure: every call has a deadline (the caller's, rollout/sglang_engine.py; the start START_TIMEOUT_S),
past which the engine's process group is SIGKILLed and EngineDied names the call and the deadline. `close`
asks the engine to shut down, waits, then SIGKILLs the engine's process group.
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing
import multiprocessing.util
import os
import signal
import sys
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any, NoReturn

from rollout.engine import EngineDied

TERMINAL_SIGNALS = (signal.SIGINT, signal.SIGTERM)
POLL_S = 1.0  # how often a waiting trainer checks that the engine process still lives
# SGLang's start reads the checkpoint and captures CUDA graphs: an hour reads a 65 GB checkpoint at 20 MB/s.
START_TIMEOUT_S = 3600.0


class EngineCallError(RuntimeError):
    """A call raised inside the engine process; the process serves on."""


def describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _ignore_terminal_signals() -> None:
    for sig in TERMINAL_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


def _die_with_parent(parent_pid: int) -> None:
    """SIGKILL this process when the process that started it ends (Linux; elsewhere the pipe's EOF ends it)."""
    if sys.platform.startswith("linux"):
        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    if os.getppid() != parent_pid:  # the parent ended before the request above took effect
        os._exit(1)


def _mapped_files(pid: int | str) -> set[str]:
    """The files under /dev/shm that process `pid` maps (Linux /proc)."""
    with open(f"/proc/{pid}/maps") as f:
        return {line.split(maxsplit=5)[5].rstrip("\n") for line in f if " /dev/shm/" in line}


def shared_memory_files(group: int) -> set[str]:
    """The named /dev/shm files that processes of process group `group` map and this process does not."""
    if not os.path.isdir("/proc"):
        return set()
    found: set[str] = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):  # a process that ended meanwhile
            if os.getpgid(int(pid)) == group:
                found |= _mapped_files(pid)
    return {path for path in found - _mapped_files(os.getpid()) if not path.endswith(" (deleted)")}


def _reply(conn: Connection, status: str, value: object) -> None:
    try:
        conn.send((status, value))
    except Exception as exc:  # an unpicklable result: say so instead of dying
        conn.send(("error", f"the engine's result could not be sent back: {describe(exc)}"))


def serve(conn: Connection, target: Callable[..., object], kwargs: dict, parent_pid: int) -> None:
    """The child's main: build target(**kwargs), then answer calls until "shutdown" or the pipe closes."""
    os.setsid()
    _ignore_terminal_signals()
    signal.pthread_sigmask(signal.SIG_UNBLOCK, TERMINAL_SIGNALS)  # blocked since the spawn, see EngineProcess
    _die_with_parent(parent_pid)
    conn.send(("session", os.getpgrp()))
    try:
        engine = target(**kwargs)
    except BaseException as exc:
        _reply(conn, "error", describe(exc))
        return
    _reply(conn, "ok", None)
    while True:
        try:
            method, args, call_kwargs = conn.recv()
        except (EOFError, OSError):  # the trainer is gone
            method, args, call_kwargs = "shutdown", (), {}
        try:
            result = ("ok", getattr(engine, method)(*args, **call_kwargs))
        except Exception as exc:
            result = ("error", describe(exc))
        _ignore_terminal_signals()  # SGLang's first request installs its own SIGTERM handler
        if method == "shutdown":
            with contextlib.suppress(OSError):
                _reply(conn, *result)
            return
        _reply(conn, *result)


class EngineProcess:
    """`target(**kwargs)` built and driven in a child process (see the module docstring).

    target: a picklable callable (a module-level function or class, or a functools.partial of one)
        that returns the engine; its methods are what `call` reaches.
    name: how messages name the engine ("the SGLang engine").
    Raises EngineCallError when the target raises, EngineDied when the child ends while it starts.
    """

    def __init__(self, target: Callable[..., object], kwargs: dict, *, name: str = "the engine") -> None:
        from multiprocessing import resource_tracker

        self.name = name
        self.dead: str | None = None  # why it serves no more calls
        self.group: int | None = None  # the engine's process group
        # Started first: its start unblocks SIGINT / SIGTERM, which would undo the blocking below.
        resource_tracker.ensure_running()
        ctx = multiprocessing.get_context("spawn")
        self._conn, child_end = ctx.Pipe()
        self.process = ctx.Process(target=serve, args=(child_end, target, kwargs, os.getpid()), name="engine")
        # The child must not act on SIGINT / SIGTERM from its first instruction (a Ctrl-C while it imports would
        # end it): blocked in this thread, which spawns it, they are blocked in the child too (a signal mask
        # survives fork and exec), until `serve` ignores them, which discards any pending, and unblocks them.
        # Only this thread's mask changes: this process's handlers stay, so a signal meant for it meanwhile runs
        # them, through another of its threads or, pending, once the mask is restored. (Ignoring them here too
        # would drop such a signal: a disposition is the whole process's, and the kernel hands a signal to any
        # thread that does not block it.)
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, TERMINAL_SIGNALS)
        try:
            self.process.start()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
            child_end.close()  # only the child holds it now: its end closes the pipe
        # Ended before multiprocessing joins its children at exit (a non-daemon child: SGLang's engine starts
        # processes of its own, which a daemon may not), also when the owner never called close().
        self._finalizer = multiprocessing.util.Finalize(self, self.close, exitpriority=10)
        self.shm_files: set[str] = set()  # what the engine leaves in /dev/shm: removed when it ends
        try:
            self.group = self._receive("start", START_TIMEOUT_S)
            self._receive("start", START_TIMEOUT_S)
            self.shm_files = shared_memory_files(self.group)
        except BaseException:
            self.close(timeout_s=10)
            raise

    def call(self, method: str, *args: object, deadline_s: float, **kwargs: object) -> Any:
        """engine.method(*args, **kwargs) in the child; its result, or EngineCallError / EngineDied (also when
        no answer came within deadline_s). (Any: whatever that method returns, unpickled from the pipe.)"""
        if self.dead is not None:
            raise EngineDied(self.dead)
        try:
            self._conn.send((method, args, kwargs))
        except OSError:
            self._died(method)
        return self._receive(method, deadline_s)

    def _receive(self, what: str, deadline_s: float) -> Any:  # an unpickled reply
        end = time.monotonic() + deadline_s
        while not self._conn.poll(max(0.0, min(POLL_S, end - time.monotonic()))):
            if not self.process.is_alive() and not self._conn.poll(0):
                self._died(what)
            if time.monotonic() >= end:  # hung: its processes are killed first, then it is ended as a dead one
                self._end_group()
                self._died(what, f"no answer within its deadline of {deadline_s:,.0f} s: hung, its processes killed")
        try:
            status, value = self._conn.recv()
        except (EOFError, OSError):
            self._died(what)
        if status == "error":
            raise EngineCallError(value)
        return value

    def _died(self, what: str, how: str | None = None) -> NoReturn:
        self.process.join(timeout=10)
        code = self.process.exitcode
        if code is not None:
            how = how or (f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}")
        self.dead = f"{self.name} process (pid {self.process.pid}) ended during {what} ({how or 'still running'})"
        self._end_group()
        raise EngineDied(self.dead)

    def _end_group(self) -> None:
        """SIGKILL what is left of the engine's process group (SGLang's own processes), then remove the /dev/shm
        files it mapped at start, which no SGLang shutdown removes (a CPU engine's all-reduce buffer of sgl_kernel's
        shm.cpp, 258 MiB; its load snapshot of srt/managers/load_snapshot.py)."""
        if self.group is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.group, signal.SIGKILL)
            self.group = None
        self.process.join(timeout=10)
        for path in self.shm_files:
            with contextlib.suppress(OSError):
                os.unlink(path)
        self.shm_files = set()

    def close(self, timeout_s: float = 60.0) -> None:
        """Shut the engine down (its own shutdown), wait up to timeout_s, then end its process group."""
        self._finalizer.cancel()
        if self.dead is None and self.process.is_alive():
            with contextlib.suppress(OSError, EOFError):
                self._conn.send(("shutdown", (), {}))
                if self._conn.poll(timeout_s):
                    self._conn.recv()
            self.process.join(timeout=timeout_s)
        self.dead = self.dead or f"{self.name} was shut down"
        self._end_group()
        self._conn.close()
