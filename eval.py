"""Evaluate a policy: k samples per problem, scored by rl/reward.py, reported as avg@k / pass@k / maj@k.

    python eval.py --model DIR --data PATH|synthetic --k 32 --temperature 1.0 --top-p 0.7 \\
        --max-new-tokens 20480 [--tokenizer DIR] [--engine torch|sglang] [--json OUT]

DIR is a Hugging Face checkpoint directory (config.json + safetensors, e.g. written by
model.hf.save_hf) or a run folder, whose `hf/` export is then used. The data is a parquet file in
the DAPO-Math-17k schema (AIME 2024 in the paper) or "synthetic" (the built-in arithmetic task's
held-out split). The defaults are the paper's evaluation settings: k = 32, temperature 1.0, top_p 0.7,
responses of up to 20480 tokens. The script prints a table (one row per data source, then the
overall row) followed by one JSON line with the full report.

`evaluate` is the same code train.py runs every `eval.interval` steps with its own engine. The
estimators and the majority-vote rules are in rl/eval_metrics.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
import time
import zlib
from collections.abc import Callable, Sequence

from rl.eval_metrics import ProblemResult, pass_ks, summarize
from rollout.engine import Completion, SamplingParams
from trainer.scoring import check_completions, rule_score


# ---------------------------------------------------------------------------------------------------
# Evaluation
# ---------------------------------------------------------------------------------------------------


def evaluate(engine, examples: Sequence, tokenizer, params: SamplingParams, *, strict_box: bool = False,
             progress=None, pass_at: Sequence[int] | None = None, prompts_per_call: int | None = None,
             gather: Callable[[list[ProblemResult]], list[ProblemResult]] | None = None) -> dict:
    """Generate `params.n` (= k) samples for each example, score them, and summarise.

    examples: distinct problems (rl/data.py PromptExample: prompt_ids, ground_truth, data_source);
        k comes from params.n, so a data set loaded with repeat > 1 is refused.
    progress: None/False for no display, True for one on stderr, or an object with `update(n, **postfix)`
        (e.g. observe.progress.Progress) that is advanced by the number of problems done, with the
        running accuracy as `acc=`.
    pass_at: the j of the reported pass@j (each <= k); default 1 and k.
    prompts_per_call: problems per `engine.generate` call (None: all in one call, which keeps the
        engine's batch fullest; smaller calls give the progress display finer steps).
    gather: merges the per-problem results of all ranks (e.g. wrapping all_gather_object) when each
        rank evaluates its own share of the problems (which may be empty); None for a single process.

    Returns {"k", "overall": {...}, "by_source": {source: {...}}, "sampling": {...}, "time_s"}; the
    rows hold num_problems, num_samples, avg@k, pass@j, maj@k, response_length/mean (tokens, stop
    token included) and truncated_share (samples that hit max_new_tokens).
    """
    if not isinstance(params, SamplingParams):
        raise TypeError(f"params must be a rollout.engine.SamplingParams, got {type(params).__name__}")
    examples = list(examples)
    if not examples and gather is None:
        raise ValueError("evaluate() needs at least one example")
    _refuse_repeats(examples)
    k = params.n
    ks = tuple(pass_ks(k) if pass_at is None else pass_at)
    bad = [j for j in ks if not 1 <= j <= k]
    if bad:
        raise ValueError(f"pass@{bad[0]} needs between 1 and k = {k} samples per problem")
    if prompts_per_call is not None and prompts_per_call < 1:
        raise ValueError(f"prompts_per_call must be >= 1 or None, got {prompts_per_call}")
    chunk = prompts_per_call or max(len(examples), 1)

    owned = progress is True
    if owned:
        from observe.progress import Progress

        progress = Progress(total=len(examples), desc="eval", unit="problems")
    results: list[ProblemResult] = []
    start = time.perf_counter()
    # Ranks that share one engine (SGLang's TP group) generate in one collective call: a rank without
    # problems still takes part, with no prompts, or its group would wait for it forever.
    starts = range(0, len(examples), chunk) if examples or getattr(engine, "group", None) is None else [0]
    try:
        for begin in starts:
            batch = examples[begin:begin + chunk]
            completions = engine.generate([list(e.prompt_ids) for e in batch], _call_params(params, batch, begin))
            results.extend(score_completions(batch, completions, tokenizer, k, strict_box=strict_box,
                                             stop_ids=params.stop_token_ids))
            if progress is not None and progress is not False and batch:
                done = results[-len(batch):]
                progress.update(len(batch), acc=sum(r.num_correct for r in done) / (k * len(done)))
    finally:
        if owned:
            progress.close()
    elapsed = time.perf_counter() - start
    if gather is not None:
        results = gather(results)  # a rank with no share of the problems contributes nothing
        if not results:
            raise ValueError("evaluate() needs at least one example (none on any rank)")
    report = summarize(results, ks)
    report["sampling"] = {"n": k, "temperature": params.temperature, "top_p": params.top_p, "top_k": params.top_k,
                          "max_new_tokens": params.max_new_tokens, "strict_box": strict_box}
    report["time_s"] = elapsed
    return report


def _call_params(params: SamplingParams, batch: Sequence, begin: int) -> SamplingParams:
    """The params of one generate call. A fixed seed is combined with the call's first problem, so calls
    (chunks, data-parallel ranks) draw independent samples instead of replaying one random stream; the
    same problems and seed still give the same samples."""
    if params.seed is None or not batch:
        return params
    return dataclasses.replace(params, seed=zlib.crc32(f"{params.seed}-{begin}-{batch[0].index}".encode()))


def params_from_config(cfg, stop_token_ids, seed: int | None = None) -> SamplingParams:
    """Evaluation SamplingParams from a config.Config: eval.k samples at eval.temperature / eval.top_p
    (greedy: one sample at temperature 0), responses of eval.max_response_length tokens (default:
    rollout.max_response_length), top_k off."""
    ev = cfg.eval
    if ev.greedy and ev.k != 1:
        raise ValueError(f"eval.greedy draws one sample per problem; eval.k must be 1, got {ev.k}")
    return SamplingParams(
        max_new_tokens=ev.max_response_length or cfg.rollout.max_response_length,
        temperature=0.0 if ev.greedy else ev.temperature,
        top_p=1.0 if ev.greedy else ev.top_p,
        n=ev.k,
        stop_token_ids=tuple(stop_token_ids),
        seed=seed,
    )


def score_completions(examples: Sequence, completions: Sequence[Completion], tokenizer, k: int, *,
                      strict_box: bool = False, stop_ids: Sequence[int] = ()) -> list[ProblemResult]:
    """One ProblemResult per example from its k completions (grouped by prompt, as engines return them).

    Each response is scored as training scores it (trainer/scoring.py `rule_score` on `response_text`:
    special tokens, such as the final <|im_end|>, are not part of the answer). An engine answer with
    missing, aborted or misgrouped completions raises trainer.scoring.EngineFailure.
    """
    check_completions(completions, len(examples), k)
    results = []
    for p, example in enumerate(examples):
        group = completions[p * k:(p + 1) * k]
        scores = [rule_score(tokenizer, c.token_ids, example.ground_truth, stop_ids=stop_ids, strict_box=strict_box)
                  for c in group]
        results.append(ProblemResult(
            data_source=example.data_source,
            acc=[bool(s["acc"]) for s in scores],
            pred=[s["pred"] for s in scores],
            response_length=[len(c.token_ids) for c in group],
            truncated=[c.finish_reason == "length" for c in group],
        ))
    return results


def _refuse_repeats(examples: Sequence) -> None:
    seen: dict[tuple, int] = {}
    for i, e in enumerate(examples):
        key = (tuple(e.prompt_ids), e.ground_truth)
        if key in seen:
            raise ValueError(f"example {i} repeats example {seen[key]}: evaluate distinct problems (load with "
                             "repeat=1) and set the samples per problem with SamplingParams.n = k")
        seen[key] = i


# ---------------------------------------------------------------------------------------------------
# Reporting
# ---------------------------------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------------


def resolve_checkpoint(path: str) -> str:
    """The HF checkpoint directory for --model: `path` itself, or a run folder's `hf/` export."""
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    if os.path.isfile(os.path.join(path, "hf", "config.json")):
        return os.path.join(path, "hf")
    raise FileNotFoundError(f"--model {path}: neither an HF checkpoint (no config.json) nor a run folder with an "
                            "hf/ export (no hf/config.json)")


def resolve_tokenizer(explicit: str | None, model_dir: str, model_arg: str) -> str:
    """The tokenizer directory: --tokenizer, else the checkpoint's, else the run folder's."""
    if explicit:
        return explicit
    for candidate in dict.fromkeys((model_dir, model_arg)):
        if os.path.isfile(os.path.join(candidate, "tokenizer.json")):
            return candidate
    raise FileNotFoundError(f"no tokenizer.json in {model_dir}" + (f" or {model_arg}" if model_arg != model_dir else "")
                            + "; pass --tokenizer DIR")


def load_examples(args, tokenizer) -> list:
    from rl.data import load_prompts, rows_to_examples, synthetic_arithmetic_rows

    if args.data == "synthetic":
        rows = synthetic_arithmetic_rows(args.synthetic_num, difficulty=args.synthetic_difficulty, split="eval",
                                         seed=args.data_seed)
        examples, _ = rows_to_examples(rows, tokenizer, max_prompt_length=args.max_prompt_length,
                                       source_name="synthetic")
    else:
        examples = load_prompts(args.data, tokenizer, max_prompt_length=args.max_prompt_length)
    return examples[:args.limit] if args.limit else examples


def build_engine(args, model_dir: str, longest_prompt: int):
    import torch

    dtype = getattr(torch, args.dtype)
    if args.engine == "sglang":
        from rollout.sglang_engine import SGLangEngine

        return SGLangEngine(model_dir, tp_size=args.tp_size, mem_fraction_static=args.mem_fraction, dtype=dtype,
                            seed=args.seed)
    from model.hf import load_hf
    from rollout.torch_engine import TorchEngine

    model = load_hf(model_dir, dtype=dtype, device=args.device)
    # The engine never needs more context than the longest prompt plus the response budget.
    max_seq_len = min(model.args.max_position_embeddings, longest_prompt + args.max_new_tokens)
    if max_seq_len < longest_prompt + args.max_new_tokens:
        print(f"warning: the model's context of {max_seq_len} tokens leaves the longest prompt "
              f"{max_seq_len - longest_prompt} of the {args.max_new_tokens} new tokens asked for; longer responses "
              f"end with finish reason 'length'", file=sys.stderr)
    return TorchEngine(model, max_batch_size=args.max_batch_size, max_seq_len=max_seq_len, seed=args.seed)


def parse_args(argv=None) -> argparse.Namespace:
    import torch

    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description="Evaluate a policy with avg@k / pass@k / maj@k.")
    p.add_argument("--model", required=True, help="HF checkpoint directory, or a run folder (uses its hf/ export)")
    p.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the checkpoint's)")
    p.add_argument("--data", required=True, help="parquet file in the DAPO schema, or 'synthetic'")
    p.add_argument("--k", type=int, default=32, help="samples per problem")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=0.7)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--greedy", action="store_true", help="one greedy sample per problem (needs --k 1)")
    p.add_argument("--max-new-tokens", type=int, default=20480, help="response budget in tokens")
    p.add_argument("--max-prompt-length", type=int, default=2048, help="longer prompts are left-truncated")
    p.add_argument("--pass-at", type=int, nargs="+", default=None, help="the j of pass@j (default: 1 and k)")
    p.add_argument("--strict-box", action="store_true", help="score only \\boxed{} answers")
    p.add_argument("--limit", type=int, default=0, help="evaluate only the first N problems (0: all)")
    p.add_argument("--synthetic-num", type=int, default=200, help="synthetic held-out problems")
    p.add_argument("--synthetic-difficulty", type=int, default=2)
    p.add_argument("--data-seed", type=int, default=0, help="seed of the synthetic task")
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    p.add_argument("--engine", choices=("torch", "sglang"), default="torch")
    p.add_argument("--device", default="cuda" if cuda else "cpu", help="torch engine device")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="bfloat16" if cuda else "float32")
    p.add_argument("--max-batch-size", type=int, default=256, help="torch engine: sequences decoded at once")
    p.add_argument("--prompts-per-call", type=int, default=0,
                   help="problems per generate call (0: torch fills its batch once per call, sglang takes all)")
    p.add_argument("--tp-size", type=int, default=1, help="sglang: tensor-parallel size")
    p.add_argument("--mem-fraction", type=float, default=0.8, help="sglang: static memory fraction")
    p.add_argument("--json", default=None, help="also write the report to this file")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    if args.greedy:
        if args.k != 1:
            p.error(f"--greedy draws one deterministic sample per problem; it needs --k 1, got --k {args.k}")
        args.temperature, args.top_p, args.top_k = 0.0, 1.0, -1  # argmax: the report shows no unused filter
    for name in ("k", "max_new_tokens", "max_prompt_length", "max_batch_size", "synthetic_num"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    for name in ("limit", "prompts_per_call"):
        if getattr(args, name) < 0:
            p.error(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    return args


def main(argv=None) -> dict:
    from model.tokenizer import Tokenizer

    args = parse_args(argv)
    # Data-loading counts (duplicates, truncated prompts) go to stderr; a no-op where logging is set up.
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    model_dir = resolve_checkpoint(args.model)
    tokenizer = Tokenizer.from_dir(resolve_tokenizer(args.tokenizer, model_dir, args.model))
    examples = load_examples(args, tokenizer)
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, n=args.k, stop_token_ids=tuple(tokenizer.stop_ids), seed=args.seed)
    per_call = args.prompts_per_call or (max(1, args.max_batch_size // args.k) if args.engine == "torch" else None)
    engine = build_engine(args, model_dir, max(len(e.prompt_ids) for e in examples))
    try:
        report = evaluate(engine, examples, tokenizer, params, strict_box=args.strict_box,
                          progress=not args.no_progress, pass_at=args.pass_at, prompts_per_call=per_call)
    finally:
        engine.shutdown()
    report["model"] = os.path.abspath(model_dir)
    report["data"] = args.data
    print(format_table(report))
    print(json.dumps(report))
    if args.json:
        write_report(report, args.json)
    return report


def run_cli(argv=None) -> None:
    """`main` with the exit a shell expects for bad input: one line naming the problem, exit code 2.

    Bad input is a missing checkpoint or tokenizer (FileNotFoundError), an unusable data file
    (rl.data.DataError: missing, empty, not parquet, no rows, missing columns) or an impossible setting
    (ValueError); anything else is a failure and keeps its traceback.
    """
    try:
        main(argv)
    except (FileNotFoundError, ValueError) as exc:
        from rl.data import DataError

        kind = "data error: " if isinstance(exc, DataError) else ""
        print(f"eval.py: {kind}{exc}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    run_cli()
