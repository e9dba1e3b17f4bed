"""The guard around every call into the rollout engine, in one place: run on every rank, agree, checkpoint
and raise on failure; stop at the phase boundaries.

The engines may hold collectives (SGLang's tensor parallelism, the weight sync), so a call that fails on one
rank must stop every rank at the same point, or the others wait in a collective for a rank that left.
`Guard.call(what, fn)` runs fn() on every rank, then the ranks agree on the worst outcome (one all-reduce on
the gloo control group): OK, FAILED (an exception: EngineFailure, or anything else) or ENGINE_DIED (an
engine's process is gone: the policy, in the trainer's process, is intact). On a failure every rank
checkpoints the last completed step (run/phase_runner.py) and raises the error, EngineDied first, naming what
was running and that the rerun resumes (a user-facing error, errors.py, as it is). A call at a phase boundary
(`boundary=True`, e.g. a poll of the engine) is followed by a stop when a SIGTERM / SIGINT arrived on any rank.

What the engine itself reports (its exception) is named as an EngineFailure (`engine_reported`); a collective's
failure passes as it is.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from enum import IntEnum
from typing import TYPE_CHECKING, NoReturn, TypeVar

from torch.distributed import DistError

from errors import UserError
from rollout.engine import EngineDied, EngineFailure

if TYPE_CHECKING:
    from parallel.dist_env import DistEnv
    from run.phase_runner import PhaseRunner

T = TypeVar("T")


class Outcome(IntEnum):
    """How a call went on one rank; the ranks agree on the worst (`agree`)."""

    OK = 0
    FAILED = 1
    ENGINE_DIED = 2


def agree(dist_env: DistEnv, outcome: Outcome) -> Outcome:
    """The worst outcome over every rank (one all-reduce on the gloo control group: every rank calls it)."""
    return Outcome(int(dist_env.all_reduce([float(outcome)], op="max", group="world")[0]))


class Guard:
    """Guarded calls for one phase runner's steps (module docstring); without a runner (a test, a benchmark)
    a failure is raised as it is, with no checkpoint and no stops."""

    def __init__(self, dist_env: DistEnv, runner: PhaseRunner | None = None):
        self.dist, self.runner = dist_env, runner

    def call(self, what: str, fn: Callable[[], T], *, boundary: bool = False) -> T:
        """fn() on every rank, agreed on; a failure anywhere checkpoints and raises on every rank. `what` names
        the call in the error ("step 3, generation round 1"); boundary: then stop if a signal asked to."""
        error: Exception | None = None
        try:
            result = fn()
        except Exception as exc:
            error = exc
        worst = agree(self.dist, _outcome(error))
        if worst != Outcome.OK:
            self._stop(what, worst, error)
        if boundary and self.runner is not None:
            self.runner.stop_if_requested()
        return result

    def everyone(self, flag: bool) -> bool:
        """Whether `flag` holds on every data-parallel rank (one all-reduce)."""
        return self.dist.all_reduce([float(flag)], op="min")[0] > 0

    def stop(self, error: BaseException, cause: BaseException | None = None) -> NoReturn:
        """Checkpoint the last completed step, then raise `error` (on the rank that calls it)."""
        if self.runner is None:
            raise error from cause
        self.runner.stop_with_checkpoint(error, cause)

    def as_of_now(self) -> AbstractContextManager[None]:
        """Checkpoints taken inside save the run as it stands at entry: a step abandoned before its update is
        saved as not begun."""
        return self.runner.as_of_now() if self.runner is not None else nullcontext()

    def _stop(self, what: str, worst: Outcome, error: Exception | None) -> NoReturn:
        if self.runner is None:  # no checkpoint: the failure as it is
            raise error or RuntimeError(f"{what}: failed on another rank (see its log)")
        saved = f"Checkpoint of step {self.runner.state.step()} saved"
        if worst == Outcome.ENGINE_DIED:
            died = error if isinstance(error, EngineDied) else f"the rollout engine of another rank died during {what}"
            self.stop(EngineDied(f"{died}. {saved}; rerun the same command to resume"), error)
        if isinstance(error, UserError):  # a full disk, a bad file: its own one line and exit code
            self.stop(error)
        if error is None:
            message = f"{what}: failed on another rank (see its log)"
        elif isinstance(error, EngineFailure):
            message = f"{what}: {error}"
        else:
            message = f"{what} on data-parallel rank {self.dist.dp_rank}: {type(error).__name__}: {error}"
        fix = "" if isinstance(error, EngineFailure) else " (with the cause fixed)"
        self.stop(RuntimeError(f"{message}. {saved}; rerun the same command to resume{fix}"), error)


def _outcome(error: Exception | None) -> Outcome:
    if error is None:
        return Outcome.OK
    return Outcome.ENGINE_DIED if isinstance(error, EngineDied) else Outcome.FAILED


@contextmanager
def engine_reported(what: str) -> Iterator[None]:
    """Inside, the engine's own exceptions become EngineFailure naming `what` ("4 prompts x 16 samples");
    EngineDied and a torch.distributed failure (a collective's, never the engine's own) pass as they are."""
    try:
        yield
    except (EngineDied, EngineFailure, DistError):
        raise
    except Exception as exc:
        raise EngineFailure(f"engine failed on {what}: {type(exc).__name__}: {exc}") from exc
