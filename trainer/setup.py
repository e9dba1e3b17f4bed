"""Build what train.py needs from the configuration: tokenizer, prompt sets, policy, rollout engine."""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

import torch

from model.args import ModelArgs, get_preset
from model.hf import load_hf
from model.hf_adapter import DTYPES, read_hf_config
from model.qwen2 import Qwen2, build_model
from model.tokenizer import IM_END, QWEN25_DEFAULT_SYSTEM, Tokenizer, render_chat, train_bpe_tokenizer
from parallel.hf_load import load_hf_shards
from parallel.parallelize import parallelize_qwen2
from rl.data import DAPO_PROMPT_TEMPLATE, load_prompts, rows_to_examples, synthetic_task_rows
from trainer.memory import return_cached_memory

if TYPE_CHECKING:
    from config import Config
    from config.schema import DataConfig, ModelConfig, ParallelismConfig
    from rollout.engine import Engine
    from trainer.distributed import DistEnv

log = logging.getLogger(__name__)


def build_tokenizer(model: ModelConfig, data: DataConfig, run_path: str, *, is_main: bool, barrier) -> Tokenizer:
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
    tokenizer = Tokenizer.from_dir(path)
    mismatch = tokenizer.transformers_mismatch() if is_main else None  # one rank reads the whole vocabulary
    if mismatch:
        log.warning(
            "the tokenizer in %s is not what transformers 5 rebuilds for a Qwen2 checkpoint (%s): "
            "transformers' AutoTokenizer will encode the exported policy's prompts differently",
            path,
            mismatch,
        )
    return tokenizer


def load_datasets(data: DataConfig, tokenizer, *, eval_size: int | None = None):
    """(train examples, eval examples) from parquet files or the synthetic task; eval_size: the first
    eval_size held-out examples only (eval.eval_size; None: all)."""
    max_len = data.max_prompt_length
    overflow = data.prompt_overflow

    def load(path, split):
        if path == "synthetic":
            return rows_to_examples(
                synthetic_task_rows(data, split),
                tokenizer,
                max_prompt_length=max_len,
                overflow=overflow,
                source_name=f"synthetic {split}",
            )[0]
        return load_prompts(path, tokenizer, max_prompt_length=max_len, overflow=overflow)

    train = load(data.train_path, "train")
    evals = load(data.eval_path, "eval") if data.eval_path else []
    if eval_size:
        evals = evals[:eval_size]
    return train, evals


def build_policy(model_cfg: ModelConfig, device: torch.device, *, seed: int) -> torch.nn.Module:
    """The policy in its training dtype on `device`: an HF checkpoint, or a preset with random weights
    initialised from `seed` (job.seed)."""
    dtype = DTYPES[model_cfg.dtype]
    if model_cfg.hf_path:
        model = load_hf(model_cfg.hf_path, dtype=dtype, device=device)
    else:
        model = build_model(get_preset(model_cfg.preset), device=device, dtype=dtype, seed=seed)
    model.attention_backend = model_cfg.attention_backend
    return model


def policy_args(model: ModelConfig) -> ModelArgs:
    """The policy's architecture: the checkpoint's config.json, or the preset."""
    if model.hf_path:
        return read_hf_config(model.hf_path)
    return get_preset(model.preset)


@torch.no_grad()
def copy_into_shards(model: torch.nn.Module, full_tensors) -> None:
    """Copy (name, full tensor) pairs into `model`'s parameters, each rank keeping only its own part.

    A sharded parameter (a DTensor: FSDP, TP or both) takes the slice its placements give this rank,
    cut locally from the full tensor every rank holds (src_data_rank=None: no communication).
    """
    from torch.distributed.tensor import DTensor, distribute_tensor

    params = dict(model.named_parameters())
    for name, full in full_tensors:
        param = params.pop(name)
        if isinstance(param, DTensor):
            part = distribute_tensor(full.to(param.dtype), param.device_mesh, param.placements, src_data_rank=None)
            param.to_local().copy_(part.to_local())
        else:
            param.copy_(full)
    if params:
        raise ValueError(f"no values for {len(params)} parameters, e.g. {sorted(params)[:3]}")


def build_sharded_policy(
    model_cfg: ModelConfig, parallelism: ParallelismConfig, dist_env: DistEnv, *, seed: int, fill: bool = True
) -> torch.nn.Module:
    """The policy, parallelised, holding only this rank's shards on the device:

        1. the module on the meta device (no memory anywhere);
        2. parallelize_qwen2 (TP, AC, compile, FSDP) on the meta parameters;
        3. to_empty: only this rank's shards are allocated (in host memory with cpu_offload);
        4. the values (`fill=False` skips them: a rehearsal needs none): from a checkpoint, each rank reads
           only the rows of its own shards, one tensor at a time (parallel/hf_load.py); a preset's seeded
           initialisation is built whole on the CPU, copied into the shards and dropped (presets are the
           small models of tests and demos).

    Nothing full-size ever reaches the GPU, so an engine started afterwards sizes its KV pool from what
    the trainer really keeps (SGLang sizes it from the memory free when it starts); and no rank holds a
    full-size checkpoint in host memory.
    """
    dtype = DTYPES[model_cfg.dtype]
    with torch.device("meta"):
        model = Qwen2(policy_args(model_cfg)).to(dtype)
    model.attention_backend = model_cfg.attention_backend
    parallelize_qwen2(model, dist_env.mesh, dist_env.dims, parallelism)
    model.to_empty(device="cpu" if parallelism.cpu_offload else dist_env.device)
    if fill and model_cfg.hf_path:
        load_hf_shards(model, model_cfg.hf_path)
    elif fill:
        source = build_policy(model_cfg, torch.device("cpu"), seed=seed)
        copy_into_shards(model, ((name, p.detach()) for name, p in source.named_parameters()))
        del source
    return model


def build_policy_and_engine(
    cfg: Config, dist_env: DistEnv, *, start_engine=None, fill: bool = True
) -> tuple[torch.nn.Module, Engine]:
    """train.py's build order on GPUs the engine shares: the sharded policy first (build_sharded_policy:
    nothing full-size ever reaches the device), the allocator's cache handed back, then the rollout
    engine, which sizes its KV pool from the memory free when it starts.

    start_engine(cfg, policy, device, max_prompt_length, dist_env) -> engine; default `build_engine`.
    fill=False: the policy's values are not needed (a rehearsal).
    """
    policy = build_sharded_policy(cfg.model, cfg.parallelism, dist_env, seed=cfg.job.seed, fill=fill)
    return_cached_memory(dist_env)  # what the load cached is free memory for the engine
    engine = (start_engine or build_engine)(cfg, policy, dist_env.device, cfg.data.max_prompt_length, dist_env)
    return policy, engine


def torch_engine_options(rollout) -> dict:
    """The [rollout] settings of the torch engine, for every place that builds one (training, eval.py)."""
    return {
        "max_batch_size": rollout.max_batch_size,
        "compile": rollout.compile,
        "cuda_graphs": rollout.cuda_graphs,
        "block_size": rollout.block_size,
        "kv_cache_blocks": rollout.kv_cache_blocks or None,  # 0: room for max_batch_size full sequences
        "flex_decode": rollout.flex_decode,
    }


def engine_group(tp_size: int, dist_env: DistEnv):
    """The process group of the `tp_size` consecutive ranks that share one SGLang engine (one per GPU of
    the engine), and the first GPU of that engine on this node. Every rank creates every group. A gloo
    control group (trainer/distributed.py): its ranks wait in it while the leader generates."""
    from trainer.distributed import new_control_group

    if dist_env.world_size == 1:
        if tp_size != 1:
            raise ValueError(f"rollout.tp_size = {tp_size} needs {tp_size} ranks (torchrun); this run has one")
        return None, 0
    if dist_env.world_size % tp_size:
        raise ValueError(f"rollout.tp_size = {tp_size} does not divide the world size {dist_env.world_size}")
    mine = None
    for start in range(0, dist_env.world_size, tp_size):
        group = new_control_group(list(range(start, start + tp_size)), dist_env.control_timeout_s)
        if start <= dist_env.rank < start + tp_size:
            mine = group
    return mine, dist_env.local_rank - dist_env.local_rank % tp_size


def build_engine(
    cfg: Config, policy: torch.nn.Module, device: torch.device, max_prompt_length: int, dist_env: DistEnv | None = None
) -> Engine:
    """The rollout engine, started after the policy is sharded. The torch engine gets its own full copy
    of the policy's weights; an SGLang engine is shared by `rollout.tp_size` consecutive ranks (its TP group),
    colocated on their GPUs."""
    max_new = max(cfg.rollout.max_response_length, cfg.eval.max_response_length or 0)
    if cfg.rollout.engine == "torch":
        from rollout.torch_engine import TorchEngine
        from rollout.weight_sync import sync_weights

        # Its own full copy, filled from the (sharded) policy: every rank takes part in the gathers.
        with torch.device("meta"):
            engine_model = Qwen2(policy.args).to(DTYPES[cfg.rollout.dtype])
        engine_model.to_empty(device=device)
        engine = TorchEngine(
            engine_model,
            max_seq_len=max_prompt_length + max_new,
            device=device,
            dtype=DTYPES[cfg.rollout.dtype],
            seed=cfg.job.seed,
            **torch_engine_options(cfg.rollout),
        )
        sync_weights(policy, engine, bucket_bytes=cfg.rollout.weight_sync_bucket_mb << 20)
        return engine
    from rollout.sglang_engine import SGLangEngine, context_length_for

    group, base_gpu_id = engine_group(cfg.rollout.tp_size, dist_env)
    return SGLangEngine(
        model_path=cfg.model.hf_path,
        tp_size=cfg.rollout.tp_size,
        base_gpu_id=base_gpu_id,
        mem_fraction_static=cfg.rollout.mem_fraction_static,
        dtype=cfg.rollout.dtype,
        seed=cfg.job.seed,
        context_length=context_length_for(max_prompt_length, max_new),
        group=group,
        device=device,
    )
