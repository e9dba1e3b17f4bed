"""The rollout engine as train.py drives it (`GuardedEngine`): each call runs on every rank, the ranks agree on
how it went, and a failure on any of them checkpoints the last completed step and stops every rank; a signal is
honoured at the next boundary (a poll, a release); an engine that stops producing tokens is hung and ends as a
dead one.

Why every rank: the engines hold collectives (SGLang's tensor parallelism, the weight sync's gathers), so a call
that fails on one rank must stop every rank at the same point, or the others wait in a collective for a rank that
left. After each call the ranks agree (`agree`: one all-reduce on the gloo control group) on three numbers: the
worst outcome, whether a signal arrived anywhere, whether any rank still waits. Every collective of the guard has
this one shape, so a rank that fails between two engine calls (its scoring, say: `failures_agreed`) meets its
peers in their next agreement; and there is always a next one before the engine's next collective: every rank
agrees on leaving a `failures_agreed` block, also when it succeeded, and before each weight bucket's gathers that
its shards are ready (`together`, rollout/weight_sync.py). Outcomes: OK, FAILED (an exception: EngineFailure, or
anything else) or ENGINE_DIED (an engine's process is gone, or it hung: the policy, in the trainer's process, is
intact). On a failure every rank checkpoints (run/phase_runner.py) and raises the error, EngineDied first, naming
what was running and that the rerun resumes (a user-facing error, errors.py, as it is).

`generate(prompts, params)`: rollout/engine.py's loop (submit, poll until done, gather) with the submit and each
poll agreed: `poll_together` is done once every rank's engine returned every completion. Progress, not a deadline:
the engine is hung when none of its requests produced a token or finished for `hang_after_s` (the progress window,
rollout.call_timeout_s), and is then killed, within that window and one poll; a slow engine that keeps producing
is never stopped. Nothing else bounds a generation: a poll returns within poll_s (SGLang) or poll_steps decode
steps (torch), and a poll of an engine process that does not answer within its call deadline (the same key) is a
dead engine's (rollout/engine_process.py).

What the engine itself reports (its exception) is named as an EngineFailure; a collective's failure passes as it
is (rollout/sglang_engine.py raises a DistError for its group's), never named as the engine's own. Nothing is
retried: every failure stops the run with a checkpoint, and the rerun resumes.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from enum import IntEnum
from typing import TYPE_CHECKING, NoReturn, TypeVar, cast

import torch
from torch.distributed import DistError

from errors import UserError
from rollout.engine import Completion, Engine, EngineDied, EngineFailure, Polled, SamplingParams, gather

if TYPE_CHECKING:
    from parallel.dist_env import DistEnv
    from run.phase_runner import PhaseRunner

T = TypeVar("T")


class Outcome(IntEnum):
    """How a call went on one rank; the ranks agree on the worst."""

    OK = 0
    FAILED = 1
    ENGINE_DIED = 2


class GuardedEngine:
    """`engine` (rollout/engine.py) called on every rank with the guard's agreement (module docstring).

    dist_env: the run's ranks (None: one process, which raises its failures as they are); runner: the phase runner
    that checkpoints and stops (None: a failure is raised as it is, and signals wait for the caller); hang_after_s:
    the progress window (rollout.call_timeout_s); on_poll: an observer of every poll (the rollout display).
    """

    def __init__(
        self,
        engine: Engine,
        dist_env: DistEnv | None = None,
        runner: PhaseRunner | None = None,
        *,
        hang_after_s: float = 600.0,
        on_poll: Callable[[Polled], object] = lambda polled: None,
    ):
        self.engine, self.dist, self.runner, self.hang_after_s = engine, dist_env, runner, hang_after_s
        self.on_poll = on_poll
        self.where = ""  # what the run is doing, named in errors ("step 3, rollout")
        self._raised: BaseException | None = None  # the error the agreement raised last (not agreed on again)
        self._round = ("", 0.0)  # the round in flight: its name in errors, when its engine last produced

    # -- the engine interface ----------------------------------------------------------------------------

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        """params.n completions of every prompt, grouped by prompt (prompt 0's n first): rollout/engine.py's
        submit and gather, the submit and each poll agreed (`poll_together`). A collective: every rank calls it,
        with its own prompts (possibly none), and polls until every rank's completions are back."""
        what = f"generate ({len(prompts)} prompts x {params.n} samples)"
        self.call(what, lambda: self.engine.submit(prompts, params), boundary=True)
        self._round = what, time.monotonic()
        return gather(self.poll_together, len(prompts), params.n)

    def poll_together(self) -> Polled:
        """One poll of this rank's engine, then the ranks' agreement on it: done once no rank's round is left."""
        what = self._round[0]
        polled, error = _attempt(lambda: _named(what, self._poll))
        polled = polled or Polled([], 0, True)  # a failed poll: the agreement raises
        anyone = self.agree(what, error, not polled.done, boundary=True)
        return Polled(polled.completions, polled.tokens, not anyone)

    def _poll(self) -> Polled:
        """This rank's poll. The engine is hung (killed, EngineDied) when none of its requests produced a token or
        finished for hang_after_s while this rank waited."""
        what, quiet_since = self._round
        polled, now = self.engine.poll(), time.monotonic()
        if polled.tokens or polled.completions:
            self._round = what, now
        elif not polled.done and now - quiet_since > self.hang_after_s:
            self.engine.shutdown()
            raise EngineDied(
                f"no request produced a token or finished for {self.hang_after_s:,.0f} s "
                "(rollout.call_timeout_s): hung, its processes killed"
            )
        self.on_poll(polled)
        return polled

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        bucket = list(named_tensors)
        self.call(f"update_weights ({len(bucket)} tensors)", lambda: self.engine.update_weights(bucket))

    def release_memory(self) -> None:
        self.call("release_memory", self.engine.release_memory, boundary=True)

    def resume_memory(self) -> None:
        self.call("resume_memory", self.engine.resume_memory)

    def shutdown(self) -> None:
        """Not agreed on: every way out of a run shuts its engine down, whatever the others do."""
        self.engine.shutdown()

    @property
    def dtype(self) -> torch.dtype:
        return self.engine.dtype  # type: ignore[attr-defined]  # both engines have one (rollout/weight_sync.py)

    @property
    def device(self) -> torch.device | None:
        return getattr(self.engine, "device", None)

    # -- agreement ---------------------------------------------------------------------------------------

    def call(self, what: str, fn: Callable[[], T], *, boundary: bool = False) -> T:
        """fn() (an engine call: what the engine raises named an EngineFailure) on every rank, then the agreement."""
        return self.together(what, lambda: _named(what, fn), boundary=boundary)

    def together(self, what: str, fn: Callable[[], T], *, boundary: bool = False) -> T:
        """fn() on this rank, then the ranks' agreement on how it went (`agree`); its result."""
        result, error = _attempt(fn)
        self.agree(what, error, False, boundary=boundary)
        return cast(T, result)  # fn's: had it raised, the agreement would have

    def everyone(self, flag: bool) -> bool:
        """Whether `flag` holds on every rank (an agreement)."""
        return not self.agree(self.where, None, not flag)

    def agree(self, what: str, error: BaseException | None, flag: bool, *, boundary: bool = False) -> bool:
        """The ranks' agreement: a failure anywhere checkpoints and raises on every rank; at a boundary, a signal
        anywhere stops every rank with a checkpoint; returns whether `flag` holds on any rank."""
        if self.dist is None:
            if error is not None:
                raise error
            return flag
        stop = self.runner.stop if self.runner is not None else None
        signal = stop is not None and stop.signal_name is not None
        outcome = (
            Outcome.OK if error is None else Outcome.ENGINE_DIED if isinstance(error, EngineDied) else Outcome.FAILED
        )
        worst, signalled, anyone = self.dist.all_reduce([float(outcome), signal, flag], "max", "world")
        if worst:
            self._stop(what, Outcome(int(worst)), error)
        if boundary and signalled and self.runner is not None:
            self._raised = None
            try:
                self.runner.stop_if_requested(anyone=True)
            except Exception as exc:
                self._raised = exc
                raise
        return anyone > 0

    @contextmanager
    def failures_agreed(self, where: str) -> Iterator[None]:
        """Inside, errors name `where`; an exception raised inside that no agreement has seen (this rank's own,
        outside an engine call: its scoring, say) is agreed on at once: the peers meet it in their next agreement
        and every rank stops with a checkpoint. Every rank leaving the block without an error agrees on it too,
        before anything else (the engine's next call, itself a collective of its group), so a peer that failed in
        the block's last stretch is met there."""
        self.where, self._raised = where, None
        try:
            yield
        except Exception as exc:
            if exc is not self._raised:
                self.agree(where, exc, False)
            raise
        else:
            self.agree(where, None, False)
        finally:
            self.where = ""

    def _stop(self, what: str, worst: Outcome, error: BaseException | None) -> NoReturn:
        what = f"{self.where}, {what}" if self.where and what != self.where else what
        if self.runner is None:  # no checkpoint: the failure as it is
            self._raised = error or RuntimeError(f"{what}: failed on another rank (see its log)")
            raise self._raised
        saved = f"Checkpoint of step {self.runner.state.step()} saved"
        if worst == Outcome.ENGINE_DIED:
            died = error if isinstance(error, EngineDied) else f"the rollout engine of another rank died during {what}"
            stopped: BaseException = EngineDied(f"{died}. {saved}; rerun the same command to resume")
        elif isinstance(error, UserError):  # a full disk, a bad file: its own one line and exit code
            stopped = error
        else:
            if error is None:
                message = f"{what}: failed on another rank (see its log)"
            elif isinstance(error, EngineFailure):
                message = f"{what}: {error}"
            else:
                rank = self.dist.dp_rank if self.dist is not None else 0
                message = f"{what} on data-parallel rank {rank}: {type(error).__name__}: {error}"
            fix = "" if isinstance(error, EngineFailure) else " (with the cause fixed)"
            stopped = RuntimeError(f"{message}. {saved}; rerun the same command to resume{fix}")
        try:
            self.runner.stop_with_checkpoint(stopped, error if error is not stopped else None)
        except Exception as exc:
            self._raised = exc
            raise


def _attempt(fn: Callable[[], T]) -> tuple[T | None, Exception | None]:
    """fn()'s result, or the exception it raised."""
    try:
        return fn(), None
    except Exception as exc:
        return None, exc


def _named(what: str, fn: Callable[[], T]) -> T:
    """fn(), an engine call: what it raises is named an EngineFailure, unless it names itself (the engine's death,
    its failure, a collective's)."""
    try:
        return fn()
    except (EngineDied, EngineFailure, DistError):
        raise
    except Exception as exc:
        raise EngineFailure(f"engine failed on {what}: {type(exc).__name__}: {exc}") from exc
