"""torch.compile of each transformer block, in place.

Each block is compiled on its own (`block.compile()`): the blocks share one code object, so dynamo traces
one graph and reuses it for every layer; and `Module.compile` keeps the block object itself in the
module tree (it only swaps the call path), so parameter names and checkpoint keys do not gain the
`_orig_mod.` prefix that wrapping in `torch.compile(module)` would add.

Tensor parallelism + compile on torch 2.13: the embedding's row-wise output is an AsyncCollectiveTensor
(the pending result of its reduce-scatter). AOTAutograd replaces such a graph input by its inner tensor,
which has no autograd history, so the compiled first block returns no gradient for its input and the
embedding gets none (the backward then fails inside DTensor). Upstream: the unwrap came with
pytorch/pytorch#179849; the fix that keeps the input's requires_grad is pytorch/pytorch#191113, not in
2.13. We hand the blocks a plain tensor instead: the collective is awaited in eager mode by an identity
autograd function, which keeps the gradient path (`_resolve_async_output`). This is device-independent,
so the guard is always on. tests/test_parallel_compile.py keeps a strict-xfail test of the unguarded path.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor

if TYPE_CHECKING:
    from model.qwen2 import Qwen2


class _AwaitCollective(torch.autograd.Function):
    """Identity on values and gradients; returns the awaited plain tensor instead of the async wrapper."""

    @staticmethod
    def forward(ctx: Any, x: AsyncCollectiveTensor) -> torch.Tensor:  # ctx: autograd's context, unused
        return x.trigger_wait()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


def _resolve_async_output(module: nn.Module, args: tuple[object, ...], output: torch.Tensor) -> torch.Tensor:
    if isinstance(output, AsyncCollectiveTensor):
        return _AwaitCollective.apply(output)
    return output


def apply_compile(model: Qwen2, *, backend: str = "inductor") -> Qwen2:
    """Compile every block of `model.layers` in place (call after TP and activation checkpointing)."""
    model.embed_tokens.register_forward_hook(_resolve_async_output)
    for block in model.layers.values():
        block.compile(backend=backend, fullgraph=True)
    return model
