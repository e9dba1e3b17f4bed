"""The CPU-offloaded AdamW step: torch's per-tensor loop (the default on host tensors) vs its fused CPU kernel
(parallel/adamw.py, what train.py takes with cpu_offload) and foreach, each on 1 intra-op thread (torchrun's
OMP_NUM_THREADS=1) and on N threads.

With parallelism.cpu_offload each rank's fp32 parameters, gradients and AdamW moments live in host memory
and `optimizer.step()` runs on the CPU. parallel/cpu_threads.py gives each process the node's cores divided by
its processes when offloading; this measures what the kernel and the threads buy.

The state is one transformer block of Qwen2.5-32B as one of 8 FSDP ranks holds it (each tensor's first
dimension split 8 ways: 61M parameters, 0.98 GB of parameters, gradients and moments); the real step
walks 64 such blocks plus the embedding and head shards, 16 times per rollout step. Baseline: the per-tensor
loop; every kernel at 1 thread and at N threads (default: every core this process may use), alternately,
best of `--repeats`. Prints a table (seconds per step, and per GB of fp32 parameters) and one JSON line.

    python bench/offload_adamw_threads.py [--threads N] [--repeats 5] [--blocks 1]
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


KERNELS = {"per-tensor (torch's default)": {"foreach": False}, "fused": {"fused": True}, "foreach": {"foreach": True}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="N (default: all cores)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--blocks", type=int, default=1)
    opts = parser.parse_args()

    params = block_shards(opts.blocks)
    count = sum(p.numel() for p in params)
    rows = []
    for label, kernel in KERNELS.items():
        optimizer = torch.optim.AdamW(params, lr=1e-6, weight_decay=0.1, **kernel)
        step_seconds(optimizer, 1)  # the moments are allocated at the first step: not timed
        times: dict[int, list[float]] = {1: [], opts.threads: []}
        for _ in range(opts.repeats):
            for threads in times:
                times[threads].append(step_seconds(optimizer, threads))
        rows.append((label, min(times[1]), min(times[opts.threads])))
        del optimizer

    gb = count * 4 / 1e9  # fp32 parameters
    print(
        f"AdamW step over {count / 1e6:.0f}M fp32 parameters ({len(params)} tensors: {opts.blocks} block(s) of "
        f"Qwen2.5-32B as 1 of {RANKS} FSDP ranks holds them); best of {opts.repeats}; "
        f"{len(os.sched_getaffinity(0))} cores here"
    )
    print(
        f"{'kernel':<30}{'1 thread s':>12}{f'{opts.threads} threads s':>14}{'s/GB, 1 thread':>16}{'vs per-tensor':>15}"
    )
    base = rows[0][1]
    for label, one, many in rows:
        print(f"{label:<30}{one:>12.3f}{many:>14.3f}{one / gb:>16.3f}{base / one:>14.1f}x")
    print(
        json.dumps(
            {
                "bench": "offload_adamw_threads",
                "parameters": count,
                "threads": opts.threads,
                "cores": len(os.sched_getaffinity(0)),
                "rows": [
                    {"kernel": label, "one_s": one, "n_s": many, "s_per_gb_one": one / gb, "speedup_one": base / one}
                    for label, one, many in rows
                ],
            }
        )
    )


if __name__ == "__main__":
    main()
