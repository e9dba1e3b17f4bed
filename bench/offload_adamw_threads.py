"""The CPU-offloaded AdamW step on 1 intra-op thread (torchrun's OMP_NUM_THREADS=1) vs N threads.

With parallelism.cpu_offload each rank's fp32 parameters, gradients and AdamW moments live in host memory
and `optimizer.step()` runs on the CPU: torch's AdamW as train.py builds it (trainer/loop.py), which on CPU
tensors is the per-tensor implementation. parallel/cpu_threads.py gives each process the node's cores divided by
its processes when offloading; this measures what that buys.

The state is one transformer block of Qwen2.5-32B as one of 8 FSDP ranks holds it (each tensor's first
dimension split 8 ways: 61M parameters, 0.98 GB of parameters, gradients and moments); the real step
walks 64 such blocks plus the embedding and head shards, 16 times per rollout step. Baseline: 1 thread;
measured: N threads (default: every core this process may use), alternately, best of `--repeats`.
`--fused` adds torch's fused CPU AdamW (not what train.py runs) at both thread counts, for reference.
Prints a table and one JSON line.

    python bench/offload_adamw_threads.py [--threads N] [--repeats 5] [--blocks 1] [--fused]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from model.args import get_preset  # noqa: E402
from model.hf_adapter import hf_shapes  # noqa: E402

RANKS = 8


def block_shards(blocks: int) -> list[torch.Tensor]:
    """fp32 parameters shaped as one FSDP rank's shards of the first `blocks` blocks of Qwen2.5-32B,
    each with a gradient."""
    params = []
    generator = torch.Generator().manual_seed(0)
    for name, shape in hf_shapes(get_preset("qwen2.5-32b")).items():
        layer = name.split(".")[2] if name.startswith("model.layers.") else None
        if layer is None or int(layer) >= blocks:
            continue
        shard = (-(-shape[0] // RANKS), *shape[1:])
        p = torch.nn.Parameter(torch.randn(shard, generator=generator))
        p.grad = torch.randn(shard, generator=generator) * 1e-3
        params.append(p)
    return params


def step_seconds(optimizer: torch.optim.Optimizer, threads: int) -> float:
    torch.set_num_threads(threads)
    start = time.perf_counter()
    optimizer.step()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="N (default: all cores)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--blocks", type=int, default=1)
    parser.add_argument("--fused", action="store_true", help="also time torch's fused CPU AdamW")
    opts = parser.parse_args()

    params = block_shards(opts.blocks)
    count = sum(p.numel() for p in params)
    variants = {"AdamW (train.py's)": {}}
    if opts.fused:
        variants["AdamW fused=True"] = {"fused": True}
    rows = []
    for label, extra in variants.items():
        optimizer = torch.optim.AdamW(params, lr=1e-6, weight_decay=0.1, **extra)
        step_seconds(optimizer, 1)  # the moments are allocated at the first step: not timed
        times = {1: [], opts.threads: []}
        for _ in range(opts.repeats):
            for threads in times:
                times[threads].append(step_seconds(optimizer, threads))
        rows.append((label, min(times[1]), min(times[opts.threads])))
        del optimizer

    print(
        f"AdamW step over {count / 1e6:.0f}M fp32 parameters ({len(params)} tensors: {opts.blocks} block(s) of "
        f"Qwen2.5-32B as 1 of {RANKS} FSDP ranks holds them); best of {opts.repeats}; "
        f"{len(os.sched_getaffinity(0))} cores here"
    )
    print(f"{'optimizer':<22}{'1 thread s':>12}{f'{opts.threads} threads s':>14}{'speed-up':>10}{'GB/s at N':>11}")
    state_bytes = count * 4 * 4  # parameters, gradients and two moments, read (and three written) per step
    for label, one, many in rows:
        print(f"{label:<22}{one:>12.3f}{many:>14.3f}{one / many:>9.2f}x{state_bytes / many / 1e9:>11.1f}")
    print(
        json.dumps(
            {
                "bench": "offload_adamw_threads",
                "parameters": count,
                "threads": opts.threads,
                "cores": len(os.sched_getaffinity(0)),
                "rows": [
                    {"optimizer": label, "one_s": one, "n_s": many, "speedup": one / many} for label, one, many in rows
                ],
            }
        )
    )


if __name__ == "__main__":
    main()
