"""Evaluate a policy: k samples per problem, scored as training scores them, reported as avg@k / pass@k / maj@k.

    python eval.py --model DIR [--data PATH|synthetic] [--config FILE] [--section.key=value ...]
    python eval.py --config configs/dapo_32b.toml --model runs/dapo-32b --data aime_2024.parquet

The settings are train.py's: the same TOML file (default configs/demo_cpu.toml) and the same
`--section.key=value` overrides. Evaluation reads [eval] (k, temperature, top_p, top_k, greedy,
max_response_length, eval_size, pass_at), the engine's [rollout] settings, [data] (the prompt length, the
columns, the synthetic task), [reward] (the run's reward function, checked on the first problems before the
model loads), algorithm.strict_box, job.seed (sampling) and metrics.progress. So a run's recipe
evaluates its checkpoints with the settings of its own held-out evaluations, and
`--config configs/dapo_32b.toml` gives the paper's (avg@32 at temperature 1.0, top_p 0.7, responses of up
to 20480 tokens).

The short flags set one key each: `--model DIR` is model.hf_path (a Hugging Face checkpoint directory, a hub
id, or a run folder, whose `hf/` export is then used; it clears model.preset), `--data` is data.eval_path
(a parquet or jsonl file in the DAPO-Math-17k schema, a hub data set id, or "synthetic") and `--tokenizer DIR` is
model.tokenizer_path (default: the checkpoint's, else the run folder's). The command prints a table (one row
per data source, then the overall row; its header before the evaluation, so an output that cannot be written
fails before any work) followed by one JSON line with the full report, so the report as a file is
`set -o pipefail; python eval.py ... | tail -n 1 > report.json` (indented: `| tail -n 1 | jq .`): without
pipefail the pipe's status is tail's, 0 even when eval.py failed and the file holds no report.
The evaluation itself is evaluation/evaluate.py.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import Any

from config import Config, config_parser, parse_config_args
from errors import ConfigError, broken_link, report, writing
from evaluation.evaluate import evaluate, load_eval_set, params_from_config
from evaluation.metrics import pass_ks
from evaluation.report import format_table, table_header
from model.hf import check_checksums, check_finite_weights
from model.hf_adapter import read_hf_config
from observe.progress import Progress
from preflight import limits
from preflight.checks import eval_problems
from preflight.hub_inputs import EVAL_INPUTS, fetch_hub_inputs
from rewards.scorer import build_scorer
from rollout.engine_spec import EngineSpec
from run.guard import GuardedEngine


def _short_flags(args: argparse.Namespace) -> list[str]:
    """The overrides the short flags stand for (--model also clears the recipe's random-init preset)."""
    flags = [f"model.hf_path={args.model}", "model.preset="] if args.model is not None else []
    flags += [f"data.eval_path={args.data}"] if args.data is not None else []
    return flags + ([f"model.tokenizer_path={args.tokenizer}"] if args.tokenizer is not None else [])


def parse_cli(argv: list[str] | None = None) -> tuple[Config, argparse.Namespace]:
    """The configuration (`--config`, then the short flags, then `--section.key=value`) and the flags."""
    parser = config_parser(
        "Evaluate a policy with avg@k / pass@k / maj@k.",
        "--eval.k=32 --eval.top_p=0.7 --rollout.max_batch_size=256 --data.synthetic_num_eval=50",
    )
    parser.add_argument("--model", help="model.hf_path: an HF checkpoint directory or hub id, or a run folder")
    parser.add_argument("--data", help="data.eval_path: a parquet / jsonl file or hub id, or 'synthetic'")
    parser.add_argument("--tokenizer", help="model.tokenizer_path (default: the checkpoint's)")
    return parse_config_args(parser, argv, _short_flags)


def resolve_checkpoint(path: str) -> str:
    """The HF checkpoint directory for --model: a run folder's `hf/` export, or `path` itself. The export is
    looked for first: a run folder holds a config.json of its own (the run's configuration)."""
    if not path:
        raise ConfigError("model.hf_path is not set: pass --model DIR (an HF checkpoint directory or a run folder)")
    if os.path.isfile(os.path.join(path, "hf", "config.json")):
        return os.path.join(path, "hf")
    if os.path.isdir(os.path.join(path, "checkpoints")):  # a run folder whose run has not finished
        from checkpoint.manager import CheckpointManager

        steps = CheckpointManager(os.path.join(path, "checkpoints")).complete_steps()
        at = f"its newest checkpoint is step {steps[-1]}" if steps else "it has no checkpoint yet"
        why = (
            f"its run has not finished ({at}); the export is written when it finishes (run its train.py command again)"
        )
        if os.path.isfile(os.path.join(path, "finished.json")):
            why = "its run finished with checkpoint.export_hf = false"
        raise ConfigError(f"--model {path} is a run folder without an HF export: {why}; or pass an HF checkpoint")
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    if broken_link(path):
        raise ConfigError(f"--model {path} {broken_link(path)}; pass an HF checkpoint directory or a run folder")
    raise ConfigError(
        f"--model {path}: neither an HF checkpoint (no config.json) nor a run folder with an "
        "hf/ export (no hf/config.json)"
    )


def resolve_tokenizer(explicit: str, model_dir: str, model_arg: str) -> str:
    """The tokenizer directory: --tokenizer, else the checkpoint's, else the run folder's."""
    if explicit:
        if not os.path.isfile(os.path.join(explicit, "tokenizer.json")):
            raise ConfigError(f"--tokenizer {explicit}: no tokenizer.json there; pass the folder that holds it")
        return explicit
    for candidate in dict.fromkeys((model_dir, model_arg)):
        if os.path.isfile(os.path.join(candidate, "tokenizer.json")):
            return candidate
    raise ConfigError(
        f"no tokenizer.json in {model_dir}"
        + (f" or {model_arg}" if model_arg != model_dir else "")
        + "; pass --tokenizer DIR"
    )


def check_sizes(cfg: Config, model_dir: str, per_call: int | None) -> None:
    """Before any work: the torch engine's KV cache and the samples of one generate call (`per_call` problems;
    None: all) fit this machine (preflight/limits.py)."""
    args = read_hf_config(model_dir)
    seq_len = min(args.max_position_embeddings, cfg.data.max_prompt_length + cfg.eval_max_new_tokens)
    limits.check_torch_engine_fits(cfg, args, seq_len)
    problems = eval_problems(cfg)  # None: a set read through `datasets`, counted as it is read (at least one)
    calls = [n for n in (per_call, problems) if n is not None]
    limits.check_evaluation_fits(cfg, min(calls, default=1), limits.physical_memory())


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from model.tokenizer import Tokenizer

    cfg, _ = parse_cli(argv)
    # Data-loading counts (duplicates, truncated prompts) go to stderr; a no-op where logging is set up.
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    cfg = fetch_hub_inputs(cfg, EVAL_INPUTS)  # hub ids: into the hub cache, then read from there
    model_dir = resolve_checkpoint(cfg.model.hf_path)
    check_checksums(model_dir)
    # The torch engine gets one full batch per call (the progress display moves per call); SGLang takes all.
    per_call = max(1, cfg.rollout.max_batch_size // cfg.eval.k) if cfg.rollout.engine == "torch" else None
    check_sizes(cfg, model_dir, per_call)
    check_finite_weights(model_dir)
    tokenizer_dir = resolve_tokenizer(cfg.model.tokenizer_path, model_dir, cfg.model.hf_path)
    if tokenizer_dir != model_dir:  # a folder of its own: checked as the checkpoint was
        check_checksums(tokenizer_dir)
    tokenizer = Tokenizer.from_dir(tokenizer_dir)
    examples = load_eval_set(cfg, tokenizer)
    params = params_from_config(cfg, tokenizer.stop_ids, seed=cfg.job.seed)
    header = table_header(params.n, cfg.eval.pass_at or pass_ks(params.n), {e.data_source for e in examples})
    with writing("the standard output"):  # before any work: an output that cannot be written (a full disk) fails now
        print("\n".join(header), flush=True)
    scorer = build_scorer(cfg)
    scorer.check(examples)
    longest_prompt = max((len(e.prompt_ids) for e in examples), default=0)
    started = EngineSpec.from_config(cfg).start_from_checkpoint(model_dir, longest_prompt, params.max_new_tokens)
    engine = GuardedEngine(started, hang_after_s=cfg.rollout.call_timeout_s)  # one process: its progress watched
    display = Progress(total=len(examples), desc="eval", unit="problems", enabled=cfg.metrics.progress)
    try:
        report = evaluate(
            engine,
            examples,
            tokenizer,
            params,
            strict_box=cfg.algorithm.strict_box,
            progress=display,
            pass_at=cfg.eval.pass_at,
            prompts_per_call=per_call,
            scorer=scorer,
        )
        display.close()
    finally:
        scorer.close()
        engine.shutdown()
    report["model"] = os.path.abspath(model_dir)
    report["data"] = cfg.data.eval_path
    report["reward"] = cfg.reward.function or "rule"
    with writing("the standard output"):
        print(format_table(report).split("\n", 2)[2], json.dumps(report), sep="\n", flush=True)
    return report


def run_cli(argv: list[str] | None = None) -> None:
    """`main` with the exits a shell expects, as train.py's (errors.py): bad input (a configuration problem,
    including a missing checkpoint or tokenizer; an unusable data file; a damaged checkpoint) is one line and
    exit code 2; Ctrl-C one line and 130; anything else is a failure and keeps its traceback."""
    try:
        main(argv)
    except KeyboardInterrupt:
        print("eval.py: interrupted (Ctrl-C); no report was written", file=sys.stderr)
        sys.exit(130)
    except Exception as exc:
        code = report(exc, prefix="eval.py: ")
        if code is None:
            raise
        sys.exit(code)


if __name__ == "__main__":
    run_cli()
