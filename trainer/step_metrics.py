"""The per-step metrics row (the DAPO paper's monitoring panel) and where it is written."""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING

from model.args import ModelArgs, training_flops
from observe.metrics_log import MetricsLogger
from observe.plot import plot_run

if TYPE_CHECKING:
    import torch

    from config import MetricsConfig
    from trainer.distributed import DistEnv

log = logging.getLogger("train")


def sample_totals(groups) -> dict[str, float]:
    """Sums over the samples of `groups` (ScoredGroups of trainer.scoring.Sample): count, score, correct,
    response tokens, truncated responses, and the longest response (a max, not a sum)."""
    samples = [s for g in groups for s in g.payload]
    lengths = [len(s.response_ids) for s in samples]
    return {
        "samples": float(len(samples)),
        "score": float(sum(s.score for s in samples)),
        "acc": float(sum(s.acc for s in samples)),
        "length": float(sum(lengths)),
        "truncated": float(sum(s.finish_reason == "length" for s in samples)),
        "longest": float(max(lengths, default=0)),
    }


def add_totals(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    """Two `sample_totals` combined (e.g. over generation rounds)."""
    return {k: max(a[k], b[k]) if k == "longest" else a[k] + b[k] for k in a}


_SUMMED = ("samples", "score", "acc", "length", "truncated")


def _sample_means(sums: list[float], longest: float, prefix: str) -> dict[str, float]:
    """Reward, accuracy and length means from the `_SUMMED` totals; NaN (logged as null) without samples."""
    n, score, acc, length, truncated = sums
    mean = (lambda x: x / n) if n else (lambda x: math.nan)
    return {
        f"{prefix}reward/mean": mean(score),
        f"{prefix}acc/mean": mean(acc),
        f"{prefix}response_length/mean": mean(length),
        f"{prefix}response_length/max": longest if n else math.nan,
        f"{prefix}response_length/clip_ratio": mean(truncated),
    }


def rollout_metrics(
    groups, filter_stats: dict, train_stats: dict, dist_env: DistEnv, *, group_size: int
) -> dict[str, float]:
    """Reward, accuracy, lengths and group shares of the step, reduced over data-parallel ranks.

    reward/*, acc/mean and response_length/* describe every sample generated in the step's rounds (the
    panel's view of the policy: also a step whose groups were all dropped shows what it generated);
    kept/* the same statistics of the batch trained on (kept groups, carried-over ones included).
    """
    every, kept = filter_stats["generated"], sample_totals(groups)
    sums = dist_env.all_reduce([totals[k] for totals in (every, kept) for k in _SUMMED])
    longest = dist_env.all_reduce([every["longest"], kept["longest"]], op="max")
    row = _sample_means(sums[: len(_SUMMED)], longest[0], "")
    row.update(_sample_means(sums[len(_SUMMED) :], longest[1], "kept/"))
    pre = dict(
        zip(
            ("groups_generated", "samples_generated", "groups_kept"),
            dist_env.all_reduce(
                [float(filter_stats[k]) for k in ("groups_generated", "samples_generated", "groups_kept")]
            ),
        )
    )
    # Shares over every rank's generated groups (each rank reports shares of its own).
    generated = float(filter_stats["groups_generated"])
    share_keys = ("share_all_correct", "share_all_wrong")
    counts = dist_env.all_reduce([filter_stats[k] * generated if generated else 0.0 for k in share_keys])
    shares = {
        k: c / pre["groups_generated"] if pre["groups_generated"] else math.nan for k, c in zip(share_keys, counts)
    }
    row.update(
        {
            # NaN on a step served entirely from carried-over groups (nothing generated, nothing filtered).
            "groups/kept_share": pre["groups_kept"] / pre["groups_generated"] if pre["groups_generated"] else math.nan,
            "groups/all_correct_share": shares["share_all_correct"],
            "groups/all_wrong_share": shares["share_all_wrong"],
            "gen/rounds": filter_stats["rounds"],
            "gen/samples": pre["samples_generated"],  # every sample the step's rounds generated (all ranks)
            "gen/samples_per_kept_sample": (
                pre["samples_generated"] / (pre["groups_kept"] * group_size) if pre["groups_kept"] else math.nan
            ),
            "groups/in_batch": dist_env.all_reduce([float(len(groups))])[0],
        }
    )
    # Where the batch came from: carried-over groups used, surplus carried to the next step, stale ones
    # dropped, and the groups missing from a short batch (on_shortfall = "fill").
    origin = ("groups_from_carry", "groups_carried_over", "groups_dropped_stale", "shortfall")
    totals = dist_env.all_reduce([float(filter_stats[key]) for key in origin])
    row.update({f"groups/{key.removeprefix('groups_')}": total for key, total in zip(origin, totals)})
    row.update({k: v for k, v in train_stats.items() if not k.startswith("_")})
    return row


# Dense bf16 peak per device from datasheets, for the MFU column (no entry: not logged unless
# metrics.peak_tflops is set).
DATASHEET_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0}


def peak_tflops(metrics: MetricsConfig, device: torch.device) -> float | None:
    """metrics.peak_tflops, else the datasheet value of a known GPU, else None."""
    if metrics.peak_tflops > 0:
        return metrics.peak_tflops
    if device.type != "cuda":
        return None
    import torch

    name = torch.cuda.get_device_name(device)
    return next((tflops for key, tflops in DATASHEET_BF16_TFLOPS.items() if key in name), None)


def training_mfu(
    args: ModelArgs, groups, seconds: float, dist_env: DistEnv, *, ppo_epochs: int, metrics: MetricsConfig
) -> dict[str, float]:
    """{"mfu": ...}: model FLOPs of the training phase over (seconds x devices x peak); {} when the peak is
    unknown (CPU). FLOPs: the old-log-prob forward (1/3 of forward + backward) plus ppo_epochs forward +
    backward passes over every trained sequence (model.args.training_flops)."""
    peak = peak_tflops(metrics, dist_env.device)
    if peak is None or seconds <= 0:
        return {}
    samples = [s for g in groups for s in g.payload]
    lengths = [len(s.example.prompt_ids) + len(s.response_ids) for s in samples]
    head_tokens = sum(len(s.response_ids) for s in samples)  # only response tokens reach the output head
    flops = training_flops(args, [lengths], head_tokens) * (ppo_epochs + 1 / 3)
    # Every rank trains its own sequences; tensor-parallel peers share the same ones.
    total = dist_env.all_reduce([flops])[0]
    return {"mfu": total / (seconds * dist_env.world_size * peak * 1e12)}


class MetricsWriter:
    """metrics.jsonl (+ TensorBoard) through observe.MetricsLogger, a console line per step, the plot."""

    def __init__(self, run_path: str, metrics: MetricsConfig, *, rank: int, resumed_step: int = 0):
        self.run_path, self.log_every, self.rank = run_path, max(metrics.log_every, 1), rank
        # Lines (and TensorBoard events) past the resumed checkpoint belong to steps that will be run again.
        self.logger = MetricsLogger(run_path, tensorboard=metrics.tensorboard, rank=rank, resume_after=resumed_step)

    def write(self, step: int, row: dict) -> None:
        self.logger.log(step, row)
        if self.rank == 0 and "reward/mean" in row and step % self.log_every == 0:
            log.info(
                "step %d | reward %.3f | acc %.3f | kept %.2f | len %.1f | entropy %.3f | clip %.3f | %.1fs",
                step,
                row["reward/mean"],
                row["acc/mean"],
                row["groups/kept_share"],
                row["response_length/mean"],
                row["entropy"],
                row["pg_clipfrac"],
                row["time/step"],
            )

    def close(self, plot: bool = False) -> None:
        self.logger.close()
        if plot and self.rank == 0:
            path = plot_run(self.run_path)
            log.info("monitoring panel: %s", path)
