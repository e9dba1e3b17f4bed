"""DAPO policy loss: the clipped token loss (Eq. 10) and its token-level mean (Eq. 8).

Eq. 10, per token, with r = exp(clamp(logp - old_logp, -20, 20)) and advantage A:

    l = max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high))          clip-higher: eps_high > eps_low
    l = min(l, -A c)   when A < 0                                 dual clip, c > 1

The clamp keeps exp() finite; the dual clip bounds the loss of a negative-advantage token whose
ratio exploded. Eq. 8, the token-level loss, then averages over every valid (mask = 1) token of the
mini-batch at once, so a long response weighs as many tokens as it has:

    loss = sum_{i,t} l_{i,t} / N_tokens,     N_tokens = sum_i |o_i|

The global count - the contract with the caller. A mini-batch is split into gradient-accumulation
micro-batches and over data-parallel ranks; pass N_tokens of the WHOLE mini-batch as
`global_num_tokens` to every call. Each call then returns its micro-batch's share (its partial sum
divided by the global count), so the mini-batch gradient is the SUM of the micro-batch gradients
over micro-batches and ranks - not their mean. Accumulating `.backward()` over micro-batches sums
already. Across ranks, all-reduce the gradients with SUM; a reduction that averages over the W ranks
(the DDP / FSDP2 default) must be undone by multiplying the loss by W (or, in FSDP2, by setting the
gradient divide factor to 1).

Table 1's other aggregations (the GRPO baseline's per-sample mean and its variants) are in
rl/loss_modes.py; `policy_loss`, the one entry, computes any of them in one checked call. Without global
counts, token-mean and the three seq-* modes equal verl's `agg_loss` with dp_size = 1, except where every token is
masked: verl then divides 0 by 0 (NaN) and this returns 0.
"""

from __future__ import annotations

import torch

from rl import checks
from rl.loss_modes import AGG_MODES, Count, Normalisers, aggregate, count
from rl.stats import ClipStats

LOG_RATIO_CLAMP = 20.0


def clipped_token_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    valid: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
    clip_c: float | None,
    token_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ClipStats]:
    """Eq. 10: per-token losses [B, T], zero where not `valid`, and their clip statistics.

    r = exp(clamp(logp - old_logp, -20, 20))
    l = max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high))
    l = min(l, -A c)   when A < 0 (clip_c = c; None: no dual clip)
    l = w l            with the constant token_weights w, when given
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
    if clip_c is not None:
        per_token = torch.where(advantages < 0, torch.minimum(per_token, -advantages * clip_c), per_token)
    if token_weights is not None:
        per_token = per_token * torch.where(valid, token_weights.detach().to(dtype), 0.0)
    stats = ClipStats.of(valid, advantages, old_logp, log_ratio, ratio, unclipped, clipped, clip_c)
    return torch.where(valid, per_token, 0.0), stats


def token_mean(per_token: torch.Tensor, valid: torch.Tensor, global_num_tokens: Count | None = None) -> torch.Tensor:
    """Eq. 8 as the DAPO recipe applies it: sum_{i,t} l / N_tokens over the valid tokens, N_tokens the
    whole mini-batch's (`global_num_tokens`, see the module docstring; default: this call's). An empty
    batch gives 0."""
    return per_token.sum(dim=-1).sum() / count(global_num_tokens, valid.sum(), per_token, "global_num_tokens")


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
) -> tuple[torch.Tensor, ClipStats]:
    """The policy loss, the one entry training (trainer/losses.py) and tests call: Eq. 10 per token, then Eq. 8
    (or another `agg` mode of AGG_MODES, rl/loss_modes.py), its inputs checked first; all per-token tensors are
    [B, T].

    logp: log-probs of the sampled tokens under the policy being trained (carries the gradient); old_logp:
    under the policy that generated them (constant); advantages: per-token (constant); mask: 1 (or True)
    for the response tokens in the loss; clip_low, clip_high: eps_low, eps_high; clip_c: the dual-clip c > 1
    (None: off); token_weights: constant per-token factors, e.g. `rl.correction.truncated_is_weights`. The
    counts of the whole mini-batch (default: this call's): global_num_tokens (token-mean), global_num_seqs
    (rows with a valid token: seq-mean-token-mean, seq-mean-token-sum), group_num_tokens [B] and
    global_num_groups (group-token-mean, which needs the integer group_ids [B]); norm_len: the constant
    divisor of seq-mean-token-sum-norm (default: T).

    Returns (loss, what the clip did: ClipStats).
    """
    named = {"old_logp": old_logp, "advantages": advantages, "mask": mask, "token_weights": token_weights}
    checks.loss_inputs(logp, named, agg, AGG_MODES, (clip_low, clip_high, clip_c))
    valid, weights = mask != 0, token_weights
    per_token, stats = clipped_token_loss(
        logp, old_logp, advantages, valid, clip_low=clip_low, clip_high=clip_high, clip_c=clip_c, token_weights=weights
    )
    if agg == "token-mean":
        return token_mean(per_token, valid, global_num_tokens), stats
    norm = Normalisers(global_num_seqs, group_ids, group_num_tokens, global_num_groups, norm_len)
    return aggregate(per_token, valid, agg, norm), stats
