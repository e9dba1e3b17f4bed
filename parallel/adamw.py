"""Which kernel steps AdamW. With parallelism.cpu_offload the parameters, gradients and both moments are host
tensors and the step runs on the CPU, where torch's default is its per-tensor loop (no foreach kernels there):
about ten passes over each shard and two shard-sized temporaries. torch's fused CPU kernel makes one pass and
no temporary; it equals the loop within fp32 rounding under FSDP2's CPU offload, checkpoints included
(tests/test_offload_adamw.py), and bench/RESULTS.md gives its speed. On GPUs torch's default (foreach) stays."""

from __future__ import annotations


def fused_adamw(cpu_offload: bool) -> bool | None:
    """torch.optim.AdamW's `fused` for a run: True when its state is offloaded, else None (torch's choice)."""
    return True if cpu_offload else None
