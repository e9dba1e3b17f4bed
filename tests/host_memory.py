"""This process's resident host memory (Linux /proc): now, and its high-water mark since the last reset.

`reset_peak()` first hands the memory the C allocator holds free back to the kernel (glibc's malloc_trim):
freed heap pages stay resident, and a process forked from one that freed memory (a test's ranks) inherits
them, so allocations that reuse them would not show. It then writes 5 to /proc/self/clear_refs, which sets
the high-water mark (VmHWM) to the current resident set (VmRSS); VmHWM then rises with every page the
process maps, file-backed pages included.
"""

from __future__ import annotations

import ctypes

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter (malloc.h)


def _status_bytes(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024  # the kernel reports kB
    raise KeyError(key)


def rss() -> int:
    return _status_bytes("VmRSS")


def peak() -> int:
    return _status_bytes("VmHWM")


def reset_peak() -> int:
    """Start a new high-water mark at the current resident set; returns that resident set."""
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return rss()


def return_freed_memory_at_once(threshold: int = 128 << 10) -> None:
    """Make glibc serve every allocation of `threshold` bytes or more with its own mapping, returned to the
    kernel when freed. By default the threshold adapts (up to 32 MB) to the blocks a process frees, and
    freed tensors below it stay in the heap, resident: on a CPU rank the resident set then follows the
    allocator's history, not the tensors alive. For measurements of what a process holds."""
    if not ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, threshold):
        raise OSError("mallopt(M_MMAP_THRESHOLD) failed")
