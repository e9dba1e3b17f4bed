"""The probes' mechanism metrics (bench/mechanisms.py), per step, from what a run writes: its metrics.jsonl and
the samples each step trained on (rollouts/, trainer/rollout_dump.py), read against the task's own rows (their
extra_info, regenerated from the run's [data] section). `run_metrics` gives a run's rows: its metrics.jsonl lines
and one more line per step with the probe's keys.

clip_bias (tasks/coin.py)
    clip/upper       tokens clipped at 1 + eps_high (A > 0), share of trained tokens: pg_clipfrac_upper
    clip/lower       tokens clipped at 1 - eps_low (A < 0): pg_clipfrac - pg_clipfrac_upper
    (and the policy's entropy on its trained tokens, "entropy", as logged)
rare_strategy (tasks/fork.py), over the fork's prompts ("What is 17 + 24 + 31?")
    rare/share       samples whose first word is the rare strategy's
    rare/prob        the rollout policy's probability of the rare first token, mean over prompts: exp(first log-prob)
                     of a sample that starts with it, 1 - exp(first log-prob) of one that starts with the common one
    fork/entropy     the binary entropy of that probability, mean over prompts (nats)
    acc/fork, acc/rare, acc/common    accuracy of all samples, of those that chose each strategy
    (and "pg_clipfrac_upper/first_token", as logged: of every response's first token, the other kinds of prompt
    included, whose first token, p ~ 1, is never clipped at the upper bound)
length_budget (tasks/scan.py)
    truncated        samples that reached the length cap
    early            samples that answered before their check lines reached the even number
    short            samples written in the short style (of those with a check line)
    acc              accuracy;  len/right, len/wrong: mean length of right and of wrong answers (tokens)
    acc/late, acc/pos<j>    accuracy on the problems whose even number is in the last POSITIONS_LATE positions,
                     and at position j
"""

from __future__ import annotations

import functools
import json
import math
import os
import statistics
from collections import defaultdict

from bench.ablation_report import RunResult
from observe.metrics_log import MetricsLogger, read_metrics
from trainer.rollout_dump import FOLDER, read_dump

POSITIONS_LATE = 2


def clip_bias_rows(metrics: list[dict], dumps: dict, extra: list[dict]) -> list[dict]:
    """clip/upper and clip/lower of every training step's metrics line."""
    rows = []
    for row in metrics:
        if row.get("pg_clipfrac") is None or row.get("pg_clipfrac_upper") is None:
            continue
        upper = row["pg_clipfrac_upper"]
        rows.append({"step": row["step"], "clip/upper": upper, "clip/lower": row["pg_clipfrac"] - upper})
    return rows


def _mean(values) -> float | None:
    values = list(values)
    return statistics.fmean(values) if values else None


def _binary_entropy(p: float) -> float:
    return -sum(q * math.log(q) for q in (p, 1 - p) if q > 0)


def rare_strategy_rows(metrics: list[dict], dumps: dict, extra: list[dict]) -> list[dict]:
    """The rare strategy's share and probability, the fork's entropy and the accuracies, per step."""
    from tasks.fork import COMMON, RARE, response_strategy

    rare_word, common_word = RARE.split()[0], COMMON.split()[0]
    rows = []
    for step, samples in sorted(dumps.items()):
        fork = [s for s in samples if extra[s["prompt_index"]]["kind"] == "fork"]
        if not fork:
            continue
        by_prompt = defaultdict(list)
        for s in fork:
            words = s["response"].split()
            first = words[0] if words else ""
            p = math.exp(s["logprobs"][0]) if s["logprobs"] else 0.0
            if first == rare_word:
                by_prompt[s["prompt_index"]].append(p)
            elif first == common_word:
                by_prompt[s["prompt_index"]].append(1.0 - p)
        probs = [statistics.fmean(ps) for ps in by_prompt.values()]
        chose = [response_strategy(s["response"]) for s in fork]
        rows.append(
            {
                "step": step,
                "rare/share": statistics.fmean(c == RARE for c in chose),
                "rare/prob": _mean(probs),
                "fork/entropy": _mean(_binary_entropy(p) for p in probs),
                "acc/fork": statistics.fmean(s["acc"] for s in fork),
                "acc/rare": _mean(s["acc"] for s, c in zip(fork, chose) if c == RARE),
                "acc/common": _mean(s["acc"] for s, c in zip(fork, chose) if c == COMMON),
            }
        )
    return rows


def length_budget_rows(metrics: list[dict], dumps: dict, extra: list[dict]) -> list[dict]:
    """Truncation, early answers, the short style's share, accuracy by the answer's position, lengths."""
    from tasks.scan import answered_early, read_scan

    rows = []
    for step, samples in sorted(dumps.items()):
        if not samples:
            continue
        readings = [read_scan(s["response"]) for s in samples]
        problems = [extra[s["prompt_index"]] for s in samples]
        k = max(len(p["numbers"]) for p in problems)
        styled = [r.style for r in readings if r.style != "none"]
        row = {
            "step": step,
            "truncated": statistics.fmean(s["finish_reason"] == "length" for s in samples),
            "early": statistics.fmean(
                answered_early(r, p["numbers"], p["position"]) for r, p in zip(readings, problems)
            ),
            "short": statistics.fmean(style == "short" for style in styled) if styled else None,
            "acc": statistics.fmean(s["acc"] for s in samples),
            "len/right": _mean(s["length"] for s in samples if s["acc"]),
            "len/wrong": _mean(s["length"] for s in samples if not s["acc"]),
            "acc/late": _mean(s["acc"] for s, p in zip(samples, problems) if p["position"] > k - POSITIONS_LATE),
        }
        for j in range(1, k + 1):
            row[f"acc/pos{j}"] = _mean(s["acc"] for s, p in zip(samples, problems) if p["position"] == j)
        rows.append(row)
    return rows


PROBE_ROWS = {"clip_bias": clip_bias_rows, "rare_strategy": rare_strategy_rows, "length_budget": length_budget_rows}


@functools.lru_cache(maxsize=4)
def task_extra(data_json: str) -> list[dict]:
    """The extra_info of every training row of the synthetic task a [data] section (as JSON) describes."""
    from config.schema import DataConfig
    from data.prompts import synthetic_task_rows

    return [row["extra_info"] for row in synthetic_task_rows(DataConfig(**json.loads(data_json)), "train")]


def read_dumps(path: str) -> dict[int, list[dict]]:
    """{step: samples} of every step the run dumped."""
    folder = os.path.join(path, FOLDER)
    if not os.path.isdir(folder):
        return {}
    steps = sorted({int(name[5:11]) for name in os.listdir(folder) if name.startswith("step_")})
    return {step: read_dump(path, step) for step in steps}


def run_metrics(path: str, probe: str) -> RunResult | None:
    """The run folder's metrics.jsonl rows and the probe's own rows (None when it has no metrics yet)."""
    file = os.path.join(path, MetricsLogger.FILENAME)
    if not os.path.isfile(file):
        return None
    metrics = read_metrics(file)
    dumps = read_dumps(path)
    extra: list[dict] = []
    if dumps:
        with open(os.path.join(path, "config.json")) as f:
            extra = task_extra(json.dumps(json.load(f)["data"], sort_keys=True))
    return RunResult(metrics + PROBE_ROWS[probe](metrics, dumps, extra))
