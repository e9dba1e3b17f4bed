"""Activation checkpointing of transformer blocks, applied in place (parameter names do not change).

Modes:
  - "none":      keep every activation.
  - "full":      keep only each block's inputs; the whole block is recomputed in the backward.
  - "selective": either per operator ("op": keep the outputs of matmuls and attention, the expensive
                 ops, and recompute the cheap elementwise ones: norms, SiLU, rotary, residual adds), or
                 per block ("every k": full checkpointing of every k-th block only).

The block's `forward` is replaced by a checkpointed call of the original one, instead of wrapping the
block in another module, so `named_parameters()` and checkpoint keys stay `layers.N....` and compile and
FSDP (applied afterwards, to the same block) see an ordinary module.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

if TYPE_CHECKING:
    from model.qwen2 import Qwen2

# What checkpoint's `context_fn` returns: the contexts of the forward and of its recomputation.
ContextFn = Callable[[], tuple[AbstractContextManager, AbstractContextManager]]

AC_MODES = ("none", "full", "selective")

# Outputs worth keeping under per-op selective checkpointing: recomputing them costs real FLOPs.
_SAVE_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.aten._scaled_dot_product_attention_math.default,
    torch.ops.higher_order.flex_attention,  # packed rows on GPU
    # Collectives under tensor parallelism: recomputing them would repeat the communication.
    torch.ops._c10d_functional.reduce_scatter_tensor.default,
    torch.ops._c10d_functional.all_gather_into_tensor.default,
    torch.ops._c10d_functional.all_reduce.default,
}


def _op_policy(ctx: object, op: object, *args: object, **kwargs: object) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_context() -> tuple[AbstractContextManager, AbstractContextManager]:
    return create_selective_checkpoint_contexts(_op_policy)


def _checkpoint_forward(block: nn.Module, context_fn: ContextFn | None = None) -> None:
    original = block.forward  # bound method of the block's class

    @functools.wraps(original)
    def forward(*args: Any, **kwargs: Any) -> torch.Tensor:  # the block's own arguments, passed on unchanged
        # preserve_rng_state=False: the blocks draw no random numbers (no dropout), so the RNG
        # bookkeeping would be pure overhead. Without a context_fn, checkpoint's default is left out: dynamo
        # (torch 2.13) cannot trace a checkpoint given its default noop_context_fn explicitly.
        extra: dict[str, Any] = {} if context_fn is None else {"context_fn": context_fn}
        return checkpoint(original, *args, use_reentrant=False, preserve_rng_state=False, **extra, **kwargs)

    block.forward = forward


def apply_ac(model: Qwen2, mode: str = "none", *, selective: str | int = "op") -> Qwen2:
    """Checkpoint `model.layers` in place.

    mode: "none" | "full" | "selective". selective: "op" (per-operator policy) or a positive integer k
    (as int or string) to fully checkpoint every k-th block (blocks 0, k, 2k, ...).
    """
    if mode not in AC_MODES:
        raise ValueError(f"activation checkpointing mode must be one of {AC_MODES}, got {mode!r}")
    if mode == "none":
        return model
    every = 1 if mode == "full" or selective == "op" else int(selective) if str(selective).isdigit() else 0
    if every < 1:
        raise ValueError(
            f"selective activation checkpointing takes 'op' or a positive block interval, got {selective!r}"
        )
    context_fn = _selective_context if mode == "selective" and selective == "op" else None
    for layer_id, block in model.layers.items():
        if int(layer_id) % every == 0:
            _checkpoint_forward(block, context_fn)
    return model
