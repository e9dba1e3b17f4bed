"""The per-step metrics row (the DAPO paper's monitoring panel): each metric declared once, with how it
combines over micro-batches and ranks (observe/records.py), and where the row is written.

The rollout phase adds to `RolloutMetrics` and the update to `TrainMetrics`, each on its own rank; at the
step's end `StepRecord.reduce` combines both over every rank (one all-reduce per kind) and `row` is the line
of metrics.jsonl.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from model.args import ModelArgs, training_flops
from observe.metrics_log import MetricsLogger
from observe.plot import plot_run
from observe.records import MAX, SAME, SUM, Count, Max, Mean, Sum, logged, over_ranks, row
from trainer.mismatch import MismatchMetrics

if TYPE_CHECKING:
    import torch

    from config.schema import MetricsConfig
    from parallel.dist_env import DistEnv
    from rl.filter import FilterStats
    from trainer.losses import PassStats
    from trainer.types import RolloutGroup

log = logging.getLogger("train")


@dataclass
class SampleMetrics:
    """Reward, accuracy and lengths of a set of samples: every sample a step generated, or the batch it
    trained on. NaN (null) without samples."""

    reward: Mean = logged("reward/mean", Mean)
    acc: Mean = logged("acc/mean", Mean)
    length: Mean = logged("response_length/mean", Mean)
    longest: Max = logged("response_length/max", Max)
    truncated: Mean = logged("response_length/clip_ratio", Mean)  # the truncated share
    truncated_reward: Mean = logged("reward/truncated_mean", Mean)  # of the truncated samples (DAPO Figs. 4-5)

    def add(self, groups: Iterable[RolloutGroup]) -> None:
        samples = [s for g in groups for s in g.payload]
        truncated = [s.score for s in samples if s.finish_reason == "length"]
        n = len(samples)
        self.reward.add(float(sum(s.score for s in samples)), n)
        self.acc.add(float(sum(s.acc for s in samples)), n)
        self.length.add(float(sum(len(s.response_ids) for s in samples)), n)
        for s in samples:
            self.longest.add(float(len(s.response_ids)))
        self.truncated.add(float(len(truncated)), n)
        self.truncated_reward.add(float(sum(truncated)), len(truncated))


@dataclass
class PartialMetrics:
    """Partial rollout (rollout.partial): the batch's continued samples (started in an earlier step's rollout)
    and their tokens generated under older weights, as shares of the batch's; their age in steps; the groups
    stopped unfinished at a round's end and those dropped for age (rollout.partial_max_age)."""

    continued_share: Mean = logged("continued_share", Mean)
    continued_token_share: Mean = logged("continued_token_share", Mean)
    age: Mean = logged("age/mean", Mean)  # of the continued samples
    age_max: Max = logged("age/max", Max)
    stopped: Sum = logged("groups_stopped", Sum)
    dropped_old: Sum = logged("groups_dropped_old", Sum)

    def add(self, groups: Iterable[RolloutGroup]) -> None:
        samples = [s for g in groups for s in g.payload]
        continued = [s for s in samples if s.age > 0]
        self.continued_share.add(float(len(continued)), len(samples))
        tokens = sum(len(s.response_ids) for s in samples)
        self.continued_token_share.add(float(sum(s.continued_tokens for s in continued)), tokens)
        self.age.add(float(sum(s.age for s in continued)), len(continued))
        for s in continued:
            self.age_max.add(float(s.age))


@dataclass
class RolloutMetrics:
    """A step's rollout phase: what it generated (the panel's view of the policy: also a step whose groups
    were all dropped shows it), what it trained on (kept groups, carried-over ones included), and the groups.
    The shares are of the groups generated: NaN on a step served entirely from carried-over groups."""

    generated: SampleMetrics = logged("", SampleMetrics)
    kept: SampleMetrics = logged("kept/", SampleMetrics)
    kept_share: Mean = logged("groups/kept_share", Mean)
    all_correct_share: Mean = logged("groups/all_correct_share", Mean)
    all_wrong_share: Mean = logged("groups/all_wrong_share", Mean)
    rounds: Count = logged("gen/rounds", Count, SAME)
    samples: Sum = logged("gen/samples", Sum)  # the x axis of accuracy against generated samples (DAPO Fig. 6)
    samples_per_kept_sample: Mean = logged("gen/samples_per_kept_sample", Mean)
    in_batch: Sum = logged("groups/in_batch", Sum)
    # Where the batch came from: carried-over groups used, surplus carried to the next step, stale ones
    # dropped, and the groups missing from a short batch (on_shortfall = "fill").
    from_carry: Sum = logged("groups/from_carry", Sum)
    carried_over: Sum = logged("groups/carried_over", Sum)
    dropped_stale: Sum = logged("groups/dropped_stale", Sum)
    shortfall: Sum = logged("groups/shortfall", Sum)
    tokens: Sum = logged("gen/tokens", Sum)  # generated in this step's rounds (stopped samples' included)
    partial: PartialMetrics = logged("partial/", PartialMetrics)
    generate_s: Sum = logged("time/generate", Sum, MAX)  # the slowest rank's
    score_s: Sum = logged("time/score", Sum, MAX)

    def add_generated(self, groups: list[RolloutGroup], score_s: float) -> None:
        """Finished groups just scored (in `score_s` seconds), with the tokens this step generated for them."""
        self.generated.add(groups)
        self.score_s.add(score_s)
        self.tokens.add(float(sum(len(s.response_ids) - s.continued_tokens for g in groups for s in g.payload)))

    def add_batch(self, batch: tuple[list[RolloutGroup], FilterStats], group_size: int) -> list[RolloutGroup]:
        """The batch dynamic sampling handed out (rl/filter.py), counted with what the filter did."""
        groups, f = batch
        self.kept.add(groups)
        self.kept_share.add(f.groups_kept, f.groups_generated)
        self.all_correct_share.add(f.all_correct, f.groups_generated)
        self.all_wrong_share.add(f.all_wrong, f.groups_generated)
        self.rounds.add(f.rounds)
        self.samples.add(f.samples_generated)
        self.samples_per_kept_sample.add(f.samples_generated, f.groups_kept * group_size)
        self.in_batch.add(f.groups_in_batch)
        self.from_carry.add(f.groups_from_carry)
        self.carried_over.add(f.groups_carried_over)
        self.dropped_stale.add(f.groups_dropped_stale)
        self.shortfall.add(f.shortfall)
        self.partial.add(groups)
        return groups


@dataclass
class TrainMetrics:
    """A step's training phase: per-token means over the trained tokens (NaN without any), means over the
    optimizer updates (which every rank runs alike), and the engine/trainer mismatch."""

    loss: Mean = logged("loss", Mean, (SUM, SAME))  # each update's mini-batch loss: its shares summed over ranks
    pg_clipfrac: Mean = logged("pg_clipfrac", Mean)
    pg_clipfrac_lower: Mean = logged("pg_clipfrac_lower", Mean)
    pg_clipfrac_upper: Mean = logged("pg_clipfrac_upper", Mean)
    clipped_upper_prob: Mean = logged("token_prob/clipped_upper_mean", Mean)  # of the upper-clipped tokens
    first_token_upper: Mean = logged("pg_clipfrac_upper/first_token", Mean)  # of the responses' first tokens
    ppo_kl: Mean = logged("ppo_kl", Mean)
    entropy: Mean = logged("entropy", Mean)
    token_prob: Mean = logged("token_prob/mean", Mean)
    grad_norm: Mean = logged("grad_norm", Mean, (SAME, SAME))  # of the updates that were not skipped
    skipped: Count = logged("updates_skipped_nonfinite", Count, SAME)
    updates: Count = logged("updates", Count, SAME)
    lr: Sum = logged("lr", Sum, SAME)  # the rate this step ran at
    train_tokens: Sum = logged("train_tokens", Sum)  # valid tokens trained on (once, whatever ppo_epochs)
    mismatch: MismatchMetrics = logged("mismatch/", MismatchMetrics)
    continued_mismatch: MismatchMetrics = logged("partial/mismatch/", MismatchMetrics)  # older-policy tokens

    def add_pass(self, stats: PassStats) -> None:
        """One micro-batch's loss pass, weighted by its valid tokens."""
        clip = stats.clip
        n = float(clip.num_tokens)
        upper = float(clip.pg_clipfrac_upper) * n
        self.pg_clipfrac.add(float(clip.pg_clipfrac) * n, n)
        self.pg_clipfrac_lower.add(float(clip.pg_clipfrac_lower) * n, n)
        self.pg_clipfrac_upper.add(upper, n)
        self.clipped_upper_prob.add(float(clip.clipped_upper_prob) * upper, upper)
        self.first_token_upper.add(float(clip.first_tokens_upper), float(clip.num_first_tokens))
        self.ppo_kl.add(float(clip.ppo_kl) * n, n)
        self.entropy.add(float(stats.entropy_sum), n)
        self.token_prob.add(float(stats.token_prob_sum), n)

    def add_update(self, loss: float, grad_norm: float | None) -> None:
        """One optimizer update: its mini-batch loss (this rank's share) and gradient norm (None: skipped)."""
        self.loss.add(loss)
        self.updates.add(1)
        if grad_norm is None:
            self.skipped.add(1)
        else:
            self.grad_norm.add(grad_norm)

    def metrics(self) -> dict[str, float]:
        """The logged values, by name (of every rank once `StepRecord.reduce` combined them)."""
        return row(self)


@dataclass
class StepTimes:
    """Seconds the main rank spent in the phases after the rollout (None: the phase did not run), laps of a
    clock that starts with the step."""

    train: float = 0.0
    sync: float | None = None
    step: float | None = None  # the step's seconds so far (its evaluation apart)
    eval: float | None = None
    clock: list[float] = field(default_factory=lambda: [time.perf_counter()] * 2, repr=False)  # start, last lap

    def lap(self) -> float:
        """Seconds since the last lap (or the step's start); `step` becomes the seconds since the start."""
        now = time.perf_counter()
        seconds, self.clock[1], self.step = now - self.clock[1], now, now - self.clock[0]
        return seconds


@dataclass
class StepRecord:
    """One step's line of metrics.jsonl."""

    rollout: RolloutMetrics
    train: TrainMetrics
    times: StepTimes
    mfu: float | None = None  # None where the device's peak is unknown (CPU)
    eval: dict[str, float] = field(default_factory=dict)  # the held-out evaluation's eval/... metrics, if due

    def reduce(self, dist_env: DistEnv) -> None:
        """Both phases' metrics over every rank (every rank calls it)."""
        over_ranks((self.rollout, self.train), dist_env)

    def row(self) -> dict[str, float | None]:
        t = self.times
        line: dict[str, float | None] = {**row(self.rollout, self.train), "time/train": t.train}
        if self.mfu is not None:
            line["mfu"] = self.mfu
        if t.sync is not None:
            line["time/sync"] = t.sync
        if t.step is not None:
            line["time/step"] = t.step
            if t.sync is not None:  # a complete step
                line["tokens_per_s"] = self.train.train_tokens.result() / max(t.step, 1e-9)
        line.update(self.eval)
        if t.eval is not None:
            line["time/eval"] = t.eval
        return line


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
