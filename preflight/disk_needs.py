"""The disk a run needs, from its configuration: what it reads and the most its run folder holds.

    checkpoint in         the HF checkpoint of model.hf_path, in its stored dtype (bf16 for Qwen2.5's releases)
    training checkpoint   one DCP checkpoint (checkpoint/manager.py): the parameters in the training dtype
                          and AdamW's two moments (exp_avg, exp_avg_sq) in the same dtype, P x 3 x dtype bytes;
                          with LoRA the adapters alone, in float32 (parallel/lora.py)
    at once               checkpoint.keep_latest_k + 1 of them: a new one is written and verified before the
                          oldest is pruned (CheckpointManager.save renames it complete, then _prune);
                          keep_latest_k = 0 keeps one per checkpoint.interval steps
    HF export             the final policy in the training dtype (checkpoint/hf_export.py export_hf, no cast)

A few KB per checkpoint (manifest, index, train state, RNG states) are not counted.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch

from model.args import ModelArgs, num_params
from model.qwen2 import Qwen2
from parallel.lora import adapter_count

if TYPE_CHECKING:
    from config import Config


def checkpoint_dtype_and_bytes(hf_path: str, args: ModelArgs) -> tuple[torch.dtype, int]:
    """(stored dtype, bytes on disk) of the checkpoint at hf_path, read from its files' headers;
    (bfloat16, 0) without one: Qwen2.5's releases are stored in bf16."""
    if not hf_path:
        return torch.bfloat16, 0
    from safetensors import safe_open

    from model.hf import checkpoint_layout

    layout = checkpoint_layout(hf_path, args)
    with safe_open(layout.files["model.embed_tokens.weight"], framework="pt") as f:
        dtype = f.get_slice("model.embed_tokens.weight")[:0].dtype  # reads no data
    return dtype, sum(os.path.getsize(file) for file in set(layout.files.values()))


def run_disk_bytes(cfg: Config, args: ModelArgs) -> dict[str, int]:
    """Bytes by item of the module docstring, and their total, for configuration `cfg` of architecture `args`."""
    from model.hf_adapter import DTYPES

    count = num_params(args)
    stored, on_disk = checkpoint_dtype_and_bytes(cfg.model.hf_path, args)
    dtype_bytes = DTYPES[cfg.model.dtype].itemsize
    trained, trained_bytes = count, dtype_bytes
    if cfg.lora.enabled:  # the adapters and their moments, float32
        with torch.device("meta"):
            trained, trained_bytes = adapter_count(Qwen2(args), cfg.lora.rank, cfg.lora.targets), 4
    one = 3 * trained * trained_bytes if cfg.checkpoint.enabled else 0
    keep = cfg.checkpoint.keep_latest_k
    at_once = keep + 1 if keep else cfg.training.steps // cfg.checkpoint.interval + 1
    needs = {
        "checkpoint_in": on_disk or count * stored.itemsize,
        "training_checkpoint": one,
        "training_checkpoints_at_once": one * at_once,
        "hf_export": count * dtype_bytes if cfg.checkpoint.export_hf else 0,
    }
    needs["total"] = needs["checkpoint_in"] + needs["training_checkpoints_at_once"] + needs["hf_export"]
    return needs
