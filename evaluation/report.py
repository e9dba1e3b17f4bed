"""The evaluation report: avg@k / pass@k / maj@k per data source and overall (evaluation/metrics.py), as a
fixed-width table, as flat `eval/...` metrics for metrics.jsonl, and as a JSON file."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import Any

from errors import write_atomically
from evaluation.metrics import ProblemResult, summarize
from rollout.engine import SamplingParams


def make_report(
    results: list[ProblemResult], ks: Sequence[int], params: SamplingParams, strict_box: bool, elapsed: float
) -> dict[str, Any]:
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


def _pass_keys(row: dict) -> list[str]:
    return sorted((key for key in row if key.startswith("pass@")), key=lambda key: int(key[5:]))


def table_header(k: int, ks: Iterable[int], sources: Iterable[str]) -> list[str]:
    """The table's first two lines, known before any problem is evaluated (eval.py prints them first, so an output
    that cannot be written fails before the work): k samples, the j of pass@j, the data sources."""
    width = max(len("source"), len("overall"), *map(len, sources))
    metric_keys = [f"avg@{k}", *(f"pass@{j}" for j in sorted(set(ks))), f"maj@{k}"]
    header = f"{'source':<{width}}  {'problems':>8}" + "".join(f"  {m:>8}" for m in metric_keys)
    header += f"  {'mean len':>8}  {'truncated':>9}"
    return [header, "-" * len(header)]


def format_table(report: dict) -> str:
    """A fixed-width table: one row per data source, then "overall"; accuracies in percent."""
    k = report["k"]
    metric_keys = [f"avg@{k}", *_pass_keys(report["overall"]), f"maj@{k}"]
    rows = [(source, row) for source, row in report["by_source"].items()] + [("overall", report["overall"])]
    width = max(len("source"), *(len(name) for name, _ in rows))
    lines = table_header(k, [int(key[5:]) for key in metric_keys[1:-1]], report["by_source"])
    for name, row in rows:
        if name == "overall" and len(rows) > 1:
            lines.append(lines[1])
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
    """Write the report as indented JSON (folders created; replaced atomically; errors.py write_atomically)."""
    write_atomically(path, json.dumps(report, indent=2) + "\n")


def read_report(path: str) -> dict | None:
    """A report `write_report` wrote, or None when it is missing or unreadable (its flat metrics cannot be made)."""
    try:
        with open(path, encoding="utf-8") as f:
            report = json.load(f)
        flat_metrics(report)
        return report
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
