"""One step's rollout phase (Algorithm 1, lines 3-8): generate, score, filter, until the batch is full.

Every rank generates whole groups for its own prompts, so group statistics need no communication. The
ranks agree, through one all-reduce per round, on whether every rank's batch is full: the engines may
hold collectives (SGLang TP, weight sync) and all ranks must run the same number of rounds.
"""

from __future__ import annotations

import dataclasses
import time

from rl.filter import DynamicBatchBuilder
from rollout.engine import SamplingParams
from trainer.scoring import EngineFailure, RewardSettings, score_groups


def generate_round(engine, sampler, prompts_per_round: int, params: SamplingParams, tokenizer,
                   reward: RewardSettings, retries: int = 1):
    """Draw this rank's prompts, generate params.n samples each, score them into groups.

    An engine exception or an aborted request is retried `retries` times on the same prompts, then
    raised as EngineFailure with the request count and the engine's message.
    """
    examples = sampler.next_batch(prompts_per_round)
    stop_ids = set(params.stop_token_ids)
    last_error = None
    for _ in range(retries + 1):
        try:
            completions = engine.generate([e.prompt_ids for e in examples], params)
            return score_groups(examples, completions, params.n, tokenizer, reward, stop_ids)
        except EngineFailure as exc:
            last_error = exc
        except Exception as exc:  # the engine's own errors: report them with the request count
            last_error = EngineFailure(f"engine failed on {len(examples)} prompts x {params.n} samples: "
                                       f"{type(exc).__name__}: {exc}")
    raise last_error


def collect_batch(step: int, builder: DynamicBatchBuilder, engine, sampler, prompts_per_round: int,
                  params: SamplingParams, tokenizer, reward: RewardSettings, dist_env, progress=None):
    """Run generation rounds until every rank's builder is full or the round limit is reached.

    Returns (groups for this rank's batch, diagnostics, seconds spent generating, seconds scoring).
    """
    builder.start_step(step)
    gen_seconds = 0.0
    while True:
        everyone_full = dist_env.all_reduce([float(builder.full())], op="min")[0] > 0
        if everyone_full or builder.rounds >= builder.max_rounds:
            break
        start = time.perf_counter()
        # A seed derived from (step, round, rank) makes every round reproducible after a resume.
        seed = (params.seed or 0) * 1_000_003 + step * 1009 + builder.rounds * 101 + dist_env.dp_rank
        round_params = dataclasses.replace(params, seed=seed)
        groups = generate_round(engine, sampler, prompts_per_round, round_params, tokenizer, reward)
        gen_seconds += time.perf_counter() - start
        builder.add_round(groups)
        if progress is not None:
            progress(builder.rounds)
    batch, diagnostics = builder.finish()
    return batch, diagnostics, gen_seconds
