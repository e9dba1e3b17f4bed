"""Trainer -> engine weight sync after an optimizer step, one bucket at a time.

    for each trainer parameter, in registration order (embedding, layers 0..N-1, norm, head):
        local = shard.to(engine dtype)        # cast before gathering: fewer bytes on the wire
        local = local.to(engine device)       # an offloaded (CPU) shard goes to the GPU
        full  = local.full_tensor()           # all-gather of a DTensor (FSDP, TP or both); plain tensors as is
        bucket += (HF name, full)
        if bucket holds >= bucket_bytes: engine.update_weights(bucket); drop bucket
    engine.update_weights(last bucket)

With parallelism.cpu_offload the shards live on the CPU: gathering them there would run an NCCL collective on
CPU tensors, and SGLang would be handed a CPU tensor where it opens a CUDA IPC handle. Peak extra memory is one
bucket of full tensors (a single tensor larger than `bucket_bytes` forms a bucket of its own); the engine copies
each bucket into its existing weights (no re-allocation).

Every rank of the trainer calls it, because gathering a DTensor is a collective that all ranks of its mesh must
enter in the same order (the module's parameter order, the same on every rank); with SGLang each rank passes
its `SGLangEngine` handle, which gathers the ranks' buckets to the engine's leader. In a run the engine is the
guarded one (run/guard.py): the ranks agree after every bucket, so a failed update on any rank stops every rank
at the same bucket.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator
from typing import Protocol

import torch
from torch import nn

from model.hf_adapter import iter_hf_tensors
from parallel.lora import merged_parameters


def _full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    # DTensor is imported lazily so the single-device path needs no torch.distributed at all.
    if type(tensor).__name__ == "DTensor":
        from torch.distributed.tensor import DTensor

        if isinstance(tensor, DTensor):
            return tensor.full_tensor()
    return tensor


def iter_weight_buckets(
    model: nn.Module,
    *,
    bucket_bytes: int = 1 << 30,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Yield lists of (HF name, full tensor) of about `bucket_bytes` each (see the module docstring).

    A generator: each bucket is gathered only when the consumer asks for it, so the previous bucket
    can be freed first. Every rank must consume it to the end (collectives).
    """
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    if "torch.distributed.fsdp" in sys.modules:  # otherwise no module can be FSDP-sharded
        from parallel.fsdp import reshard_gathered

        reshard_gathered(model)  # read the fp32 master shards, not copies a no-grad forward left gathered
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    with torch.no_grad():
        for hf_name, tensor in iter_hf_tensors(merged_parameters(model)):  # LoRA: W + (alpha / r) B A
            if dtype is not None and tensor.dtype != dtype:
                tensor = tensor.to(dtype)  # first, so an offloaded shard crosses to the device at its new size
            if device is not None:
                tensor = tensor.to(device)  # before the gather, which runs where the shard is
            full = _full_tensor(tensor)
            bucket.append((hf_name, full))
            size += full.numel() * full.element_size()
            if size >= bucket_bytes:
                yield bucket
                bucket, size = [], 0
    if bucket:
        yield bucket


class WeightReceiver(Protocol):
    """What sync_weights pushes into: an engine's update_weights (Engine), or the rehearsal's stand-in."""

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None: ...


def sync_weights(trainer_model: nn.Module, engine: WeightReceiver, *, bucket_bytes: int = 1 << 30) -> int:
    """Push every trainer parameter into `engine`; returns the bytes sent. Call on every trainer rank.

    The shards are cast to `engine.dtype` and gathered on `engine.device` (both engines expose them; without
    them each shard keeps its dtype and stays where it is).
    """
    dtype, device = getattr(engine, "dtype", None), getattr(engine, "device", None)
    sent = 0
    for bucket in iter_weight_buckets(trainer_model, bucket_bytes=bucket_bytes, dtype=dtype, device=device):
        engine.update_weights(bucket)
        sent += sum(t.numel() * t.element_size() for _, t in bucket)
        del bucket
    return sent
