"""Evaluation: k samples per problem, scored as training scores them, reported as avg@k / pass@k / maj@k.

One library for both entry points: train.py evaluates its engine's current weights every
`eval.interval` steps (`run_held_out_eval`, each data-parallel rank on its share of the problems), and
eval.py evaluates a checkpoint. A response is scored by trainer/scoring.py (`check_completions`, then
`rule_score` on `response_text`), so the same tokens get the same reward in training and in evaluation.
The estimators and the majority-vote rules are in rl/eval_metrics.py.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
import zlib
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch.distributed as dist

from rl.data import load_prompts, rows_to_examples, synthetic_task_rows
from rl.eval_metrics import ProblemResult, pass_ks, summarize
from rollout.engine import Completion, Engine, EngineDied, SamplingParams
from trainer.memory import return_cached_memory
from trainer.scoring import EngineFailure, check_completions, rule_score

if TYPE_CHECKING:
    from model.tokenizer import Tokenizer
    from rl.data import PromptExample
    from trainer.distributed import DistEnv


def evaluate(
    engine,
    examples: Sequence,
    tokenizer,
    params: SamplingParams,
    *,
    strict_box: bool = False,
    progress=None,
    pass_at: Sequence[int] | None = None,
    prompts_per_call: int | None = None,
    gather: Callable[[list[ProblemResult]], list[ProblemResult]] | None = None,
) -> dict:
    """Generate `params.n` (= k) samples for each example, score them, and summarise.

    examples: distinct problems (rl/data.py PromptExample: prompt_ids, ground_truth, data_source);
        k comes from params.n, so a data set loaded with repeat > 1 is refused.
    progress: None/False for no display, True for one on stderr, or an object with `update(n, **postfix)`
        (e.g. observe.progress.Progress) that is advanced by the number of problems done, with the
        running accuracy as `acc=`.
    pass_at: the j of the reported pass@j (each <= k); None or empty: 1 and k.
    prompts_per_call: problems per `engine.generate` call (None: all in one call, which keeps the
        engine's batch fullest; smaller calls give the progress display finer steps).
    gather: merges the per-problem results of all ranks (e.g. wrapping all_gather_object) when each
        rank evaluates its own share of the problems (which may be empty); None for a single process.

    Returns {"k", "overall": {...}, "by_source": {source: {...}}, "sampling": {...}, "time_s"}; the
    rows hold num_problems, num_samples, avg@k, pass@j, maj@k, response_length/mean (tokens, stop
    token included) and truncated_share (samples that hit max_new_tokens).
    """
    examples = list(examples)
    ks = _checked_pass_ks(params, examples, pass_at, prompts_per_call, gather)
    start = time.perf_counter()
    results = problem_results(
        engine, examples, tokenizer, params, strict_box=strict_box, progress=progress, prompts_per_call=prompts_per_call
    )
    elapsed = time.perf_counter() - start
    if gather is not None:
        results = gather(results)  # a rank with no share of the problems contributes nothing
        if not results:
            raise ValueError("evaluate() needs at least one example (none on any rank)")
    return make_report(results, ks, params, strict_box, elapsed)


def problem_results(
    engine, examples: list, tokenizer, params: SamplingParams, *, strict_box: bool, progress, prompts_per_call
) -> list[ProblemResult]:
    """evaluate's generation and scoring of this process's examples, one ProblemResult each."""
    k = params.n
    chunk = prompts_per_call or max(len(examples), 1)
    owned = progress is True
    if owned:
        from observe.progress import Progress

        progress = Progress(total=len(examples), desc="eval", unit="problems")
    results: list[ProblemResult] = []
    # Ranks that share one engine (SGLang's TP group) generate in one collective call: a rank without
    # problems still takes part, with no prompts, or its group would wait for it forever.
    starts = range(0, len(examples), chunk) if examples or getattr(engine, "group", None) is None else [0]
    try:
        for begin in starts:
            batch = examples[begin : begin + chunk]
            completions = engine.generate([list(e.prompt_ids) for e in batch], _call_params(params, batch, begin))
            results.extend(
                score_completions(
                    batch, completions, tokenizer, k, strict_box=strict_box, stop_ids=params.stop_token_ids
                )
            )
            if progress is not None and progress is not False and batch:
                done = results[-len(batch) :]
                progress.update(len(batch), acc=sum(r.num_correct for r in done) / (k * len(done)))
    finally:
        if owned:
            progress.close()
    return results


def make_report(results: list[ProblemResult], ks, params: SamplingParams, strict_box: bool, elapsed: float) -> dict:
    """evaluate's report of all results (see evaluate)."""
    k = params.n
    report = summarize(results, ks)
    report["sampling"] = {
        "n": k,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k,
        "max_new_tokens": params.max_new_tokens,
        "strict_box": strict_box,
    }
    report["time_s"] = elapsed
    return report


def _checked_pass_ks(params, examples: list, pass_at, prompts_per_call, gather) -> tuple[int, ...]:
    """The j of the reported pass@j, after refusing arguments `evaluate` cannot run with."""
    if not isinstance(params, SamplingParams):
        raise TypeError(f"params must be a rollout.engine.SamplingParams, got {type(params).__name__}")
    if not examples and gather is None:
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


def _call_params(params: SamplingParams, batch: Sequence, begin: int) -> SamplingParams:
    """The params of one generate call. A fixed seed is combined with the call's first problem, so calls
    (chunks, data-parallel ranks) draw independent samples instead of replaying one random stream; the
    same problems and seed still give the same samples."""
    if params.seed is None or not batch:
        return params
    return dataclasses.replace(params, seed=zlib.crc32(f"{params.seed}-{begin}-{batch[0].index}".encode()))


def params_from_config(cfg, stop_token_ids, seed: int | None = None) -> SamplingParams:
    """Evaluation SamplingParams from a config.Config: eval.k samples at eval.temperature / eval.top_p /
    eval.top_k, responses of eval.max_response_length tokens (default: rollout.max_response_length).
    Greedy decoding is temperature 0 with no filter (the configuration's rules hold eval.k to 1 for it)."""
    ev = cfg.eval
    return SamplingParams(
        max_new_tokens=ev.max_response_length or cfg.rollout.max_response_length,
        temperature=0.0 if ev.greedy else ev.temperature,
        top_p=1.0 if ev.greedy else ev.top_p,
        top_k=-1 if ev.greedy else ev.top_k,
        n=ev.k,
        stop_token_ids=tuple(stop_token_ids),
        seed=seed,
    )


def load_eval_set(cfg, tokenizer) -> list:
    """The held-out problems of `data.eval_path` (a parquet file, or the synthetic task's eval split),
    prompts of at most data.max_prompt_length tokens, the first eval.eval_size of them."""
    data = cfg.data
    if data.eval_path == "synthetic":
        rows = synthetic_task_rows(data, "eval")
        examples = rows_to_examples(
            rows,
            tokenizer,
            max_prompt_length=data.max_prompt_length,
            overflow=data.prompt_overflow,
            source_name="synthetic eval",
        )[0]
    else:
        examples = load_prompts(
            data.eval_path, tokenizer, max_prompt_length=data.max_prompt_length, overflow=data.prompt_overflow
        )
    return examples[: cfg.eval.eval_size] if cfg.eval.eval_size else examples


def score_completions(
    examples: Sequence,
    completions: Sequence[Completion],
    tokenizer,
    k: int,
    *,
    strict_box: bool = False,
    stop_ids: Sequence[int] = (),
) -> list[ProblemResult]:
    """One ProblemResult per example from its k completions (grouped by prompt, as engines return them).

    Each response is scored as training scores it (trainer/scoring.py `rule_score` on `response_text`:
    special tokens, such as the final <|im_end|>, are not part of the answer). An engine answer with
    missing, aborted or misgrouped completions raises trainer.scoring.EngineFailure.
    """
    check_completions(completions, len(examples), k)
    results = []
    for p, example in enumerate(examples):
        group = completions[p * k : (p + 1) * k]
        scores = [
            rule_score(tokenizer, c.token_ids, example.ground_truth, stop_ids=stop_ids, strict_box=strict_box)
            for c in group
        ]
        results.append(
            ProblemResult(
                data_source=example.data_source,
                acc=[bool(s["acc"]) for s in scores],
                pred=[s["pred"] for s in scores],
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
                f"example {i} repeats example {seen[key]}: evaluate distinct problems (load with "
                "repeat=1) and set the samples per problem with SamplingParams.n = k"
            )
        seen[key] = i


def _pass_keys(row: dict) -> list[str]:
    return sorted((key for key in row if key.startswith("pass@")), key=lambda key: int(key[5:]))


def format_table(report: dict) -> str:
    """A fixed-width table: one row per data source, then "overall"; accuracies in percent."""
    k = report["k"]
    metric_keys = [f"avg@{k}", *_pass_keys(report["overall"]), f"maj@{k}"]
    rows = [(source, row) for source, row in report["by_source"].items()] + [("overall", report["overall"])]
    width = max(len("source"), *(len(name) for name, _ in rows))
    header = f"{'source':<{width}}  {'problems':>8}" + "".join(f"  {m:>8}" for m in metric_keys)
    header += f"  {'mean len':>8}  {'truncated':>9}"
    lines = [header, "-" * len(header)]
    for name, row in rows:
        if name == "overall" and len(rows) > 1:
            lines.append("-" * len(header))
        line = f"{name:<{width}}  {row['num_problems']:>8}" + "".join(f"  {100 * row[m]:>7.1f}%" for m in metric_keys)
        length, truncated = row.get("response_length/mean"), row.get("truncated_share")
        line += f"  {length:>8.1f}" if length is not None else f"  {'-':>8}"
        line += f"  {100 * truncated:>8.1f}%" if truncated is not None else f"  {'-':>9}"
        lines.append(line)
    return "\n".join(lines)


def flat_metrics(report: dict, prefix: str = "eval/") -> dict[str, float]:
    """The report as flat metrics for metrics.jsonl: eval/avg_at_k, eval/pass_at_<j>, eval/pass_at_k,
    eval/maj_at_k, eval/response_length/mean, eval/truncated_share, and eval/<source>/avg_at_k."""
    k = report["k"]
    overall = report["overall"]
    out = {f"{prefix}avg_at_k": overall[f"avg@{k}"], f"{prefix}maj_at_k": overall[f"maj@{k}"]}
    for key in _pass_keys(overall):
        out[f"{prefix}pass_at_{key[5:]}"] = overall[key]
    if f"pass@{k}" in overall:
        out[f"{prefix}pass_at_k"] = overall[f"pass@{k}"]
    for key in ("response_length/mean", "truncated_share"):
        if key in overall:
            out[prefix + key] = overall[key]
    for source, row in report["by_source"].items():
        out[f"{prefix}{source}/avg_at_k"] = row[f"avg@{k}"]
    return out


def write_report(report: dict, path: str) -> None:
    """Write the report as indented JSON (folders created; replaced atomically)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=2)
        f.write("\n")
    os.replace(tmp, path)


def _gather_outcomes(outcome: tuple, dist_env: DistEnv) -> list[tuple]:
    """(data-parallel rank, outcome) of every rank, gathered over the gloo control group of all ranks
    (trainer/distributed.py): a rank whose engine finished first waits here for the slowest, which can
    take longer than NCCL's 10-minute watchdog allows; the control group's timeout is
    rollout.round_timeout_s."""
    everyone = [None] * dist_env.world_size
    dist.all_gather_object(everyone, (dist_env.dp_rank, outcome), group=dist_env.control_group)
    return everyone


def _merged(everyone: list[tuple], local_error: BaseException | None) -> list[ProblemResult]:
    """The results of every data-parallel share in data-parallel order (tensor-parallel peers evaluate the
    same share: the first one's is kept), or, when any rank failed, that failure raised on every rank:
    an engine's death (EngineDied) first."""
    for kind in ("died", "failed"):
        failed = [(rank, value) for rank, (_, (status, value)) in enumerate(everyone) if status == kind]
        if failed:
            if local_error is not None and (kind == "failed" or isinstance(local_error, EngineDied)):
                raise local_error
            rank, why = failed[0]
            error = EngineDied if kind == "died" else EngineFailure
            raise error(f"the evaluation failed on rank {rank}: {why}")
    shares: dict[int, list] = {}
    for dp_rank, (_, results) in everyone:
        shares.setdefault(dp_rank, results)
    return [r for dp_rank in sorted(shares) for r in shares[dp_rank]]


def run_held_out_eval(
    engine: Engine,
    examples: Sequence[PromptExample],
    tokenizer: Tokenizer,
    params: SamplingParams,
    dist_env: DistEnv,
    run_path: str,
    step: int,
    *,
    strict_box: bool = False,
    progress=None,
    pass_at: Sequence[int] = (),
) -> dict[str, float]:
    """Evaluate the engine's current weights; returns flat `eval/...` metrics and writes eval/step_N.json.

    The trainer's cached GPU memory is handed back before the engine takes its memory back
    (trainer/memory.py). Data-parallel ranks split the problems and merge their results over the gloo
    control group (`_gather_outcomes`); tensor-parallel peers evaluate the same share with the same
    weights and seeds. A failure on any rank (the engine's death: EngineDied) is raised on every rank.
    """
    return_cached_memory(dist_env)
    mine = examples[dist_env.dp_rank :: dist_env.dp_size]
    ks = _checked_pass_ks(params, mine, pass_at, None, gather=dist_env.world_size > 1 or None)
    start = time.perf_counter()
    try:
        engine.resume_memory()
        results = problem_results(
            engine, mine, tokenizer, params, strict_box=strict_box, progress=progress, prompts_per_call=None
        )
        outcome, local_error = ("ok", results), None
    except Exception as exc:
        if dist_env.world_size == 1:
            raise
        outcome, local_error = (
            ("died" if isinstance(exc, EngineDied) else "failed", f"{type(exc).__name__}: {exc}"),
            exc,
        )
    elapsed = time.perf_counter() - start
    if dist_env.world_size > 1:
        results = _merged(_gather_outcomes(outcome, dist_env), local_error)
    if not results:
        raise ValueError("evaluate() needs at least one example (none on any rank)")
    report = make_report(results, ks, params, strict_box, elapsed)
    if dist_env.is_main:
        write_report(report, os.path.join(run_path, "eval", f"step_{step:06d}.json"))
    return flat_metrics(report)
