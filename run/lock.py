"""One run per run folder: an exclusive lock held by the run's main process for as long as it runs.

The lock is `fcntl.flock` on `<run folder>/.lock`. The kernel releases it when the holding process ends,
however it ends (exit, crash, SIGKILL), so a lock is never stale: a run whose holder is gone takes the folder
over at once, and one whose holder is alive is refused, with the pid, host and start time the holder wrote
into the file. A pid written there only names the holder; it is never used to decide, so a reused pid cannot
keep a folder locked. On NFS, Linux implements flock with the server's byte-range locks, so two machines
sharing the folder exclude each other too; a file system without locks (flock fails with ENOLCK or
EOPNOTSUPP) runs unlocked, with a warning.

Only the main rank (rank 0) of a job takes the lock: the other ranks of the same job work in the folder it
holds, and a second job on the folder is refused on its own rank 0.
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import json
import logging
import os
import socket

from errors import RunFolderError

log = logging.getLogger("train")

LOCK_FILE = ".lock"
_UNSUPPORTED = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}


class FolderBusyError(RunFolderError):
    """Another live process holds the folder's lock."""


class FolderLock:
    """An exclusive lock on `folder` (created if missing), held from `acquire` until `release` or exit."""

    def __init__(self, folder: str):
        self.folder = os.path.abspath(folder)
        self.path = os.path.join(self.folder, LOCK_FILE)
        self._fd: int | None = None

    def acquire(self) -> None:
        """Lock the folder now at `folder` (raises FolderBusyError naming the holder). Called again after the
        folder was moved away and another created in its place, it locks the new one, then lets the old go."""
        if self._fd is not None and _same_file(self._fd, self.path):
            return
        os.makedirs(self.folder, exist_ok=True)
        for _ in range(10):  # the lock file may be replaced between open and flock: lock the one at the path
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read_holder(fd)
                os.close(fd)
                raise FolderBusyError(
                    f"run folder {self.folder} is in use by another run ({holder}; lock file {self.path}): two "
                    f"runs in one folder would overwrite each other's checkpoints and metrics. Wait for it to end "
                    f"or stop it, or give this run another job.name or job.run_dir"
                ) from None
            except OSError as exc:
                os.close(fd)
                if exc.errno not in _UNSUPPORTED:
                    raise
                log.warning(
                    "the file system of %s cannot lock files (%s): nothing stops a second run from using this "
                    "folder at the same time",
                    self.folder,
                    exc.strerror,
                )
                return
            if _same_file(fd, self.path):
                break
            os.close(fd)  # locked a file that was moved or replaced meanwhile
        else:
            raise FolderBusyError(f"run folder {self.folder}: its lock file keeps being replaced by another process")
        self.release()  # the lock of the folder that was here before (moved aside by --fresh)
        self._fd = fd
        # Who holds it, for the message of a run refused here (_read_holder).
        started = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
        data = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": started}).encode()
        os.ftruncate(fd, 0)
        os.pwrite(fd, data, 0)

    def release(self) -> None:
        """Let the folder go (the lock file stays: removing it could let two runs lock two different files)."""
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)  # closing the last descriptor releases the flock

    def __enter__(self) -> FolderLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _same_file(fd: int, path: str) -> bool:
    try:
        return os.path.samestat(os.fstat(fd), os.stat(path))
    except OSError:
        return False


def _read_holder(fd: int) -> str:
    """The holder as its lock file describes it, e.g. "pid 4242 on host gpu-3, started 2025-06-01 12:00:00 UTC"."""
    try:
        holder = json.loads(os.pread(fd, 4096, 0).decode())
        return f"pid {holder['pid']} on host {holder['host']}, started {holder['started']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "a process that has not written its details yet"
