"""The ablation ladder's figures, in the style of the DAPO paper's (PNG, one file each):

    accuracy_per_rung.png   held-out avg@k per rung over steps, and training accuracy (Table 1 as curves)
    clip_higher.png         held-out accuracy and entropy with and without clip-higher (Fig. 2)
    overlong.png            response length, truncated share and reward with and without overlong
                            filtering and the soft overlong punishment (Fig. 4)
    dynamic_sampling.png    held-out accuracy against steps and against generated samples, with and
                            without dynamic sampling (Fig. 6)
    group_shares.png        the share of all-correct and of all-wrong groups over steps, per rung

A line is the mean over seeds; in the figures that compare two to four rungs a band shows the seeds' range
(min to max; with all six rungs the bands would hide each other: the table gives the spread). Held-out curves
start at the shared warm-up's evaluation (step 0). Per-step training metrics are smoothed over `SMOOTH` steps
(a centred moving mean). The rungs a comparison needs are found from the switches: the rung that turns a
technique on and the rung before it.
"""

from __future__ import annotations

import os

HELD_OUT = "eval/avg_at_k"
SMOOTH = 5
FIGSIZE_PER_PANEL = (4.6, 3.6)
DPI = 90


def _smoothed(values: list[float], window: int) -> list[float]:
    if window <= 1:
        return values
    half = window // 2
    windows = [values[max(0, i - half) : i + half + 1] for i in range(len(values))]
    return [sum(w) / len(w) for w in windows]


def seed_band(runs: dict, name: str, seeds: list[int], key: str, *, smooth: int = 1, x_key: str | None = None):
    """(x, mean, low, high) over the seeds that have run `name`, at the steps every one of them logged `key`.

    Held-out curves start from each seed's warm-up evaluation at step 0. x_key: plot against the cumulative
    sum of this per-step metric (e.g. generated samples) instead of the step, averaged over seeds."""
    curves = []
    for seed in seeds:
        run = runs.get((name, seed))
        if run is None:
            continue
        points = dict(zip(*run.series(key)))
        warm = runs.get(("warm-up", seed))
        if key == HELD_OUT and warm is not None and 0 not in points:
            start = warm.value_at(HELD_OUT, 0)
            if start is not None:
                points[0] = start
        if x_key is not None:
            counts = dict(zip(*run.series(x_key)))
            total, cumulative = 0.0, {0: 0.0}
            for step in range(1, max(points, default=0) + 1):
                total += counts.get(step, 0.0)
                cumulative[step] = total
            points = {step: (cumulative[step], v) for step, v in points.items()}
        curves.append(points)
    if not curves:
        return None
    steps = sorted(set.intersection(*(set(c) for c in curves)))
    if not steps:
        return None
    if x_key is not None:
        x = [sum(c[s][0] for c in curves) / len(curves) for s in steps]
        columns = [[c[s][1] for c in curves] for s in steps]
    else:
        x, columns = steps, [[c[s] for c in curves] for s in steps]
    mean = _smoothed([sum(col) / len(col) for col in columns], smooth)
    low = _smoothed([min(col) for col in columns], smooth)
    high = _smoothed([max(col) for col in columns], smooth)
    return x, mean, low, high


def _draw(ax, runs, seeds, rung, key, *, smooth=1, x_key=None, style="-", band=True) -> bool:
    curve = seed_band(runs, rung.name, seeds, key, smooth=smooth, x_key=x_key)
    if curve is None:
        return False
    x, mean, low, high = curve
    color = f"C{(rung.number - 1) % 10}"
    marker = "o" if key == HELD_OUT else None
    ax.plot(x, mean, style, color=color, marker=marker, markersize=3.5, linewidth=1.6, label=rung.name)
    if band and len(seeds) > 1:
        ax.fill_between(x, low, high, color=color, alpha=0.15, linewidth=0)
    return True


def _panel(ax, title: str, xlabel: str = "step", ylabel: str = "") -> None:
    ax.set_title(title, fontsize=11)
    ax.set_xlabel(xlabel)
    if ylabel:
        ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)


def _figure(panels: int):
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    fig = Figure(figsize=(FIGSIZE_PER_PANEL[0] * panels, FIGSIZE_PER_PANEL[1]), dpi=DPI, layout="constrained")
    return fig, fig.subplots(1, panels).ravel() if panels > 1 else [fig.subplots(1, 1)]


def _pair(rungs: list, *switches: str) -> list:
    """The rungs that turn on one of `switches` (a change from the rung before), each after the rung before it."""
    chosen = []
    for before, rung in zip(rungs, rungs[1:]):
        if any(before.switches.get(s) != rung.switches.get(s) for s in switches):
            chosen += [r for r in (before, rung) if r not in chosen]
    return chosen


def _save(fig, axes, out_dir: str, name: str, title: str) -> str:
    for ax in axes:
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8, framealpha=0.9)
    fig.suptitle(title, fontsize=12)
    path = os.path.join(out_dir, name)
    fig.savefig(path + ".tmp.png", dpi=DPI)
    os.replace(path + ".tmp.png", path)
    return path


def draw_figures(runs: dict, rungs: list, seeds: list[int], out_dir: str, *, group_size: int) -> list[str]:
    """Every figure of the module docstring that the finished runs allow; returns their paths."""
    os.makedirs(out_dir, exist_ok=True)
    seeds_text = f"mean over seeds {', '.join(map(str, seeds))}" + (" (band: min-max)" if len(seeds) > 1 else "")
    written = []

    fig, axes = _figure(2)
    _panel(axes[0], "Held-out accuracy", ylabel="avg@k")
    _panel(axes[1], f"Training accuracy (all samples, {SMOOTH}-step mean)", ylabel="accuracy")
    if any([_draw(axes[0], runs, seeds, r, HELD_OUT, band=False) for r in rungs]):
        for r in rungs:
            _draw(axes[1], runs, seeds, r, "acc/mean", smooth=SMOOTH, band=False)
        title = f"Table 1 ladder: mean over seeds {', '.join(map(str, seeds))}"
        written.append(_save(fig, axes, out_dir, "accuracy_per_rung.png", title))

    pair = _pair(rungs, "clip_high")
    if len(pair) == 2:
        fig, axes = _figure(2)
        _panel(axes[0], "Held-out accuracy", ylabel="avg@k")
        _panel(axes[1], f"Entropy of the policy ({SMOOTH}-step mean)", ylabel="nats per token")
        for r in pair:
            _draw(axes[0], runs, seeds, r, HELD_OUT)
            _draw(axes[1], runs, seeds, r, "entropy", smooth=SMOOTH)
        title = f"Without / with clip-higher (Fig. 2): {seeds_text}"
        written.append(_save(fig, axes, out_dir, "clip_higher.png", title))

    pair = _pair(rungs, "overlong_filter", "overlong_penalty")
    if pair:
        fig, axes = _figure(3)
        _panel(axes[0], f"Mean response length ({SMOOTH}-step mean)", ylabel="tokens")
        _panel(axes[1], f"Truncated samples ({SMOOTH}-step mean)", ylabel="share of samples")
        _panel(axes[2], f"Reward, all samples ({SMOOTH}-step mean)", ylabel="score")
        for r in pair:
            for ax, key in zip(axes, ("response_length/mean", "response_length/clip_ratio", "reward/mean")):
                _draw(ax, runs, seeds, r, key, smooth=SMOOTH)
        title = f"Without / with overlong filtering and soft overlong punishment (Fig. 4): {seeds_text}"
        written.append(_save(fig, axes, out_dir, "overlong.png", title))

    pair = _pair(rungs, "dynamic_sampling")
    if len(pair) == 2:
        fig, axes = _figure(2)
        _panel(axes[0], "Held-out accuracy against steps", ylabel="avg@k")
        _panel(axes[1], "Held-out accuracy against generated samples", xlabel="samples generated", ylabel="avg@k")
        for r in pair:
            _draw(axes[0], runs, seeds, r, HELD_OUT)
            _draw(axes[1], runs, seeds, r, HELD_OUT, x_key="gen/samples")
        title = f"Without / with dynamic sampling (Fig. 6), groups of {group_size}: {seeds_text}"
        written.append(_save(fig, axes, out_dir, "dynamic_sampling.png", title))

    fig, axes = _figure(2)
    _panel(axes[0], f"All-correct groups ({SMOOTH}-step mean)", ylabel="share of generated groups")
    _panel(axes[1], f"All-wrong groups ({SMOOTH}-step mean)", ylabel="share of generated groups")
    if any([_draw(axes[0], runs, seeds, r, "groups/all_correct_share", smooth=SMOOTH, band=False) for r in rungs]):
        for r in rungs:
            _draw(axes[1], runs, seeds, r, "groups/all_wrong_share", smooth=SMOOTH, band=False)
        title = f"Groups dynamic sampling drops: mean over seeds {', '.join(map(str, seeds))}"
        written.append(_save(fig, axes, out_dir, "group_shares.png", title))
    return written
