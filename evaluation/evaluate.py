"""k samples per problem from an engine, each scored as training scores it: the run's reward (rewards/scorer.py: the
rule reward, or the user's function) on rl/reward.py `response_text`, so the same tokens get the same reward in
training and in evaluation. The engine is a guarded
one (run/guard.py GuardedEngine: its generate checks what the engine returned and watches its progress). The
estimators and the majority-vote rules are in evaluation/metrics.py; the report in evaluation/report.py."""

from __future__ import annotations

import dataclasses
import time
import zlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from data.prompts import load_split
from evaluation.metrics import ProblemResult, pass_ks
from evaluation.report import make_report
from rewards.scorer import Scorer
from rollout.engine import Completion, Generator, SamplingParams

if TYPE_CHECKING:
    from config import Config
    from data.prompts import PromptExample
    from model.tokenizer import Tokenizer
    from observe.progress import Progress


def evaluate(
    engine: Generator,
    examples: Sequence[PromptExample],
    tokenizer: Tokenizer,
    params: SamplingParams,
    *,
    strict_box: bool = False,
    progress: Progress | None = None,
    pass_at: Sequence[int] | None = None,
    prompts_per_call: int | None = None,
    scorer: Scorer | None = None,
) -> dict[str, Any]:
    """Generate `params.n` (= k) samples for each of `examples` (distinct problems: a repeat is refused), score
    them, and summarise (evaluation/report.py).

    progress: advanced by the problems done, with the running accuracy as `acc=`. pass_at: the j of the reported
    pass@j (None or empty: 1 and k). prompts_per_call: problems per `engine.generate` call (None: all in one
    call, which keeps the engine's batch fullest; smaller calls give the progress display finer steps). scorer: the
    reward (None: the rule reward, boxed answers only with `strict_box`).
    """
    examples = list(examples)
    ks = checked_pass_ks(params, examples, pass_at, prompts_per_call)
    start = time.perf_counter()
    k, chunk, results = params.n, prompts_per_call or max(len(examples), 1), list[ProblemResult]()
    for begin in range(0, len(examples), chunk):
        batch = examples[begin : begin + chunk]
        completions = engine.generate([list(e.prompt_ids) for e in batch], call_params(params, batch, begin))
        done = score_completions(
            batch, completions, tokenizer, k, strict_box=strict_box, stop_ids=params.stop_token_ids, scorer=scorer
        )
        results += done
        if progress is not None:
            progress.update(len(batch), acc=sum(r.num_correct for r in done) / (k * len(done)))
    return make_report(results, ks, params, strict_box, time.perf_counter() - start)


def checked_pass_ks(
    params: SamplingParams,
    examples: Sequence[PromptExample],
    pass_at: Sequence[int] | None,
    prompts_per_call: int | None,
    shared: bool = False,
) -> tuple[int, ...]:
    """The j of the reported pass@j, after refusing arguments `evaluate` cannot run with (`shared`: the examples
    are this rank's share, which may be empty)."""
    if not isinstance(params, SamplingParams):
        raise TypeError(f"params must be a rollout.engine.SamplingParams, got {type(params).__name__}")
    if not examples and not shared:
        raise ValueError("evaluate() needs at least one example")
    _refuse_repeats(examples)
    k = params.n
    ks = tuple(pass_at or pass_ks(k))
    bad = [j for j in ks if not 1 <= j <= k]
    if bad:
        raise ValueError(f"pass@{bad[0]} needs between 1 and k = {k} samples per problem")
    if prompts_per_call is not None and prompts_per_call < 1:
        raise ValueError(f"prompts_per_call must be >= 1 or None, got {prompts_per_call}")
    return ks


def call_params(params: SamplingParams, batch: Sequence, begin: int) -> SamplingParams:
    """The params of one generate call. A fixed seed is combined with the call's first problem, so calls
    (chunks, data-parallel ranks) draw independent samples instead of replaying one random stream; the
    same problems and seed still give the same samples."""
    if params.seed is None or not batch:
        return params
    return dataclasses.replace(params, seed=zlib.crc32(f"{params.seed}-{begin}-{batch[0].index}".encode()))


def params_from_config(cfg: Config, stop_token_ids: Sequence[int], seed: int | None = None) -> SamplingParams:
    """Evaluation SamplingParams from a config.Config: eval.k samples at eval.temperature / eval.top_p /
    eval.top_k, responses of eval.max_response_length tokens (default: rollout.max_response_length).
    Greedy decoding is temperature 0 with no filter (the configuration's rules hold eval.k to 1 for it)."""
    ev = cfg.eval
    return SamplingParams(
        max_new_tokens=cfg.eval_max_new_tokens,
        temperature=0.0 if ev.greedy else ev.temperature,
        top_p=1.0 if ev.greedy else ev.top_p,
        top_k=-1 if ev.greedy else ev.top_k,
        n=ev.k,
        stop_token_ids=tuple(stop_token_ids),
        seed=seed,
    )


def load_eval_set(cfg: Config, tokenizer: Tokenizer) -> list[PromptExample]:
    """The held-out problems of `data.eval_path` (a parquet file, or the synthetic task's eval split),
    prompts of at most data.max_prompt_length tokens, the first eval.eval_size of them."""
    examples = load_split(cfg.data, "eval", tokenizer)
    return examples[: cfg.eval.eval_size] if cfg.eval.eval_size else examples


def score_completions(
    examples: Sequence[PromptExample],
    completions: Sequence[Completion],
    tokenizer: Tokenizer,
    k: int,
    *,
    strict_box: bool = False,
    stop_ids: Sequence[int] = (),
    scorer: Scorer | None = None,
) -> list[ProblemResult]:
    """One ProblemResult per example from its k completions (grouped by prompt, as the engine's generate returns
    them, checked: run/guard.py).

    Each response is scored as training scores it (`scorer`, None: the rule reward; rewards/scorer.py
    Scorer.score_completions).
    """
    verdicts = (scorer or Scorer(strict_box=strict_box)).score_completions(tokenizer, completions, examples, stop_ids)
    results = []
    for p, example in enumerate(examples):
        group, scores = completions[p * k : (p + 1) * k], verdicts[p * k : (p + 1) * k]
        results.append(
            ProblemResult(
                data_source=example.data_source,
                acc=[s.acc for s in scores],
                pred=[s.pred for s in scores],
                response_length=[len(c.token_ids) for c in group],
                truncated=[c.finish_reason == "length" for c in group],
            )
        )
    return results


def _refuse_repeats(examples: Sequence) -> None:
    seen: dict[tuple, int] = {}
    for i, e in enumerate(examples):
        key = (tuple(e.prompt_ids), e.ground_truth)
        if key in seen:
            raise ValueError(
                f"example {i} repeats example {seen[key]}: evaluate distinct problems and set the samples per "
                "problem with SamplingParams.n = k"
            )
        seen[key] = i
