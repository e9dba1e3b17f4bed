"""The fused CPU AdamW kernel (parallel/adamw.py) against the per-tensor loop torch runs by default on host
tensors, under FSDP2's CPU offload on 2 gloo ranks: parameters, both moments and the step count after steps
with a linear warm-up and gradient clipping (the same clipped gradients go to both), and checkpoints saved
under one kernel and loaded under the other.

Tolerance, derived (first order in u = 2^-24, fp32's unit roundoff). Both kernels evaluate, per element,
    p <- p (1 - lr wd);  m <- m + (1 - b1)(g - m);  v <- b2 v + (1 - b2) g^2
    d  = sqrt(v) / sqrt(1 - b2^t) + eps;  p <- p - (lr / (1 - b1^t)) m / d
each result rounded to fp32 after at most: 4 roundings for m (the fp32 weight 1 - b1, g - m, the product, the
sum), 4 for v (b2 and 1 - b2 rounded, three products and a sum of positive terms), 4 for d (sqrt, the rounded
sqrt(1 - b2^t), the division, + eps), 3 for the update (its rounded step size, a product, a division) and 3 for
p (the rounded 1 - lr wd, the product, the difference); the two kernels differ only in the order of these
operations (aten/src/ATen/native/cpu/FusedAdamKernel.cpp; torch/optim/adam.py _single_tensor_adam). With
exact values m, v, d, U (the update), p from a float64 run of the same recurrence on the same gradients, each
kernel's error obeys
    E_m' = b1 E_m + 2u (|m| + |g|)            (|g - m| (1 - b1) 3u + |m'| u <= 2u (|m| + |g|))
    E_v' = b2 E_v + 4u v'                      (terms of one sign: a relative error)
    E_U  = step_size E_m' / d + |U| (E_v' / (2 v') + 4u + 3u)
    E_p' = (1 - lr wd) E_p + 2u |p| + u |p'| + E_U
so the two kernels differ by at most 2 E and each differs from float64 by at most E, element by element.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from dist_utils import run_ranks
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard
from torch.optim.optimizer import _default_to_fused_or_foreach

from checkpoint.manager import CheckpointManager
from config.schema import OptimizerConfig
from model.args import PRESETS
from model.qwen2 import build_model
from parallel.adamw import fused_adamw
from parallel.fsdp import set_gradient_sum
from parallel.grad_clip import clip_grad_norm_
from trainer.optimizer import build_optimizer

U = 2.0**-24
OPT = OptimizerConfig(lr=2e-2, warmup_steps=3, weight_decay=0.1, grad_clip=0.5)


def _offloaded_model(mesh):
    """The tiny Qwen2 sharded as parallel/fsdp.py shards it, with FSDP2's CPU offload (not pinned: that needs
    CUDA; parallel/fsdp.py refuses offload on a CPU mesh only because the state is in host memory anyway)."""
    model = build_model(PRESETS["tiny"], seed=0)
    policy = CPUOffloadPolicy(pin_memory=False)
    for unit in (model.embed_tokens, *model.layers.values(), model):
        fully_shard(unit, mesh=mesh, offload_policy=policy)
    set_gradient_sum(model)
    return model


def _side(mesh, fused):
    """(model, AdamW, warm-up schedule) as trainer/optimizer.py build_optimizer makes them; fused: with the
    kernel parallel/adamw.py chooses under offload (else torch's default, the per-tensor loop on CPU)."""
    model = _offloaded_model(mesh)
    optimizer, schedule = build_optimizer(
        model.parameters(), OPT, fused=fused_adamw(cpu_offload=True) if fused else None
    )
    return model, optimizer, schedule


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


class Reference:
    """AdamW's recurrence in float64 on this rank's shards, and the fp32 error bound E of each quantity."""

    def __init__(self, params, exp_avgs, exp_avg_sqs, step):
        self.p = [_local(x).detach().double() for x in params]
        self.m = [_local(x).double() for x in exp_avgs]
        self.v = [_local(x).double() for x in exp_avg_sqs]
        self.e = {name: [torch.zeros_like(x) for x in self.p] for name in ("p", "m", "v")}
        self.t = step

    def step(self, grads, lr):
        (b1, b2), eps, wd = OPT.betas, OPT.eps, OPT.weight_decay
        self.t += 1
        size = lr / (1 - b1**self.t)
        for i, g in enumerate(grads):
            g, p, m, v = _local(g).double(), self.p[i], self.m[i], self.v[i]
            m2, v2 = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g
            d = v2.sqrt() / math.sqrt(1 - b2**self.t) + eps
            update = size * m2 / d
            p2 = p * (1 - lr * wd) - update
            e = self.e
            e["m"][i] = b1 * e["m"][i] + 2 * U * (m.abs() + g.abs())
            e["v"][i] = b2 * e["v"][i] + 4 * U * v2
            relative_d = torch.where(v2 > 0, e["v"][i] / (2 * v2), 0.0) + 4 * U
            e_update = size * e["m"][i] / d + update.abs() * (relative_d + 3 * U)
            e["p"][i] = (1 - lr * wd) * e["p"][i] + 2 * U * p.abs() + U * p2.abs() + e_update
            self.p[i], self.m[i], self.v[i] = p2, m2, v2


def _state(model, optimizer):
    params = list(model.parameters())
    states = [optimizer.state[p] for p in params]
    return {
        "p": [_local(p).detach() for p in params],
        "m": [_local(s["exp_avg"]) for s in states],
        "v": [_local(s["exp_avg_sq"]) for s in states],
        "step": [float(s["step"]) for s in states],
    }


def _worst(a, b, bound):
    """max |a - b| / bound over every element (0 where both are equal)."""
    ratios = [
        ((x.double() - y.double()).abs() / torch.clamp(e, min=1e-300)).max().item() for x, y, e in zip(a, b, bound)
    ]
    return max(ratios)


def _run(sides, reference, steps, rank, first):
    """`steps` updates of every side on the first side's clipped gradients (each rank its own batch); returns
    the gradient norms before clipping."""
    norms = []
    leader = sides[0][0]
    for step in range(first, first + steps):
        generator = torch.Generator().manual_seed(1000 * step + rank)
        tokens = torch.randint(0, 256, (2, 16), generator=generator)
        logits = leader(tokens[:, :-1])
        F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten()).backward()
        norms.append(clip_grad_norm_(list(leader.parameters()), OPT.grad_clip).item())
        grads = [p.grad for p in leader.parameters()]
        for model, _, _ in sides[1:]:
            for p, g in zip(model.parameters(), grads):
                p.grad = g.detach().clone()
        reference.step(grads, sides[0][1].param_groups[0]["lr"])
        for _, optimizer, schedule in sides:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            schedule.step()
    return norms


def _compare(per_tensor, fused, reference):
    a, b = _state(*per_tensor[:2]), _state(*fused[:2])
    worst = {}
    for name in ("p", "m", "v"):
        exact = getattr(reference, name)
        bound = reference.e[name]
        worst[name] = (
            _worst(a[name], b[name], [2 * e for e in bound]),
            _worst(a[name], exact, bound),
            _worst(b[name], exact, bound),
        )
    assert a["step"] == b["step"] == [float(reference.t)] * len(a["step"])
    return worst


def _kernels_worker(rank, world, folder):
    mesh = init_device_mesh("cpu", (world,))
    per_tensor, fused = _side(mesh, fused=False), _side(mesh, fused=True)
    params = list(per_tensor[0].parameters())
    assert not _default_to_fused_or_foreach(params, False, False)[1]  # today's: the per-tensor loop
    zeros = [torch.zeros_like(_local(p)) for p in params]
    reference = Reference(params, zeros, zeros, 0)
    norms = _run([per_tensor, fused], reference, 6, rank, first=0)
    results = {"fresh": _compare(per_tensor, fused, reference), "norms": norms}
    # Checkpoints: each kernel's, after those 6 steps, loaded under both kernels; 3 more steps from there.
    for name, (model, optimizer, schedule) in (("per-tensor", per_tensor), ("fused", fused)):
        CheckpointManager(f"{folder}/{name}").save(6, model, optimizer, schedule, train_state={})
    for name, saved in (("per-tensor", per_tensor), ("fused", fused)):
        loaded = [_side(mesh, fused=False), _side(mesh, fused=True)]
        for model, optimizer, schedule in loaded:
            CheckpointManager(f"{folder}/{name}").load(6, model, optimizer, schedule)
            got, want = _state(model, optimizer), _state(*saved[:2])
            assert all(torch.equal(x, y) for key in "pmv" for x, y in zip(got[key], want[key]))
            assert got["step"] == want["step"] and schedule.last_epoch == saved[2].last_epoch
        assert [opt.param_groups[0]["fused"] for _, opt, _ in loaded] == [None, True]  # each keeps its kernel
        state = _state(*saved[:2])
        reference = Reference(state["p"], state["m"], state["v"], 6)
        _run(loaded, reference, 3, rank, first=6)
        results[f"from {name}"] = _compare(*loaded, reference)
    return results


@pytest.mark.multiprocess
def test_fused_offloaded_adamw_equals_the_per_tensor_step_within_fp32_rounding(tmp_path):
    for result in run_ranks(_kernels_worker, 2, str(tmp_path), timeout=300):
        assert max(result["norms"]) > OPT.grad_clip  # clipping binds on some steps
        for case in ("fresh", "from per-tensor", "from fused"):
            for name, (between, per_tensor, fused) in result[case].items():
                assert between <= 1 and per_tensor <= 1 and fused <= 1, (case, name, result[case])


def _step_temporaries(rank, world):
    """The resident memory a second AdamW step adds beyond its state, per kernel, on shards of 64, 32 and 4 MiB."""
    from host_memory import peak, reset_peak, return_freed_memory_at_once

    return_freed_memory_at_once()
    extra = {}
    for fused in (None, True):
        params = [torch.nn.Parameter(torch.randn(shape)) for shape in ((4096, 4096), (2048, 4096), (1024, 1024))]
        for p in params:
            p.grad = torch.randn_like(p)
        optimizer = torch.optim.AdamW(params, fused=fused)
        optimizer.step()  # the moments are allocated at the first step
        start = reset_peak()
        optimizer.step()
        extra["fused" if fused else "per-tensor"] = peak() - start
        del optimizer, params
    return extra


@pytest.mark.multiprocess
def test_the_fused_step_makes_no_temporaries_where_the_loop_makes_two_of_the_largest_shard():
    """What the host ledger counts beside the moments in the offloaded step (preflight/host_ledger.py), measured
    in a fresh process: the per-tensor loop holds two tensors of the largest shard at once (sqrt(v), then its
    quotient), the fused kernel none (1 MiB of slack either way: allocator pages, pages the kernel reclaims)."""
    (extra,) = run_ranks(_step_temporaries, 1, start="spawn")
    largest = 4096 * 4096 * 4
    assert abs(extra["per-tensor"] - 2 * largest) <= 1 << 20
    assert extra["fused"] <= 1 << 20
