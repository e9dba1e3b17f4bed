"""The metric records of the DAPO step, kept beside the functions they describe: what the clip of Eq. 10 did to a
loss call's tokens (ClipStats, filled by rl/loss.py `clipped_token_loss`) and what dynamic sampling (Eq. 11) did
in a step (FilterStats, filled by rl/filter.py). Each field is a logged record (observe/records.py): the step adds
these records into its own and reduces them over ranks as they are (trainer/step_metrics.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from observe.records import SAME, Count, Mean, Sum, logged


@dataclass
class ClipStats:
    """Eq. 10 over a call's valid tokens: the shares clipped (the clipped term the larger), dual-clipped (A < 0)
    and clipped at the upper bound (A > 0), the mean pi_old probability of the last (DAPO Fig. 3: the upper clip
    caps tokens the old policy gave a low probability), mean old_logp - logp (clamped), the share of the
    responses' first tokens clipped at the upper bound (where a response chooses its approach), the largest ratio,
    and the valid tokens and the rows that have one. GSPO's (rl/loss.py) are of the tokens whose sequence ratio
    the clip binds, its ratio the sequence's; CISPO's of the tokens whose weight was clipped (upper: at 1 + eps_high,
    whatever A's sign; the lower share is pg_clipfrac - pg_clipfrac_upper). Neither has a dual clip: its share is 0."""

    pg_clipfrac: Mean = logged("pg_clipfrac", Mean)
    pg_clipfrac_lower: Mean = logged("pg_clipfrac_lower", Mean)
    pg_clipfrac_upper: Mean = logged("pg_clipfrac_upper", Mean)
    clipped_upper_prob: Mean = logged("token_prob/clipped_upper_mean", Mean)
    ppo_kl: Mean = logged("ppo_kl", Mean)
    first_token_upper: Mean = logged("pg_clipfrac_upper/first_token", Mean)
    ratio_max: float = 0.0  # not logged: of this call only, as the two counts below
    num_tokens: int = 0
    num_nonempty_seqs: int = 0

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
        clip_binds = clipped > unclipped
        dual_binds = torch.zeros_like(valid)
        if clip_c is not None:  # the dual clip binds where max(-A r, -A clip(r)) > -A c, A < 0
            dual_binds = (advantages < 0) & (torch.maximum(unclipped, clipped) > -advantages * clip_c)
        return cls.shares(valid, old_logp, log_ratio, ratio, clip_binds, clip_binds & (advantages > 0), dual_binds)

    @classmethod
    @torch.no_grad()
    def shares(
        cls,
        valid: torch.Tensor,
        old_logp: torch.Tensor,
        log_ratio: torch.Tensor,
        ratio: torch.Tensor,
        clip_binds: torch.Tensor,
        upper: torch.Tensor,
        dual_binds: torch.Tensor,
    ) -> ClipStats:
        """The statistics from where the clip binds, where it binds at the upper bound and where the dual clip
        binds. Each share is computed in the loss's dtype and weighted by its count."""
        dtype, stats = ratio.dtype, cls()
        num_tokens = valid.sum()
        denom = num_tokens.clamp(min=1).to(dtype)
        upper = upper & valid
        num_upper = upper.sum()
        n = float(num_tokens)
        upper_share = float(num_upper.to(dtype) / denom)
        stats.pg_clipfrac.add(float((clip_binds & valid).sum().to(dtype) / denom) * n, n)
        stats.pg_clipfrac_lower.add(float((dual_binds & valid).sum().to(dtype) / denom) * n, n)
        stats.pg_clipfrac_upper.add(upper_share * n, n)
        upper_prob = torch.where(upper, old_logp.exp(), 0.0).sum() / num_upper.clamp(min=1).to(dtype)
        stats.clipped_upper_prob.add(float(upper_prob) * upper_share * n, upper_share * n)
        stats.ppo_kl.add(float(torch.where(valid, -log_ratio, 0.0).sum() / denom) * n, n)
        stats.first_token_upper.add(float(upper[..., :1].sum()), float(valid[..., :1].sum()))
        stats.ratio_max = float(torch.where(valid, ratio, 0.0).max()) if valid.numel() else 0.0
        stats.num_tokens, stats.num_nonempty_seqs = int(num_tokens), int(valid.any(dim=-1).sum())
        return stats


@dataclass
class FilterStats:
    """What dynamic sampling did in one step: the rounds it ran; the groups they generated, before filtering, and
    the shares of them that were kept, all correct, all wrong; the samples generated per kept sample; and where the
    batch came from: carried-over groups used, surplus carried to the next step, stale ones dropped, and the
    groups missing from a short batch (on_shortfall = "fill"). The shares are NaN on a step served entirely from
    carried-over groups."""

    rounds: Count = logged("gen/rounds", Count, SAME)
    kept_share: Mean = logged("groups/kept_share", Mean)
    all_correct_share: Mean = logged("groups/all_correct_share", Mean)
    all_wrong_share: Mean = logged("groups/all_wrong_share", Mean)
    samples: Sum = logged("gen/samples", Sum)  # the x axis of accuracy against generated samples (DAPO Fig. 6)
    samples_per_kept_sample: Mean = logged("gen/samples_per_kept_sample", Mean)
    in_batch: Sum = logged("groups/in_batch", Sum)
    from_carry: Sum = logged("groups/from_carry", Sum)
    carried_over: Sum = logged("groups/carried_over", Sum)
    dropped_stale: Sum = logged("groups/dropped_stale", Sum)
    shortfall: Sum = logged("groups/shortfall", Sum)

    def count_round(self, generated: int, samples: int, all_correct: int, all_wrong: int, kept: int) -> None:
        """One generation round: its groups (and samples) before filtering, the all-correct and all-wrong ones,
        and the kept ones (all groups of one size: samples / generated per group)."""
        self.rounds.add(1)
        self.kept_share.add(kept, generated)
        self.all_correct_share.add(all_correct, generated)
        self.all_wrong_share.add(all_wrong, generated)
        self.samples.add(samples)
        self.samples_per_kept_sample.add(samples, kept * (samples // max(generated, 1)))

    def count_batch(self, in_batch: int, from_carry: int, carried_over: int, dropped_stale: int, wanted: int) -> None:
        """Where the step's batch came from (the carried-over groups it used count once in it)."""
        self.in_batch.add(in_batch)
        self.from_carry.add(min(from_carry, in_batch))
        self.carried_over.add(carried_over)
        self.dropped_stale.add(dropped_stale)
        self.shortfall.add(wanted - in_batch)
