"""Policy log-probs on packed micro-batches, and the DAPO / supervised losses built on them.

The log-prob of response token k of a sample is read from the hidden state that predicts it (see
trainer/packing.py). Only those rows go through the output head, in chunks (model/logprob.py), or
vocabulary-parallel when the head is tensor-parallel (parallel/logprob.py): the [tokens, vocab] logits
are never materialised, and prompt positions never reach the head at all.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Replicate

from model.logprob import DEFAULT_CHUNK, token_logprobs
from parallel.logprob import vocab_parallel_token_logprobs
from rl.correction import truncated_is_weights
from rl.loss import policy_loss
from trainer.packing import MicroBatch


def micro_batch_logprobs(
    model, mb: MicroBatch, *, temperature: float = 1.0, chunk_size: int = DEFAULT_CHUNK, with_entropy: bool = True
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log pi(o_t | q, o_<t) / T-tempered, and the entropy, on the micro-batch's [S, L] response grid."""
    hidden = model(mb.tokens, mb.positions, mb.document_ids, context=mb.attention_context(), return_hidden=True)
    if isinstance(hidden, DTensor):  # sequence-parallel output of the final norm
        hidden = hidden.redistribute(placements=[Replicate()] * hidden.device_mesh.ndim).to_local()
    selected = hidden[0, mb.predict_positions]
    weight = model.output_weight()
    if isinstance(weight, DTensor):  # vocabulary-sharded head under tensor parallelism
        logp, entropy = vocab_parallel_token_logprobs(
            selected, weight, mb.targets, temperature=temperature, chunk_size=chunk_size, with_entropy=with_entropy
        )
    else:
        logp, entropy = token_logprobs(
            selected, weight, mb.targets, temperature=temperature, chunk_size=chunk_size, with_entropy=with_entropy
        )
    return mb.grid(logp), (mb.grid(entropy) if entropy is not None else None)


def dapo_micro_batch_loss(
    model,
    mb: MicroBatch,
    *,
    global_num_tokens,
    global_num_seqs,
    global_num_groups,
    temperature: float,
    clip_low: float,
    clip_high: float,
    clip_c: float,
    agg: str,
    truncated_is: bool = False,
    is_cap: float = 2.0,
    norm_len: float | None = None,
    chunk_size: int = DEFAULT_CHUNK,
):
    """This micro-batch's share of the mini-batch DAPO loss (Eq. 8, 10), and its metrics.

    The global counts make the loss `sum(token losses here) / count over the whole mini-batch`, so the
    gradients of all micro-batches on all ranks SUM to the mini-batch gradient (rl/loss.py).
    """
    logp, entropy = micro_batch_logprobs(model, mb, temperature=temperature, chunk_size=chunk_size)
    # Truncated importance sampling (rl/correction.py): min(pi_old / pi_rollout, cap) per token. Samples of
    # carried-over groups were drawn by an earlier policy, so they always get it (decoupled PPO: the
    # clip stays anchored at pi_old, the weight corrects for the behaviour policy); fresh samples only
    # when truncated_is is on, to absorb engine/trainer numeric differences.
    weights = truncated_is_weights(mb.old_logp, mb.rollout_logp, mb.mask, cap=is_cap)
    if not truncated_is:
        weights = torch.where(mb.stale.unsqueeze(1), weights, torch.ones_like(weights))
    group_num_tokens = None
    if agg == "group-token-mean":
        # Groups never straddle ranks, but may straddle micro-batches: count each group's tokens over the
        # whole mini-batch (the caller stores them per sample in `mb.group_tokens`).
        group_num_tokens = mb.group_tokens
    loss, metrics = policy_loss(
        logp,
        mb.old_logp,
        mb.advantages,
        mb.mask,
        clip_low=clip_low,
        clip_high=clip_high,
        clip_c=clip_c,
        agg=agg,
        global_num_tokens=global_num_tokens,
        global_num_seqs=global_num_seqs,
        token_weights=weights,
        group_ids=mb.group_ids if agg == "group-token-mean" else None,
        group_num_tokens=group_num_tokens,
        global_num_groups=global_num_groups if agg == "group-token-mean" else None,
        norm_len=norm_len,
    )
    valid = mb.mask > 0
    with torch.no_grad():
        metrics = dict(metrics)
        metrics["entropy_sum"] = (entropy.float() * valid).sum()
        metrics["token_prob_sum"] = (logp.detach().float().exp() * valid).sum()
        metrics["valid_tokens"] = valid.sum()
        metrics["logp"] = logp.detach()  # [S, L]: at the step-start weights, pi_old itself (trainer/update.py)
    return loss, metrics


def sft_micro_batch_loss(model, mb: MicroBatch, *, global_num_tokens, chunk_size: int = DEFAULT_CHUNK):
    """Supervised warm-up: -sum log p(solution tokens) / tokens in the whole batch (teacher forcing)."""
    logp, _ = micro_batch_logprobs(model, mb, chunk_size=chunk_size, with_entropy=False)
    return -(logp * mb.mask).sum() / global_num_tokens
