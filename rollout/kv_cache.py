"""A paged KV cache and the two attention contexts that read and write it (CPU and CUDA).

The model calls `context.attend(layer_id, q, k, v)` with q [B, H, T, D] and k, v [B, H_kv, T, D] after
RoPE (model/qwen2.py). The contexts below store k, v in the cache and attend, so the engine reuses the
model's own projections, norms and rotary embedding instead of re-implementing them.

Cache layout: per layer, keys and values as [H_kv, num_blocks + 1, block_size, D]. A sequence's block
table lists its blocks in order: position j of the sequence lives at (block_table[j // block_size],
j % block_size). The extra last block is scratch: padding rows of a fixed-shape (CUDA graph) decode
write there, so it is never handed to a sequence. Heads first makes the decode gather one
index_select of whole blocks whose result is already [H_kv, B, L, D], with no further copy.
A block never needs clearing: a sequence only attends to positions it has written itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


class PagedKVCache:
    """k/v buffers of `num_blocks` blocks of `block_size` token positions (plus one scratch block)."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        shape = (num_kv_heads, num_blocks + 1, block_size, head_dim)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(num_layers)]
        self.scratch_block = num_blocks

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """k and v of one token position in every layer."""
        return 2 * num_layers * num_kv_heads * head_dim * dtype.itemsize


@dataclass(eq=False)
class PrefillContext:
    """Token lists right-padded to a common length T, each attending causally to itself.

    Row r of the batch is token list r at positions 0..T-1. Right padding needs no mask: with plain
    causal attention, query i < len_r only sees keys j <= i < len_r, all real; queries at padded
    positions produce garbage that is never read (the engine takes the hidden state at len_r - 1).

    k, v of row `src_row[m]`, position `src_pos[m]` are written to (dst_block[m], dst_offset[m]) for every
    m: a prompt's full blocks appear once (shared by its samples), its partial last block once per sample.
    """

    cache: PagedKVCache
    src_row: torch.Tensor
    src_pos: torch.Tensor
    dst_block: torch.Tensor
    dst_offset: torch.Tensor

    def attend(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # k[src_row, :, src_pos] is [M, H_kv, D]; the cache's indexed view is [H_kv, M, D].
        self.cache.k[layer_id][:, self.dst_block, self.dst_offset] = k[self.src_row, :, self.src_pos].transpose(0, 1)
        self.cache.v[layer_id][:, self.dst_block, self.dst_offset] = v[self.src_row, :, self.src_pos].transpose(0, 1)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])


class DecodeContext:
    """One new token per sequence b at its own position `positions` [B], over its blocks `block_tables`
    [B, W] (W blocks, padded with any block index: those positions are masked).

    The token's k, v are written at (block_tables[b, p // S], p % S) first (S = block size, p =
    positions[b]); then the sequence's W blocks are gathered into K, V [H_kv, B, W * S, D] and, per kv head,
        scores = q K^T / sqrt(D) + bias,  bias[b, j] = 0 if j <= positions[b] else -inf
        out    = softmax(scores) V
    (bias is built once per step and shared by layers). Scores and softmax are in fp32 whatever the
    cache dtype, as SDPA's math path does.

    Grouped-query attention without copying the cache: the G = H / H_kv query heads sharing one kv head
    are consecutive (as in HF's repeat_kv), so q [B, H, 1, D] is viewed as [H_kv, B, G, D], G "queries"
    per kv head and sequence, and multiplies the gathered [H_kv, B, D, L] directly.
    """

    def __init__(
        self,
        k_cache: list[torch.Tensor],
        v_cache: list[torch.Tensor],
        positions: torch.Tensor,
        block_tables: torch.Tensor,
        gather_out: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        # The per-layer buffers, not the cache object: a compiled decode step takes them as inputs, so
        # a cache re-allocated by release/resume_memory needs no recompilation.
        self.k_cache, self.v_cache = k_cache, v_cache
        # Reused output buffers for the gathered keys and values (CPU): a fresh multi-MB tensor per layer
        # and step comes from mmap and pays a page fault per 4 KiB on first touch, several times the copy.
        self.gather_out = gather_out
        if gather_out is not None:  # resize_ keeps the storage unless it has to grow
            rows = (k_cache[0].shape[0], block_tables.numel(), k_cache[0].shape[2] * k_cache[0].shape[3])
            for buffer in gather_out:
                buffer.resize_(rows)
        block_size = k_cache[0].shape[2]
        b, width = block_tables.shape
        self.write_block = block_tables.gather(1, (positions // block_size).unsqueeze(1)).squeeze(1)
        self.write_offset = positions % block_size
        self.flat_blocks = block_tables.reshape(-1)
        self.kv_len = width * block_size
        key_pos = torch.arange(self.kv_len, device=positions.device)
        visible = key_pos.unsqueeze(0) <= positions.unsqueeze(1)
        bias = torch.zeros(visible.shape, device=positions.device).masked_fill_(~visible, float("-inf"))
        self.bias = bias[None, :, None, :]  # [1, B, 1, L]

    def attend(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        b, h, _, d = q.shape
        kv_heads = k.shape[1]
        k_cache, v_cache = self.k_cache[layer_id], self.v_cache[layer_id]
        k_cache[:, self.write_block, self.write_offset] = k[:, :, 0].transpose(0, 1)
        v_cache[:, self.write_block, self.write_offset] = v[:, :, 0].transpose(0, 1)
        # Blocks viewed as rows of block_size * D: index_select copies whole rows (memcpy speed, ~3x faster
        # on CPU than selecting along dim 1 of the 4-d tensor).
        if self.gather_out is None:
            keys = k_cache.flatten(2).index_select(1, self.flat_blocks)
            values = v_cache.flatten(2).index_select(1, self.flat_blocks)
        else:
            keys = torch.index_select(k_cache.flatten(2), 1, self.flat_blocks, out=self.gather_out[0])
            values = torch.index_select(v_cache.flatten(2), 1, self.flat_blocks, out=self.gather_out[1])
        keys, values = keys.view(kv_heads, b, self.kv_len, d), values.view(kv_heads, b, self.kv_len, d)
        grouped_q = q.reshape(b, kv_heads, h // kv_heads, d).transpose(0, 1)
        scores = torch.matmul(grouped_q, keys.transpose(-1, -2)).float()
        probs = scores.mul_(d**-0.5).add_(self.bias).softmax(dim=-1).to(v.dtype)
        out = torch.matmul(probs, values)  # [H_kv, B, G, D]
        return out.transpose(0, 1).reshape(b, h, 1, d)
