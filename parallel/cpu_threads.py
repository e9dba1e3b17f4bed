"""Intra-op CPU threads per process: what the CPU-offloaded optimizer runs on.

torchrun sets OMP_NUM_THREADS=1 in every process it starts (when the variable is unset and there is more
than one process per node), so torch uses one intra-op thread. With parallelism.cpu_offload the AdamW step
runs on the CPU over each rank's shard of the fp32 state (4.1B parameters per rank for Qwen2.5-32B on 8
ranks, once per mini-batch): on one thread it leaves every other core of the node idle
(bench/offload_adamw_threads.py). So, when offloading, each process takes its share of the node's cores.

    job.cpu_threads > 0                     that many (the configuration wins)
    OMP_NUM_THREADS set to more than 1      left as it is (torchrun itself only ever sets 1)
    parallelism.cpu_offload                 the node's cores // the processes on this node (at least 1)
    otherwise                               torch's default (under torchrun: 1)

The node's cores are those this process may run on (its CPU affinity): all of the machine's, or the
allotment of a container or a Slurm job, which every process of the node shares. A launcher that pins each
rank to its own share already (numactl, Slurm's --cpu-bind) gets a smaller count than it could use; set
job.cpu_threads there.
"""

from __future__ import annotations

import os
from collections.abc import Mapping


def intra_op_threads(
    configured: int,
    *,
    cpu_offload: bool,
    node_cores: int,
    local_processes: int,
    omp_num_threads: str | None,
) -> tuple[int | None, str]:
    """(threads to set, or None to keep torch's default; why), by the rules of the module docstring."""
    if configured > 0:
        return configured, "job.cpu_threads"
    if omp_num_threads and omp_num_threads.strip().isdigit() and int(omp_num_threads) > 1:
        return None, f"OMP_NUM_THREADS={omp_num_threads.strip()}"
    if not cpu_offload:
        return None, "torch's default (job.cpu_threads = 0, no CPU offload)"
    threads = max(1, node_cores // max(1, local_processes))
    return threads, f"{node_cores} cores / {local_processes} processes on this node, for the CPU-offloaded optimizer"


def set_intra_op_threads(
    configured: int, *, cpu_offload: bool, environ: Mapping[str, str] | None = None
) -> tuple[int, str]:
    """Apply `intra_op_threads` to this process (torch.set_num_threads); returns (threads now, why)."""
    import torch

    environ = os.environ if environ is None else environ
    threads, why = intra_op_threads(
        configured,
        cpu_offload=cpu_offload,
        node_cores=len(os.sched_getaffinity(0)),
        local_processes=int(environ.get("LOCAL_WORLD_SIZE", "1")),
        omp_num_threads=environ.get("OMP_NUM_THREADS"),
    )
    if threads is not None:
        torch.set_num_threads(threads)
    return torch.get_num_threads(), why
