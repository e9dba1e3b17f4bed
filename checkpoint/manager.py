"""Training checkpoints with torch.distributed.checkpoint (DCP): verified, atomic, pruned, resumed automatically.

Layout of `folder`:

    step-00000120/                  a complete checkpoint
        .metadata, __0_0.distcp...  DCP: model parameters and optimizer state tensors, each rank writing
                                    its own shards
        train_state/rank-00000.json     per rank, as plain data (checkpoint/plain_state.py): step, tokens,
        train_state/rank-00000.safetensors  data position, carried-over rollout groups, LR scheduler, the
                                    optimizer's hyperparameters, RNG states (torch CPU/CUDA, Python, NumPy)
        COMPLETE.json               manifest: every file's size and content hash (XXH3-128, taken from the
                                    bytes as they were written: checkpoint/files.py); written last
    step-00000140.tmp/              being written (or left by a crash): never loaded, removed later

Saving: a policy or optimizer state with NaN or infinite values is refused before anything is written
(NonFiniteStateError). All ranks write into `step-N.tmp`, hashing the bytes the operating system accepted, and
fsync each file; only when every rank's files are written does rank 0 write the manifest and rename the folder
to `step-N` (one rename, atomic on POSIX file systems), and only then are older checkpoints pruned (the latest
`keep` are kept; 0: all). The files are not read back after the write: right after an fsync a read is served
by the page cache, so it would compare the write-time hash with itself at the cost of every byte again (393 GB
for the 32B recipe); what protects a run is that every write error fails the save and the check below, before
anything is loaded. A save that fails (a full disk, an unwritable folder) removes its partial folder and raises
CheckpointSaveError on every rank, naming the cause; the previous checkpoints are untouched.

Resuming: before anything is loaded, every file of the newest checkpoint is read and checked against the
manifest (the files divided among the ranks). A damaged checkpoint (no manifest or one of sizes only, a missing,
truncated or changed file, or files that load NaN or inf, the manifest rewritten to match) is skipped with one
log line naming the step and the file or tensor, and the next older intact one is used; the skipped ones are
renamed `step-N.damaged` (kept for inspection), so the run's own later checkpoints are neither shadowed nor
pruned by them. When checkpoints exist but none is intact, the run is refused (CheckpointError): nothing is
moved, and nothing starts over silently.

Loading runs no code from the folder: the train state is JSON and safetensors, and DCP is read by
checkpoint/safe_dcp.py (its index through a restricted unpickler, tensors only). Checkpoints of the older
layout, whose train state was a pickle (`train_state/rank-N.pt`), are refused, not unpickled.

Works with and without a process group: single-process training saves the same layout.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import re
import shutil
import warnings
from collections.abc import Callable, Iterator
from typing import Any, TypeVar, cast

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.optim.lr_scheduler import LRScheduler

from checkpoint.files import (
    HASH_NAME,
    NO_SPACE,
    FileRecord,
    WrittenFiles,
    base_files,
    describe_file_system,
    folder_digest,
    hashing_writer,
    verify,
)
from checkpoint.optimizer_settings import configured_settings, restore_configured
from checkpoint.plain_state import PlainStateError, encode, load_plain, save_plain
from checkpoint.safe_dcp import load_tensors
from errors import CheckpointError, first_os_error
from parallel.finite import NonFiniteStateError, nonfinite_state
from parallel.fsdp import reshard_gathered
from parallel.lora import adapters_of

log = logging.getLogger(__name__)

MANIFEST = "COMPLETE.json"
_STEP_DIR = re.compile(r"step-(\d{8})\Z")
_T = TypeVar("_T")


class CheckpointSaveError(CheckpointError):
    """A checkpoint could not be written (full disk, unwritable folder);
    its partial folder was removed and the earlier checkpoints are intact."""


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _all_gather(value: _T) -> list[_T]:
    """`value` of every rank, in rank order."""
    if not dist.is_initialized():
        return [value]
    out: list[_T | None] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return cast("list[_T]", out)  # every slot now holds a rank's value


@contextlib.contextmanager
def _single_process_quiet() -> Iterator[None]:
    """Without a process group DCP warns that it "assumes" single-process mode; that is intended here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def _rng_state() -> dict[str, Any]:
    """This process's RNG states as plain data (checkpoint/plain_state.py)."""
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    legacy = np.random.get_state(legacy=True)
    assert isinstance(legacy, tuple)  # the global MT19937 generator's legacy state is a 5-tuple
    algorithm, keys, *position = legacy  # position: pos, has_gauss, cached_gaussian, Python numbers already
    state["numpy"] = (algorithm, torch.from_numpy(keys.astype(np.int64)), *position)
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    if "numpy" in state:
        algorithm, keys, pos, has_gauss, cached_gaussian = state["numpy"]
        np.random.set_state((algorithm, keys.numpy().astype(np.uint32), pos, has_gauss, cached_gaussian))


# LoRA: the adapters are the state (DCP reads exactly the keys asked for, so a missing one is still an error)
_ADAPTERS_ONLY = StateDictOptions(ignore_frozen_params=True, strict=False)


def _state_options(model: nn.Module) -> StateDictOptions | None:
    """How the model's state dict is taken and set: its adapters only with LoRA, else whole (torch's defaults)."""
    return _ADAPTERS_ONLY if adapters_of(model) is not None else None


def base_identity(model: nn.Module) -> dict[str, str] | None:
    """The base a LoRA model's adapters train on, as its checkpoints record it: its path and one content hash of
    its config.json and weight files (files.py `folder_digest`); None for a model trained whole. Rank 0 hashes."""
    adapters = adapters_of(model)
    if adapters is None:
        return None
    digest = _all_gather(folder_digest(adapters.base, base_files(adapters.base)) if _rank() == 0 else "")[0]
    return {"path": adapters.base, HASH_NAME: digest}


def check_base(path: str, saved: dict | None, model: nn.Module) -> None:
    """Refuse (CheckpointError, every rank) checkpoint `path` whose kind differs from the run's (adapters only, or the
    whole policy), or whose adapters were trained on a base with other content than model.hf_path's now."""
    now = base_identity(model)
    if (saved is None) != (now is None):
        held = "LoRA adapters" if saved else "the whole policy"
        raise CheckpointError(
            f"checkpoint {path} holds {held}, and this run trains {'LoRA adapters' if now else 'the whole policy'}: "
            f"set lora.enabled = {str(bool(saved)).lower()} to resume it, or start over with --fresh"
        )
    if saved is not None and now is not None and saved.get(HASH_NAME) != now[HASH_NAME]:
        raise CheckpointError(
            f"checkpoint {path} holds LoRA adapters trained on the base {saved.get('path')} (content "
            f"{str(saved.get(HASH_NAME))[:12]}...), and model.hf_path = {now['path']} holds other weights "
            f"({now[HASH_NAME][:12]}...): resume with that base, or start over with --fresh"
        )


def _unused_name(path: str) -> str:
    """`path`, or `path.1`, `path.2`, ... : the first that does not exist."""
    candidate, n = path, 0
    while os.path.exists(candidate):
        n += 1
        candidate = f"{path}.{n}"
    return candidate


def _failure_report(failure: BaseException | None, written: WrittenFiles | None) -> tuple[str, str] | None:
    """What a rank tells the others about its part of a save: None (done), or (kind, detail) with kind
    "no_space", "os" (another OSError) or "other" (a bug)."""
    if failure is None:
        return None
    os_error = (written.failure if written is not None else None) or first_os_error(failure)
    if os_error is not None:
        where = f": {os_error.filename}" if os_error.filename else ""
        return ("no_space" if os_error.errno in NO_SPACE else "os"), f"{os_error.strerror or os_error}{where}"
    return "other", f"{type(failure).__name__}: {failure}"


class CheckpointManager:
    """Save and resume (model, optimizer, LR scheduler, train state) under `folder`, keeping the latest `keep`."""

    def __init__(self, folder: str, keep: int = 3):
        if keep < 0:
            raise ValueError(f"keep must be >= 0 (0 keeps every checkpoint), got {keep}")
        self.folder = folder
        self.keep = keep

    def step_path(self, step: int) -> str:
        """The folder of checkpoint `step` (it may not exist)."""
        return os.path.join(self.folder, f"step-{step:08d}")

    def complete_steps(self) -> list[int]:
        """Steps with a renamed (committed) checkpoint folder, oldest first (validity not checked)."""
        if not os.path.isdir(self.folder):
            return []
        steps = [int(m.group(1)) for m in map(_STEP_DIR.match, os.listdir(self.folder)) if m]
        return sorted(steps)

    def validate(self, step: int, share: tuple[int, int] = (0, 1)) -> str | None:
        """None if checkpoint `step` is intact (its manifest readable, and every file of it, or of the
        `share` = (k, n) that is every n-th file from the k-th, with the size and content hash recorded),
        else why not."""
        path = os.path.join(self.step_path(step), MANIFEST)
        if not os.path.isfile(path):
            return f"no {MANIFEST} (an interrupted save)"
        try:
            with open(path, encoding="utf-8") as f:
                records = json.load(f)["files"]
            if any(isinstance(value, int) for value in records.values()):
                sizes_only = f"{MANIFEST} records file sizes only (an older version wrote it)"
                return f"{sizes_only}: its files cannot be verified"
            files = {str(name): FileRecord.from_json(value) for name, value in records.items()}
        except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as e:
            return f"unreadable {MANIFEST}: {type(e).__name__}: {e}"
        names = sorted(files)[share[0] :: share[1]]
        return verify(self.step_path(step), {name: files[name] for name in names})

    def _verdicts(self) -> Iterator[tuple[int, str | None]]:
        """(step, why its files are damaged or None) of each checkpoint, newest first. Every rank checks its share
        of each checkpoint's files; collective (every rank must take the same number of verdicts)."""
        for step in reversed(_all_gather(self.complete_steps())[0]):  # rank 0's listing
            problems = _all_gather(self.validate(step, (_rank(), _world_size())))
            yield step, next((p for p in problems if p is not None), None)

    def _name(self, step: int) -> str:
        return os.path.basename(self.step_path(step))

    def _previous(self) -> str:
        """What a failed save leaves: the newest committed checkpoint, untouched."""
        steps = self.complete_steps()
        if not steps:
            return "no earlier checkpoint exists in it"
        return f"the previous checkpoint (step {steps[-1]}, {self.step_path(steps[-1])}) is intact"

    def save(
        self,
        step: int,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        lr_scheduler: LRScheduler | None = None,
        train_state: dict[str, Any] | None = None,
    ) -> str:
        """Write checkpoint `step` atomically on every rank, verified before it counts; returns its folder.

        train_state: this rank's values as plain data (checkpoint/plain_state.py: str-keyed dicts, lists,
        tuples, numbers, strings, tensors), e.g. step, tokens, data position, carried-over rollout groups;
        RNG states are added automatically. Anything else raises PlainStateError before anything is written,
        and so do NaN or infinite weights or optimizer state (NonFiniteStateError). A save that fails raises
        CheckpointSaveError on every rank (see the module docstring).
        """
        # An optimizer that never stepped has no state; asking DCP for it would initialise it with a
        # zero-lr step (Adam's step count becomes 1), so a resumed run's first update would differ.
        with_optimizer = optimizer is not None and len(optimizer.state) > 0
        reshard_gathered(model)  # the fp32 master shards, not copies gathered by a forward without backward
        problem = nonfinite_state(model, optimizer if with_optimizer else None)
        if problem is not None:
            raise NonFiniteStateError(f"step {step}: {problem}; it was not checkpointed ({self._previous()})")
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
        written = WrittenFiles(tmp)
        self._save_phase(step, tmp, lambda: self._make_folder(tmp), main_only=True)
        records = self._save_phase(step, tmp, lambda: self._write(tmp, tensors, extra, written), written)
        # Every rank ran the write, so no entry is None.
        files = {name: record for rank_records in records if rank_records for name, record in rank_records.items()}
        base = base_identity(model)  # every rank: rank 0 hashes, the others wait
        self._save_phase(step, tmp, lambda: self._commit(step, tmp, files, with_optimizer, base), main_only=True)
        return final

    def _save_phase(
        self,
        step: int,
        tmp: str,
        action: Callable[[], _T],
        written: WrittenFiles | None = None,
        main_only: bool = False,
    ) -> list[_T | None]:
        """Run `action` on every rank (on rank 0 only with main_only); returns what it returned on each rank.
        A failure on any rank is raised on every rank, after rank 0 removed the partial folder `tmp`: no rank
        is left waiting for the others, and the error names the cause (a bug keeps its own traceback).
        (With main_only, the other ranks' entry is None.)"""
        result: _T | None = None
        failure: BaseException | None = None
        if not main_only or _rank() == 0:
            try:
                result = action()
            except (Exception, CheckpointException) as exc:  # DCP's CheckpointException is a BaseException
                failure = exc
        report = _failure_report(failure, written)
        reports = _all_gather((report, result))
        first = next((r for r, _ in reports if r is not None), None)
        if first is None:
            return [r for _, r in reports]
        if _rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        _barrier()  # the partial folder is gone before any rank reports
        if failure is not None and report is not None and report[0] == "other":
            raise failure
        kind, detail = first
        previous = self._previous()
        raise CheckpointSaveError(
            {
                "no_space": f"no space left on {describe_file_system(self.folder)} while saving step {step} "
                f"({detail}); {previous}. Free some space (or keep fewer checkpoints: checkpoint.keep_latest_k) "
                f"and run the same command again to resume",
                "os": f"cannot write checkpoint step {step} to {self.folder} ({detail}); {previous}",
                "other": f"saving checkpoint step {step} failed on another rank ({detail}); {previous}",
            }[kind]
        ) from failure

    @staticmethod
    def _make_folder(tmp: str) -> None:
        if os.path.exists(tmp):  # left by an interrupted save of the same step
            shutil.rmtree(tmp)
        os.makedirs(os.path.join(tmp, "train_state"))

    def _write(
        self, tmp: str, tensors: dict[str, Any], extra: dict[str, Any], written: WrittenFiles
    ) -> dict[str, FileRecord]:
        """This rank's files (DCP shards, its train state; rank 0 also DCP's index), hashed as they are written
        and fsynced; returns their records."""
        with _single_process_quiet():
            dcp.save(tensors, storage_writer=hashing_writer(tmp, written))
        save_plain(extra, *self._rank_files(tmp, _rank()), written)
        return written.records

    def _commit(
        self, step: int, tmp: str, files: dict[str, FileRecord], with_optimizer: bool, base: dict | None
    ) -> None:
        """Rank 0, once every rank's files are written: the manifest, the rename, then the prune. `base`: the identity
        of the base that LoRA adapters were trained on (`base_identity`; None: the checkpoint holds the policy)."""
        manifest = {
            "step": step,
            "world_size": _world_size(),
            "optimizer": with_optimizer,
            "hash": HASH_NAME,
            "files": {name: files[name].to_json() for name in sorted(files)},
            **({"base": base} if base is not None else {}),
        }
        with open(os.path.join(tmp, MANIFEST), "w", encoding="utf-8") as f:
            json.dump(manifest, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        final = self.step_path(step)
        old = None
        if os.path.exists(final):  # re-saving a step replaces it; a directory cannot be replaced in one rename
            old = _unused_name(final + ".old")
            os.replace(final, old)
        os.replace(tmp, final)
        fd = os.open(self.folder, os.O_RDONLY)  # the rename itself is durable once its folder is fsynced
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        self._prune(keep_step=step)  # only now: the new checkpoint is written, fsynced and committed

    def _prune(self, keep_step: int) -> None:
        if self.keep:  # 0: keep every checkpoint
            for step in self.complete_steps()[: -self.keep]:
                shutil.rmtree(self.step_path(step), ignore_errors=True)
        for name in os.listdir(self.folder):  # folders of interrupted saves
            if name.endswith(".tmp") and name != f"step-{keep_step:08d}.tmp":
                shutil.rmtree(os.path.join(self.folder, name), ignore_errors=True)

    @staticmethod
    def _rank_files(path: str, rank: int) -> tuple[str, str]:
        """(JSON, safetensors) of `rank`'s train state in checkpoint folder `path`."""
        stem = os.path.join(path, "train_state", f"rank-{rank:05d}")
        return stem + ".json", stem + ".safetensors"

    @staticmethod
    def _dcp_state(
        model: nn.Module, optimizer: torch.optim.Optimizer | None
    ) -> tuple[dict[str, Any], list[dict[str, Any]] | None]:  # DCP's state dict: nested dicts of tensors
        """(the tensors DCP stores, the optimizer's param_groups or None). The param groups (learning rate,
        betas, parameter names) are plain values: they go to the JSON train state, so DCP holds tensors only.
        With LoRA the trained parameters are the adapters: the frozen base is not stored (it is model.hf_path)."""
        options = _state_options(model)
        if optimizer is None:
            return {"model": get_model_state_dict(model, options=options)}, None
        model_state, optim_state = get_state_dict(model, optimizer, options=options)
        param_groups = cast("list[dict[str, Any]]", optim_state["param_groups"])  # torch types every entry alike
        return {"model": model_state, "optimizer": {"state": optim_state["state"]}}, param_groups

    @staticmethod
    def _set_state(
        model: nn.Module, optimizer: torch.optim.Optimizer | None, tensors: dict[str, Any], param_groups: Any
    ) -> None:
        """The tensors DCP loaded into the model, and into the optimizer with its param groups (the JSON train
        state's); with LoRA, the adapters and their moments only."""
        options = _state_options(model)
        if optimizer is None:
            set_model_state_dict(model, tensors["model"], options=options)
            return
        optim_state = {"state": tensors["optimizer"]["state"], "param_groups": param_groups}
        set_state_dict(
            model, optimizer, model_state_dict=tensors["model"], optim_state_dict=optim_state, options=options
        )

    def _read_train_state(self, path: str) -> tuple[dict[str, Any], bool]:
        """This rank's saved extra state (rank 0's when the checkpoint had fewer ranks), and whether it is its own."""
        json_file, tensor_file = self._rank_files(path, _rank())
        own = os.path.isfile(json_file)
        if not own:
            json_file, tensor_file = self._rank_files(path, 0)
        if not os.path.isfile(json_file):
            pickles = [os.path.join(path, "train_state", f"rank-{r:05d}.pt") for r in (_rank(), 0)]
            legacy = next((file for file in pickles if os.path.isfile(file)), None)
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
        self,
        step: int,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        lr_scheduler: LRScheduler | None = None,
    ) -> dict[str, Any]:
        """Load checkpoint `step` into the (already parallelised) model and optimizer in place; restore this
        rank's RNG states and the scheduler's position; return the saved train state. The optimizer's configured
        hyperparameters (lr, betas, weight decay, ...) win over the checkpoint's (checkpoint/optimizer_settings.py).

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
        target = optimizer  # takes the configured settings, also when it starts fresh
        with open(os.path.join(path, MANIFEST)) as f:
            manifest = json.load(f)
        check_base(path, manifest.get("base"), model)
        if not manifest.get("optimizer", True):
            optimizer = None  # saved before the first update: the optimizer starts fresh
        if optimizer is not None and extra.get("optimizer_param_groups") is None:
            raise CheckpointError(
                f"{path} has optimizer state but no optimizer_param_groups in its train state; "
                f"remove that checkpoint folder"
            )
        settings = configured_settings(target, lr_scheduler) if target is not None else {}
        tensors, _ = self._dcp_state(model, optimizer)
        with _single_process_quiet():
            load_tensors(tensors, path)
        self._set_state(model, optimizer, tensors, extra.get("optimizer_param_groups"))
        if extra["world_size"] != _world_size():
            warnings.warn(
                f"{path} was saved with {extra['world_size']} ranks, resuming with {_world_size()}", stacklevel=2
            )
        if own:
            _set_rng_state(extra["rng"])
        if target is not None:  # the configured hyperparameters, at the schedule's saved position
            changed = restore_configured(settings, target, lr_scheduler, extra["lr_scheduler"])
            if changed and _rank() == 0:
                log.warning(
                    "checkpoint %s was made with other optimizer settings; training with the configured ones: %s",
                    path,
                    changed,
                )
        elif lr_scheduler is not None and extra["lr_scheduler"] is not None:
            lr_scheduler.load_state_dict(extra["lr_scheduler"])
        return extra["train_state"]

    def resume(
        self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, lr_scheduler: LRScheduler | None = None
    ) -> dict[str, Any] | None:
        """Load the newest intact checkpoint, if any; returns its train state or None (no checkpoint at all).

        Intact: its files match the manifest (checked before loading) and what it loads is finite (checked after:
        NaN or inf written over its bytes with the manifest rewritten to match is damage too). Newer damaged ones
        are renamed `step-N.damaged`, each with one log line naming the file or tensor. When checkpoints exist but
        none is intact, CheckpointError (nothing is moved): starting over would throw away the run's work
        without a question."""
        damaged: list[tuple[int, str]] = []
        for step, problem in self._verdicts():
            if problem is None:
                saved = self.load(step, model, optimizer, lr_scheduler)
                problem = nonfinite_state(model, optimizer)  # collective (parallel/finite.py)
                if problem is None:
                    self._set_aside(damaged, step)
                    return saved
                if optimizer is not None:  # dropped: an older checkpoint saved before any update must not inherit it
                    optimizer.state.clear()
                problem = f"it loads with NaN or inf: {problem}"
            damaged.append((step, problem))
        if damaged:
            newest, problem = damaged[0]
            older = f" (and the {len(damaged) - 1} older ones are damaged too)" if len(damaged) > 1 else ""
            raise CheckpointError(
                f"no intact checkpoint to resume from in {self.folder}: {self._name(newest)} is damaged "
                f"({problem}){older}. Nothing was moved or deleted; restore the damaged files, or start over "
                f"with --fresh (the run folder is moved aside)"
            )
        return None

    def _set_aside(self, damaged: list[tuple[int, str]], intact: int) -> None:
        """Rename the damaged checkpoints newer than `intact` to `step-N.damaged`, one log line each (rank 0)."""
        if _rank() == 0:
            for bad, problem in damaged:
                aside = _unused_name(self.step_path(bad) + ".damaged")
                os.replace(self.step_path(bad), aside)
                log.warning(
                    "checkpoint %s is damaged (%s); resuming from %s instead; the damaged one is kept as %s",
                    self.step_path(bad),
                    problem,
                    self._name(intact),
                    os.path.basename(aside),
                )
        _barrier()
