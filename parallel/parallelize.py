"""Apply every parallelism to a Qwen2 model, in the one order that composes: TP -> LoRA -> AC -> compile -> FSDP.

Why this order:
  1. Tensor parallelism first: it replaces parameters by DTensors sharded over the tp mesh and installs the
     input/output redistribution hooks that every later step must see as part of the module.
  LoRA adapters (parallel/lora.py), when trained, come right after TP: they are laid out to match its plan and
     their forward hook must run before its output hook; FSDP then shards them with their block.
  2. Activation checkpointing wraps each block's forward, so that compile traces the checkpointed region
     (and can apply its own recompute decisions inside it).
  3. Compile per block, after AC and before FSDP, so FSDP's hooks stay outside the compiled graphs.
  4. FSDP last: it shards whatever parameters exist (the TP DTensors become 2-D, dp x tp) and groups them
     into units; its hooks must wrap the final form of each block.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import torch

from model.hf_adapter import to_dtype
from parallel.activation_checkpoint import apply_ac
from parallel.compile import apply_compile
from parallel.dims import ParallelDims
from parallel.fsdp import apply_fsdp
from parallel.lora import Adapters, apply_lora
from parallel.tensor_parallel import apply_tp

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from config.schema import ParallelismConfig
    from model.qwen2 import Qwen2


def parallelize_qwen2(
    model: Qwen2,
    mesh: DeviceMesh | None,
    dims: ParallelDims,
    parallelism: ParallelismConfig | None = None,
    *,
    compile_backend: str = "inductor",
    lora: Adapters | None = None,
    **overrides: Any,  # fields of ParallelismConfig, each a value of its field's type
) -> Qwen2:
    """Parallelise `model` in place over `mesh` (from `dims.build_mesh`) and return it.

    `parallelism` is the [parallelism] section (None: its defaults); its degrees (dp_replicate, dp_shard, tp)
    are `dims`', the rest are the switches read here. Its fields may also be passed as keyword arguments
    (`compile=True`, `param_dtype=torch.float32` or `"float32"`, ...), which leave the section unchanged.
    FSDP wraps the model when there is data parallelism or mixed precision (param_dtype != the model's
    dtype). Without a mesh (single process, no process group), only AC and compile apply. `lora`: the adapters to
    train on the frozen model (parallel/lora.py; None: every weight is trained).
    """
    if parallelism is None:
        from config.schema import ParallelismConfig  # the defaults only; no import of config otherwise

        parallelism = ParallelismConfig()
    config = dataclasses.replace(parallelism, **overrides)  # a copy: the section itself stays unchanged
    param_dtype, reduce_dtype = to_dtype(config.param_dtype), to_dtype(config.reduce_dtype)
    needs_mesh = dims.tp_enabled or dims.fsdp_enabled
    if (mesh is not None and mesh is not dims.world_mesh) or (needs_mesh and mesh is None):
        raise ValueError("parallelize_qwen2 needs the mesh returned by dims.build_mesh(...)")
    # Mixed precision is FSDP's MixedPrecisionPolicy, so a single data-parallel rank that trains in bf16
    # still gets a (size-1) FSDP wrapping: fp32 master weights, bf16 compute.
    # (A float32 adapter on a bfloat16 base: mixed too.)
    mixed_precision = param_dtype != next(model.parameters()).dtype or (
        lora is not None and param_dtype != torch.float32
    )
    if mixed_precision and mesh is None:
        raise ValueError(
            f"param_dtype {param_dtype} differs from the model's dtype; mixed precision runs through FSDP "
            "and needs a process group and mesh (one rank is fine), or set param_dtype to the model's dtype"
        )

    if dims.tp_enabled:
        apply_tp(model, dims.tp_mesh())
    if lora is not None:
        apply_lora(model, lora)
    # ac_every_k_blocks 0 is the per-operator policy of selective AC, k >= 1 every k-th block in full.
    apply_ac(model, config.activation_checkpoint, selective=config.ac_every_k_blocks or "op")
    if config.compile:
        apply_compile(model, backend=compile_backend)
    if dims.fsdp_enabled or mixed_precision:
        apply_fsdp(
            model,
            dims.fsdp_mesh(),
            param_dtype=param_dtype,
            reduce_dtype=reduce_dtype,
            reshard_after_forward=config.reshard_after_forward,
            cpu_offload=config.cpu_offload,
        )
    return model
