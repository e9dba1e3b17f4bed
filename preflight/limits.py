"""Sizes a configuration may type but no machine runs, refused when a run starts (preflight/checks.py) and before
eval.py loads its checkpoint, one line each with the figures:

    a step's samples       prompts a round x rollout.n, at BYTES_PER_TOKEN a token (the least any representation
                           takes), against this node's share of its memory
    an evaluation's        the problems one generate call holds x eval.k, at BYTES_PER_TOKEN a token, likewise
    the torch engine's     rollout.max_batch_size full-length sequences (or rollout.kv_cache_blocks blocks) of k and
    KV cache               v in every layer, against the memory it is allocated in (a GPU's, or this node's)
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from errors import ConfigError

if TYPE_CHECKING:
    from config import Config
    from model.args import ModelArgs

BYTES_PER_TOKEN = 12  # an int64 token id and a float32 log-prob: the least any rollout sample takes per token


def physical_memory() -> int:
    """This node's memory, in bytes."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def node_share() -> float:
    """The share of a job's ranks (and so of its samples) that run on this node (torchrun's sizes; 1 alone)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    return min(world, int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))) / world


def check_rollout_batch_fits(cfg: Config, memory_bytes: int) -> None:
    """This node's share of one step's samples, at BYTES_PER_TOKEN a token, fits its `memory_bytes`."""
    tokens = cfg.prompts_per_round * cfg.rollout.n * cfg.engine_max_seq_len * node_share()
    if tokens * BYTES_PER_TOKEN > memory_bytes:
        raise ConfigError(
            f"one step's samples cannot fit this machine: {cfg.prompts_per_round} prompts a round x rollout.n = "
            f"{cfg.rollout.n} of up to {cfg.engine_max_seq_len} tokens take at least "
            f"{tokens * BYTES_PER_TOKEN / 1e9:,.1f} GB on this node ({BYTES_PER_TOKEN} bytes a token: an int64 id "
            f"and a float32 log-prob), more than its {memory_bytes / 1e9:,.1f} GB of memory; lower "
            "training.train_batch_size, rollout.n or the lengths"
        )


def check_evaluation_fits(cfg: Config, problems_at_once: float, memory_bytes: int) -> None:
    """The samples of `problems_at_once` held-out problems (what one generate call holds on this node) x eval.k,
    at BYTES_PER_TOKEN a token, fit `memory_bytes`."""
    seq_len = cfg.data.max_prompt_length + cfg.eval_max_new_tokens
    need = problems_at_once * cfg.eval.k * seq_len * BYTES_PER_TOKEN
    if need > memory_bytes:
        raise ConfigError(
            f"an evaluation's samples cannot fit this machine: eval.k = {cfg.eval.k:,} samples of each of "
            f"{problems_at_once:,.0f} problem{'' if problems_at_once == 1 else 's'} held at once, of up to {seq_len} "
            f"tokens, take at least "
            f"{need / 1e9:,.1f} GB on this node ({BYTES_PER_TOKEN} bytes a token: an int64 id and a float32 "
            f"log-prob), more than its {memory_bytes / 1e9:,.1f} GB of memory; lower eval.k (or eval.eval_size)"
        )


def check_torch_engine_fits(cfg: Config, args: ModelArgs, seq_len: int) -> None:
    """The torch engine's KV cache (rollout/torch_engine.py: rollout.kv_cache_blocks blocks, by default room
    for rollout.max_batch_size sequences of `seq_len` tokens) fits the memory it is allocated in: a GPU's, or
    this node's shared by its processes. Nothing to check for SGLang, which sizes its cache from free memory."""
    ro = cfg.rollout
    if ro.engine != "torch":
        return
    from model.hf_adapter import DTYPES
    from rollout.kv_cache import PagedKVCache

    blocks = ro.kv_cache_blocks or ro.max_batch_size * -(-seq_len // ro.block_size)
    per_token = PagedKVCache.bytes_per_token(args.num_layers, args.num_kv_heads, args.head_dim, DTYPES[ro.dtype])
    need = blocks * ro.block_size * per_token
    memory, where = _engine_memory()
    if need > memory:
        size = (
            f"rollout.kv_cache_blocks = {ro.kv_cache_blocks:,} blocks of {ro.block_size} positions"
            if ro.kv_cache_blocks
            else f"rollout.max_batch_size = {ro.max_batch_size:,} sequences of up to {seq_len} tokens"
        )
        raise ConfigError(
            f"the torch engine's KV cache cannot fit this machine: {size} take {need / 1e9:,.1f} GB ({per_token:,} "
            f"bytes a token: k and v of {args.num_layers} layers x {args.num_kv_heads} KV heads x {args.head_dim} "
            f"in {ro.dtype}), more than {where}; lower rollout.max_batch_size"
            + (" or rollout.kv_cache_blocks" if ro.kv_cache_blocks else "")
        )


def _engine_memory() -> tuple[float, str]:
    """The bytes one torch engine's KV cache may take, and what they are: its GPU's memory, or on a CPU its
    process's share of this node's."""
    import torch

    if torch.cuda.is_available():
        device = int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count()
        memory = torch.cuda.get_device_properties(device).total_memory
        return memory, f"the {memory / 1e9:,.1f} GB of its GPU"
    processes = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    memory = physical_memory()
    share = f" shared by {processes} processes" if processes > 1 else ""
    return memory / processes, f"the {memory / 1e9:,.1f} GB of this node's memory{share}"
