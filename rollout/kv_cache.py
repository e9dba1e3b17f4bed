"""A preallocated KV cache and the two attention contexts that read and write it.

The model calls `context.attend(layer_id, q, k, v)` with q [B, H, T, D] and k, v [B, H_kv, T, D] after
RoPE (model/qwen2.py). The contexts below store k, v in the cache and attend, so the engine reuses the
model's own projections, norms and rotary embedding instead of re-implementing them.

Cache layout: per layer, keys TRANSPOSED as [slots, H_kv, D, max_seq_len] and values as
[slots, H_kv, max_seq_len, D]; slot s holds one request. Storing K^T makes the decode scores
q K^T a plain batched matmul over contiguous rows (about 1.8x faster on CPU than reading K
through a transposed view). A slot never needs clearing: a request only ever attends to positions
it has written itself (prefill writes 0..L-1, decode writes L, L+1, ...).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class KVCache:
    """k/v buffers for `num_slots` concurrent requests of up to `max_seq_len` tokens each."""

    def __init__(self, num_layers: int, num_slots: int, num_kv_heads: int, max_seq_len: int, head_dim: int,
                 device: torch.device, dtype: torch.dtype):
        k_shape = (num_slots, num_kv_heads, head_dim, max_seq_len)
        v_shape = (num_slots, num_kv_heads, max_seq_len, head_dim)
        self.k = [torch.zeros(k_shape, device=device, dtype=dtype) for _ in range(num_layers)]
        self.v = [torch.zeros(v_shape, device=device, dtype=dtype) for _ in range(num_layers)]
        self.num_slots = num_slots
        self.max_seq_len = max_seq_len


class PrefillContext:
    """Prompts right-padded to a common length T, each attending causally to itself.

    Row r of the batch is prompt r at positions 0..T-1. Right padding needs no mask: with plain causal
    attention, query i < len_r only sees keys j <= i < len_r, all real; queries at padded positions
    produce garbage that is never read (the engine takes the hidden state at len_r - 1).

    k, v are written to the cache slots `slot_ids` [S] from rows `row_of_slot` [S]: several slots may
    copy the same row, which is how the n samples of a prompt share one prefill.
    """

    def __init__(self, cache: KVCache, slot_ids: torch.Tensor, row_of_slot: torch.Tensor):
        self.cache = cache
        self.slot_ids = slot_ids
        self.row_of_slot = row_of_slot

    def attend(self, layer_id: int, q, k, v):
        t = k.shape[2]
        self.cache.k[layer_id][self.slot_ids, :, :, :t] = k[self.row_of_slot].transpose(-1, -2)
        self.cache.v[layer_id][self.slot_ids, :, :t] = v[self.row_of_slot]
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])


class DecodeContext:
    """One new token per slot 0..B-1 at its own position `positions` [B]; attends over cache[..., :kv_len].

    The token's k, v are written at position positions[b] of slot b first; then, per kv head,
        scores = q K^T / sqrt(D) + bias,  bias[b, j] = 0 if j <= positions[b] else -inf
        out    = softmax(scores) V
    over the first kv_len >= max(positions) + 1 positions (bias is built once per step, shared by layers).
    Scores and softmax are in fp32 whatever the cache dtype, as SDPA's math path does.

    Grouped-query attention without copying the cache: the G = H / H_kv query heads sharing one kv head
    are consecutive (as in HF's repeat_kv), so q [B, H, 1, D] is viewed as [B, H_kv, G, D], G "queries"
    per kv head, and multiplies the cache's [B, H_kv, D, kv_len] directly.
    """

    def __init__(self, k_cache: list[torch.Tensor], v_cache: list[torch.Tensor], positions: torch.Tensor, kv_len: int):
        # The per-layer buffers, not the KVCache object: a compiled decode step takes them as inputs, so
        # a cache re-allocated by release/resume_memory needs no recompilation.
        self.k_cache, self.v_cache = k_cache, v_cache
        self.positions = positions
        self.kv_len = kv_len
        self.batch_index = torch.arange(positions.shape[0], device=positions.device)
        key_pos = torch.arange(kv_len, device=positions.device)
        visible = key_pos.unsqueeze(0) <= positions.unsqueeze(1)
        bias = torch.zeros(visible.shape, device=positions.device).masked_fill_(~visible, float("-inf"))
        self.bias = bias[:, None, None, :]

    def attend(self, layer_id: int, q, k, v):
        b, h, _, d = q.shape
        kv_heads = k.shape[1]
        k_cache, v_cache = self.k_cache[layer_id], self.v_cache[layer_id]
        k_cache[self.batch_index, :, :, self.positions] = k[:, :, 0]
        v_cache[self.batch_index, :, self.positions] = v[:, :, 0]
        grouped_q = q.reshape(b, kv_heads, h // kv_heads, d)
        scores = torch.matmul(grouped_q, k_cache[:b, :, :, : self.kv_len]).float()
        probs = scores.mul_(d ** -0.5).add_(self.bias).softmax(dim=-1).to(v.dtype)
        out = torch.matmul(probs, v_cache[:b, :, : self.kv_len])
        return out.view(b, h, 1, d)
