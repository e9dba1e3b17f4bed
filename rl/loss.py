"""DAPO policy loss: the clipped token loss (Eq. 10) and its token-level mean (Eq. 8).

Eq. 10, per token, with r = exp(clamp(logp - old_logp, -20, 20)) and advantage A:

    l = max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high))          clip-higher: eps_high > eps_low
    l = min(l, -A c)   when A < 0                                 dual clip, c > 1

The clamp keeps exp() finite; the dual clip bounds the loss of a negative-advantage token whose
ratio exploded. Eq. 8, the token-level loss, then averages over every valid (mask = 1) token of the
mini-batch at once, so a long response weighs as many tokens as it has:

    loss = sum_{i,t} l_{i,t} / N_tokens,     N_tokens = sum_i |o_i|

The global count - the contract with the caller. A mini-batch is split into gradient-accumulation
micro-batches and over data-parallel ranks; pass N_tokens of the WHOLE mini-batch (`GlobalCounts.tokens`)
to every call. Each call then returns its micro-batch's share (its partial sum
divided by the global count), so the mini-batch gradient is the SUM of the micro-batch gradients
over micro-batches and ranks - not their mean. Accumulating `.backward()` over micro-batches sums
already. Across ranks, all-reduce the gradients with SUM; a reduction that averages over the W ranks
(the DDP / FSDP2 default) must be undone by multiplying the loss by W (or, in FSDP2, by setting the
gradient divide factor to 1).

algorithm.policy_loss swaps Eq. 10 for GSPO's sequence-level ratio (`gspo_token_loss`) or CISPO's clipped
importance weight (`cispo_token_loss`); every aggregation and the global counts apply to them alike.

Table 1's other aggregations (the GRPO baseline's per-sample mean and its variants) are in
rl/loss_modes.py; `policy_loss`, the one entry, computes any of them in one checked call, from its settings
(`LossSettings`: clip bounds, dual clip, aggregation, variant, norm_len) and the mini-batch's `GlobalCounts`.
Without global counts, token-mean and the three seq-* modes equal verl's `agg_loss` with dp_size = 1, except
where every token is masked: verl then divides 0 by 0 (NaN) and this returns 0.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from rl import checks
from rl.loss_modes import AGG_MODES, THIS_CALL, Count, GlobalCounts, aggregate, count
from rl.stats import ClipStats

LOG_RATIO_CLAMP = 20.0
POLICY_LOSSES = ("dapo", "gspo", "cispo")  # Eq. 10, GSPO's sequence-level ratio, CISPO's clipped weight


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
    logp, old_logp, advantages = _masked(valid, logp, old_logp, advantages)
    log_ratio = torch.clamp(logp - old_logp, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    per_token = torch.maximum(unclipped, clipped)
    if clip_c is not None:
        per_token = torch.where(advantages < 0, torch.minimum(per_token, -advantages * clip_c), per_token)
    stats = ClipStats.of(valid, advantages, old_logp, log_ratio, ratio, unclipped, clipped, clip_c)
    return _weighted(per_token, valid, token_weights), stats


def gspo_token_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    valid: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
    token_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ClipStats]:
    """GSPO (arXiv 2507.18071, in its GSPO-token form): Eq. 10 with one ratio per response, its tokens'
    geometric mean, carried to each token so that the gradient flows through the token's own log-prob:

        s_i = exp(sum_t (logp - old_logp) / |o_i|)        over the valid tokens of row i (one response)
        log s_{i,t} = log pi_t - sg[log pi_t] + sg[log s_i]              (value: s_i)
        l = max(-A s_{i,t}, -A clip(s_{i,t}, 1 - eps_low, 1 + eps_high)),   times token_weights w

    No dual clip. The paper averages the token means of each sequence (agg = seq-mean-token-mean) and uses
    eps_low = 3e-4, eps_high = 4e-4; here the run's agg and eps apply. log s_i is clamped to +-20 (value only).
    """
    logp, old_logp, advantages = _masked(valid, logp, old_logp, advantages)
    log_ratio = logp - old_logp
    seq_log_ratio = log_ratio.detach().sum(-1, keepdim=True) / valid.sum(-1, keepdim=True).clamp(min=1)
    seq_log_ratio = torch.clamp(seq_log_ratio, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(logp - logp.detach() + seq_log_ratio)  # sg[...] added last: its value stays exact
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    log_ratio = torch.clamp(log_ratio.detach(), -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    stats = ClipStats.of(valid, advantages, old_logp, log_ratio, ratio.detach(), unclipped, clipped, None)
    return _weighted(torch.maximum(unclipped, clipped), valid, token_weights), stats


def cispo_token_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    valid: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
    token_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ClipStats]:
    """CISPO (MiniMax-M1, arXiv 2506.13585): REINFORCE with the importance weight clipped and
    detached, so the clip scales a token's gradient instead of dropping it:

        r = exp(clamp(logp - old_logp, -20, 20)),    l = -sg[clip(r, 1 - eps_low, 1 + eps_high)] A log pi,   times w

    No dual clip. MiniMax-M1 sets no lower bound (eps_low large; here at most just below 1) and tunes eps_high.
    """
    logp, old_logp, advantages = _masked(valid, logp, old_logp, advantages)
    log_ratio = torch.clamp(logp.detach() - old_logp, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    weight = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    lower, upper = ratio < 1.0 - clip_low, ratio > 1.0 + clip_high
    stats = ClipStats.shares(valid, old_logp, log_ratio, ratio, lower | upper, upper, torch.zeros_like(valid))
    return _weighted(-(weight * advantages) * logp, valid, token_weights), stats


def _masked(valid: torch.Tensor, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """logp, old_logp, advantages in float32 at least, the last two detached, 0 where not `valid`."""
    dtype = torch.promote_types(tensors[0].dtype, torch.float32)
    # Zero masked positions before exp(): padding may hold garbage (inf, NaN), and a NaN there would
    # reach the gradient even though the position is masked out later.
    return tuple(
        torch.where(valid, t.to(dtype) if i == 0 else t.detach().to(dtype), 0.0) for i, t in enumerate(tensors)
    )


def _weighted(per_token: torch.Tensor, valid: torch.Tensor, token_weights: torch.Tensor | None) -> torch.Tensor:
    """l w with the constant token_weights w (when given), 0 where not `valid`."""
    if token_weights is not None:
        per_token = per_token * torch.where(valid, token_weights.detach().to(per_token.dtype), 0.0)
    return torch.where(valid, per_token, 0.0)


def token_mean(per_token: torch.Tensor, valid: torch.Tensor, global_num_tokens: Count | None = None) -> torch.Tensor:
    """Eq. 8 as the DAPO recipe applies it: sum_{i,t} l / N_tokens over the valid tokens, N_tokens the
    whole mini-batch's (`global_num_tokens`, see the module docstring; default: this call's). An empty
    batch gives 0."""
    return per_token.sum(dim=-1).sum() / count(global_num_tokens, valid.sum(), per_token, "counts.tokens")


@dataclass(frozen=True)
class LossSettings:
    """How `policy_loss` computes, given once (trainer/losses.py DAPOLoss builds them from [algorithm], as
    torchtitan's losses/dapo.py keeps its clip bounds in a Config): clip_low, clip_high: eps_low, eps_high of Eq. 10;
    clip_c: the dual-clip c > 1 (None: off; GSPO and CISPO have none); agg: Eq. 8's token-mean or another mode of
    AGG_MODES (rl/loss_modes.py); variant: the per-token loss, one of POLICY_LOSSES; norm_len: the constant divisor
    of seq-mean-token-sum-norm (None: T)."""

    clip_low: float = 0.2
    clip_high: float = 0.28
    clip_c: float | None = 10.0
    agg: str = "token-mean"
    variant: str = "dapo"
    norm_len: float | None = None


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    settings: LossSettings = LossSettings(),
    counts: GlobalCounts = THIS_CALL,
    *,
    token_weights: torch.Tensor | None = None,
    group_ids: torch.Tensor | None = None,
    group_num_tokens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ClipStats]:
    """The policy loss, the one entry training (trainer/losses.py) and tests call: Eq. 10 per token, then Eq. 8
    (or another mode, `settings.agg`), its inputs checked first; all per-token tensors are [B, T].

    logp: log-probs of the sampled tokens under the policy being trained (carries the gradient); old_logp:
    under the policy that generated them (constant); advantages: per-token (constant); mask: 1 (or True)
    for the response tokens in the loss; counts: the whole mini-batch's (`GlobalCounts`; default: this call's);
    token_weights: constant per-token factors, e.g. `rl.correction.truncated_is_weights`; group_ids [B]: the
    rows' integer groups, and group_num_tokens [B]: their groups' valid tokens in the whole mini-batch (default:
    this call's), for group-token-mean.

    Returns (loss, what the clip did: ClipStats).
    """
    s, named = settings, {"old_logp": old_logp, "advantages": advantages, "mask": mask, "token_weights": token_weights}
    checks.loss_inputs(logp, named, (s.agg, AGG_MODES), (s.variant, POLICY_LOSSES), (s.clip_low, s.clip_high, s.clip_c))
    token_loss: Callable[..., tuple[torch.Tensor, ClipStats]] = functools.partial(clipped_token_loss, clip_c=s.clip_c)
    if s.variant != "dapo":
        token_loss = gspo_token_loss if s.variant == "gspo" else cispo_token_loss
    valid = mask != 0
    per_token, stats = token_loss(
        logp, old_logp, advantages, valid, clip_low=s.clip_low, clip_high=s.clip_high, token_weights=token_weights
    )
    if s.agg == "token-mean":
        return token_mean(per_token, valid, counts.tokens), stats
    return aggregate(per_token, valid, s.agg, counts, s.norm_len, group_ids, group_num_tokens), stats
