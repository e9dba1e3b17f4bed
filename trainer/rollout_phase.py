"""One step's rollout phase (Algorithm 1, lines 3-8): generate, score, filter, until the batch is full.

Every rank generates whole groups for its own prompts, so group statistics need no communication. The
ranks agree after every round on whether every rank's batch is full: the engines may hold collectives
(SGLang TP, weight sync) and all ranks must run the same number of rounds. A round is split into generate
calls of at most rollout.requests_per_call requests per engine, each through the run's guard (run/guard.py:
a failure on any rank stops every rank with a checkpoint, a signal stops them after the call), so a rank's
wait for the others is bounded by one call, and the progress display advances after each.
"""

from __future__ import annotations

import dataclasses
import functools
import time
import zlib
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from rl.data import PromptExample, PromptSampler
from rl.filter import DynamicBatchBuilder
from rollout.engine import Engine, SamplingParams
from run.guard import engine_reported, retried
from trainer.scoring import RewardSettings, score_groups
from trainer.types import RolloutBatch, RolloutGroup, Sample

if TYPE_CHECKING:
    from config import Config
    from config.schema import RolloutConfig
    from model.tokenizer import Tokenizer
    from observe.progress import Progress
    from parallel.dist_env import DistEnv
    from run.guard import Guard

GenerateCall = Callable[[], tuple[list[RolloutGroup], float, float]]


def generate_call(
    engine: Engine,
    examples: list[PromptExample],
    params: SamplingParams,
    tokenizer: Tokenizer,
    reward: RewardSettings,
    step: int = 0,
    retries: int = 1,
) -> tuple[list[RolloutGroup], float, float]:
    """Generate params.n samples for each of `examples` in one engine call and score them into groups:
    (groups, seconds generating, seconds scoring). What the engine itself reports (its own exception, aborted
    or malformed output: EngineFailure) is retried `retries` times on the same prompts (run/guard.py)."""
    stop_ids = set(params.stop_token_ids)

    def attempt() -> tuple[list[RolloutGroup], float, float]:
        start = time.perf_counter()
        with engine_reported(f"{len(examples)} prompts x {params.n} samples"):
            completions = engine.generate([e.prompt_ids for e in examples], params)
        generated = time.perf_counter()
        groups = score_groups(examples, completions, params.n, tokenizer, reward, stop_ids, step)
        return groups, generated - start, time.perf_counter() - generated

    return retried(attempt, retries)


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
        self.engine, self.sampler, self.builder, self.tokenizer = engine, sampler, builder, tokenizer
        self.dist, self.params, self.reward = dist_env, params, reward
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
        ranks_per_engine = ro.tp_size if ro.engine == "sglang" else 1
        return cls(
            engine,
            sampler,
            builder,
            tokenizer,
            dist_env,
            params=rollout_sampling(ro, tokenizer.stop_ids, cfg.job.seed),
            reward=RewardSettings.from_config(cfg),
            prompts_per_round=cfg.prompts_per_round,
            prompts_per_call=prompts_per_call(ro.requests_per_call, ro.n, ranks_per_engine),
        )

    def collect(self, step: int, guard: Guard, progress: Progress | None = None) -> RolloutBatch:
        """Generation rounds until every rank's batch is full or max_num_gen_batches rounds ran, then the batch
        dynamic sampling hands out (surplus groups carried over). Every engine call goes through `guard`.
        progress: counts this rank's kept groups, advanced after every call (None: no display)."""
        builder, batch, shown = self.builder, RolloutBatch(), 0
        builder.start_step(step)  # carried-over groups come first
        while builder.rounds < builder.max_rounds and not guard.everyone(builder.full()):
            what, groups, calls = f"step {step}, generation round {builder.rounds + 1}", [], self._calls(step)
            for number, call in enumerate(calls, 1):  # the round's prompts, prompts_per_call at a time
                groups += batch.metrics.add_call(guard.call(what, call, boundary=True))  # generate and score
                shown = self._show(progress, shown, groups, f"{number}/{len(calls)}")
            builder.add_round(groups)  # Eq. 11: keep the groups whose accuracy varies
        batch.groups = batch.metrics.add_batch(guard.call(f"step {step}", builder.finish), self.params.n)
        return batch

    def _calls(self, step: int) -> list[GenerateCall]:
        """The next round's generate calls. A seed derived from (seed, step, round, rank) makes every round
        reproducible after a resume; each call after the first derives its own."""
        seed = zlib.crc32(f"{self.params.seed}-{step}-{self.builder.rounds}-{self.dist.dp_rank}".encode())
        round_params = dataclasses.replace(self.params, seed=seed)
        examples = self.sampler.next_batch(self.prompts_per_round)
        chunk = self.prompts_per_call or max(len(examples), 1)
        parts = [examples[i : i + chunk] for i in range(0, len(examples), chunk)]
        engine, tokenizer, reward = self.engine, self.tokenizer, self.reward
        return [
            functools.partial(generate_call, engine, part, call_params(round_params, c), tokenizer, reward, step)
            for c, part in enumerate(parts)
        ]

    def _show(self, progress: Progress | None, shown: int, groups: list[RolloutGroup], calls: str) -> int:
        """The display advanced to the groups kept so far, counting this round's `groups` (returned)."""
        if progress is None:
            return shown
        builder = self.builder
        kept = min(builder.num_kept + sum(map(builder.keeps, groups)), builder.train_batch_size)
        progress.update(kept - shown, rounds=builder.rounds + 1, calls=calls)
        return kept
