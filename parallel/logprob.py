"""Token log-probabilities and entropy from a vocabulary-sharded output head, without gathering the vocabulary.

Under tensor parallelism each rank holds rows [off, off + V/tp) of the [V, H] output weight, so it forms
only its slice of the logits z = h W^T / T. The chunked math of `model/logprob.py` is applied per slice,
and only a few floats per token cross the TP group:

    m       = max_v z_v                          all-reduce MAX (a shift for stability; no gradient)
    S       = sum_v exp(z_v - m)                 all-reduce SUM  \
    z_y - m  (only the rank owning y adds it)    all-reduce SUM   } one collective on a [3, chunk] tensor
    sum_v exp(z_v - m)(z_v - m)                  all-reduce SUM  /
    logp_y  = (z_y - m) - log S,   lse = m + log S,   entropy = log S - sum exp(z - m)(z - m) / S

The backward recomputes each chunk's logit slice and applies model/logprob.py's logit gradients with the
global lse and entropy, so the weight shard's gradient is local and exact, and the hidden states' gradient
is a partial sum over the vocabulary slices, reduced over the TP group (by DTensor when `hidden` is a
DTensor, by an all-reduce otherwise). The [tokens, V] logits never exist, on any rank; at most one [chunk, V/tp] slice.

Without tensor parallelism this is `model.logprob.token_logprobs`, so the trainer calls one function.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from model.logprob import DEFAULT_CHUNK, ChunkedTokenLogprobs, check_logprob_inputs, token_logprobs


def _check_tp_sharded_head(weight: DTensor) -> None:
    """A DTensor head weight must be sharded on dim 0 (vocabulary), evenly, over a 1-D tensor-parallel mesh."""
    names = weight.device_mesh.mesh_dim_names
    if names is not None and names != ("tp",):
        raise ValueError(
            f"the head weight is sharded over the {names} mesh, not tensor-parallel: under FSDP call this after "
            "model(...) has run, while the output head is gathered (model.output_weight() then returns it)"
        )
    if weight.device_mesh.ndim != 1 or tuple(weight.placements) != (Shard(0),):
        raise ValueError(
            f"the head weight must be sharded on dim 0 over a 1-D tensor-parallel mesh, got placements "
            f"{tuple(weight.placements)} on a {weight.device_mesh.ndim}-D mesh (gather it under FSDP first)"
        )
    tp_size = weight.device_mesh.size()
    if weight.shape[0] % tp_size:
        raise ValueError(f"vocabulary {weight.shape[0]} is not divisible by the tensor-parallel size {tp_size}")


def _head_slice(
    weight: torch.Tensor, tp_group: dist.ProcessGroup | None
) -> tuple[torch.Tensor, dist.ProcessGroup | None, int]:
    """(this rank's rows of the head weight, the group they are sharded over, the full vocabulary size).

    A DTensor weight brings its own mesh's group; a plain slice is sharded over `tp_group` (None: unsharded).
    """
    if not isinstance(weight, DTensor):
        return weight, tp_group, weight.shape[0] * (dist.get_world_size(tp_group) if tp_group is not None else 1)
    _check_tp_sharded_head(weight)
    tp_group = weight.device_mesh.get_group()
    return weight.to_local(), tp_group, weight.shape[0]


def _full_hidden(hidden: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """(the full hidden states, whether their gradient still needs an all-reduce over the TP group).

    A DTensor (sequence-sharded under sequence parallelism) is gathered along the sequence. The local gradient
    w.r.t. the gathered hidden states is this rank's share of a sum over vocabulary slices, so it is declared
    Partial and DTensor reduces it on the way back; a plain tensor's is all-reduced by the backward here.
    """
    if not isinstance(hidden, DTensor):
        return hidden, True
    ndim = hidden.device_mesh.ndim
    return hidden.redistribute(placements=[Replicate()] * ndim).to_local(grad_placements=[Partial()] * ndim), False


def vocab_parallel_token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    tp_group: dist.ProcessGroup | None = None,
    *,
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK,
    with_entropy: bool = True,
    entropy_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(target) and entropy per token from hidden states [..., H] and a (vocab-sharded) head weight.

    hidden: final hidden states. A DTensor on the TP mesh (the sequence-sharded output of the final norm
        under sequence parallelism) is gathered along the sequence here; a plain tensor must be the same
        full tensor on every TP rank.
    weight: `model.output_weight()`: under TP a DTensor sharded on dim 0 (vocabulary) over the TP mesh,
        or this rank's plain slice together with `tp_group` (rank r holds rows [r V/tp, (r+1) V/tp)).
    targets: global vocabulary ids, shape `hidden.shape[:-1]`, the same on every TP rank.
    tp_group: the TP process group for a plain weight slice; unused for a DTensor weight (its mesh is used).

    Returns (logp, entropy or None), fp32 (fp64 for fp64 inputs), shape `targets.shape`, identical on every
    TP rank. The entropy carries a gradient only with `entropy_grad=True`. Without any sharding this is
    exactly `model.logprob.token_logprobs`.
    """
    weight, tp_group, vocab = _head_slice(weight, tp_group)
    hidden, reduce_hidden_grad = _full_hidden(hidden)
    if tp_group is None or dist.get_world_size(tp_group) == 1:
        return token_logprobs(
            hidden,
            weight,
            targets,
            temperature=temperature,
            chunk_size=chunk_size,
            with_entropy=with_entropy,
            entropy_grad=entropy_grad,
        )

    check_logprob_inputs(hidden, weight, targets, temperature, chunk_size, with_entropy, entropy_grad, vocab=vocab)

    local = targets.reshape(-1).long() - dist.get_rank(tp_group) * weight.shape[0]
    local = torch.where((local >= 0) & (local < weight.shape[0]), local, -1)  # -1: not in this slice
    group = tp_group  # bound for the closures below (mypy keeps the narrowing)

    def reduce(op: dist.ReduceOp.RedOpType) -> Callable[[torch.Tensor], object]:
        return lambda t: dist.all_reduce(t, op=op, group=group)

    logp, entropy = ChunkedTokenLogprobs.apply(
        hidden.reshape(-1, hidden.shape[-1]),
        weight,
        local,
        float(temperature),
        int(chunk_size),
        bool(with_entropy),
        bool(entropy_grad),
        reduce(dist.ReduceOp.MAX),
        reduce(dist.ReduceOp.SUM),
        reduce(dist.ReduceOp.SUM) if reduce_hidden_grad else None,
    )
    lead = targets.shape
    return logp.view(lead), (entropy.view(lead) if with_entropy else None)
