"""Trainer -> engine weight sync after an optimizer step, one bucket at a time.

    for each bucket of trainer parameters, in registration order (embedding, layers 0..N-1, norm, head),
    the next ones whose full tensors hold >= bucket_bytes:
        local = shard.to(engine dtype)        # cast before gathering: fewer bytes on the wire
        local = local.to(engine device)       # an offloaded (CPU) shard goes to the GPU
        every rank agrees that its shards are ready (and, on a GPU, that the gathered bucket fits)
        full  = local.full_tensor()           # all-gather of a DTensor (FSDP, TP or both); plain tensors as is
        engine.update_weights([(HF name, full), ...]); drop the bucket

With parallelism.cpu_offload the shards live on the CPU: gathering them there would run an NCCL collective on
CPU tensors, and SGLang would be handed a CPU tensor where it opens a CUDA IPC handle. Peak extra memory is one
bucket of full tensors and its shards (a single tensor larger than `bucket_bytes` forms a bucket of its own); the
engine copies each bucket into its existing weights (no re-allocation).

Every rank of the trainer calls it, because gathering a DTensor is a collective that all ranks of its mesh must
enter in the same order (the module's parameter order, the same on every rank); with SGLang each rank passes
its `SGLangEngine` handle, which gathers the ranks' buckets to the engine's leader. In a run the engine is the
guarded one (run/guard.py): the ranks agree before each bucket's gathers that every rank's shards are ready, and
after its update, so a rank that fails to prepare a bucket (an out-of-memory error moving or casting its shards,
or no room for the gathered bucket) or to update it stops every rank with a checkpoint at that bucket, none left
waiting in a gather (one all-reduce on the gloo control group per bucket, and one after the last).
"""

from __future__ import annotations

import functools
import itertools
import sys
from collections.abc import Callable, Iterable, Iterator
from typing import Protocol

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from model.hf_adapter import iter_hf_tensors
from parallel.lora import merged_parameters

Shards = list[tuple[str, torch.Tensor]]  # (HF name, this rank's shard) of one bucket


def _alone(what: str, fn: Callable[[], Shards]) -> Shards:
    return fn()


def iter_weight_buckets(
    model: nn.Module,
    *,
    bucket_bytes: int = 1 << 30,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    together: Callable[[str, Callable[[], Shards]], Shards] = _alone,
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Yield lists of (HF name, full tensor) of about `bucket_bytes` each (see the module docstring).

    A generator: each bucket is gathered only when the consumer asks for it, so the previous bucket
    can be freed first. Every rank must consume it to the end (collectives). Each bucket's shards are made ready
    for its gathers (`next_shards`) inside `together(what, fn)`: the guard's agreement (run/guard.py
    GuardedEngine.together) when the ranks must all be ready before any enters a gather.
    """
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    if "torch.distributed.fsdp" in sys.modules:  # otherwise no module can be FSDP-sharded
        from parallel.fsdp import reshard_gathered

        reshard_gathered(model)  # read the fp32 master shards, not copies a no-grad forward left gathered
    # Detached parameters: nothing here records a graph (and no grad mode is held across a yield, where the
    # consumer runs, or left behind by a consumer that stops part-way).
    tensors = iter_hf_tensors(merged_parameters(model))  # LoRA: W + (alpha / r) B A, its adapters gathered here
    for index in itertools.count(1):
        ready = functools.partial(next_shards, tensors, bucket_bytes, dtype, device)
        shards = together(f"the weight sync's bucket {index} (its shards, before their gathers)", ready)
        if not shards:
            return
        yield [(hf_name, shard.full_tensor() if isinstance(shard, DTensor) else shard) for hf_name, shard in shards]


def next_shards(
    tensors: Iterator[tuple[str, torch.Tensor]],
    bucket_bytes: int,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
) -> Shards:
    """The next bucket's tensors as they enter their gathers: (HF name, shard) pairs from `tensors` until the full
    tensors hold `bucket_bytes` (the last bucket: what is left; none once all are sent), each cast to `dtype` and
    moved to `device`; on a GPU, refused here rather than inside a gather unless the gathered ones fit
    (`check_room_to_gather`)."""
    shards, size, gathered = [], 0, 0
    for hf_name, tensor in tensors:
        if dtype is not None and tensor.dtype != dtype:
            tensor = tensor.to(dtype)  # first, so an offloaded shard crosses to the device at its new size
        if device is not None:
            tensor = tensor.to(device)  # before the gather, which runs where the shard is
        shards.append((hf_name, tensor))
        full = tensor.numel() * tensor.element_size()  # a DTensor's numel is its full tensor's
        size, gathered = size + full, gathered + full * isinstance(tensor, DTensor)
        if size >= bucket_bytes:
            break
    check_room_to_gather(gathered, device)
    return shards


def check_room_to_gather(nbytes: int, device: torch.device | str | None) -> None:
    """An out-of-memory error unless gathering `nbytes` of sharded tensors on a GPU `device` fits in what its
    allocator can hand out: the GPU's free memory and the allocator's cached blocks."""
    if nbytes and torch.device(device or "cpu").type == "cuda":
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        free = torch.cuda.mem_get_info(device)[0] + cached
        if free < nbytes:
            raise torch.OutOfMemoryError(
                f"gathering {nbytes / 2**20:,.0f} MiB of weights on {device}: {free / 2**20:,.0f} MiB are free"
            )


class WeightReceiver(Protocol):
    """What sync_weights pushes into: an engine's update_weights (Engine), or the rehearsal's stand-in."""

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None: ...


def sync_weights(trainer_model: nn.Module, engine: WeightReceiver, *, bucket_bytes: int = 1 << 30) -> int:
    """Push every trainer parameter into `engine`; returns the bytes sent. Call on every trainer rank.

    The shards are cast to `engine.dtype` and gathered on `engine.device` (both engines expose them; without
    them each shard keeps its dtype and stays where it is).
    """
    dtype, device = getattr(engine, "dtype", None), getattr(engine, "device", None)
    together = getattr(engine, "together", _alone)  # the guarded engine's agreement: every rank ready to gather
    sent = 0
    buckets = iter_weight_buckets(
        trainer_model, bucket_bytes=bucket_bytes, dtype=dtype, device=device, together=together
    )
    for bucket in buckets:
        engine.update_weights(bucket)
        sent += sum(t.numel() * t.element_size() for _, t in bucket)
        del bucket
    return sent
