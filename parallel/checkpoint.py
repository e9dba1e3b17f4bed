"""Training checkpoints with torch.distributed.checkpoint (DCP): atomic, pruned, resumed automatically.

Layout of `folder`:

    step-00000120/                  a complete checkpoint
        .metadata, __0_0.distcp...  DCP: model and optimizer state, each rank writing its own shards
        train_state/rank-00000.pt   per rank: step, tokens, data position, carried-over rollout groups,
                                    LR scheduler, RNG states (torch CPU/CUDA, Python, NumPy)
        COMPLETE.json               manifest: every file's size; written last
    step-00000140.tmp/              being written (or left by a crash): never loaded, removed later

Atomicity: all ranks write into `step-N.tmp`; after a barrier rank 0 writes the manifest and renames the
folder to `step-N` (one rename, atomic on POSIX file systems). A checkpoint without the manifest, or whose
files no longer match it (a truncated or missing file), is skipped with a warning and the next older
intact one is used; when a run resumes from it, the newer damaged ones are renamed `step-N.damaged`, so
the run's own later checkpoints are neither shadowed nor pruned by them. Only the latest `keep` complete
checkpoints are kept (0: all).

Works with and without a process group: single-process training saves the same layout.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import shutil
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from parallel.fsdp import reshard_gathered

MANIFEST = "COMPLETE.json"
_STEP_DIR = re.compile(r"step-(\d{8})\Z")


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _barrier():
    if dist.is_initialized():
        dist.barrier()


def _broadcast(value):
    if not dist.is_initialized():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


@contextlib.contextmanager
def _single_process_quiet():
    """DCP warns that it "assumes" single-process mode even when told so (no_dist=True); that is intended here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    try:
        import numpy as np

        state["numpy"] = np.random.get_state()
    except ImportError:
        pass
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])


def _unused_name(path: str) -> str:
    """`path`, or `path.1`, `path.2`, ... : the first that does not exist."""
    candidate, n = path, 0
    while os.path.exists(candidate):
        n += 1
        candidate = f"{path}.{n}"
    return candidate


def _list_files(root: str) -> dict[str, int]:
    sizes = {}
    for directory, _, files in os.walk(root):
        for name in files:
            path = os.path.join(directory, name)
            sizes[os.path.relpath(path, root)] = os.path.getsize(path)
    return sizes


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class CheckpointManager:
    """Save and resume (model, optimizer, LR scheduler, train state) under `folder`, keeping the latest `keep`."""

    def __init__(self, folder: str, keep: int = 3):
        if keep < 0:
            raise ValueError(f"keep must be >= 0 (0 keeps every checkpoint), got {keep}")
        self.folder = folder
        self.keep = keep

    # ---- discovery ----------------------------------------------------------------------------------

    def step_path(self, step: int) -> str:
        """The folder of checkpoint `step` (it may not exist)."""
        return os.path.join(self.folder, f"step-{step:08d}")

    def complete_steps(self) -> list[int]:
        """Steps with a renamed (committed) checkpoint folder, oldest first (validity not checked)."""
        if not os.path.isdir(self.folder):
            return []
        steps = [int(m.group(1)) for m in map(_STEP_DIR.match, os.listdir(self.folder)) if m]
        return sorted(steps)

    def validate(self, step: int) -> str | None:
        """None if checkpoint `step` is intact, else why not (missing manifest, missing or resized file)."""
        path = self.step_path(step)
        manifest_path = os.path.join(path, MANIFEST)
        if not os.path.isfile(manifest_path):
            return f"no {MANIFEST} (an interrupted save)"
        try:
            with open(manifest_path) as f:
                manifest = json.load(f)
            expected = manifest["files"]
        except (json.JSONDecodeError, KeyError) as e:
            return f"unreadable {MANIFEST}: {e}"
        for name, size in expected.items():
            file = os.path.join(path, name)
            if not os.path.isfile(file):
                return f"file {name} is missing"
            actual = os.path.getsize(file)
            if actual != size:
                return f"file {name} has {actual} bytes, the manifest says {size} (truncated or overwritten)"
        return None

    def latest_valid_step(self, set_aside_damaged: bool = False) -> int | None:
        """The newest intact checkpoint; newer damaged ones are skipped with a warning. Decided on rank 0.

        set_aside_damaged: rename the skipped ones to `step-N.damaged` (kept for inspection). A run that
        resumes from an older step must do this: its own later checkpoints would otherwise rank below the
        damaged ones and be pruned as the oldest, and the damaged step would never be written again.
        """
        chosen = None
        if _rank() == 0:
            for step in reversed(self.complete_steps()):
                problem = self.validate(step)
                if problem is None:
                    chosen = step
                    break
                path = self.step_path(step)
                if set_aside_damaged:
                    aside = _unused_name(path + ".damaged")
                    os.replace(path, aside)
                    problem += f"; moved to {aside}"
                warnings.warn(f"skipping checkpoint {path}: {problem}", stacklevel=2)
        return _broadcast(chosen)

    # ---- save ---------------------------------------------------------------------------------------

    def save(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
             lr_scheduler=None, train_state: dict[str, Any] | None = None) -> str:
        """Write checkpoint `step` atomically on every rank; returns its folder.

        train_state: picklable values of this rank (step, tokens, data position, carried-over rollout
        groups as bytes, ...); RNG states are added automatically.
        """
        reshard_gathered(model)  # the fp32 master shards, not copies gathered by a forward without backward
        final = self.step_path(step)
        tmp = final + ".tmp"
        if _rank() == 0:
            if os.path.exists(tmp):
                shutil.rmtree(tmp)
            os.makedirs(os.path.join(tmp, "train_state"))
        _barrier()

        # An optimizer that never stepped has no state; asking DCP for it would initialise it with a
        # zero-lr step (Adam's step count becomes 1), so a resumed run's first update would differ.
        with_optimizer = optimizer is not None and len(optimizer.state) > 0
        state = self._dcp_state(model, optimizer if with_optimizer else None)
        with _single_process_quiet():
            dcp.save(state, checkpoint_id=tmp, no_dist=not dist.is_initialized())
        extra = {
            "train_state": dict(train_state or {}),
            "lr_scheduler": lr_scheduler.state_dict() if lr_scheduler is not None else None,
            "rng": _rng_state(),
            "world_size": _world_size(),
        }
        rank_file = os.path.join(tmp, "train_state", f"rank-{_rank():05d}.pt")
        torch.save(extra, rank_file)
        with open(rank_file, "rb+") as f:
            os.fsync(f.fileno())
        _barrier()

        if _rank() == 0:
            manifest = {"step": step, "world_size": _world_size(), "optimizer": with_optimizer,
                        "files": _list_files(tmp)}
            with open(os.path.join(tmp, MANIFEST), "w") as f:
                json.dump(manifest, f, indent=1)
                f.flush()
                os.fsync(f.fileno())
            old = None
            if os.path.exists(final):  # re-saving a step replaces it; a directory cannot be replaced in one rename
                old = _unused_name(final + ".old")
                os.replace(final, old)
            os.replace(tmp, final)
            _fsync_dir(self.folder)
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
            self._prune(keep_step=step)
        _barrier()
        return final

    def _prune(self, keep_step: int) -> None:
        if self.keep:  # 0: keep every checkpoint
            for step in self.complete_steps()[:-self.keep]:
                shutil.rmtree(self.step_path(step), ignore_errors=True)
        for name in os.listdir(self.folder):  # folders of interrupted saves
            if name.endswith(".tmp") and name != f"step-{keep_step:08d}.tmp":
                shutil.rmtree(os.path.join(self.folder, name), ignore_errors=True)

    # ---- load ---------------------------------------------------------------------------------------

    @staticmethod
    def _dcp_state(model, optimizer):
        if optimizer is None:
            return {"model": get_model_state_dict(model)}
        model_state, optim_state = get_state_dict(model, optimizer)
        return {"model": model_state, "optimizer": optim_state}

    def load(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
             lr_scheduler=None) -> dict[str, Any]:
        """Load checkpoint `step` into the (already parallelised) model and optimizer in place; restore this
        rank's RNG states and the scheduler; return the saved train state."""
        path = self.step_path(step)
        fresh_optimizer = None
        with open(os.path.join(path, MANIFEST)) as f:
            if not json.load(f).get("optimizer", True):
                # Saved before the first update: the optimizer starts fresh.
                fresh_optimizer, optimizer = optimizer, None
        state = self._dcp_state(model, optimizer)
        with _single_process_quiet():
            dcp.load(state, checkpoint_id=path, no_dist=not dist.is_initialized())
        if optimizer is None:
            set_model_state_dict(model, state["model"])
        else:
            set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])

        rank_file = os.path.join(path, "train_state", f"rank-{_rank():05d}.pt")
        own = os.path.isfile(rank_file)
        if not own:
            warnings.warn(f"{path} was saved by fewer ranks; rank {_rank()} resumes with rank 0's train state "
                          "and keeps its current RNG states", stacklevel=2)
            rank_file = os.path.join(path, "train_state", "rank-00000.pt")
        # weights_only=False: the file holds this trainer's own picklable state (data position, rollout groups).
        extra = torch.load(rank_file, weights_only=False)
        if extra["world_size"] != _world_size():
            warnings.warn(f"{path} was saved with {extra['world_size']} ranks, resuming with {_world_size()}",
                          stacklevel=2)
        if own:
            _set_rng_state(extra["rng"])
        if lr_scheduler is not None and extra["lr_scheduler"] is not None:
            lr_scheduler.load_state_dict(extra["lr_scheduler"])
            if fresh_optimizer is not None:
                # No optimizer state was saved (every update so far was skipped), so the param groups still
                # hold the initial rate while the schedule has moved on: give them the schedule's.
                for group, lr in zip(fresh_optimizer.param_groups, lr_scheduler.get_last_lr()):
                    group["lr"] = lr
        return extra["train_state"]

    def resume(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
               lr_scheduler=None) -> dict[str, Any] | None:
        """Load the newest intact checkpoint, if any; returns its train state or None (fresh start)."""
        step = self.latest_valid_step(set_aside_damaged=True)
        if step is None:
            return None
        return self.load(step, model, optimizer, lr_scheduler)
