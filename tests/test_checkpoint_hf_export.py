"""HF export from an FSDP 2 x TP 2 sharded model equals the single-process `save_hf` output, tensor for tensor.

DCP's HF writer with per-rank shards consolidated on disk is checked for an untied and a tied model, in fp32
and cast to bf16; the exported folder also loads back with `model.hf.load_hf`.
"""

from __future__ import annotations

import os

import pytest
import torch
from dist_utils import run_ranks
from safetensors import safe_open

from checkpoint.hf_export import export_hf
from model.args import PRESETS
from model.hf import load_hf, save_hf
from model.qwen2 import build_model
from parallel.dims import ParallelDims
from parallel.parallelize import parallelize_qwen2


def _read_all(path: str) -> dict[str, torch.Tensor]:
    tensors = {}
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(path, name), framework="pt") as f:
                for key in f.keys():
                    assert key not in tensors, f"{key} stored twice"
                    tensors[key] = f.get_tensor(key)
    return tensors


def _export_worker(rank, world_size, root):
    dims = ParallelDims(dp_shard=2, tp=2, world_size=world_size)
    mesh = dims.build_mesh("cpu")
    for preset in ("tiny", "tiny-tied"):
        model = build_model(PRESETS[preset], seed=3)
        parallelize_qwen2(model, mesh, dims, param_dtype=torch.float32, reduce_dtype=torch.float32)
        # Small files so the export spans several of them.
        export_hf(model, os.path.join(root, f"{preset}-dcp"), max_shard_bytes=64 * 1024)
        export_hf(model, os.path.join(root, f"{preset}-dcp-bf16"), dtype=torch.bfloat16)
    return None


@pytest.mark.multiprocess
def test_export_from_2x2_sharded_model_equals_single_process(tmp_path):
    run_ranks(_export_worker, 4, str(tmp_path))
    for preset in ("tiny", "tiny-tied"):
        single = build_model(PRESETS[preset], seed=3)
        save_hf(single, str(tmp_path / f"{preset}-single"))
        expected = _read_all(str(tmp_path / f"{preset}-single"))
        for variant in ("dcp", "dcp-bf16"):
            folder = str(tmp_path / f"{preset}-{variant}")
            got = _read_all(folder)
            assert got.keys() == expected.keys(), (variant, sorted(got.keys() ^ expected.keys()))
            cast = (lambda t: t.to(torch.bfloat16)) if variant.endswith("bf16") else (lambda t: t)
            for key, tensor in expected.items():
                assert got[key].dtype == cast(tensor).dtype, (variant, key)
                assert torch.equal(got[key], cast(tensor)), f"{preset} {variant}: {key} differs"
            assert not os.path.exists(os.path.join(folder, "sharded"))
            if variant != "dcp-bf16":
                loaded = load_hf(folder)
                for (n, a), (_, b) in zip(loaded.named_parameters(), single.named_parameters()):
                    assert torch.equal(a, b), n
        assert len([f for f in os.listdir(tmp_path / f"{preset}-dcp") if f.endswith(".safetensors")]) > 1
