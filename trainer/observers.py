"""What the phases of a step tell the metrics and the console, attached to them once, at build: the phases call
their observer at a few points and never hold a record or a display themselves.

    RolloutWatch    the rollout phase (lines 3-8): every group scored, the batch dynamic sampling hands out, the
                    time spent generating and scoring; a display of the kept groups (and the engine's tokens)
    TrainWatch      the update (lines 9-12): the samples it trains on with their advantages (the rollout dump),
                    each loss pass, each optimizer update, the engine/trainer log-prob mismatch
                    (trainer/mismatch.py); a display of the micro-batches
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from observe.progress import Progress
from trainer.mismatch import MismatchProbe
from trainer.step_metrics import RolloutMetrics, TrainMetrics, reward_parts

if TYPE_CHECKING:
    import torch

    from config.schema import MetricsConfig
    from parallel.dist_env import DistEnv
    from rl.filter import DynamicBatchBuilder, FilterStats
    from rollout.engine import Polled
    from trainer.losses import PassStats
    from trainer.packing import MicroBatch, PackItem
    from trainer.types import RolloutGroup, Sample

Display = Callable[[int | None, str, str], Progress]  # (total, description, unit) -> a progress display


def no_display(total: int | None, desc: str, unit: str) -> Progress:
    return Progress(enabled=False)


class RolloutWatch:
    """The rollout phase's metrics (`metrics`, of the last step) and display (module docstring); `reward_metrics`:
    the names of a reward function's other numbers (rewards/scorer.py). Its `polled` observes the engine's every poll
    (run/guard.py GuardedEngine's on_poll)."""

    def __init__(
        self, builder: DynamicBatchBuilder[list[Sample]], display: Display, reward_metrics: Sequence[str] = ()
    ):
        self.builder, self.display, self.reward_parts = builder, display, reward_parts(reward_metrics)
        self.metrics, self.bar = RolloutMetrics(reward_parts=self.reward_parts()), Progress(enabled=False)
        self.tokens, self.started, self.last_poll = 0, 0.0, 0.0

    def start(self, step: int) -> None:
        self.metrics, self.tokens = RolloutMetrics(reward_parts=self.reward_parts()), 0
        self.started = self.last_poll = time.perf_counter()
        self.bar = self.display(self.builder.train_batch_size, f"step {step} rollout", "groups")

    def polled(self, polled: Polled) -> None:
        self.tokens, self.last_poll = self.tokens + polled.tokens, time.perf_counter()
        self.bar.update(0, tokens=self.tokens)

    def round(self, groups: list[RolloutGroup]) -> None:
        """A round's groups, scored and filtered since the round's last poll: counted among the generated samples;
        the display advanced to the groups kept so far."""
        self.metrics.score_s.add(time.perf_counter() - self.last_poll)  # scoring and filtering
        self.metrics.add_generated(groups)
        kept = min(self.builder.num_kept, self.builder.train_batch_size)
        self.bar.update(kept - self.bar.n, rounds=self.builder.rounds)

    def batch(self, batch: list[RolloutGroup], filtered: FilterStats) -> None:
        """The batch dynamic sampling handed out, counted with what the filter did and the phase's time spent
        generating (the rest: scoring and filtering)."""
        self.metrics.add_batch((batch, filtered))
        self.metrics.generate_s.add(time.perf_counter() - self.started - self.metrics.score_s.result())
        self.bar.close()


class TrainWatch:
    """The update's metrics (`start` makes the step's) and display (module docstring); dump: writes the samples a
    step trains on with their advantages (trainer/rollout_dump.py; None: nothing written)."""

    def __init__(
        self, display: Display, dump: Callable[[int, list[RolloutGroup], list[list[float]]], None] | None = None
    ):
        self.display, self.bar, self.step = display, Progress(enabled=False), 0
        self.metrics, self.dump = TrainMetrics(), dump
        self.probe = MismatchProbe(self.metrics.mismatch, [])

    def samples(self, step: int, groups: list[RolloutGroup], group_items: list[list[PackItem]]) -> None:
        """The samples the step trains on, each with the Eq. 9 advantage the update uses (metrics.rollout_dump)."""
        if self.dump is not None:
            self.dump(step, groups, [[item.advantage for item in items] for items in group_items])

    def start(self, step: int, mini_batches: list[list[MicroBatch]], epochs: int, lr: float) -> TrainMetrics:
        """The step's metrics, from the learning rate it runs at."""
        self.metrics, self.step = TrainMetrics(), step
        self.metrics.lr.add(lr)
        self.probe = MismatchProbe(self.metrics.mismatch, mini_batches[0] if mini_batches else [])
        # The valid tokens trained on, once whatever ppo_epochs: overlong-filtered samples and padding have none.
        self.metrics.train_tokens.add(float(sum(int((mb.mask > 0).sum()) for mbs in mini_batches for mb in mbs)))
        self.bar = self.display(sum(len(mbs) for mbs in mini_batches) * epochs, f"step {step} train", "micro-batches")
        return self.metrics

    def recomputed(self, old_logp: torch.Tensor, mb: MicroBatch) -> None:
        """pi_old recomputed by the trainer at the step-start weights: measured against the engine's."""
        self.probe.saw(old_logp, mb, step_start=True)

    def loss_pass(self, stats: PassStats, mb: MicroBatch) -> None:
        self.metrics.add_pass(stats)
        self.probe.saw(stats.logp, mb)
        self.bar.update(1)

    def skipped(self, micro_batches: int) -> None:
        """A mini-batch with nothing to train on: no update, nothing logged."""
        self.bar.update(micro_batches)

    def update(self, loss: float, grad_norm: float | None) -> None:
        self.metrics.add_update(loss, grad_norm)

    def finish(self, pi_old_setting: str | None = None) -> TrainMetrics:
        """The step's metrics; where the engine's log-probs served as pi_old (`pi_old_setting`: the configured
        algorithm.old_logprobs), a warning when they strayed from the trainer's (trainer/mismatch.py)."""
        self.bar.close()
        if pi_old_setting is not None:
            self.probe.warn_if_above(self.step, pi_old_setting)
        return self.metrics


def display_for(metrics: MetricsConfig, dist_env: DistEnv) -> Display:
    """The run's progress displays: on the main rank when metrics.progress, gone once their phase ends."""
    shown = metrics.progress and dist_env.is_main
    return lambda total, desc, unit: Progress(total=total, desc=desc, unit=unit, enabled=shown, leave=False)
