"""The probes' results (bench/mechanisms.py): per probe, a table of its mechanism metrics per arm and a figure.

Each measure is summarised per run over its steps, then over seeds:

    last      the mean of the last LAST steps (where the run ended up)
    final     the value at the run's last step (a held-out evaluation)
    mean      the mean over every step (what the run did throughout)
    change    the mean of the last LAST steps minus the value at step 1 (how far it moved)
    reached   the first step at which the value reached the measure's threshold (runs that never reached it
              count as the last step + 1, and the table says how many did not)

Per arm: mean ± standard deviation over seeds; for every arm but the reference (the probe's first arm), the paired
difference, per seed this arm's value minus the reference's (both from the same warm-up and the same rollout seed),
with its mean, standard deviation and 95% Student-t interval (bench/ablation_report.py interval95). The figure
draws, per arm, the mean over seeds of each per-step metric with a band from the lowest to the highest seed
(bench/ablation_figures.py seed_band), smoothed over the panel's window.
"""

from __future__ import annotations

import json
import math
import os
import statistics
from collections.abc import Callable
from dataclasses import dataclass

from bench.ablation_figures import _draw, _figure, _panel, _save
from bench.ablation_report import RunResult, _mean_std, interval95
from bench.mechanism_metrics import run_metrics

LAST = 5


@dataclass(frozen=True)
class Measure:
    key: str  # a per-step key of the run's rows (bench/mechanism_metrics.py)
    label: str
    summary: str = "last"  # last | final | mean | change | reached (module docstring)
    percent: bool = False  # shown x 100
    threshold: float = 0.5  # of "reached"


@dataclass(frozen=True)
class Panel:
    title: str
    ylabel: str
    key: str
    smooth: int = 1


@dataclass(frozen=True)
class View:
    """What a probe's table and figure show; `extra` draws more panels (ax, runs, arms, seeds) -> drawn."""

    title: str
    measures: tuple[Measure, ...]
    panels: tuple[Panel, ...]
    extra: tuple[Callable, ...] = ()


def _step_one_mean(runs: dict, key: str) -> float | None:
    """The mean over every arm run of `key` at step 1 (each run's first step: the warm-up's policy)."""
    values = [run.value_at(key, 1) for name, run in runs.items() if name[0] != "warm-up"]
    values = [v for v in values if v is not None]
    return statistics.fmean(values) if values else None


def rare_probability_panel(ax, runs: dict, arms: list, seeds: list[int]) -> bool:
    """The rare strategy's probability per arm, with the bound p0 (1 + eps_high)^(t - 1) that the upper clip puts
    on its growth (p0: its mean probability at step 1 over every run) for the arms' finite eps_high."""
    _panel(ax, "Probability of the rare strategy", ylabel="p(rare first token), mean over prompts")
    drawn = False
    for arm in arms:
        drawn = _draw(ax, runs, seeds, arm, "rare/prob") or drawn
    p0 = _step_one_mean(runs, "rare/prob")
    if drawn and p0:
        steps = max(max(run.series("rare/prob")[0], default=1) for run in runs.values())
        for arm in arms:
            eps = arm.switches.get("clip_high", 0)
            if eps < 1:
                t = list(range(1, steps + 1))
                bound = [min(p0 * (1 + eps) ** (s - 1), 1.0) for s in t]
                color = f"C{(arm.number - 1) % 10}"
                ax.plot(t, bound, ":", color=color, linewidth=1.2, label=f"p0 (1 + {eps:g})^(t-1)")
        ax.set_ylim(0, 1)
    return drawn


def accuracy_by_position_panel(ax, runs: dict, arms: list, seeds: list[int]) -> bool:
    """Accuracy by the even number's position (mean of the last LAST steps), per arm: mean over seeds, min-max."""
    _panel(ax, f"Accuracy by answer position (last {LAST} steps)", "position of the even number", "accuracy")
    drawn = False
    for arm in arms:
        curves = []
        for seed in seeds:
            run = runs.get((arm.name, seed))
            if run is None:
                continue
            curve = {}
            for key in {k for row in run.rows for k in row if k.startswith("acc/pos")}:
                values = run.series(key)[1][-LAST:]
                if values:
                    curve[int(key[len("acc/pos") :])] = statistics.fmean(values)
            curves.append(curve)
        positions = sorted(set.intersection(*(set(c) for c in curves))) if curves else []
        if not positions:
            continue
        color = f"C{(arm.number - 1) % 10}"
        columns = [[c[j] for c in curves] for j in positions]
        ax.plot(positions, [statistics.fmean(c) for c in columns], "-o", color=color, markersize=3.5, label=arm.name)
        if len(curves) > 1:
            ax.fill_between(positions, [min(c) for c in columns], [max(c) for c in columns], color=color, alpha=0.15)
        drawn = True
    return drawn


VIEWS = {
    "clip_bias": View(
        "The clip under a reward with no signal (tasks/coin.py)",
        (
            Measure("entropy", "entropy change, last 5 steps - step 1 (nats)", "change"),
            Measure("entropy", "entropy, last 5 steps (nats)"),
            Measure("clip/upper", "clipped at 1 + eps_high, % of tokens", "mean", percent=True),
            Measure("clip/lower", "clipped at 1 - eps_low, % of tokens", "mean", percent=True),
            Measure("response_length/clip_ratio", "truncated responses, % (mean over steps)", "mean", percent=True),
        ),
        (
            Panel("Entropy of the trained tokens", "nats per token", "entropy"),
            Panel("Clipped at 1 + eps_high (A > 0)", "share of trained tokens", "clip/upper", 3),
            Panel("Clipped at 1 - eps_low (A < 0)", "share of trained tokens", "clip/lower", 3),
            Panel("Truncated responses (no answer: -1)", "share of samples", "response_length/clip_ratio", 3),
        ),
    ),
    "rare_strategy": View(
        "A rare but better first move (tasks/fork.py)",
        (
            Measure("rare/prob", "probability of the rare strategy, last 5 steps", percent=True),
            Measure("rare/prob", "first step at which its probability reached 0.5", "reached"),
            Measure("pg_clipfrac_upper/first_token", "first tokens clipped at 1 + eps_high, %", "mean", percent=True),
            Measure("fork/entropy", "entropy at the fork, mean over steps (nats)", "mean"),
            Measure("acc/fork", "accuracy at the fork, last 5 steps", percent=True),
            Measure("eval/avg_at_k", "held-out accuracy at the end", "final", percent=True),
        ),
        (
            Panel("First tokens clipped at 1 + eps_high", "share of first tokens", "pg_clipfrac_upper/first_token", 3),
            Panel("Entropy at the fork", "nats (mean over prompts)", "fork/entropy"),
            Panel("Accuracy at the fork (training samples)", "accuracy", "acc/fork", 3),
            Panel("Held-out accuracy", "avg@k", "eval/avg_at_k"),
        ),
        (rare_probability_panel,),
    ),
    "length_budget": View(
        "A length budget that binds on valid reasoning (tasks/scan.py)",
        (
            Measure("truncated", "truncated samples, last 5 steps", percent=True),
            Measure("early", "early answers, last 5 steps", percent=True),
            Measure("short", "short style, last 5 steps", percent=True),
            Measure("acc", "accuracy, last 5 steps", percent=True),
            Measure("acc/late", "accuracy, even number in the last 2 positions, last 5 steps", percent=True),
            Measure("len/wrong", "length of wrong answers, last 5 steps (tokens)"),
            Measure("len/right", "length of right answers, last 5 steps (tokens)"),
        ),
        (
            Panel("Truncated samples", "share of samples", "truncated", 3),
            Panel("Early answers (before the even number)", "share of samples", "early", 3),
            Panel("Short style", "share of samples with a check line", "short", 3),
            Panel("Length of wrong answers", "tokens", "len/wrong", 3),
            Panel("Length of right answers", "tokens", "len/right", 3),
        ),
        (accuracy_by_position_panel,),
    ),
}


def summarize(run: RunResult | None, measure: Measure, steps: int) -> float | None:
    """The measure of one run (None: the run or the metric is missing)."""
    if run is None:
        return None
    at, values = run.series(measure.key)
    if not values:
        return None
    if measure.summary == "mean":
        return statistics.fmean(values)
    if measure.summary == "final":
        return values[-1]
    if measure.summary == "reached":
        return next((float(s) for s, v in zip(at, values) if v >= measure.threshold), float(steps + 1))
    last = statistics.fmean(values[-LAST:])
    if measure.summary == "change":
        return last - values[0] if at[0] == 1 else None
    return last


def probe_table(runs: dict, arms: list, seeds: list[int], measures, steps: int) -> list[dict]:
    """One row per arm: per measure its per-seed values, mean and spread, and (but for the reference arm, the
    first) the paired difference from the reference."""
    reference = arms[0].name
    per_arm = {
        arm.name: {i: {s: summarize(runs.get((arm.name, s)), m, steps) for s in seeds} for i, m in enumerate(measures)}
        for arm in arms
    }
    rows = []
    for arm in arms:
        row = {"arm": arm.name, "switches": arm.switches, "measures": []}
        for i, measure in enumerate(measures):
            values = per_arm[arm.name][i]
            mean, std = _mean_std([v for v in values.values() if v is not None])
            entry = {"key": measure.key, "summary": measure.summary, "per_seed": values, "mean": mean, "std": std}
            if measure.summary == "reached":
                entry["not_reached"] = sum(v is not None and v > steps for v in values.values())
            if arm.name != reference:
                ref = per_arm[reference][i]
                pairs = [values[s] - ref[s] for s in seeds if values[s] is not None and ref[s] is not None]
                entry["diff_mean"], entry["diff_std"] = _mean_std(pairs)
                entry["diff_ci"] = interval95(pairs)
            row["measures"].append(entry)
        rows.append(row)
    return rows


def _number(value, percent: bool, signed: bool = False) -> str:
    if value is None or math.isnan(value):
        return "-"
    value = 100 * value if percent else value
    digits = 2 if percent or abs(value) >= 10 else 3
    return f"{value:+.{digits}f}" if signed else f"{value:.{digits}f}"


def markdown_table(rows: list[dict], measures, seeds: list[int]) -> str:
    """Per measure, arms as rows: mean ± std over seeds, per seed, and the paired difference from the reference
    with its 95% interval."""
    blocks = []
    for i, measure in enumerate(measures):
        p = measure.percent
        lines = [
            f"**{measure.label}** ({measure.summary})",
            "",
            f"| arm | mean ± std | per seed ({', '.join(map(str, seeds))}) | minus {rows[0]['arm']}, per seed "
            "| mean ± std | 95% interval |",
            "|---|---:|---|---|---:|---:|",
        ]
        for row in rows:
            e = row["measures"][i]
            per_seed = " / ".join(_number(e["per_seed"][s], p) for s in seeds)
            cell = "-" if math.isnan(e["mean"]) else f"{_number(e['mean'], p)} ± {_number(e['std'], p)}"
            if e.get("not_reached"):
                cell += f" ({e['not_reached']} never)"
            if "diff_mean" in e:
                ref = rows[0]["measures"][i]["per_seed"]
                diffs = " / ".join(
                    _number(e["per_seed"][s] - ref[s], p, signed=True)
                    if e["per_seed"][s] is not None and ref[s] is not None
                    else "-"
                    for s in seeds
                )
                low, high = e["diff_ci"]
                interval = "-" if math.isnan(low) else f"[{_number(low, p, True)}, {_number(high, p, True)}]"
                diff = (
                    "-"
                    if math.isnan(e["diff_mean"])
                    else f"{_number(e['diff_mean'], p, True)} ± {_number(e['diff_std'], p)}"
                )
                lines.append(f"| {row['arm']} | {cell} | {per_seed} | {diffs} | {diff} | {interval} |")
            else:
                lines.append(f"| {row['arm']} | {cell} | {per_seed} | (reference) | | |")
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


def draw_probe_figure(runs: dict, arms: list, seeds: list[int], view: View, path: str) -> str | None:
    """The probe's figure: one panel per per-step metric (and its extra panels), every arm in each."""
    count = len(view.panels) + len(view.extra)
    fig, axes = _figure(count, rows=2 if count > 4 else 1)
    drawn = False
    for ax, panel in zip(axes, view.panels):
        smooth = f" ({panel.smooth}-step mean)" if panel.smooth > 1 else ""
        _panel(ax, panel.title + smooth, ylabel=panel.ylabel)
        for arm in arms:
            drawn = _draw(ax, runs, seeds, arm, panel.key, smooth=panel.smooth) or drawn
    for ax, extra in zip(axes[len(view.panels) :], view.extra):
        drawn = extra(ax, runs, arms, seeds) or drawn
    if not drawn:
        return None
    band = " (band: min-max)" if len(seeds) > 1 else ""
    title = f"{view.title}: mean over seeds {', '.join(map(str, seeds))}{band}"
    return _save(fig, axes, os.path.dirname(path), os.path.basename(path), title)


def collect_runs(probe_dir: str, probe: str, seeds: list[int], arms: list) -> dict:
    """{(arm name, seed): RunResult} of every arm run with metrics, and ("warm-up", seed) for each seed."""
    runs = {}
    warm = run_metrics(os.path.join(probe_dir, "warm-up"), probe)
    for seed in seeds:
        if warm is not None:
            runs[("warm-up", seed)] = warm  # the one warm-up every seed starts from
        for arm in arms:
            run = run_metrics(os.path.join(probe_dir, f"seed-{seed}", arm.name), probe)
            if run is not None:
                runs[(arm.name, seed)] = run
    return runs


def write_probe_report(probe_dir: str, probe: str, seeds: list[int], arms: list, config: dict, timing=None) -> dict:
    """table.md, results.json and figures/<probe>.png in `probe_dir`; prints the table. Returns the results."""
    view, steps = VIEWS[probe], config["training"]["steps"]
    runs = collect_runs(probe_dir, probe, seeds, arms)
    rows = probe_table(runs, arms, seeds, view.measures, steps)
    table = f"### {probe}: {view.title}\n\n" + markdown_table(rows, view.measures, seeds)
    print(table)
    os.makedirs(os.path.join(probe_dir, "figures"), exist_ok=True)
    with open(os.path.join(probe_dir, "table.md"), "w") as f:
        f.write(table + "\n")
    figure = draw_probe_figure(runs, arms, seeds, view, os.path.join(probe_dir, "figures", f"{probe}.png"))
    results = {"probe": probe, "seeds": seeds, "steps": steps, "table": rows, "figure": figure, "timing": timing}
    with open(os.path.join(probe_dir, "results.json"), "w") as f:
        json.dump(results, f, indent=2, default=str)
    print(f"table: {os.path.join(probe_dir, 'table.md')}; figure: {figure}")
    print(json.dumps({"bench": "mechanisms", "probe": probe, "seeds": seeds, "table": rows}, default=str))
    return results
