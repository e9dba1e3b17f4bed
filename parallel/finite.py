"""Whether a policy's weights (and its optimizer's state) are finite: one fused reduction, one host sync.

    finite(T) <=> ||T||_2 is finite, for every tensor T (a NaN or an infinity in T makes its norm NaN or inf)

`torch._foreach_norm` computes the norms of a whole list of tensors in one fused kernel per device and
dtype; their finiteness is read back with a single host sync. A float32 norm also overflows when |x| >
~1.8e19 (x^2 exceeds the float32 range) although every element is finite; the tensors so flagged, if any,
are checked element by element before anything is reported. Sharded tensors (DTensor: FSDP, TP) are
checked on each rank's local shard, and the ranks agree on the verdict with one all-reduce.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from errors import RunStopped
from parallel.plain_names import plain_name, plain_named_parameters


class NonFiniteStateError(RunStopped, RuntimeError):
    """A policy or optimizer state holds NaN or infinite values; it was not saved or exported."""


def nonfinite_names(named: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
    """Names of the floating-point tensors (this rank's shards) holding a NaN or an infinity, in order."""
    names, tensors = [], []
    for name, tensor in named:
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        if local.is_floating_point() and local.numel():
            names.append(name)
            tensors.append(local.detach())
    if not tensors:
        return []
    groups: dict[tuple, list[int]] = {}
    for i, tensor in enumerate(tensors):
        groups.setdefault((tensor.device, tensor.dtype), []).append(i)
    device = next((t.device for t in tensors if t.device.type != "cpu"), tensors[0].device)
    order, norms = [], []
    for indices in groups.values():
        order += indices
        group_norms = torch._foreach_norm([tensors[i] for i in indices], 2)
        norms.append(torch.stack(group_norms).float().to(device, non_blocking=True))
    flagged = ~torch.cat(norms).isfinite()
    if not bool(flagged.any()):  # the one host sync when everything is finite
        return []
    suspects = sorted(order[int(k)] for k in flagged.nonzero().flatten().tolist())
    return [names[i] for i in suspects if not bool(torch.isfinite(tensors[i]).all())]


def optimizer_state_tensors(model: nn.Module, optimizer: torch.optim.Optimizer) -> Iterable[tuple[str, torch.Tensor]]:
    """(parameter name + "." + state key, tensor) for every tensor in `optimizer`'s per-parameter state."""
    names = {id(param): plain_name(name) for name, param in model.named_parameters()}
    for param, state in optimizer.state.items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                yield f"{names.get(id(param), '?')}.{key}", value


def _distributed() -> bool:
    return dist.is_initialized() and dist.get_world_size() > 1


def count_on_every_rank(local: list[int]) -> list[int]:
    """The sums of the counts `local` over every rank (themselves without a process group)."""
    if not _distributed():
        return list(local)
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    total = torch.tensor(local, dtype=torch.int64, device=device)
    dist.all_reduce(total)
    return total.tolist()


def describe(names: list[str], total: int, what: str) -> str:
    """E.g. "the policy's weights hold NaN or inf in 3 tensors (first: layers.0.self_attn.q_proj.weight)";
    under a process group the count is of the ranks' local shards."""
    kind, where = ("shard", "first on this rank") if _distributed() else ("tensor", "first")
    first = f" ({where}: {names[0]})" if names else " (on another rank)"
    return f"{what} hold NaN or inf in {total} {kind}{'s' if total != 1 else ''}{first}"


def nonfinite_state(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> str | None:
    """None if the model's parameters (and the optimizer's state) are finite on every rank, else what is not.
    One reduction and one host sync on each rank, one all-reduce: every rank calls it."""
    params = list(plain_named_parameters(model))
    state = list(optimizer_state_tensors(model, optimizer)) if optimizer is not None else []
    found = nonfinite_names(params + state)
    param_names = {name for name, _ in params}
    bad_params = [name for name in found if name in param_names]
    bad_state = [name for name in found if name not in param_names]
    total_params, total_state = count_on_every_rank([len(bad_params), len(bad_state)])
    parts = []
    if total_params:
        parts.append(describe(bad_params, total_params, "the policy's weights"))
    if total_state:
        parts.append(describe(bad_state, total_state, "the optimizer's state tensors"))
    return "; ".join(parts) or None
