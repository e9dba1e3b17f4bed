"""Sizes a configuration may type but no machine runs, refused when a run starts (config/checks.py), one line each:
an SGLang generate call whose deadline (rollout/sglang_engine.py generate_deadline_s) outlasts the gloo timeout
(rollout.round_timeout_s) of the ranks that wait for it, which would fail before a hang is found; and a step's
samples that no node's memory holds, at the least any representation takes (BYTES_PER_TOKEN).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from errors import ConfigError

if TYPE_CHECKING:
    from config import Config

BYTES_PER_TOKEN = 12  # an int64 token id and a float32 log-prob: the least any rollout sample takes per token


def check_limits(cfg: Config) -> None:
    check_generate_deadline(cfg)
    check_rollout_batch_fits(cfg, os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def engine_call_requests(cfg: Config) -> int:
    """The most requests of one training generate call of an engine: whole groups, at least one from each of
    its rollout.tp_size ranks, at most rollout.requests_per_call (trainer/rollout_phase.py prompts_per_call)."""
    group = cfg.rollout.n * cfg.rollout.tp_size
    return max(1, cfg.rollout.requests_per_call // group) * group


def check_generate_deadline(cfg: Config) -> None:
    """An SGLang generate call's deadline must end before the collective that waits for it times out."""
    from rollout.sglang_engine import generate_deadline_s

    ro = cfg.rollout
    if ro.engine != "sglang":
        return  # the torch engine runs in the trainer's process: no deadline
    group, requests = ro.n * ro.tp_size, engine_call_requests(cfg)
    deadline = generate_deadline_s(requests, ro.max_response_length, ro.call_timeout_s, ro.min_tokens_per_s)
    if deadline < ro.round_timeout_s:
        return
    most = int((ro.round_timeout_s - ro.call_timeout_s) * ro.min_tokens_per_s / ro.max_response_length) // group
    lower = f"lower rollout.requests_per_call to {most * group} or " if most else ""
    raise ConfigError(
        f"rollout.round_timeout_s = {ro.round_timeout_s} is shorter than one generate call's deadline of "
        f"{deadline:,.0f} s (rollout.call_timeout_s + {requests} requests x {ro.max_response_length} tokens / "
        f"rollout.min_tokens_per_s = {ro.min_tokens_per_s:g}): the ranks waiting for the call would time out "
        f"before a hang is found; {lower}raise rollout.round_timeout_s above {deadline:,.0f}"
    )


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
