"""Progress display for long phases (generation rounds, training micro-steps, evaluation).

On a terminal it is a tqdm bar (count, rate, elapsed time, ETA). When the output stream is not a
terminal (CI, `> run.log`) a bar's carriage returns would fill the log with fragments, so it prints
plain lines instead, at most one every `plain_interval` seconds plus one when the phase ends:

    eval: 12/30 problems (40%) | 2.41 problems/s | elapsed 00:04 | ETA 00:07 | acc=0.25

With rate r = done / elapsed and remaining = total - done, ETA = remaining / r. `enabled=False` (or a
non-zero rank) shows nothing; every method is then a no-op, so callers need no conditionals.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TextIO

from tqdm import tqdm


class Progress:
    """One phase's progress: `update(n)` as work completes, `close()` (or a `with` block) at the end.

    total: units of work in the phase (None: unknown, no percentage or ETA).
    desc: the phase's name, printed first.
    unit: what is counted ("prompts", "micro-batches", ...).
    enabled: False shows nothing.
    file: output stream (default sys.stderr, as tqdm, so stdout stays free for results).
    leave: keep the finished bar (terminal) / print the final line (plain mode) even when the phase
        was short; False keeps logs of many short phases quiet: the final line then appears only if
        a periodic line was printed.
    plain_interval: seconds between plain lines.
    clock: time source in seconds (injectable for tests).
    """

    def __init__(
        self,
        total: int | None = None,
        desc: str = "",
        *,
        unit: str = "it",
        enabled: bool = True,
        file: TextIO | None = None,
        leave: bool = True,
        plain_interval: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if total is not None and total < 0:
            raise ValueError(f"Progress total must be >= 0 or None, got {total}")
        if plain_interval <= 0:
            raise ValueError(f"plain_interval must be > 0 seconds, got {plain_interval}")
        self.total, self.desc, self.unit, self.enabled, self.leave = total, desc, unit, enabled, leave
        self.file = file if file is not None else sys.stderr
        self.plain_interval, self.clock = plain_interval, clock
        self.n, self.lines_printed, self.closed = 0, 0, False
        self.postfix: dict[str, object] = {}
        self._bar = None
        self._start = self._last_line = clock()
        if enabled and _is_terminal(self.file):
            self._bar = tqdm(
                total=total, desc=desc, unit=unit, file=self.file, leave=leave, dynamic_ncols=True, mininterval=0.5
            )

    def update(self, n: int = 1, **postfix: object) -> None:
        """Record `n` more units done; keyword arguments are shown after the counts (key=value)."""
        if not self.enabled or self.closed:
            return
        self.n += n
        self.postfix.update(postfix)
        if self._bar is not None:
            if postfix:
                self._bar.set_postfix(self._formatted_postfix(), refresh=False)
            self._bar.update(n)
        elif self.clock() - self._last_line >= self.plain_interval:
            self._print_line()

    def close(self) -> None:
        if not self.enabled or self.closed:
            return
        self.closed = True
        if self._bar is not None:
            self._bar.close()
        elif self.leave or self.lines_printed:
            self._print_line()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- plain lines ------------------------------------------------------------------------------

    def line(self) -> str:
        """The plain progress line for the current state."""
        elapsed = self.clock() - self._start
        rate = self.n / elapsed if elapsed > 0 else None
        counts = f"{self.n}/{self.total} {self.unit}" if self.total is not None else f"{self.n} {self.unit}"
        if self.total:
            counts += f" ({100 * self.n / self.total:.0f}%)"
        parts = [f"{self.desc}: {counts}" if self.desc else counts]
        parts.append(f"{rate:.3g} {self.unit}/s" if rate is not None else f"? {self.unit}/s")
        parts.append(f"elapsed {tqdm.format_interval(elapsed)}")
        if self.total is not None and self.n < self.total:
            parts.append(f"ETA {tqdm.format_interval((self.total - self.n) / rate)}" if rate else "ETA ?")
        if self.postfix:
            parts.append(" ".join(f"{k}={v}" for k, v in self._formatted_postfix().items()))
        return " | ".join(parts)

    def _print_line(self) -> None:
        print(self.line(), file=self.file, flush=True)
        self.lines_printed += 1
        self._last_line = self.clock()

    def _formatted_postfix(self) -> dict[str, str]:
        return {k: f"{v:.4g}" if isinstance(v, float) else str(v) for k, v in self.postfix.items()}


def _is_terminal(stream: object) -> bool:
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty()) if isatty is not None else False
    except (ValueError, OSError):  # a closed or detached stream is no terminal
        return False
