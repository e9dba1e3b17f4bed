"""DAPO policy loss: decoupled clip, dual clip and token-level aggregation (DAPO Eq. 8, 10).

Per token, with r = exp(clamp(logp - old_logp, -20, 20)) and advantage A:

    l = max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high))          clip-higher: eps_high > eps_low
    l = min(l, -A c)   when A < 0                                 dual clip, c > 1

The clamp keeps exp() finite; the dual clip bounds the loss of a negative-advantage token whose
ratio exploded. The per-token losses are then aggregated over the valid (mask = 1) tokens:

    token-mean               sum_{i,t} l / N_tokens                    DAPO token-level loss (recipe)
    seq-mean-token-mean      sum_i (sum_t l / |o_i|) / N_seqs           GRPO baseline
    seq-mean-token-sum       sum_i (sum_t l) / N_seqs
    seq-mean-token-sum-norm  sum_{i,t} l / norm_len                     Dr. GRPO (norm_len: constant)
    group-token-mean         sum_g (sum_{i in g, t} l / N_tokens(g)) / N_groups

token-mean is how the DAPO recipe applies Eq. 8's 1 / sum_i |o_i|: one token mean over the whole
mini-batch. group-token-mean reads Eq. 8 literally: the token mean is taken within each prompt's
group, and the expectation over prompts becomes a mean over groups.

N_seqs counts only the rows with at least one valid token, and N_groups only the groups with one: a
row that overlong filtering masked out entirely has no token mean and takes no share of the average
(verl's `agg_loss` and OpenRLHF exclude such rows the same way). seq-mean-token-sum-norm has no
sequence average at all, as in verl ("turns off seq-dim averaging"): the token sums are divided by
the constant norm_len only (verl's `loss_scale_factor`, default: the padded response length T); the
Dr. GRPO paper's extra 1 / G is a constant factor for a fixed batch size.
With no global counts, token-mean and the three seq-* modes equal verl's `agg_loss` with dp_size = 1,
except where every token is masked: verl then divides 0 by 0 (NaN) and this returns 0.

Global normalisation - the contract with the caller. Pass the counts of the WHOLE mini-batch
(all gradient-accumulation micro-batches on all data-parallel ranks): `global_num_tokens`,
`global_num_seqs`, and for group-token-mean `group_num_tokens` / `global_num_groups`. Each call then
returns its micro-batch's share of the mini-batch loss (its partial sum divided by the global count),
so the mini-batch gradient is the SUM of the micro-batch gradients over micro-batches and over
data-parallel ranks - not their mean. Accumulating `.backward()` over micro-batches sums already.
Across ranks, all-reduce the gradients with SUM; a reduction that averages over the W ranks (the
DDP / FSDP2 default) must be undone by multiplying the loss by W (or, in FSDP2, by setting the
gradient divide factor to 1). The counts are those of the rows and groups with a valid token. For
seq-mean-token-sum-norm, pass a constant `norm_len` (the maximum response length): the default, this
call's T, changes with padding; it needs no global count.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

AGG_MODES = (
    "token-mean",
    "seq-mean-token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
    "group-token-mean",
)
LOG_RATIO_CLAMP = 20.0

Count = int | float | torch.Tensor


@dataclass(frozen=True)
class _Normalisers:
    """What the aggregation divides by (module docstring): the caller's whole-mini-batch counts (None: this
    call's), the rows' group ids (group-token-mean) and the constant norm_len (seq-mean-token-sum-norm)."""

    global_num_tokens: Count | None
    global_num_seqs: Count | None
    group_ids: torch.Tensor | None
    group_num_tokens: torch.Tensor | None
    global_num_groups: Count | None
    norm_len: float | None


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    clip_c: float | None = 10.0,
    agg: str = "token-mean",
    global_num_tokens: Count | None = None,
    global_num_seqs: Count | None = None,
    token_weights: torch.Tensor | None = None,
    group_ids: torch.Tensor | None = None,
    group_num_tokens: torch.Tensor | None = None,
    global_num_groups: Count | None = None,
    norm_len: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped policy-gradient loss and its metrics; all per-token tensors are [B, T].

    Per token (Eq. 10, decoupled clip; dual clip for A < 0), r = exp(clamp(logp - old_logp, -20, 20)):
        l = max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high)),   l = min(l, -A c) when A < 0
    aggregated at token level (Eq. 8, agg = token-mean):
        loss = sum_{i,t} l / N_tokens   over the valid tokens; the other `agg` modes: module docstring.

    Args:
        logp: log-probs of the sampled tokens under the policy being trained (carries the gradient).
        old_logp: log-probs under the policy that generated the samples (treated as constant).
        advantages: per-token advantages (constant), e.g. `rl.advantage.broadcast_to_tokens`.
        mask: 1 (or True) for response tokens that take part in the loss.
        clip_low, clip_high: eps_low and eps_high of the decoupled clip.
        clip_c: dual-clip constant c > 1 for A < 0; None disables the dual clip.
        agg: one of `AGG_MODES` (see the module docstring).
        global_num_tokens: valid tokens in the whole mini-batch (token-mean); default: this call's.
        global_num_seqs: rows with a valid token in the whole mini-batch (seq-mean-token-mean,
            seq-mean-token-sum); default: this call's.
        token_weights: per-token factors on the loss, e.g. truncated importance-sampling weights
            (`rl.correction.truncated_is_weights`); treated as constant.
        group_ids: [B] integer group (prompt) id of each row, required by group-token-mean.
        group_num_tokens: [B] valid tokens of each row's whole group across the mini-batch;
            default: counted in this call.
        global_num_groups: groups with a valid token in the whole mini-batch; default: counted in
            this call.
        norm_len: the constant divisor of seq-mean-token-sum-norm (verl's loss_scale_factor); default: T.

    Returns:
        (loss, metrics). metrics holds detached scalars over this call's valid tokens:
        pg_clipfrac (share of tokens where the clipped term is the larger one), pg_clipfrac_lower
        (share of tokens where the dual clip binds, A < 0), pg_clipfrac_upper (share of tokens clipped at the
        upper bound, A > 0 and r > 1 + eps_high), clipped_upper_prob (mean pi_old probability of those
        tokens, 0 without any; weight it by pg_clipfrac_upper x num_tokens), ppo_kl (mean of old_logp - logp,
        clamped like the ratio), ratio_max, num_tokens and num_nonempty_seqs (rows with a valid
        token); weight them by num_tokens to combine micro-batches.
    """
    _check_inputs(logp, old_logp, advantages, mask, token_weights, clip_low, clip_high, clip_c, agg)
    valid = mask != 0
    # Eq. 10: the clipped surrogate of each token (decoupled clip; dual clip for A < 0).
    per_token, terms = _token_losses(logp, old_logp, advantages, valid, token_weights, clip_low, clip_high, clip_c)
    # Eq. 8: sum of the token losses / valid tokens in the whole mini-batch (or an ablation's `agg` mode).
    norm = _Normalisers(global_num_tokens, global_num_seqs, group_ids, group_num_tokens, global_num_groups, norm_len)
    return _aggregate(per_token, valid, agg, norm), _metrics(valid, *terms)


def _token_losses(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    valid: torch.Tensor,
    token_weights: torch.Tensor | None,
    clip_low: float,
    clip_high: float,
    clip_c: float | None,
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """Per-token losses [B, T], zero where not valid, and the terms the metrics read (Eq. 10, dual clip).

        r = exp(clamp(logp - old_logp, -20, 20))
        l = max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high))
        l = min(l, -A c)   when A < 0 (clip_c = c; None: no dual clip)
        l = w l            with the constant token_weights w, when given

    Returns (l, (log_ratio, ratio, clip_binds, dual_binds, upper_binds, old_logp)); clip_binds: the clipped term
    is the larger one; upper_binds: it is, at the upper bound (A > 0, r > 1 + eps_high).
    """
    dtype = torch.promote_types(logp.dtype, torch.float32)
    # Zero masked positions before exp(): padding may hold garbage (inf, NaN), and a NaN there would
    # reach the gradient even though the position is masked out later.
    logp = torch.where(valid, logp.to(dtype), 0.0)
    old_logp = torch.where(valid, old_logp.detach().to(dtype), 0.0)
    advantages = torch.where(valid, advantages.detach().to(dtype), 0.0)

    log_ratio = torch.clamp(logp - old_logp, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    per_token = torch.maximum(unclipped, clipped)
    dual_binds = torch.zeros_like(valid)
    if clip_c is not None:
        dual_cap = -advantages * clip_c
        dual_binds = (advantages < 0) & (per_token > dual_cap)
        per_token = torch.where(advantages < 0, torch.minimum(per_token, dual_cap), per_token)
    if token_weights is not None:
        per_token = per_token * torch.where(valid, token_weights.detach().to(dtype), 0.0)
    per_token = torch.where(valid, per_token, 0.0)
    clip_binds = clipped > unclipped
    return per_token, (log_ratio, ratio, clip_binds, dual_binds, clip_binds & (advantages > 0), old_logp)


@torch.no_grad()
def _metrics(
    valid: torch.Tensor,
    log_ratio: torch.Tensor,
    ratio: torch.Tensor,
    clip_binds: torch.Tensor,
    dual_binds: torch.Tensor,
    upper_binds: torch.Tensor,
    old_logp: torch.Tensor,
) -> dict[str, torch.Tensor]:
    """The detached metrics of `policy_loss` over the valid tokens (see its Returns)."""
    dtype = ratio.dtype
    num_tokens = valid.sum()
    denom = num_tokens.clamp(min=1).to(dtype)
    upper = upper_binds & valid
    num_upper = upper.sum()
    metrics = {
        "pg_clipfrac": (clip_binds & valid).sum().to(dtype) / denom,
        "pg_clipfrac_lower": (dual_binds & valid).sum().to(dtype) / denom,
        "pg_clipfrac_upper": num_upper.to(dtype) / denom,
        # DAPO Fig. 3: the upper clip caps tokens the old policy gave a low probability.
        "clipped_upper_prob": torch.where(upper, old_logp.exp(), 0.0).sum() / num_upper.clamp(min=1).to(dtype),
        "ppo_kl": torch.where(valid, -log_ratio, 0.0).sum() / denom,
        "ratio_max": torch.where(valid, ratio, 0.0).max() if valid.numel() else ratio.new_zeros(()),
        "num_tokens": num_tokens,
        "num_nonempty_seqs": valid.any(dim=-1).sum(),
    }
    return {name: value.detach() for name, value in metrics.items()}


def _aggregate(per_token: torch.Tensor, valid: torch.Tensor, agg: str, norm: _Normalisers) -> torch.Tensor:
    """Reduce zero-masked per-token losses [B, T] to the scalar loss of `agg` (module docstring).

    token-mean (Eq. 8 as the recipe applies it): sum_{i,t} l / N_tokens; seq-mean-token-mean:
    sum_i (sum_t l / |o_i|) / N_seqs; seq-mean-token-sum: sum_i sum_t l / N_seqs; seq-mean-token-sum-norm:
    sum_{i,t} l / norm_len; group-token-mean: sum_g (sum_{i in g, t} l / N_tokens(g)) / N_groups.
    """
    row_sum = per_token.sum(dim=-1)
    row_tokens = valid.sum(dim=-1).to(per_token.dtype)
    if agg == "token-mean":
        return row_sum.sum() / _count(norm.global_num_tokens, row_tokens.sum(), per_token, "global_num_tokens")
    if agg == "group-token-mean":
        return _group_token_mean(per_token, row_sum, row_tokens, norm)
    if agg == "seq-mean-token-sum-norm":
        if norm.norm_len is not None and not norm.norm_len > 0:
            raise ValueError(f"policy_loss: norm_len must be > 0, got {norm.norm_len}")
        return row_sum.sum() / (per_token.shape[-1] if norm.norm_len is None else norm.norm_len)
    # A fully masked row has row_sum 0 (its losses were zeroed) and is left out of the count.
    row_loss = row_sum / row_tokens.clamp(min=1) if agg == "seq-mean-token-mean" else row_sum
    num_rows = (row_tokens > 0).sum().to(per_token.dtype)
    return row_loss.sum() / _count(norm.global_num_seqs, num_rows, per_token, "global_num_seqs")


def _group_token_mean(
    per_token: torch.Tensor,
    row_sum: torch.Tensor,
    row_tokens: torch.Tensor,
    norm: _Normalisers,
) -> torch.Tensor:
    batch = per_token.shape[0]
    group_ids, group_num_tokens = norm.group_ids, norm.group_num_tokens
    if group_ids is None or group_ids.shape != (batch,) or group_ids.is_floating_point():
        raise ValueError(
            f"policy_loss: agg='group-token-mean' needs integer group_ids of shape [{batch}], "
            f"got {None if group_ids is None else tuple(group_ids.shape)}"
        )
    distinct, index = torch.unique(group_ids.to(per_token.device), return_inverse=True)
    tokens_here = torch.zeros(distinct.numel(), dtype=per_token.dtype, device=per_token.device)
    tokens_here = tokens_here.index_add(0, index, row_tokens)  # valid tokens of each group in this call
    if group_num_tokens is None:
        group_num_tokens = tokens_here[index]
    elif group_num_tokens.shape != (batch,):
        raise ValueError(
            f"policy_loss: group_num_tokens must have shape [{batch}], got {tuple(group_num_tokens.shape)}"
        )
    group_num_tokens = group_num_tokens.to(per_token.device, per_token.dtype)
    # A group whose every sample is masked out has no token mean: it is not counted.
    num_groups = (tokens_here > 0).sum().to(per_token.dtype)
    # A row of a group without any valid token has row_sum 0; clamping keeps 0 / 0 out.
    loss = (row_sum / group_num_tokens.clamp(min=1)).sum()
    return loss / _count(norm.global_num_groups, num_groups, per_token, "global_num_groups")


def _count(given: Count | None, local: torch.Tensor, like: torch.Tensor, name: str) -> torch.Tensor:
    """Denominator: the caller's global count or the local one; clamped to 1 so that an empty
    batch (numerator 0) gives loss 0 instead of NaN."""
    if given is None:
        return local.clamp(min=1)
    if isinstance(given, torch.Tensor):
        if given.numel() != 1:
            raise ValueError(f"policy_loss: {name} must be a scalar, got shape {tuple(given.shape)}")
        return given.detach().reshape(()).to(like.device, like.dtype).clamp(min=1)
    if isinstance(given, bool) or not given >= 0:
        raise ValueError(f"policy_loss: {name} must be a count >= 0, got {given!r}")
    return torch.tensor(float(max(given, 1)), dtype=like.dtype, device=like.device)


def _check_inputs(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    token_weights: torch.Tensor | None,
    clip_low: float,
    clip_high: float,
    clip_c: float | None,
    agg: str,
) -> None:
    if logp.dim() != 2:
        raise ValueError(f"policy_loss: logp must be [B, T], got shape {tuple(logp.shape)}")
    named = {"old_logp": old_logp, "advantages": advantages, "mask": mask, "token_weights": token_weights}
    for name, tensor in named.items():
        if tensor is not None and tensor.shape != logp.shape:
            raise ValueError(f"policy_loss: {name} has shape {tuple(tensor.shape)}, logp has {tuple(logp.shape)}")
    if agg not in AGG_MODES:
        raise ValueError(f"policy_loss: unknown agg {agg!r}; choose one of {AGG_MODES}")
    if not 0 <= clip_low < 1:
        raise ValueError(f"policy_loss: clip_low must be in [0, 1), got {clip_low}")
    if not clip_high >= 0:
        raise ValueError(f"policy_loss: clip_high must be >= 0, got {clip_high}")
    if clip_c is not None and not clip_c > 1:
        raise ValueError(f"policy_loss: dual-clip constant clip_c must be > 1, got {clip_c}")
