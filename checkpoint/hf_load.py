"""A Hugging Face checkpoint read straight into a sharded model: each rank reads only the rows its shards hold.

For every parameter of the model (FSDP- and/or TP-sharded DTensors, or plain tensors), in module order:

    region = the part of the full tensor this rank holds, from the DTensor's placements (FSDP Shard(0),
             TP Shard(0) or Shard(1), both on a 2-D mesh; replicated or plain: the whole tensor)
    with safe_open(the tensor's file) as f:      # one tensor's file is open at a time
        part = f.get_slice(HF name)[region]       # a view into the memory-mapped file: only the region's
                                                  # rows are read from disk
        local shard.copy_(part)                   # cast to the parameter's dtype by the copy itself

So a rank's host memory during the load is its own shards (where they live in host memory) plus one
tensor's pages: no full-size model, and no full tensor in the parameter dtype, ever exists. Names and shapes
come from the adapter (model/hf_adapter.py) through `model.hf.checkpoint_layout`, which checks the whole
checkpoint against the model before anything is read.

Why a file is opened per tensor: safetensors maps the whole file (torch.UntypedStorage.from_file), and
every page a read touches stays resident in the process until the mapping is released, that is until the
handle and every view of it are gone. Kept open for all the tensors of a 4 GB file, a rank slicing columns
(TP's row-wise layers: each row of the tensor is touched) would hold most of the file. Opening costs one
header parse (a few KB of JSON).

torch.distributed.checkpoint's HuggingFaceStorageReader does the same slicing (`get_slice` per read item,
offsets from the same DTensor function), but holds each file open while it serves all the file's reads, needs
a collective planning step, and has no place for the tied-head check; this module is the shorter of the two.

A tied checkpoint that also stores `lm_head.weight` is accepted only if it equals the embedding (as
`load_hf` does): every rank compares the two whole tensors half a tensor at a time, so every rank reaches the
same verdict without a collective.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from model.hf import Region, fill_from_hf
from parallel.lora import is_adapter_name
from parallel.plain_names import plain_named_parameters

if TYPE_CHECKING:
    from model.qwen2 import Qwen2


def local_region(param: torch.Tensor) -> Region:
    """The slices of the full tensor that this rank's part of `param` holds (the whole tensor when plain)."""
    if not isinstance(param, DTensor):
        return tuple(slice(0, n) for n in param.shape)
    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    return tuple(slice(o, o + n) for o, n in zip(offset, shape))


def load_hf_shards(model: Qwen2, path: str) -> None:
    """Fill `model`'s allocated parameters (after `to_empty`) from the HF checkpoint directory `path`; each
    rank reads only its own regions. Call on every rank; no collective is run. LoRA adapters (parallel/lora.py) are
    not the checkpoint's: they are left as they are.

    The checkpoint is checked against `model.args` first (a `CheckpointError` lists every mismatch); the
    values are exactly `model.hf.load_hf(path, dtype)`'s, each cast from the stored dtype by the copy.
    """
    parts = (
        (name, param.to_local() if isinstance(param, DTensor) else param, local_region(param))
        for name, param in plain_named_parameters(model)
        if not is_adapter_name(name)
    )
    fill_from_hf(model, path, parts)


def load_transient_bytes(model: Qwen2, stored_dtype: torch.dtype, *, shards_on_device: bool) -> int:
    """The most host memory one parameter's read holds beside the shards, for a checkpoint stored in
    `stored_dtype`: the resident pages of the rows its region spans (a column slice touches every row of
    the tensor), plus, for shards on an accelerator (`shards_on_device`), a column slice made contiguous in
    host memory before it crosses. A tied checkpoint's head check holds half of the head and half of the
    embedding."""
    size = torch.empty((), dtype=stored_dtype).element_size()
    most = 0
    for _, param in plain_named_parameters(model):
        region = local_region(param)
        rows = region[0].stop - region[0].start
        row_elements = math.prod(param.shape[1:])
        region_elements = math.prod(r.stop - r.start for r in region)
        columns_sliced = region_elements != rows * row_elements
        staging = region_elements * size if columns_sliced and shards_on_device else 0
        most = max(most, rows * row_elements * size + staging)
    if model.args.tie_word_embeddings:
        most = max(most, 2 * -(-model.args.vocab_size // 2) * model.args.hidden_size * size)
    return most
