"""Token sampling from a batch of logits: temperature, top-k, top-p, greedy; with the sampled log-probs.

For logits z (one row) and temperature T > 0:
    log p = log_softmax(z / T)                       # returned log-probs use this, untruncated
    keep  = top-k set of z, then the top-p nucleus of the renormalised top-k distribution
    q_i   = p_i / sum_{j in keep} p_j  for i in keep, else 0
    token ~ q                                        # drawn by inverse CDF, below
    logprob = log p[token]
At T = 0: token = argmax z and logprob = log_softmax(z)[token].

The returned log-prob is from the full distribution log_softmax(z / T), not the truncated q: it is what
SGLang reports and what the trainer recomputes from the same weights, so DAPO's importance ratio
(Eq. 10) starts at exactly 1 for on-policy samples.

Sampling is by inverse CDF with one uniform draw per row: C_i = q_0 + ... + q_i,
u ~ U[0, 1) * C_{V-1}, token = the first i with C_i > u, so P(token = i) = q_i / C_{V-1} = q_i.
A token with q_i = 0 is never drawn (C_i = C_{i-1}, so an earlier index already exceeds u), and
scaling u by C_{V-1} rather than 1 keeps the float sum's rounding from selecting past the end. One
draw per row instead of one per logit (torch.multinomial, the exponential race) is what makes it
cheap on CPU, and it needs no device-to-host sync.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def truncate_logits(scaled: torch.Tensor, top_k: int = -1, top_p: float = 1.0) -> torch.Tensor:
    """Set to -inf every logit outside the top-k set and then outside the top-p nucleus.

    scaled: [B, V] temperature-scaled logits. top_k = -1 keeps all; exactly k logits survive top-k
    (ties at the k-th value are broken by index). The nucleus is the smallest prefix of tokens sorted by
    probability whose mass reaches top_p; the most likely token always survives.
    """
    vocab = scaled.shape[-1]
    if top_k != -1 and top_k < vocab:
        values, indices = torch.topk(scaled, top_k, dim=-1)
        scaled = torch.full_like(scaled, float("-inf")).scatter_(-1, indices, values)
    if top_p < 1.0:
        sorted_logits, order = torch.sort(scaled, dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(dim=-1)
        # Mass strictly before each token: a token is outside the nucleus once that already reaches top_p.
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop_sorted = mass_before >= top_p
        drop_sorted[..., 0] = False
        drop = torch.zeros_like(drop_sorted).scatter_(-1, order, drop_sorted)
        scaled = scaled.masked_fill(drop, float("-inf"))
    return scaled


def sample(
    logits: torch.Tensor,
    temperature: float,
    top_k: int = -1,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row of logits [B, V]; returns (tokens [B] int64, logprobs [B] fp32)."""
    logits = logits.float()
    if temperature == 0.0:
        tokens = logits.argmax(dim=-1)
        logprobs = F.log_softmax(logits, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
        return tokens, logprobs
    scaled = logits / temperature
    full_logprobs = F.log_softmax(scaled, dim=-1)
    kept = truncate_logits(scaled, top_k, top_p)
    cdf = kept.softmax(dim=-1).cumsum_(dim=-1)
    u = torch.rand(cdf.shape[0], 1, generator=generator, device=cdf.device) * cdf[:, -1:]
    tokens = torch.searchsorted(cdf, u, right=True).squeeze(-1).clamp_(max=cdf.shape[-1] - 1)
    logprobs = full_logprobs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    return tokens, logprobs
