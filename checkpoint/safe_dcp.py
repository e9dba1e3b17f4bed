"""Loading a torch.distributed.checkpoint (DCP) folder without letting its files run code.

DCP (torch 2.13) reads three kinds of data, and two of them are pickles that may call any importable
function while they are read:

    .metadata        the index of the checkpoint   pickle.load (FileSystemReader.read_metadata)
    byte items       non-tensor values              torch.load(weights_only=False) (DefaultLoadPlanner.load_bytes)
    tensor items     tensor data                    torch.load(weights_only=True): torch's restricted unpickler

Here the metadata is read by an unpickler that resolves only the classes a DCP index consists of (the
approach of the Python documentation's "Restricting Globals"), every storage file it names must lie inside
the checkpoint folder, and byte items are refused: the states this project saves through DCP hold tensors
only (everything else goes to JSON, see checkpoint/plain_state.py). Tensor data keeps torch's weights-only
loading.
"""

from __future__ import annotations

import io
import os
import pickle
from typing import IO, Any, cast

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

from errors import CheckpointError


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint file asks for something a checkpoint written by this project never contains."""


# Everything a DCP index refers to (measured: pickletools over indexes of sharded and single-process saves).
_METADATA_CLASSES = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in (
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # looks a layout up by name, e.g. "torch.strided"
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
}


class _MetadataUnpickler(pickle.Unpickler):
    """Resolves only DCP's index classes and torch dtypes; anything else is refused before it is called."""

    def __init__(self, file: IO[bytes], path: str) -> None:
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str) -> object:
        if (module, name) in _METADATA_CLASSES:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise UnsafeCheckpointError(
            f"{self.path} refers to {module}.{name}, which a checkpoint's index never holds; it was not loaded "
            f"(reading it could run code). Remove this checkpoint folder unless you trust whoever wrote it"
        )


class SafeFileSystemReader(FileSystemReader):
    """FileSystemReader whose index is read by `_MetadataUnpickler` and may only name files in the folder."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:  # what DCP passes on (rank=...)
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as stream:
            f = cast(IO[bytes], stream)  # typed IOBase by DCP; opened "rb", it is a binary file
            try:
                metadata = _MetadataUnpickler(f, str(path)).load()
            except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError) as exc:
                raise UnsafeCheckpointError(f"{path} is not a checkpoint index: {type(exc).__name__}: {exc}") from exc
        if not isinstance(metadata, Metadata):
            raise UnsafeCheckpointError(f"{path} holds a {type(metadata).__name__}, not a checkpoint index")
        for info in (metadata.storage_data or {}).values():
            relative = getattr(info, "relative_path", None)
            if (
                not isinstance(relative, str)
                or not relative
                or os.path.isabs(relative)
                or relative != os.path.basename(relative)
                or relative in (".", "..")
            ):
                raise UnsafeCheckpointError(
                    f"{path} names the storage file {relative!r}, outside the checkpoint folder; it was not loaded"
                )
        storage_meta = getattr(metadata, "storage_meta", None)  # an older torch's index has no such attribute
        if storage_meta is None:
            storage_meta = metadata.storage_meta = StorageMeta()
        storage_meta.load_id = self.load_id
        return metadata


class TensorsOnlyLoadPlanner(DefaultLoadPlanner):
    """Loads tensors only: DCP reads a non-tensor ("byte") item with torch.load(weights_only=False)."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        raise UnsafeCheckpointError(
            f"the checkpoint stores {read_item.dest_index.fqn!r} as a pickled object, which this project never "
            f"writes; it was not loaded (reading it could run code). Remove this checkpoint folder unless you "
            f"trust whoever wrote it"
        )


def flatten(nested: dict, prefix: str = "") -> dict:
    """A nested dict's leaves under dotted keys ("model.layers.0.norm.weight"): DCP's flat keys of a state dict."""
    flat = {}
    for key, value in nested.items():
        if isinstance(value, dict):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _check_layout(index: Metadata, state_dict: dict, checkpoint_id: str) -> None:
    """The checkpoint's model tensors are the ones `state_dict` expects, with the same (a DTensor's: full) shapes: a
    checkpoint of another model (preset, checkpoint) is named as such instead of failing deep inside the load."""
    wanted = {key: tuple(t.shape) for key, t in flatten(state_dict).items() if isinstance(t, torch.Tensor)}
    stored = {key: tuple(item.size) for key, item in index.state_dict_metadata.items() if hasattr(item, "size")}
    advice = (
        "it was written for another model. Resume with the model the run started with (model.preset or "
        "model.hf_path in the run folder's config.json), or start over with --fresh"
    )
    for key, shape in wanted.items():
        if key in stored and stored[key] != shape:
            raise CheckpointError(
                f"{checkpoint_id} holds {key} with shape {list(stored[key])}, this run's model has "
                f"{list(shape)}: {advice}"
            )
    missing = sorted(key for key in wanted if key.startswith("model.") and key not in stored)
    extra = sorted(key for key in stored if key.startswith("model.") and key not in wanted)
    if missing or extra:
        found = f"lacks {len(missing)} of this run's model tensors (first: {missing[0]})" if missing else ""
        found += "; " if missing and extra else ""
        found += f"holds {len(extra)} tensors this run's model lacks (first: {extra[0]})" if extra else ""
        raise CheckpointError(f"{checkpoint_id} {found}: {advice}")


def load_tensors(state_dict: dict, checkpoint_id: str) -> None:
    """dcp.load of `state_dict` (tensors only) in place, with the safe reader and planner above.

    The index is checked first, so that a refusal is raised as itself: inside dcp.load a failed index read
    becomes an AssertionError message, and a failed item read one CheckpointException for every rank. So
    are its tensors' names and shapes against `state_dict`'s (CheckpointError naming the first difference)."""
    reader = SafeFileSystemReader(checkpoint_id)
    index = reader.read_metadata()
    pickled = sorted(key for key, item in index.state_dict_metadata.items() if isinstance(item, BytesStorageMetadata))
    if pickled:
        raise UnsafeCheckpointError(
            f"{checkpoint_id} stores {pickled[0]!r} as a pickled object, which this project never writes; it was "
            f"not loaded (reading it could run code). Remove this checkpoint folder unless you trust whoever wrote it"
        )
    _check_layout(index, state_dict, checkpoint_id)
    try:
        dcp.load(state_dict, storage_reader=SafeFileSystemReader(checkpoint_id), planner=TensorsOnlyLoadPlanner())
    except CheckpointException as exc:
        refused = [error for error, _ in exc.failures.values() if isinstance(error, CheckpointError)]
        if refused:
            raise refused[0] from None
        raise
