"""A sharded policy reads only its own rows of a checkpoint (checkpoint/hf_load.py through train.py's
build_sharded_policy): each rank's host high-water mark during the load, and the values against load_hf."""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch.distributed.tensor import DTensor

from checkpoint.sharded_policy import build_sharded_policy, shard_policy
from config import load_config
from model.args import ModelArgs
from model.hf import CheckpointError, load_hf, save_hf
from model.qwen2 import build_model
from tests.dist_utils import run_ranks
from tests.host_memory import peak, reset_peak
from tests.qwen2_checkpoint import write_qwen2_checkpoint

CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")
MiB = 1 << 20

# 107M parameters: 214 MB in bf16 on disk, 428 MB in fp32. Every block is far larger than the slack below
# and the full fp32 model is more than 4 x one rank's shards on 2 ranks, so "shards + one tensor" and "the
# whole model" are hundreds of MB apart. The largest tensors are the embedding and the head (16 MiB in bf16).
ARGS = ModelArgs(
    vocab_size=8192,
    hidden_size=1024,
    num_layers=8,
    num_heads=8,
    num_kv_heads=2,
    intermediate_size=2816,
    tie_word_embeddings=False,
    max_position_embeddings=256,
)
STORED = torch.bfloat16
# What the load may hold beyond the shards, the largest stored tensor and the build's own objects (measured
# per rank, see _load_and_measure): the JSON headers of the checkpoint's files (a few KB each), the kernel's
# fault-around (up to 64 KiB mapped on each side of a read region), the load's Python objects.
SLACK = 4 * MiB


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    """A bf16 checkpoint written by transformers' save_pretrained in 40 MB files (6 files and an index)."""
    path = str(tmp_path_factory.mktemp("qwen2-bf16"))
    write_qwen2_checkpoint(path, ARGS, dtype=STORED, max_shard_size="40MB")
    assert len([f for f in os.listdir(path) if f.endswith(".safetensors")]) > 2
    assert os.path.isfile(os.path.join(path, "model.safetensors.index.json"))
    return path


def _config(path: str, layout: list[str]):
    overrides = [f"model.hf_path={path}", "model.preset=", "model.dtype=float32", "parallelism.param_dtype=bfloat16"]
    return load_config(os.path.join(CONFIGS, "demo_cpu.toml"), overrides + layout)


def _local_bytes(model) -> int:
    return sum((p.to_local() if isinstance(p, DTensor) else p).nbytes for p in model.parameters())


def _load_and_measure(rank, world_size, path, layout):
    """Build the sharded policy twice: without values (what the build itself keeps resident: module, FSDP and
    DTensor objects), then from the checkpoint; the second build's high-water mark above its start."""
    from parallel.dist_env import init_distributed

    cfg = _config(path, layout)
    dist_env = init_distributed(cfg.parallelism.dp_replicate, cfg.parallelism.dp_shard, cfg.parallelism.tp)
    start = reset_peak()
    skeleton = shard_policy(cfg.model, cfg.parallelism, dist_env)  # kept alive
    build_overhead = peak() - start
    start = reset_peak()
    policy = build_sharded_policy(cfg.model, cfg.parallelism, dist_env, seed=0)
    load_peak = peak() - start
    shards = _local_bytes(policy)
    del skeleton
    # Every value against the single-process load, gathered one tensor at a time (rank 0 compares).
    reference = load_hf(path, dtype=torch.float32) if rank == 0 else None
    differ = []
    for name, param in policy.named_parameters():
        full = param.full_tensor() if isinstance(param, DTensor) else param
        if rank == 0 and not torch.equal(full.detach(), reference.get_parameter(name).detach()):
            differ.append(name)
    return {"peak": load_peak, "shards": shards, "build": build_overhead, "differ": differ}


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "world_size,layout",
    [
        (2, ["parallelism.dp_shard=2"]),
        (2, ["parallelism.dp_shard=1", "parallelism.tp=2"]),
        (4, ["parallelism.dp_shard=4"]),
        (4, ["parallelism.dp_shard=2", "parallelism.tp=2"]),
    ],
    ids=["fsdp2", "tp2", "fsdp4", "fsdp2xtp2"],
)
def test_each_rank_holds_its_shards_and_one_tensor_while_loading(checkpoint, world_size, layout):
    largest = max(t.nbytes for t in load_file(os.path.join(checkpoint, _largest_file(checkpoint))).values())
    full_model = sum(p.numel() for p in build_model(ARGS).parameters()) * 4
    results = run_ranks(_load_and_measure, world_size, checkpoint, layout)
    assert results[0]["differ"] == []
    for rank, r in enumerate(results):
        bound = r["shards"] + largest + r["build"] + SLACK
        # The bound separates the two behaviours: the shards beside the whole fp32 model are far above it.
        assert r["shards"] + full_model > 2 * bound
        assert r["peak"] <= bound, (
            f"rank {rank}: the load's high-water mark is {r['peak'] / MiB:.1f} MiB; its shards are "
            f"{r['shards'] / MiB:.1f} MiB, the largest tensor {largest / MiB:.1f} MiB, the build "
            f"{r['build'] / MiB:.1f} MiB, slack {SLACK / MiB:.0f} MiB"
        )
        # The shards were written: the measurement sees them. Within SLACK: pages the allocator kept from memory
        # freed before the reset are reused without raising the high-water mark (seen: 0.5-1 MB of 107 MB).
        assert r["peak"] >= r["shards"] - SLACK


def _largest_file(path: str) -> str:
    """The checkpoint file that holds its largest tensor (the embedding)."""
    import json

    with open(os.path.join(path, "model.safetensors.index.json")) as f:
        return json.load(f)["weight_map"]["model.embed_tokens.weight"]


TIED = ModelArgs(
    vocab_size=96,
    hidden_size=32,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    intermediate_size=48,
    tie_word_embeddings=True,
    max_position_embeddings=64,
)


def _tied_checkpoint(path: str, head_differs: bool) -> None:
    """A tied checkpoint that also stores lm_head.weight (some transformers versions write it), in bf16."""
    save_hf(build_model(TIED, seed=1).to(torch.bfloat16), path)
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    if head_differs:
        tensors["lm_head.weight"][-1, -1] += 1.0  # in the last rows: a rank comparing only its own rows misses it
    save_file(tensors, file, metadata={"format": "pt"})


def _load_tied(rank, world_size, path):
    from parallel.dist_env import init_distributed

    cfg = _config(path, ["parallelism.dp_shard=2", "parallelism.param_dtype=float32"])
    dist_env = init_distributed(cfg.parallelism.dp_replicate, cfg.parallelism.dp_shard, cfg.parallelism.tp)
    try:
        policy = build_sharded_policy(cfg.model, cfg.parallelism, dist_env, seed=0)
    except CheckpointError as exc:
        return str(exc)
    return {name: p.full_tensor().detach() for name, p in policy.named_parameters()}


@pytest.mark.multiprocess
def test_a_tied_checkpoint_with_a_stored_head_loads_sharded_and_a_different_head_is_refused_on_every_rank(tmp_path):
    _tied_checkpoint(str(tmp_path / "same"), head_differs=False)
    _tied_checkpoint(str(tmp_path / "differs"), head_differs=True)
    reference = load_hf(str(tmp_path / "same"))
    for values in run_ranks(_load_tied, 2, str(tmp_path / "same")):
        assert values.keys() == dict(reference.named_parameters()).keys()
        for name, value in values.items():
            assert torch.equal(value, reference.get_parameter(name).detach()), name
    for message in run_ranks(_load_tied, 2, str(tmp_path / "differs")):
        assert "lm_head.weight that differs from model.embed_tokens.weight" in message


@pytest.mark.multiprocess
def test_a_nan_in_rows_one_rank_reads_is_named_on_every_rank(tmp_path):
    """The last row of the embedding is rank 1's (FSDP shards rows): both ranks name its file and tensor."""
    path = str(tmp_path / "nan")
    save_hf(build_model(TIED, seed=1), path)
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    tensors["model.embed_tokens.weight"][-1, 0] = float("inf")
    save_file(tensors, file, metadata={"format": "pt"})
    for message in run_ranks(_load_tied, 2, path):
        assert message.startswith(f"{file} holds NaN or inf in model.embed_tokens.weight: a policy with non-finite")


def test_one_process_reads_the_checkpoint_as_load_hf_does(checkpoint):
    """No process group: the parameters are plain tensors, read whole; the values are load_hf's."""
    from parallel.dist_env import init_distributed

    cfg = _config(checkpoint, ["parallelism.param_dtype=float32"])
    dist_env = init_distributed(1, -1, 1)
    assert dist_env.world_size == 1 and dist_env.mesh is None
    policy = build_sharded_policy(cfg.model, cfg.parallelism, dist_env, seed=0)
    reference = load_hf(checkpoint)
    for name, param in policy.named_parameters():
        assert type(param) is torch.nn.Parameter, name
        assert torch.equal(param.detach(), reference.get_parameter(name).detach()), name
