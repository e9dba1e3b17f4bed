"""One step's training phase (Algorithm 1, lines 9-12): advantages, old log-probs, mini-batch updates.

    A_i = (R_i - mean(R)) / (std(R) + eps) per group (Eq. 9, rl/advantage.py)
    for each of train_batch_size / mini_batch_size mini-batches (x ppo_epochs):
        loss = sum over micro-batches and ranks of policy_loss(..., global counts)   (Eq. 8, 10)
        clip the global gradient norm, AdamW step

Micro-batches are packed rows of at most `micro_batch_tokens` tokens. FSDP runs collectives in every
forward and backward, so every rank must run the same number of micro-batches: ranks with fewer pad
with an empty one (loss mask 0), which changes no gradient.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import TYPE_CHECKING

import torch

from model.logprob import DEFAULT_CHUNK
from parallel.finite import NonFiniteStateError, nonfinite_state
from parallel.grad_clip import clip_grad_norm_
from rl.advantage import group_advantages
from rl.correction import mismatch_metrics
from rl.reward import overlong_filter_mask
from trainer.losses import dapo_micro_batch_loss, micro_batch_logprobs
from trainer.packing import MicroBatch, PackItem, pack, pack_micro_batches

if TYPE_CHECKING:
    from config import Config
    from config.schema import AlgorithmConfig, RolloutConfig, TrainingConfig
    from parallel.dist_env import DistEnv

log = logging.getLogger(__name__)


def pack_items_for_groups(
    groups, *, adv_eps: float, norm_by_std: bool, overlong_filter: bool, group_offset: int = 0, step: int = 0
) -> list[list[PackItem]]:
    """One list of PackItems per group: each sample with its Eq. 9 advantage and its loss weight."""
    out = []
    for g, group in enumerate(groups):
        samples = group.payload
        advantages = group_advantages(
            torch.tensor(group.score, dtype=torch.float64),
            group_size=len(samples),
            eps=adv_eps,
            norm_by_std=norm_by_std,
        )
        # Overlong filtering (Sec. 3.4): truncated samples are masked out of the loss.
        weights = torch.ones(len(samples), 1)
        if overlong_filter:
            weights = overlong_filter_mask(weights, [s.finish_reason for s in samples])
        items = []
        for sample, advantage, weight in zip(samples, advantages.tolist(), weights[:, 0].tolist()):
            items.append(
                PackItem(
                    sample.example.prompt_ids,
                    sample.response_ids,
                    advantage,
                    weight,
                    sample.rollout_logprobs,
                    group_id=group_offset + g,
                    stale=sample.step < step,
                )
            )
        tokens = sum(len(it.response_ids) for it in items if it.loss_weight > 0)
        for it in items:
            it.group_num_tokens = tokens
        out.append(items)
    return out


ROLLOUT_LOGP_TOLERANCE = 1e-3  # largest engine/trainer log-prob gap at which the engine's may serve as pi_old
PADDING_GROUP = -1  # group id of the rows that only keep ranks in step


def empty_micro_batch(pad_to_multiple: int = 1) -> MicroBatch:
    """A one-token row that enters no loss: keeps FSDP's collectives in step on ranks with less data."""
    return pack([PackItem([0], [0], loss_weight=0.0, group_id=PADDING_GROUP)], pad_to_multiple)


def equalize_micro_batch_count(micro_batches: list[MicroBatch], dist_env: DistEnv) -> list[MicroBatch]:
    most = int(dist_env.all_reduce([float(len(micro_batches))], op="max")[0])
    pad = dist_env.dims.tp
    return micro_batches + [empty_micro_batch(pad) for _ in range(most - len(micro_batches))]


def split_into_mini_batches(group_items: list[list[PackItem]], num_updates: int) -> list[list[PackItem]]:
    """Deal whole groups into `num_updates` consecutive mini-batches (sizes differ by at most one group)."""
    bounds = [round(i * len(group_items) / num_updates) for i in range(num_updates + 1)]
    return [[it for items in group_items[a:b] for it in items] for a, b in zip(bounds[:-1], bounds[1:])]


def old_logprob_source(cfg: Config) -> str:
    """Where pi_old (Eq. 10's ratio denominator) comes from: "recompute" or "rollout".

    The engine's log-probs of the sampled tokens are pi_old itself when the engine runs the trainer's own
    model code on the weights of the step start in the same precision: the torch engine with the engine,
    the trained parameters and the compute all in fp32 (they agree within 1e-5). SGLang's kernels and any
    bf16 path give different numbers, so "auto" recomputes there.
    """
    choice = cfg.algorithm.old_logprobs
    if choice != "auto":
        return choice
    fp32 = (cfg.rollout.dtype, cfg.model.dtype, cfg.parallelism.param_dtype) == ("float32",) * 3
    return "rollout" if cfg.rollout.engine == "torch" and fp32 else "recompute"


def shares_prompts(cfg: Config, dist_env: DistEnv, device: torch.device) -> bool:
    """Whether micro-batches hold one prompt copy per group (model/shared_prompt_attention.py): asked for,
    and attention runs through SDPA on unsharded rows (FlexAttention's block mask and sequence-parallel rows
    are per document; compiled blocks are not checked with it)."""
    backend = cfg.model.attention_backend
    sdpa = backend == "sdpa" or (backend == "auto" and torch.device(device).type != "cuda")
    return cfg.training.share_prompts and sdpa and dist_env.dims.tp == 1 and not cfg.parallelism.compile


def needs_recompute(mb: MicroBatch, source: str) -> bool:
    """Whether pi_old of `mb` must come from the trainer: always with "recompute"; with "rollout" where a
    loss token belongs to a carried-over sample (an older policy drew it) or lacks the engine's log-probs."""
    if source != "rollout":
        return True
    if not bool((mb.mask > 0).any()):  # padding rows: no token needs pi_old
        return False
    return bool(mb.stale.any()) or any(it.rollout_logprobs is None for it in mb.items)


@torch.no_grad()
def fill_old_logprobs(
    model,
    micro_batches: list[MicroBatch],
    temperature: float,
    chunk_size: int,
    source: str = "recompute",
    at_least: int = 0,
) -> list[MicroBatch]:
    """log pi_old of every response token, from the trainer before this step's first update; returns the
    micro-batches it recomputed. With source "rollout" the engine's log-probs are taken instead where they
    are pi_old (`needs_recompute`). at_least: recompute at least this many micro-batches (those that need it
    first): under FSDP every rank must run as many forwards as the others."""
    order = sorted(range(len(micro_batches)), key=lambda i: not needs_recompute(micro_batches[i], source))
    count = max(at_least, sum(needs_recompute(mb, source) for mb in micro_batches))
    recomputed = []
    for position, i in enumerate(order):
        mb = micro_batches[i]
        if position >= count:
            mb.old_logp = mb.rollout_logp.float()
            continue
        logp, _ = micro_batch_logprobs(model, mb, temperature=temperature, chunk_size=chunk_size, with_entropy=False)
        mb.old_logp = logp  # in the log-probs' statistics dtype: fp32, or fp64 for a float64 model
        recomputed.append(mb)
    return recomputed


@dataclasses.dataclass
class _StepTotals:
    """What a step's updates add up: token-weighted metric sums, grad norms, update counts, the mismatch."""

    measured: list  # (trainer log-probs at the step-start weights, micro-batch) pairs for the mismatch
    sums: dict[str, float] = dataclasses.field(
        default_factory=lambda: dict.fromkeys(
            ("loss", "pg_clipfrac", "pg_clipfrac_lower", "ppo_kl", "entropy_sum", "token_prob_sum", "valid_tokens"), 0.0
        )
    )
    grad_norms: list[float] = dataclasses.field(default_factory=list)
    skipped: int = 0
    updates: int = 0
    mismatch: dict[str, float] | None = None


class TrainPhase:
    """Holds what the updates need across steps: model, optimizer, scheduler and the settings.

    training, algorithm, rollout: the [training], [algorithm] and [rollout] sections (the rollout's
    temperature and maximum response length); grad_clip: optimizer.grad_clip; old_logprobs: where pi_old
    comes from (`old_logprob_source`); share_prompts: one prompt copy per group (`shares_prompts`).
    `from_config` derives them all from the whole configuration.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
        dist_env: DistEnv,
        device: torch.device,
        *,
        training: TrainingConfig,
        algorithm: AlgorithmConfig,
        rollout: RolloutConfig,
        grad_clip: float,
        old_logprobs: str,
        share_prompts: bool,
    ):
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.dist, self.device = dist_env, device
        self.training, self.algorithm, self.rollout = training, algorithm, rollout
        self.grad_clip, self.old_logprobs, self.share_prompts = grad_clip, old_logprobs, share_prompts
        self.nonfinite_in_a_row = 0

    @classmethod
    def from_config(
        cls,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
        cfg: Config,
        dist_env: DistEnv,
        device: torch.device,
    ) -> TrainPhase:
        """The phase with the sections and decisions of `cfg` it reads."""
        return cls(
            model,
            optimizer,
            scheduler,
            dist_env,
            device,
            training=cfg.training,
            algorithm=cfg.algorithm,
            rollout=cfg.rollout,
            grad_clip=cfg.optimizer.grad_clip,
            old_logprobs=old_logprob_source(cfg),
            share_prompts=shares_prompts(cfg, dist_env, device),
        )

    def run(self, step: int, groups, progress=None) -> dict[str, float]:
        """Advantages, old log-probs and the step's updates on this rank's `groups`; returns the step's
        training metrics (reduced over ranks). progress: an observe.progress.Progress, set to the number
        of micro-batches to run and advanced after each (None: no display)."""
        mini_batches = self._mini_batches(step, groups)
        self.model.train()
        source = self.old_logprobs
        # Every rank runs as many old-log-prob forwards as the rank that needs the most (FSDP collectives).
        needed = [float(sum(needs_recompute(mb, source) for mb in mbs)) for mbs in mini_batches]
        most = self.dist.all_reduce(needed, op="max") if source == "rollout" else needed
        recomputed = [
            fill_old_logprobs(self.model, mbs, self.temperature, DEFAULT_CHUNK, source, at_least=int(m))
            for mbs, m in zip(mini_batches, most)
        ]
        # Engine vs trainer log-probs: from the recomputed pi_old, or, where the engine's were taken, from the
        # first mini-batch's loss pass (the weights have not moved yet there, so its log-probs are pi_old).
        totals = _StepTotals(measured=[(mb.old_logp, mb) for mbs in recomputed for mb in mbs])
        fresh_first = [mb for mb in mini_batches[0] if not any(mb is r for r in recomputed[0])] if mini_batches else []
        if progress is not None:
            progress.set_total(sum(len(mbs) for mbs in mini_batches) * self.training.ppo_epochs)
        for epoch in range(self.training.ppo_epochs):
            for index, mbs in enumerate(mini_batches):
                first = epoch == 0 and index == 0
                self._update(step, index, mbs, totals, fresh_first if first else [], source, first, progress)
        if totals.mismatch is None:  # the first mini-batch was not trained on: only recomputed log-probs measure it
            totals.mismatch = self._mismatch([(mb.old_logp, mb) for mbs in recomputed for mb in mbs])
        lr = self.optimizer.param_groups[0]["lr"]  # the rate this step ran at
        if totals.updates > totals.skipped:
            # The warm-up counts rollout steps that updated the policy (the paper: 20 rollout steps, each of
            # which trains, since dynamic sampling fills its batch). A step with nothing to train on, or whose
            # every update was skipped, leaves AdamW's state and the weights as they were, so it does not use
            # up warm-up either; the schedule's position is checkpointed with it.
            self.scheduler.step()
        return self._summary(totals, lr)

    @property
    def temperature(self) -> float:
        """The sampling temperature the log-probs are taken at (1 for greedy rollouts)."""
        return self.rollout.temperature if self.rollout.temperature > 0 else 1.0

    def _mini_batches(self, step: int, groups) -> list[list[MicroBatch]]:
        """This rank's groups as packed micro-batches per mini-batch, on the device, as many on every rank."""
        alg = self.algorithm
        num_updates = self.training.train_batch_size // self.training.mini_batch_size
        group_offset = self.dist.dp_rank * 1_000_000  # group ids unique across ranks
        items = pack_items_for_groups(
            groups,
            adv_eps=alg.adv_eps,
            norm_by_std=alg.norm_adv_by_std,
            overlong_filter=alg.overlong_filter,
            group_offset=group_offset,
            step=step,
        )
        mini_batches = []
        for mini in split_into_mini_batches(items, num_updates):
            mbs = (
                pack_micro_batches(
                    mini,
                    self.training.micro_batch_tokens,
                    self.dist.dims.tp,
                    share_prompts=self.share_prompts,
                )
                if mini
                else []
            )
            mini_batches.append([mb.to(self.device) for mb in equalize_micro_batch_count(mbs, self.dist)])
        return mini_batches

    def _update(
        self,
        step: int,
        index: int,
        mbs: list[MicroBatch],
        totals: _StepTotals,
        fresh: list[MicroBatch],
        source: str,
        first: bool,
        progress,
    ) -> None:
        """One mini-batch: the DAPO loss over its micro-batches (global counts), then clip and AdamW step.
        fresh: micro-batches whose loss pass measures the engine/trainer mismatch (first: the step's first)."""
        alg = self.algorithm
        tokens, seqs, groups_here = self._local_counts(mbs)
        g_tokens, g_seqs, g_groups = self.dist.all_reduce([tokens, seqs, groups_here])
        if g_seqs == 0:
            # Nothing to train on in this mini-batch on any rank: a short batch (on_shortfall = "fill")
            # left it empty, or overlong filtering masked every sample. No update, and nothing that
            # would enter the logged loss or grad norm as a zero.
            if progress is not None:
                progress.update(len(mbs))
            return
        totals.updates += 1
        loss_total = 0.0
        for micro_index, mb in enumerate(mbs):
            loss, metrics = dapo_micro_batch_loss(
                self.model,
                mb,
                global_num_tokens=g_tokens,
                global_num_seqs=g_seqs,
                global_num_groups=g_groups,
                temperature=self.temperature,
                clip_low=alg.clip_low,
                clip_high=alg.clip_high,
                clip_c=alg.clip_c,
                agg=alg.loss_agg,
                truncated_is=alg.truncated_is,
                is_cap=alg.truncated_is_cap,
                norm_len=self.rollout.max_response_length,
                chunk_size=DEFAULT_CHUNK,
            )
            loss.backward()
            if any(mb is m for m in fresh):
                totals.measured.append((metrics["logp"], mb))
            loss_value = loss.item()  # the micro-batch's one host sync for its loss
            loss_total += loss_value
            n = float(metrics["num_tokens"])
            for key in ("pg_clipfrac", "pg_clipfrac_lower", "ppo_kl"):
                totals.sums[key] += float(metrics[key]) * n
            for key in ("entropy_sum", "token_prob_sum", "valid_tokens"):
                totals.sums[key] += float(metrics[key])
            if not math.isfinite(loss_value):
                log.warning(
                    "step %d: non-finite loss %s in mini-batch %d, micro-batch %d", step, loss_value, index, micro_index
                )
            if progress is not None:
                progress.update(1)
        totals.sums["loss"] += self.dist.all_reduce([loss_total])[0]
        if first:
            totals.mismatch = self._mismatch(totals.measured)
            if source == "rollout" and totals.mismatch["mismatch/max_abs_logp"] > ROLLOUT_LOGP_TOLERANCE:
                log.warning(
                    "step %d: the engine's log-probs differ from the trainer's by up to %.2g, yet "
                    "serve as pi_old (algorithm.old_logprobs = %r); set it to 'recompute'",
                    step,
                    totals.mismatch["mismatch/max_abs_logp"],
                    alg.old_logprobs,
                )
        grad_norm = self._clip_and_step(step, index)
        if grad_norm is None:
            totals.skipped += 1
        else:
            totals.grad_norms.append(grad_norm)

    def _summary(self, totals: _StepTotals, lr: float) -> dict[str, float]:
        """The step's training metrics: token-weighted means over every rank, per-update means."""
        # Every rank contributed its token-weighted sums; "loss" is already reduced.
        sums = dict(totals.sums)
        loss_sum = sums.pop("loss")
        reduced = dict(zip(sums, self.dist.all_reduce(list(sums.values()))))
        reduced["loss"] = loss_sum
        tokens = reduced.pop("valid_tokens")
        per_token = (lambda x: x / tokens) if tokens else (lambda x: math.nan)  # NaN: no token was trained on
        updates, grad_norms = totals.updates, totals.grad_norms
        return {
            "loss": reduced["loss"] / updates if updates else math.nan,
            "pg_clipfrac": per_token(reduced["pg_clipfrac"]),
            "pg_clipfrac_lower": per_token(reduced["pg_clipfrac_lower"]),
            "ppo_kl": per_token(reduced["ppo_kl"]),
            "entropy": per_token(reduced["entropy_sum"]),
            "token_prob/mean": per_token(reduced["token_prob_sum"]),
            "grad_norm": sum(grad_norms) / len(grad_norms) if grad_norms else math.nan,
            "updates_skipped_nonfinite": totals.skipped,
            "updates": updates,
            "lr": lr,
            "train_tokens": tokens / self.training.ppo_epochs,
            **totals.mismatch,
        }

    def _mismatch(self, measured: list[tuple[torch.Tensor, MicroBatch]]) -> dict[str, float]:
        """Engine vs trainer log-probs of the same tokens (rl/correction.py), over all ranks' tokens.
        measured: (the trainer's log-probs at the step-start weights [S, L], their micro-batch) pairs."""
        sums = [0.0, 0.0, 0.0, 0.0]  # tokens, |delta| sum, k3 sum, |delta p| > 0.1 count
        worst = 0.0
        for trainer_logp, mb in measured:
            # Fresh samples only: carried-over ones differ by design (an older policy drew them).
            m = mismatch_metrics(trainer_logp, mb.rollout_logp, mb.mask * ~mb.stale.unsqueeze(1))
            n = float(m["mismatch_num_tokens"])
            sums[0] += n
            sums[1] += float(m["mismatch_abs_logp_mean"]) * n
            sums[2] += float(m["mismatch_k3_kl"]) * n
            sums[3] += float(m["mismatch_prob_diff_frac"]) * n
            worst = max(worst, float(m["mismatch_abs_logp_max"]))
        tokens, abs_sum, k3_sum, far = self.dist.all_reduce(sums)
        worst = self.dist.all_reduce([worst], op="max")[0]
        if not tokens:  # no fresh sample to compare: nothing measured
            return dict.fromkeys(
                ("mismatch/mean_abs_logp", "mismatch/max_abs_logp", "mismatch/k3_kl", "mismatch/prob_diff_gt_0.1"),
                math.nan,
            )
        return {
            "mismatch/mean_abs_logp": abs_sum / tokens,
            "mismatch/max_abs_logp": worst,
            "mismatch/k3_kl": k3_sum / tokens,
            "mismatch/prob_diff_gt_0.1": far / tokens,
        }

    def _local_counts(self, mbs: list[MicroBatch]) -> tuple[float, float, float]:
        """Loss tokens, sequences and groups of this rank's mini-batch. Sequences and groups count only
        those with a loss token (rl/loss.py): overlong-filtered samples and padding rows are left out."""
        tokens, seqs, groups = 0.0, 0.0, set()
        for mb in mbs:
            valid = mb.mask > 0
            rows = valid.any(dim=-1)
            tokens += float(valid.sum())
            seqs += float(rows.sum())
            groups.update(mb.group_ids[rows.to(mb.group_ids.device)].tolist())
        return tokens, seqs, float(len(groups))

    def _clip_and_step(self, step: int, index: int) -> float | None:
        """Clip the global grad norm and step; returns the norm, or None for a skipped update.

        A non-finite gradient norm skips the update (the weights and AdamW's state stay as they were) and
        counts as a non-finite update. After the step the weights are checked (parallel/finite.py: one fused
        reduction, agreed by every rank): weights gone NaN or inf cannot be taken back without a second copy
        of the policy and its moments, so the run stops without saving that state (NonFiniteStateError) and a
        rerun resumes from the newest checkpoint, which was verified finite when it was written."""
        max_norm = self.grad_clip if self.grad_clip > 0 else float("inf")
        norm = float(clip_grad_norm_([p for p in self.model.parameters() if p.grad is not None], max_norm))
        if not math.isfinite(norm):
            self.optimizer.zero_grad(set_to_none=True)
            self.nonfinite_in_a_row += 1
            log.warning(
                "step %d, mini-batch %d: non-finite gradient norm %s; update skipped (%d in a row)",
                step,
                index,
                norm,
                self.nonfinite_in_a_row,
            )
            return None
        self.nonfinite_in_a_row = 0
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        after = nonfinite_state(self.model)
        if after is not None:
            raise NonFiniteStateError(
                f"step {step}, mini-batch {index}: after the optimizer step {after} (gradient norm {norm:.4g}); "
                f"stopping without saving this state: rerun the same command to resume from the newest checkpoint"
            )
        return norm
