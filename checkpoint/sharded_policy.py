"""The policy on a device mesh, holding only this rank's shards, filled from a checkpoint or a preset.

    1. the module on the meta device (no memory anywhere);
    2. parallelize_qwen2 (TP, AC, compile, FSDP) on the meta parameters;
    3. to_empty: only this rank's shards are allocated (in host memory with cpu_offload);
    4. the values: from a checkpoint, each rank reads only the rows of its own shards, one tensor at a time
       (checkpoint/hf_load.py); a preset's seeded initialisation is built whole on the CPU, copied into the
       shards and dropped (presets are the small models of tests and demos).

Nothing full-size ever reaches the GPU, so an engine started afterwards sizes its KV pool from what the
trainer really keeps (SGLang sizes it from the memory free when it starts); and no rank holds a full-size
checkpoint in host memory. Steps 1-3 are `shard_policy` (the rehearsal stops there: it needs no values),
step 4 `fill_policy`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

from checkpoint.hf_load import load_hf_shards
from model.args import ModelArgs, get_preset
from model.hf import checkpoint_layout, load_hf, nonfinite_weights_error
from model.hf_adapter import DTYPES, read_hf_config, to_hf_name
from model.qwen2 import Qwen2, build_model
from parallel.lora import adapters_from, adapters_of, reset_adapters
from parallel.parallelize import parallelize_qwen2

if TYPE_CHECKING:
    from config.schema import LoRAConfig, ModelConfig, ParallelismConfig
    from parallel.dist_env import DistEnv


def build_policy(model_cfg: ModelConfig, device: torch.device, *, seed: int) -> torch.nn.Module:
    """The policy in its training dtype on `device`: an HF checkpoint, or a preset with random weights
    initialised from `seed` (job.seed)."""
    dtype = DTYPES[model_cfg.dtype]
    if model_cfg.hf_path:
        model = load_hf(model_cfg.hf_path, dtype=dtype, device=device)
    else:
        model = build_model(get_preset(model_cfg.preset), device=device, dtype=dtype, seed=seed)
    model.attention_backend = model_cfg.attention_backend
    return model


def policy_args(model: ModelConfig) -> ModelArgs:
    """The policy's architecture: the checkpoint's config.json, or the preset."""
    if model.hf_path:
        return read_hf_config(model.hf_path)
    return get_preset(model.preset)


@torch.no_grad()
def copy_into_shards(model: torch.nn.Module, full_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Copy (name, full tensor) pairs into `model`'s parameters, each rank keeping only its own part.

    A sharded parameter (a DTensor: FSDP, TP or both) takes the slice its placements give this rank,
    cut locally from the full tensor every rank holds (src_data_rank=None: no communication).
    """
    from torch.distributed.tensor import DTensor, distribute_tensor

    params = dict(model.named_parameters())
    for name, full in full_tensors:
        param = params.pop(name)
        if isinstance(param, DTensor):
            part = distribute_tensor(full.to(param.dtype), param.device_mesh, param.placements, src_data_rank=None)
            param.to_local().copy_(part.to_local())
        else:
            param.copy_(full)
    if params:
        raise ValueError(f"no values for {len(params)} parameters, e.g. {sorted(params)[:3]}")


def shard_policy(
    model_cfg: ModelConfig, parallelism: ParallelismConfig, dist_env: DistEnv, lora: LoRAConfig | None = None
) -> Qwen2:
    """Steps 1-3: the parallelised policy with this rank's shards allocated, their values not yet set; with
    lora.enabled, the base frozen and adapters added (parallel/lora.py)."""
    dtype = DTYPES[model_cfg.dtype]
    with torch.device("meta"):
        model = Qwen2(policy_args(model_cfg)).to(dtype)
    model.attention_backend = model_cfg.attention_backend
    adapters = adapters_from(lora, model_cfg.hf_path) if lora is not None else None
    parallelize_qwen2(model, dist_env.mesh, dist_env.dims, parallelism, lora=adapters)
    model.to_empty(device="cpu" if parallelism.cpu_offload else dist_env.device)
    return model


def fill_policy(model: Qwen2, model_cfg: ModelConfig, *, seed: int) -> None:
    """Step 4: this rank's shards from the checkpoint's rows, or from the preset's initialisation at `seed`; the
    adapters, if any, from their initialisation at `seed`."""
    if model_cfg.hf_path:
        load_hf_shards(model, model_cfg.hf_path)
        if adapters_of(model) is not None:
            reset_adapters(model, seed)
        _refuse_nonfinite_checkpoint(model, model_cfg.hf_path)
        return
    source = build_policy(model_cfg, torch.device("cpu"), seed=seed)
    copy_into_shards(model, ((name, p.detach()) for name, p in source.named_parameters()))
    del source


def _refuse_nonfinite_checkpoint(model: Qwen2, path: str) -> None:
    """A NaN or inf the ranks read into their shards, named (file, tensor) on every rank: CheckpointError.
    One fused check of this rank's shards (parallel/finite.py), then every rank learns the first one found."""
    import torch.distributed as dist

    from parallel.finite import nonfinite_names
    from parallel.plain_names import plain_named_parameters

    mine = nonfinite_names(plain_named_parameters(model))[:1]
    found: list[list[str] | None] = [mine]
    if dist.is_initialized() and dist.get_world_size() > 1:
        found = [None] * dist.get_world_size()
        dist.all_gather_object(found, mine)
    first = next((names[0] for names in found if names), None)
    if first is not None:
        hf_name = to_hf_name(first)
        raise nonfinite_weights_error(checkpoint_layout(path, model.args).files[hf_name], hf_name)


def build_sharded_policy(
    model_cfg: ModelConfig,
    parallelism: ParallelismConfig,
    dist_env: DistEnv,
    *,
    seed: int,
    lora: LoRAConfig | None = None,
) -> Qwen2:
    """The policy, parallelised, holding only this rank's shards, filled (steps 1-4 above)."""
    model = shard_policy(model_cfg, parallelism, dist_env, lora)
    fill_policy(model, model_cfg, seed=seed)
    return model
