"""The reference for `model.logprob.token_logprobs`: full fp32 logits, differentiated by autograd."""

from __future__ import annotations

import torch

from model.logprob import check_logprob_inputs


def naive_token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    with_entropy: bool = True,
    entropy_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Reference for `token_logprobs`: materialises the full fp32 logits and lets autograd differentiate.
    `chunk_size` is accepted for signature compatibility and ignored."""
    check_logprob_inputs(hidden, weight, targets, temperature, chunk_size, with_entropy, entropy_grad)
    logits = (hidden @ weight.t()).to(torch.promote_types(hidden.dtype, torch.float32)) / temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = logp_all.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)
    if not with_entropy:
        return logp, None
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, (entropy if entropy_grad else entropy.detach())
