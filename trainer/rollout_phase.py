"""One step's rollout phase (Algorithm 1, lines 3-8): sample prompts, generate G responses each, score them
(Eq. 13), keep the groups whose accuracy varies (Eq. 11), until the batch is full.

Every rank generates whole groups for its own prompts, so group statistics need no communication. The engine is
the run's guarded one (run/guard.py GuardedEngine): each of its calls runs on every rank, and a failure on any
of them stops every rank with a checkpoint; `engine.everyone(builder.full())` ends the rounds on every rank
together. A batch still short after the last round is trained on, or stops the run (`on_shortfall`).
"""

from __future__ import annotations

import dataclasses
import logging
import zlib
from collections.abc import Iterable
from typing import TYPE_CHECKING, Literal

from rollout.engine import Generator, SamplingParams
from trainer.scoring import score_groups

if TYPE_CHECKING:
    from config import Config
    from config.schema import RolloutConfig
    from data.prompts import PromptSampler
    from model.tokenizer import Tokenizer
    from rewards.scorer import Scorer
    from rl.filter import DynamicBatchBuilder
    from rl.stats import FilterStats
    from trainer.observers import RolloutWatch
    from trainer.types import RolloutGroup, Sample

log = logging.getLogger("train")


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


def on_shortfall(filtered: FilterStats, step: int, policy: Literal["fill", "raise"], max_rounds: int) -> None:
    """A batch dynamic sampling (Eq. 11) left short after its last round: trained on with one line (on_shortfall
    "fill"), or the run stopped (on_shortfall "raise")."""
    short = int(filtered.shortfall.result())
    if short:
        kept = int(filtered.in_batch.result())
        wanted = kept + short
        rounds = filtered.rounds.result()
        message = f"dynamic sampling kept {kept} of {wanted} groups at step {step} after {rounds} of {max_rounds}"
        message += " generation rounds"
        if policy == "raise":
            raise RuntimeError(f"{message} (on_shortfall 'raise'): allow more rounds or train on what was kept")
        log.warning("%s; training on the smaller batch", message)


class RolloutPhase:
    """Lines 3-8 of Algorithm 1 on this rank, built once and called every step (`collect_batch`): the run's
    configuration, its guarded engine, this rank's prompt sampler, dynamic sampling's batch builder (Eq. 11),
    the tokenizer the reward decodes with, this rank's data-parallel index, the phase's observer and the reward
    (rewards/scorer.py; None: the rule reward)."""

    def __init__(
        self,
        cfg: Config,
        engine: Generator,
        sampler: PromptSampler,
        builder: DynamicBatchBuilder[list[Sample]],
        tokenizer: Tokenizer,
        dp_rank: int,
        watch: RolloutWatch,
        scorer: Scorer | None = None,
    ):
        self.cfg, self.engine, self.sampler, self.builder, self.tokenizer = cfg, engine, sampler, builder, tokenizer
        self.dp_rank, self.watch, self.scorer = dp_rank, watch, scorer
        self.params = rollout_sampling(cfg.rollout, tokenizer.stop_ids, cfg.job.seed)

    def collect_batch(self, step: int) -> list[RolloutGroup]:
        """Generation rounds until every rank's batch holds its train_batch_size groups, at most
        max_num_gen_batches rounds: the batch dynamic sampling hands out (surplus carried over)."""
        builder, cfg = self.builder, self.cfg
        self.watch.start(step)
        builder.start_step(step)  # carried-over groups come first
        while builder.rounds < builder.max_rounds and not self.engine.everyone(builder.full()):
            examples = self.sampler.next_batch(cfg.prompts_per_round)
            completions = self.engine.generate([e.prompt_ids for e in examples], self.round_params(step))
            groups = score_groups(examples, completions, self.tokenizer, cfg, step, self.scorer)  # rewards, Eq. 13
            builder.add_round(groups)  # Eq. 11: keep the groups whose accuracy varies
            self.watch.round(groups)
        batch, filtered = builder.finish()  # the kept groups (surplus carried over) and what the filter did
        self.watch.batch(batch, filtered)
        on_shortfall(filtered, step, cfg.algorithm.on_shortfall, builder.max_rounds)  # a batch still short
        return batch

    def round_params(self, step: int) -> SamplingParams:
        """The round's sampling, seeded from (seed, step, round, rank): every round is reproducible after a resume."""
        seed = zlib.crc32(f"{self.params.seed}-{step}-{self.builder.rounds}-{self.dp_rank}".encode())
        return dataclasses.replace(self.params, seed=seed)
