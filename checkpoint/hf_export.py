"""Hugging Face export (config.json + safetensors, `model.hf.save_hf` semantics) from a sharded model.

With a process group, every rank writes the shards it holds, under HF names, with DCP's
HuggingFaceStorageWriter into `path/sharded/`; then the output files are consolidated from those shards, the
files divided among the ranks (each reads the byte ranges it needs from disk). No rank ever gathers the model,
or even one full tensor, in memory. The tensors are those `save_hf` would write from the unsharded model, in
`model-0000k-of-0000n.safetensors` plus `model.safetensors.index.json`; they load with `transformers` and
`model.hf.load_hf`. One process alone writes through `save_hf` itself.

A LoRA policy (parallel/lora.py) is exported twice: as the merged model, W + (alpha / r) B A for every adapted
linear (`merged_parameters`: the same checkpoint a fully trained policy gives, so transformers, SGLang and vLLM load
it unchanged), and as the adapter alone in PEFT's format in `path/adapter/` (`export_peft`), which `peft` loads onto
the base: `PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), path + "/adapter")`. The adapter
folder is a subfolder, not beside config.json: transformers takes an adapter_config.json it finds next to a model's
config for an adapter to load onto another model.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from model.hf import DEFAULT_MAX_SHARD_BYTES, exporting, remove_model_files, save_hf, split_into_shards
from model.hf_adapter import iter_hf_tensors, write_hf_config, write_json
from parallel.finite import NonFiniteStateError, nonfinite_state
from parallel.fsdp import reshard_gathered
from parallel.lora import adapters_of, full_tensor, is_adapter_name, merged_parameters
from parallel.plain_names import plain_named_parameters

if TYPE_CHECKING:
    from model.qwen2 import Qwen2


ADAPTER_FOLDER = "adapter"


def _local_tensors(model: Qwen2, dtype: torch.dtype | None) -> Iterator[tuple[str, torch.Tensor]]:
    """(our name, local parameter: a DTensor shard when sharded; LoRA's merged), cast locally to `dtype`."""
    for name, tensor in merged_parameters(model):
        yield name, (tensor if dtype is None else tensor.to(dtype))


def export_hf(
    model: Qwen2,
    path: str,
    *,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> None:
    """Write `model` (plain, FSDP- and/or TP-sharded) as a HF Qwen2 checkpoint into `path`; call on every rank.

    dtype: cast the stored tensors (e.g. torch.bfloat16); default: the parameters' dtype. Older model files
    in `path` are replaced. Call outside forward/backward; FSDP units still gathered by a forward without
    backward are resharded first, so the fp32 master weights are written. Weights holding NaN or inf are
    refused before anything is written (NonFiniteStateError). A write that fails for a reason a person can fix
    (a full disk, a read-only folder) is one WriteError on the rank that met it, which removes `path`.
    """
    reshard_gathered(model)
    problem = nonfinite_state(model)
    if problem is not None:  # a NaN policy is never exported
        raise NonFiniteStateError(f"{problem}; not exported to {path}")
    with exporting(path):  # a full disk or a read-only folder: one WriteError, the folder removed
        if adapters_of(model) is not None:
            export_peft(model, os.path.join(path, ADAPTER_FOLDER))
        if not dist.is_initialized() or dist.get_world_size() == 1:
            save_hf(_local_tensors(model, dtype), path, args=model.args, max_shard_bytes=max_shard_bytes)
            return
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint._consolidate_hf_safetensors import consolidate_safetensors_files_on_every_rank
        from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageWriter

        sharded = os.path.join(path, "sharded")
        if dist.get_rank() == 0:
            os.makedirs(path, exist_ok=True)
            remove_model_files(path)
            shutil.rmtree(sharded, ignore_errors=True)
        dist.barrier()
        state = dict(iter_hf_tensors(_local_tensors(model, dtype)))
        files = enumerate(split_into_shards(state.items(), max_shard_bytes), 1)  # output files 1..n, as save_hf's
        mapping = {name: i for i, shard in files for name in shard}
        writer = HuggingFaceStorageWriter(sharded, fqn_to_index_mapping=mapping, save_distributed=True)
        dcp.save(state, storage_writer=writer)
        dist.barrier()
        consolidate_safetensors_files_on_every_rank(sharded, path, mapping)
        if dist.get_rank() == 0:
            shutil.rmtree(sharded)
            write_hf_config(path, model.args, dtype or next(model.parameters()).dtype)
        dist.barrier()


def export_peft(model: Qwen2, path: str) -> None:
    """Write `model`'s LoRA adapters into `path` as PEFT saves a LoRA adapter: adapter_config.json and
    adapter_model.safetensors, whose tensors are named as PEFT names those of a Qwen2ForCausalLM
    (`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`: [r, in], `lora_B`: [out, r], float32).
    Call on every rank (each adapter is gathered whole); rank 0 writes."""
    from safetensors.torch import save_file

    adapters = adapters_of(model)
    assert adapters is not None, "a model with LoRA adapters"
    tensors = {
        f"base_model.model.model.{name}.weight": full_tensor(tensor).detach().cpu().contiguous()
        for name, tensor in plain_named_parameters(model)
        if is_adapter_name(name)
    }
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"), metadata={"format": "pt"})
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "lora_dropout": 0.0, "bias": "none", "r": adapters.rank}
    config.update(lora_alpha=adapters.alpha, target_modules=list(adapters.targets))
    config.update(base_model_name_or_path=adapters.base)  # PEFT's defaults for the rest (no DoRA, no rsLoRA)
    write_json(os.path.join(path, "adapter_config.json"), config)
