"""What runs inside a reward worker process (rewards/pool.py starts it): import the user's functions, then score
batches until told to stop or until the trainer is gone.

    python -c "...; from rewards.worker import serve; serve(FD)"     FD: the worker's end of its socket to the pool

The pool sends (sys.path, the function specs) first; the worker imports every function and answers ("ready",)
or ("error", index, what). Then each message is a batch (responses, ground truths, {column: values}) and each
answer ("ok", [one return per function], peak RSS in MB) or ("error", index, what): `what` completes the line
"reward function <spec> <what>" the run stops with; the traceback goes to the worker's stderr (the trainer's).
Only the standard library is imported here: a worker costs what the user's module costs.

A spec is "package.module:function" (imported from the trainer's sys.path) or "path/to/file.py:function" (an
absolute path by the time it gets here: rewards/scorer.py `resolve_spec`). Before a call, the arguments are bound
to the function's signature, so a function that cannot take them is named as such, not by a TypeError from
somewhere inside it.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import resource
import signal
import sys
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any


def load_function(spec: str) -> Callable[..., Any]:
    """The function `spec` names ("package.module:function" or "/path/to/file.py:function")."""
    target, _, name = spec.rpartition(":")
    if target.endswith(".py"):
        found = importlib.util.spec_from_file_location(f"reward_{abs(hash(target))}", target)
        if found is None or found.loader is None or not os.path.isfile(target):
            raise FileNotFoundError(f"no file {target}")
        module = importlib.util.module_from_spec(found)
        sys.modules[found.name] = module  # its classes and dataclasses can then be pickled
        found.loader.exec_module(module)
    else:
        module = importlib.import_module(target)
    function = getattr(module, name, None)
    if not callable(function):
        raise LookupError(f"{target} has no function {name!r}")
    return function


def _die_with_parent() -> None:
    """On Linux, the kernel kills this process when the trainer's dies (PR_SET_PDEATHSIG), even mid-call."""
    if sys.platform == "linux":
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGKILL)


def _peak_rss_mb() -> float:
    """This process's peak resident memory (ru_maxrss: KB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (2**20 if sys.platform == "darwin" else 2**10)


def _failed(index: int, what: str) -> tuple[str, int, str]:
    traceback.print_exc()
    return ("error", index, what)


def _score(functions: list[Callable[..., Any]], batch: tuple[list, list, dict[str, list]]) -> tuple:
    """Every function on the batch: ("ok", returns, peak RSS) or the first one's failure."""
    responses, truths, columns = batch
    returns = []
    for index, function in enumerate(functions):
        try:
            inspect.signature(function).bind(responses, truths, **columns)
        except TypeError as exc:
            shown = ", ".join(["responses", "ground_truths", *(f"{c}=..." for c in columns)])
            return ("error", index, f"cannot be called as f({shown}): {exc}")
        try:
            returns.append(function(responses, truths, **columns))
        except BaseException as exc:  # SystemExit and KeyboardInterrupt from the user's code too
            return _failed(index, f"raised {type(exc).__name__}: {exc}")
    return ("ok", returns, _peak_rss_mb())


def serve(fd: int) -> None:
    """The worker's life (module docstring)."""
    _die_with_parent()
    conn = Connection(fd)
    path, specs = conn.recv()
    sys.path[:] = path
    functions = []
    for index, spec in enumerate(specs):
        try:
            functions.append(load_function(spec))
        except BaseException as exc:
            conn.send(_failed(index, f"cannot be imported: {type(exc).__name__}: {exc}"))
            return
    conn.send(("ready",))
    while True:
        try:
            batch = conn.recv()
        except EOFError:  # the pool closed its end: the trainer is gone or done
            return
        answer = _score(functions, batch)
        try:
            conn.send(answer)
        except Exception as exc:  # what pickle cannot send back (a generator, a lambda, an open file)
            conn.send(_failed(0, f"returned what cannot be sent back to the trainer: {type(exc).__name__}: {exc}"))
