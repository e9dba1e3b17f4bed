"""Attention for packed rows in which the G samples of a prompt share one copy of the prompt.

A shared-prompt row (trainer/packing.py, `share_prompts=True`) holds each prompt once, followed by the
responses of its samples:

    [prompt_g | response_g1 | response_g2 | ... | prompt_h | response_h1 | ...]

with positions 0..P-1 on the prompt and P..P+R_i-1 on every response. Token t of response i attends to

    the whole prompt of its group, and the tokens of response i up to t            (no other response)

and a prompt token attends causally within its prompt: exactly what it sees when the sample is packed
alone as [prompt | response_i]. A causal model's prompt states do not depend on what follows them, so the
hidden states, log-probs and gradients equal the one-copy-per-sample packing, for (P + sum R) instead of
(G P + sum R) tokens of every linear layer. The gradients of the shared prompt states are the sums over
the samples that read them, as autograd accumulates them through the gathers below.

Prompts are attended as a [prompts, longest, ...] batch with plain causal SDPA; responses as a
[samples, longest response, ...] query batch against [prompt slots | response slots] keys with a boolean
mask. The model's Attention receives this object as its `context` (model/qwen2.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _runs(segments: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(index [N, longest] of each run's row positions (0 in the padding), valid [N, longest]) of
    (start, length) runs [N, 2]."""
    longest = max(1, int(segments[:, 1].max())) if segments.numel() else 1
    offsets = torch.arange(longest, device=segments.device)
    valid = offsets < segments[:, 1:2]
    return torch.where(valid, segments[:, 0:1] + offsets, 0), valid


class SharedPromptContext:
    """prompt_segments [G, 2] (start, length) and response_segments [S, 3] (start, length, prompt index) of
    one packed row of `length` tokens; together they cover every row position exactly once."""

    def __init__(self, prompt_segments: torch.Tensor, response_segments: torch.Tensor, length: int) -> None:
        self.prompt_index, self.prompt_valid = _runs(prompt_segments)
        self.has_responses = response_segments.shape[0] > 0
        covered = [self.prompt_index[self.prompt_valid]]
        if self.has_responses:
            self.response_index, self.response_valid = _runs(response_segments[:, :2])
            prompt_of = response_segments[:, 2]
            # Keys of sample i: its prompt's slots, then its own response's slots.
            self.key_index = torch.cat([self.prompt_index[prompt_of], self.response_index], dim=1)
            queries = self.response_index.shape[1]
            steps = torch.arange(queries, device=prompt_of.device)
            causal = steps.unsqueeze(1) >= steps.unsqueeze(0)  # [query, key] within the response
            sees_prompt = self.prompt_valid[prompt_of].unsqueeze(1).expand(-1, queries, -1)
            sees_response = causal.unsqueeze(0) & self.response_valid.unsqueeze(1)
            self.mask = torch.cat([sees_prompt, sees_response], dim=2).unsqueeze(1)  # [S, 1, query, key]
            covered.append(self.response_index[self.response_valid])
        positions = torch.cat(covered)
        if positions.numel() != length or not torch.equal(
            positions.sort().values, torch.arange(length, device=positions.device)
        ):
            raise ValueError(f"the prompt and response segments must cover the row's {length} positions once each")
        self.order = positions.argsort()  # outputs are produced prompts first, responses after

    def attend(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [1, H, T, D], k and v [1, H_kv, T, D] -> [1, H, T, D]."""
        if q.shape[0] != 1:
            raise ValueError(f"a shared-prompt row is one packed row, got a batch of {q.shape[0]}")
        gqa = q.shape[1] != k.shape[1]
        q, k, v = (x[0].transpose(0, 1) for x in (q, k, v))  # [T, heads, D]

        def runs(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:  # [T, heads, D] -> [runs, heads, longest, D]
            return x[index].transpose(1, 2)

        index = self.prompt_index
        out = F.scaled_dot_product_attention(
            runs(q, index), runs(k, index), runs(v, index), is_causal=True, enable_gqa=gqa
        )
        parts = [out.transpose(1, 2)[self.prompt_valid]]
        if self.has_responses:
            out = F.scaled_dot_product_attention(
                runs(q, self.response_index),
                runs(k, self.key_index),
                runs(v, self.key_index),
                attn_mask=self.mask,
                enable_gqa=gqa,
            )
            parts.append(out.transpose(1, 2)[self.response_valid])
        return torch.cat(parts)[self.order].transpose(0, 1).unsqueeze(0)
