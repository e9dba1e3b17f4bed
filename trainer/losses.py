"""Policy log-probs on packed micro-batches, and the DAPO / supervised losses built on them.

The log-prob of response token k of a sample is read from the hidden state that predicts it (see
trainer/packing.py). Only those rows go through the output head, in chunks (model/logprob.py), or
vocabulary-parallel when the head is tensor-parallel (parallel/logprob.py): the [tokens, vocab] logits
are never materialised, and prompt positions never reach the head at all.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch.distributed.tensor import DTensor, Replicate

from model.logprob import DEFAULT_CHUNK, token_logprobs
from parallel.logprob import vocab_parallel_token_logprobs
from rl.correction import truncated_is_weights
from rl.loss import LossSettings, policy_loss
from rl.loss_modes import GlobalCounts
from rl.stats import ClipStats
from trainer.packing import MicroBatch

if TYPE_CHECKING:
    from config.schema import AlgorithmConfig, RolloutConfig
    from model.qwen2 import Qwen2


def micro_batch_logprobs(
    model: Qwen2,
    mb: MicroBatch,
    *,
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK,
    with_entropy: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log pi(o_t | q, o_<t) / T-tempered, and the entropy, on the micro-batch's [S, L] response grid."""
    hidden = model(mb.tokens, mb.positions, mb.document_ids, context=mb.attention_context(), return_hidden=True)
    if isinstance(hidden, DTensor):  # sequence-parallel output of the final norm
        hidden = hidden.redistribute(placements=[Replicate()] * hidden.device_mesh.ndim).to_local()
    selected = hidden[0, mb.predict_positions]
    weight = model.output_weight()
    # A DTensor weight: the vocabulary-sharded head under tensor parallelism.
    logprobs = vocab_parallel_token_logprobs if isinstance(weight, DTensor) else token_logprobs
    logp, entropy = logprobs(
        selected, weight, mb.targets, temperature=temperature, chunk_size=chunk_size, with_entropy=with_entropy
    )
    return mb.grid(logp), (mb.grid(entropy) if entropy is not None else None)


@dataclass(frozen=True)
class PassStats:
    """What one micro-batch's loss pass tells the step's metrics: Eq. 10's clip statistics, the entropy and
    token-probability sums over its valid tokens, and its log-probs [S, L] (at the step-start weights, pi_old
    itself: trainer/mismatch.py)."""

    clip: ClipStats
    entropy_sum: torch.Tensor
    token_prob_sum: torch.Tensor
    logp: torch.Tensor


class DAPOLoss:
    """The DAPO policy loss of one micro-batch (Eq. 10, then Eq. 8) with the run's [algorithm] settings: built
    once from the [algorithm] and [rollout] sections, then called with data only.

        loss, clip = policy_loss(log pi, log pi_old, A, mask, settings (eps_low, eps_high, c, ...), counts)   rl/loss.py

    With the mini-batch's global count N_tokens (`GlobalCounts`), each micro-batch's loss is its share, so the
    gradients of all micro-batches on all ranks SUM to the mini-batch gradient (rl/loss.py). Table 1's other
    algorithm.loss_agg modes divide by their own counts (rl/loss_modes.py); algorithm.policy_loss swaps Eq. 10
    for GSPO's or CISPO's per-token loss (rl/loss.py). The log-probs are at the rollout's
    temperature (rollout.logprob_temperature); seq-mean-token-sum-norm divides by rollout.max_response_length.
    """

    def __init__(self, algorithm: AlgorithmConfig, rollout: RolloutConfig, chunk_size: int = DEFAULT_CHUNK):
        self.algorithm, self.chunk_size = algorithm, chunk_size  # chunk_size: output-head rows at a time
        self.temperature, alg = rollout.logprob_temperature, algorithm
        args = (alg.clip_low, alg.clip_high, alg.clip_c, alg.loss_agg, alg.policy_loss, rollout.max_response_length)
        self.settings = LossSettings(*args)

    def __call__(self, model: Qwen2, mb: MicroBatch, counts: GlobalCounts) -> tuple[torch.Tensor, PassStats]:
        """This micro-batch's share of the mini-batch loss, and what it tells the step's metrics."""
        logp, entropy = micro_batch_logprobs(model, mb, temperature=self.temperature, chunk_size=self.chunk_size)
        assert entropy is not None  # asked for: with_entropy defaults to True
        assert mb.old_logp is not None, "pi_old is filled before the updates (trainer/update.py)"
        loss, clip = policy_loss(
            logp,
            mb.old_logp,
            mb.advantages,
            mb.mask,
            self.settings,
            counts,
            token_weights=self.importance_weights(mb),
            # groups never straddle ranks, but may straddle micro-batches: mb.group_tokens holds their counts
            group_ids=mb.group_ids,
            group_num_tokens=mb.group_tokens,
        )
        with torch.no_grad():
            valid = mb.mask > 0
            entropy_sum = (entropy.float() * valid).sum()
            token_prob_sum = (logp.detach().float().exp() * valid).sum()
        return loss, PassStats(clip, entropy_sum, token_prob_sum, logp.detach())

    def importance_weights(self, mb: MicroBatch) -> torch.Tensor:
        """Truncated importance sampling (rl/correction.py): min(pi_old / pi_rollout, cap) per token. Samples of
        carried-over groups were drawn by an earlier policy, so they always get it (decoupled PPO: the clip
        stays anchored at pi_old, the weight corrects for the behaviour policy); fresh samples only with
        algorithm.truncated_is, to absorb engine/trainer numeric differences."""
        assert mb.old_logp is not None
        weights = truncated_is_weights(mb.old_logp, mb.rollout_logp, mb.mask, cap=self.algorithm.truncated_is_cap)
        if not self.algorithm.truncated_is:
            weights = torch.where(mb.stale.unsqueeze(1), weights, torch.ones_like(weights))
        return weights


def sft_micro_batch_loss(
    model: Qwen2, mb: MicroBatch, *, global_num_tokens: float, chunk_size: int = DEFAULT_CHUNK
) -> torch.Tensor:
    """Supervised warm-up: -sum log p(solution tokens) / tokens in the whole batch (teacher forcing)."""
    logp, _ = micro_batch_logprobs(model, mb, chunk_size=chunk_size, with_entropy=False)
    return -(logp * mb.mask).sum() / global_num_tokens
