"""The per-step metrics row (the DAPO paper's monitoring panel): each metric declared once, with how it
combines over micro-batches and ranks (observe/records.py), and where the row is written.

The rollout phase adds to `RolloutMetrics` and the update to `TrainMetrics`, each on its own rank; at the
step's end `StepRecord.reduce` combines both over every rank (one all-reduce per kind) and `row` is the line
of metrics.jsonl.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, make_dataclass
from typing import TYPE_CHECKING, Any

from model.args import ModelArgs, training_flops
from observe.metrics_log import MetricsLogger
from observe.records import MAX, SAME, SUM, Count, Max, Mean, Sum, add, logged, over_ranks, records, row
from rl.stats import ClipStats, FilterStats
from trainer.mismatch import MismatchMetrics

if TYPE_CHECKING:
    import torch

    from config.schema import MetricsConfig
    from parallel.dist_env import DistEnv
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


def reward_parts(names: Sequence[str] = ()) -> type:
    """A metrics dataclass of one Mean per name: the numbers a user's reward function returns beside its score
    (rewards/scorer.py), the same names on every rank (its check at start gives them), logged as reward/<name>."""
    return make_dataclass("RewardParts", [(f"part{i}", Mean, logged(name, Mean)) for i, name in enumerate(names)])


@dataclass
class RolloutMetrics:
    """A step's rollout phase: what it generated (the panel's view of the policy: also a step whose groups
    were all dropped shows it), what it trained on (kept groups, carried-over ones included), what dynamic
    sampling did (rl/stats.py FilterStats, the builder's own record), and the phase's times."""

    generated: SampleMetrics = logged("", SampleMetrics)
    kept: SampleMetrics = logged("kept/", SampleMetrics)
    filter: FilterStats = logged("", FilterStats)
    tokens: Sum = logged("gen/tokens", Sum)  # generated in this step's rounds
    generate_s: Sum = logged("time/generate", Sum, MAX)  # the slowest rank's
    score_s: Sum = logged("time/score", Sum, MAX)  # scoring and filtering
    reward_parts: Any = logged("reward/", reward_parts())  # a reward function's other numbers (`reward_parts`)

    def add_generated(self, groups: list[RolloutGroup]) -> None:
        """Groups just scored, with the tokens this step generated for them."""
        self.generated.add(groups)
        self.tokens.add(float(sum(len(s.response_ids) for g in groups for s in g.payload)))
        for name, mean in records(self.reward_parts):
            values = [s.reward_metrics[name] for g in groups for s in g.payload if name in s.reward_metrics]
            mean.add(math.fsum(values), len(values))  # type: ignore[call-arg]  # a Mean (`reward_parts`)

    def add_batch(self, batch: tuple[list[RolloutGroup], FilterStats]) -> None:
        """The batch dynamic sampling handed out (rl/filter.py), and what the filter did."""
        groups, self.filter = batch
        self.kept.add(groups)


@dataclass
class TrainMetrics:
    """A step's training phase: per-token means over the trained tokens (NaN without any), means over the
    optimizer updates (which every rank runs alike), and the engine/trainer mismatch."""

    loss: Mean = logged("loss", Mean, (SUM, SAME))  # each update's mini-batch loss: its shares summed over ranks
    clip: ClipStats = logged("", ClipStats)  # Eq. 10's, over the trained tokens (rl/stats.py)
    entropy: Mean = logged("entropy", Mean)
    token_prob: Mean = logged("token_prob/mean", Mean)
    grad_norm: Mean = logged("grad_norm", Mean, (SAME, SAME))  # of the updates that were not skipped
    skipped: Count = logged("updates_skipped_nonfinite", Count, SAME)
    updates: Count = logged("updates", Count, SAME)
    lr: Sum = logged("lr", Sum, SAME)  # the rate this step ran at
    train_tokens: Sum = logged("train_tokens", Sum)  # valid tokens trained on (once, whatever ppo_epochs)
    mismatch: MismatchMetrics = logged("mismatch/", MismatchMetrics)

    def add_pass(self, stats: PassStats) -> None:
        """One micro-batch's loss pass, weighted by its valid tokens."""
        add(self.clip, stats.clip)
        self.entropy.add(float(stats.entropy_sum), stats.clip.num_tokens)
        self.token_prob.add(float(stats.token_prob_sum), stats.clip.num_tokens)

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
        optional = {"mfu": self.mfu, "time/sync": t.sync, "time/step": t.step}
        line.update({key: value for key, value in optional.items() if value is not None})
        if t.step is not None and t.sync is not None:  # a complete step
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


# The console line's metrics, in its order.
CONSOLE_KEYS = "reward/mean acc/mean groups/kept_share response_length/mean entropy pg_clipfrac time/step".split()


class MetricsWriter:
    """metrics.jsonl (+ TensorBoard) through observe.MetricsLogger, and a console line per step."""

    def __init__(self, run_path: str, metrics: MetricsConfig, *, rank: int, resumed_step: int = 0):
        self.run_path, self.log_every, self.rank = run_path, max(metrics.log_every, 1), rank
        self.tensorboard = metrics.tensorboard
        # Lines (and TensorBoard events) past the resumed checkpoint belong to steps that will be run again.
        self.logger = MetricsLogger(run_path, tensorboard=metrics.tensorboard, rank=rank, resume_after=resumed_step)

    def write(self, step: int, row: dict) -> None:
        self.logger.log(step, row)
        if self.rank == 0 and "reward/mean" in row and step % self.log_every == 0:
            line = "step %d | reward %.3f | acc %.3f | kept %.2f | len %.1f | entropy %.3f | clip %.3f | %.1fs"
            log.info(line, step, *(row[key] for key in CONSOLE_KEYS))

    def close(self) -> None:
        self.logger.close()
        if self.rank == 0 and self.tensorboard:
            log.info("curves: tensorboard --logdir %s/tensorboard", self.run_path)
