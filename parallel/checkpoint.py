"""Training checkpoints with torch.distributed.checkpoint (DCP): atomic, pruned, resumed automatically.

Layout of `folder`:

    step-00000120/                  a complete checkpoint
        .metadata, __0_0.distcp...  DCP: model parameters and optimizer state tensors, each rank writing
                                    its own shards
        train_state/rank-00000.json     per rank, as plain data (parallel/plain_state.py): step, tokens,
        train_state/rank-00000.safetensors  data position, carried-over rollout groups, LR scheduler, the
                                    optimizer's hyperparameters, RNG states (torch CPU/CUDA, Python, NumPy)
        COMPLETE.json               manifest: every file's size; written last
    step-00000140.tmp/              being written (or left by a crash): never loaded, removed later

Atomicity: all ranks write into `step-N.tmp`; after a barrier rank 0 writes the manifest and renames the
folder to `step-N` (one rename, atomic on POSIX file systems). A checkpoint without the manifest, or whose
files no longer match it (a truncated or missing file), is skipped with a warning and the next older
intact one is used; when a run resumes from it, the newer damaged ones are renamed `step-N.damaged`, so
the run's own later checkpoints are neither shadowed nor pruned by them. Only the latest `keep` complete
checkpoints are kept (0: all).

Loading runs no code from the folder: the train state is JSON and safetensors, and DCP is read by
parallel/safe_dcp.py (its index through a restricted unpickler, tensors only). Checkpoints of the older
layout, whose train state was a pickle (`train_state/rank-N.pt`), are refused, not unpickled.

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
from parallel.plain_state import PlainStateError, encode, load_plain, save_plain
from parallel.safe_dcp import CheckpointError, load_tensors

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
    """This process's RNG states as plain data (parallel/plain_state.py)."""
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    try:
        import numpy as np

        algorithm, keys, pos, has_gauss, cached_gaussian = np.random.get_state(legacy=True)
        state["numpy"] = (
            algorithm,
            torch.from_numpy(keys.astype(np.int64)),
            int(pos),
            int(has_gauss),
            float(cached_gaussian),
        )
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

        algorithm, keys, pos, has_gauss, cached_gaussian = state["numpy"]
        np.random.set_state((algorithm, keys.numpy().astype(np.uint32), pos, has_gauss, cached_gaussian))


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

    def save(
        self,
        step: int,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        lr_scheduler=None,
        train_state: dict[str, Any] | None = None,
    ) -> str:
        """Write checkpoint `step` atomically on every rank; returns its folder.

        train_state: this rank's values as plain data (parallel/plain_state.py: str-keyed dicts, lists,
        tuples, numbers, strings, tensors), e.g. step, tokens, data position, carried-over rollout groups;
        RNG states are added automatically. Anything else raises PlainStateError before anything is written.
        """
        # An optimizer that never stepped has no state; asking DCP for it would initialise it with a
        # zero-lr step (Adam's step count becomes 1), so a resumed run's first update would differ.
        with_optimizer = optimizer is not None and len(optimizer.state) > 0
        reshard_gathered(model)  # the fp32 master shards, not copies gathered by a forward without backward
        tensors, param_groups = self._dcp_state(model, optimizer if with_optimizer else None)
        extra = {
            "train_state": dict(train_state or {}),
            "lr_scheduler": lr_scheduler.state_dict() if lr_scheduler is not None else None,
            "optimizer_param_groups": param_groups,
            "rng": _rng_state(),
            "world_size": _world_size(),
        }
        encode(extra, {})  # refuse what is not plain data before any file is touched
        final = self.step_path(step)
        tmp = final + ".tmp"
        if _rank() == 0:
            if os.path.exists(tmp):
                shutil.rmtree(tmp)
            os.makedirs(os.path.join(tmp, "train_state"))
        _barrier()

        with _single_process_quiet():
            dcp.save(tensors, checkpoint_id=tmp, no_dist=not dist.is_initialized())
        save_plain(extra, *self._rank_files(tmp, _rank()))
        _barrier()

        if _rank() == 0:
            manifest = {
                "step": step,
                "world_size": _world_size(),
                "optimizer": with_optimizer,
                "files": _list_files(tmp),
            }
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
            for step in self.complete_steps()[: -self.keep]:
                shutil.rmtree(self.step_path(step), ignore_errors=True)
        for name in os.listdir(self.folder):  # folders of interrupted saves
            if name.endswith(".tmp") and name != f"step-{keep_step:08d}.tmp":
                shutil.rmtree(os.path.join(self.folder, name), ignore_errors=True)

    # ---- load ---------------------------------------------------------------------------------------

    @staticmethod
    def _rank_files(path: str, rank: int) -> tuple[str, str]:
        """(JSON, safetensors) of `rank`'s train state in checkpoint folder `path`."""
        stem = os.path.join(path, "train_state", f"rank-{rank:05d}")
        return stem + ".json", stem + ".safetensors"

    @staticmethod
    def _dcp_state(model, optimizer):
        """(the tensors DCP stores, the optimizer's param_groups or None). The param groups (learning rate,
        betas, parameter names) are plain values: they go to the JSON train state, so DCP holds tensors only."""
        if optimizer is None:
            return {"model": get_model_state_dict(model)}, None
        model_state, optim_state = get_state_dict(model, optimizer)
        return {"model": model_state, "optimizer": {"state": optim_state["state"]}}, optim_state["param_groups"]

    def _read_train_state(self, path: str) -> tuple[dict, bool]:
        """This rank's saved extra state (rank 0's when the checkpoint had fewer ranks), and whether it is its own."""
        json_file, tensor_file = self._rank_files(path, _rank())
        own = os.path.isfile(json_file)
        if not own:
            json_file, tensor_file = self._rank_files(path, 0)
        if not os.path.isfile(json_file):
            legacy = [os.path.join(path, "train_state", f"rank-{r:05d}.pt") for r in (_rank(), 0)]
            legacy = next((file for file in legacy if os.path.isfile(file)), None)
            if legacy is not None:
                raise CheckpointError(
                    f"{legacy} is a pickle written by an older version of this trainer; it is not loaded, because "
                    f"unpickling a file can run any code in it. Start the run over (train.py --fresh moves the run "
                    f"folder aside) or remove {self.folder}"
                )
            raise CheckpointError(f"{json_file} is missing from checkpoint {path}; remove that checkpoint folder")
        try:
            extra = load_plain(json_file, tensor_file)
        except PlainStateError as exc:
            raise CheckpointError(f"checkpoint {path}: {exc}; remove that checkpoint folder") from exc
        if not isinstance(extra, dict) or not {"train_state", "rng", "world_size"} <= extra.keys():
            raise CheckpointError(f"{json_file} is not a train state written by this trainer; remove checkpoint {path}")
        return extra, own

    def load(
        self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, lr_scheduler=None
    ) -> dict[str, Any]:
        """Load checkpoint `step` into the (already parallelised) model and optimizer in place; restore this
        rank's RNG states and the scheduler; return the saved train state.

        Nothing in the folder can run code (see the module docstring); a checkpoint that would need it
        raises CheckpointError, naming the file, before the model is touched."""
        path = self.step_path(step)
        extra, own = self._read_train_state(path)
        if not own:
            warnings.warn(
                f"{path} was saved by fewer ranks; rank {_rank()} resumes with rank 0's train state "
                "and keeps its current RNG states",
                stacklevel=2,
            )
        fresh_optimizer = None
        with open(os.path.join(path, MANIFEST)) as f:
            if not json.load(f).get("optimizer", True):
                # Saved before the first update: the optimizer starts fresh.
                fresh_optimizer, optimizer = optimizer, None
        if optimizer is not None and extra.get("optimizer_param_groups") is None:
            raise CheckpointError(
                f"{path} has optimizer state but no optimizer_param_groups in its train state; "
                f"remove that checkpoint folder"
            )
        tensors, _ = self._dcp_state(model, optimizer)
        with _single_process_quiet():
            load_tensors(tensors, path, no_dist=not dist.is_initialized())
        if optimizer is None:
            set_model_state_dict(model, tensors["model"])
        else:
            optim_state = {"state": tensors["optimizer"]["state"], "param_groups": extra["optimizer_param_groups"]}
            set_state_dict(model, optimizer, model_state_dict=tensors["model"], optim_state_dict=optim_state)

        if extra["world_size"] != _world_size():
            warnings.warn(
                f"{path} was saved with {extra['world_size']} ranks, resuming with {_world_size()}", stacklevel=2
            )
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

    def resume(
        self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, lr_scheduler=None
    ) -> dict[str, Any] | None:
        """Load the newest intact checkpoint, if any; returns its train state or None (fresh start)."""
        step = self.latest_valid_step(set_aside_damaged=True)
        if step is None:
            return None
        return self.load(step, model, optimizer, lr_scheduler)
