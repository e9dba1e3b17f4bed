"""One step's rollout phase (Algorithm 1, lines 3-8): generate, score, filter, until the batch is full.

Every rank generates whole groups for its own prompts, so group statistics need no communication. A round
submits its groups to the engine (rollout/engine.py PartialEngine) and polls: each poll returns the groups
that finished, scored at once, and the ranks then agree (one all-reduce) on whether the round is over, so
every rank makes as many engine calls, each through the run's guard (run/guard.py: a failure on any rank
stops every rank with a checkpoint, a signal stops them after the call), and a rank's wait for the others is
bounded by one poll. A round is over when every rank's engine has returned every group, or, with partial
rollout (rollout.partial), as soon as every rank's batch is full: what still runs is then stopped, and each
unfinished group (its prompt, its samples' tokens so far and their log-probs) is continued first in the next
step's first round, under the new weights; a group older than rollout.partial_max_age steps is dropped.
"""

from __future__ import annotations

import dataclasses
import functools
import time
import zlib
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, TypeVar

from rl.data import PromptSampler
from rl.filter import DynamicBatchBuilder
from rollout.engine import Completion, GroupRequest, PartialEngine, SamplingParams
from run.guard import engine_reported
from trainer.scoring import RewardSettings, score_groups
from trainer.types import RolloutBatch, RolloutGroup, Sample, Unfinished

T = TypeVar("T")

if TYPE_CHECKING:
    from config import Config
    from config.schema import RolloutConfig
    from model.tokenizer import Tokenizer
    from observe.progress import Progress
    from parallel.dist_env import DistEnv
    from run.guard import Guard


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


class RolloutPhase:
    """Lines 3-8 of Algorithm 1 on this rank, built once (`from_config`) and called every step (`collect`).

    engine, sampler (this rank's prompts), builder (dynamic sampling, Eq. 11), tokenizer, dist_env; params:
    the rollout's sampling; reward: the rule reward and soft overlong punishment; prompts_per_round: prompts
    a round draws; partial: end a round once the batch is full (partial rollout); max_age: steps an unfinished
    group may wait. `unfinished`: the groups stopped at the last round's end, checkpointed (run/state.py).
    """

    def __init__(
        self,
        engine: PartialEngine,
        sampler: PromptSampler,
        builder: DynamicBatchBuilder[list[Sample]],
        tokenizer: Tokenizer,
        dist_env: DistEnv,
        *,
        params: SamplingParams,
        reward: RewardSettings,
        prompts_per_round: int,
        partial: bool = False,
        max_age: int = 1,
    ):
        self.engine, self.sampler, self.builder, self.tokenizer = engine, sampler, builder, tokenizer
        self.dist, self.params, self.reward, self.prompts_per_round = dist_env, params, reward, prompts_per_round
        self.partial, self.max_age = partial, max_age
        self.unfinished: list[Unfinished] = []

    @classmethod
    def from_config(
        cls,
        cfg: Config,
        engine: PartialEngine,
        sampler: PromptSampler,
        builder: DynamicBatchBuilder[list[Sample]],
        tokenizer: Tokenizer,
        dist_env: DistEnv,
    ) -> RolloutPhase:
        ro = cfg.rollout
        return cls(
            engine,
            sampler,
            builder,
            tokenizer,
            dist_env,
            params=rollout_sampling(ro, tokenizer.stop_ids, cfg.job.seed),
            reward=RewardSettings.from_config(cfg),
            prompts_per_round=cfg.prompts_per_round,
            partial=ro.partial,
            max_age=ro.partial_max_age,
        )

    def collect(self, step: int, guard: Guard, progress: Progress | None = None) -> RolloutBatch:
        """Generation rounds until every rank's batch is full or max_num_gen_batches rounds ran, then the batch
        dynamic sampling hands out (surplus groups carried over). Every engine call goes through `guard`.
        progress: counts this rank's kept groups, advanced after every poll (None: no display)."""
        builder, batch = self.builder, RolloutBatch()
        builder.start_step(step)  # carried-over groups come first
        continued = self.continued(step, batch)  # then the unfinished groups of earlier steps (partial rollout)
        while builder.rounds < builder.max_rounds and not guard.everyone(builder.full()):
            fresh = [Unfinished(e, [], step) for e in self.sampler.next_batch(self.prompts_per_round)]
            builder.add_round(GenerationRound(self, step, batch, progress).run(guard, continued + fresh))
            continued = []  # Eq. 11 above: keep the groups whose accuracy varies
        self.unfinished = continued + self.unfinished  # not submitted: no round ran (the carry filled the batch)
        batch.groups = batch.metrics.add_batch(guard.call(f"step {step}", builder.finish), self.params.n)
        return batch

    def continued(self, step: int, batch: RolloutBatch) -> list[Unfinished]:
        """The unfinished groups to continue at `step`, those older than max_age steps dropped (counted)."""
        waiting, self.unfinished = self.unfinished, []
        young = [u for u in waiting if step - u.started <= self.max_age]
        batch.metrics.partial.dropped_old.add(len(waiting) - len(young))
        return young

    def score(self, groups: list[Unfinished], completions: list[Completion], step: int) -> dict[int, RolloutGroup]:
        """The finished `groups` scored from their engine `completions` (n per group, any order), by group key,
        each sample knowing how many of its tokens an earlier step's policy generated and its age."""
        by_key, n, stop_ids = _by_group(completions), self.params.n, set(self.params.stop_token_ids)
        keys = sorted(by_key)
        ordered = [dataclasses.replace(c, prompt_index=i) for i, k in enumerate(keys) for c in by_key[k]]
        examples = [groups[k].example for k in keys]
        scored = score_groups(examples, ordered, n, self.tokenizer, self.reward, stop_ids, step)
        for key, group in zip(keys, scored):
            for sample, older in zip(group.payload, groups[key].older_tokens(n)):
                sample.continued_tokens, sample.age = older, step - groups[key].started
        return dict(zip(keys, scored))


class GenerationRound:
    """One generation round of a step: its groups submitted, polled until over, the rest stopped (module doc)."""

    def __init__(self, phase: RolloutPhase, step: int, batch: RolloutBatch, progress: Progress | None):
        self.phase, self.step, self.batch, self.progress = phase, step, batch, progress
        self.shown = min(phase.builder.num_kept, phase.builder.train_batch_size) if phase.builder.rounds else 0
        self.what = f"step {step}, generation round {phase.builder.rounds + 1}"

    def run(self, guard: Guard, groups: list[Unfinished]) -> list[RolloutGroup]:
        """The round's finished groups, scored; the unfinished ones are left in phase.unfinished."""
        phase, step = self.phase, self.step
        # A seed derived from (seed, step, round, rank) makes every round reproducible after a resume.
        seed = zlib.crc32(f"{phase.params.seed}-{step}-{phase.builder.rounds}-{phase.dist.dp_rank}".encode())
        params = dataclasses.replace(phase.params, seed=seed)
        requests = [GroupRequest(key, g.example.prompt_ids, g.samples) for key, g in enumerate(groups)]
        self.guarded(guard, "submit", lambda: phase.engine.submit(requests, params), len(groups))
        in_flight, scored, polls = set(range(len(groups))), dict[int, RolloutGroup](), 0
        while True:
            done = self.guarded(guard, "poll", phase.engine.poll, len(in_flight))
            in_flight -= {c.prompt_index for c in done}
            scored.update(self.guarded(guard, "", functools.partial(self.scored, groups, done), 0))
            polls += 1
            self.show(scored, f"{polls} polls")
            enough = phase.partial and phase.builder.num_kept + sum(map(phase.builder.keeps, scored.values())) >= (
                phase.builder.train_batch_size
            )
            if guard.everyone(enough or not in_flight):
                break
        stopped = self.guarded(guard, "stop", phase.engine.stop, len(in_flight))
        running = {c.prompt_index for c in stopped if c.finish_reason == "abort"}  # the others finished meanwhile
        finished = [c for c in stopped if c.prompt_index not in running]
        scored.update(self.guarded(guard, "", functools.partial(self.scored, groups, finished), 0))
        phase.unfinished += self.stopped(groups, [c for c in stopped if c.prompt_index in running])
        # In the order the groups were submitted, not finished: a batch the filter fills from them (Eq. 11) keeps
        # the first groups of the round, as without partial rollout, not the fastest (the shortest responses).
        return [scored[key] for key in sorted(scored)]

    def guarded(self, guard: Guard, engine_call: str, call: Callable[[], list[T] | None], groups: int) -> list[T]:
        """call() through the guard: engine.submit / poll / stop (`engine_call` names it), timed into the phase's
        generate time, or the scoring of what the engine returned (engine_call "")."""

        def timed() -> list[T]:
            if not engine_call:
                return call() or []
            start = time.perf_counter()
            with engine_reported(f"{engine_call} of {groups} groups x {self.phase.params.n} samples"):
                out = call()
            self.batch.metrics.generate_s.add(time.perf_counter() - start)
            return out or []

        return guard.call(self.what, timed, boundary=bool(engine_call))

    def scored(self, groups: list[Unfinished], completions: list[Completion]) -> list[tuple[int, RolloutGroup]]:
        """Finished groups scored, with their keys, and counted among the step's generated samples (and tokens)."""
        start = time.perf_counter()
        scored = self.phase.score(groups, completions, self.step)
        self.batch.metrics.add_generated(list(scored.values()), time.perf_counter() - start)
        return list(scored.items())

    def stopped(self, groups: list[Unfinished], completions: list[Completion]) -> list[Unfinished]:
        """The groups stopped unfinished: kept with their samples so far, to continue in the next step."""
        by_key = _by_group(completions)
        new_tokens = sum(len(c.token_ids) for c in completions)
        old_tokens = sum(sum(groups[key].older_tokens(self.phase.params.n)) for key in by_key)
        self.batch.metrics.partial.stopped.add(len(by_key))
        self.batch.metrics.tokens.add(new_tokens - old_tokens)
        return [self.kept(groups[key], samples) for key, samples in sorted(by_key.items())]

    def kept(self, group: Unfinished, samples: list[Completion]) -> Unfinished:
        """A stopped group as the next step continues it; one stopped before any token is a fresh group there."""
        if any(c.token_ids for c in samples):
            return Unfinished(group.example, samples, group.started)
        return Unfinished(group.example, [], self.step + 1)

    def show(self, scored: dict[int, RolloutGroup], polls: str) -> None:
        """The display advanced to the groups kept so far, counting this round's `scored` groups."""
        if self.progress is None:
            return
        builder = self.phase.builder
        kept = min(builder.num_kept + sum(map(builder.keeps, scored.values())), builder.train_batch_size)
        self.progress.update(kept - self.shown, rounds=builder.rounds + 1, calls=polls)
        self.shown = kept


def _by_group(completions: list[Completion]) -> dict[int, list[Completion]]:
    """Completions by group key, each group's in sample order."""
    by_key: dict[int, list[Completion]] = {}
    for c in sorted(completions, key=lambda c: (c.prompt_index, c.sample_index)):
        by_key.setdefault(c.prompt_index, []).append(c)
    return by_key
