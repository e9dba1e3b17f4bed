"""FSDP2 (`fully_shard`) for the Qwen2 module.

Units (each one all-gather before use and one reduce-scatter of its gradients):
  - each transformer block;
  - the embedding table (untied models);
  - the root: final norm, output head, and the embedding when tied.

The root unit is never resharded after the forward: the trainer computes log-probs from the final hidden
states and `model.output_weight()` *after* `model(...)` returns (chunked, see parallel/logprob.py), so
the head (and, when tied, the embedding table, used at both ends of the model) must stay gathered until
the backward has accumulated both of its uses. The root's gradients are reduced at the end of the
backward, after every use has contributed.

Gradient reduction is a plain SUM over data-parallel ranks (divide factor 1). The DAPO token-level loss
of every micro-batch is already divided by the token count of the whole mini-batch across all ranks
(rl/loss.py: loss = sum(token losses) / global_num_tokens), so the sum of per-rank gradients is exactly
the gradient of the global token mean; FSDP's default average would divide it by dp a second time.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from model.qwen2 import Qwen2


def apply_fsdp(
    model: Qwen2,
    dp_mesh: DeviceMesh,
    *,
    param_dtype: torch.dtype = torch.bfloat16,
    reduce_dtype: torch.dtype = torch.float32,
    reshard_after_forward: bool = True,
    cpu_offload: bool = False,
) -> Qwen2:
    """Shard `model` in place over `dp_mesh` (1-D: FSDP; 2-D (replicate, shard): HSDP).

    param_dtype: dtype of gathered parameters for compute (bf16 on GPUs; the sharded master copy keeps
        the model's dtype, fp32).
    reduce_dtype: dtype of the gradient reduction (fp32: the sum over ranks loses no precision to bf16).
    reshard_after_forward: free gathered block parameters after each block's forward (re-gathered in
        backward) to save memory; the last block is kept, since the backward needs it first.
    cpu_offload: keep sharded parameters, gradients and optimizer state in host memory (CUDA only).
    """
    if dp_mesh.device_type == "cpu" and cpu_offload:
        raise ValueError("cpu_offload needs a CUDA mesh: on a CPU mesh the parameters already live in host memory")
    mp_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    offload = CPUOffloadPolicy(pin_memory=True) if cpu_offload else OffloadPolicy()

    def shard(module: nn.Module, reshard: bool) -> None:
        fully_shard(module, mesh=dp_mesh, mp_policy=mp_policy, offload_policy=offload, reshard_after_forward=reshard)

    if model.lm_head is not None:
        shard(model.embed_tokens, reshard_after_forward)
    blocks = list(model.layers.values())
    for i, block in enumerate(blocks):
        # The last block's parameters are the first the backward needs: resharding them would only
        # trigger an immediate re-gather.
        shard(block, reshard_after_forward and i < len(blocks) - 1)
    shard(model, False)
    set_gradient_sum(model)
    return model


def set_gradient_sum(model: nn.Module) -> None:
    """Make every FSDP unit SUM gradients over data-parallel ranks instead of averaging them.

    Forcing SUM-only collectives (instead of a pre-multiplied sum with factor 1) keeps the reduction a
    plain sum on every backend, gloo included.
    """
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)


def reshard_gathered(model: nn.Module) -> None:
    """Put every FSDP unit back in its sharded state, so `named_parameters()` yields the fp32 master shards.

    Units built with reshard_after_forward=False (the root, the last block) stay gathered after a forward
    that has no backward (a no-grad log-prob pass, an evaluation): their parameters are then the gathered
    low-precision copies, and whoever reads them (weight sync, checkpoint, export) would get bf16-rounded
    weights. Cheap when every unit is already sharded.
    """
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
