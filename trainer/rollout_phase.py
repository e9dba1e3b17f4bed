"""One step's rollout phase (Algorithm 1, lines 3-8): generate, score, filter, until the batch is full.

Every rank generates whole groups for its own prompts, so group statistics need no communication. The
ranks agree, through one all-reduce per round, on whether every rank's batch is full: the engines may
hold collectives (SGLang TP, weight sync) and all ranks must run the same number of rounds. A round is
split into generate calls of at most rollout.requests_per_call requests per engine: a rank's wait for the
others is bounded by one call, the progress display advances after each, and a signal is honoured
between calls.
"""

from __future__ import annotations

import dataclasses
import functools
import time
import zlib
from collections.abc import Callable
from typing import TYPE_CHECKING

from rl.data import PromptSampler
from rl.filter import DynamicBatchBuilder
from rollout.engine import Engine, EngineDied, EngineFailure, SamplingParams
from trainer.scoring import RewardSettings, score_groups
from trainer.step_metrics import add_totals, sample_totals

if TYPE_CHECKING:
    from model.tokenizer import Tokenizer
    from parallel.dist_env import DistEnv


def generate_call(
    engine: Engine,
    examples: list,
    params: SamplingParams,
    tokenizer: Tokenizer,
    reward: RewardSettings,
    step: int = 0,
    retries: int = 1,
):
    """Generate params.n samples for each of `examples` in one engine call and score them into groups.

    Returns (groups, seconds generating, seconds scoring).
    An engine exception or an aborted request is retried `retries` times on the same prompts, then
    raised as EngineFailure with the request count and the engine's message. EngineDied (the engine's
    process is gone) is raised at once: nothing is left to retry on.
    """
    stop_ids = set(params.stop_token_ids)
    last_error = None
    for _ in range(retries + 1):
        start = time.perf_counter()
        try:
            completions = engine.generate([e.prompt_ids for e in examples], params)
        except EngineDied:
            raise
        except Exception as exc:  # the engine's own errors: report them with the request count
            last_error = EngineFailure(
                f"engine failed on {len(examples)} prompts x {params.n} samples: {type(exc).__name__}: {exc}"
            )
            continue
        generated = time.perf_counter()
        try:
            # Raises EngineFailure for aborted requests or malformed output; other errors are not the engine's.
            groups = score_groups(examples, completions, params.n, tokenizer, reward, stop_ids, step)
        except EngineFailure as exc:
            last_error = exc
            continue
        return groups, generated - start, time.perf_counter() - generated
    raise last_error


def call_params(params: SamplingParams, call: int) -> SamplingParams:
    """The params of a round's call number `call`: the round's seed for the first, one derived from it for
    each later call, so the calls of a round do not replay one random stream."""
    if params.seed is None or call == 0:
        return params
    return dataclasses.replace(params, seed=zlib.crc32(f"{params.seed}-call-{call}".encode()))


def prompts_per_call(requests_per_call: int, n: int, ranks_per_engine: int = 1) -> int:
    """Prompts one rank passes per generate call so that an engine call holds at most `requests_per_call`
    requests (prompts x n, summed over the `ranks_per_engine` ranks that share the engine); at least one
    whole group: a prompt's n samples are never split over calls."""
    return max(1, requests_per_call // (n * ranks_per_engine))


class RolloutError(RuntimeError):
    """The rollout phase of a step stopped on every rank for a reason that is not the engine's."""


class BatchShortfall(RolloutError):
    """Dynamic sampling could not fill the batch and algorithm.on_shortfall is "raise"."""


class RoundStopped(Exception):
    """A stop (a signal) was requested between two generate calls; every rank stopped there."""


# What a rank tells the others after each call: the worst of these wins.
_CALL_OK, _CALL_ENGINE_FAILED, _CALL_FAILED, _CALL_ENGINE_DIED = 0.0, 1.0, 2.0, 3.0


def agreed_call(dist_env: DistEnv, step: int, round_number: int, call) -> tuple:
    """call() on every rank, then one all-reduce of its outcome: a failure on any rank is raised on every
    rank (EngineDied before any other failure), so no rank is left waiting in a collective."""
    failure, status, result = None, _CALL_OK, None
    try:
        result = call()
    except EngineDied as exc:
        failure, status = exc, _CALL_ENGINE_DIED
    except EngineFailure as exc:
        failure, status = exc, _CALL_ENGINE_FAILED
    except Exception as exc:  # scoring or data: still agreed on
        failure = RolloutError(
            f"step {step}, generation round {round_number} on data-parallel rank {dist_env.dp_rank}: "
            f"{type(exc).__name__}: {exc}"
        )
        failure.__cause__, status = exc, _CALL_FAILED
    worst = dist_env.all_reduce([status], op="max", group="world")[0]
    if worst == _CALL_ENGINE_DIED:
        raise failure if status == _CALL_ENGINE_DIED else EngineDied("the rollout engine of another rank died")
    if worst == _CALL_FAILED:
        raise failure or RolloutError(f"step {step}: the rollout phase failed on another rank (see its log)")
    if worst == _CALL_ENGINE_FAILED:
        raise failure or EngineFailure("the engine failed on another rank")
    return result


def _after_call(step: int, builder, groups: list, calls: tuple[int, int], progress, shown: int, stop_requested) -> int:
    """After call calls[0] of calls[1]: the display advanced to the groups kept so far (returned), and
    RoundStopped raised when a stop was requested."""
    if progress is not None:
        kept = min(builder.num_kept + sum(map(builder.keeps, groups)), builder.train_batch_size)
        progress.update(kept - shown, rounds=builder.rounds + 1, calls=f"{calls[0]}/{calls[1]}")
        shown = kept
    if stop_requested is not None and stop_requested():
        raise RoundStopped(f"step {step}: stopped after generate call {calls[0]} of {calls[1]}")
    return shown


def _refuse_shortfall(step: int, builder: DynamicBatchBuilder, dist_env: DistEnv) -> None:
    """BatchShortfall on every rank when any rank's batch is short and on_shortfall is "raise"."""
    if builder.on_shortfall == "raise":
        short = dist_env.all_reduce([float(not builder.full())], op="max", group="world")[0] > 0
        if short:
            raise BatchShortfall(
                f"dynamic sampling could not fill the batch of step {step} in "
                f"{builder.rounds} generation rounds (algorithm.on_shortfall = 'raise'); "
                f"raise algorithm.max_num_gen_batches or set algorithm.on_shortfall = 'fill'"
            )


def collect_batch(
    step: int,
    builder: DynamicBatchBuilder,
    engine: Engine,
    sampler: PromptSampler,
    prompts_per_round: int,
    params: SamplingParams,
    tokenizer: Tokenizer,
    reward: RewardSettings,
    dist_env: DistEnv,
    progress=None,
    *,
    prompts_per_call: int | None = None,
    stop_requested: Callable[[], bool] | None = None,
):
    """Run generation rounds until every rank's builder is full or the round limit is reached.

    A round draws `prompts_per_round` prompts and generates for this rank's share in calls of at most
    `prompts_per_call` prompts (None: one call), the same number of calls on every rank.
    Returns (groups for this rank's batch, diagnostics, {"generate": s, "score": s}); diagnostics are
    the builder's plus "generated", the `sample_totals` of every sample this rank generated in the step.
    After every call the ranks agree (`agreed_call`): an engine failure (EngineFailure), an engine
    process's death (EngineDied) or any other error (RolloutError) on any rank is raised on every rank, so
    train.py can checkpoint the last completed step; so is a shortfall under on_shortfall="raise"
    (BatchShortfall). stop_requested(): asked after every call (a collective, e.g. GracefulStop.requested);
    True raises RoundStopped on every rank.
    progress: an observe.progress.Progress counting this rank's kept groups, advanced after every call
    (None: no display).
    """
    builder.start_step(step)
    seconds = {"generate": 0.0, "score": 0.0}
    generated = sample_totals([])
    shown = 0
    while True:
        everyone_full = dist_env.all_reduce([float(builder.full())], op="min")[0] > 0
        if everyone_full or builder.rounds >= builder.max_rounds:
            break
        # A seed derived from (seed, step, round, rank) makes every round reproducible after a resume.
        seed = zlib.crc32(f"{params.seed}-{step}-{builder.rounds}-{dist_env.dp_rank}".encode())
        round_params = dataclasses.replace(params, seed=seed)
        examples = sampler.next_batch(prompts_per_round)
        chunk = prompts_per_call or max(len(examples), 1)
        parts = [examples[i : i + chunk] for i in range(0, len(examples), chunk)]
        groups = []
        for call, part in enumerate(parts):
            generate = functools.partial(
                generate_call, engine, part, call_params(round_params, call), tokenizer, reward, step
            )
            new, gen_s, score_s = agreed_call(dist_env, step, builder.rounds + 1, generate)
            seconds["generate"] += gen_s
            seconds["score"] += score_s
            groups.extend(new)
            shown = _after_call(step, builder, groups, (call + 1, len(parts)), progress, shown, stop_requested)
        builder.add_round(groups)
        generated = add_totals(generated, sample_totals(groups))
    _refuse_shortfall(step, builder, dist_env)
    batch, diagnostics = builder.finish()
    return batch, dict(diagnostics, generated=generated), seconds
