"""What a DAPO run is built from, once, in train.py's order (`build`): the run folder (locked), the tokenizer
and the prompt sets, the policy sharded over the mesh, the rollout engine beside it, the optimizer and its
schedule, and dynamic sampling's batch builder, each built from its configuration section and then called with
data. The phases of a step are built around them by the trainer (trainer/loop.py Trainer), which holds the
runner that checkpoints a failure.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from checkpoint.sharded_policy import build_sharded_policy
from config import config_to_dict
from data.prompts import PromptExample, PromptSampler, load_split, synthetic_task_rows
from errors import ConfigError
from model.args import get_preset
from model.qwen2 import Qwen2
from model.tokenizer import IM_END, QWEN25_DEFAULT_SYSTEM, Tokenizer, render_chat, train_bpe_tokenizer
from parallel.adamw import fused_adamw
from parallel.device_memory import return_cached_memory
from rewards.scorer import Scorer, build_scorer
from rl.filter import DynamicBatchBuilder
from rollout.engine import Engine
from rollout.engine_spec import EngineSpec
from run.folder import discard_refused_launch, prepare_run_folder, run_folder_path
from run.lock import FolderLock
from tasks.catalog import DAPO_PROMPT_TEMPLATE
from trainer.optimizer import build_optimizer
from trainer.types import Sample

if TYPE_CHECKING:
    from config import Config
    from config.schema import DataConfig, ModelConfig
    from parallel.dist_env import DistEnv

log = logging.getLogger("train")


@dataclasses.dataclass
class Components:
    """What a run is built from, in `build`'s order."""

    dist: DistEnv
    run_path: str
    tokenizer: Tokenizer
    train_set: list[PromptExample]
    eval_set: list[PromptExample]
    sampler: PromptSampler
    policy: Qwen2
    engine: Engine  # the rollout engine (the trainer drives it through the guard, run/guard.py)
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    builder: DynamicBatchBuilder[list[Sample]]
    scorer: Scorer  # the reward (rewards/scorer.py): the rule reward, or the user's functions in worker processes
    lock: FolderLock | None = None  # the main rank's lock on the run folder


def build(cfg: Config, dist: DistEnv, *, fresh: bool) -> Components:
    """Run folder (locked by the main rank until `Trainer.close`), tokenizer and data, then the policy, the
    rollout engine, the optimizer and its schedule, and the batch builder."""
    lock = FolderLock(run_folder_path(cfg.job.run_dir, cfg.job.name)) if dist.is_main else None
    try:
        parts = _build(cfg, dist, fresh, lock)
    except BaseException:
        if lock is not None:
            discard_refused_launch(lock.folder)  # the folder, when this launch made it
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
    warn_if_fewer_than_a_round(cfg, len(train_set))
    scorer = build_scorer(cfg)  # a user's function: imported and called on the first rows, before anything is built
    scorer.check(train_set)

    policy, engine = build_policy_and_engine(cfg, dist)
    fused = fused_adamw(cfg.parallelism.cpu_offload)  # offloaded: the CPU's fused kernel, no temporaries
    optimizer, scheduler = build_optimizer(policy.parameters(), cfg.optimizer, fused=fused)  # LoRA: the adapters
    alg = cfg.algorithm
    builder: DynamicBatchBuilder[list[Sample]] = DynamicBatchBuilder(
        cfg.training.train_batch_size // dist.dp_size,  # this rank's share of a batch
        alg.max_num_gen_batches,
        max_staleness=alg.carry_over_max_staleness,
        enabled=alg.dynamic_sampling,
        metric=alg.filter_metric,
    )
    parts = (run_path, tokenizer, train_set, eval_set, sampler, policy, engine, optimizer, scheduler, builder, scorer)
    return Components(dist, *parts)


def warn_if_fewer_than_a_round(cfg: Config, prompts: int) -> None:
    """One line when the prompt set is smaller than a generation round: the round then repeats prompts."""
    if prompts < cfg.prompts_per_round:
        log.warning(
            "data.train_path holds %d prompts, fewer than one generation round draws (%d): a round repeats prompts "
            "and their groups are not independent; use more prompts or a smaller training.train_batch_size",
            prompts,
            cfg.prompts_per_round,
        )


def build_policy_and_engine(cfg: Config, dist_env: DistEnv) -> tuple[Qwen2, Engine]:
    """train.py's build order on GPUs the engine shares: the sharded policy first (checkpoint/sharded_policy.py:
    nothing full-size ever reaches the device), the allocator's cache handed back, then the rollout engine,
    which sizes its KV pool from the memory free when it starts."""
    policy = build_sharded_policy(cfg.model, cfg.parallelism, dist_env, seed=cfg.job.seed, lora=cfg.lora)
    return_cached_memory(dist_env)  # what the load cached is free memory for the engine
    return policy, EngineSpec.from_config(cfg).start_beside(policy, dist_env)


def build_tokenizer(
    model: ModelConfig, data: DataConfig, run_path: str, *, is_main: bool, barrier: Callable[[], None]
) -> Tokenizer:
    """The checkpoint's tokenizer, or one trained on the synthetic task (saved in the run folder).

    Only rank 0 trains the synthetic tokenizer; the others wait and load the saved copy, so every rank
    holds byte-identical vocabularies. Its phrases are the fixed text of every prompt (the default system
    message, DAPO's template around the problem), one token each.
    """
    path = model.tokenizer_path or model.hf_path
    if not path:
        if data.train_path != "synthetic":
            raise ValueError("model.tokenizer_path (or model.hf_path) must be set for a real data set")
        path = os.path.join(run_path, "tokenizer")
        if is_main and not os.path.isfile(os.path.join(path, "tokenizer.json")):
            rows = synthetic_task_rows(data, "train")
            texts = [render_chat(r["prompt"]) + r["extra_info"]["solution"] + IM_END for r in rows]
            vocab = get_preset(model.preset).vocab_size
            phrases = [QWEN25_DEFAULT_SYSTEM, *DAPO_PROMPT_TEMPLATE.split("{problem}")]
            train_bpe_tokenizer(texts, vocab, phrases=phrases).save(path)
        barrier()
    return Tokenizer.from_dir(path)


def load_datasets(
    data: DataConfig, tokenizer: Tokenizer, *, eval_size: int | None = None
) -> tuple[list[PromptExample], list[PromptExample]]:
    """(train examples, eval examples) from parquet files or the synthetic task (data/prompts.py load_split);
    eval_size: the first eval_size held-out examples only (eval.eval_size; None: all)."""
    train = load_split(data, "train", tokenizer)
    evals = load_split(data, "eval", tokenizer) if data.eval_path else []
    return train, evals[:eval_size] if eval_size else evals
