"""The console of a torchrun job: a line every rank prints comes out once.

Each rank counts the lines it prints; the k-th copy of a line is printed by the first rank to claim it in the
key-value store torchrun's agent hosts for the job (TORCHELASTIC_USE_AGENT_STORE, MASTER_ADDR:MASTER_PORT).
A line of one rank only is printed by it. Without that store, or once it no longer answers, every line is.
"""

from __future__ import annotations

import collections
import hashlib
import logging
import os
import sys
from datetime import timedelta
from typing import Any


class OncePerJob(logging.Filter):
    """A logging filter (and `print_line`) that lets through the copies of a line no other rank printed."""

    def __init__(self, store: Any) -> None:  # a torch.distributed Store
        super().__init__()
        self.store, self.printed = store, collections.Counter[str]()

    def first(self, line: str) -> bool:
        self.printed[line] += 1
        try:
            return int(self.store.add(f"{hashlib.sha1(line.encode()).hexdigest()}/{self.printed[line]}", 1)) == 1
        except Exception:  # the store's host is gone (DistStoreError, RuntimeError): print
            return True

    def filter(self, record: logging.LogRecord) -> bool:
        return self.first(record.getMessage())

    def print_line(self, line: str) -> None:
        if self.first(line):
            print(line, file=sys.stderr)


def once_per_job() -> OncePerJob | None:
    """Under torchrun, the job's filter on every console handler and on Python's warnings; None elsewhere."""
    env = os.environ
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    import torch.distributed as dist

    store = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), is_master=False, timeout=timedelta(seconds=30))
    job = f"dapo-console/{env.get('TORCHELASTIC_RUN_ID')}/{env.get('TORCHELASTIC_RESTART_COUNT')}/"
    once = OncePerJob(dist.PrefixStore(job, store))
    logging.captureWarnings(True)
    for handler in logging.getLogger().handlers:
        handler.addFilter(once)
    return once
