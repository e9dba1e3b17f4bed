"""The per-step metrics row (the DAPO paper's monitoring panel) and where it is written."""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from model.args import ModelArgs, training_flops
from observe.metrics_log import MetricsLogger
from observe.plot import plot_run

if TYPE_CHECKING:
    import torch

    from config import MetricsConfig
    from parallel.dist_env import DistEnv
    from trainer.rollout_phase import RolloutBatch
    from trainer.scoring import RolloutGroup
    from trainer.update import TrainStats

log = logging.getLogger("train")


@dataclass(frozen=True)
class SampleTotals:
    """Sums over a set of samples: count, score, correct, response tokens, truncated responses and their score,
    and the longest response (a max, not a sum). `+` combines two sets (e.g. generation rounds)."""

    samples: float = 0.0
    score: float = 0.0
    acc: float = 0.0
    length: float = 0.0
    truncated: float = 0.0
    truncated_score: float = 0.0
    longest: float = 0.0

    @classmethod
    def of(cls, groups: Iterable[RolloutGroup]) -> SampleTotals:
        samples = [s for g in groups for s in g.payload]
        lengths = [len(s.response_ids) for s in samples]
        return cls(
            samples=float(len(samples)),
            score=float(sum(s.score for s in samples)),
            acc=float(sum(s.acc for s in samples)),
            length=float(sum(lengths)),
            truncated=float(sum(s.finish_reason == "length" for s in samples)),
            truncated_score=float(sum(s.score for s in samples if s.finish_reason == "length")),
            longest=float(max(lengths, default=0)),
        )

    def __add__(self, other: SampleTotals) -> SampleTotals:
        summed = {name: getattr(self, name) + getattr(other, name) for name in _SUMMED}
        return SampleTotals(**summed, longest=max(self.longest, other.longest))

    def summed(self) -> list[float]:
        return [getattr(self, name) for name in _SUMMED]


_SUMMED = ("samples", "score", "acc", "length", "truncated", "truncated_score")


@dataclass(frozen=True)
class SampleMeans:
    """Reward, accuracy and length means of a set of samples over every rank; NaN (null) without samples."""

    reward: float
    acc: float
    length: float
    length_max: float
    clip_ratio: float  # truncated share
    truncated_reward: float  # mean reward of the truncated samples (DAPO Figs. 4-5); NaN without any

    @classmethod
    def of(cls, sums: list[float], longest: float) -> SampleMeans:
        n, score, acc, length, truncated, truncated_score = sums

        def mean(x: float) -> float:
            return x / n if n else math.nan

        truncated_reward = truncated_score / truncated if truncated else math.nan
        return cls(mean(score), mean(acc), mean(length), longest if n else math.nan, mean(truncated), truncated_reward)

    def metrics(self, prefix: str) -> dict[str, float]:
        return {
            f"{prefix}reward/mean": self.reward,
            f"{prefix}acc/mean": self.acc,
            f"{prefix}response_length/mean": self.length,
            f"{prefix}response_length/max": self.length_max,
            f"{prefix}response_length/clip_ratio": self.clip_ratio,
            f"{prefix}reward/truncated_mean": self.truncated_reward,
        }


@dataclass(frozen=True)
class RolloutStats:
    """A step's rollout phase over every rank: what it generated, what it trained on, and the groups.

    generated describes every sample of the step's rounds (the panel's view of the policy: also a step whose
    groups were all dropped shows what it generated); kept the batch trained on (kept groups, carried-over
    ones included). The shares are over every rank's generated groups; NaN on a step served entirely from
    carried-over groups (nothing generated, nothing filtered).
    """

    generated: SampleMeans
    kept: SampleMeans
    kept_share: float
    all_correct_share: float
    all_wrong_share: float
    rounds: float
    samples: float  # generated over every round and rank: the x axis of accuracy against samples (DAPO Fig. 6)
    samples_per_kept_sample: float
    in_batch: float
    # Where the batch came from: carried-over groups used, surplus carried to the next step, stale ones
    # dropped, and the groups missing from a short batch (on_shortfall = "fill").
    from_carry: float
    carried_over: float
    dropped_stale: float
    shortfall: float

    def metrics(self) -> dict[str, float]:
        return {
            **self.generated.metrics(""),
            **self.kept.metrics("kept/"),
            "groups/kept_share": self.kept_share,
            "groups/all_correct_share": self.all_correct_share,
            "groups/all_wrong_share": self.all_wrong_share,
            "gen/rounds": self.rounds,
            "gen/samples": self.samples,  # every sample the step's rounds generated (all ranks)
            "gen/samples_per_kept_sample": self.samples_per_kept_sample,
            "groups/in_batch": self.in_batch,
            "groups/from_carry": self.from_carry,
            "groups/carried_over": self.carried_over,
            "groups/dropped_stale": self.dropped_stale,
            "groups/shortfall": self.shortfall,
        }


def rollout_stats(batch: RolloutBatch, dist_env: DistEnv, *, group_size: int) -> RolloutStats:
    """RolloutStats of this rank's `batch`, reduced over the data-parallel ranks."""
    every, kept, stats = batch.generated, SampleTotals.of(batch.groups), batch.filter_stats
    sums = dist_env.all_reduce(every.summed() + kept.summed())
    longest = dist_env.all_reduce([every.longest, kept.longest], op="max")
    counted = ("groups_generated", "samples_generated", "groups_kept")
    generated_groups, generated_samples, kept_groups = dist_env.all_reduce([float(stats[k]) for k in counted])
    # Each rank reports shares of its own generated groups.
    mine = float(stats["groups_generated"])
    share_keys = ("share_all_correct", "share_all_wrong")
    all_correct, all_wrong = dist_env.all_reduce([stats[k] * mine if mine else 0.0 for k in share_keys])
    in_batch = dist_env.all_reduce([float(len(batch.groups))])[0]
    origin = ("groups_from_carry", "groups_carried_over", "groups_dropped_stale", "shortfall")
    from_carry, carried_over, dropped_stale, shortfall = dist_env.all_reduce([float(stats[k]) for k in origin])

    def share(count: float) -> float:
        return count / generated_groups if generated_groups else math.nan

    return RolloutStats(
        generated=SampleMeans.of(sums[: len(_SUMMED)], longest[0]),
        kept=SampleMeans.of(sums[len(_SUMMED) :], longest[1]),
        kept_share=share(kept_groups),
        all_correct_share=share(all_correct),
        all_wrong_share=share(all_wrong),
        rounds=stats["rounds"],
        samples=generated_samples,
        samples_per_kept_sample=generated_samples / (kept_groups * group_size) if kept_groups else math.nan,
        in_batch=in_batch,
        from_carry=from_carry,
        carried_over=carried_over,
        dropped_stale=dropped_stale,
        shortfall=shortfall,
    )


@dataclass
class StepTimes:
    """Seconds a step spent in each phase (None: the phase did not run)."""

    generate: float
    score: float
    train: float
    sync: float | None = None
    step: float | None = None
    eval: float | None = None


@dataclass
class StepRecord:
    """One step's line of metrics.jsonl: its fields are the logged metrics (`row`)."""

    rollout: RolloutStats
    train: TrainStats
    times: StepTimes
    mfu: float | None = None  # None where the device's peak is unknown (CPU)
    eval: dict[str, float] = field(default_factory=dict)  # the held-out evaluation's eval/... metrics, if due

    def row(self) -> dict[str, float | None]:
        t = self.times
        row: dict[str, float | None] = {**self.rollout.metrics(), **self.train.metrics()}
        row.update({"time/generate": t.generate, "time/score": t.score, "time/train": t.train})
        if self.mfu is not None:
            row["mfu"] = self.mfu
        if t.sync is not None:
            row["time/sync"] = t.sync
        if t.step is not None:
            row["time/step"] = t.step
            if t.sync is not None:  # a complete step
                row["tokens_per_s"] = self.train.train_tokens / max(t.step, 1e-9)
        row.update(self.eval)
        if t.eval is not None:
            row["time/eval"] = t.eval
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
    args: ModelArgs,
    groups: list[RolloutGroup],
    seconds: float,
    dist_env: DistEnv,
    *,
    ppo_epochs: int,
    metrics: MetricsConfig,
) -> float | None:
    """Model FLOPs of the training phase over (seconds x devices x peak); None when the peak is unknown
    (CPU). FLOPs: the old-log-prob forward (1/3 of forward + backward) plus ppo_epochs forward + backward
    passes over every trained sequence (model.args.training_flops)."""
    peak = peak_tflops(metrics, dist_env.device)
    if peak is None or seconds <= 0:
        return None
    samples = [s for g in groups for s in g.payload]
    lengths = [len(s.example.prompt_ids) + len(s.response_ids) for s in samples]
    head_tokens = sum(len(s.response_ids) for s in samples)  # only response tokens reach the output head
    flops = training_flops(args, [lengths], head_tokens) * (ppo_epochs + 1 / 3)
    # Every rank trains its own sequences; tensor-parallel peers share the same ones.
    total = dist_env.all_reduce([flops])[0]
    return total / (seconds * dist_env.world_size * peak * 1e12)


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
