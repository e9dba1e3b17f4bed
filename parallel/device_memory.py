"""Hand the trainer's cached GPU memory back before the colocated engine takes memory.

PyTorch's caching allocator keeps every block it ever used (the training peak: activations, gathered
FSDP units, optimizer temporaries) reserved after the tensors are gone. The engine is another process:
it cannot use those blocks, and SGLang maps its weights and KV pool back with `resume_memory_occupation`
(and sizes its KV pool at start from the memory free then). So before the engine starts or resumes,
every rank waits for its queued kernels, empties the cache, and all ranks agree (a barrier) that this
is done: an engine spans the GPUs of several trainer ranks. The barrier is on the gloo control group
(DistEnv.barrier): it waits for the slowest rank's load or step, not for a kernel, and allocates no device
memory right after the cache was emptied.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from parallel.dist_env import DistEnv

_observers: list[Callable[[], object]] = []  # called after each return (the rehearsal's ledger records it)


def return_cached_memory(dist_env: DistEnv) -> None:
    """synchronize + empty_cache on this rank's GPU, then a barrier over all ranks (on gloo)."""
    if dist_env.device.type == "cuda":
        torch.cuda.synchronize(dist_env.device)
        torch.cuda.empty_cache()
    dist_env.barrier()
    for observer in _observers:
        observer()


@contextlib.contextmanager
def observe_cache_returns(fn: Callable[[], object]) -> Iterator[None]:
    """Call `fn()` after every return_cached_memory inside the block."""
    _observers.append(fn)
    try:
        yield
    finally:
        _observers.remove(fn)
