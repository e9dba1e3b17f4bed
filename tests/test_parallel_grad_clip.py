"""Gradient-norm clipping over DTensor gradients on different meshes equals the single-process computation.

Two gloo ranks hold four gradients: sharded on a 1-D mesh, replicated on that mesh, sharded on a second
(2-D) mesh, and a plain replicated tensor. The total 2-, 1- and inf-norms and the clipped gradients must
match torch.nn.utils.clip_grad_norm_ on the full tensors. (The model-level check, with FSDP and TP
shards of one model, is part of tests/test_parallel_parity.py.)
"""

from __future__ import annotations

import math

import pytest
import torch
from dist_utils import run_ranks
from numerics import cascade_sum_rtol
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from parallel.grad_clip import clip_grad_norm_, total_grad_norm

NORMS = (2.0, 1.0, math.inf)


def _full_grads():
    g = torch.Generator().manual_seed(0)
    return [
        torch.randn(6, 3, generator=g),
        torch.randn(5, generator=g),
        torch.randn(4, 2, generator=g) * 3,
        torch.randn(3, generator=g),
    ]


def _params(rank, world_size):
    mesh_a = init_device_mesh("cpu", (world_size,))
    mesh_b = init_device_mesh("cpu", (world_size, 1), mesh_dim_names=("x", "y"))
    layouts = [(mesh_a, [Shard(0)]), (mesh_a, [Replicate()]), (mesh_b, [Shard(0), Replicate()]), (None, None)]
    params = []
    for grad, (mesh, placements) in zip(_full_grads(), layouts):
        if mesh is None:
            p = torch.nn.Parameter(torch.zeros_like(grad))
            p.grad = grad.clone()
        else:
            p = torch.nn.Parameter(distribute_tensor(torch.zeros_like(grad), mesh, placements))
            p.grad = distribute_tensor(grad.clone(), mesh, placements)
        params.append(p)
    return params


def _worker(rank, world_size):
    out = {}
    for norm_type in NORMS:
        params = _params(rank, world_size)
        norm = total_grad_norm(params, norm_type)
        clipped_norm = clip_grad_norm_(params, max_norm=1.0, norm_type=norm_type)
        grads = [p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad for p in params]
        out[norm_type] = (norm, clipped_norm, grads)
    return out


@pytest.fixture(scope="module")
def results():
    return run_ranks(_worker, 2)


@pytest.mark.parametrize("norm_type", NORMS)
def test_total_norm_and_clipping_match_single_process(results, norm_type):
    ref_params = [torch.nn.Parameter(torch.zeros_like(g)) for g in _full_grads()]
    for p, g in zip(ref_params, _full_grads()):
        p.grad = g.clone()
    ref_norm = torch.nn.utils.clip_grad_norm_(ref_params, max_norm=1.0, norm_type=norm_type)
    assert ref_norm > 1.0  # clipping is active
    # Two fp32 norms of the same n values, each within a cascade sum's bound of the true norm (plus the
    # all-reduce of the ranks' parts and the root: one cascade bound more); the clipped gradients are scaled by
    # max_norm / norm, so they inherit the norm's relative error and one rounding of their own.
    rtol = 3 * cascade_sum_rtol(sum(p.numel() for p in ref_params), torch.float32)
    grad_atol = (rtol + torch.finfo(torch.float32).eps) * max(p.grad.abs().max().item() for p in ref_params)
    for rank_out in results:
        norm, clipped_norm, grads = rank_out[norm_type]
        print(f"norm {norm_type}: sharded {norm.item():.6f} single {ref_norm.item():.6f}")
        assert norm.item() == pytest.approx(ref_norm.item(), rel=rtol)
        assert clipped_norm.item() == pytest.approx(ref_norm.item(), rel=rtol)
        for got, p in zip(grads, ref_params):
            assert (got - p.grad).abs().max() <= grad_atol


def test_single_process_plain_tensors():
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in _full_grads()]
    for p, g in zip(params, _full_grads()):
        p.grad = g.clone()
    flat = torch.cat([g.flatten() for g in _full_grads()])
    rtol = 3 * cascade_sum_rtol(flat.numel(), torch.float32)  # as above: two norms, and the clipping's scale
    assert clip_grad_norm_(params, 0.5).item() == pytest.approx(flat.norm().item(), rel=rtol)
    assert torch.cat([p.grad.flatten() for p in params]).norm().item() == pytest.approx(0.5, rel=rtol)
