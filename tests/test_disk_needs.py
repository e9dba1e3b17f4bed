"""The disk a run needs (preflight/disk_needs.py) against the files a real checkpoint and export write."""

import os

import torch

from checkpoint.hf_export import export_hf
from checkpoint.manager import CheckpointManager
from config import load_config
from model.args import ModelArgs, num_params
from model.qwen2 import build_model
from preflight.disk_needs import run_disk_bytes

CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")
ARGS = ModelArgs(
    vocab_size=2048,
    hidden_size=256,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    intermediate_size=768,
    tie_word_embeddings=False,
    max_position_embeddings=128,
)
# What a checkpoint holds besides the tensors: DCP's index (an entry per stored tensor: each parameter and its
# two moments and step count), the manifest, the train state and RNG states. 4 KiB per entry and 64 KiB over
# all; for Qwen2.5-32B that is 9 MB beside 393 GB.
ENTRY, FIXED = 4 << 10, 64 << 10


def _folder_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(path) for f in files)


def test_a_training_checkpoint_and_an_export_take_what_the_estimate_says(tmp_path):
    hf = tmp_path / "in"
    model = build_model(ARGS, seed=0)
    export_hf(model.to(torch.bfloat16), str(hf))  # the checkpoint a run starts from, in bf16
    cfg = load_config(
        os.path.join(CONFIGS, "demo_cpu.toml"),
        [f"model.hf_path={hf}", "model.preset=", "model.dtype=float32", "checkpoint.keep_latest_k=2"],
    )
    needs = run_disk_bytes(cfg, ARGS)

    model = build_model(ARGS, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.zeros(1, 4, dtype=torch.long)).sum().backward()
    optimizer.step()
    saved = CheckpointManager(str(tmp_path / "ckpt"), keep=2).save(1, model, optimizer)
    export_hf(model, str(tmp_path / "out"))

    assert needs["training_checkpoint"] == 3 * num_params(ARGS) * 4
    entries = 4 * len(list(model.parameters()))
    assert (
        needs["training_checkpoint"] <= _folder_bytes(saved) <= needs["training_checkpoint"] + entries * ENTRY + FIXED
    )
    assert needs["hf_export"] <= _folder_bytes(tmp_path / "out") <= needs["hf_export"] + FIXED
    assert needs["checkpoint_in"] == sum(os.path.getsize(hf / f) for f in os.listdir(hf) if f.endswith(".safetensors"))
    assert needs["training_checkpoints_at_once"] == 3 * needs["training_checkpoint"]  # keep 2, and the new one
    assert needs["total"] == needs["checkpoint_in"] + needs["training_checkpoints_at_once"] + needs["hf_export"]
