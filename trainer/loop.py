"""The DAPO trainer: one iteration of Algorithm 1 (`StepPhases.step`, which `Trainer` runs) over the components
train.py built once (trainer/build.py), and the phases around the loop (resume, warm-up, evaluation, the end).

The rollout engine is the run's guarded one (run/guard.py GuardedEngine): each call runs on every rank, the ranks
agree on how it went, and a failure on any of them checkpoints the last completed step and stops every rank
(an engine whose process died or hung included: the policy lives in the trainer's process and is intact); a
signal stops the run at the next phase boundary with a checkpoint. The warm-up and the loop run under a phase runner
(run/phase_runner.py: resume, interval checkpoints, stops). Every way out of a run goes through
`Trainer.close`: the rollout engine is shut down, the signal handlers restored, the run folder released, and
the row of a step that completed but was not logged yet is written.
"""

from __future__ import annotations

import abc
import logging
import time
from typing import TYPE_CHECKING, Any

from checkpoint.hf_export import export_hf
from checkpoint.manager import CheckpointManager
from config import Config
from errors import RunStopped
from evaluation.evaluate import params_from_config
from evaluation.held_out import discard_reports_after, run_held_out_eval
from evaluation.report import flat_metrics, read_report
from model.hf import complete_hf_export
from parallel.device_memory import return_cached_memory
from rollout.weight_sync import sync_weights
from run.folder import WARMUP_CHECKPOINTS, mark_finished
from run.guard import GuardedEngine
from run.phase_runner import Checkpointed, PhaseRunner
from run.signals import GracefulStop
from trainer.build import Components
from trainer.observers import RolloutWatch, TrainWatch, display_for
from trainer.rollout_dump import rollout_dump
from trainer.rollout_phase import RolloutPhase
from trainer.state import LoopPosition, TrainState
from trainer.step_metrics import MetricsWriter, StepRecord, StepTimes, training_mfu
from trainer.types import RolloutGroup
from trainer.update import TrainPhase
from trainer.warmup import SFTWarmup, discard_warmup_checkpoints

if TYPE_CHECKING:
    from model.qwen2 import Qwen2
    from parallel.dist_env import DistEnv

log = logging.getLogger("train")


class StepPhases(abc.ABC):
    """One step's phases in the order that sharing the GPUs with the engine requires: the engine takes its
    memory back (the trainer's cached blocks handed back first), generates and frees its KV cache for
    training; the trainer trains; the new weights go into the engine. `Trainer` runs them; the rehearsal
    (preflight/rehearsal.py) runs the same sequence over stand-ins and measures each phase. The engine is the
    run's guarded one (run/guard.py): its calls run on every rank and stop every rank on a failure."""

    engine: GuardedEngine
    policy: Qwen2
    dist: DistEnv
    bucket_bytes: int  # of the weight sync (rollout.weight_sync_bucket_mb)

    def step(self, step: int) -> None:
        """One iteration of Algorithm 1: dynamic-sampling rollouts, the DAPO updates, the weights to the engine."""
        times = StepTimes()  # the step's clock
        groups = self.rollouts(step)  # lines 3-8
        record = self.train(step, groups, times)  # lines 9-12
        self.sync_weights()  # the new policy into the engine
        self.after_step(step, record)

    def rollouts(self, step: int) -> list[RolloutGroup]:
        """Lines 3-8 with the engine's memory around them: taken back to generate, released for training."""
        self.resume_engine()
        groups = self.collect_batch(step)  # generate, score, filter until the batch is full
        self.release_engine()  # room for training
        return groups

    def resume_engine(self) -> None:
        return_cached_memory(self.dist)
        self.engine.resume_memory()

    def release_engine(self) -> None:
        self.engine.release_memory()

    def sync_weights(self) -> None:
        """The policy's weights into the engine, in place (the first bucket maps the engine's weights back)."""
        return_cached_memory(self.dist)
        sync_weights(self.policy, self.engine, bucket_bytes=self.bucket_bytes)

    # What a subclass supplies: the Trainer's real phases, the rehearsal's measured stand-ins.
    @abc.abstractmethod
    def collect_batch(self, step: int) -> list[RolloutGroup]: ...

    @abc.abstractmethod
    def train(self, step: int, groups: list[RolloutGroup], times: StepTimes) -> StepRecord: ...

    @abc.abstractmethod
    def after_step(self, step: int, record: StepRecord) -> None: ...


class Trainer(StepPhases):
    """Algorithm 1 over built components; `state` is what a checkpoint records of the loop."""

    def __init__(self, cfg: Config, parts: Components):
        """The loop's state and runner, then the phases of a step around the built components: the guarded
        engine (its failures checkpointed through the runner, its polls shown by the rollout phase's display)."""
        self.cfg, self.parts, self.dist, self.policy = cfg, parts, parts.dist, parts.policy
        self.bucket_bytes = cfg.rollout.weight_sync_bucket_mb << 20
        self.position = parts.sampler.state_dict(), parts.builder.state_dict()  # the data's, as of the last step
        self.stop = GracefulStop()  # listening from `resume` on
        checkpoints = CheckpointManager(f"{parts.run_path}/checkpoints", keep=cfg.checkpoint.keep_latest_k)
        saved = Checkpointed(parts.policy, parts.optimizer, parts.scheduler, lambda: self.state.step, self.extra)
        interval = cfg.checkpoint.interval if cfg.checkpoint.enabled else 0
        self.runner = PhaseRunner(checkpoints, saved, self.stop, self.dist, interval=interval)
        self.display = display_for(cfg.metrics, self.dist)
        rollout_watch = RolloutWatch(parts.builder, self.display, parts.scorer.metric_names)
        hang_after_s = cfg.rollout.call_timeout_s  # the progress window (the same key: each call's deadline)
        self.engine = GuardedEngine(
            parts.engine, self.dist, self.runner, hang_after_s=hang_after_s, on_poll=rollout_watch.polled
        )
        data = (parts.sampler, parts.builder, parts.tokenizer, self.dist.dp_rank)
        self.rollout = RolloutPhase(cfg, self.engine, *data, rollout_watch, parts.scorer)
        train_watch = TrainWatch(self.display, rollout_dump(cfg, parts.run_path, parts.tokenizer, self.dist))
        self.update = TrainPhase(cfg, parts.policy, parts.optimizer, parts.scheduler, self.dist, train_watch)
        self.state = TrainState(skipped=self.update.optimizer_step.skipped)
        self.metrics: MetricsWriter | None = None
        self.unlogged: tuple[int, StepRecord] | None = None  # a completed step whose row is not written yet
        self.eval_params = params_from_config(cfg, parts.tokenizer.stop_ids, seed=cfg.job.seed)

    # --- Algorithm 1 (the sequence: StepPhases.step) -------------------------------------------------
    def collect_batch(self, step: int) -> list[RolloutGroup]:
        """Lines 3-8 on this rank (trainer/rollout_phase.py). A failure of this rank's own (its scoring, or a short
        batch under algorithm.on_shortfall = "raise") is agreed on by every rank."""
        with self.engine.failures_agreed(f"step {step}, rollout"):
            return self.rollout.collect_batch(step)

    def train(self, step: int, groups: list[RolloutGroup], times: StepTimes) -> StepRecord:
        """Lines 9-12 on this rank's groups; the step is then done. Its record so far, over every rank."""
        times.lap()  # the rollout phase's time is in its metrics
        trained = self.update.run(step, groups)
        times.train = times.lap()
        self.state.step, self.position = step, (self.parts.sampler.state_dict(), self.parts.builder.state_dict())
        return self.step_record(step, groups, StepRecord(self.rollout.watch.metrics, trained, times))

    def step_record(self, step: int, groups: list[RolloutGroup], record: StepRecord) -> StepRecord:
        """The record of a completed step over every rank (one all-reduce per kind), with its MFU, kept as the
        row to write should the run stop before `after_step` writes it; the run's token count advanced."""
        self.unlogged = step, record
        record.reduce(self.dist)
        self.state.tokens += int(record.train.train_tokens.result())
        cfg = self.cfg
        args = (self.parts.policy.args, groups, record.times.train, self.dist)
        record.mfu = training_mfu(*args, ppo_epochs=cfg.training.ppo_epochs, metrics=cfg.metrics)
        return record

    # --- Checkpoints, metrics, evaluation ----------------------------------------------------------
    def extra(self) -> dict[str, Any]:
        """The loop's state and the data's position after the last completed step, as plain data for a
        checkpoint (one taken during a step's rollouts saves that step as not begun)."""
        return {**self.state.state_dict(), **LoopPosition.of(*self.position).plain()}

    def write(self, step: int, row: dict[str, Any]) -> None:
        assert self.metrics is not None, "resume() opens metrics.jsonl"
        self.metrics.write(step, row)

    def held_out(self, step: int) -> dict[str, float]:
        """Held-out accuracy (avg@k, pass@k) of the engine's current weights."""
        p, alg, ev = self.parts, self.cfg.algorithm, self.cfg.eval
        args = (self.engine, p.eval_set, p.tokenizer, self.eval_params, self.dist, p.run_path, step, p.scorer)
        problems = -(-len(p.eval_set) // self.dist.dp_size)
        with self.display(problems, f"eval at step {step}", "problems") as bar:
            with self.engine.failures_agreed(f"the evaluation at step {step}"):
                return run_held_out_eval(*args, strict_box=alg.strict_box, pass_at=ev.pass_at, progress=bar)

    # --- Around the loop ---------------------------------------------------------------------------
    def resume(self) -> None:
        """Load the latest checkpoint (if resuming), then open metrics.jsonl and start listening for signals."""
        p = self.parts
        saved = self.runner.resume() if self.cfg.checkpoint.resume else None
        if saved is not None:
            LoopPosition.pop_from(saved).restore(p.sampler, p.builder)
            self.state.load_state_dict(saved)
            self.position = p.sampler.state_dict(), p.builder.state_dict()
            log.info("resumed from step %d", self.state.step)
            with self.engine.failures_agreed("resume"):
                self.sync_weights()
        self.resumed_at = self.state.step  # an evaluation report of this step is of the weights resumed
        if self.dist.is_main:
            discard_reports_after(p.run_path, self.state.step)
        # Rows past the checkpoint are redone; so is the step-0 evaluation when the run restarts at step 0.
        self.metrics = MetricsWriter(
            p.run_path, self.cfg.metrics, rank=self.dist.rank, resumed_step=self.state.step or -1
        )
        # A first SIGTERM / SIGINT asks for a checkpoint at the next phase boundary, from here to the end.
        self.stop.install()

    def warm_up(self) -> None:
        """Supervised warm-up (demo models start from random weights), checkpointed as step 0."""
        cfg, p, training = self.cfg, self.parts, self.cfg.training
        if not training.sft_warmup_steps or self.state.sft_done:
            return
        start = time.perf_counter()
        warm = SFTWarmup(training, cfg.optimizer, p.policy, p.train_set, p.tokenizer, self.dist, seed=cfg.job.seed)
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
        with self.display(training.sft_warmup_steps, "warm-up", "steps") as bar:
            warm.run(
                runner,
                resume=cfg.checkpoint.resume,
                progress=bar,
                on_log=lambda step, loss: log.info("sft step %d: loss %.4f", step, loss),
            )
        self.state.sft_done = True
        if cfg.checkpoint.enabled:  # the warm-up's end, as step 0: a rerun goes on from here
            self.runner.save()
        discard_warmup_checkpoints(checkpoints, self.dist.is_main)
        with self.engine.failures_agreed("the weight sync after the warm-up"):
            self.sync_weights()
        log.info("supervised warm-up: %d steps in %.1fs", training.sft_warmup_steps, time.perf_counter() - start)

    def evaluate_at_start(self) -> None:
        """The held-out accuracy before DAPO (eval.at_start), unless the run resumes past step 0."""
        if self.cfg.eval.at_start and self.state.step == 0 and self.parts.eval_set:
            scores = self.held_out(0)
            self.write(0, scores)
            log.info(
                "held-out accuracy before DAPO: %.1f%% (avg@%d)", 100 * scores["eval/avg_at_k"], self.eval_params.n
            )
        self.runner.stop_if_requested()

    def after_step(self, step: int, record: StepRecord) -> None:
        """The step's held-out evaluation (every eval.interval steps), its metrics row, its interval checkpoint,
        and a stop when one was asked for or too many updates in a row were skipped."""
        record.times.sync = record.times.lap()
        ev = self.cfg.eval
        last = step == self.cfg.training.steps
        due = ev.interval and step % ev.interval == 0 and not (last and ev.at_end)
        if due and self.parts.eval_set:
            eval_start = time.perf_counter()
            record.eval = self.held_out(step)
            record.times.eval = time.perf_counter() - eval_start
        self.write(step, record.row())
        self.unlogged = None
        self.runner.end_of_step()
        skipped = self.state.skipped.in_a_row
        if skipped >= self.cfg.training.max_nonfinite_steps:
            saved = self.runner.checkpoints.step_path(step)  # the updates were skipped: its weights are finite
            self.runner.stop_with_checkpoint(
                RunStopped(f"{skipped} non-finite updates in a row at step {step}; checkpoint saved: {saved}")
            )

    def finish(self) -> None:
        """Held-out accuracy, the last checkpoint, the HF export; the run marked finished."""
        cfg, p, step = self.cfg, self.parts, self.state.step
        scores = self.final_evaluation(step) if cfg.eval.at_end and p.eval_set else None
        self.stop.only_the_end_left()  # a signal from here on stops nothing; one during the evaluation still does
        if scores is not None:
            label = "after DAPO" if step else "with no DAPO step (training.steps = 0)"
            log.info("held-out accuracy %s: %.1f%% (avg@%d)", label, 100 * scores["eval/avg_at_k"], self.eval_params.n)
        self.runner.stop_if_requested()
        if cfg.checkpoint.enabled:
            self.runner.save()  # no-op when the last step's interval checkpoint exists
        if cfg.checkpoint.export_hf:
            export_hf(p.policy, f"{p.run_path}/hf")
            if self.dist.is_main:
                complete_hf_export(f"{p.run_path}/hf", p.tokenizer, model_source=cfg.model.hf_path or None)
        assert self.metrics is not None
        self.metrics.close()
        if self.dist.is_main:
            mark_finished(p.run_path, step)

    def final_evaluation(self, step: int) -> dict[str, float]:
        """The held-out evaluation after the last step, run and logged once: the rerun of a finish that was
        stopped or killed takes the report already written (eval/step_N.json) and its metrics row, when it
        resumed at that step: a report of a step this launch trained again is of other weights."""
        report = read_report(f"{self.parts.run_path}/eval/step_{step:06d}.json") if step == self.resumed_at else None
        missing = self.dist.all_reduce([report is None], "max", "world")[0]  # on any rank: all evaluate together
        scores = self.held_out(step) if missing or report is None else flat_metrics(report)
        assert self.metrics is not None
        if not self.metrics.logger.logged(step, "eval/avg_at_k"):
            self.write(step, scores)
        return scores

    def close(self) -> None:
        """On every way out: a completed step's row written (its checkpoint holds it: a resume does not redo it),
        the signal handlers restored, the rollout engine shut down, the run folder released."""
        try:
            if self.unlogged is not None:
                step, record = self.unlogged
                self.write(step, record.row())
            self.stop.restore()
            self.parts.scorer.close()  # the reward's worker processes, if any
            self.engine.shutdown()
        finally:
            if self.parts.lock is not None:
                self.parts.lock.release()
