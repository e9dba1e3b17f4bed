"""The DAPO paper's monitoring panel, drawn from a run's metrics.jsonl as one PNG.

    python -m observe.plot RUN_DIR            writes RUN_DIR/plots/panel.png

Eight panels against the training step: mean response length (with the max), reward and training accuracy
(of every generated sample, and of the groups kept for training), entropy of the policy, mean token
probability, held-out accuracy (avg@k, on evaluation steps only), the share of groups kept by dynamic
sampling (with the all-correct / all-wrong shares it drops, and the share of truncated responses), and the
clip fractions. The
paper watches these to tell healthy training (entropy neither collapsing nor exploding, response
length growing, reward rising) from failure. A metric missing from the log gets a panel that says
so instead of an error. When a step was logged twice (a resumed run redoing steps) the last line wins.
"""

from __future__ import annotations

import argparse
import math
import os
from typing import TYPE_CHECKING

from errors import WriteError, write_atomically
from observe.metrics_log import MetricsLogger, read_metrics

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

FIGSIZE = (16.0, 8.5)  # inches
DPI = 100  # -> 1600 x 850 pixels
STYLES = ("-", "--", ":", "-.")  # the series of a panel, in order

# (title, ((JSONL key, legend entry), ...), whether the values are shares or probabilities: an axis of [0, 1])
PANELS: tuple[tuple[str, tuple[tuple[str, str], ...], bool], ...] = (
    ("Response length (tokens)", (("response_length/mean", "mean"), ("response_length/max", "max")), False),
    ("Reward (score)", (("reward/mean", "all samples"), ("kept/reward/mean", "kept groups")), False),
    ("Training accuracy", (("acc/mean", "all samples"), ("kept/acc/mean", "kept groups")), True),
    ("Entropy (nats)", (("entropy", "mean token entropy"),), False),
    ("Mean token probability", (("token_prob/mean", "mean probability"),), False),
    ("Held-out accuracy", (("eval/avg_at_k", "avg@k"),), True),
    (
        "Shares: groups kept / dropped, truncated",
        (
            ("groups/kept_share", "groups kept"),
            ("groups/all_correct_share", "all correct"),
            ("groups/all_wrong_share", "all wrong"),
            ("response_length/clip_ratio", "truncated responses"),
        ),
        True,
    ),
    (
        "Clip fractions (share of tokens)",
        (("pg_clipfrac", "clip active"), ("pg_clipfrac_lower", "dual clip active, A<0 (pg_clipfrac_lower)")),
        False,
    ),
)


def series_points(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of one key, sorted by step; a re-logged step keeps its last value; nulls skipped."""
    by_step: dict[int, float | None] = {}
    for row in rows:
        if key in row:
            by_step[row["step"]] = row[key]
    points = sorted((s, float(v)) for s, v in by_step.items() if isinstance(v, (int, float)) and math.isfinite(v))
    return [s for s, _ in points], [v for _, v in points]


def build_figure(rows: list[dict], title: str = "") -> Figure:
    """A matplotlib Figure with one subplot per `PANELS` entry (2 rows x 4 columns), on one step range (a
    sparse metric, the held-out accuracy, lines up with the rest)."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display needed
    from matplotlib.figure import Figure

    fig = Figure(figsize=FIGSIZE, dpi=DPI, layout="constrained")
    steps = [row["step"] for row in rows]
    for ax, panel in zip(fig.subplots(2, 4).ravel(), PANELS):
        _draw_panel(ax, *panel, rows)
        if steps:
            ax.set_xlim(min(steps) - 0.5, max(steps) + 0.5)
    if title:
        fig.suptitle(title, fontsize=14)
    return fig


def _draw_panel(ax: Axes, title: str, series: tuple[tuple[str, str], ...], unit: bool, rows: list[dict]) -> None:
    """One panel; where none of its metrics is in the log, a note that says so instead."""
    ax.set_title(title, fontsize=12)
    ax.set_xlabel("step")
    ax.grid(True, alpha=0.3)
    missing = []
    for (key, label), style in zip(series, STYLES):
        steps, values = series_points(rows, key)
        if not steps:
            missing.append(key)
            continue
        # Few points (the held-out accuracy, a short run): each one shown.
        ax.plot(steps, values, style, marker="o" if len(steps) <= 20 else None, markersize=3.5, label=label)
    if len(missing) == len(series):
        ax.text(0.5, 0.5, "not in metrics.jsonl:\n" + "\n".join(missing), transform=ax.transAxes, ha="center")
        return
    if unit:
        ax.set_ylim(-0.02, 1.02)
    if len(series) > 1:
        ax.legend(fontsize=8, framealpha=0.9)


def plot_run(run_dir: str, out: str | None = None) -> str:
    """Draw run_dir/metrics.jsonl into `out` (default run_dir/plots/panel.png); returns the path.

    The PNG is written to a temporary name and renamed, so a reader never sees half a file.
    """
    rows = read_metrics(os.path.join(run_dir, MetricsLogger.FILENAME))
    out = out or os.path.join(run_dir, "plots", "panel.png")
    steps = [row["step"] for row in rows]
    name = os.path.basename(os.path.normpath(run_dir))
    title = f"{name}: steps {min(steps)}-{max(steps)}" if steps else f"{name}: no steps logged yet"
    fig = build_figure(rows, title)
    write_atomically(out, lambda f: fig.savefig(f, dpi=DPI, format="png"))
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Draw the DAPO monitoring panel of a run folder.")
    parser.add_argument("run_dir", help="run folder holding metrics.jsonl")
    parser.add_argument("--out", default=None, help="PNG path (default RUN_DIR/plots/panel.png)")
    args = parser.parse_args(argv)
    try:
        print(plot_run(args.run_dir, args.out))
    except (FileNotFoundError, ValueError, WriteError) as exc:
        parser.exit(2, f"observe.plot: {exc}\n")


if __name__ == "__main__":
    main()
