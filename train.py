"""DAPO training: Algorithm 1 of "DAPO: An Open-Source LLM Reinforcement Learning System at Scale"
(arXiv 2503.14476), top to bottom.

    python train.py --config configs/demo_cpu.toml                       # one CPU process
    torchrun --nproc_per_node=8 train.py --config configs/dapo_32b.toml  # one 8-GPU node
    python train.py --config X --dry-run                                 # print the resolved config
    python train.py --config X --rehearse                                # the run's per-GPU memory, on CPU

Algorithm 1, as this file runs it:
    for step = 1..M:
        repeat (at most max_num_gen_batches rounds)                      trainer/rollout_phase.py
            sample prompts; generate G responses each with the engine    rollout/
            reward = rule reward + soft overlong punishment (Eq. 13)     rl/reward.py
            keep groups with 0 < #correct < G (Eq. 11)                    rl/filter.py
        until train_batch_size groups are kept (surplus carried over)
        advantages A_i = (R_i - mean R) / (std R + eps) (Eq. 9)          rl/advantage.py
        for each mini-batch: DAPO loss (Eq. 8, 10), token-level mean      rl/loss.py, trainer/update.py
        push the new weights into the engine in place                    rollout/weight_sync.py
"""

from __future__ import annotations

import json
import logging
import sys
import time

import torch

from config import ConfigError, check_runnable, config_to_dict, parse_cli
from parallel.checkpoint import CheckpointError, CheckpointManager
from model.hf import complete_hf_export
from parallel.hf_export import export_hf
from rl.filter import DynamicBatchBuilder
from trainer.evaluation import params_from_config
from observe.progress import Progress
from rollout.engine import SamplingParams
from rollout.weight_sync import sync_weights
from trainer.distributed import init_distributed, shutdown_distributed
from trainer.evaluation import run_held_out_eval
from trainer.loop_state import loop_position, restore_loop_position
from trainer.memory import return_cached_memory
from trainer.rollout_phase import RolloutError, collect_batch
from trainer.run_folder import (WARMUP_CHECKPOINTS, RunFolderError, finished_run_report, mark_finished,
                                prepare_run_folder)
from trainer.scoring import EngineFailure, RewardSettings
from trainer.signals import GracefulStop, StopRequested
from trainer.setup import build_policy_and_engine, build_tokenizer, load_datasets
from trainer.sft import discard_warmup_checkpoints, sft_warmup
from trainer.step_metrics import MetricsWriter, rollout_metrics, training_mfu
from trainer.update import TrainPhase
from rl.data import DataError, PromptSampler

log = logging.getLogger("train")


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    argv = list(sys.argv[1:] if argv is None else argv)
    rehearse = "--rehearse" in argv
    cfg, cli = parse_cli([a for a in argv if a != "--rehearse"])
    if rehearse:
        from trainer.rehearsal import main as rehearse_main

        return rehearse_main(cfg)
    if cli.dry_run:
        print(json.dumps(config_to_dict(cfg), indent=2))
        return 0
    check_runnable(cfg)

    # --- Processes, run folder, data -------------------------------------------------------------
    dist = init_distributed(cfg.parallelism.dp_replicate, cfg.parallelism.dp_shard, cfg.parallelism.tp,
                            control_timeout_s=cfg.rollout.round_timeout_s)
    torch.manual_seed(cfg.job.seed)
    if cfg.job.cpu_threads:
        torch.set_num_threads(cfg.job.cpu_threads)
    report = (finished_run_report(cfg.job.run_dir, cfg.job.name, cfg.training.steps)
              if cfg.checkpoint.resume and not cli.fresh else None)
    if report is not None:  # rerunning a finished run: its result, and nothing else
        for line in report if dist.is_main else ():
            log.info(line)
        shutdown_distributed()
        return 0
    run_path = prepare_run_folder(cfg.job.run_dir, cfg.job.name, config_to_dict(cfg), is_main=dist.is_main,
                                  resume=cfg.checkpoint.resume, fresh=cli.fresh)
    dist.barrier()
    tokenizer = build_tokenizer(cfg, run_path, is_main=dist.is_main, barrier=dist.barrier)
    train_set, eval_set = load_datasets(cfg, tokenizer)
    if cfg.training.sft_warmup_steps and not any(e.solution for e in train_set):
        raise ConfigError(f"training.sft_warmup_steps = {cfg.training.sft_warmup_steps} needs worked solutions "
                          f"(extra_info.solution), and none of the {len(train_set)} prompts of data.train_path = "
                          f"{cfg.data.train_path!r} has one: set training.sft_warmup_steps = 0 for this data set")
    sampler = PromptSampler(train_set, seed=cfg.data.seed, shuffle=cfg.data.shuffle,
                            dp_rank=dist.dp_rank, dp_size=dist.dp_size)
    log.info("run folder %s: %d training prompts, %d held-out prompts", run_path, len(train_set), len(eval_set))

    # --- Policy, rollout engine, optimizer ---------------------------------------------------------
    policy, engine = build_policy_and_engine(cfg, dist)
    opt = cfg.optimizer
    optimizer = torch.optim.AdamW(policy.parameters(), lr=opt.lr, betas=tuple(opt.betas), eps=opt.eps,
                                  weight_decay=opt.weight_decay)
    # Linear warm-up over the first `warmup_steps` rollout steps that update the policy (trainer/update.py),
    # then constant (the paper's schedule).
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / max(1, opt.warmup_steps)))
    alg = cfg.algorithm
    builder = DynamicBatchBuilder(cfg.training.train_batch_size // dist.dp_size, alg.max_num_gen_batches,
                                  on_shortfall=alg.on_shortfall, max_staleness=alg.carry_over_max_staleness,
                                  enabled=alg.dynamic_sampling, metric=alg.filter_metric)
    trainer = TrainPhase(policy, optimizer, scheduler, cfg, dist, dist.device)

    # --- Resume ------------------------------------------------------------------------------------
    state = {"step": 0, "sft_done": False, "tokens": 0, "nonfinite_in_a_row": 0}
    checkpoints = CheckpointManager(f"{run_path}/checkpoints", keep=cfg.checkpoint.keep_latest_k)

    def save_checkpoint(position=None):
        """Checkpoint the last completed step (`position`: the data state it ended with)."""
        if state["step"] in checkpoints.complete_steps():
            return
        position = position or loop_position(sampler, builder)
        checkpoints.save(state["step"], policy, optimizer, scheduler, dict(state, **position))

    saved = checkpoints.resume(policy, optimizer, scheduler) if cfg.checkpoint.resume else None
    if saved is not None:
        restore_loop_position(saved, sampler, builder)
        state.update(saved)
        trainer.nonfinite_in_a_row = state["nonfinite_in_a_row"]  # "in a row" spans the restart
        log.info("resumed from step %d", state["step"])
        sync_weights(policy, engine, bucket_bytes=cfg.rollout.weight_sync_bucket_mb << 20)
    # Rows past the checkpoint are redone; so is the step-0 evaluation when the run restarts at step 0.
    metrics_out = MetricsWriter(run_path, cfg, rank=dist.rank,
                                resumed_step=state["step"] if state["step"] > 0 else -1)
    # A first SIGTERM / SIGINT asks for a checkpoint at the next phase boundary, from here to the end.
    stop = GracefulStop().install()

    def progress(total, desc, unit):
        return Progress(total=total, desc=desc, unit=unit, enabled=cfg.metrics.progress and dist.is_main,
                        leave=False)

    # --- Supervised warm-up (demo models start from random weights) --------------------------------
    if cfg.training.sft_warmup_steps and not state["sft_done"]:
        start = time.perf_counter()
        warmup_checkpoints = CheckpointManager(f"{run_path}/{WARMUP_CHECKPOINTS}", keep=1)
        with progress(cfg.training.sft_warmup_steps, "warm-up", "steps") as bar:
            sft_warmup(policy, train_set, tokenizer, steps=cfg.training.sft_warmup_steps,
                       batch_size=cfg.training.sft_batch_size, lr=cfg.training.sft_lr,
                       micro_batch_tokens=cfg.training.micro_batch_tokens, dist_env=dist, device=dist.device,
                       seed=cfg.job.seed, on_log=lambda s, l: log.info("sft step %d: loss %.4f", s, l),
                       progress=bar, checkpoints=warmup_checkpoints, resume=cfg.checkpoint.resume,
                       interval=cfg.checkpoint.warmup_interval if cfg.checkpoint.enabled else 0, stop=stop)
        sync_weights(policy, engine, bucket_bytes=cfg.rollout.weight_sync_bucket_mb << 20)
        state["sft_done"] = True
        if cfg.checkpoint.enabled:  # the warm-up's end, as step 0: a rerun goes on from here
            save_checkpoint()
        discard_warmup_checkpoints(warmup_checkpoints, dist.is_main)
        log.info("supervised warm-up: %d steps in %.1fs", cfg.training.sft_warmup_steps, time.perf_counter() - start)

    eval_params = params_from_config(cfg, tokenizer.stop_ids, seed=cfg.job.seed)

    def held_out(step):
        with progress(-(-len(eval_set) // dist.dp_size), f"eval at step {step}", "problems") as bar:
            return run_held_out_eval(engine, eval_set, tokenizer, eval_params, dist, run_path, step,
                                     strict_box=alg.strict_box, progress=bar, pass_at=cfg.eval.pass_at)

    if cfg.eval.at_start and state["step"] == 0 and eval_set:
        scores = held_out(0)
        metrics_out.write(0, scores)
        log.info("held-out accuracy before DAPO: %.1f%% (avg@%d)", 100 * scores["eval/avg_at_k"], eval_params.n)
    if stop.requested(dist):
        save_checkpoint()
        raise StopRequested(stop.signal_name, state["step"])

    # --- Algorithm 1 -------------------------------------------------------------------------------
    rollout_params = SamplingParams(
        max_new_tokens=cfg.rollout.max_response_length, temperature=cfg.rollout.temperature,
        top_p=cfg.rollout.top_p, top_k=cfg.rollout.top_k, n=cfg.rollout.n, stop_token_ids=tokenizer.stop_ids,
        seed=cfg.job.seed)
    reward = RewardSettings(cfg.rollout.max_response_length, alg.overlong_penalty, alg.overlong_buffer,
                            alg.overlong_penalty_factor, alg.strict_box)
    multiplier = cfg.rollout.gen_batch_multiplier if alg.dynamic_sampling else 1
    prompts_per_round = cfg.training.train_batch_size * multiplier
    for step in range(state["step"] + 1, cfg.training.steps + 1):
        step_start = time.perf_counter()
        # Where this step starts: a step abandoned after its rollouts is checkpointed as not begun.
        before_step = loop_position(sampler, builder)
        return_cached_memory(dist)  # the engine takes its memory back: the trainer's cached blocks first
        engine.resume_memory()
        try:
            with progress(builder.train_batch_size, f"step {step} rollout", "groups") as bar:
                groups, filter_stats, rollout_seconds = collect_batch(
                    step, builder, engine, sampler, prompts_per_round, rollout_params, tokenizer, reward, dist,
                    progress=bar)
        except EngineFailure as exc:
            save_checkpoint(before_step)
            raise RuntimeError(f"step {step}: {exc}; the retry failed too. Checkpoint of step {state['step']} "
                               f"saved; rerun the same command to resume") from exc
        except RolloutError as exc:  # a shortfall under on_shortfall = "raise", or a scoring error
            save_checkpoint(before_step)
            raise RuntimeError(f"{exc}. Checkpoint of step {state['step']} saved; rerun to resume "
                               f"(with the cause fixed)") from exc
        engine.release_memory()  # colocated: the KV cache makes room for training activations
        if stop.requested(dist):
            save_checkpoint(before_step)
            raise StopRequested(stop.signal_name, state["step"])

        train_start = time.perf_counter()
        with progress(None, f"step {step} train", "micro-batches") as bar:
            train_stats = trainer.run(step, groups, progress=bar)
        train_seconds = time.perf_counter() - train_start
        state["step"] = step
        state["tokens"] += int(train_stats["train_tokens"])
        state["nonfinite_in_a_row"] = trainer.nonfinite_in_a_row
        row = rollout_metrics(groups, filter_stats, train_stats, dist, cfg)
        row.update({"time/generate": rollout_seconds["generate"], "time/score": rollout_seconds["score"],
                    "time/train": train_seconds})
        row.update(training_mfu(policy.args, groups, cfg, train_seconds, dist))
        if trainer.nonfinite_in_a_row >= cfg.training.max_nonfinite_steps:
            row["time/step"] = time.perf_counter() - step_start
            metrics_out.write(step, row)
            save_checkpoint()
            raise RuntimeError(f"{trainer.nonfinite_in_a_row} non-finite updates in a row at step {step}; "
                               f"checkpoint saved, stopping")

        sync_start = time.perf_counter()
        return_cached_memory(dist)  # the first bucket maps the engine's weights back
        sync_weights(policy, engine, bucket_bytes=cfg.rollout.weight_sync_bucket_mb << 20)
        row["time/sync"] = time.perf_counter() - sync_start
        row["time/step"] = time.perf_counter() - step_start
        row["tokens_per_s"] = row["train_tokens"] / max(row["time/step"], 1e-9)
        last = step == cfg.training.steps
        if cfg.eval.interval and step % cfg.eval.interval == 0 and not (last and cfg.eval.at_end) and eval_set:
            eval_start = time.perf_counter()
            row.update(held_out(step))
            row["time/eval"] = time.perf_counter() - eval_start
        metrics_out.write(step, row)
        if cfg.checkpoint.enabled and step % cfg.checkpoint.interval == 0:
            save_checkpoint()
        if stop.requested(dist):
            save_checkpoint()
            raise StopRequested(stop.signal_name, step)

    # --- The end: held-out accuracy, checkpoint, HF export, plot -----------------------------------
    if cfg.eval.at_end and eval_set:
        scores = held_out(state["step"])
        metrics_out.write(state["step"], scores)
        log.info("held-out accuracy after DAPO: %.1f%% (avg@%d)", 100 * scores["eval/avg_at_k"], eval_params.n)
    if cfg.checkpoint.enabled:
        save_checkpoint()  # no-op when the last step's interval checkpoint exists
    if stop.requested(dist):
        raise StopRequested(stop.signal_name, state["step"])
    if cfg.checkpoint.export_hf:
        export_hf(policy, f"{run_path}/hf")
        if dist.is_main:
            complete_hf_export(f"{run_path}/hf", tokenizer, model_source=cfg.model.hf_path or None)
    metrics_out.close(plot=cfg.metrics.plot)
    stop.restore()
    if dist.is_main:
        mark_finished(run_path, state["step"])
    engine.shutdown()
    shutdown_distributed()
    return 0


def run_cli(argv=None):
    """`main` with the exits a shell expects: 2 for bad input, 143/130 after a signal, 1 for failures."""
    try:
        sys.exit(main(argv))
    except ConfigError as exc:
        print(f"configuration error: {exc}", file=sys.stderr)
        sys.exit(2)
    except (RunFolderError, CheckpointError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    except DataError as exc:
        print(f"data error: {exc}", file=sys.stderr)
        sys.exit(2)
    except StopRequested as exc:
        print(f"training {exc}; a checkpoint was saved: run the same command again to resume", file=sys.stderr)
        sys.exit(130 if exc.signal_name == "SIGINT" else 143)


if __name__ == "__main__":
    run_cli()
