"""Process-group set-up for train.py: torchrun (SPMD) or a plain single process, CPU or CUDA.

Two kinds of groups: the default one (NCCL on GPUs) for tensors, and gloo "control" groups for the few
Python values ranks agree on while an inference engine may still be generating elsewhere (the guard's agreement
after each engine call, run/guard.py; SGLang's engine-group messages; the held-out evaluation's results). A rank
waits there for the slowest rank's poll or evaluation, which can take longer than NCCL's 10-minute default
timeout; control groups get `control_timeout_s` (config: rollout.round_timeout_s) and keep no GPU stream waiting.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, TypeVar, cast

import torch
import torch.distributed as dist

from errors import UserError
from parallel.dims import ParallelDims

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

T = TypeVar("T")

# Six hours: longer than any one generation round of the shipped configs (32B, 20k-token responses).
DEFAULT_CONTROL_TIMEOUT_S = 6 * 3600


def new_control_group(ranks: list[int] | None, timeout_s: float = DEFAULT_CONTROL_TIMEOUT_S) -> dist.ProcessGroup | int:
    """A gloo group over `ranks` (None: every rank) with a timeout that outlasts the slowest generation;
    a rank outside `ranks` gets torch's placeholder for a group it is not in (the int NON_GROUP_MEMBER).
    Collective: every rank must call it, in the same order. In a fake world (a rehearsal on PyTorch's
    "fake" backend) the group stays fake: gloo would wait for peers that do not exist."""
    backend = None if dist.get_backend() == "fake" else "gloo"
    return dist.new_group(ranks, backend=backend, timeout=timedelta(seconds=timeout_s))


@dataclass
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    dims: ParallelDims
    control_group: dist.ProcessGroup | None = None  # gloo group of every rank (None: the default group)
    control_timeout_s: float = DEFAULT_CONTROL_TIMEOUT_S

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def dp_rank(self) -> int:
        return self.dims.dp_rank() if self.mesh is not None else 0

    @property
    def dp_size(self) -> int:
        return self.dims.dp

    @property
    def dp_group(self) -> dist.ProcessGroup | None:
        return self.dims.dp_mesh().get_group() if self.mesh is not None else None

    @property
    def mesh(self) -> DeviceMesh | None:
        return self.dims.world_mesh

    def all_reduce(self, values: list[float], op: str = "sum", group: str = "dp") -> list[float]:
        """Reduce a few Python numbers over the data-parallel ranks, or over every rank with group="world"
        (on the gloo control group: ranks may wait there for the slowest engine)."""
        if self.world_size == 1:
            return list(values)
        control = group == "world" and self.control_group is not None
        tensor = torch.tensor(values, dtype=torch.float64, device="cpu" if control else self.device)
        reduce_op = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op]
        dist.all_reduce(
            tensor, op=reduce_op, group=self.control_group if control else self.dp_group if group == "dp" else None
        )
        return tensor.tolist()

    def barrier(self) -> None:
        """Every rank waits for the others on the gloo control group: a host-side wait (a run folder prepared, a GPU
        cache emptied after a synchronize) needs no device kernel, and a slow rank may outlast NCCL's 10 minutes."""
        if self.world_size > 1:
            dist.barrier(group=self.control_group)

    def node_first(self, fn: Callable[[], T]) -> T:
        """fn() on each node's first process (local rank 0), then on the node's others, which meanwhile wait on
        the gloo control group (a download can outlast NCCL's 10-minute default) and so find what the first
        left behind (a download cache) complete. After each turn the ranks agree: a failure on any rank is raised
        on every rank (its own on the rank that failed; a copy of the first elsewhere), so none waits for a
        peer that already left."""
        if self.world_size == 1:
            return fn()
        result: T | None = None
        for first_turn in (True, False):
            error: Exception | None = None
            if (self.local_rank == 0) == first_turn:
                try:
                    result = fn()
                except Exception as exc:
                    error = exc
            shared = error if error is None or isinstance(error, UserError) else RuntimeError(repr(error))
            everyone: list[Exception | None] = [None] * self.world_size
            dist.all_gather_object(everyone, shared, group=self.control_group)  # picklable: a UserError or a repr
            first = error or next((e for e in everyone if e is not None), None)
            if first is not None:
                raise first
        return cast(T, result)


def init_distributed(
    dp_replicate: int, dp_shard: int, tp: int, control_timeout_s: float = DEFAULT_CONTROL_TIMEOUT_S
) -> DistEnv:
    """Join torchrun's process group if there is one (nccl on CUDA, gloo on CPU), build the mesh and the
    gloo control group (see the module docstring)."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    dims = ParallelDims(dp_replicate=dp_replicate, dp_shard=dp_shard, tp=tp, world_size=world_size)
    # One CUDA process still needs a (one-rank) mesh: FSDP's mixed precision (bf16 compute over fp32
    # master weights) is applied through fully_shard.
    if world_size > 1 or device.type == "cuda":
        if not dist.is_initialized():
            if world_size == 1:
                dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
            else:
                dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
        dims.build_mesh(device.type)
    control = new_control_group(None, control_timeout_s) if world_size > 1 else None
    assert not isinstance(control, int)  # every rank is a member of a group over every rank
    return DistEnv(rank, world_size, local_rank, device, dims, control, control_timeout_s)


def shutdown_distributed(clean: bool = True) -> None:
    """Leave the process group. clean: every rank got here (after a failure a peer may never arrive, so no
    barrier then)."""
    if dist.is_initialized():
        if clean:
            dist.barrier()  # no rank tears the group down while a peer still uses it
        dist.destroy_process_group()
