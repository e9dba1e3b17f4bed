"""DAPO training: Algorithm 1 of "DAPO: An Open-Source LLM Reinforcement Learning System at Scale"
(arXiv 2503.14476), top to bottom.

    python train.py --config configs/demo_cpu.toml                       # one CPU process
    torchrun --nproc_per_node=8 train.py --config configs/dapo_32b.toml  # one 8-GPU node
    python train.py --config X --dry-run                                 # print the resolved config
    python train.py --config X --rehearse                                # the run's per-GPU memory, on CPU

Algorithm 1, as this file runs it (one iteration: trainer/loop.py, StepPhases.step):
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

import torch

from config import config_to_dict, parse_cli
from parallel.cpu_threads import set_intra_op_threads
from parallel.dist_env import init_distributed, shutdown_distributed
from preflight.checks import check_runnable
from preflight.hub_inputs import fetch_training_inputs
from run.folder import accept_launch, discard_refused_launch, finished_run_report
from run.signals import NothingToStop, exit_with_codes
from trainer.build import build
from trainer.loop import Trainer

log = logging.getLogger("train")


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    cfg, cli = parse_cli(argv)
    if cli.rehearse:
        from preflight.rehearsal import main as rehearse_main

        return rehearse_main(cfg)
    if cli.dry_run:
        print(json.dumps(config_to_dict(cfg), indent=2))
        return 0
    check_runnable(cfg)

    par = cfg.parallelism
    dist = init_distributed(par.dp_replicate, par.dp_shard, par.tp, control_timeout_s=cfg.rollout.round_timeout_s)
    trainer, finished, finished_signals = None, False, NothingToStop()
    try:
        torch.manual_seed(cfg.job.seed)
        threads, why = set_intra_op_threads(cfg.job.cpu_threads, cpu_offload=cfg.parallelism.cpu_offload)
        if dist.is_main:
            log.info("intra-op CPU threads per process: %d (%s)", threads, why)
        report = (
            finished_run_report(cfg.job.run_dir, cfg.job.name, cfg.training.steps)
            if cfg.checkpoint.resume and not cli.fresh
            else None
        )
        if report is not None:  # rerunning a finished run: its result, and nothing else
            finished_signals.install()
            for line in report if dist.is_main else ():
                log.info(line)
        else:
            cfg = fetch_training_inputs(cfg, dist)  # hub ids: one process per node downloads, then checks
            trainer = Trainer(cfg, build(cfg, dist, fresh=cli.fresh))
            trainer.resume()  # the latest checkpoint, when checkpoint.resume
            if dist.is_main:  # nothing refused this launch: its configuration snapshot
                accept_launch(trainer.parts.run_path, config_to_dict(cfg))
            trainer.warm_up()  # supervised, on worked solutions (training.sft_warmup_steps)
            trainer.evaluate_at_start()
            for step in range(trainer.state.step + 1, cfg.training.steps + 1):
                trainer.step(step)  # Algorithm 1
            trainer.finish()  # held-out accuracy, last checkpoint, HF export
            finished_signals.take_over(trainer.stop)  # while the engine shuts down, and to the process's end
        finished = True
        return 0
    finally:
        try:
            if trainer is not None:
                discard_refused_launch(trainer.parts.run_path)  # refused before accept_launch: the folder it made
                trainer.close()
        finally:
            shutdown_distributed(clean=finished)
            finished_signals.restore()


def run_cli(argv: list[str] | None = None) -> None:
    """`main` with the exits a shell expects (run/signals.py, `exit_with_codes`)."""
    exit_with_codes(main, argv)


if __name__ == "__main__":
    run_cli()
