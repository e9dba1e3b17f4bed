"""The ablation ladder's figures, in the style of the DAPO paper's (PNG, one file each): each shows the mechanism a
technique exists for, with the rung that turns it on against the rung before.

    accuracy_per_rung.png   held-out avg@k per rung over steps, and training accuracy (Table 1 as curves)
    clip_higher.png         rung 2 -> 3: held-out accuracy, entropy (Fig. 2), the share of tokens clipped at the
                            upper bound, and the mean pi_old probability of those tokens (Fig. 3)
    overlong.png            rungs 1 -> 4 (overlong filtering, then the soft punishment): response length, the
                            truncated share, the mean reward of truncated samples, entropy (Figs. 4-5)
    token_level_loss.png    rung 4 -> 5: response length and entropy (Fig. 4a/4b), held-out accuracy
    dynamic_sampling.png    rung 5 -> 6: held-out accuracy against steps and against generated samples, the share
                            of generated groups kept, generation rounds per step (Fig. 6)
    group_shares.png        the share of all-correct and of all-wrong groups over steps, per rung

A line is the mean over seeds; in the figures that compare two to four rungs a band shows the seeds' range
(min to max; with all six rungs the bands would hide each other: the table gives the spread). Held-out curves
start at the shared warm-up's evaluation (step 0). Per-step training metrics are smoothed over `SMOOTH` steps
(a centred moving mean); a metric a step may not have (the mean probability of up-clipped tokens on a step
that clipped none, the reward of truncated samples on a step that truncated none) is averaged over the seeds
that have it, at the steps where at least half of them do. The rungs a comparison needs are found from the
switches: the rung that turns a technique on and the rung before it.
"""

from __future__ import annotations

import os

HELD_OUT = "eval/avg_at_k"
CLIPPED_PROB = "token_prob/clipped_upper_mean"
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
    """(x, mean, low, high) over the seeds that have run `name`, at the steps at least half of them logged `key`
    (the mean and range over those that did).

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
    steps = sorted(s for s in set.union(*(set(c) for c in curves)) if 2 * sum(s in c for c in curves) >= len(curves))
    if not steps:
        return None
    if x_key is not None:
        x = [sum(c[s][0] for c in curves if s in c) / sum(s in c for c in curves) for s in steps]
        columns = [[c[s][1] for c in curves if s in c] for s in steps]
    else:
        x, columns = steps, [[c[s] for c in curves if s in c] for s in steps]
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


def _figure(panels: int, rows: int = 1):
    """A figure of `panels` panels in `rows` rows (unused cells of the grid hidden), and its axes."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    columns = -(-panels // rows)
    size = (FIGSIZE_PER_PANEL[0] * columns, FIGSIZE_PER_PANEL[1] * rows)
    fig = Figure(figsize=size, dpi=DPI, layout="constrained")
    if panels == 1:
        return fig, [fig.subplots(1, 1)]
    axes = list(fig.subplots(rows, columns).ravel())
    for ax in axes[panels:]:
        ax.set_visible(False)
    return fig, axes[:panels]


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


def _compare(runs, seeds, pair, panels, out_dir: str, name: str, title: str) -> str | None:
    """One figure of len(panels) panels, each (title, y label, key, smooth, x_key), with every rung of `pair`."""
    if len(pair) < 2:
        return None
    fig, axes = _figure(len(panels))
    drawn = False
    for ax, (panel_title, ylabel, key, smooth, x_key) in zip(axes, panels):
        _panel(ax, panel_title, "samples generated" if x_key else "step", ylabel)
        for r in pair:
            drawn = _draw(ax, runs, seeds, r, key, smooth=smooth, x_key=x_key) or drawn
    return _save(fig, axes, out_dir, name, title) if drawn else None


def _mechanism_figures(runs, rungs, seeds, out_dir: str, seeds_text: str, group_size: int) -> list[str | None]:
    held_out = ("Held-out accuracy", "avg@k", HELD_OUT, 1, None)
    entropy = (f"Entropy ({SMOOTH}-step mean)", "nats per token", "entropy", SMOOTH, None)
    length = (f"Mean response length ({SMOOTH}-step mean)", "tokens", "response_length/mean", SMOOTH, None)
    m = f"{SMOOTH}-step mean"
    return [
        _compare(
            runs,
            seeds,
            _pair(rungs, "clip_high"),
            [
                held_out,
                entropy,
                (f"Tokens clipped at 1 + eps_high ({m})", "share of trained tokens", "pg_clipfrac_upper", SMOOTH, None),
                (f"Mean pi_old prob. of up-clipped tokens ({m})", "probability", CLIPPED_PROB, SMOOTH, None),
            ],
            out_dir,
            "clip_higher.png",
            f"Without / with clip-higher (Figs. 2, 3): {seeds_text}",
        ),
        _compare(
            runs,
            seeds,
            _pair(rungs, "overlong_filter", "overlong_penalty"),
            [
                length,
                (f"Truncated samples ({m})", "share of samples", "response_length/clip_ratio", SMOOTH, None),
                (f"Reward of truncated samples ({m})", "mean score", "reward/truncated_mean", SMOOTH, None),
                entropy,
            ],
            out_dir,
            "overlong.png",
            f"Overlong filtering, then the soft overlong punishment (Figs. 4, 5): {seeds_text}",
        ),
        _compare(
            runs,
            seeds,
            _pair(rungs, "loss_agg"),
            [length, entropy, held_out],
            out_dir,
            "token_level_loss.png",
            f"Sample-level / token-level loss (Fig. 4): {seeds_text}",
        ),
        _compare(
            runs,
            seeds,
            _pair(rungs, "dynamic_sampling"),
            [
                ("Held-out accuracy against steps", "avg@k", HELD_OUT, 1, None),
                ("Held-out accuracy against generated samples", "avg@k", HELD_OUT, 1, "gen/samples"),
                (f"Generated groups kept ({m})", "share of groups", "groups/kept_share", SMOOTH, None),
                ("Generation rounds per step", "rounds", "gen/rounds", 1, None),
            ],
            out_dir,
            "dynamic_sampling.png",
            f"Without / with dynamic sampling (Fig. 6), groups of {group_size}: {seeds_text}",
        ),
    ]


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

    written += [p for p in _mechanism_figures(runs, rungs, seeds, out_dir, seeds_text, group_size) if p]

    fig, axes = _figure(2)
    _panel(axes[0], f"All-correct groups ({SMOOTH}-step mean)", ylabel="share of generated groups")
    _panel(axes[1], f"All-wrong groups ({SMOOTH}-step mean)", ylabel="share of generated groups")
    if any([_draw(axes[0], runs, seeds, r, "groups/all_correct_share", smooth=SMOOTH, band=False) for r in rungs]):
        for r in rungs:
            _draw(axes[1], runs, seeds, r, "groups/all_wrong_share", smooth=SMOOTH, band=False)
        title = f"Groups dynamic sampling drops: mean over seeds {', '.join(map(str, seeds))}"
        written.append(_save(fig, axes, out_dir, "group_shares.png", title))
    return written
