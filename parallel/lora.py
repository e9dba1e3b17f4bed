"""LoRA (Hu et al., arXiv 2106.09685) on the policy's linear layers, applied from outside the model as the rest of
parallel/ applies parallelism: model/qwen2.py stays plain, and the rollout engines only ever see merged weights.

Each adapted linear y = x W^T + b (W: [out, in]) gains a low-rank term; W and b, and every other weight, are frozen:

    y = x W^T + b + (alpha / r) (x A^T) B^T          A: [r, in], B: [out, r], the only trained parameters

A starts as nn.Linear's default initialisation (Kaiming-uniform with a = sqrt(5), PEFT's), B as zeros, so the adapted
policy starts as the base exactly. The adapters are float32 whatever the base's dtype (model.dtype): they and AdamW's
moments are the trained state; the frozen base may be bfloat16. The engines receive, for every adapted linear,

    W' = W + (alpha / r) B A                          (`merged_parameters`: what the weight sync and the HF export read)

computed in float32 and rounded once to W's dtype, on each rank's part of W: the adapters are gathered whole first,
all of them (small: r x (in + out) per linear; 0.3 GB for the 7B at rank 32), then the term B A is formed whole, one
weight at a time, and each rank adds its part of it, with no further collective.

Where it sits in parallelize_qwen2 (TP -> LoRA -> AC -> compile -> FSDP):
  - tensor parallelism: A and B are DTensors laid out to match the base's plan, so no term is replicated work and
    the forward adds no collective. Column-wise W (Shard(0), q/k/v/gate/up): B is sharded with W's rows and A is
    replicated; each rank computes its own output columns. Row-wise W (Shard(1), o/down): A is sharded with W's
    columns and B replicated; x A^T is then a partial sum on every rank, B keeps it partial, and the term joins the
    base's partial output before the plan's one reduce-scatter. The term is added by a forward hook that runs before
    the plan's output hook (prepend), where the output is still the DTensor of that layout.
  - activation checkpointing and compile wrap the whole block, hooks included.
  - FSDP: A and B are parameters of their block's unit beside the frozen W: gathered with it, and the unit's
    reduce-scatter carries their gradients only (frozen parameters get none, and no optimizer state).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from errors import ConfigError
from parallel.plain_names import plain_name, plain_named_parameters

if TYPE_CHECKING:
    from config.schema import LoRAConfig

ADAPTER_NAMES = ("lora_A", "lora_B")
_SETTINGS = "lora"  # the model's attribute holding its Adapters


@dataclass(frozen=True)
class Adapters:
    """What `apply_lora` put on a model (its `lora` attribute): the settings, and the base checkpoint they adapt."""

    rank: int
    alpha: float
    targets: tuple[str, ...]
    base: str = ""  # the base's HF checkpoint (model.hf_path): checkpoints record it with its content hash

    @property
    def scale(self) -> float:
        """alpha / r, the factor of the low-rank term."""
        return self.alpha / self.rank


def adapters_of(model: nn.Module) -> Adapters | None:
    """The model's adapters' settings, or None for a model trained whole."""
    found = getattr(model, _SETTINGS, None)
    return found if isinstance(found, Adapters) else None


def is_adapter_name(name: str) -> bool:
    """Whether a parameter name is an adapter's ("layers.0.mlp.up_proj.lora_A")."""
    return name.rpartition(".")[2] in ADAPTER_NAMES


def adapted_linears(model: nn.Module, targets: Sequence[str]) -> Iterator[tuple[str, nn.Linear]]:
    """(plain name, module) of the blocks' linears whose own name is one of `targets` ("q_proj", ...), in order."""
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and name.startswith("layers.") and name.rpartition(".")[2] in targets:
            yield plain_name(name), module


def adapter_count(model: nn.Module, rank: int, targets: Sequence[str]) -> int:
    """The number of adapter parameters LoRA of `rank` on `targets` gives `model` (a meta-device one will do)."""
    return sum(rank * (m.in_features + m.out_features) for _, m in adapted_linears(model, targets))


def _new_adapter(weight: torch.Tensor, shape: tuple[int, int], shared_dim: int) -> nn.Parameter:
    """A float32 adapter of `shape` beside `weight` (same device, meta included): under tensor parallelism a DTensor
    sharded as `weight` when the base's plan shards the dimension they share (`shared_dim` of W), else replicated."""
    local = weight.to_local() if isinstance(weight, DTensor) else weight
    full = torch.zeros(shape, dtype=torch.float32, device=local.device)
    if isinstance(weight, DTensor):
        (placement,) = weight.placements  # the 1-D tp mesh: LoRA is applied after TP and before FSDP
        # A [r, in] shares W's dim 1 (in) at its own dim 1, B [out, r] W's dim 0 (out) at its dim 0
        follows = isinstance(placement, Shard) and placement.dim == shared_dim
        layout = [Shard(shared_dim) if follows else Replicate()]
        full = distribute_tensor(full, weight.device_mesh, layout, src_data_rank=None)
    return nn.Parameter(full)


def _add_low_rank_term(
    scale: float, linear: nn.Module, args: tuple[torch.Tensor, ...], output: torch.Tensor
) -> torch.Tensor:
    """Forward hook (with `scale` bound): y + scale (x A^T) B^T, computed in the adapters' dtype (FSDP's compute dtype
    when it gathers them) and added in y's."""
    a, b = linear.get_parameter("lora_A"), linear.get_parameter("lora_B")
    low_rank = F.linear(F.linear(args[0].to(a.dtype), a), b) * scale
    return output + low_rank.to(output.dtype)


def adapters_from(section: LoRAConfig, base: str) -> Adapters | None:
    """The [lora] section's adapters on the base checkpoint `base` (model.hf_path); None when lora.enabled is off."""
    return Adapters(section.rank, section.alpha, tuple(section.targets), base) if section.enabled else None


def apply_lora(model: nn.Module, adapters: Adapters, *, seed: int = 0) -> nn.Module:
    """Freeze every parameter of `model` and give each linear `adapters.targets` names its A and B (module docstring),
    in place; call after tensor parallelism and before FSDP. On a materialised model the adapters are initialised from
    `seed`; on the meta device `reset_adapters` does it once the model is allocated. A rank above a targeted linear's
    narrower side is a ConfigError: the product B A could not have rank r."""
    rank = adapters.rank
    linears = list(adapted_linears(model, adapters.targets))  # the config names known linears only: never empty
    name, narrowest = min(((n, min(m.in_features, m.out_features)) for n, m in linears), key=lambda t: t[1])
    if rank > narrowest:
        raise ConfigError(
            f"lora.rank = {rank} is above the width of {name} ({narrowest}): B A would have rank {narrowest} at most; "
            f"use lora.rank <= {narrowest}"
        )
    model.requires_grad_(False)
    for _, linear in linears:
        linear.register_parameter("lora_A", _new_adapter(linear.weight, (rank, linear.in_features), 1))
        linear.register_parameter("lora_B", _new_adapter(linear.weight, (linear.out_features, rank), 0))
        hook = functools.partial(_add_low_rank_term, adapters.scale)
        linear.register_forward_hook(hook, prepend=True)  # before TP's output hook
    setattr(model, _SETTINGS, adapters)
    if not linears[0][1].weight.is_meta:
        reset_adapters(model, seed)
    return model


@torch.no_grad()
def _copy_full(param: torch.Tensor, full: torch.Tensor) -> None:
    """Set `param` (plain, or this rank's part of a DTensor) to the values of the full tensor `full`."""
    if isinstance(param, DTensor):
        part = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
        param.to_local().copy_(part.to_local())
    else:
        param.copy_(full)


def reset_adapters(model: nn.Module, seed: int) -> None:
    """A from nn.Linear's initialisation (a generator seeded with `seed`, the same full values on every rank, each
    keeping its part), B = 0: the adapted policy is the base."""
    lora = adapters_of(model)
    assert lora is not None, "apply_lora first"
    generator = torch.Generator().manual_seed(seed)
    for _, linear in adapted_linears(model, lora.targets):
        a, b = linear.get_parameter("lora_A"), linear.get_parameter("lora_B")
        init = torch.empty(a.shape, dtype=torch.float32)
        nn.init.kaiming_uniform_(init, a=math.sqrt(5), generator=generator)
        _copy_full(a, init)
        _copy_full(b, torch.zeros(b.shape))


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor: a DTensor gathered (a collective over its mesh; an offloaded shard first goes where its
    mesh communicates), a plain tensor as it is."""
    if not isinstance(tensor, DTensor):
        return tensor
    mesh_device = tensor.device_mesh.device_type
    moved = tensor if tensor.device.type == mesh_device else tensor.to(mesh_device)
    assert isinstance(moved, DTensor)  # .to keeps a DTensor's placements
    return moved.full_tensor()


@torch.no_grad()
def merged_weight(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """W + scale B A on this rank's part of W, from the whole A and B, in float32, rounded once to W's dtype; a
    DTensor of W's layout when W is one. No collective: the term B A is formed whole (one weight's at a time) and each
    rank keeps its part."""
    delta = scale * (b.float() @ a.float())
    if not isinstance(weight, DTensor):
        return (weight.float() + delta.to(weight.device)).to(weight.dtype)
    local = weight.to_local()
    part = distribute_tensor(delta, weight.device_mesh, weight.placements, src_data_rank=None).to_local()
    merged = (local.float() + part.to(local.device)).to(local.dtype)
    return DTensor.from_local(merged, weight.device_mesh, weight.placements, shape=weight.shape, stride=weight.stride())


def merged_parameters(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(plain name, tensor) of the base's parameters, in order, with every adapted weight merged (`merged_weight`)
    and the adapters left out: the weights of a plain model that computes what the adapted one does. A model
    without adapters: its parameters as they are (parallel/plain_names.py). The adapters are gathered whole when it
    is called (collectives, every rank), so that what it yields is local work only: a rank that fails while it
    merges leaves no other rank waiting in a gather."""
    lora = adapters_of(model)
    linears = adapted_linears(model, lora.targets) if lora is not None else ()
    adapted = {name: tuple(full_tensor(m.get_parameter(n).detach()) for n in ADAPTER_NAMES) for name, m in linears}
    return _merged(model, adapted, lora.scale if lora is not None else 0.0)


def _merged(
    model: nn.Module, adapted: dict[str, tuple[torch.Tensor, ...]], scale: float
) -> Iterator[tuple[str, torch.Tensor]]:
    for name, param in plain_named_parameters(model):
        owner, _, leaf = name.rpartition(".")
        if leaf == "weight" and owner in adapted:
            a, b = adapted[owner]
            param = merged_weight(param, a, b, scale)
        if leaf not in ADAPTER_NAMES:
            yield name, param
