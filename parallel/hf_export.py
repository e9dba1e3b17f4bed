"""Hugging Face export (config.json + safetensors, `model.hf.save_hf` semantics) from a sharded model.

Two ways, both producing the tensors `save_hf` would write from the unsharded model:

  - "dcp" (default with a process group): every rank writes the shards it holds, under HF names, with
    DCP's HuggingFaceStorageWriter into `path/sharded/`; then the output files are consolidated from those
    shards, the files divided among the ranks (each reads the byte ranges it needs from disk). No rank ever
    gathers the model, or even one full tensor, in memory.
  - "gather": one parameter at a time is all-gathered (`full_tensor()`) and rank 0 streams it into
    `save_hf`; peak extra memory is one full tensor. The fallback where DCP's writer cannot be used.

Output files are `model-0000k-of-0000n.safetensors` plus `model.safetensors.index.json` (the "dcp" way) or
`save_hf`'s own naming (the "gather" way); both load with `transformers` and `model.hf.load_hf`.
"""

from __future__ import annotations

import json
import os
import re
import shutil

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from model.hf import CONFIG_NAME, DEFAULT_MAX_SHARD_BYTES, hf_config_from_args, save_hf, to_hf_name
from parallel.fsdp import reshard_gathered

_MODEL_FILES = re.compile(r"(model\.safetensors|model-\d{5}-of-\d{5}\.safetensors|model\.safetensors\.index\.json)\Z")


def _hf_state(model: nn.Module, dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """{HF name: parameter (a DTensor shard when sharded)}, cast locally to `dtype`."""
    state = {}
    for name, param in model.named_parameters():
        tensor = param.detach()
        state[to_hf_name(name)] = tensor if dtype is None else tensor.to(dtype)
    return state


def _file_index(state: dict[str, torch.Tensor], max_shard_bytes: int) -> dict[str, int]:
    """Assign tensors, in model order, to output files 1..n of at most `max_shard_bytes` (full sizes)."""
    mapping, index, used = {}, 1, 0
    for name, tensor in state.items():
        size = tensor.numel() * tensor.element_size()  # numel of a DTensor is the full tensor's
        if used and used + size > max_shard_bytes:
            index, used = index + 1, 0
        mapping[name] = index
        used += size
    return mapping


def _export_dcp(model, path, dtype, max_shard_bytes):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._consolidate_hf_safetensors import consolidate_safetensors_files_on_every_rank
    from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageWriter

    state = _hf_state(model, dtype)
    mapping = _file_index(state, max_shard_bytes)
    sharded = os.path.join(path, "sharded")
    writer = HuggingFaceStorageWriter(sharded, fqn_to_index_mapping=mapping, save_distributed=True)
    dcp.save(state, storage_writer=writer)
    dist.barrier()
    consolidate_safetensors_files_on_every_rank(sharded, path, mapping)


def _export_gather(model, path, dtype, max_shard_bytes):
    def full_tensors():
        for name, param in model.named_parameters():
            tensor = param.detach()
            if isinstance(tensor, DTensor):
                tensor = tensor.full_tensor()  # a collective: every rank walks the same order
            yield name, (tensor if dtype is None else tensor.to(dtype))

    if dist.get_rank() == 0:
        save_hf(full_tensors(), path, args=model.args, max_shard_bytes=max_shard_bytes)
    else:
        for _ in full_tensors():
            pass


def export_hf(model: nn.Module, path: str, *, dtype: torch.dtype | None = None,
              max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, method: str = "dcp") -> None:
    """Write `model` (plain, FSDP- and/or TP-sharded) as a HF Qwen2 checkpoint into `path`; call on every rank.

    dtype: cast the stored tensors (e.g. torch.bfloat16); default: the parameters' dtype. Older model files
    in `path` are replaced. Call outside forward/backward; FSDP units still gathered by a forward without
    backward are resharded first, so the fp32 master weights are written.
    """
    if method not in ("dcp", "gather"):
        raise ValueError(f"export method must be 'dcp' or 'gather', got {method!r}")
    reshard_gathered(model)
    if not dist.is_initialized() or dist.get_world_size() == 1:
        save_hf(((n, p.detach() if dtype is None else p.detach().to(dtype)) for n, p in model.named_parameters()),
                path, args=model.args, max_shard_bytes=max_shard_bytes)
        return
    if dist.get_rank() == 0:
        os.makedirs(path, exist_ok=True)
        for name in os.listdir(path):
            if _MODEL_FILES.match(name):
                os.remove(os.path.join(path, name))
        shutil.rmtree(os.path.join(path, "sharded"), ignore_errors=True)
    dist.barrier()
    if method == "gather":
        _export_gather(model, path, dtype, max_shard_bytes)
    else:
        _export_dcp(model, path, dtype, max_shard_bytes)
        if dist.get_rank() == 0:
            shutil.rmtree(os.path.join(path, "sharded"))
            stored = dtype or next(model.parameters()).dtype
            with open(os.path.join(path, CONFIG_NAME), "w") as f:
                json.dump(hf_config_from_args(model.args, dtype=stored), f, indent=2)
    dist.barrier()
