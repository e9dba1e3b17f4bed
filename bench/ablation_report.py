"""The ablation ladder's results: per rung and seed, the metrics of its run folder; the table; its markdown.

    held-out at the end: eval/avg_at_k at the last step (held-out avg@k, the paper's Table 1 column)
    late mean:           the mean of the held-out evaluations in the second half of training (steps > S/2):
                         a less noisy view of the same, fixed before the ladder ran
    gain:                per seed, this rung's value minus the rung before's (both start from that seed's
                         warm-up; the first rung's gain is over the warm-up itself), then the mean, standard
                         deviation and 95% interval of those differences
    clipped:             pg_clipfrac, the share of trained tokens whose ratio was clipped, mean over the steps
                         and seeds (and pg_clipfrac_upper, the share clipped at 1 + eps_high)
    entropy:             the policy's entropy on its trained tokens, mean of the first and of the last 5 steps

Spreads are sample standard deviations over seeds (n - 1 in the denominator; 0 for a single seed). The 95%
interval of a mean over n seeds is Student's t-interval, mean ± t(0.975, n - 1) x std / sqrt(n): it takes the
per-seed values (for a gain, the paired differences) as draws from a normal distribution.
"""

from __future__ import annotations

import json
import math
import os
import re
import statistics
from dataclasses import dataclass, field

from observe.metrics_log import MetricsLogger, read_metrics

HELD_OUT = "eval/avg_at_k"
_PAPER = re.compile(r"avg@32 = (\d+)")


def series_points(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of one key, sorted by step; a re-logged step keeps its last value; nulls skipped."""
    by_step: dict[int, float | None] = {}
    for row in rows:
        if key in row:
            by_step[row["step"]] = row[key]
    points = sorted((s, float(v)) for s, v in by_step.items() if isinstance(v, (int, float)) and math.isfinite(v))
    return [s for s, _ in points], [v for _, v in points]


@dataclass
class RunResult:
    """One run folder's metrics rows; `series(key)` gives (steps, values) with the last value per step."""

    rows: list[dict] = field(default_factory=list)

    def series(self, key: str) -> tuple[list[int], list[float]]:
        return series_points(self.rows, key)

    def value_at(self, key: str, step: int) -> float | None:
        steps, values = self.series(key)
        return values[steps.index(step)] if step in steps else None


def read_run(path: str) -> RunResult | None:
    """The run folder's metrics, or None when it has none yet."""
    file = os.path.join(path, MetricsLogger.FILENAME)
    return RunResult(read_metrics(file)) if os.path.isfile(file) else None


def paper_score(rung) -> str:
    """The rung's AIME 2024 avg@32 in the paper's Table 1, from its file's header ("" if not stated)."""
    with open(rung.path) as f:
        match = _PAPER.search(f.read())
    return match.group(1) if match else ""


def _mean_std(values: list[float]) -> tuple[float, float]:
    if not values:
        return math.nan, math.nan
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def _t_central_mass(t: float, df: int) -> float:
    """P(|T| < t) for Student's t with an integer df, in closed form (Abramowitz & Stegun 26.7.3-4):
    theta = atan(t / sqrt(df)); a finite series in sin and cos of theta."""
    theta = math.atan(t / math.sqrt(df))
    sin, cos = math.sin(theta), math.cos(theta)
    if df == 1:
        return 2 * theta / math.pi
    term = total = cos if df % 2 else 1.0
    for k in range(3 if df % 2 else 2, df, 2):
        term *= (k - 1) / k * cos * cos
        total += term
    return 2 / math.pi * (theta + sin * total) if df % 2 else sin * total


def t_quantile(level: float, df: int) -> float:
    """t such that P(|T| < t) = level for Student's t with df degrees of freedom (bisection to 1e-12)."""
    low, high = 0.0, 1.0
    while _t_central_mass(high, df) < level:
        high *= 2
    while high - low > 1e-12 * high:
        mid = (low + high) / 2
        low, high = (mid, high) if _t_central_mass(mid, df) < level else (low, mid)
    return (low + high) / 2


def interval95(values: list[float]) -> tuple[float, float]:
    """The 95% t-interval of the mean of `values` ((nan, nan) with fewer than two)."""
    if len(values) < 2:
        return math.nan, math.nan
    mean, std = _mean_std(values)
    half = t_quantile(0.95, len(values) - 1) * std / math.sqrt(len(values))
    return mean - half, mean + half


def _window_mean(run: RunResult, key: str, first: bool, width: int = 5) -> float | None:
    values = [v for v in run.series(key)[1] if v is not None and not math.isnan(v)]
    window = values[:width] if first else values[-width:]
    return statistics.fmean(window) if window else None


def _over_seeds(values) -> float:
    present = [v for v in values if v is not None]
    return statistics.fmean(present) if present else math.nan


def late_mean(run: RunResult, steps: int) -> float | None:
    """The mean of the held-out evaluations at steps > steps / 2 (None without any)."""
    points = [v for s, v in zip(*run.series(HELD_OUT)) if s > steps / 2]
    return statistics.fmean(points) if points else None


def ladder_table(runs: dict, rungs: list, seeds: list[int], steps: int) -> list[dict]:
    """One row per rung (and a first row for the warm-up): per-seed values, means, spreads and gains.

    runs: {(rung name or "warm-up", seed): RunResult}. A rung whose runs are not all finished gets None
    values for the missing seeds and is left out of the means (its row says how many seeds it has).
    """
    rows = []
    start = {s: runs[("warm-up", s)].value_at(HELD_OUT, 0) if ("warm-up", s) in runs else None for s in seeds}
    values = [v for v in start.values() if v is not None]
    mean, std = _mean_std(values)
    rows.append({"rung": "warm-up (step 0)", "switches": {}, "per_seed": start, "final_mean": mean, "final_std": std})
    before = start  # the first rung's gain is over the warm-up it starts from
    for rung in rungs:
        final, late = {}, {}
        for seed in seeds:
            run = runs.get((rung.name, seed))
            final[seed] = run.value_at(HELD_OUT, steps) if run else None
            late[seed] = late_mean(run, steps) if run else None
        row = {"rung": rung.name, "switches": rung.switches, "paper": paper_score(rung), "per_seed": final}
        row["final_mean"], row["final_std"] = _mean_std([v for v in final.values() if v is not None])
        row["late_mean"], row["late_std"] = _mean_std([v for v in late.values() if v is not None])
        row["seeds_done"] = sum(v is not None for v in final.values())
        pairs = [final[s] - before[s] for s in seeds if final[s] is not None and before[s] is not None]
        row["gain_mean"], row["gain_std"] = _mean_std(pairs)
        row["gain_ci"] = interval95(pairs)
        done = [runs[(rung.name, s)] for s in seeds if (rung.name, s) in runs]
        for key in ("pg_clipfrac", "pg_clipfrac_upper"):
            row[key] = _over_seeds(_over_seeds(r.series(key)[1]) if r.series(key)[1] else None for r in done)
        row["entropy_first"] = _over_seeds(_window_mean(r, "entropy", True) for r in done)
        row["entropy_last"] = _over_seeds(_window_mean(r, "entropy", False) for r in done)
        rows.append(row)
        before = final
    return rows


def paired_difference(rows: list[dict], seeds: list[int], first: int = 1, last: int = -1) -> dict:
    """The last rung minus the first per seed (full DAPO against naive GRPO): per seed, mean, std, interval."""
    a, b = rows[first]["per_seed"], rows[last]["per_seed"]
    per_seed = {s: b[s] - a[s] for s in seeds if a[s] is not None and b[s] is not None}
    mean, std = _mean_std(list(per_seed.values()))
    return {
        "from": rows[first]["rung"],
        "to": rows[last]["rung"],
        "per_seed": per_seed,
        "mean": mean,
        "std": std,
        "ci": interval95(list(per_seed.values())),
        "positive": sum(v > 0 for v in per_seed.values()),
    }


def _pct(value, spread=None) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    text = f"{100 * value:.1f}"
    return text if spread is None or math.isnan(spread) else f"{text} ± {100 * spread:.1f}"


def _signed(value, spread) -> str:
    if value is None or math.isnan(value):
        return "-"
    return f"{100 * value:+.1f} ± {100 * spread:.1f}"


def _interval(ci) -> str:
    if ci is None or math.isnan(ci[0]):
        return "-"
    return f"[{100 * ci[0]:+.1f}, {100 * ci[1]:+.1f}]"


def _share(value, digits: int = 2) -> str:
    return "-" if value is None or math.isnan(value) else f"{100 * value:.{digits}f}"


def _entropy(row: dict) -> str:
    first, last = row.get("entropy_first"), row.get("entropy_last")
    return "-" if first is None or math.isnan(first) else f"{first:.3f} -> {last:.3f}"


def markdown_table(rows: list[dict], seeds: list[int], k: int) -> str:
    """The table in markdown: accuracies in percent, mean ± standard deviation over seeds; gains with their 95%
    t-interval; clipped shares in percent of trained tokens; entropy in nats per token."""
    head = (
        f"| rung | held-out avg@{k} at the end | per seed ({', '.join(map(str, seeds))}) | gain over the rung before "
        f"| gain, 95% interval | held-out, second-half mean | clipped tokens % (upper) | entropy, first -> last "
        f"5 steps | paper (AIME avg@32) |"
    )
    lines = [head, "|---|---:|---|---:|---:|---:|---:|---:|---:|"]
    for row in rows:
        per_seed = " / ".join(_pct(row["per_seed"][s]) for s in seeds)
        clipped = _share(row.get("pg_clipfrac"))
        clipped += "" if clipped == "-" else f" ({_share(row['pg_clipfrac_upper'])})"
        lines.append(
            f"| {row['rung']} | {_pct(row['final_mean'], row['final_std'])} | {per_seed} | "
            f"{_signed(row.get('gain_mean'), row.get('gain_std'))} | {_interval(row.get('gain_ci'))} | "
            f"{_pct(row.get('late_mean'), row.get('late_std'))} | {clipped} | {_entropy(row)} | "
            f"{row.get('paper', '')} |"
        )
    return "\n".join(lines)


def markdown_difference(diff: dict, seeds: list[int]) -> str:
    """One line: the last rung against the first, per seed, with mean, std and 95% interval."""
    per_seed = ", ".join(f"{100 * diff['per_seed'][s]:+.1f}" for s in seeds if s in diff["per_seed"])
    return (
        f"{diff['to']} - {diff['from']}, per seed ({per_seed}): {_signed(diff['mean'], diff['std'])} points, "
        f"95% interval {_interval(diff['ci'])}; above on {diff['positive']} of {len(diff['per_seed'])} seeds"
    )


def collect_runs(run_dir: str, seeds: list[int], rungs: list) -> dict:
    """{(rung name or "warm-up", seed): RunResult} of every run folder that has metrics."""
    runs = {}
    for seed in seeds:
        for name in ["warm-up", *(r.name for r in rungs)]:
            run = read_run(os.path.join(run_dir, f"seed-{seed}", name))
            if run is not None:
                runs[(name, seed)] = run
    return runs


def write_report(run_dir: str, seeds: list[int], rungs: list, config: dict, timing: dict | None = None) -> dict:
    """table.md, results.json and the figures of the ladder in `run_dir`; prints the table. Returns the
    results. timing: the ladder's wall and CPU time (bench/ablation.py timing_totals), kept in results.json."""
    from bench.ablation_figures import draw_figures

    steps, k = config["training"]["steps"], config["eval"]["k"]
    runs = collect_runs(run_dir, seeds, rungs)
    rows = ladder_table(runs, rungs, seeds, steps)
    table = markdown_table(rows, seeds, k)
    difference = paired_difference(rows, seeds) if len(rows) > 2 else None
    if difference is not None:
        table += "\n\n" + markdown_difference(difference, seeds)
    print(table)
    with open(os.path.join(run_dir, "table.md"), "w") as f:
        f.write(table + "\n")
    figures = draw_figures(runs, rungs, seeds, os.path.join(run_dir, "figures"), group_size=config["rollout"]["n"])
    results = {"seeds": seeds, "steps": steps, "k": k, "table": rows, "difference": difference}
    results |= {"figures": figures, "timing": timing}
    with open(os.path.join(run_dir, "results.json"), "w") as f:
        json.dump(results, f, indent=2, default=str)
    print(f"table: {os.path.join(run_dir, 'table.md')}; figures: {', '.join(figures)}")
    print(
        json.dumps(
            {"bench": "ablation", "run_dir": run_dir, "seeds": seeds, "table": rows, "timing": timing}, default=str
        )
    )
    return results
