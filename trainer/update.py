"""One step's training phase (Algorithm 1, lines 9-12): advantages, old log-probs, mini-batch updates.

    A_i = (R_i - mean(R)) / (std(R) + eps) per group (Eq. 9, rl/advantage.py)
    for each of train_batch_size / mini_batch_size mini-batches (x ppo_epochs):
        loss = sum over micro-batches and ranks of DAPOLoss(..., global counts)   (Eq. 10, then Eq. 8)
        clip the global gradient norm, AdamW step

Micro-batches are packed rows of at most `micro_batch_tokens` tokens. FSDP runs collectives in every
forward and backward, so every rank must run the same number of micro-batches: ranks with fewer pad
with an empty one (loss mask 0), which changes no gradient.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from rl.advantage import group_advantages
from rl.loss_modes import GlobalCounts
from rl.reward import overlong_filter_mask
from trainer.losses import DAPOLoss, micro_batch_logprobs
from trainer.optimizer import OptimizerStep
from trainer.packing import MicroBatch, PackItem, pack, pack_micro_batches
from trainer.step_metrics import TrainMetrics

if TYPE_CHECKING:
    from config import Config
    from model.qwen2 import Qwen2
    from parallel.dist_env import DistEnv
    from trainer.observers import TrainWatch
    from trainer.types import RolloutGroup


def pack_items_for_groups(
    groups: list[RolloutGroup],
    *,
    adv_eps: float,
    norm_by_std: bool,
    overlong_filter: bool,
    group_offset: int = 0,
    step: int = 0,
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
        items = [
            PackItem(
                sample.example.prompt_ids,
                sample.response_ids,
                advantage,
                weight,
                sample.rollout_logprobs,
                group_id=group_offset + g,
                stale=sample.step < step,
            )
            for sample, advantage, weight in zip(samples, advantages.tolist(), weights[:, 0].tolist())
        ]
        tokens = sum(len(it.response_ids) for it in items if it.loss_weight > 0)
        for it in items:
            it.group_num_tokens = tokens
        out.append(items)
    return out


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
    model: Qwen2,
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


class TrainPhase:
    """The updates of a step, built once (the run's configuration, the policy, its optimizer and schedule, the
    ranks, the phase's observer) and called with data every step (`run`)."""

    def __init__(
        self,
        cfg: Config,
        model: Qwen2,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
        dist_env: DistEnv,
        watch: TrainWatch,
    ):
        self.cfg, self.model, self.scheduler, self.dist, self.watch = cfg, model, scheduler, dist_env, watch
        self.training, self.algorithm = cfg.training, cfg.algorithm
        self.optimizer_step = OptimizerStep(cfg.optimizer, model, optimizer)
        self.loss = DAPOLoss(cfg.algorithm, cfg.rollout)
        self.old_logprobs = old_logprob_source(cfg)  # where pi_old comes from
        self.share_prompts = shares_prompts(cfg, dist_env, dist_env.device)  # one prompt copy per group

    def run(self, step: int, groups: list[RolloutGroup]) -> TrainMetrics:
        """Lines 9-12 on this rank's `groups`: advantages (`pack_items`) and mini-batches (`mini_batches`), pi_old,
        then for each mini-batch (x ppo_epochs) the loss passes of its micro-batches and one optimizer step; the
        learning-rate schedule steps once a step that updated the policy. Returns this rank's training metrics
        (StepRecord.reduce combines the ranks')."""
        group_items = self.pack_items(step, groups)  # each sample with its Eq. 9 advantage and its loss weight
        self.watch.samples(step, groups, group_items)
        mini_batches = self.mini_batches(group_items)
        lr = self.optimizer_step.optimizer.param_groups[0]["lr"]  # the rate this step runs at
        self.watch.start(step, mini_batches, self.training.ppo_epochs, lr)
        self.model.train()
        self.fill_old_logprobs(mini_batches)
        applied = 0  # updates of the policy
        for _ in range(self.training.ppo_epochs):
            for index, mbs in enumerate(mini_batches):
                counts = self.global_counts(mbs)
                if counts.seqs == 0:
                    # Nothing to train on in this mini-batch on any rank: a short batch (on_shortfall = "fill")
                    # left it empty, or overlong filtering masked every sample. No update, and nothing that
                    # would enter the logged loss or grad norm as a zero.
                    self.watch.skipped(len(mbs))
                    continue
                loss = 0.0
                for mb in mbs:
                    loss += self.loss_pass(mb, counts)
                grad_norm = self.optimizer_step(f"step {step}, mini-batch {index}")  # None: skipped, non-finite
                applied += grad_norm is not None
                self.watch.update(loss, grad_norm)
        if applied:
            # The warm-up counts rollout steps that updated the policy (the paper: 20 rollout steps, each of
            # which trains, since dynamic sampling fills its batch). A step with nothing to train on, or whose
            # every update was skipped, leaves AdamW's state and the weights as they were, so it does not use
            # up warm-up either; the schedule's position is checkpointed with it.
            self.scheduler.step()
        return self.watch.finish(self.algorithm.old_logprobs if self.old_logprobs == "rollout" else None)

    def fill_old_logprobs(self, mini_batches: list[list[MicroBatch]]) -> None:
        """pi_old of every micro-batch (recomputed, or the engine's where exact); the recomputed ones are
        measured against the engine's. Every rank runs as many forwards as the rank that needs the most (FSDP)."""
        source = self.old_logprobs
        needed = [float(sum(needs_recompute(mb, source) for mb in mbs)) for mbs in mini_batches]
        most = self.dist.all_reduce(needed, op="max") if source == "rollout" else needed
        temperature, chunk = self.loss.temperature, self.loss.chunk_size
        for mbs, m in zip(mini_batches, most):
            for mb in fill_old_logprobs(self.model, mbs, temperature, chunk, source, at_least=int(m)):
                assert mb.old_logp is not None  # just filled
                self.watch.recomputed(mb.old_logp, mb)

    def pack_items(self, step: int, groups: list[RolloutGroup]) -> list[list[PackItem]]:
        """This rank's groups as PackItems, one list per group: each sample with its Eq. 9 advantage and its loss
        weight (overlong filtering), its group's id unique across ranks."""
        alg = self.algorithm
        return pack_items_for_groups(
            groups,
            adv_eps=alg.adv_eps,
            norm_by_std=alg.norm_adv_by_std,
            overlong_filter=alg.overlong_filter,
            group_offset=self.dist.dp_rank * 1_000_000,
            step=step,
        )

    def mini_batches(self, group_items: list[list[PackItem]]) -> list[list[MicroBatch]]:
        """The groups' items as packed micro-batches per mini-batch, on the device, as many on every rank."""
        num_updates = self.training.train_batch_size // self.training.mini_batch_size
        mini_batches = []
        for mini in split_into_mini_batches(group_items, num_updates):
            tokens, tp = self.training.micro_batch_tokens, self.dist.dims.tp
            mbs = pack_micro_batches(mini, tokens, tp, share_prompts=self.share_prompts) if mini else []
            mini_batches.append([mb.to(self.dist.device) for mb in equalize_micro_batch_count(mbs, self.dist)])
        return mini_batches

    def loss_pass(self, mb: MicroBatch, counts: GlobalCounts) -> float:
        """Forward, the DAPO loss (Eq. 10, 8), backward: returns the micro-batch's share of the mini-batch loss
        (its one host read)."""
        loss, stats = self.loss(self.model, mb, counts)
        loss.backward()
        self.watch.loss_pass(stats, mb)
        return loss.item()

    def global_counts(self, mbs: list[MicroBatch]) -> GlobalCounts:
        """Loss tokens, sequences and groups of the mini-batch over every rank. Sequences and groups count only
        those with a loss token (rl/loss.py): overlong-filtered samples and padding rows are left out."""
        tokens, seqs, groups = 0.0, 0.0, set()
        for mb in mbs:
            valid = mb.mask > 0
            rows = valid.any(dim=-1)
            tokens += float(valid.sum())
            seqs += float(rows.sum())
            groups.update(mb.group_ids[rows.to(mb.group_ids.device)].tolist())
        return GlobalCounts(*self.dist.all_reduce([tokens, seqs, float(len(groups))]))
