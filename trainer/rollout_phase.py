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
from collections.abc import Callable, Iterable
from enum import IntEnum
from typing import TYPE_CHECKING, TypeVar

from rl.data import PromptExample, PromptSampler
from rl.filter import DynamicBatchBuilder
from rollout.engine import Engine, EngineDied, EngineFailure, SamplingParams
from trainer.scoring import RewardSettings, RolloutGroup, Sample, score_groups
from trainer.step_metrics import RolloutMetrics

if TYPE_CHECKING:
    from config import Config
    from config.schema import RolloutConfig
    from model.tokenizer import Tokenizer
    from observe.progress import Progress
    from parallel.dist_env import DistEnv

T = TypeVar("T")


def generate_call(
    engine: Engine,
    examples: list[PromptExample],
    params: SamplingParams,
    tokenizer: Tokenizer,
    reward: RewardSettings,
    step: int = 0,
    retries: int = 1,
) -> tuple[list[RolloutGroup], float, float]:
    """Generate params.n samples for each of `examples` in one engine call and score them into groups.

    Returns (groups, seconds generating, seconds scoring).
    An engine exception or an aborted request is retried `retries` times on the same prompts, then
    raised as EngineFailure with the request count and the engine's message. EngineDied (the engine's
    process is gone) is raised at once: nothing is left to retry on.
    """
    stop_ids = set(params.stop_token_ids)
    last_error = EngineFailure(f"no attempt was made (retries = {retries})")
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


def rollout_sampling(rollout: RolloutConfig, stop_ids: Iterable[int], seed: int) -> SamplingParams:
    """How a training rollout samples: rollout.n responses per prompt of at most rollout.max_response_length
    tokens, at the section's temperature, top-p and top-k, stopping at `stop_ids`."""
    return SamplingParams(
        max_new_tokens=rollout.max_response_length,
        temperature=rollout.temperature,
        top_p=rollout.top_p,
        top_k=rollout.top_k,
        n=rollout.n,
        stop_token_ids=tuple(stop_ids),
        seed=seed,
    )


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


class Outcome(IntEnum):
    """How a call went on one rank; the ranks agree on the worst (`agree`)."""

    OK = 0
    ENGINE_FAILED = 1  # the engine raised or aborted requests (retried once, then EngineFailure)
    FAILED = 2  # anything else: scoring, data
    ENGINE_DIED = 3  # the engine's process is gone (EngineDied)


def agree(dist_env: DistEnv, outcome: Outcome) -> Outcome:
    """The worst outcome over every rank (one all-reduce on the gloo control group: every rank calls it)."""
    return Outcome(int(dist_env.all_reduce([float(outcome)], op="max", group="world")[0]))


def agreed_call(dist_env: DistEnv, step: int, round_number: int, call: Callable[[], T]) -> T:
    """call() on every rank, then the ranks agree on how it went: a failure on any rank is raised on every
    rank (EngineDied before any other failure), so no rank is left waiting in a collective."""
    failure: BaseException | None = None
    try:
        result, outcome = call(), Outcome.OK
    except EngineDied as exc:
        failure, outcome = exc, Outcome.ENGINE_DIED
    except EngineFailure as exc:
        failure, outcome = exc, Outcome.ENGINE_FAILED
    except Exception as exc:  # scoring or data: still agreed on
        failure = RolloutError(
            f"step {step}, generation round {round_number} on data-parallel rank {dist_env.dp_rank}: "
            f"{type(exc).__name__}: {exc}"
        )
        failure.__cause__, outcome = exc, Outcome.FAILED
    worst = agree(dist_env, outcome)
    if worst == Outcome.ENGINE_DIED:
        if failure is not None and outcome == Outcome.ENGINE_DIED:
            raise failure
        raise EngineDied("the rollout engine of another rank died")
    if worst == Outcome.FAILED:
        raise failure or RolloutError(f"step {step}: the rollout phase failed on another rank (see its log)")
    if worst == Outcome.ENGINE_FAILED:
        raise failure or EngineFailure("the engine failed on another rank")
    return result


@dataclasses.dataclass
class RolloutBatch:
    """What a step's rollout phase hands the update: this rank's groups (kept, carried over), and the phase's
    metrics (every sample generated, the batch, what the filter did, the time spent)."""

    groups: list[RolloutGroup] = dataclasses.field(default_factory=list)
    metrics: RolloutMetrics = dataclasses.field(default_factory=RolloutMetrics)


class RolloutPhase:
    """Lines 3-8 of Algorithm 1 on this rank, built once (`from_config`) and called every step (`collect`).

    engine, sampler (this rank's prompts), builder (dynamic sampling, Eq. 11), tokenizer, dist_env; params:
    the rollout's sampling; reward: the rule reward and soft overlong punishment; prompts_per_round: prompts
    a round draws; prompts_per_call: prompts per generate call (None: the whole round in one call).
    """

    def __init__(
        self,
        engine: Engine,
        sampler: PromptSampler,
        builder: DynamicBatchBuilder[list[Sample]],
        tokenizer: Tokenizer,
        dist_env: DistEnv,
        *,
        params: SamplingParams,
        reward: RewardSettings,
        prompts_per_round: int,
        prompts_per_call: int | None = None,
    ):
        self.engine, self.sampler, self.builder, self.tokenizer, self.dist = (
            engine,
            sampler,
            builder,
            tokenizer,
            dist_env,
        )
        self.params, self.reward = params, reward
        self.prompts_per_round, self.prompts_per_call = prompts_per_round, prompts_per_call

    @classmethod
    def from_config(
        cls,
        cfg: Config,
        engine: Engine,
        sampler: PromptSampler,
        builder: DynamicBatchBuilder[list[Sample]],
        tokenizer: Tokenizer,
        dist_env: DistEnv,
    ) -> RolloutPhase:
        ro = cfg.rollout
        params = rollout_sampling(ro, tokenizer.stop_ids, cfg.job.seed)
        ranks_per_engine = ro.tp_size if ro.engine == "sglang" else 1
        return cls(
            engine,
            sampler,
            builder,
            tokenizer,
            dist_env,
            params=params,
            reward=RewardSettings.from_config(cfg),
            prompts_per_round=cfg.prompts_per_round,
            prompts_per_call=prompts_per_call(ro.requests_per_call, ro.n, ranks_per_engine),
        )

    def collect(
        self, step: int, *, progress: Progress | None = None, stop_requested: Callable[[], bool] | None = None
    ) -> RolloutBatch:
        """Generation rounds until every rank's builder is full or the round limit is reached.

        A round draws `prompts_per_round` prompts and generates for this rank's share in calls of at most
        `prompts_per_call` prompts, the same number of calls on every rank. After every call the ranks agree
        (`agreed_call`): an engine failure (EngineFailure), an engine process's death (EngineDied) or any other
        error (RolloutError) on any rank is raised on every rank, so train.py can checkpoint the last completed
        step; so is a shortfall under on_shortfall="raise" (BatchShortfall). stop_requested(): asked after
        every call (a collective, e.g. GracefulStop.requested); True raises RoundStopped on every rank.
        progress: counts this rank's kept groups, advanced after every call (None: no display).
        """
        builder = self.builder
        builder.start_step(step)
        batch = RolloutBatch()
        shown = 0
        while True:
            everyone_full = self.dist.all_reduce([float(builder.full())], op="min")[0] > 0
            if everyone_full or builder.rounds >= builder.max_rounds:
                break
            groups = []
            for call, part, params in self._calls(step):
                generate = functools.partial(
                    generate_call, self.engine, part, params, self.tokenizer, self.reward, step
                )
                groups += batch.metrics.add_call(agreed_call(self.dist, step, builder.rounds + 1, generate))
                shown = _after_call(step, builder, groups, call, progress, shown, stop_requested)
            builder.add_round(groups)
        _refuse_shortfall(step, builder, self.dist)
        batch.groups = batch.metrics.add_batch(builder.finish(), self.params.n)
        return batch

    def _calls(self, step: int) -> list[tuple[tuple[int, int], list[PromptExample], SamplingParams]]:
        """The next round's calls: ((number, of), prompts, params). A seed derived from (seed, step, round,
        rank) makes every round reproducible after a resume; each call after the first derives its own."""
        seed = zlib.crc32(f"{self.params.seed}-{step}-{self.builder.rounds}-{self.dist.dp_rank}".encode())
        round_params = dataclasses.replace(self.params, seed=seed)
        examples = self.sampler.next_batch(self.prompts_per_round)
        chunk = self.prompts_per_call or max(len(examples), 1)
        parts = [examples[i : i + chunk] for i in range(0, len(examples), chunk)]
        return [((c + 1, len(parts)), part, call_params(round_params, c)) for c, part in enumerate(parts)]


def _after_call(
    step: int,
    builder: DynamicBatchBuilder[list[Sample]],
    groups: list[RolloutGroup],
    calls: tuple[int, int],
    progress: Progress | None,
    shown: int,
    stop_requested: Callable[[], bool] | None,
) -> int:
    """After call calls[0] of calls[1]: the display advanced to the groups kept so far (returned), and
    RoundStopped raised when a stop was requested."""
    if progress is not None:
        kept = min(builder.num_kept + sum(map(builder.keeps, groups)), builder.train_batch_size)
        progress.update(kept - shown, rounds=builder.rounds + 1, calls=f"{calls[0]}/{calls[1]}")
        shown = kept
    if stop_requested is not None and stop_requested():
        raise RoundStopped(f"step {step}: stopped after generate call {calls[0]} of {calls[1]}")
    return shown


def _refuse_shortfall(step: int, builder: DynamicBatchBuilder[list[Sample]], dist_env: DistEnv) -> None:
    """BatchShortfall on every rank when any rank's batch is short and on_shortfall is "raise"."""
    if builder.on_shortfall == "raise":
        short = dist_env.all_reduce([float(not builder.full())], op="max", group="world")[0] > 0
        if short:
            raise BatchShortfall(
                f"dynamic sampling could not fill the batch of step {step} in "
                f"{builder.rounds} generation rounds (algorithm.on_shortfall = 'raise'); "
                f"raise algorithm.max_num_gen_batches or set algorithm.on_shortfall = 'fill'"
            )
