"""The learning-rate sweep that fixes the ablation ladder's lr before any rung is judged: naive GRPO alone
(rung 1) on one seed at several learning rates, every run from one shared supervised warm-up.

    python bench/ablation_sweep.py              # lr 1.5e-5, 2.5e-5, 4e-5, 6e-5 on seed 0 into runs/ablation-sweep/
    python bench/ablation_sweep.py [--lrs 1e-5,2e-5] [--seed S] [--jobs 2] [--run-dir DIR] [--section.key=value ...]
    python bench/ablation_sweep.py --report     # the table and figure of the runs done so far

Each lr is a one-rung ladder of bench/ablation.py in DIR/lr-X/ (its own ladder.json: the task config with the
overrides and optimizer.lr = X). The warm-up runs once, in the first lr's folder; the others start from a copy
of it: the warm-up trains at training.sft_lr and never steps the DAPO optimizer, and a run started from its
checkpoint trains at its own configured lr (checkpoint/optimizer_settings.py). Resumable like the ladder.

Per lr: pg_clipfrac (the share of trained tokens whose ratio was clipped) and pg_clipfrac_upper (at 1 + eps_high),
means over the steps; the entropy of the first and the last 5 steps; the held-out accuracy at every evaluation
and its second-half mean (steps > S/2). The rule the ladder's lr follows: the largest lr whose second-half mean
is within WITHIN points of the sweep's best. Writes sweep.md and sweep.png (held-out accuracy, clipped share
and entropy over steps, one line per lr) into DIR.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.ablation import (  # noqa: E402
    TASK_CONFIG,
    LadderError,
    Timing,
    check_ladder_file,
    check_overrides,
    effective_config,
    ladder_rungs,
    plan_jobs,
    run_jobs,
)
from bench.ablation_report import HELD_OUT, late_mean, read_run  # noqa: E402
from config import ConfigError, config_to_dict, split_overrides  # noqa: E402

DEFAULT_LRS = "1.5e-5,2.5e-5,4e-5,6e-5"
WITHIN = 0.02  # two points of held-out accuracy: above one evaluation's sampling noise (<= 1.3 points)


def sweep_row(lr: str, run, steps: int) -> dict:
    """One lr's figures from its run's metrics (see the module docstring)."""
    trained = [r for r in run.rows if "pg_clipfrac" in r]

    def mean(key: str, rows: list[dict]) -> float:
        values = [r[key] for r in rows if r.get(key) is not None]
        return statistics.fmean(values) if values else float("nan")

    return {
        "lr": lr,
        "pg_clipfrac": mean("pg_clipfrac", trained),
        "pg_clipfrac_upper": mean("pg_clipfrac_upper", trained),
        "entropy_first": mean("entropy", trained[:5]),
        "entropy_last": mean("entropy", trained[-5:]),
        "held_out": dict(zip(*run.series(HELD_OUT))),
        "late_mean": late_mean(run, steps),
    }


def chosen_lr(rows: list[dict]) -> str | None:
    """The largest lr whose second-half held-out mean is within WITHIN of the best one's."""
    done = [r for r in rows if r["late_mean"] is not None]
    if not done:
        return None
    best = max(r["late_mean"] for r in done)
    return max((r for r in done if r["late_mean"] >= best - WITHIN), key=lambda r: float(r["lr"]))["lr"]


def markdown(rows: list[dict], start: float | None) -> str:
    evals = sorted({s for r in rows for s in r["held_out"]})
    head = "| lr | clipped tokens % (upper) | entropy, first -> last 5 steps | "
    head += " | ".join(f"held-out at {s}" for s in evals) + " | second-half mean |"
    lines = [head, "|---:|---:|---:|" + "---:|" * (len(evals) + 1)]
    if start is not None:
        lines.append("| warm-up | - | - | " + " | ".join("-" for _ in evals) + f" | ({100 * start:.1f} at step 0) |")
    for r in rows:
        held = " | ".join(f"{100 * r['held_out'][s]:.1f}" if s in r["held_out"] else "-" for s in evals)
        late = "-" if r["late_mean"] is None else f"{100 * r['late_mean']:.1f}"
        lines.append(
            f"| {r['lr']} | {100 * r['pg_clipfrac']:.2f} ({100 * r['pg_clipfrac_upper']:.2f}) | "
            f"{r['entropy_first']:.3f} -> {r['entropy_last']:.3f} | {held} | {late} |"
        )
    return "\n".join(lines)


def draw(runs: dict, lrs: list[str], seed: int, path: str) -> None:
    from bench.ablation_figures import SMOOTH, _figure, _panel, _save, seed_band

    fig, axes = _figure(3)
    _panel(axes[0], "Held-out accuracy", ylabel="avg@k")
    _panel(axes[1], f"Clipped tokens ({SMOOTH}-step mean)", ylabel="share of trained tokens")
    _panel(axes[2], f"Entropy ({SMOOTH}-step mean)", ylabel="nats per token")
    for i, lr in enumerate(lrs):
        for ax, key, smooth in zip(axes, (HELD_OUT, "pg_clipfrac", "entropy"), (1, SMOOTH, SMOOTH)):
            curve = seed_band(runs, f"lr-{lr}", [seed], key, smooth=smooth)
            if curve is not None:
                ax.plot(curve[0], curve[1], color=f"C{i}", marker="o" if key == HELD_OUT else None, label=f"lr {lr}")
    _save(fig, axes, os.path.dirname(path), os.path.basename(path), f"Naive GRPO (rung 1), seed {seed}, per lr")


def prepare(opts, overrides: list[str]):
    """The rung, the lrs and, per lr, its folder and the ladder's jobs there (a warm-up and the rung)."""
    rungs = [r for r in ladder_rungs() if r.number == opts.rung]
    if not rungs:
        raise LadderError(f"--rung {opts.rung}: no such rung file in configs/ablation/")
    if any(o.startswith("optimizer.lr=") for o in overrides):
        raise LadderError("the sweep sets optimizer.lr itself (use --lrs)")
    check_overrides(overrides, rungs)
    lrs = [x.strip() for x in opts.lrs.split(",") if x.strip()]
    plans = {}
    for lr in lrs:
        lr_overrides = [*overrides, f"optimizer.lr={lr}"]
        cfg = effective_config(TASK_CONFIG, lr_overrides, rungs[0])  # validates the lr too
        folder = os.path.join(opts.run_dir, f"lr-{lr}")
        plans[lr] = (folder, lr_overrides, cfg, plan_jobs(folder, [opts.seed], rungs, TASK_CONFIG, lr_overrides))
    return rungs[0], lrs, plans


def run(opts, lrs: list[str], plans: dict) -> int:
    timing = Timing(opts.run_dir)
    for folder, lr_overrides, _, _ in plans.values():
        base = config_to_dict(effective_config(TASK_CONFIG, lr_overrides, None))
        del base["job"]
        check_ladder_file(folder, {"task_config": os.path.relpath(TASK_CONFIG, ROOT), "config": base})
    shared = plans[lrs[0]][3][0]  # the first lr's warm-up
    code = run_jobs([shared], workers=1, threads=opts.threads, timing=timing)
    for lr in lrs[1:]:
        warm = plans[lr][3][0]
        if code == 0 and not os.path.isdir(warm.path):
            shutil.copytree(shared.path, warm.path + ".tmp")
            os.replace(warm.path + ".tmp", warm.path)
    if code == 0:
        code = run_jobs([plan[3][1] for plan in plans.values()], workers=opts.jobs, threads=opts.threads, timing=timing)
    return code


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lrs", default=DEFAULT_LRS, help=f"comma-separated learning rates (default {DEFAULT_LRS})")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rung", type=int, default=1, help="the rung trained at every lr (default 1: naive GRPO)")
    parser.add_argument("--run-dir", default=os.path.join(ROOT, "runs", "ablation-sweep"))
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--report", action="store_true", help="only write the table and figure of finished runs")
    opts, rest = parser.parse_known_args(argv)
    plain, overrides = split_overrides(rest)
    if plain:
        raise LadderError(f"unknown arguments {' '.join(plain)} (overrides are written --section.key=value)")
    opts.run_dir = os.path.abspath(opts.run_dir)
    rung, lrs, plans = prepare(opts, overrides)
    if not opts.report and run(opts, lrs, plans):
        print("sweep stopped: run the same command again to continue where it stopped", file=sys.stderr)
        return 1
    runs, rows, start = {}, [], None
    for lr in lrs:
        folder, _, cfg, _ = plans[lr]
        result = read_run(os.path.join(folder, f"seed-{opts.seed}", rung.name))
        warm = read_run(os.path.join(folder, f"seed-{opts.seed}", "warm-up"))
        if warm is not None:
            runs[("warm-up", opts.seed)] = warm
            start = warm.value_at(HELD_OUT, 0)
        if result is not None:
            runs[(f"lr-{lr}", opts.seed)] = result
            rows.append(sweep_row(lr, result, cfg.training.steps))
    table = markdown(rows, start) + f"\n\nThe rule's choice: lr {chosen_lr(rows)}"
    print(table)
    with open(os.path.join(opts.run_dir, "sweep.md"), "w") as f:
        f.write(table + "\n")
    draw(runs, [r["lr"] for r in rows], opts.seed, os.path.join(opts.run_dir, "sweep.png"))
    print(json.dumps({"bench": "ablation_sweep", "rows": rows, "chosen": chosen_lr(rows)}, default=str))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except (LadderError, ConfigError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
