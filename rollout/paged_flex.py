"""Paged decode attention on CUDA with FlexAttention: no gather, the kernel reads the blocks in place.

NOT RUN on a GPU yet: it is written against torch 2.13's flex_attention API and only exercised where a
CUDA device exists (tests marked `gpu`). The CPU path (rollout/kv_cache.py DecodeContext) is the tested one.

The whole block pool of a layer, [H_kv, num_blocks + 1, S, D], is viewed as ONE batch row of keys
[1, H_kv, (num_blocks + 1) * S, D], and every query row b gets a block mask whose KV blocks are exactly
its block table (the mask's KV block size is the cache's block size S), so the kernel visits only
sequence b's blocks and nothing is copied. The mask itself is exact on the whole pool (the block list
only skips work): with i = logical[kv // S], the index the physical block has in the tables that hold it,
    visible(b, kv) = block_tables[b, i] == kv // S  and  i * S + kv % S <= positions[b]
FlexAttention accepts a key batch of 1 against a query batch of B when the block mask has batch B.
Its kernels tile the keys in 64-128 positions, so use a block_size that is a multiple of 128 here.
"""

from __future__ import annotations

import torch

from model.qwen2 import compiled_flex_attention


class FlexDecodeContext:
    """Same interface as rollout.kv_cache.DecodeContext: one new token per sequence, paged k/v."""

    def __init__(
        self,
        k_cache: list[torch.Tensor],
        v_cache: list[torch.Tensor],
        positions: torch.Tensor,
        block_tables: torch.Tensor,
    ) -> None:
        from torch.nn.attention.flex_attention import BlockMask

        self.k_cache, self.v_cache = k_cache, v_cache
        kv_heads, pool_blocks, block_size, _ = k_cache[0].shape
        b = positions.shape[0]
        self.write_block = block_tables.gather(1, (positions // block_size).unsqueeze(1)).squeeze(1)
        self.write_offset = positions % block_size
        width = block_tables.shape[1]
        # The logical index of every physical block in use (a shared prompt block has the same index in
        # every table that holds it); the table lookup below then tells whether sequence b holds it.
        logical = torch.full((pool_blocks,), -1, dtype=torch.long, device=positions.device)
        logical.scatter_(0, block_tables.reshape(-1), torch.arange(width, device=positions.device).repeat(b))

        def visible(batch: torch.Tensor, head: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
            index = logical[kv_idx // block_size]
            held = (index >= 0) & (block_tables[batch, index.clamp(0, width - 1)] == kv_idx // block_size)
            return held & (index * block_size + kv_idx % block_size <= positions[batch])

        num_blocks = (positions // block_size + 1).to(torch.int32).view(b, 1, 1)
        # The kernels want the block list as wide as the pool (B x num_blocks int32 per step, as torch's
        # experimental PagedAttention has); only the first num_blocks[b] entries are read.
        indices = torch.zeros(b, 1, 1, pool_blocks, dtype=torch.int32, device=positions.device)
        indices[:, 0, 0, :width] = block_tables
        self.block_mask = BlockMask.from_kv_blocks(
            num_blocks,
            indices,
            BLOCK_SIZE=(1, block_size),
            mask_mod=visible,
            seq_lengths=(1, pool_blocks * block_size),
            compute_q_blocks=False,
        )
        self._flex = compiled_flex_attention()

    def attend(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        k_cache, v_cache = self.k_cache[layer_id], self.v_cache[layer_id]
        k_cache[:, self.write_block, self.write_offset] = k[:, :, 0].transpose(0, 1)
        v_cache[:, self.write_block, self.write_offset] = v[:, :, 0].transpose(0, 1)
        kv_heads, pool_blocks, block_size, d = k_cache.shape
        keys = k_cache.view(1, kv_heads, pool_blocks * block_size, d)
        values = v_cache.view(1, kv_heads, pool_blocks * block_size, d)
        return self._flex(q, keys, values, block_mask=self.block_mask, enable_gqa=q.shape[1] != kv_heads)
