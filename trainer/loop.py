"""The DAPO trainer: one iteration of Algorithm 1 (`Trainer.step`) over the components train.py built once
(trainer/build.py), and the phases around the loop (resume, warm-up, evaluation, the end).

Both the supervised warm-up and the DAPO loop run under a phase runner (run/phase_runner.py): resume
from the newest intact checkpoint, a checkpoint every interval, and every stop after the first step's data
went out checkpoints the last completed step first, so a rerun of the same command resumes. That includes
the death of an engine's process (EngineDied, rollout/engine_process.py): the policy lives in the trainer's
process and is intact, so every rank checkpoints and stops (`Trainer.engine_died`). Every way out of a run
goes through `Trainer.close`: the rollout engine is shut down, the signal handlers restored and the run
folder released, also when a step fails.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, NoReturn

from config import Config
from evaluation.evaluate import params_from_config
from evaluation.held_out import run_held_out_eval
from model.hf import complete_hf_export
from observe.progress import Progress
from parallel.checkpoint import CheckpointManager
from parallel.device_memory import return_cached_memory
from parallel.hf_export import export_hf
from rollout.engine import EngineDied, EngineFailure
from rollout.weight_sync import sync_weights
from run.folder import WARMUP_CHECKPOINTS, mark_finished
from run.phase_runner import Checkpointed, Extra, PhaseRunner
from run.signals import GracefulStop, StopRequested
from run.state import LoopPosition, TrainState
from trainer.build import Components
from trainer.rollout_phase import Outcome, RolloutBatch, RolloutError, RoundStopped, agree
from trainer.step_metrics import MetricsWriter, StepRecord, StepTimes, training_mfu
from trainer.warmup import SFTWarmup, discard_warmup_checkpoints

log = logging.getLogger("train")


class Trainer:
    """Algorithm 1 over built components; `state` is what a checkpoint records of the loop."""

    def __init__(self, cfg: Config, parts: Components):
        self.cfg, self.parts, self.dist = cfg, parts, parts.dist
        self.state = TrainState(skipped=parts.update.optimizer_step.skipped)
        self.stop = GracefulStop()  # listening from `resume` on
        checkpoints = CheckpointManager(f"{parts.run_path}/checkpoints", keep=cfg.checkpoint.keep_latest_k)
        self.runner = PhaseRunner(
            checkpoints,
            Checkpointed(parts.policy, parts.optimizer, parts.scheduler),
            self.stop,
            self.dist,
            interval=cfg.checkpoint.interval if cfg.checkpoint.enabled else 0,
        )
        self.metrics: MetricsWriter | None = None
        self.eval_params = params_from_config(cfg, parts.tokenizer.stop_ids, seed=cfg.job.seed)

    # --- Checkpoints, stops, weights ---------------------------------------------------------------
    def extra(self, position: LoopPosition | None = None) -> Extra:
        """The loop's state for a checkpoint of the last completed step, with the data `position` it ended at
        (default: where the data stands at the save)."""

        def plain() -> dict[str, Any]:
            at = position or LoopPosition.of(self.parts.sampler, self.parts.builder)
            return {**self.state.state_dict(), **at.plain()}

        return plain

    def save_checkpoint(self) -> None:
        """Checkpoint the last completed step (none when it exists already)."""
        self.runner.save(self.state.step, self.extra())

    def stop_with_checkpoint(
        self, error: Exception, position: LoopPosition | None = None, *, cause: BaseException | None = None
    ) -> NoReturn:
        """Checkpoint the last completed step (at data `position`, default: now), then raise `error`."""
        self.runner.stop_with_checkpoint(self.state.step, self.extra(position), error, cause)

    def stop_if_requested(self, position: LoopPosition | None = None, *, save: bool = True) -> None:
        """At a phase boundary: after a first SIGTERM / SIGINT on any rank, checkpoint and stop."""
        self.runner.stop_if_requested(self.state.step, self.extra(position) if save else None)

    def engine_died(self, exc: EngineDied, position: LoopPosition | None = None) -> NoReturn:
        """An engine's process is gone; the policy, in this process, is intact: checkpoint the last completed
        step (at data `position`, default: now) and stop with EngineDied on every rank."""
        self.stop_with_checkpoint(
            EngineDied(f"{exc}. Checkpoint of step {self.state.step} saved; rerun the same command to resume"),
            position,
            cause=exc,
        )

    def engine_call(self, what: str, fn: Callable[[], object], position: LoopPosition | None = None) -> None:
        """fn(), a call into the rollout engine, on every rank; then all ranks agree on how it went. If it
        failed on any rank, every rank checkpoints (the policy is intact) and stops: with EngineDied when an
        engine's process died, else with the engine's error."""
        error = None
        try:
            fn()
        except Exception as exc:
            error = exc
        outcome = Outcome.ENGINE_DIED if isinstance(error, EngineDied) else Outcome.FAILED if error else Outcome.OK
        worst = agree(self.dist, outcome)
        if worst == Outcome.ENGINE_DIED:
            died = error if isinstance(error, EngineDied) else None
            self.engine_died(died or EngineDied(f"the rollout engine of another rank died during {what}"), position)
        if worst == Outcome.FAILED:
            self.stop_with_checkpoint(
                RuntimeError(
                    f"the rollout engine failed during {what}: {error or 'on another rank (see its log)'}. "
                    f"Checkpoint of step {self.state.step} saved; rerun to resume (with the cause fixed)"
                ),
                position,
                cause=error,
            )

    def sync_weights(self) -> None:
        """Push the policy's weights into the rollout engine in place."""
        bucket_bytes = self.cfg.rollout.weight_sync_bucket_mb << 20
        self.engine_call(
            "weight sync", lambda: sync_weights(self.parts.policy, self.parts.engine, bucket_bytes=bucket_bytes)
        )

    def progress(self, total: int | None, desc: str, unit: str) -> Progress:
        return Progress(
            total=total, desc=desc, unit=unit, enabled=self.cfg.metrics.progress and self.dist.is_main, leave=False
        )

    def write(self, step: int, row: dict[str, Any]) -> None:
        assert self.metrics is not None, "resume() opens metrics.jsonl"
        self.metrics.write(step, row)

    # --- Before the loop ---------------------------------------------------------------------------
    def resume(self) -> None:
        """Load the latest checkpoint (if resuming), then open metrics.jsonl and start listening for signals."""
        p = self.parts
        saved = self.runner.resume() if self.cfg.checkpoint.resume else None
        if saved is not None:
            LoopPosition.pop_from(saved).restore(p.sampler, p.builder)
            self.state.load_state_dict(saved)
            log.info("resumed from step %d", self.state.step)
            self.sync_weights()
        # Rows past the checkpoint are redone; so is the step-0 evaluation when the run restarts at step 0.
        self.metrics = MetricsWriter(
            p.run_path,
            self.cfg.metrics,
            rank=self.dist.rank,
            resumed_step=self.state.step if self.state.step > 0 else -1,
        )
        # A first SIGTERM / SIGINT asks for a checkpoint at the next phase boundary, from here to the end.
        self.stop.install()

    def warm_up(self) -> None:
        """Supervised warm-up (demo models start from random weights), checkpointed as step 0."""
        cfg, p, training = self.cfg, self.parts, self.cfg.training
        if not training.sft_warmup_steps or self.state.sft_done:
            return
        start = time.perf_counter()
        warm = SFTWarmup.from_config(
            training, cfg.optimizer, p.policy, p.train_set, p.tokenizer, self.dist, seed=cfg.job.seed
        )
        checkpoints = CheckpointManager(f"{p.run_path}/{WARMUP_CHECKPOINTS}", keep=1)
        runner = PhaseRunner(
            checkpoints,
            warm.checkpointed(),
            self.stop,
            self.dist,
            interval=cfg.checkpoint.warmup_interval if cfg.checkpoint.enabled else 0,
            step_name="supervised warm-up step",
            last_step=training.sft_warmup_steps,  # its end is checkpointed as the DAPO loop's step 0
        )
        with self.progress(training.sft_warmup_steps, "warm-up", "steps") as bar:
            warm.run(
                runner,
                resume=cfg.checkpoint.resume,
                progress=bar,
                on_log=lambda step, loss: log.info("sft step %d: loss %.4f", step, loss),
            )
        self.state.sft_done = True
        if cfg.checkpoint.enabled:  # the warm-up's end, as step 0: a rerun goes on from here
            self.save_checkpoint()
        discard_warmup_checkpoints(checkpoints, self.dist.is_main)
        self.sync_weights()
        log.info("supervised warm-up: %d steps in %.1fs", training.sft_warmup_steps, time.perf_counter() - start)

    def held_out(self, step: int) -> dict[str, float]:
        """Held-out accuracy (avg@k, pass@k) of the engine's current weights."""
        p = self.parts
        with self.progress(-(-len(p.eval_set) // self.dist.dp_size), f"eval at step {step}", "problems") as bar:
            try:
                return run_held_out_eval(
                    p.engine,
                    p.eval_set,
                    p.tokenizer,
                    self.eval_params,
                    self.dist,
                    p.run_path,
                    step,
                    strict_box=self.cfg.algorithm.strict_box,
                    progress=bar,
                    pass_at=self.cfg.eval.pass_at,
                )
            except EngineDied as exc:  # raised on every rank: run_held_out_eval agrees on failures
                self.engine_died(exc)

    def evaluate_at_start(self) -> None:
        """The held-out accuracy before DAPO (eval.at_start), unless the run resumes past step 0."""
        if self.cfg.eval.at_start and self.state.step == 0 and self.parts.eval_set:
            scores = self.held_out(0)
            self.write(0, scores)
            log.info(
                "held-out accuracy before DAPO: %.1f%% (avg@%d)", 100 * scores["eval/avg_at_k"], self.eval_params.n
            )
        self.stop_if_requested()

    # --- Algorithm 1 -------------------------------------------------------------------------------
    def step(self, step: int) -> None:
        """One iteration of Algorithm 1: dynamic-sampling rollouts, the DAPO updates, the weights to the engine."""
        p, step_start = self.parts, time.perf_counter()
        # Where this step starts: a step abandoned after its rollouts is checkpointed as not begun.
        before_step = LoopPosition.of(p.sampler, p.builder)
        # Lines 3-8: generate, score and filter groups until the batch is full.
        return_cached_memory(self.dist)  # the engine takes its memory back: the trainer's cached blocks first
        self.engine_call("resume", p.engine.resume_memory, before_step)
        batch = self.rollouts(step, before_step)
        # Colocated: the KV cache makes room for training activations.
        self.engine_call("release", p.engine.release_memory, before_step)
        self.stop_if_requested(before_step)
        # Lines 9-12: advantages, then the DAPO loss over each mini-batch and an AdamW step.
        record = self.train(step, batch)
        self.stop_after_nonfinite_updates(step, record, step_start)
        # The new policy into the engine for the next step's rollouts.
        sync_start = time.perf_counter()
        return_cached_memory(self.dist)  # the first bucket maps the engine's weights back
        try:
            self.sync_weights()
        except EngineDied:  # the step is done and checkpointed: a resume does not redo it, so log it now
            record.times.step = time.perf_counter() - step_start
            self.write(step, record.row())
            raise
        record.times.sync = time.perf_counter() - sync_start
        record.times.step = time.perf_counter() - step_start
        self.after_step(step, record)

    def rollouts(self, step: int, before_step: LoopPosition) -> RolloutBatch:
        """Generation rounds until the batch is full; a failure checkpoints the step before and stops."""
        p = self.parts
        try:
            with self.progress(p.builder.train_batch_size, f"step {step} rollout", "groups") as bar:
                return p.rollout.collect(step, progress=bar, stop_requested=lambda: self.stop.requested(self.dist))
        except EngineDied as exc:
            self.engine_died(exc, before_step)
        except RoundStopped:
            self.stop_with_checkpoint(StopRequested(self.stop.signal_name or "a signal", self.state.step), before_step)
        except EngineFailure as exc:
            self.stop_with_checkpoint(
                RuntimeError(
                    f"step {step}: {exc}; the retry failed too. Checkpoint of step {self.state.step} saved; rerun the "
                    f"same command to resume"
                ),
                before_step,
                cause=exc,
            )
        except RolloutError as exc:  # a shortfall under on_shortfall = "raise", or a scoring error
            self.stop_with_checkpoint(
                RuntimeError(
                    f"{exc}. Checkpoint of step {self.state.step} saved; rerun to resume (with the cause fixed)"
                ),
                before_step,
                cause=exc,
            )

    def train(self, step: int, batch: RolloutBatch) -> StepRecord:
        """The step's updates on this rank's groups; the step is then done. Returns its record so far, its
        metrics combined over every rank."""
        train_start = time.perf_counter()
        with self.progress(None, f"step {step} train", "micro-batches") as bar:
            trained = self.parts.update.run(step, batch.groups, progress=bar)
        seconds = time.perf_counter() - train_start
        self.state.step = step
        record = StepRecord(batch.metrics, trained, StepTimes(train=seconds))
        record.reduce(self.dist)
        self.state.tokens += int(trained.train_tokens.result())
        record.mfu = training_mfu(
            self.parts.policy.args,
            batch.groups,
            seconds,
            self.dist,
            ppo_epochs=self.cfg.training.ppo_epochs,
            metrics=self.cfg.metrics,
        )
        return record

    def stop_after_nonfinite_updates(self, step: int, record: StepRecord, step_start: float) -> None:
        """Too many non-finite updates in a row: write the step's row, checkpoint it and stop."""
        skipped = self.state.skipped.in_a_row
        if skipped >= self.cfg.training.max_nonfinite_steps:
            record.times.step = time.perf_counter() - step_start
            self.write(step, record.row())
            self.stop_with_checkpoint(
                RuntimeError(f"{skipped} non-finite updates in a row at step {step}; checkpoint saved, stopping")
            )

    def after_step(self, step: int, record: StepRecord) -> None:
        """The step's held-out evaluation (every eval.interval steps), its metrics row, its interval checkpoint,
        and a stop when one was asked for."""
        ev = self.cfg.eval
        last = step == self.cfg.training.steps
        due = ev.interval and step % ev.interval == 0 and not (last and ev.at_end)
        if due and self.parts.eval_set:
            eval_start = time.perf_counter()
            record.eval = self.held_out(step)
            record.times.eval = time.perf_counter() - eval_start
        self.write(step, record.row())
        self.runner.end_of_step(step, self.extra())

    # --- The end -----------------------------------------------------------------------------------
    def finish(self) -> None:
        """Held-out accuracy, the last checkpoint, the HF export, the plot; the run marked finished."""
        cfg, p, step = self.cfg, self.parts, self.state.step
        if cfg.eval.at_end and p.eval_set:
            scores = self.held_out(step)
            self.write(step, scores)
            log.info("held-out accuracy after DAPO: %.1f%% (avg@%d)", 100 * scores["eval/avg_at_k"], self.eval_params.n)
        if cfg.checkpoint.enabled:
            self.save_checkpoint()  # no-op when the last step's interval checkpoint exists
        self.stop_if_requested(save=False)
        if cfg.checkpoint.export_hf:
            export_hf(p.policy, f"{p.run_path}/hf")
            if self.dist.is_main:
                complete_hf_export(f"{p.run_path}/hf", p.tokenizer, model_source=cfg.model.hf_path or None)
        assert self.metrics is not None
        self.metrics.close(plot=cfg.metrics.plot)
        if self.dist.is_main:
            mark_finished(p.run_path, step)

    def close(self) -> None:
        """On every way out: the signal handlers restored, the rollout engine shut down, the run folder released."""
        try:
            self.stop.restore()
            self.parts.engine.shutdown()
        finally:
            if self.parts.lock is not None:
                self.parts.lock.release()
