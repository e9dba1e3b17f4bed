"""Per-token log-probabilities and entropy from final hidden states, chunked over tokens.

For hidden states h_n, output head W [V, H], temperature T and target ids y_n:

    z_n      = W h_n / T                                  (logits, upcast to fp32)
    lse_n    = log sum_v exp(z_nv)
    logp_n   = z_{n, y_n} - lse_n                         (log pi(y_n | context): the log-probs in Eq. 10's ratio r)
    H_n      = lse_n - sum_v p_nv z_nv,  p_nv = exp(z_nv - lse_n)
               (policy entropy, the quantity of the paper's Fig. 2b)

The full [tokens, V] logits never exist: tokens are processed `chunk_size` at a time in forward, and
backward recomputes each chunk's logits from (h, W), so the extra memory in both passes is O(chunk x V)
plus O(tokens) saved statistics. Gradients with respect to the logits, per token:

    d logp_n / d z_nv = 1[v = y_n] - p_nv
    d H_n    / d z_nv = -p_nv (log p_nv + H_n)

then dL/dh = (dL/dz / T) W and dL/dW = sum_n (dL/dz_n / T)^T h_n, accumulated chunk by chunk.

The per-chunk math lives in `_chunk_stats` / `_finish_stats` / `_chunk_grad_logits`, written so a
vocabulary-parallel head can reuse them: each rank computes `_chunk_stats` on its vocabulary slice with
the all-reduced row max, all-reduces the three sums, and calls `_finish_stats`; in backward it passes
the global lse and entropy to `_chunk_grad_logits` (targets outside the slice are given as -1).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

# Tokens per chunk. At vocab 151936 one fp32 [256, V] buffer is 148 MiB; bench/logprob_memory.py measured
# 7% of the naive peak memory at 256 tokens per chunk (13% at 1024) and no loss of speed.
DEFAULT_CHUNK = 256


def _stats_dtype(dtype: torch.dtype) -> torch.dtype:
    """Softmax statistics are kept in fp32, or fp64 when the inputs already are."""
    return torch.promote_types(dtype, torch.float32)


def _chunk_logits(hidden: torch.Tensor, weight: torch.Tensor, temperature: float) -> torch.Tensor:
    """z = h W^T / T in fp32 (fp64 for fp64 inputs), [C, V]. The matmul runs in the inputs' dtype;
    the result is a fresh tensor, so the callers below may modify it in place."""
    logits = F.linear(hidden, weight).to(_stats_dtype(hidden.dtype))
    if temperature != 1.0:
        logits.div_(temperature)
    return logits


def _chunk_stats(
    logits: torch.Tensor, targets: torch.Tensor, row_max: torch.Tensor, with_entropy: bool = True
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Sums over this chunk's (slice of the) vocabulary, shifted by `row_max` for stability.

    logits [C, V'] fp32 (overwritten), targets [C] column index in this slice or -1 if not in it,
    row_max [C] (the max over the *whole* vocabulary). Returns
        sum_exp   = sum_v exp(z_v - m)                     [C]
        sum_exp_z = sum_v exp(z_v - m) (z_v - m)           [C] (None without entropy)
        target_z  = z_y - m, 0 where the target is not in this slice   [C]
    """
    logits.sub_(row_max.unsqueeze(-1))
    in_slice = targets >= 0
    target_z = logits.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1) * in_slice
    if not with_entropy:
        return logits.exp_().sum(-1), None, target_z
    exp = logits.exp()
    sum_exp = exp.sum(-1)
    sum_exp_z = exp.mul_(logits).sum(-1)
    return sum_exp, sum_exp_z, target_z


def _finish_stats(
    row_max: torch.Tensor, sum_exp: torch.Tensor, sum_exp_z: torch.Tensor | None, target_z: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """(logp, entropy, lse) from whole-vocabulary sums: logp = (z_y - m) - log S,
    H = log S - sum exp(z - m)(z - m) / S, lse = m + log S."""
    log_sum = sum_exp.log()
    entropy = None if sum_exp_z is None else log_sum - sum_exp_z / sum_exp
    return target_z - log_sum, entropy, row_max + log_sum


def _chunk_grad_logits(
    logits: torch.Tensor,
    targets: torch.Tensor,
    lse: torch.Tensor,
    grad_logp: torch.Tensor,
    entropy: torch.Tensor | None = None,
    grad_entropy: torch.Tensor | None = None,
) -> torch.Tensor:
    """dL/dz for one chunk, computed in place in `logits` [C, V'] fp32 (z already divided by T).

    dL/dz_v = g_lp (1[v = y] - p_v) - g_H p_v (log p_v + H) = g_lp 1[v = y] - p_v (g_lp + g_H (log p_v + H)).
    targets [C] are column indices in this slice or -1; lse and entropy are whole-vocabulary values.
    Without `grad_entropy` only one [C, V'] buffer is used.
    """
    logp = logits.sub_(lse.unsqueeze(-1))
    if grad_entropy is None:
        grad = logp.exp_().mul_(-grad_logp.unsqueeze(-1))
    else:
        assert entropy is not None  # given with grad_entropy
        p = logp.exp()
        coeff = logp.add_(entropy.unsqueeze(-1)).mul_(grad_entropy.unsqueeze(-1)).add_(grad_logp.unsqueeze(-1))
        grad = coeff.mul_(p).neg_()
        del p
    in_slice = targets >= 0
    grad.scatter_add_(-1, targets.clamp(min=0).unsqueeze(-1), (grad_logp * in_slice).unsqueeze(-1))
    return grad


Reduce = Callable[[torch.Tensor], object]  # an in-place all-reduce over the vocabulary slices' group


class ChunkedTokenLogprobs(torch.autograd.Function):
    """(hidden [N, H], weight [V', H], targets [N]) -> (logp [N], entropy [N] or empty), recomputing
    each chunk's logits in backward instead of saving them.

    Unsharded, `targets` index the whole vocabulary and the reductions are None. The vocabulary-parallel
    version (parallel/logprob.py) passes slice-local targets (-1: not in this slice), its TP group's
    all-reduces MAX and SUM, and `reduce_grad_hidden` (a SUM, or None where DTensor reduces it)."""

    @staticmethod
    def forward(
        ctx: Any,  # autograd's context object, which also carries this function's own settings
        hidden: torch.Tensor,
        weight: torch.Tensor,
        targets: torch.Tensor,
        temperature: float,
        chunk_size: int,
        with_entropy: bool,
        entropy_grad: bool,
        reduce_max: Reduce | None = None,
        reduce_sum: Reduce | None = None,
        reduce_grad_hidden: Reduce | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n = hidden.shape[0]
        logp = torch.empty(n, dtype=_stats_dtype(hidden.dtype), device=hidden.device)
        lse = torch.empty_like(logp)
        entropy = torch.empty_like(logp) if with_entropy else logp.new_empty(0)
        for start in range(0, n, chunk_size):
            end = min(start + chunk_size, n)
            logits = _chunk_logits(hidden[start:end], weight, temperature)
            row_max = logits.amax(-1)
            if reduce_max is not None:
                reduce_max(row_max)
            sum_exp, sum_exp_z, target_z = _chunk_stats(logits, targets[start:end], row_max, with_entropy)
            del logits
            if reduce_sum is not None:  # one collective for the two or three sums
                sums = torch.stack([sum_exp, target_z] if sum_exp_z is None else [sum_exp, target_z, sum_exp_z])
                reduce_sum(sums)
                sum_exp, target_z, sum_exp_z = sums[0], sums[1], (sums[2] if with_entropy else None)
            lp, ent, ls = _finish_stats(row_max, sum_exp, sum_exp_z, target_z)
            logp[start:end], lse[start:end] = lp, ls
            if ent is not None:  # with_entropy
                entropy[start:end] = ent
        ctx.save_for_backward(hidden, weight, targets, lse, entropy if entropy_grad else None)
        ctx.temperature, ctx.chunk_size, ctx.entropy_grad = temperature, chunk_size, entropy_grad
        ctx.reduce_grad_hidden = reduce_grad_hidden
        if not entropy_grad:
            ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx: Any, grad_logp: torch.Tensor, grad_entropy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        # Gradients are materialised (zeros for unused outputs), so grad_logp is always a tensor.
        hidden, weight, targets, lse, entropy = ctx.saved_tensors  # entropy: None unless entropy_grad
        temperature, chunk_size = ctx.temperature, ctx.chunk_size
        need_hidden, need_weight = ctx.needs_input_grad[:2]
        grad_hidden = torch.empty(hidden.shape, dtype=hidden.dtype, device=hidden.device) if need_hidden else None
        # fp32 accumulator across chunks, cast once at the end (a bf16 running sum would lose precision).
        grad_weight = (
            torch.zeros(weight.shape, dtype=_stats_dtype(weight.dtype), device=weight.device) if need_weight else None
        )
        for start in range(0, hidden.shape[0], chunk_size):
            end = min(start + chunk_size, hidden.shape[0])
            h = hidden[start:end]
            logits = _chunk_logits(h, weight, temperature)
            grad_z = _chunk_grad_logits(
                logits,
                targets[start:end],
                lse[start:end],
                grad_logp[start:end],
                entropy[start:end] if ctx.entropy_grad else None,
                grad_entropy[start:end] if ctx.entropy_grad else None,
            )
            del logits
            if temperature != 1.0:
                grad_z.mul_(1.0 / temperature)  # z = (h W^T) / T
            if grad_weight is not None:  # need_weight
                grad_weight.addmm_(grad_z.t(), h.to(grad_z.dtype))
            if grad_hidden is not None:  # need_hidden
                torch.mm(grad_z.to(weight.dtype), weight, out=grad_hidden[start:end])
            del grad_z
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        if grad_hidden is not None and ctx.reduce_grad_hidden is not None:
            ctx.reduce_grad_hidden(grad_hidden)
        return (grad_hidden, grad_weight) + (None,) * 8


def check_logprob_inputs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    chunk_size: int | None,
    with_entropy: bool,
    entropy_grad: bool,
    vocab: int | None = None,
) -> None:
    """Refuse inputs the chunked kernels cannot compute on, with the shape or value at fault.

    vocab: the full vocabulary when `weight` is this rank's slice of a vocabulary-parallel head (targets index
    the full vocabulary); None means weight.shape[0].
    """
    rows = "vocab" if vocab is None else "vocab/tp"
    vocab = weight.shape[0] if vocab is None else vocab
    if weight.dim() != 2 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"weight must be [{rows}, hidden={hidden.shape[-1]}], got {tuple(weight.shape)}")
    if hidden.shape[:-1] != targets.shape:
        raise ValueError(
            f"targets shape {tuple(targets.shape)} must equal hidden's leading shape {tuple(hidden.shape[:-1])}"
        )
    if hidden.dtype != weight.dtype:
        raise ValueError(f"hidden ({hidden.dtype}) and weight ({weight.dtype}) must share a dtype")
    if targets.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"targets must be integer token ids, got {targets.dtype}")
    if targets.numel():
        lo, hi = torch.stack(torch.aminmax(targets)).tolist()  # one device sync for both bounds
        if lo < 0 or hi >= vocab:
            raise ValueError(f"targets must lie in [0, {vocab}), got range [{lo}, {hi}]")
    if not temperature > 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    if chunk_size is not None and chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    if entropy_grad and not with_entropy:
        raise ValueError("entropy_grad=True needs with_entropy=True")


def token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK,
    with_entropy: bool = True,
    entropy_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log_softmax(hidden @ weight.T / temperature)[target] and the distribution's entropy, chunked.

    hidden [..., H] (any leading shape), weight [V, H] (`model.output_weight()`), targets [...] ids.
    Returns (logp [...], entropy [...] or None), both fp32 (fp64 for fp64 inputs).
    Gradients flow to `hidden` and `weight`;
    the entropy is detached unless `entropy_grad` (then its gradient flows too, e.g. for an entropy
    bonus). Peak extra memory is about two fp32 [chunk_size, V] buffers in either pass.
    """
    check_logprob_inputs(hidden, weight, targets, temperature, chunk_size, with_entropy, entropy_grad)
    lead = targets.shape
    flat_h = hidden.reshape(-1, hidden.shape[-1])
    flat_t = targets.reshape(-1).long()
    logp, entropy = ChunkedTokenLogprobs.apply(
        flat_h, weight, flat_t, float(temperature), int(chunk_size), bool(with_entropy), bool(entropy_grad)
    )
    return logp.view(lead), (entropy.view(lead) if with_entropy else None)
