"""One step's rollout phase (Algorithm 1, lines 3-8): generate, score, filter, until the batch is full.

Every rank generates whole groups for its own prompts, so group statistics need no communication. The
ranks agree, through one all-reduce per round, on whether every rank's batch is full: the engines may
hold collectives (SGLang TP, weight sync) and all ranks must run the same number of rounds.
"""

from __future__ import annotations

import dataclasses
import time
import zlib
from typing import TYPE_CHECKING

from rl.data import PromptSampler
from rl.filter import DynamicBatchBuilder
from rollout.engine import Engine, SamplingParams
from trainer.scoring import EngineFailure, RewardSettings, score_groups
from trainer.step_metrics import add_totals, sample_totals

if TYPE_CHECKING:
    from model.tokenizer import Tokenizer
    from trainer.distributed import DistEnv


def generate_round(
    engine: Engine,
    sampler: PromptSampler,
    prompts_per_round: int,
    params: SamplingParams,
    tokenizer: Tokenizer,
    reward: RewardSettings,
    step: int = 0,
    retries: int = 1,
):
    """Draw this rank's prompts, generate params.n samples each, score them into groups.

    Returns (groups, seconds generating, seconds scoring).
    An engine exception or an aborted request is retried `retries` times on the same prompts, then
    raised as EngineFailure with the request count and the engine's message.
    """
    examples = sampler.next_batch(prompts_per_round)
    stop_ids = set(params.stop_token_ids)
    last_error = None
    for _ in range(retries + 1):
        start = time.perf_counter()
        try:
            completions = engine.generate([e.prompt_ids for e in examples], params)
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


class RolloutError(RuntimeError):
    """The rollout phase of a step stopped on every rank for a reason that is not the engine's."""


class BatchShortfall(RolloutError):
    """Dynamic sampling could not fill the batch and algorithm.on_shortfall is "raise"."""


# What a rank tells the others after each round: the worst of these wins.
_ROUND_OK, _ROUND_ENGINE_FAILED, _ROUND_FAILED = 0.0, 1.0, 2.0


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
):
    """Run generation rounds until every rank's builder is full or the round limit is reached.

    Returns (groups for this rank's batch, diagnostics, {"generate": s, "score": s}); diagnostics are
    the builder's plus "generated", the `sample_totals` of every sample this rank generated in the step.
    An engine failure (EngineFailure), any other error of a round (RolloutError) or a shortfall under
    on_shortfall="raise" (BatchShortfall) on any rank is raised on every rank, so no rank is left
    waiting in a collective and train.py can checkpoint the last completed step.
    progress: an observe.progress.Progress counting this rank's kept groups (None: no display).
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
        failure, status = None, _ROUND_OK
        try:
            groups, gen_s, score_s = generate_round(
                engine, sampler, prompts_per_round, dataclasses.replace(params, seed=seed), tokenizer, reward, step
            )
        except EngineFailure as exc:
            failure, status = exc, _ROUND_ENGINE_FAILED
        except Exception as exc:  # scoring or data: still agreed on, so no rank waits in a collective
            failure = RolloutError(
                f"step {step}, generation round {builder.rounds + 1} on data-parallel rank "
                f"{dist_env.dp_rank}: {type(exc).__name__}: {exc}"
            )
            failure.__cause__, status = exc, _ROUND_FAILED
        worst = dist_env.all_reduce([status], op="max", group="world")[0]
        if worst == _ROUND_ENGINE_FAILED:
            raise failure or EngineFailure("the engine failed on another rank")
        if worst == _ROUND_FAILED:
            raise failure or RolloutError(f"step {step}: the rollout phase failed on another rank (see its log)")
        seconds["generate"] += gen_s
        seconds["score"] += score_s
        builder.add_round(groups)
        generated = add_totals(generated, sample_totals(groups))
        if progress is not None:
            kept = min(builder.num_kept, builder.train_batch_size)
            progress.update(kept - shown, rounds=builder.rounds)
            shown = kept
    if builder.on_shortfall == "raise":
        short = dist_env.all_reduce([float(not builder.full())], op="max", group="world")[0] > 0
        if short:
            raise BatchShortfall(
                f"dynamic sampling could not fill the batch of step {step} in "
                f"{builder.rounds} generation rounds (algorithm.on_shortfall = 'raise'); "
                f"raise algorithm.max_num_gen_batches or set algorithm.on_shortfall = 'fill'"
            )
    batch, diagnostics = builder.finish()
    return batch, dict(diagnostics, generated=generated), seconds
