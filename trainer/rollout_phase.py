"""One step's rollout phase (Algorithm 1, lines 3-8): generate, score, filter, until the batch is full.

Every rank generates whole groups for its own prompts, so group statistics need no communication. The
ranks agree, through one all-reduce per round, on whether every rank's batch is full: the engines may
hold collectives (SGLang TP, weight sync) and all ranks must run the same number of rounds.
"""

from __future__ import annotations

import dataclasses
import time
import zlib

from rl.filter import DynamicBatchBuilder
from rollout.engine import SamplingParams
from trainer.scoring import EngineFailure, RewardSettings, score_groups


def generate_round(engine, sampler, prompts_per_round: int, params: SamplingParams, tokenizer,
                   reward: RewardSettings, step: int = 0, retries: int = 1):
    """Draw this rank's prompts, generate params.n samples each, score them into groups.

    Returns (groups, seconds generating, seconds scoring).
    An engine exception or an aborted request is retried `retries` times on the same prompts, then
    raised as EngineFailure with the request count and the engine's message.
    """
    examples = sampler.next_batch(prompts_per_round)
    stop_ids = set(params.stop_token_ids)
    last_error = None
    for _ in range(retries + 1):
        try:
            start = time.perf_counter()
            completions = engine.generate([e.prompt_ids for e in examples], params)
            generated = time.perf_counter()
            groups = score_groups(examples, completions, params.n, tokenizer, reward, stop_ids, step)
            return groups, generated - start, time.perf_counter() - generated
        except EngineFailure as exc:
            last_error = exc
        except Exception as exc:  # the engine's own errors: report them with the request count
            last_error = EngineFailure(f"engine failed on {len(examples)} prompts x {params.n} samples: "
                                       f"{type(exc).__name__}: {exc}")
    raise last_error


def collect_batch(step: int, builder: DynamicBatchBuilder, engine, sampler, prompts_per_round: int,
                  params: SamplingParams, tokenizer, reward: RewardSettings, dist_env):
    """Run generation rounds until every rank's builder is full or the round limit is reached.

    Returns (groups for this rank's batch, diagnostics, {"generate": s, "score": s}). An
    engine failure or a shortfall under on_shortfall="raise" on any rank is raised on every rank, so
    no rank is left waiting in a collective.
    """
    builder.start_step(step)
    seconds = {"generate": 0.0, "score": 0.0}
    while True:
        everyone_full = dist_env.all_reduce([float(builder.full())], op="min")[0] > 0
        if everyone_full or builder.rounds >= builder.max_rounds:
            break
        # A seed derived from (seed, step, round, rank) makes every round reproducible after a resume.
        seed = zlib.crc32(f"{params.seed}-{step}-{builder.rounds}-{dist_env.dp_rank}".encode())
        failure = None
        try:
            groups, gen_s, score_s = generate_round(engine, sampler, prompts_per_round,
                                                    dataclasses.replace(params, seed=seed), tokenizer, reward, step)
        except EngineFailure as exc:
            failure = exc
        if dist_env.all_reduce([float(failure is not None)], op="max", group="world")[0] > 0:
            raise failure or EngineFailure("the engine failed on another rank")
        seconds["generate"] += gen_s
        seconds["score"] += score_s
        builder.add_round(groups)
    if builder.on_shortfall == "raise":
        short = dist_env.all_reduce([float(not builder.full())], op="max", group="world")[0] > 0
        if short:
            raise RuntimeError(f"dynamic sampling could not fill the batch of step {step} in "
                               f"{builder.rounds} generation rounds (algorithm.on_shortfall = 'raise')")
    batch, diagnostics = builder.finish()
    return batch, diagnostics, seconds
