"""What the phases of a step tell the metrics and the console, attached to them once, at build: the phases call
their observer at a few points and never hold a record or a display themselves.

    RolloutWatch    the rollout phase (lines 3-8): every group scored, the batch dynamic sampling hands out, the
                    time spent generating and scoring; a display of the kept groups (and the engine's tokens);
                    a batch left short after the last round trained on with a warning or the run stopped
    TrainWatch      the update (lines 9-12): each loss pass, each optimizer update, the engine/trainer log-prob
                    mismatch (trainer/mismatch.py); a display of the micro-batches
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Literal

from observe.progress import Progress
from trainer.mismatch import MismatchProbe
from trainer.step_metrics import RolloutMetrics, TrainMetrics, reward_parts

if TYPE_CHECKING:
    import torch

    from config.schema import MetricsConfig
    from parallel.dist_env import DistEnv
    from rl.filter import DynamicBatchBuilder, FilterStats
    from rollout.engine import Polled
    from run.guard import GuardedEngine
    from trainer.losses import PassStats
    from trainer.packing import MicroBatch
    from trainer.types import RolloutGroup, Sample

log = logging.getLogger("train")

Display = Callable[[int | None, str, str], Progress]  # (total, description, unit) -> a progress display


def no_display(total: int | None, desc: str, unit: str) -> Progress:
    return Progress(enabled=False)


def on_shortfall(filtered: FilterStats, step: int, policy: Literal["fill", "raise"], max_rounds: int) -> None:
    """A batch dynamic sampling left short after its last round: trained on with one line (on_shortfall "fill"),
    or the run stopped (on_shortfall "raise")."""
    short = int(filtered.shortfall.result())
    if short:
        kept, wanted = int(filtered.in_batch.result()), int(filtered.in_batch.result()) + short
        rounds = filtered.rounds.result()
        message = f"dynamic sampling kept {kept} of {wanted} groups at step {step} after {rounds} of {max_rounds}"
        message += " generation rounds"
        if policy == "raise":
            raise RuntimeError(f"{message} (on_shortfall 'raise'): allow more rounds or train on what was kept")
        log.warning("%s; training on the smaller batch", message)


class RolloutWatch:
    """The rollout phase's metrics (`metrics`, of the last step) and display (module docstring); `shortfall`:
    algorithm.on_shortfall; `reward_metrics`: the names of a reward function's other numbers (rewards/scorer.py)."""

    def __init__(
        self,
        engine: GuardedEngine,
        builder: DynamicBatchBuilder[list[Sample]],
        display: Display,
        shortfall: Literal["fill", "raise"] = "fill",
        reward_metrics: Sequence[str] = (),
    ):
        self.engine, self.builder, self.display, self.shortfall = engine, builder, display, shortfall
        self.step, self.reward_parts = 0, reward_parts(reward_metrics)
        self.metrics, self.bar = RolloutMetrics(reward_parts=self.reward_parts()), Progress(enabled=False)
        self.tokens, self.started, self.engine_s = 0, 0.0, 0.0
        engine.on_poll = self.polled

    def start(self, step: int) -> None:
        self.metrics, self.tokens, self.step = RolloutMetrics(reward_parts=self.reward_parts()), 0, step
        self.started, self.engine_s = time.perf_counter(), self.engine.seconds
        self.bar = self.display(self.builder.train_batch_size, f"step {step} rollout", "groups")

    def polled(self, polled: Polled) -> None:
        self.tokens += polled.tokens
        self.bar.update(0, tokens=self.tokens)

    def round(self, groups: list[RolloutGroup]) -> None:
        """A round's groups, scored and filtered: counted among the generated samples; the display advanced to
        the groups kept so far."""
        self.metrics.add_generated(groups)
        kept = min(self.builder.num_kept, self.builder.train_batch_size)
        self.bar.update(kept - self.bar.n, rounds=self.builder.rounds)

    def batch(self, finished: tuple[list[RolloutGroup], FilterStats]) -> list[RolloutGroup]:
        """The batch dynamic sampling handed out, counted with what the filter did and the phase's times; a
        short one warned about or refused (`on_shortfall`)."""
        self.metrics.add_batch(finished)
        generate_s = self.engine.seconds - self.engine_s
        self.metrics.generate_s.add(generate_s)
        self.metrics.score_s.add(time.perf_counter() - self.started - generate_s)  # scoring and filtering
        self.bar.close()
        on_shortfall(finished[1], self.step, self.shortfall, self.builder.max_rounds)
        return finished[0]


class TrainWatch:
    """The update's metrics (`start` makes the step's) and display (module docstring)."""

    def __init__(self, display: Display):
        self.display, self.bar, self.step = display, Progress(enabled=False), 0
        self.metrics = TrainMetrics()
        self.probe = MismatchProbe(self.metrics.mismatch, [])

    def start(self, step: int, mini_batches: list[list[MicroBatch]], epochs: int) -> TrainMetrics:
        self.metrics, self.step = TrainMetrics(), step
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
