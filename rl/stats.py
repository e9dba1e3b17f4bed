"""The metric records of the DAPO step, kept beside the functions they describe and filled by one call each:
what the clip of Eq. 10 did to a loss call's tokens (ClipStats) and what dynamic sampling (Eq. 11) did in a
step (FilterStats). trainer/step_metrics.py reduces them over micro-batches and ranks."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from rl.filter import ScoredGroup


@dataclass(frozen=True)
class ClipStats:
    """Detached scalars of Eq. 10 over a call's valid tokens (weight them by num_tokens to combine calls): the
    shares clipped (the clipped term the larger), dual-clipped (A < 0) and clipped at the upper bound (A > 0),
    the mean pi_old probability of the last (weight it by their count), mean old_logp - logp (clamped); and how
    many of the responses' first tokens were clipped at the upper bound, of how many."""

    pg_clipfrac: torch.Tensor
    pg_clipfrac_lower: torch.Tensor
    pg_clipfrac_upper: torch.Tensor
    clipped_upper_prob: torch.Tensor
    ppo_kl: torch.Tensor
    ratio_max: torch.Tensor
    num_tokens: torch.Tensor
    num_nonempty_seqs: torch.Tensor
    first_tokens_upper: torch.Tensor  # of the responses' first tokens (column 0): how many were clipped at the upper
    num_first_tokens: torch.Tensor  # bound, of how many valid ones

    @classmethod
    @torch.no_grad()
    def of(
        cls,
        valid: torch.Tensor,
        advantages: torch.Tensor,
        old_logp: torch.Tensor,
        log_ratio: torch.Tensor,
        ratio: torch.Tensor,
        unclipped: torch.Tensor,
        clipped: torch.Tensor,
        clip_c: float | None,
    ) -> ClipStats:
        """The statistics of clipped_token_loss (rl/loss.py) from its intermediate terms: -A r, -A clip(r)."""
        dtype = ratio.dtype
        num_tokens = valid.sum()
        denom = num_tokens.clamp(min=1).to(dtype)
        clip_binds = clipped > unclipped
        dual_binds = torch.zeros_like(valid)
        if clip_c is not None:  # the dual clip binds where max(-A r, -A clip(r)) > -A c, A < 0
            dual_binds = (advantages < 0) & (torch.maximum(unclipped, clipped) > -advantages * clip_c)
        upper = clip_binds & (advantages > 0) & valid
        num_upper = upper.sum()
        return cls(
            pg_clipfrac=(clip_binds & valid).sum().to(dtype) / denom,
            pg_clipfrac_lower=(dual_binds & valid).sum().to(dtype) / denom,
            pg_clipfrac_upper=num_upper.to(dtype) / denom,
            # DAPO Fig. 3: the upper clip caps tokens the old policy gave a low probability.
            clipped_upper_prob=torch.where(upper, old_logp.exp(), 0.0).sum() / num_upper.clamp(min=1).to(dtype),
            ppo_kl=torch.where(valid, -log_ratio, 0.0).sum() / denom,
            ratio_max=torch.where(valid, ratio, 0.0).max() if valid.numel() else ratio.new_zeros(()),
            num_tokens=num_tokens,
            num_nonempty_seqs=valid.any(dim=-1).sum(),
            # Where a response chooses its approach: clip-higher's bound on a rare first token (a strategy).
            first_tokens_upper=upper[..., :1].sum(),
            num_first_tokens=valid[..., :1].sum(),
        )


@dataclass
class FilterStats:
    """What dynamic sampling did in one step: the rounds it ran; the groups (and samples) they generated, before
    filtering, with how many were all correct or all wrong; the new groups it kept; and where the batch came
    from: carried-over groups used, surplus carried to the next step, stale ones dropped, and the groups
    missing from a short batch."""

    rounds: int = 0
    groups_generated: int = 0
    samples_generated: int = 0
    all_correct: int = 0
    all_wrong: int = 0
    groups_kept: int = 0
    groups_in_batch: int = 0
    groups_from_carry: int = 0
    groups_carried_over: int = 0
    groups_dropped_stale: int = 0
    shortfall: int = 0

    def count_round(self, generated: Sequence[ScoredGroup], kept: Sequence[ScoredGroup]) -> None:
        """Count one generation round: the groups it generated (before filtering) and the ones it kept."""
        self.rounds += 1
        self.groups_generated += len(generated)
        self.samples_generated += sum(group.size for group in generated)
        self.all_correct += sum(all(group.acc) for group in generated)
        self.all_wrong += sum(not any(group.acc) for group in generated)
        self.groups_kept += len(kept)

    def count_batch(self, in_batch: int, carried_over: int, wanted: int) -> None:
        """Where the step's batch came from (the carried-over groups it used count once in it)."""
        self.groups_in_batch, self.groups_carried_over, self.shortfall = in_batch, carried_over, wanted - in_batch
        self.groups_from_carry = min(self.groups_from_carry, in_batch)
