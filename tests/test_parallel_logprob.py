"""Vocabulary-parallel log-prob/entropy (2 gloo ranks) equals the single-device reference, values and gradients.

Reference: `tests.logprob_reference.naive_token_logprobs` on the full [V, H] head (full fp64 logits + autograd).
Checked for a plain weight slice + process group, and for the DTensor forms the TP model produces
(vocab-sharded weight, sequence-sharded hidden states), with a temperature, a chunk size that does not
divide the token count, targets on both ranks' slices, and the entropy gradient switched on and off.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_ranks
from numerics import assert_close_to_float64
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from parallel.logprob import vocab_parallel_token_logprobs
from tests.logprob_reference import naive_token_logprobs

V, H, B, T = 32, 8, 2, 6


def _inputs(dtype):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(B, T, H, generator=g, dtype=torch.float64).to(dtype)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64).to(dtype)
    targets = torch.randint(0, V, (B, T), generator=g)
    targets[0, :2] = torch.tensor([0, V - 1])  # first and last row of the vocabulary: both ranks own targets
    g_logp = torch.randn(B, T, generator=g, dtype=torch.float64).to(dtype)
    g_ent = torch.randn(B, T, generator=g, dtype=torch.float64).to(dtype)
    return hidden, weight, targets, g_logp, g_ent


def _grads(fn, hidden, weight, targets, g_logp, g_ent, entropy_grad):
    hidden = hidden.detach().requires_grad_()
    weight = weight.detach().requires_grad_()
    logp, ent = fn(hidden, weight, targets, entropy_grad)
    objective = (logp * g_logp).sum() + ((ent * g_ent).sum() if entropy_grad else 0.0)
    gh, gw = torch.autograd.grad(objective, (hidden, weight))
    return logp.detach(), ent.detach(), gh, gw


def _reference(dtype, entropy_grad, compute_dtype=None):
    """The single-device values and gradients for the inputs of `dtype`, computed in `compute_dtype` (default:
    the same dtype; float64 for the float64 value of fp32 inputs)."""
    inputs = _inputs(dtype)
    hidden, weight, targets, g_logp, g_ent = (
        t.to(compute_dtype or dtype) if t.is_floating_point() else t for t in inputs
    )

    def fn(h, w, t, eg):
        return naive_token_logprobs(h, w, t, temperature=0.7, entropy_grad=eg)

    return _grads(fn, hidden, weight, targets, g_logp, g_ent, entropy_grad)


def _sum_over_ranks(grad, world_size):
    """Each rank's gradient w.r.t. the full tensor is non-zero only on its own shard: their sum is the full gradient."""
    parts = [torch.zeros_like(grad) for _ in range(world_size)]
    dist.all_gather(parts, grad.contiguous())
    return sum(parts)


def _worker(rank, world_size):
    out = {}
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    group = mesh.get_group()
    rows = V // world_size
    for dtype in (torch.float64, torch.float32):
        hidden, weight, targets, g_logp, g_ent = _inputs(dtype)
        for entropy_grad in (False, True):
            # Plain slice of the weight + process group; plain full hidden states.
            def plain(h, w, t, eg):
                return vocab_parallel_token_logprobs(
                    h,
                    w[rank * rows : (rank + 1) * rows],
                    t,
                    group,
                    temperature=0.7,
                    chunk_size=5,
                    entropy_grad=eg,
                )

            lp, ent, gh, gw = _grads(plain, hidden, weight, targets, g_logp, g_ent, entropy_grad)
            out[("plain", dtype, entropy_grad)] = (lp, ent, gh, _sum_over_ranks(gw, world_size))

            # DTensors as the TP model produces them: hidden sharded on the sequence, weight on the vocabulary.
            def sharded(h, w, t, eg):
                hd = DTensor.from_local(h.chunk(world_size, dim=1)[rank], mesh, [Shard(1)])
                wd = DTensor.from_local(w[rank * rows : (rank + 1) * rows], mesh, [Shard(0)])
                return vocab_parallel_token_logprobs(hd, wd, t, temperature=0.7, chunk_size=5, entropy_grad=eg)

            lp, ent, gh, gw = _grads(sharded, hidden, weight, targets, g_logp, g_ent, entropy_grad)
            out[("dtensor", dtype, entropy_grad)] = (
                lp,
                ent,
                _sum_over_ranks(gh, world_size),
                _sum_over_ranks(gw, world_size),
            )
    # A head sharded on the hidden dimension is not a vocabulary-parallel head: refused with a clear error.
    hidden, weight, targets, _, _ = _inputs(torch.float32)
    out["wrong placement"] = None
    try:
        vocab_parallel_token_logprobs(hidden, distribute_tensor(weight, mesh, [Shard(1)]), targets)
    except ValueError as e:
        out["wrong placement"] = str(e)
    # Token ids outside the vocabulary: refused with the range found.
    bad = targets.clone()
    bad.view(-1)[0] = V
    try:
        vocab_parallel_token_logprobs(hidden, weight[rank * rows : (rank + 1) * rows], bad, group)
        out["out of range"] = None
    except ValueError as e:
        out["out of range"] = str(e)
    return out


@pytest.fixture(scope="module")
def sharded_results():
    return run_ranks(_worker, 2)


@pytest.mark.parametrize("form", ["plain", "dtensor"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("entropy_grad", [False, True])
def test_vocab_parallel_matches_single_device(sharded_results, form, dtype, entropy_grad):
    ref = _reference(dtype, entropy_grad)
    for rank, results in enumerate(sharded_results):
        got = results[(form, dtype, entropy_grad)]
        errors = [(a - b).abs().max().item() for a, b in zip(got, ref)]
        print(f"{form} {dtype} entropy_grad={entropy_grad} rank {rank}: max |err| logp, entropy, dh, dW = {errors}")
        if dtype == torch.float64:
            # Sums of at most V = 32 terms of size < 10 (H = 8 products each): float64 rounding < 1e-13.
            assert max(errors) < 1e-12, errors
        else:  # within fp32 rounding, measured against the reference in float64 (tests/numerics.py)
            assert_close_to_float64(got, ref, _reference(dtype, entropy_grad, torch.float64), f"{form} rank {rank}")
    assert ref[2].abs().max() > 1e-2 and ref[3].abs().max() > 1e-2  # gradients are not trivially zero


def test_without_tp_group_is_the_single_device_function():
    hidden, weight, targets, _, _ = _inputs(torch.float64)
    a = vocab_parallel_token_logprobs(hidden, weight, targets, temperature=0.7, chunk_size=5)
    b = naive_token_logprobs(hidden, weight, targets, temperature=0.7)
    assert (a[0] - b[0]).abs().max() < 1e-12 and (a[1] - b[1]).abs().max() < 1e-12


def test_rejects_weight_not_sharded_on_vocabulary(sharded_results):
    for results in sharded_results:
        message = results["wrong placement"]
        assert message is not None and "sharded on dim 0" in message, message


def test_rejects_targets_outside_the_vocabulary(sharded_results):
    for results in sharded_results:
        message = results["out of range"]
        assert message is not None and f"must lie in [0, {V}), got range [" in message, message
        assert message.endswith(f", {V}]"), message
