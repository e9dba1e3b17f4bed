"""The other loss aggregations of Table 1's ablation rows: how the rungs before DAPO's token-level loss
(Sec. 3.3) reduce the per-token losses of Eq. 10 (rl/loss.py `clipped_token_loss`) over the valid tokens.

    seq-mean-token-mean      sum_i (sum_t l / |o_i|) / N_seqs           GRPO baseline
    seq-mean-token-sum       sum_i (sum_t l) / N_seqs
    seq-mean-token-sum-norm  sum_{i,t} l / norm_len                     Dr. GRPO (norm_len: constant)
    group-token-mean         sum_g (sum_{i in g, t} l / N_tokens(g)) / N_groups

group-token-mean reads Eq. 8 literally: the token mean is taken within each prompt's group, and the
expectation over prompts becomes a mean over groups.

N_seqs counts only the rows with at least one valid token, and N_groups only the groups with one: a
row that overlong filtering masked out entirely has no token mean and takes no share of the average
(verl's `agg_loss` and OpenRLHF exclude such rows the same way). seq-mean-token-sum-norm has no
sequence average at all, as in verl ("turns off seq-dim averaging"): the token sums are divided by
the constant norm_len only (verl's `loss_scale_factor`, default: the padded response length T); the
Dr. GRPO paper's extra 1 / G is a constant factor for a fixed batch size.

`count` is every mode's denominator, Eq. 8's N_tokens included. The global counts follow rl/loss.py's
contract: N_seqs, N_groups and each row's N_tokens(g) are those of the whole mini-batch; norm_len is a constant
(this call's T, the default, changes with padding) and needs no count.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rl import checks

AGG_MODES = (
    "token-mean",
    "seq-mean-token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
    "group-token-mean",
)
Count = int | float | torch.Tensor


def count(given: Count | None, local: torch.Tensor, like: torch.Tensor, name: str) -> torch.Tensor:
    """A denominator: the caller's global count or the local one; clamped to 1 so that an empty batch
    (numerator 0) gives loss 0 instead of NaN."""
    checks.count(given, name)
    if given is None:
        return local.clamp(min=1)
    if isinstance(given, torch.Tensor):
        return given.detach().reshape(()).to(like.device, like.dtype).clamp(min=1)
    return torch.tensor(float(max(given, 1)), dtype=like.dtype, device=like.device)


@dataclass(frozen=True)
class GlobalCounts:
    """What the whole mini-batch holds, over every micro-batch and data-parallel rank (rl/loss.py's contract;
    None: this call's own): its valid tokens (Eq. 8's N_tokens), and its sequences and groups that have a valid
    token (N_seqs and N_groups above)."""

    tokens: Count | None = None
    seqs: Count | None = None
    groups: Count | None = None


THIS_CALL = GlobalCounts()  # no global count: a call's own (a test of one micro-batch alone)


def aggregate(
    per_token: torch.Tensor,
    valid: torch.Tensor,
    agg: str,
    counts: GlobalCounts,
    norm_len: float | None = None,
    group_ids: torch.Tensor | None = None,
    group_num_tokens: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reduce zero-masked per-token losses [B, T] to the scalar loss of the sample-level mode `agg`: over the
    mini-batch's `counts`, norm_len the constant of seq-mean-token-sum-norm, the rows' group ids and their groups'
    valid tokens in the whole mini-batch [B] those of group-token-mean."""
    row_sum = per_token.sum(dim=-1)
    row_tokens = valid.sum(dim=-1).to(per_token.dtype)
    if agg == "group-token-mean":
        return _group_token_mean(per_token, row_sum, row_tokens, group_ids, group_num_tokens, counts.groups)
    if agg == "seq-mean-token-sum-norm":
        if norm_len is not None and not norm_len > 0:
            raise ValueError(f"policy_loss: norm_len must be > 0, got {norm_len}")
        return row_sum.sum() / (per_token.shape[-1] if norm_len is None else norm_len)
    # A fully masked row has row_sum 0 (its losses were zeroed) and is left out of the count.
    row_loss = row_sum / row_tokens.clamp(min=1) if agg == "seq-mean-token-mean" else row_sum
    num_rows = (row_tokens > 0).sum().to(per_token.dtype)
    return row_loss.sum() / count(counts.seqs, num_rows, per_token, "counts.seqs")


def _group_token_mean(
    per_token: torch.Tensor,
    row_sum: torch.Tensor,
    row_tokens: torch.Tensor,
    group_ids: torch.Tensor | None,
    group_num_tokens: torch.Tensor | None,
    global_num_groups: Count | None,
) -> torch.Tensor:
    batch = per_token.shape[0]
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
    return loss / count(global_num_groups, num_groups, per_token, "counts.groups")
