"""A paged KV cache and the two attention contexts that read and write it (CPU, and CUDA without flex).

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

import torch
import torch.nn.functional as F


class PagedKVCache:
    """k/v buffers of `num_blocks` blocks of `block_size` token positions (plus one scratch block)."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 device: torch.device, dtype: torch.dtype):
        shape = (num_kv_heads, num_blocks + 1, block_size, head_dim)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(num_layers)]
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.scratch_block = num_blocks

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """k and v of one token position in every layer."""
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


class PrefillContext:
    """Token lists right-padded to a common length T, each attending causally to itself.

    Row r of the batch is token list r at positions 0..T-1. Right padding needs no mask: with plain
    causal attention, query i < len_r only sees keys j <= i < len_r, all real; queries at padded
    positions produce garbage that is never read (the engine takes the hidden state at len_r - 1).

    k, v of row `src_row[m]`, position `src_pos[m]` are written to (dst_block[m], dst_offset[m]) for every
    m: a prompt's full blocks appear once (shared by its samples), its partial last block once per sample.
    """

    def __init__(self, cache: PagedKVCache, src_row, src_pos, dst_block, dst_offset):
        self.cache = cache
        self.src_row, self.src_pos = src_row, src_pos
        self.dst_block, self.dst_offset = dst_block, dst_offset

    def attend(self, layer_id: int, q, k, v):
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

    def __init__(self, k_cache: list[torch.Tensor], v_cache: list[torch.Tensor], positions: torch.Tensor,
                 block_tables: torch.Tensor, gather_out: tuple[torch.Tensor, torch.Tensor] | None = None):
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

    def attend(self, layer_id: int, q, k, v):
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
        probs = scores.mul_(d ** -0.5).add_(self.bias).softmax(dim=-1).to(v.dtype)
        out = torch.matmul(probs, values)  # [H_kv, B, G, D]
        return out.transpose(0, 1).reshape(b, h, 1, d)


class DecodeWorkspace:
    """Each running sequence's k/v kept contiguous in one row, for decode attention without a gather (CPU).

    Per layer, k and v as [R, H_kv, L, D]: row r holds positions 0..L-1 of the sequence assigned to it.
    The paged cache stays the record of what is stored and what memory is used (admission, sharing,
    preemption); the workspace is a copy that the decode step appends to in place, so a step reads each
    key once (the attention) instead of twice (a gather of every block, then the attention).

    A sequence is copied from its blocks once, when it enters the decode batch (`load`). A finished or
    preempted sequence leaves a hole in its row: the attention still runs over holes (masked), so when
    holes exceed a quarter of the rows the survivors are moved to the front (`compact`), an amortised
    cost of at most one gather per quarter of the batch retired. Buffers grow by at least 1.5x (rows
    and positions), and only up to what the sequences need.
    """

    def __init__(self, cache: PagedKVCache):
        self.cache = cache
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.num_rows = 0  # rows in use, holes included
        self.compactions = 0  # of the current generate call

    def reset(self) -> None:
        """Forget every row (a new generate call); the buffers are kept for reuse."""
        self.num_rows = 0
        self.compactions = 0

    def _ensure(self, rows: int, length: int) -> None:
        have_rows, have_len = (self.k[0].shape[0], self.k[0].shape[2]) if self.k else (0, 0)
        if rows <= have_rows and length <= have_len:
            return
        # Only a dimension that is too small grows, by at least 1.5x (amortised copies).
        rows = have_rows if rows <= have_rows else max(rows, int(have_rows * 1.5))
        length = have_len if length <= have_len else max(length, int(have_len * 1.5))
        h_kv, _, _, d = self.cache.k[0].shape
        for buffers in (self.k, self.v):
            for i in range(len(self.cache.k)):
                grown = self.cache.k[0].new_zeros(rows, h_kv, length, d)  # finite: masked keys get weight 0, and 0 * NaN is NaN
                if i < len(buffers):
                    grown[: self.num_rows, :, :have_len] = buffers[i][: self.num_rows]
                    buffers[i] = grown
                else:
                    buffers.append(grown)

    def load(self, seqs, block_tables: torch.Tensor) -> None:
        """Give each sequence in `seqs` (without a row) the next free row and copy its blocks there.

        block_tables: [len(seqs), W] their block tables padded with any block (copied, never read)."""
        first, count = self.num_rows, len(seqs)
        width = block_tables.shape[1] * self.cache.block_size
        self._ensure(first + count, width)
        flat = block_tables.reshape(-1)
        h_kv, _, _, d = self.cache.k[0].shape
        for cache, buffers in ((self.cache.k, self.k), (self.cache.v, self.v)):
            for layer, blocks in enumerate(cache):
                gathered = blocks.flatten(2).index_select(1, flat).view(h_kv, count, width, d)
                buffers[layer][first: first + count, :, :width] = gathered.transpose(0, 1)
        for i, seq in enumerate(seqs):
            seq.row = first + i
        self.num_rows += count

    def compact(self, seqs, length: int) -> None:
        """Move the rows of `seqs` (the running sequences, in order) to rows 0..len(seqs)-1 (positions < length)."""
        rows = torch.tensor([seq.row for seq in seqs], device=self.k[0].device)
        for buffers in (self.k, self.v):
            for buffer in buffers:
                buffer[: len(seqs), :, :length] = buffer[:, :, :length].index_select(0, rows)
        for i, seq in enumerate(seqs):
            seq.row = i
        self.num_rows = len(seqs)
        self.compactions += 1

    def ensure_length(self, length: int) -> None:
        self._ensure(self.num_rows, length)


class RowDecodeContext:
    """Decode attention over a `DecodeWorkspace`: sequence b is row rows[b], its new token at positions[b].

    The token's k, v are written to its row only: on this path nothing reads a running sequence's blocks
    after it was copied to its row (a preempted sequence is recomputed by prefill), so the blocks serve
    admission and sharing. Then, over the first `length` positions of the workspace's rows,
        out = softmax(q K^T / sqrt(D) + mask) V,   mask: key j visible to row r iff j <= position of r
    with two batched matmuls on views of the rows (no copy; scores and softmax in fp32 and grouped-query
    heads without repeating k/v, as in DecodeContext). Rows that are holes see key 0 only (finite
    garbage, discarded). When the rows are exactly 0..B-1 in batch order, q and the output need no scatter.
    """

    def __init__(self, workspace: DecodeWorkspace, positions: torch.Tensor, rows: torch.Tensor, length: int,
                 identity: bool):
        self.workspace, self.rows, self.length, self.identity = workspace, rows, length, identity
        _, kv_heads, capacity, _ = workspace.k[0].shape
        # Flat index of (row, head, position) in a [R * H_kv * L, D] view: one index_copy_ per layer.
        heads = torch.arange(kv_heads, device=positions.device)
        self.write_index = ((rows.unsqueeze(1) * kv_heads + heads) * capacity + positions.unsqueeze(1)).reshape(-1)
        num_rows = workspace.num_rows
        row_position = torch.zeros(num_rows, dtype=positions.dtype, device=positions.device)
        row_position[rows] = positions  # holes keep 0: they see key 0 only
        visible = torch.arange(length, device=positions.device).unsqueeze(0) <= row_position.unsqueeze(1)
        bias = torch.zeros(visible.shape, device=positions.device).masked_fill_(~visible, float("-inf"))
        self.bias = bias[:, None, None, :]  # [R, 1, 1, L], shared by the layers

    def attend(self, layer_id: int, q, k, v):
        rows_k, rows_v = self.workspace.k[layer_id], self.workspace.v[layer_id]
        d = k.shape[-1]
        rows_k.view(-1, d).index_copy_(0, self.write_index, k[:, :, 0].reshape(-1, d))
        rows_v.view(-1, d).index_copy_(0, self.write_index, v[:, :, 0].reshape(-1, d))
        num_rows = self.workspace.num_rows
        b, h, _, d = q.shape
        kv_heads = k.shape[1]
        if not self.identity:
            q_rows = q.new_zeros(num_rows, h, 1, d)
            q_rows[self.rows] = q
            q = q_rows
        # [R, H_kv, L, D] views of the first `length` positions merge to [R * H_kv, L, D] without a copy (the
        # row stride is H_kv times the head stride); the G query heads of a kv head are its G "queries".
        keys = rows_k[:num_rows, :, : self.length].reshape(num_rows * kv_heads, self.length, d)
        values = rows_v[:num_rows, :, : self.length].reshape(num_rows * kv_heads, self.length, d)
        grouped_q = q.reshape(num_rows * kv_heads, h // kv_heads, d).contiguous()
        scores = torch.bmm(grouped_q, keys.transpose(1, 2)).float().view(num_rows, kv_heads, -1, self.length)
        probs = scores.mul_(d ** -0.5).add_(self.bias).softmax(dim=-1).to(v.dtype)
        out = torch.bmm(probs.view(num_rows * kv_heads, -1, self.length), values).view(num_rows, h, 1, d)
        return out if self.identity else out[self.rows]
