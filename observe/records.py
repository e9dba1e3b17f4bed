"""Logged metrics as typed records, each declared once with how it combines over micro-batches and ranks.

    Sum    added up (samples, groups, seconds); Count: a Sum of whole things, logged as an integer
    Mean   total / weight, NaN without weight: a mean weighted by tokens, samples or groups
    Max    the largest value, NaN where none was seen

A phase keeps its metrics in a dataclass whose fields are records (`logged(name, kind)` names each one as
metrics.jsonl, TensorBoard and the panel know it) and adds to them as it runs, on its own rank. At the step's
end `over_ranks` combines every record of every phase with one all-reduce per kind of combination: one sum,
one max. A part that every rank holds alike (the number of optimizer updates, the learning rate) is marked
SAME and left as it is.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import field, fields, is_dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from parallel.dist_env import DistEnv

SUM, MAX, SAME = "sum", "max", "same"  # how ranks combine a part


class Sum:
    """Added up over micro-batches, rounds and ranks (or, `over_ranks` MAX or SAME, not added over ranks)."""

    def __init__(self, over_ranks: str = SUM):
        self.parts, self.ops = [0.0], (over_ranks,)

    def add(self, value: float) -> None:
        self.parts[0] += value

    def result(self) -> float:
        return self.parts[0]


class Count(Sum):
    """A Sum of whole things (rounds, updates), logged as an integer."""

    def result(self) -> int:
        return int(self.parts[0])


class Max:
    """The largest value over micro-batches and ranks; NaN where none was added."""

    def __init__(self) -> None:
        self.parts, self.ops = [-math.inf], (MAX,)

    def add(self, value: float) -> None:
        self.parts[0] = max(self.parts[0], value)

    def result(self) -> float:
        return self.parts[0] if self.parts[0] > -math.inf else math.nan


class Mean:
    """total / weight, NaN without weight; both parts summed over ranks unless `over_ranks` says otherwise."""

    def __init__(self, over_ranks: tuple[str, str] = (SUM, SUM)):
        self.parts, self.ops = [0.0, 0.0], over_ranks

    def add(self, total: float, weight: float = 1.0) -> None:
        self.parts[0] += total
        self.parts[1] += weight

    def result(self) -> float:
        total, weight = self.parts
        return total / weight if weight else math.nan


Record = Sum | Count | Max | Mean


def logged(name: str, kind: Callable[..., Any], *args: Any) -> Any:
    """A dataclass field holding a `kind(*args)` record logged as `name` (a nested metrics dataclass: the
    prefix of its names)."""
    return field(default_factory=functools.partial(kind, *args), metadata={"logged": name})


def records(metrics: object) -> Iterator[tuple[str, Record]]:
    """(logged name, record) of every logged field of a metrics dataclass, nested ones under their prefix."""
    for f in fields(metrics):  # type: ignore[arg-type]  # a dataclass instance
        if "logged" not in f.metadata:
            continue
        value = getattr(metrics, f.name)
        if is_dataclass(value):
            yield from ((f.metadata["logged"] + name, record) for name, record in records(value))
        else:
            yield f.metadata["logged"], value


def add(into: object, part: object) -> None:
    """Add the records of metrics dataclass `part` into those of `into` (of the same kind), e.g. one loss call's
    into the step's (Max and Mean parts by their meaning, Sum and Count summed)."""
    for (_, total), (_, record) in zip(records(into), records(part)):
        for i, (mine, theirs) in enumerate(zip(total.parts, record.parts)):
            total.parts[i] = max(mine, theirs) if isinstance(total, Max) else mine + theirs


def row(*metrics: object) -> dict[str, float]:
    """The logged values of metrics dataclasses, by name."""
    return {name: record.result() for m in metrics for name, record in records(m)}


def over_ranks(metrics: Iterable[object], dist_env: DistEnv) -> None:
    """Combine the records of `metrics` over every rank, in place: one all-reduce of the parts ranks sum,
    one of those whose maximum they take (every rank calls it, with the same metrics)."""
    every = [record for m in metrics for _, record in records(m)]
    for op in (SUM, MAX):
        slots = [(record, i) for record in every for i, o in enumerate(record.ops) if o == op]
        reduced = dist_env.all_reduce([record.parts[i] for record, i in slots], op=op) if slots else []
        for (record, i), value in zip(slots, reduced):
            record.parts[i] = value
