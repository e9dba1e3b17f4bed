"""Tensor parallelism (Megatron-style, with sequence parallelism) for the Qwen2 module, as a plan of data.

Layout of activations between modules (tp ranks, sequence length T):

    tokens (replicated) -> embed_tokens [row-wise: vocab-sharded table]  -> h sharded on the sequence (Shard(1))
    input_layernorm     [sequence parallel: each rank normalises its T/tp tokens]
    self_attn           [input all-gathered to the full sequence]
        q/k/v_proj      [column-wise: each rank computes its heads; biases sharded with the rows]
        o_proj          [row-wise: partial sums reduce-scattered back to sequence shards]
    post_attention_layernorm [sequence parallel]
    mlp                 [input all-gathered]; gate/up column-wise, down row-wise (reduce-scatter)
    norm                [sequence parallel; output kept as a DTensor so the log-prob can gather it]
    lm_head             [column-wise, output left vocab-sharded: Shard(-1) logits]

Rotary tables are computed in the model's forward from the (replicated) full positions and reach the
attention module untouched, which sees the full sequence after its input all-gather, so nothing about
RoPE changes. Attention heads are derived from the local projection width (`view(b, t, -1, head_dim)`),
so each rank attends over its own heads with no further communication. Document masks for packed rows
are built from the replicated document ids, also full-sequence.

Tied embeddings: the row-wise embedding table and the column-wise head are the same [V, H] matrix
sharded the same way (rows = vocabulary), so the single shared parameter becomes one DTensor sharded
on dim 0 and serves both uses; its gradient accumulates both contributions.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from parallel.dims import check_tp_divides

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from model.qwen2 import Qwen2


def qwen2_tp_plan() -> dict[str, ParallelStyle]:
    """The TP plan for `model.qwen2.Qwen2`: module-path pattern -> parallel style.

    Patterns use `*` for the block index; `parallelize_module` applies them in one pass. The block's
    attention and MLP take (x, cos, sin, context) and (x,): only x is redistributed (None = untouched).
    """
    return {
        "embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "layers.*.input_layernorm": SequenceParallel(),
        "layers.*.self_attn": PrepareModuleInput(
            input_layouts=(Shard(1), None, None, None),
            desired_input_layouts=(Replicate(), None, None, None),
        ),
        "layers.*.self_attn.q_proj": ColwiseParallel(),
        "layers.*.self_attn.k_proj": ColwiseParallel(),
        "layers.*.self_attn.v_proj": ColwiseParallel(),
        "layers.*.self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1)),
        "layers.*.post_attention_layernorm": SequenceParallel(),
        "layers.*.mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "layers.*.mlp.gate_proj": ColwiseParallel(),
        "layers.*.mlp.up_proj": ColwiseParallel(),
        "layers.*.mlp.down_proj": RowwiseParallel(output_layouts=Shard(1)),
        # The final hidden states stay a sequence-sharded DTensor: the vocab-parallel log-prob gathers them.
        "norm": SequenceParallel(use_local_output=False),
        # Logits stay vocabulary-sharded (never gathered): see parallel/logprob.py.
        "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
    }


def _check_sequence_divisible(tp: int) -> Callable[[nn.Module, tuple[object, ...], dict[str, object]], None]:
    def hook(module: nn.Module, args: tuple[object, ...], kwargs: dict[str, object]) -> None:
        tokens = args[0] if args else kwargs["tokens"]
        assert isinstance(tokens, torch.Tensor)  # Qwen2.forward's first argument
        if tokens.dim() == 2 and tokens.shape[1] % tp:
            raise ValueError(
                f"sequence length {tokens.shape[1]} is not divisible by the tensor-parallel size {tp}: "
                "sequence parallelism splits every row evenly over the tp ranks; "
                f"pad or pack rows to a multiple of {tp}"
            )

    return hook


def apply_tp(model: Qwen2, tp_mesh: DeviceMesh) -> Qwen2:
    """Shard `model` in place over the 1-D `tp_mesh` following `qwen2_tp_plan()`.

    Also checks every forward's sequence length: sequence parallelism splits each row into tp equal shards.
    """
    if tp_mesh.ndim != 1:
        raise ValueError(f"apply_tp needs a 1-D tensor-parallel mesh, got {tp_mesh.ndim} dimensions")
    tp = tp_mesh.size()
    check_tp_divides(model.args, tp)
    plan = qwen2_tp_plan()
    if model.lm_head is None:
        del plan["lm_head"]  # tied: the embedding's row-wise sharding already shards the head
    parallelize_module(model, tp_mesh, plan)
    model.register_forward_pre_hook(_check_sequence_divisible(tp), with_kwargs=True)
    return model
