"""Parallel dimensions and the device mesh.

The world is factored as `dp_replicate x dp_shard x tp` (outermost to innermost):

  - `tp` (tensor parallel) is innermost so its ranks are neighbours (same node, fastest links);
    it needs the most communication (several collectives per block).
  - `dp_shard` is FSDP: parameters, gradients and optimizer state sharded, gathered per block.
  - `dp_replicate` is the replicate dimension of HSDP: whole FSDP groups replicated, gradients
    all-reduced across them (one all-reduce per step, suited to slow inter-node links).

Data parallelism is `dp = dp_replicate x dp_shard`: every dp rank reads different samples, the tp ranks
of one dp rank read the same samples.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from model.args import ModelArgs

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

MESH_DIM_NAMES = ("dp_replicate", "dp_shard", "tp")


def check_tp_divides(args: ModelArgs, tp: int) -> None:
    """Raise if `tp` does not divide the attention heads, KV heads, MLP width or vocabulary of `args`."""
    for name in ("num_heads", "num_kv_heads", "intermediate_size", "vocab_size"):
        value = getattr(args, name)
        if value % tp:
            raise ValueError(f"tensor parallel size {tp} does not divide the model's {name} ({value})")


@dataclass
class ParallelDims:
    """Sizes of the parallel dimensions; `dp_shard=-1` takes whatever the world size leaves.

    `world_size` must equal `dp_replicate * dp_shard * tp` once `dp_shard` is resolved.
    """

    dp_replicate: int = 1
    dp_shard: int = -1
    tp: int = 1
    world_size: int = 1
    world_mesh: DeviceMesh | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("dp_replicate", "tp", "world_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"ParallelDims.{name} must be a positive integer, got {value!r}")
        if not isinstance(self.dp_shard, int) or (self.dp_shard < 1 and self.dp_shard != -1):
            raise ValueError(
                f"ParallelDims.dp_shard must be a positive integer or -1 (use the rest), got {self.dp_shard!r}"
            )
        if self.dp_shard == -1:
            rest = self.dp_replicate * self.tp
            if self.world_size % rest:
                raise ValueError(
                    f"world size {self.world_size} is not divisible by dp_replicate * tp = "
                    f"{self.dp_replicate} * {self.tp}; cannot infer dp_shard"
                )
            self.dp_shard = self.world_size // rest
        product = self.dp_replicate * self.dp_shard * self.tp
        if product != self.world_size:
            raise ValueError(
                f"dp_replicate * dp_shard * tp = {self.dp_replicate} * {self.dp_shard} * {self.tp} = {product} "
                f"does not equal the world size {self.world_size}"
            )

    # ---- sizes and switches ------------------------------------------------------------------------

    @property
    def dp(self) -> int:
        """Number of data-parallel ranks (distinct data streams)."""
        return self.dp_replicate * self.dp_shard

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def fsdp_enabled(self) -> bool:
        """FSDP wraps the model whenever there is data parallelism (with dp_shard = 1 and dp_replicate > 1 it
        degenerates to replication with an all-reduce, i.e. DDP)."""
        return self.dp > 1

    @property
    def hsdp_enabled(self) -> bool:
        return self.dp_replicate > 1

    # ---- mesh ---------------------------------------------------------------------------------------

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """A 3-D DeviceMesh named ("dp_replicate", "dp_shard", "tp"), kept as `self.world_mesh`.

        Size-1 dimensions are kept so every caller can index the same names. The flattened data-parallel
        mesh (replicate x shard) is built here too: data loading and the global token count reduce over it.
        """
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        if not dist.is_initialized():
            raise RuntimeError("build_mesh needs an initialised process group (torch.distributed.init_process_group)")
        if dist.get_world_size() != self.world_size:
            raise ValueError(
                f"ParallelDims.world_size is {self.world_size} but the process group has {dist.get_world_size()} ranks"
            )
        mesh = init_device_mesh(device_type, (self.dp_replicate, self.dp_shard, self.tp), mesh_dim_names=MESH_DIM_NAMES)
        self.world_mesh = mesh
        self._dp_mesh = mesh["dp_replicate", "dp_shard"]._flatten("dp")
        return mesh

    def _require_mesh(self) -> DeviceMesh:
        if self.world_mesh is None:
            raise RuntimeError("call ParallelDims.build_mesh(device_type) first")
        return self.world_mesh

    def dp_mesh(self) -> DeviceMesh:
        """1-D mesh over all data-parallel ranks (replicate x shard flattened)."""
        self._require_mesh()
        return self._dp_mesh

    def fsdp_mesh(self) -> DeviceMesh:
        """The mesh FSDP shards over: 2-D (replicate, shard) for HSDP, else 1-D dp_shard."""
        mesh = self._require_mesh()
        return mesh["dp_replicate", "dp_shard"] if self.hsdp_enabled else mesh["dp_shard"]

    def tp_mesh(self) -> DeviceMesh:
        return self._require_mesh()["tp"]

    def dp_rank(self) -> int:
        return self.dp_mesh().get_local_rank()
