"""Checkpoints are verified before they load, with real files on disk.

Every kind of damage (bytes overwritten in place inside a tensor, random bytes of the same size, a changed train
state or DCP index, a truncated or missing file) is one finding: the newest intact checkpoint is resumed, with
one log line naming the damaged step and file; with none intact the resume is refused and nothing is moved. So
is a checkpoint whose files match a manifest rewritten after NaN bytes were written into them (what it loads is
checked too), and one whose manifest records sizes only. A failed save (a full disk) removes its partial folder,
prunes nothing and says the previous checkpoint is intact; NaN or infinite weights or optimizer state are never
checkpointed or exported.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import pickle

import pytest
import torch
from dist_utils import run_ranks

import checkpoint.manager
from checkpoint.files import file_record
from checkpoint.hf_export import export_hf
from checkpoint.manager import CheckpointError, CheckpointManager
from model.args import PRESETS
from model.qwen2 import build_model
from tests.test_checkpoint_manager import _setup, _step

STEP1, STEP2 = "step-00000001", "step-00000002"


def _largest_tensor_item(path: str):
    """Where DCP stored the largest item of checkpoint folder `path` (our own index: trusted here)."""
    with open(os.path.join(path, ".metadata"), "rb") as f:
        index = pickle.load(f)
    return max(index.storage_data.values(), key=lambda info: info.length)


def overwrite_16_bytes_inside_a_tensor(path: str) -> str:
    """16 bytes in the middle of the largest tensor's data: the zip framing around it stays valid."""
    item = _largest_tensor_item(path)
    with open(os.path.join(path, item.relative_path), "r+b") as f:
        f.seek(item.offset + item.length // 2)
        f.write(b"\xff" * 16)  # 0xffffffff is a float32 NaN
    return item.relative_path


def _same_size_garbage(path: str, name: str) -> str:
    size = os.path.getsize(os.path.join(path, name))
    with open(os.path.join(path, name), "wb") as f:
        f.write(torch.randint(0, 256, (size,), dtype=torch.uint8, generator=torch.Generator().manual_seed(7)).numpy())
    return name


def random_bytes_in_the_tensor_file(path: str) -> str:
    return _same_size_garbage(path, _largest_tensor_item(path).relative_path)


def garbage_rank_json(path: str) -> str:
    return _same_size_garbage(path, os.path.join("train_state", "rank-00000.json"))


def garbage_metadata(path: str) -> str:
    return _same_size_garbage(path, ".metadata")


def truncated_tensor_file(path: str) -> str:
    name = _largest_tensor_item(path).relative_path
    with open(os.path.join(path, name), "r+b") as f:
        f.truncate(os.path.getsize(os.path.join(path, name)) // 2)
    return name


def missing_train_state_tensors(path: str) -> str:
    name = os.path.join("train_state", "rank-00000.safetensors")
    os.remove(os.path.join(path, name))
    return name


def _rewrite_manifest(path: str, edit) -> None:
    with open(os.path.join(path, "COMPLETE.json")) as f:
        manifest = json.load(f)
    edit(manifest["files"])
    with open(os.path.join(path, "COMPLETE.json"), "w") as f:
        json.dump(manifest, f)


def nan_with_the_manifest_rewritten_to_match(path: str) -> str:
    """NaN bytes inside a tensor, and the manifest's record of its file rewritten to match: every file checks
    out, and what they load does not."""
    name = overwrite_16_bytes_inside_a_tensor(path)
    _rewrite_manifest(path, lambda files: files.update({name: file_record(os.path.join(path, name)).to_json()}))
    return "it loads with NaN or inf: the "


def a_manifest_of_sizes_only(path: str) -> str:
    """The manifest of an older version: sizes, no content hashes."""
    _rewrite_manifest(path, lambda files: files.update({k: v["bytes"] for k, v in files.items()}))
    return "COMPLETE.json records file sizes only (an older version wrote it): its files cannot be verified"


DAMAGE = [
    nan_with_the_manifest_rewritten_to_match,
    a_manifest_of_sizes_only,
    overwrite_16_bytes_inside_a_tensor,
    random_bytes_in_the_tensor_file,
    garbage_rank_json,
    garbage_metadata,
    truncated_tensor_file,
    missing_train_state_tensors,
]


def _saved_steps(folder: str, steps, keep: int = 3) -> tuple[CheckpointManager, dict]:
    """Checkpoints of a tiny model after each of `steps` updates; returns the manager and each step's weights."""
    torch.manual_seed(0)
    manager = CheckpointManager(folder, keep=keep)
    model, optimizer, scheduler = _setup(0)
    weights = {}
    for step in steps:
        _step(model, optimizer, scheduler)
        manager.save(step, model, optimizer, scheduler, {"step": step})
        weights[step] = {k: v.clone() for k, v in model.state_dict().items()}
    return manager, weights


@pytest.mark.parametrize("damage", DAMAGE, ids=lambda d: d.__name__)
def test_a_damaged_checkpoint_falls_back_to_the_newest_intact_one_in_one_line(tmp_path, caplog, damage):
    folder = str(tmp_path / "ckpt")
    manager, weights = _saved_steps(folder, (1, 2))
    damaged_file = damage(manager.step_path(2))
    model, optimizer, scheduler = _setup(1)
    with caplog.at_level(logging.WARNING, logger="checkpoint.manager"):
        assert manager.resume(model, optimizer, scheduler) == {"step": 1}
    assert all(torch.equal(model.state_dict()[k], v) for k, v in weights[1].items())
    assert optimizer.state_dict()["state"][0]["step"] == 1
    lines = [r.getMessage() for r in caplog.records if r.name == "checkpoint.manager" and r.levelno >= logging.WARNING]
    assert len(lines) == 1 and STEP2 in lines[0] and damaged_file in lines[0], lines
    assert f"resuming from {STEP1} instead" in lines[0] and "\n" not in lines[0]
    assert sorted(os.listdir(folder)) == [STEP1, f"{STEP2}.damaged"]


@pytest.mark.parametrize("damage", DAMAGE, ids=lambda d: d.__name__)
def test_with_no_intact_checkpoint_the_resume_is_refused_and_nothing_is_moved(tmp_path, damage):
    folder = str(tmp_path / "ckpt")
    manager, _ = _saved_steps(folder, (1,))
    damaged_file = damage(manager.step_path(1))
    model, optimizer, scheduler = _setup(1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointError) as refused:
        manager.resume(model, optimizer, scheduler)
    message = str(refused.value)
    assert f"no intact checkpoint to resume from in {folder}: {STEP1} is damaged" in message
    assert damaged_file in message and "--fresh" in message and "\n" not in message
    assert os.listdir(folder) == [STEP1]  # neither moved aside nor deleted
    assert not optimizer.state and "is intact" not in message
    if damage is not nan_with_the_manifest_rewritten_to_match:  # refused before anything was loaded
        assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())


def _no_space(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_a_full_disk_during_a_save_is_one_error_and_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    import torch.distributed.checkpoint.filesystem as dcp_filesystem

    folder = str(tmp_path / "ckpt")
    manager, _ = _saved_steps(folder, (1,), keep=1)
    monkeypatch.setattr(dcp_filesystem, "_write_item", _no_space)  # the disk fills up while DCP writes
    model, optimizer, scheduler = _setup(0)
    with pytest.raises(CheckpointError) as failed:
        manager.save(2, model, optimizer, scheduler, {"step": 2})
    message = str(failed.value)
    assert message.startswith("no space left on ") and " while saving step 2 " in message
    assert f"the previous checkpoint (step 1, {manager.step_path(1)}) is intact" in message and "\n" not in message
    assert os.listdir(folder) == [STEP1] and manager.validate(1) is None


def _save_on_two_ranks(rank, world_size, folder, failing_part):
    """Rank 1 finds the disk full in `failing_part` of the save; every rank must raise the same one error."""
    import torch.distributed.checkpoint.filesystem as dcp_filesystem

    manager = CheckpointManager(folder, keep=1)
    model, optimizer, scheduler = _setup(0)
    manager.save(1, model, optimizer, scheduler, {"step": 1})
    if rank == 1 and failing_part == "tensors":
        dcp_filesystem._write_item = _no_space
    if rank == 1 and failing_part == "train state":
        checkpoint.manager.save_plain = _no_space
    try:
        manager.save(2, model, optimizer, scheduler, {"step": 2})
    except CheckpointError as exc:
        return {"error": str(exc), "listing": sorted(os.listdir(folder))}
    return {"error": None}


@pytest.mark.multiprocess
@pytest.mark.parametrize("failing_part", ["tensors", "train state"])
def test_a_full_disk_on_one_rank_stops_every_rank_with_the_same_error(tmp_path, failing_part):
    results = run_ranks(_save_on_two_ranks, 2, str(tmp_path / "ckpt"), failing_part, timeout=120)
    for result in results:
        assert result["error"] is not None and result["error"].startswith("no space left on "), result
        assert "while saving step 2" in result["error"] and "previous checkpoint (step 1" in result["error"]
    assert results[0]["listing"] == [STEP1]


def test_non_finite_weights_or_optimizer_state_are_never_checkpointed(tmp_path):
    folder = str(tmp_path / "ckpt")
    manager, _ = _saved_steps(folder, (1,))
    model, optimizer, scheduler = _setup(0)
    _step(model, optimizer, scheduler)
    with torch.no_grad():
        model.norm.weight[3] = float("nan")
    with pytest.raises(checkpoint.manager.NonFiniteStateError) as refused:
        manager.save(2, model, optimizer, scheduler, {"step": 2})
    assert "the policy's weights hold NaN or inf in 1 tensor (first: norm.weight)" in str(refused.value)
    assert f"not checkpointed (the previous checkpoint (step 1, {manager.step_path(1)}) is intact" in str(refused.value)
    with torch.no_grad():
        model.norm.weight[3] = 1.0
    optimizer.state[model.lm_head.weight]["exp_avg_sq"][0, 0] = float("inf")
    with pytest.raises(checkpoint.manager.NonFiniteStateError, match=r"optimizer's state tensors hold NaN or inf"):
        manager.save(2, model, optimizer, scheduler, {"step": 2})
    assert os.listdir(folder) == [STEP1]


def _nan_in_one_shard(rank, world_size, folder):
    """A NaN in rank 1's shard of an FSDP-sharded parameter: every rank must see it, and refuse to save."""
    from torch.distributed.tensor import DTensor

    from parallel.dims import ParallelDims
    from parallel.finite import nonfinite_state

    dims = ParallelDims(dp_shard=world_size, world_size=world_size)
    dims.build_mesh("cpu")
    model, optimizer, scheduler = _setup(0, dims)
    before = nonfinite_state(model, optimizer)
    weight = model.norm.weight
    assert isinstance(weight, DTensor)
    if rank == 1:
        with torch.no_grad():
            weight.to_local()[0] = float("nan")
    found = nonfinite_state(model, optimizer)
    try:
        CheckpointManager(folder).save(1, model, optimizer, scheduler)
    except checkpoint.manager.NonFiniteStateError as exc:
        refused = str(exc)
    else:
        refused = None
    return {"before": before, "found": found, "refused": refused}


@pytest.mark.multiprocess
def test_a_nan_in_one_ranks_shard_is_seen_and_refused_on_every_rank(tmp_path):
    results = run_ranks(_nan_in_one_shard, 2, str(tmp_path / "ckpt"), timeout=120)
    assert [r["before"] for r in results] == [None, None]
    assert results[0]["found"] == "the policy's weights hold NaN or inf in 1 shard (on another rank)"
    assert results[1]["found"] == "the policy's weights hold NaN or inf in 1 shard (first on this rank: norm.weight)"
    assert all(r["refused"] is not None and r["found"] in r["refused"] for r in results)
    assert not os.path.exists(tmp_path / "ckpt")


def test_non_finite_weights_are_never_exported(tmp_path):
    model = build_model(PRESETS["tiny"], seed=0)
    with torch.no_grad():
        model.layers["1"].self_attn.q_proj.weight[0, 0] = float("inf")
    with pytest.raises(
        checkpoint.manager.NonFiniteStateError, match=r"layers.1.self_attn.q_proj.weight\); not exported"
    ):
        export_hf(model, str(tmp_path / "hf"))
    assert not (tmp_path / "hf").exists()


def test_resuming_into_another_model_names_both_shapes(tmp_path):
    folder = str(tmp_path / "ckpt")
    manager, _ = _saved_steps(folder, (1,))
    other = build_model(PRESETS["tiny"].replace(hidden_size=32, intermediate_size=64), seed=0)
    with pytest.raises(CheckpointError) as refused:
        manager.resume(other, torch.optim.AdamW(other.parameters()))
    message = str(refused.value)
    assert "holds model.embed_tokens.weight with shape [256, 64], this run's model has [256, 32]" in message
    assert "written for another model" in message and "--fresh" in message
    fewer_layers = build_model(PRESETS["tiny"].replace(num_layers=1), seed=0)
    with pytest.raises(CheckpointError, match=r"holds 12 tensors this run's model lacks \(first: model.layers.1"):
        manager.resume(fewer_layers)
