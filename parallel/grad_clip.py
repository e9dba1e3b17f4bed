"""Gradient-norm clipping for parameters sharded by FSDP and/or TP (DTensors, possibly on different meshes).

    total_norm = (sum_p ||g_p||_q^q)^(1/q)        (q = norm_type; q = inf: max_p max|g_p|)
    g_p       <- g_p * min(1, max_norm / (total_norm + 1e-6))

A DTensor's local norm is only a piece of its norm: torch computes the per-tensor norms of a group of
DTensors on one mesh as a DTensor with a partial placement, and `full_tensor()` reduces it across that
mesh (sum of q-th powers, or max). Gradients on different meshes (say, FSDP-only next to FSDP x TP) are
grouped by mesh, each group's norm is reduced on its own mesh, and the groups are combined locally.
The scaling multiplies each rank's local shards in place, which is exact for sharded and replicated
gradients alike.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.distributed.tensor import DTensor


@torch.no_grad()
def total_grad_norm(parameters: Iterable[torch.Tensor], norm_type: float = 2.0) -> torch.Tensor:
    """The q-norm of all gradients, as if every full gradient were concatenated into one vector (a plain tensor)."""
    norm_type = float(norm_type)
    groups: dict[object, list[torch.Tensor]] = {}
    for p in parameters:
        if p.grad is None:
            continue
        key = p.grad.device_mesh if isinstance(p.grad, DTensor) else None
        groups.setdefault(key, []).append(p.grad)
    group_norms = []
    for grads in groups.values():
        norm = torch.nn.utils.get_total_norm(grads, norm_type, foreach=None)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        group_norms.append(norm.float())
    if not group_norms:
        return torch.tensor(0.0)
    return torch.linalg.vector_norm(torch.stack([n.to(group_norms[0].device) for n in group_norms]), norm_type)


@torch.no_grad()
def clip_grad_norm_(parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Scale all gradients so their total norm is at most `max_norm`; returns the norm before clipping (a
    non-finite norm is the caller's to handle: trainer/optimizer.py skips the update)."""
    parameters = list(parameters)
    total = total_grad_norm(parameters, norm_type)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for p in parameters:
        if p.grad is None:
            continue
        grad = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
        grad.mul_(coef.to(grad.device, grad.dtype))
    return total
