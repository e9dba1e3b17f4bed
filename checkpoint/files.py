"""The files of a checkpoint and what they are checked against: a content hash taken while each is written.

Every file of a checkpoint is hashed from the bytes handed to the operating system as it is written (DCP's
tensor files and index through `HashingFileSystem`, the train state through `write_file`), not by reading
it back: the hash records what the trainer meant to store. Before one is loaded, every file is read and compared
(`verify`). Damage of any kind (bytes overwritten in place, a truncated or missing file, a changed index) is the
same finding: a file whose bytes or size differ from its record.

The hash is XXH3-128 (the `xxhash` package): not cryptographic, since it guards against damage, not an
attacker (loading runs no code from the folder in any case, see checkpoint/safe_dcp.py), and far faster than
the disk: about 15 GB/s on one core against ~0.4 GB/s for BLAKE2b on the same machine (bench/RESULTS.md).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import functools
import hashlib
import io
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import xxhash
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem

from model.hf_adapter import CONFIG_NAME, is_model_file

if TYPE_CHECKING:
    from _typeshed import ReadableBuffer

HASH_NAME = "xxh3_128"
_WRITE_BUFFER = 1 << 20
# A full disk (or quota): the save can never succeed there until space is freed.
NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


@dataclasses.dataclass(frozen=True)
class FileRecord:
    """A file's size and content hash."""

    size: int
    digest: str

    def to_json(self) -> dict:
        return {"bytes": self.size, HASH_NAME: self.digest}

    @staticmethod
    def from_json(value: Any) -> FileRecord:  # a manifest's JSON value: {"bytes", hash}
        return FileRecord(int(value["bytes"]), str(value[HASH_NAME]))


class WrittenFiles:
    """The files this process wrote under `root`: relative name -> FileRecord, and the first OSError a write
    met (DCP's tensor writer turns a failed write into its own zip-writer error, so the cause is kept here)."""

    def __init__(self, root: str) -> None:
        self.root = os.path.abspath(root)
        self.records: dict[str, FileRecord] = {}
        self.failure: OSError | None = None

    def name(self, path: str | os.PathLike) -> str:
        return os.path.relpath(os.path.abspath(path), self.root)


class _HashingFile(io.FileIO):
    """A file opened for writing that hashes every byte the operating system accepted."""

    def __init__(self, path: str | os.PathLike, written: WrittenFiles) -> None:
        super().__init__(path, "wb")
        self._written, self._hash, self._size = written, xxhash.xxh3_128(), 0

    def write(self, data: ReadableBuffer) -> int:
        try:
            count = super().write(data)
        except OSError as exc:
            self._written.failure = self._written.failure or exc  # the first one
            raise
        if count:
            self._hash.update(memoryview(data).cast("B")[:count])
            self._size += count
        return count

    def close(self) -> None:
        if self.closed:
            return
        try:
            super().close()  # some file systems (NFS) report a full disk only here
        except OSError as exc:
            self._written.failure = self._written.failure or exc  # the first one
            raise
        if self._written.failure is None:
            self._written.records[self._written.name(self.name)] = FileRecord(self._size, self._hash.hexdigest())


def _hashing_stream(path: str | os.PathLike, written: WrittenFiles) -> io.BufferedWriter[_HashingFile]:
    return io.BufferedWriter(_HashingFile(path, written), buffer_size=_WRITE_BUFFER)


class HashingFileSystem(FileSystem):
    """DCP's local file system, with every file it writes hashed into `written` (renames followed)."""

    def __init__(self, written: WrittenFiles) -> None:
        super().__init__()
        self.written = written

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[io.IOBase]:
        opened = _hashing_stream(path, self.written) if "w" in mode else super().create_stream(path, mode)
        with opened as stream:
            yield stream

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        super().rename(path, new_path)
        record = self.written.records.pop(self.written.name(path), None)
        if record is not None:
            self.written.records[self.written.name(new_path)] = record


def hashing_writer(path: str, written: WrittenFiles) -> FileSystemWriter:
    """DCP's FileSystemWriter (one file per rank, each fsynced) whose files are hashed into `written`."""
    writer = FileSystemWriter(path, sync_files=True)
    writer.fs = HashingFileSystem(written)
    return writer


def write_file(path: str, data: bytes, written: WrittenFiles) -> None:
    """Write `data` to `path`, fsynced, with its record in `written`."""
    with _hashing_stream(path, written) as stream:
        stream.write(data)
        stream.flush()
        os.fsync(stream.fileno())


def file_record(path: str) -> FileRecord:
    """The size and hash of the file at `path`, read from the start."""
    with open(path, "rb", buffering=0) as f:
        digest = hashlib.file_digest(f, xxhash.xxh3_128)
        return FileRecord(f.tell(), digest.hexdigest())


def base_files(path: str) -> list[str]:
    """The files of an HF checkpoint folder that make its weights: config.json and the weight files and index."""
    return sorted(n for n in os.listdir(path) if n == CONFIG_NAME or is_model_file(n))


def folder_digest(path: str, names: list[str]) -> str:
    """One content hash of the files `names` of folder `path`: XXH3-128 over each one's name, size and hash. Read
    once per process while no file's size or modification time changes (a run checkpoints many times)."""
    stats = [(name, os.stat(os.path.join(path, name))) for name in names]
    return _folder_digest(os.path.abspath(path), tuple((n, s.st_size, s.st_mtime_ns) for n, s in stats))


@functools.lru_cache(maxsize=4)
def _folder_digest(path: str, stats: tuple[tuple[str, int, int], ...]) -> str:
    combined = xxhash.xxh3_128()
    for name, _, _ in stats:
        record = file_record(os.path.join(path, name))
        combined.update(f"{name} {record.size} {record.digest}\n".encode())
    return combined.hexdigest()


def verify(root: str, expected: dict[str, FileRecord]) -> str | None:
    """None if every file in `expected` reads back as recorded, else the first problem (names sorted)."""
    for name in sorted(expected):
        path, record = os.path.join(root, name), expected[name]
        if not os.path.isfile(path):
            return f"file {name} is missing"
        size = os.path.getsize(path)
        if size != record.size:
            return f"file {name} has {size} bytes, the manifest says {record.size} (truncated or overwritten)"
        if file_record(path).digest != record.digest:
            return f"file {name} does not match its content hash (its bytes changed after it was written)"
    return None


def describe_file_system(path: str) -> str:
    """The device holding `path` and where it is mounted, e.g. "/dev/vda1 (mounted at /data)"."""
    target = os.path.realpath(path)
    best = None
    try:
        with open("/proc/self/mounts", encoding="utf-8", errors="replace") as f:
            for line in f:
                fields = line.split()
                if len(fields) < 2:
                    continue
                source, mount = fields[0], fields[1].replace("\\040", " ")
                inside = target == mount or target.startswith(mount.rstrip("/") + "/")
                if inside and (best is None or len(mount) > len(best[1])):
                    best = (source, mount)
    except OSError:
        pass
    return f"{best[0]} (mounted at {best[1]})" if best is not None else f"the file system of {target}"
