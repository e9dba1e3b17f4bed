"""The DAPO trainer: its components built once (`build`), its position (`TrainState`), one iteration of
Algorithm 1 (`Trainer.step`), and the phases around the loop (resume, warm-up, evaluation, the end).

Every way out of a run goes through `Trainer.close`: the rollout engine is shut down and the signal
handlers restored, also when a step fails. Every stop after the first step's data went out checkpoints
the last completed step first (`Trainer.stop_with_checkpoint`), so a rerun of the same command resumes.
That includes the death of an engine's process (EngineDied, rollout/engine_process.py): the policy lives
in the trainer's process and is intact, so every rank checkpoints and stops (`Trainer.engine_died`).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import NoReturn

import torch

from config import Config, config_to_dict
from errors import ConfigError
from evaluation.evaluate import params_from_config
from evaluation.held_out import run_held_out_eval
from model.hf import complete_hf_export
from model.tokenizer import Tokenizer
from observe.progress import Progress
from parallel.checkpoint import CheckpointManager
from parallel.device_memory import return_cached_memory
from parallel.dist_env import DistEnv
from parallel.finite import NonFiniteStateError
from parallel.hf_export import export_hf
from rl.data import PromptExample, PromptSampler
from rl.filter import DynamicBatchBuilder
from rollout.engine import Engine, EngineDied, EngineFailure, SamplingParams
from rollout.weight_sync import sync_weights
from trainer.rollout_phase import RolloutError, RoundStopped, collect_batch, prompts_per_call
from trainer.run_folder import WARMUP_CHECKPOINTS, mark_finished, prepare_run_folder, run_folder_path
from trainer.run_lock import FolderLock
from trainer.scoring import RewardSettings
from trainer.setup import build_policy_and_engine, build_tokenizer, load_datasets
from trainer.signals import GracefulStop, StopRequested
from trainer.state import loop_position, restore_loop_position
from trainer.step_metrics import MetricsWriter, rollout_metrics, training_mfu
from trainer.update import TrainPhase
from trainer.warmup import discard_warmup_checkpoints, sft_warmup

log = logging.getLogger("train")


@dataclasses.dataclass
class TrainState:
    """Where the run stands: checkpointed with every step, beside the data position (trainer/state.py)."""

    step: int = 0  # the last completed DAPO step
    sft_done: bool = False  # the supervised warm-up has run (it is not repeated on resume)
    tokens: int = 0  # response tokens trained on so far
    nonfinite_in_a_row: int = 0  # updates skipped in a row for a non-finite loss, across restarts

    def state_dict(self) -> dict:
        return dataclasses.asdict(self)

    def load_state_dict(self, saved: dict) -> None:
        for field in dataclasses.fields(self):
            if field.name in saved:
                setattr(self, field.name, saved[field.name])


@dataclasses.dataclass
class Components:
    """What a run is built from, in `build`'s order."""

    dist: DistEnv
    run_path: str
    tokenizer: Tokenizer
    train_set: list[PromptExample]
    eval_set: list[PromptExample]
    sampler: PromptSampler
    policy: torch.nn.Module
    engine: Engine
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    builder: DynamicBatchBuilder
    phase: TrainPhase
    lock: FolderLock | None = None  # the main rank's lock on the run folder


def build(cfg: Config, dist: DistEnv, *, fresh: bool) -> Components:
    """Run folder (locked by the main rank until `Trainer.close`), tokenizer and data, then the policy, the
    rollout engine, the optimizer and its schedule."""
    lock = FolderLock(run_folder_path(cfg.job.run_dir, cfg.job.name)) if dist.is_main else None
    try:
        parts = _build(cfg, dist, fresh, lock)
    except BaseException:
        if lock is not None:
            lock.release()
        raise
    parts.lock = lock
    return parts


def _build(cfg: Config, dist: DistEnv, fresh: bool, lock: FolderLock | None) -> Components:
    run_path = prepare_run_folder(
        cfg.job.run_dir,
        cfg.job.name,
        config_to_dict(cfg),
        is_main=dist.is_main,
        resume=cfg.checkpoint.resume,
        fresh=fresh,
        lock=lock,
    )
    dist.barrier()
    tokenizer = build_tokenizer(cfg.model, cfg.data, run_path, is_main=dist.is_main, barrier=dist.barrier)
    train_set, eval_set = load_datasets(cfg.data, tokenizer, eval_size=cfg.eval.eval_size)
    if cfg.training.sft_warmup_steps and not any(e.solution for e in train_set):
        raise ConfigError(
            f"training.sft_warmup_steps = {cfg.training.sft_warmup_steps} needs worked solutions "
            f"(extra_info.solution), and none of the {len(train_set)} prompts of data.train_path = "
            f"{cfg.data.train_path!r} has one: set training.sft_warmup_steps = 0 for this data set"
        )
    sampler = PromptSampler(
        train_set, seed=cfg.data.seed, shuffle=cfg.data.shuffle, dp_rank=dist.dp_rank, dp_size=dist.dp_size
    )
    log.info("run folder %s: %d training prompts, %d held-out prompts", run_path, len(train_set), len(eval_set))

    policy, engine = build_policy_and_engine(cfg, dist)
    opt = cfg.optimizer
    optimizer = torch.optim.AdamW(
        policy.parameters(), lr=opt.lr, betas=tuple(opt.betas), eps=opt.eps, weight_decay=opt.weight_decay
    )
    # Linear warm-up over the first `warmup_steps` rollout steps that update the policy (trainer/update.py),
    # then constant (the paper's schedule).
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / max(1, opt.warmup_steps)))
    alg = cfg.algorithm
    builder = DynamicBatchBuilder(
        cfg.training.train_batch_size // dist.dp_size,
        alg.max_num_gen_batches,
        on_shortfall=alg.on_shortfall,
        max_staleness=alg.carry_over_max_staleness,
        enabled=alg.dynamic_sampling,
        metric=alg.filter_metric,
    )
    phase = TrainPhase.from_config(policy, optimizer, scheduler, cfg, dist, dist.device)
    return Components(
        dist, run_path, tokenizer, train_set, eval_set, sampler, policy, engine, optimizer, scheduler, builder, phase
    )


class Trainer:
    """Algorithm 1 over built components; `state` is what a checkpoint records of the loop."""

    def __init__(self, cfg: Config, parts: Components):
        self.cfg, self.parts, self.dist = cfg, parts, parts.dist
        self.state = TrainState()
        self.checkpoints = CheckpointManager(f"{parts.run_path}/checkpoints", keep=cfg.checkpoint.keep_latest_k)
        self.metrics: MetricsWriter | None = None
        self.stop: GracefulStop | None = None
        self.eval_params = params_from_config(cfg, parts.tokenizer.stop_ids, seed=cfg.job.seed)
        rollout, alg = cfg.rollout, cfg.algorithm
        self.rollout_params = SamplingParams(
            max_new_tokens=rollout.max_response_length,
            temperature=rollout.temperature,
            top_p=rollout.top_p,
            top_k=rollout.top_k,
            n=rollout.n,
            stop_token_ids=parts.tokenizer.stop_ids,
            seed=cfg.job.seed,
        )
        self.reward = RewardSettings(
            rollout.max_response_length,
            alg.overlong_penalty,
            alg.overlong_buffer,
            alg.overlong_penalty_factor,
            alg.strict_box,
        )
        multiplier = rollout.gen_batch_multiplier if alg.dynamic_sampling else 1
        self.prompts_per_round = cfg.training.train_batch_size * multiplier
        ranks_per_engine = rollout.tp_size if rollout.engine == "sglang" else 1
        self.prompts_per_call = prompts_per_call(rollout.requests_per_call, rollout.n, ranks_per_engine)

    # --- Checkpoints, stops, weights ---------------------------------------------------------------
    def save_checkpoint(self, position: dict | None = None) -> None:
        """Checkpoint the last completed step (`position`: the data state it ended with)."""
        if self.state.step in self.checkpoints.complete_steps():
            return
        p = self.parts
        position = position or loop_position(p.sampler, p.builder)
        self.checkpoints.save(
            self.state.step, p.policy, p.optimizer, p.scheduler, dict(self.state.state_dict(), **position)
        )

    def stop_with_checkpoint(
        self, error: Exception, position: dict | None = None, *, save: bool = True, cause: BaseException | None = None
    ) -> NoReturn:
        """Checkpoint the last completed step (at data `position`, default: now), then raise `error`."""
        if save:
            try:
                self.save_checkpoint(position)
            except NonFiniteStateError as refused:  # a NaN policy is not saved: the refusal is the error
                raise refused from error
        raise error from cause

    def stop_if_requested(self, position: dict | None = None, *, save: bool = True) -> None:
        """At a phase boundary: after a first SIGTERM / SIGINT on any rank, checkpoint and stop."""
        if self.stop.requested(self.dist):
            self.stop_with_checkpoint(StopRequested(self.stop.signal_name, self.state.step), position, save=save)

    def engine_died(self, exc: EngineDied, position: dict | None = None) -> NoReturn:
        """An engine's process is gone; the policy, in this process, is intact: checkpoint the last completed
        step (at data `position`, default: now) and stop with EngineDied on every rank."""
        self.stop_with_checkpoint(
            EngineDied(f"{exc}. Checkpoint of step {self.state.step} saved; rerun the same command to resume"),
            position,
            cause=exc,
        )

    def engine_call(self, what: str, fn, position: dict | None = None) -> None:
        """fn(), a call into the rollout engine, on every rank; then all ranks agree (one all-reduce on the
        gloo control group) on how it went. If it failed on any rank, every rank checkpoints (the policy is
        intact) and stops: with EngineDied when an engine's process died, else with the engine's error."""
        error = None
        try:
            fn()
        except Exception as exc:
            error = exc
        status = 2.0 if isinstance(error, EngineDied) else 1.0 if error is not None else 0.0
        worst = self.dist.all_reduce([status], op="max", group="world")[0]
        if worst == 2.0:
            died = error if isinstance(error, EngineDied) else None
            self.engine_died(died or EngineDied(f"the rollout engine of another rank died during {what}"), position)
        if worst == 1.0:
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

    def progress(self, total, desc: str, unit: str) -> Progress:
        return Progress(
            total=total, desc=desc, unit=unit, enabled=self.cfg.metrics.progress and self.dist.is_main, leave=False
        )

    # --- Before the loop ---------------------------------------------------------------------------
    def resume(self) -> None:
        """Load the latest checkpoint (if resuming), then open metrics.jsonl and start listening for signals."""
        p = self.parts
        saved = self.checkpoints.resume(p.policy, p.optimizer, p.scheduler) if self.cfg.checkpoint.resume else None
        if saved is not None:
            restore_loop_position(saved, p.sampler, p.builder)
            self.state.load_state_dict(saved)
            p.phase.nonfinite_in_a_row = self.state.nonfinite_in_a_row  # "in a row" spans the restart
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
        self.stop = GracefulStop().install()

    def warm_up(self) -> None:
        """Supervised warm-up (demo models start from random weights), checkpointed as step 0."""
        cfg, p, training = self.cfg, self.parts, self.cfg.training
        if not training.sft_warmup_steps or self.state.sft_done:
            return
        start = time.perf_counter()
        warmup_checkpoints = CheckpointManager(f"{p.run_path}/{WARMUP_CHECKPOINTS}", keep=1)
        with self.progress(training.sft_warmup_steps, "warm-up", "steps") as bar:
            sft_warmup(
                p.policy,
                p.train_set,
                p.tokenizer,
                steps=training.sft_warmup_steps,
                batch_size=training.sft_batch_size,
                lr=training.sft_lr,
                micro_batch_tokens=training.micro_batch_tokens,
                dist_env=self.dist,
                device=self.dist.device,
                seed=cfg.job.seed,
                on_log=lambda step, loss: log.info("sft step %d: loss %.4f", step, loss),
                progress=bar,
                checkpoints=warmup_checkpoints,
                resume=cfg.checkpoint.resume,
                interval=cfg.checkpoint.warmup_interval if cfg.checkpoint.enabled else 0,
                stop=self.stop,
            )
        self.state.sft_done = True
        if cfg.checkpoint.enabled:  # the warm-up's end, as step 0: a rerun goes on from here
            self.save_checkpoint()
        discard_warmup_checkpoints(warmup_checkpoints, self.dist.is_main)
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
            self.metrics.write(0, scores)
            log.info(
                "held-out accuracy before DAPO: %.1f%% (avg@%d)", 100 * scores["eval/avg_at_k"], self.eval_params.n
            )
        self.stop_if_requested()

    # --- Algorithm 1 -------------------------------------------------------------------------------
    def step(self, step: int) -> None:
        """One iteration of Algorithm 1: dynamic-sampling rollouts, the DAPO updates, the weights to the engine."""
        p, step_start = self.parts, time.perf_counter()
        # Where this step starts: a step abandoned after its rollouts is checkpointed as not begun.
        before_step = loop_position(p.sampler, p.builder)
        # Lines 3-8: generate, score and filter groups until the batch is full.
        return_cached_memory(self.dist)  # the engine takes its memory back: the trainer's cached blocks first
        self.engine_call("resume", p.engine.resume_memory, before_step)
        groups, filter_stats, seconds = self.rollouts(step, before_step)
        # Colocated: the KV cache makes room for training activations.
        self.engine_call("release", p.engine.release_memory, before_step)
        self.stop_if_requested(before_step)
        # Lines 9-12: advantages, then the DAPO loss over each mini-batch and an AdamW step.
        train_stats, seconds["train"] = self.train(step, groups)
        row = self.step_row(groups, filter_stats, train_stats, seconds)
        self.stop_after_nonfinite_updates(step, row, step_start)
        # The new policy into the engine for the next step's rollouts.
        sync_start = time.perf_counter()
        return_cached_memory(self.dist)  # the first bucket maps the engine's weights back
        try:
            self.sync_weights()
        except EngineDied:  # the step is done and checkpointed: a resume does not redo it, so log it now
            row["time/step"] = time.perf_counter() - step_start
            self.metrics.write(step, row)
            raise
        row["time/sync"] = time.perf_counter() - sync_start
        row["time/step"] = time.perf_counter() - step_start
        row["tokens_per_s"] = row["train_tokens"] / max(row["time/step"], 1e-9)
        self.after_step(step, row)

    def train(self, step: int, groups) -> tuple[dict[str, float], float]:
        """The step's updates on this rank's `groups`; (training metrics, seconds). The step is then done."""
        train_start = time.perf_counter()
        with self.progress(None, f"step {step} train", "micro-batches") as bar:
            train_stats = self.parts.phase.run(step, groups, progress=bar)
        train_seconds = time.perf_counter() - train_start
        self.state.step = step
        self.state.tokens += int(train_stats["train_tokens"])
        self.state.nonfinite_in_a_row = self.parts.phase.nonfinite_in_a_row
        return train_stats, train_seconds

    def step_row(self, groups, filter_stats: dict, train_stats: dict, seconds: dict[str, float]) -> dict:
        """The step's metrics row so far: rollout and training statistics, phase times, MFU."""
        row = rollout_metrics(groups, filter_stats, train_stats, self.dist, group_size=self.cfg.rollout.n)
        row.update({f"time/{phase}": seconds[phase] for phase in ("generate", "score", "train")})
        row.update(
            training_mfu(
                self.parts.policy.args,
                groups,
                seconds["train"],
                self.dist,
                ppo_epochs=self.cfg.training.ppo_epochs,
                metrics=self.cfg.metrics,
            )
        )
        return row

    def rollouts(self, step: int, before_step: dict):
        """Generation rounds until the batch is full; a failure checkpoints the step before and stops."""
        p = self.parts
        try:
            with self.progress(p.builder.train_batch_size, f"step {step} rollout", "groups") as bar:
                return collect_batch(
                    step,
                    p.builder,
                    p.engine,
                    p.sampler,
                    self.prompts_per_round,
                    self.rollout_params,
                    p.tokenizer,
                    self.reward,
                    self.dist,
                    progress=bar,
                    prompts_per_call=self.prompts_per_call,
                    stop_requested=lambda: self.stop.requested(self.dist),
                )
        except EngineDied as exc:
            self.engine_died(exc, before_step)
        except RoundStopped:
            self.stop_with_checkpoint(StopRequested(self.stop.signal_name, self.state.step), before_step)
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

    def stop_after_nonfinite_updates(self, step: int, row: dict, step_start: float) -> None:
        """Too many non-finite updates in a row: write the step's row, checkpoint it and stop."""
        skipped = self.parts.phase.nonfinite_in_a_row
        if skipped >= self.cfg.training.max_nonfinite_steps:
            row["time/step"] = time.perf_counter() - step_start
            self.metrics.write(step, row)
            self.stop_with_checkpoint(
                RuntimeError(f"{skipped} non-finite updates in a row at step {step}; checkpoint saved, stopping")
            )

    def after_step(self, step: int, row: dict) -> None:
        """The step's held-out evaluation (every eval.interval steps), its metrics row and checkpoint."""
        cfg = self.cfg
        last = step == cfg.training.steps
        due = cfg.eval.interval and step % cfg.eval.interval == 0 and not (last and cfg.eval.at_end)
        if due and self.parts.eval_set:
            eval_start = time.perf_counter()
            row.update(self.held_out(step))
            row["time/eval"] = time.perf_counter() - eval_start
        self.metrics.write(step, row)
        if cfg.checkpoint.enabled and step % cfg.checkpoint.interval == 0:
            self.save_checkpoint()
        self.stop_if_requested()

    # --- The end -----------------------------------------------------------------------------------
    def finish(self) -> None:
        """Held-out accuracy, the last checkpoint, the HF export, the plot; the run marked finished."""
        cfg, p, step = self.cfg, self.parts, self.state.step
        if cfg.eval.at_end and p.eval_set:
            scores = self.held_out(step)
            self.metrics.write(step, scores)
            log.info("held-out accuracy after DAPO: %.1f%% (avg@%d)", 100 * scores["eval/avg_at_k"], self.eval_params.n)
        if cfg.checkpoint.enabled:
            self.save_checkpoint()  # no-op when the last step's interval checkpoint exists
        self.stop_if_requested(save=False)
        if cfg.checkpoint.export_hf:
            export_hf(p.policy, f"{p.run_path}/hf")
            if self.dist.is_main:
                complete_hf_export(f"{p.run_path}/hf", p.tokenizer, model_source=cfg.model.hf_path or None)
        self.metrics.close(plot=cfg.metrics.plot)
        if self.dist.is_main:
            mark_finished(p.run_path, step)

    def close(self) -> None:
        """On every way out: the signal handlers restored, the rollout engine shut down, the run folder released."""
        try:
            if self.stop is not None:
                self.stop.restore()
            self.parts.engine.shutdown()
        finally:
            if self.parts.lock is not None:
                self.parts.lock.release()
