"""Per-step metrics: one JSON line per `log` call in run_dir/metrics.jsonl, optionally TensorBoard too.

A line is `{"step": <int>, "<key>": <number or null>, ...}`. Values are ints or floats; bools become
0/1, 0-d tensors and numpy scalars their Python number, and NaN / +-inf become null (JSON has no
such numbers) so that every line is strict JSON any tool can read. The file is opened in append
mode and each line is one unbuffered write: a crashed or resumed run keeps what it logged, a plot can
read the file while the run writes it, and a write that fails (a full disk) is cut off again, so no
half line stays (a WriteError, errors.py). After a resume from an earlier checkpoint, `truncate_after`
drops the lines of steps that will be redone.

TensorBoard (optional): the same values go to a `SummaryWriter` in run_dir/tensorboard/ with the
JSONL keys as tags (NaN and inf as they are; TensorBoard shows them). Only rank 0 writes anything.
"""

from __future__ import annotations

import contextlib
import json
import math
import numbers
import os
from io import FileIO
from typing import TYPE_CHECKING

from errors import write_atomically, writing

if TYPE_CHECKING:
    from torch.utils.tensorboard import SummaryWriter


class MetricsLogger:
    """Append per-step metrics to run_dir/metrics.jsonl (and TensorBoard); a no-op on rank != 0."""

    FILENAME = "metrics.jsonl"

    def __init__(self, run_dir: str, *, tensorboard: bool = False, rank: int = 0, resume_after: int | None = None):
        """resume_after: a run resumed after this step drops what it logged for later steps, in the JSONL
        (`truncate_after`) and in TensorBoard (events from step resume_after + 1 on are purged); -1
        drops everything."""
        self.path = os.path.join(run_dir, self.FILENAME)
        self.active = rank == 0
        self._file: FileIO | None = None
        self._writer: SummaryWriter | None = None
        if not self.active:
            return
        os.makedirs(run_dir, exist_ok=True)
        self._file = open(self.path, "ab", buffering=0)
        if resume_after is not None:
            self.truncate_after(resume_after)
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            purge = None if resume_after is None else max(resume_after + 1, 0)
            self._writer = SummaryWriter(log_dir=os.path.join(run_dir, "tensorboard"), purge_step=purge)

    def log(self, step: int, metrics: dict) -> None:
        """Write one line: `step` and every metric (see the module docstring for value conversion)."""
        if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 0:
            raise ValueError(f"metrics step must be an int >= 0, got {step!r}")
        if "step" in metrics:
            raise ValueError("metrics must not contain the key 'step' (it is the separate step argument)")
        row = {"step": int(step)}
        raw = {}
        for key, value in metrics.items():
            if not isinstance(key, str) or not key:
                raise ValueError(f"metric names must be non-empty strings, got {key!r}")
            raw[key] = _number(key, value)
            row[key] = raw[key] if raw[key] is None or math.isfinite(raw[key]) else None
        if not self.active:
            return
        if self._file is None:
            raise RuntimeError(f"MetricsLogger for {self.path} is closed")
        self._append(json.dumps(row, allow_nan=False) + "\n")
        if self._writer is not None:
            for key, value in raw.items():
                if value is not None:
                    self._writer.add_scalar(key, value, global_step=int(step))
            self._writer.flush()

    def _append(self, line: str) -> None:
        """Append `line` whole, or cut a partial write off again and raise WriteError."""
        assert self._file is not None
        data, start = line.encode(), self._file.seek(0, os.SEEK_END)
        with writing(self.path):
            try:
                done = 0
                while done < len(data):
                    done += self._file.write(data[done:]) or 0
            except OSError:
                with contextlib.suppress(OSError):
                    os.ftruncate(self._file.fileno(), start)
                raise

    def truncate_after(self, step: int) -> int:
        """Drop the lines of steps > `step` (they will be logged again after a resume); returns how many."""
        if not self.active:
            return 0
        if self._file is None:
            raise RuntimeError(f"MetricsLogger for {self.path} is closed")
        rows = read_metrics(self.path)
        kept = [row for row in rows if row["step"] <= step]
        with open(self.path, "rb") as f:
            text = f.read()
        if len(kept) != len(rows) or text and not text.endswith(b"\n"):
            # Rewritten also when a killed run left a partial last line: the next line would be glued to it.
            self._file.close()
            write_atomically(self.path, "".join(json.dumps(row, allow_nan=False) + "\n" for row in kept))
            self._file = open(self.path, "ab", buffering=0)
        return len(rows) - len(kept)

    def logged(self, step: int, key: str) -> bool:
        """Whether the file holds a line of `step` with `key` (False on ranks that write none)."""
        return self.active and any(row["step"] == step and key in row for row in read_metrics(self.path))

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _number(key: str, value: object) -> float | int | None:
    if value is None:
        return None
    if hasattr(value, "item") and getattr(value, "ndim", 0) == 0:  # 0-d torch tensor / numpy scalar
        value = value.item()
    if isinstance(value, numbers.Integral):  # bools too: 0/1
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    raise TypeError(f"metric {key!r} must be a number, got {type(value).__name__} {value!r:.60}")


def read_metrics(path: str) -> list[dict]:
    """Every line of a metrics.jsonl file as a dict, in file order; errors name the file and line."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no metrics file at {path}")
    rows = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                # A run killed mid-write can leave a partial last line; anywhere else it is corruption.
                if not line.endswith("\n"):
                    break
                raise ValueError(f"{path}:{number}: not a JSON line ({exc.msg})") from None
            if not isinstance(row, dict) or not isinstance(row.get("step"), int):
                raise ValueError(f"{path}:{number}: a metrics line must be an object with an int 'step'")
            rows.append(row)
    return rows
