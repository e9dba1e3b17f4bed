"""The DAPO paper's monitoring panel, drawn from a run's metrics.jsonl as one PNG.

    python -m observe.plot RUN_DIR            writes RUN_DIR/plots/panel.png

Eight panels against the training step: mean response length (with the max, and the share of
truncated responses on a second axis), reward and training accuracy (of every generated sample, and of
the groups kept for training), entropy of the policy, mean
token probability, held-out accuracy (avg@k, on evaluation steps only), the share of groups kept by
dynamic sampling (with the all-correct / all-wrong shares it drops), and the clip fractions. The
paper watches these to tell healthy training (entropy neither collapsing nor exploding, response
length growing, reward rising) from failure. A metric missing from the log gets a panel that says
so instead of an error. When a step was logged twice (a resumed run redoing steps) the last line wins.
"""

from __future__ import annotations

import argparse
import math
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from errors import WriteError, write_atomically
from observe.metrics_log import MetricsLogger, read_metrics

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D

FIGSIZE = (16.0, 8.5)  # inches
DPI = 100  # -> 1600 x 850 pixels


@dataclass(frozen=True)
class Series:
    key: str  # JSONL key
    label: str  # legend entry
    style: str = "-"
    secondary: bool = False  # drawn against a right-hand axis (a share next to a length)


@dataclass(frozen=True)
class PanelSpec:
    title: str
    series: tuple[Series, ...]
    ylabel: str = ""
    unit_interval: bool = False  # the values are shares or probabilities: fix the axis to [0, 1]
    markers: bool = False  # sparse metrics (evaluation steps): show each point


PANELS: tuple[PanelSpec, ...] = (
    PanelSpec(
        "Response length",
        (
            Series("response_length/mean", "mean"),
            Series("response_length/max", "max", ":"),
            Series("response_length/clip_ratio", "truncated share", "--", secondary=True),
        ),
        ylabel="tokens",
    ),
    PanelSpec(
        "Reward (score)", (Series("reward/mean", "all samples"), Series("kept/reward/mean", "kept groups", "--"))
    ),
    PanelSpec(
        "Training accuracy",
        (Series("acc/mean", "all samples"), Series("kept/acc/mean", "kept groups", "--")),
        unit_interval=True,
    ),
    PanelSpec("Entropy", (Series("entropy", "mean token entropy"),), ylabel="nats"),
    PanelSpec("Mean token probability", (Series("token_prob/mean", "mean probability"),)),
    PanelSpec("Held-out accuracy", (Series("eval/avg_at_k", "avg@k"),), unit_interval=True, markers=True),
    PanelSpec(
        "Dynamic sampling: group shares",
        (
            Series("groups/kept_share", "kept"),
            Series("groups/all_correct_share", "all correct", "--"),
            Series("groups/all_wrong_share", "all wrong", ":"),
        ),
        unit_interval=True,
    ),
    PanelSpec(
        "Clip fractions",
        (
            Series("pg_clipfrac", "clip active (pg_clipfrac)"),
            Series("pg_clipfrac_lower", "dual clip active, A<0 (pg_clipfrac_lower)", "--"),
        ),
        ylabel="share of tokens",
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
    """A matplotlib Figure with one subplot per `PANELS` entry (2 rows x 4 columns)."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display needed
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=FIGSIZE, dpi=DPI, layout="constrained")
    axes = fig.subplots(2, 4).ravel()
    steps = [row["step"] for row in rows]
    for ax, spec in zip(axes, PANELS):
        if _draw_panel(ax, spec, rows) and steps:
            # One step range for every panel, so a sparse metric (evaluation) lines up with the rest.
            low, high = min(steps), max(steps)
            pad = max(0.5, 0.02 * (high - low))
            ax.set_xlim(low - pad, high + pad)
            ax.xaxis.set_major_locator(MaxNLocator(integer=True, steps=[1, 2, 5, 10]))
    if title:
        fig.suptitle(title, fontsize=14)
    return fig


def _draw_panel(ax: Axes, spec: PanelSpec, rows: list[dict]) -> bool:
    """Draw one panel; False when none of its metrics is in the log (the panel then says so)."""
    ax.set_title(spec.title, fontsize=12)
    ax.set_xlabel("step")
    if spec.ylabel:
        ax.set_ylabel(spec.ylabel)
    ax.grid(True, alpha=0.3)
    drawn: list[tuple[Line2D, float, float]] = []  # (line, latest step, latest value)
    missing: list[str] = []
    twin = None
    for i, series in enumerate(spec.series):
        steps, values = series_points(rows, series.key)
        if not steps:
            missing.append(series.key)
            continue
        target = ax
        if series.secondary:
            twin = twin or ax.twinx()
            twin.set_ylim(0.0, 1.0)
            twin.set_ylabel(series.label, color="gray")
            target = twin
        marker = "o" if spec.markers or len(steps) <= 20 else None
        color = "gray" if series.secondary else f"C{i}"
        (line,) = target.plot(
            steps, values, series.style, marker=marker, markersize=3.5, color=color, linewidth=1.6, label=series.label
        )
        drawn.append((line, steps[-1], values[-1]))
    if not drawn:
        note = "not in metrics.jsonl:\n" + "\n".join(missing)
        ax.text(0.5, 0.5, note, transform=ax.transAxes, ha="center", va="center", fontsize=10, color="gray")
        ax.set_xticks([])
        ax.set_yticks([])
        ax.set_ylabel("")
        return False
    if spec.markers:
        # Sparse points: print the latest value, the number people look for.
        _, x, y = drawn[0]
        ax.annotate(f"{y:.3f}", (x, y), textcoords="offset points", xytext=(0, 7), ha="center", fontsize=9)
    if spec.unit_interval:
        ax.set_ylim(-0.02, 1.02)
    if len(spec.series) > 1:
        loc: Literal["best", "upper left"] = "best"
        if not spec.unit_interval:
            # Free the top third of the axes for the legend so it never hides a line.
            low, high = ax.get_ylim()
            ax.set_ylim(low, high + 0.35 * (high - low))
            loc = "upper left"
        ax.legend(handles=[d[0] for d in drawn], fontsize=8, loc=loc, framealpha=0.9)
    if len(spec.series) == 1:
        ax.set_ylabel(ax.get_ylabel() or spec.series[0].key, fontsize=9)
    return True


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
