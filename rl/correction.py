"""Rollout/trainer mismatch: how far the inference engine's log-probs are from the trainer's.

The engine samples with its own kernels (and often its own precision), so the log-prob it reports
for a sampled token, rollout_logp, differs from the trainer's old_logp for the same token and the
same weights. With delta = old_logp - rollout_logp per valid token:

    mean |delta|, max |delta|
    k3 KL estimate   E[exp(delta) - 1 - delta]         ~ KL(pi_rollout || pi_old): the samples come
                                                        from the rollout policy; >= 0 per token
    |delta p| share  share of tokens with |exp(old_logp) - exp(rollout_logp)| > 0.1

Truncated importance sampling corrects the policy gradient for the mismatch: each token's loss is
multiplied by

    w = min(exp(old_logp - rollout_logp), cap)          cap = 2 by default

(pass w as `token_weights` to `rl.loss.policy_loss`). It is off by default in the training config.
"""

from __future__ import annotations

import math

import torch

from rl.loss import LOG_RATIO_CLAMP


def mismatch_metrics(
    old_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor, prob_threshold: float = 0.1
) -> dict[str, torch.Tensor]:
    """Detached scalar mismatch metrics over the valid tokens of [B, T] log-probs (0 when none)."""
    _check(old_logp, rollout_logp, mask)
    with torch.no_grad():
        valid = mask != 0
        dtype = torch.promote_types(old_logp.dtype, torch.float32)
        old = torch.where(valid, old_logp.to(dtype), 0.0)
        rollout = torch.where(valid, rollout_logp.to(dtype), 0.0)
        delta = old - rollout
        # The clamp keeps exp() finite when one side is -inf-like; it only matters for |delta| > 20.
        clamped = delta.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        k3 = torch.exp(clamped) - 1.0 - clamped
        prob_gap = (torch.exp(old) - torch.exp(rollout)).abs() > prob_threshold
        num_tokens = valid.sum()
        denom = num_tokens.clamp(min=1).to(dtype)
        return {
            "mismatch_abs_logp_mean": delta.abs().sum() / denom,
            "mismatch_abs_logp_max": delta.abs().max() if delta.numel() else delta.new_zeros(()),
            "mismatch_k3_kl": torch.where(valid, k3, 0.0).sum() / denom,
            "mismatch_prob_diff_frac": (prob_gap & valid).sum().to(dtype) / denom,
            "mismatch_num_tokens": num_tokens,
        }


def truncated_is_weights(
    old_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor | None = None, cap: float = 2.0
) -> torch.Tensor:
    """Per-token weights min(exp(old_logp - rollout_logp), cap), detached; 0 at masked positions.

    Computed as exp(min(delta, log cap)), which is the same value and cannot overflow.
    """
    _check(old_logp, rollout_logp, mask)
    if not cap > 0:
        raise ValueError(f"truncated_is_weights: cap must be > 0, got {cap}")
    with torch.no_grad():
        dtype = torch.promote_types(old_logp.dtype, torch.float32)
        delta = old_logp.to(dtype) - rollout_logp.to(dtype)
        weights = torch.exp(delta.clamp(max=math.log(cap)))
        if mask is not None:
            weights = torch.where(mask != 0, weights, 0.0)
        return weights


def _check(old_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor | None) -> None:
    if old_logp.dim() != 2 or rollout_logp.shape != old_logp.shape:
        raise ValueError(
            f"mismatch: old_logp and rollout_logp must both be [B, T], got "
            f"{tuple(old_logp.shape)} and {tuple(rollout_logp.shape)}"
        )
    if mask is not None and mask.shape != old_logp.shape:
        raise ValueError(f"mismatch: mask has shape {tuple(mask.shape)}, log-probs have {tuple(old_logp.shape)}")
