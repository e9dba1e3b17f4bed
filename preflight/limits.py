"""Sizes a configuration may type but no machine runs, refused when a run starts (config/checks.py), one line each:
a step's samples that no node's memory holds, at the least any representation takes (BYTES_PER_TOKEN).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from errors import ConfigError

if TYPE_CHECKING:
    from config import Config

BYTES_PER_TOKEN = 12  # an int64 token id and a float32 log-prob: the least any rollout sample takes per token


def check_limits(cfg: Config) -> None:
    check_rollout_batch_fits(cfg, os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def check_rollout_batch_fits(cfg: Config, memory_bytes: int) -> None:
    """This node's share of one step's samples, at BYTES_PER_TOKEN a token, fits its `memory_bytes`."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    node_share = min(world, int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))) / world
    tokens = cfg.prompts_per_round * cfg.rollout.n * cfg.engine_max_seq_len * node_share
    if tokens * BYTES_PER_TOKEN > memory_bytes:
        raise ConfigError(
            f"one step's samples cannot fit this machine: {cfg.prompts_per_round} prompts a round x rollout.n = "
            f"{cfg.rollout.n} of up to {cfg.engine_max_seq_len} tokens take at least "
            f"{tokens * BYTES_PER_TOKEN / 1e9:,.1f} GB on this node ({BYTES_PER_TOKEN} bytes a token: an int64 id "
            f"and a float32 log-prob), more than its {memory_bytes / 1e9:,.1f} GB of memory; lower "
            "training.train_batch_size, rollout.n or the lengths"
        )
