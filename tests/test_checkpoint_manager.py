"""Distributed checkpoints: exact resume in a new process group, skipped damaged checkpoints, pruning.

The training steps draw their data from each rank's torch RNG and follow a warm-up LR schedule, so an exact
resume needs the model, the AdamW state, the scheduler and the RNG states all restored: the resumed run's
losses must equal the uninterrupted run's bit for bit.
"""

from __future__ import annotations

import io
import json
import logging
import os
import pickle
import re

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_ranks

from checkpoint.manager import MANIFEST, CheckpointManager
from model.args import PRESETS
from model.qwen2 import build_model
from parallel.dims import ParallelDims
from parallel.grad_clip import clip_grad_norm_
from parallel.logprob import vocab_parallel_token_logprobs
from parallel.parallelize import parallelize_qwen2

ARGS = PRESETS["tiny"]


def _setup(model_seed, dims=None):
    model = build_model(ARGS, seed=model_seed)
    if dims is not None:
        parallelize_qwen2(model, dims.world_mesh, dims, param_dtype=torch.float32, reduce_dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 3))
    return model, optimizer, scheduler


def _step(model, optimizer, scheduler):
    """One update on a batch drawn from this rank's RNG; returns the loss summed over data-parallel ranks."""
    tokens = torch.randint(0, ARGS.vocab_size, (2, 8))
    hidden = model(tokens, return_hidden=True)
    logp, _ = vocab_parallel_token_logprobs(hidden, model.output_weight(), tokens.roll(-1, 1))
    world = dist.get_world_size() if dist.is_initialized() else 1
    loss = -logp.sum() / (logp.numel() * world)  # token mean over the global batch
    loss.backward()
    clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad()
    loss = loss.detach()
    if dist.is_initialized():
        dist.all_reduce(loss)
    return loss


def _train_state(step, rank):
    groups = [{"prompt": f"rank {rank} step {step}", "rewards": (1.0, -1.0), "logprobs": torch.full((3,), -0.5)}]
    return {
        "step": step,
        "tokens": 16 * step,
        "data_position": {"epoch": 0, "index": 4 * step},
        "carried_groups": groups,
    }


def _worker(rank, world_size, mode, folder):
    dims = ParallelDims(dp_shard=world_size, world_size=world_size)
    dims.build_mesh("cpu")
    torch.manual_seed(100 + rank)
    manager = CheckpointManager(folder, keep=2)
    if mode == "uninterrupted":
        model, optimizer, scheduler = _setup(0, dims)
        return [_step(model, optimizer, scheduler) for _ in range(4)]
    if mode == "interrupted":
        model, optimizer, scheduler = _setup(0, dims)
        losses = []
        for step in range(1, 4):
            losses.append(_step(model, optimizer, scheduler))
            if step >= 2:
                manager.save(step, model, optimizer, scheduler, _train_state(step, rank))
        return losses
    # "resume": a different initialisation, overwritten by the checkpoint.
    torch.manual_seed(999)
    model, optimizer, scheduler = _setup(1, dims)
    caught = _LogLines()
    logging.getLogger("checkpoint.manager").addHandler(caught)
    try:
        state = manager.resume(model, optimizer, scheduler)
    finally:
        logging.getLogger("checkpoint.manager").removeHandler(caught)
    losses = [_step(model, optimizer, scheduler) for _ in range(2)]
    return {"losses": losses, "state": state, "warnings": caught.lines}


class _LogLines(logging.Handler):
    """The messages logged while it is attached."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def test_resume_in_new_process_group_is_exact_and_skips_damaged(tmp_path):
    folder = str(tmp_path / "ckpt")
    reference = run_ranks(_worker, 2, "uninterrupted", folder)[0]
    first = run_ranks(_worker, 2, "interrupted", folder)[0]
    assert torch.equal(torch.stack(first), torch.stack(reference[:3]))
    assert sorted(os.listdir(folder)) == ["step-00000002", "step-00000003"]

    # Damage the newest checkpoint: truncate one of its DCP data files.
    newest = os.path.join(folder, "step-00000003")
    data = sorted(f for f in os.listdir(newest) if f.endswith(".distcp"))[0]
    with open(os.path.join(newest, data), "r+b") as f:
        f.truncate(os.path.getsize(os.path.join(newest, data)) // 2)
    # And leave a half-written save behind, as a crash would.
    os.makedirs(os.path.join(folder, "step-00000004.tmp"))

    resumed = run_ranks(_worker, 2, "resume", folder)
    out = resumed[0]
    print(f"uninterrupted losses {torch.stack(reference).tolist()}; resumed {torch.stack(out['losses']).tolist()}")
    # Rank 0 names the damaged checkpoint and its file in one line and sets it aside.
    assert [w for w in out["warnings"] if "is damaged" in w and data in w and "resuming from step-00000002" in w]
    assert sorted(os.listdir(folder)) == ["step-00000002", "step-00000003.damaged", "step-00000004.tmp"]
    # Resumed from step 2: its steps 3 and 4 equal the uninterrupted run's, bit for bit.
    assert torch.equal(torch.stack(out["losses"]), torch.stack(reference[2:4]))
    for rank, rank_out in enumerate(resumed):
        state = rank_out["state"]
        assert state["step"] == 2 and state["data_position"] == {"epoch": 0, "index": 8}
        group = state["carried_groups"][0]
        assert group["prompt"] == f"rank {rank} step 2" and group["rewards"] == (1.0, -1.0)
        assert torch.equal(group["logprobs"], torch.full((3,), -0.5))


def test_single_process_save_prune_and_fallback(tmp_path, caplog):
    torch.manual_seed(0)
    folder = str(tmp_path / "ckpt")
    manager = CheckpointManager(folder, keep=2)
    assert manager.resume(*_setup(0)) is None  # nothing to resume from
    model, optimizer, scheduler = _setup(0)
    saved = {}
    for step in range(1, 5):
        _step(model, optimizer, scheduler)
        manager.save(step, model, optimizer, scheduler, {"step": step})
        saved[step] = {k: v.clone() for k, v in model.state_dict().items()}
    assert manager.complete_steps() == [3, 4]  # keep=2 pruned steps 1 and 2
    assert all(manager.validate(s) is None for s in (3, 4))

    # A checkpoint whose manifest is missing (renamed by hand, or an older format) is not trusted either.
    os.remove(os.path.join(folder, "step-00000004", MANIFEST))
    fresh, fresh_opt, fresh_sched = _setup(1)
    with caplog.at_level(logging.WARNING, logger="checkpoint.manager"):
        state = manager.resume(fresh, fresh_opt, fresh_sched)
    assert re.search(
        r"step-00000004 is damaged \(no COMPLETE.json .*\); resuming from step-00000003 instead; the "
        r"damaged one is kept as step-00000004.damaged",
        caplog.text,
    )
    assert state == {"step": 3}
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in saved[3].items())
    assert fresh_sched.last_epoch == scheduler.last_epoch - 1
    assert fresh_opt.state_dict()["state"][0]["step"] == 3
    assert sorted(os.listdir(folder)) == ["step-00000003", "step-00000004.damaged"]


def test_a_run_resumed_below_damaged_checkpoints_keeps_its_own(tmp_path, caplog):
    folder = str(tmp_path / "ckpt")
    manager = CheckpointManager(folder, keep=1)
    model, optimizer, scheduler = _setup(0)
    for step in (20, 30):
        _step(model, optimizer, scheduler)
        manager.save(step, model, optimizer, scheduler, {"step": step})
    with open(os.path.join(folder, "step-00000030", "train_state", "rank-00000.json"), "r+b") as f:
        f.truncate(10)
    # keep=1 pruned step 20; rebuild it as the intact one to fall back to.
    manager.keep = 0
    manager.save(20, model, optimizer, scheduler, {"step": 20})
    manager.keep = 1
    with caplog.at_level(logging.WARNING, logger="checkpoint.manager"):
        assert manager.resume(*_setup(1)) == {"step": 20}
    assert "rank-00000.json has 10 bytes" in caplog.text
    # The resumed run's next checkpoints are the newest: kept, and step 30 is written again.
    manager.save(21, model, optimizer, scheduler, {"step": 21})
    assert manager.complete_steps() == [21] and manager.validate(21) is None
    manager.save(30, model, optimizer, scheduler, {"step": 30})
    assert manager.complete_steps() == [30] and manager.validate(30) is None
    assert sorted(os.listdir(folder)) == ["step-00000030", "step-00000030.damaged"]


def test_keep_zero_keeps_every_checkpoint_and_resaving_a_step_replaces_it(tmp_path):
    manager = CheckpointManager(str(tmp_path), keep=0)
    model, optimizer, scheduler = _setup(0)
    for step in range(1, 5):
        manager.save(step, model, optimizer, scheduler, {"step": step})
    manager.save(4, model, optimizer, scheduler, {"step": 4, "again": True})
    assert manager.complete_steps() == [1, 2, 3, 4]
    assert sorted(os.listdir(tmp_path)) == [f"step-0000000{s}" for s in range(1, 5)]
    assert manager.resume(*_setup(1)) == {"step": 4, "again": True}


def test_bad_keep_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"keep must be >= 0 \(0 keeps every checkpoint\), got -1"):
        CheckpointManager(str(tmp_path), keep=-1)


def test_checkpoint_before_the_first_update_leaves_the_optimizer_fresh(tmp_path):
    """DCP would initialise an empty Adam state with a zero-lr step (step count 1); it must not."""
    from checkpoint.manager import CheckpointManager
    from model.args import get_preset
    from model.qwen2 import build_model

    model = build_model(get_preset("tiny"), seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    manager = CheckpointManager(str(tmp_path), keep=2)
    manager.save(0, model, optimizer, train_state={"step": 0})
    assert len(optimizer.state) == 0
    restored = build_model(get_preset("tiny"), seed=1)
    fresh = torch.optim.AdamW(restored.parameters(), lr=1e-3)
    assert manager.resume(restored, fresh) == {"step": 0}
    assert len(fresh.state) == 0
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), restored.parameters()))
    # Steps whose updates were all skipped moved the schedule but left no optimizer state: the resumed
    # optimizer runs at the schedule's rate, not the initial one.
    warmup = lambda s: min(1.0, (s + 1) / 10)  # noqa: E731
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup)
    for _ in range(3):
        scheduler.step()
    manager.save(3, model, optimizer, scheduler, {"step": 3})
    again = torch.optim.AdamW(restored.parameters(), lr=1e-3)
    again_scheduler = torch.optim.lr_scheduler.LambdaLR(again, warmup)
    assert manager.resume(restored, again, again_scheduler) == {"step": 3}
    assert again.param_groups[0]["lr"] == pytest.approx(1e-3 * 0.4) == optimizer.param_groups[0]["lr"]


def _optimizer(model, lr, weight_decay):
    from config.schema import OptimizerConfig
    from trainer.optimizer import build_optimizer

    return build_optimizer(model.parameters(), OptimizerConfig(lr=lr, weight_decay=weight_decay, warmup_steps=5))


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before")  # skipped updates
@pytest.mark.parametrize("moved", [True, False], ids=["optimizer-state", "before-the-first-update"])
def test_resume_trains_at_the_configured_lr_at_the_schedules_position(tmp_path, caplog, moved):
    """A checkpoint made at lr A, resumed by a run configured with lr B (one warm-up shared by runs at several
    rates): the run trains at B times the schedule's factor at the saved step; an unchanged resume is unchanged."""
    model = build_model(ARGS, seed=0)
    optimizer, scheduler = _optimizer(model, 1e-4, 0.0)
    for _ in range(2):  # two updates (or two skipped ones: the schedule moves, no optimizer state is made)
        _step(model, optimizer, scheduler) if moved else scheduler.step()
    manager = CheckpointManager(str(tmp_path), keep=2)
    manager.save(2, model, optimizer, scheduler, {"step": 2})
    assert optimizer.param_groups[0]["lr"] == pytest.approx(1e-4 * 3 / 5)

    same = build_model(ARGS, seed=1)
    same_optimizer, same_scheduler = _optimizer(same, 1e-4, 0.0)
    with caplog.at_level(logging.WARNING, logger="checkpoint.manager"):
        manager.resume(same, same_optimizer, same_scheduler)
    assert "other optimizer settings" not in caplog.text
    assert same_scheduler.state_dict() == scheduler.state_dict()
    saved_groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    assert [{k: v for k, v in g.items() if k != "params"} for g in same_optimizer.param_groups] == saved_groups

    restored = build_model(ARGS, seed=1)
    other, other_scheduler = _optimizer(restored, 1.5e-5, 0.1)
    with caplog.at_level(logging.WARNING, logger="checkpoint.manager"):
        manager.resume(restored, other, other_scheduler)
    assert "lr 0.0001 -> 1.5e-05" in caplog.text
    assert ("weight_decay 0.0 -> 0.1" in caplog.text) == moved  # saved param groups exist after an update only
    assert other_scheduler.last_epoch == 2 and other_scheduler.base_lrs == [1.5e-5]
    assert other.param_groups[0]["lr"] == pytest.approx(1.5e-5 * 3 / 5, rel=1e-12)
    assert other.param_groups[0]["weight_decay"] == 0.1
    # The update itself runs at B: AdamW moves each weight by lr x (m / (sqrt(v) + eps) + wd x w), so the same
    # update on a copy whose rate and decay are set by hand gives the same weights.
    reference = build_model(ARGS, seed=1)
    reference.load_state_dict(restored.state_dict())
    by_hand, by_hand_scheduler = _optimizer(reference, 1e-4, 0.0)
    manager.resume(reference, by_hand, by_hand_scheduler)
    by_hand.param_groups[0].update(lr=1.5e-5 * 3 / 5, weight_decay=0.1)
    for net, opt, sched in ((restored, other, other_scheduler), (reference, by_hand, by_hand_scheduler)):
        torch.manual_seed(7)
        _step(net, opt, sched)
    assert all(torch.equal(a, b) for a, b in zip(restored.parameters(), reference.parameters()))
    assert other.param_groups[0]["lr"] == pytest.approx(1.5e-5 * 4 / 5, rel=1e-12)  # the schedule goes on at B


# ---- loading runs no code from the checkpoint folder ----------------------------------------------------


class _CreatesFile:
    """Unpickling this calls open(path, "w"): a stand-in for any code a planted pickle could run."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return open, (self.path, "w")


def _saved_checkpoint(folder):
    manager = CheckpointManager(folder, keep=1)
    model, optimizer, scheduler = _setup(0)
    _step(model, optimizer, scheduler)
    return manager, manager.save(1, model, optimizer, scheduler, {"step": 1})


def _update_manifest(path):
    """What an attacker would do too: make the manifest match the planted files, so the folder looks intact."""
    from checkpoint.files import file_record

    with open(os.path.join(path, MANIFEST)) as f:
        manifest = json.load(f)
    os.remove(os.path.join(path, MANIFEST))
    files = [os.path.join(folder, name) for folder, _, names in os.walk(path) for name in names]
    manifest["files"] = {os.path.relpath(file, path): file_record(file).to_json() for file in files}
    with open(os.path.join(path, MANIFEST), "w") as f:
        json.dump(manifest, f)


def test_a_pickled_train_state_of_the_old_layout_is_refused_not_run(tmp_path):
    from checkpoint.manager import CheckpointError

    manager, path = _saved_checkpoint(str(tmp_path / "ckpt"))
    # The old layout: train_state/rank-00000.pt, read with torch.load(weights_only=False).
    for name in ("rank-00000.json", "rank-00000.safetensors"):
        os.remove(os.path.join(path, "train_state", name))
    planted = os.path.join(path, "train_state", "rank-00000.pt")
    torch.save({"train_state": _CreatesFile(str(tmp_path / "marker"))}, planted)
    _update_manifest(path)
    # The planted file does run code when unpickled the old way (checked on a copy of the marker's path).
    torch.save(_CreatesFile(str(tmp_path / "proof")), tmp_path / "proof.pt")
    torch.load(tmp_path / "proof.pt", weights_only=False)
    assert (tmp_path / "proof").exists()

    model, optimizer, scheduler = _setup(1)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(
        CheckpointError,
        match=r"rank-00000.pt is a pickle written by an older version of this "
        r"trainer; it is not loaded, because unpickling a file can run any "
        r"code in it. Start the run over \(train.py --fresh",
    ):
        manager.resume(model, optimizer, scheduler)
    assert not (tmp_path / "marker").exists()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # refused before loading weights


def test_a_planted_dcp_index_is_refused_not_run(tmp_path):
    from torch.distributed.checkpoint.metadata import Metadata

    from checkpoint.safe_dcp import UnsafeCheckpointError

    manager, path = _saved_checkpoint(str(tmp_path / "ckpt"))
    with open(os.path.join(path, ".metadata"), "rb") as f:
        index = pickle.load(f)  # our own file: trusted here
    assert isinstance(index, Metadata)
    index.planner_data = _CreatesFile(str(tmp_path / "marker"))
    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump(index, f)
    _update_manifest(path)
    with pytest.raises(
        UnsafeCheckpointError,
        match=r"\.metadata refers to (builtins|io)\.open, which a checkpoint's "
        r"index never holds; it was not loaded",
    ):
        manager.resume(*_setup(1))
    assert not (tmp_path / "marker").exists()


def test_a_planted_pickled_item_in_dcp_data_is_refused_not_run(tmp_path):
    """DCP reads non-tensor items with torch.load(weights_only=False); a checkpoint that declares one is refused."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    from checkpoint.safe_dcp import UnsafeCheckpointError

    manager, path = _saved_checkpoint(str(tmp_path / "ckpt"))
    with open(os.path.join(path, ".metadata"), "rb") as f:
        index = pickle.load(f)
    key = "model.norm.weight"
    assert key in index.state_dict_metadata
    payload = io.BytesIO()
    torch.save(_CreatesFile(str(tmp_path / "marker")), payload)
    with open(os.path.join(path, "planted.distcp"), "wb") as f:
        f.write(payload.getvalue())
    index.state_dict_metadata[key] = BytesStorageMetadata()
    index.storage_data = {k: v for k, v in index.storage_data.items() if k.fqn != key}
    index.storage_data[MetadataIndex(key)] = _StorageInfo("planted.distcp", 0, len(payload.getvalue()))
    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump(index, f)
    _update_manifest(path)
    with pytest.raises(
        UnsafeCheckpointError,
        match=r"stores 'model.norm.weight' as a pickled object, which this "
        r"project never writes; it was not loaded",
    ):
        manager.resume(*_setup(1))
    assert not (tmp_path / "marker").exists()
    # Behind that check, the load planner refuses such an item too.
    from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

    from checkpoint.safe_dcp import TensorsOnlyLoadPlanner

    item = ReadItem(LoadItemType.BYTE_IO, MetadataIndex(key), 0, MetadataIndex(key), 0, 0)
    with pytest.raises(UnsafeCheckpointError, match="as a pickled object"):
        TensorsOnlyLoadPlanner().load_bytes(item, io.BytesIO(payload.getvalue()))
    assert not (tmp_path / "marker").exists()


def test_a_dcp_index_naming_a_file_outside_the_checkpoint_is_refused(tmp_path):
    from checkpoint.safe_dcp import UnsafeCheckpointError

    manager, path = _saved_checkpoint(str(tmp_path / "ckpt"))
    with open(os.path.join(path, ".metadata"), "rb") as f:
        index = pickle.load(f)
    for info in index.storage_data.values():
        info.relative_path = "../../elsewhere.distcp"
    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump(index, f)
    _update_manifest(path)
    with pytest.raises(UnsafeCheckpointError, match=r"names the storage file '../../elsewhere.distcp', outside"):
        manager.resume(*_setup(1))


def test_train_state_that_is_not_plain_data_is_refused_before_anything_is_written(tmp_path):
    from checkpoint.plain_state import PlainStateError

    manager = CheckpointManager(str(tmp_path), keep=1)
    model, optimizer, scheduler = _setup(0)
    with pytest.raises(PlainStateError, match=r"state.train_state.groups\[0\]: a .*_CreatesFile is not plain data"):
        manager.save(1, model, optimizer, scheduler, {"groups": [_CreatesFile("x")]})
    assert os.listdir(tmp_path) == []


def test_plain_state_round_trips_exactly(tmp_path):
    import random

    from checkpoint.plain_state import load_plain, save_plain

    value = {
        "ints": [1, -2, 3**40],
        "floats": (0.1, float("inf"), -0.0),
        "none": None,
        "flag": True,
        "text": "é\n",
        "python_rng": random.Random(3).getstate(),
        "empty": {},
        "nested": [(), [()]],
        "tensors": {
            "bf16": torch.randn(3, dtype=torch.bfloat16),
            "bytes": torch.get_rng_state(),
            "scalar": torch.tensor(7, dtype=torch.int64),
        },
    }
    save_plain(value, str(tmp_path / "s.json"), str(tmp_path / "s.safetensors"))
    back = load_plain(str(tmp_path / "s.json"), str(tmp_path / "s.safetensors"))
    tensors = back.pop("tensors")
    expected = dict(value)
    expected_tensors = expected.pop("tensors")
    assert back == expected and type(back["floats"]) is tuple and back["nested"] == [(), [()]]
    assert back["floats"][2] == 0.0 and str(back["floats"][2]) == "-0.0"
    for name, tensor in expected_tensors.items():
        assert tensors[name].dtype == tensor.dtype and torch.equal(tensors[name], tensor), name


def test_load_restores_the_torch_python_and_numpy_random_states(tmp_path):
    """What each generator draws after a load is what it drew after the save, though reseeded in between."""
    import random

    import numpy as np

    def draws():
        return torch.rand(3).tolist(), random.random(), np.random.rand(3).tolist(), float(np.random.randn())

    manager = CheckpointManager(str(tmp_path))
    model = torch.nn.Linear(2, 2)
    torch.manual_seed(1), random.seed(1), np.random.seed(1)
    np.random.randn()  # leaves a cached Gaussian, part of numpy's state
    manager.save(1, model)
    after_save = draws()
    torch.manual_seed(2), random.seed(2), np.random.seed(2)
    manager.load(1, model)
    assert draws() == after_save
