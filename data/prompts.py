"""Prompt sets read by their columns (by default the DAPO-Math-17k schema) and a resumable sampler.

A row of the schema (one parquet row, or one dict here; what each field may hold, and how data.prompt_key and
data.answer_key name other columns: data/prompt_row.py):
    {"data_source": str, "prompt": [{"role": "user", "content": str}, ...], "ability": str,
     "reward_model": {"style": "rule", "ground_truth": str | [str, ...]}, "extra_info": {...}}

The built-in synthetic tasks (tasks/) write rows of exactly this schema, so the demo and the tests exercise
the same reader as a real DAPO-Math-17k file. Their rows also carry a worked solution in
`extra_info["solution"]`, used by the supervised warm-up that precedes DAPO in the CPU demo.
"""

from __future__ import annotations

import logging
import os
import random
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from data.prompt_row import DAPO_COLUMNS, Columns, RowSkipped, check_columns, field_at, read_messages, read_row
from errors import DataError, broken_link
from rl.math_normalize import normalize_final_answer
from rl.reward import GroundTruth
from tasks.arithmetic import synthetic_arithmetic_rows
from tasks.chain import synthetic_chain_rows
from tasks.coin import synthetic_coin_rows
from tasks.fork import synthetic_fork_rows
from tasks.scan import synthetic_scan_rows

if TYPE_CHECKING:
    import pyarrow as pa

    from config.schema import DataConfig
    from model.tokenizer import Tokenizer

log = logging.getLogger(__name__)


@dataclass
class PromptExample:
    """One usable prompt: its chat messages, token ids and the ground truth the scorer compares with (one
    answer, or a tuple of accepted answers: data/prompt_row.py)."""

    prompt_ids: list[int]
    ground_truth: GroundTruth
    data_source: str
    messages: list[dict]
    solution: str | None = None  # worked solution, when the data set has one (synthetic task)
    index: int = 0  # position in the deduplicated set
    extra: dict[str, Any] = field(default_factory=dict)  # the row's other columns, for a reward function


@dataclass
class LoadStats:
    rows: int = 0
    duplicates: int = 0
    skipped: dict[str, int] = field(default_factory=dict)  # reason -> rows skipped for it (data/prompt_row.py)
    truncated: int = 0
    dropped_too_long: int = 0
    first_problem: str | None = None
    conflicting: int = 0  # duplicates whose ground truth scores otherwise than the first's (which is kept)
    first_conflict: str | None = None
    columns: list[str] = field(default_factory=list)  # the first row's
    read_by: Columns = DAPO_COLUMNS

    @property
    def skipped_rows(self) -> int:
        return sum(self.skipped.values())

    def note_problem(self, row_number: int, problem: str) -> None:
        if self.first_problem is None:
            self.first_problem = f"row {row_number}: {problem}"

    def note_duplicate(
        self, row_number: int, row: Mapping[str, object], messages: list[dict], first: tuple[int, object, GroundTruth]
    ) -> None:
        """Count a duplicate of the prompt first read at row `first[0]` (raw ground truth `first[1]`, read as
        `first[2]`), and note it when its ground truth is another answer for the scorer (its normalised answers
        differ). Rows whose raw ground truth equals the first's, nearly every repeat, are not read further."""
        self.duplicates += 1
        try:
            raw = field_at(row, self.read_by.answer)
            if type(raw) is type(first[1]) and isinstance(raw, str | int | float) and raw == first[1]:
                return
            truth = read_row(row, messages, self.read_by).ground_truth
        except RowSkipped:  # unusable: dropped as a duplicate all the same
            return
        if _scored_as(truth) != _scored_as(first[2]):
            self.conflicting += 1
            if self.first_conflict is None:
                self.first_conflict = f"row {row_number} answers {truth!r} where row {first[0]} answers {first[2]!r}"

    def summary(self, path: str, kept: int) -> str:
        reasons = "; ".join(f"{count} x {reason}" for reason, count in self.skipped.items())
        conflicts = (
            f" ({self.conflicting} of them with another ground truth than the first, which is kept: "
            f"{self.first_conflict})"
            if self.conflicting
            else ""
        )
        return (
            f"{path}: {self.rows} rows -> {kept} prompts ({self.duplicates} duplicates dropped{conflicts}, "
            f"{self.skipped_rows} rows skipped{f' ({reasons})' if reasons else ''}, {self.truncated} left-truncated, "
            f"{self.dropped_too_long} dropped as too long)"
        )


Overflow = Literal["truncate_left", "drop"]  # what becomes of a prompt longer than max_prompt_length


def columns_of(data: DataConfig) -> Columns:
    """Where the [data] section's prompt sets hold their prompts and answers (data/prompt_row.py)."""
    return Columns(data.prompt_key, data.answer_key, data.prompt_template)


def rows_to_examples(
    rows: Iterable[Mapping[str, object]],
    tokenizer: Tokenizer,
    *,
    max_prompt_length: int,
    overflow: Overflow = "truncate_left",
    source_name: str = "<rows>",
    columns: Columns = DAPO_COLUMNS,
) -> tuple[list[PromptExample], LoadStats]:
    """Deduplicate, validate, template and tokenise rows, read by `columns` (default: the DAPO schema's).

    Each row is read by data/prompt_row.py: a row it cannot use is skipped and counted under its reason in
    the load summary (logged as a warning). Duplicates are rows whose prompt messages are identical (the
    official DAPO-Math-17k file repeats each prompt about 100 times); the first is kept, and duplicates whose
    ground truth scores otherwise are counted and one is named in the summary (then a warning). Prompts longer than
    `max_prompt_length` tokens are left-truncated (keeping the end of the prompt, where the generation
    prompt is) or dropped, per `overflow`.
    """
    stats = LoadStats(read_by=columns)
    seen: dict[tuple, tuple[int, object, GroundTruth]] = {}  # prompt -> its row number, raw and read ground truth
    examples: list[PromptExample] = []
    for row_number, row in enumerate(rows):
        stats.rows += 1
        if row_number == 0 and isinstance(row, Mapping):
            stats.columns = list(row)
        try:
            messages = read_messages(row, columns)
            key = tuple((m["role"], m["content"]) for m in messages)
            if key in seen:  # before the other fields are read: DAPO-Math-17k is 99% repeats
                stats.note_duplicate(row_number, row, messages, seen[key])
                continue
            parsed = read_row(row, messages, columns)
        except RowSkipped as skipped:
            reason = str(skipped)
            stats.skipped[reason] = stats.skipped.get(reason, 0) + 1
            stats.note_problem(row_number, reason)
            continue
        seen[key] = (row_number, field_at(row, columns.answer), parsed.ground_truth)
        ids = _fit_prompt(tokenizer.encode_chat(parsed.messages), max_prompt_length, overflow, stats, row_number)
        if ids is None:
            continue
        examples.append(
            PromptExample(
                prompt_ids=ids,
                ground_truth=parsed.ground_truth,
                data_source=parsed.data_source,
                messages=parsed.messages,
                solution=parsed.solution,
                index=len(examples),
                extra=parsed.extra,
            )
        )
    _report_load(source_name, len(examples), stats)
    return examples, stats


def _fit_prompt(
    ids: list[int], max_prompt_length: int, overflow: Overflow, stats: LoadStats, row_number: int
) -> list[int] | None:
    """A prompt's ids within `max_prompt_length` tokens: its last tokens (left-truncated, counted), or None
    when `overflow` is "drop" (counted, and noted as a problem)."""
    if len(ids) <= max_prompt_length:
        return ids
    if overflow == "drop":
        stats.dropped_too_long += 1
        stats.note_problem(row_number, f"prompt of {len(ids)} tokens > max_prompt_length {max_prompt_length}")
        return None
    stats.truncated += 1
    return ids[-max_prompt_length:]


def _report_load(source_name: str, kept: int, stats: LoadStats) -> None:
    """Refuse a set with no usable row (naming its first problem); else log its load summary, as a warning
    when rows were skipped."""
    if not kept:
        raise DataError(
            f"{source_name}: no usable row ({stats.rows} rows read); first problem: "
            f"{stats.first_problem or 'the file is empty'}"
            + (f" (its columns: {', '.join(stats.columns)})" if stats.columns else "")
        )
    (log.warning if stats.skipped or stats.conflicting else log.info)(stats.summary(source_name, kept))


def _scored_as(truth: GroundTruth) -> frozenset[str]:
    """The normalised answers a response is compared with (rl/reward.py): equal sets score every response alike."""
    return frozenset(normalize_final_answer(a) for a in ((truth,) if isinstance(truth, str) else truth))


def check_parquet_file(path: str, required_columns: tuple[str, ...] = ()) -> None:
    """Refuse a file that cannot be a prompt set, from its parquet footer alone (no row is read).

    Each way the file can be unusable is a DataError naming the file and the problem: missing, empty,
    not parquet, no rows, or without one of `required_columns`.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    if os.path.isdir(path):
        raise DataError(f"{path} is a directory; a prompt set is one parquet file in the DAPO-Math-17k schema")
    if not os.path.isfile(path):
        raise DataError(
            f"data file {path} {broken_link(path)}" if broken_link(path) else f"data file not found: {path}"
        )
    if os.path.getsize(path) == 0:
        raise DataError(f"{path}: the file is empty (0 bytes), not a parquet file")
    try:
        with pq.ParquetFile(path) as parquet:
            columns, num_rows = parquet.schema_arrow.names, parquet.metadata.num_rows
    except (pa.ArrowException, OSError) as exc:  # ArrowInvalid: "Parquet magic bytes not found ..."
        raise DataError(f"{path}: cannot be read as parquet ({exc})") from exc
    if num_rows == 0:
        raise DataError(f"{path}: the parquet file has no rows (columns: {', '.join(columns) or 'none'})")
    check_columns(path, columns, required_columns, "prompt file")


def read_parquet_rows(path: str, required_columns: tuple[str, ...] = ()) -> list[dict]:
    """All rows of a parquet file as dicts, read with pyarrow after `check_parquet_file`.

    (The `datasets` library fails on a file with no rows with a message that names neither the file nor
    the cause; pyarrow reads the footer, which says both.)
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    check_parquet_file(path, required_columns)
    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as exc:  # a damaged row group behind an intact footer
        raise DataError(f"{path}: cannot be read as parquet ({exc})") from exc
    try:
        return table.to_pylist()
    except UnicodeDecodeError as exc:  # pyarrow reads string columns unchecked and decodes them here
        column, row = _first_undecodable_cell(table)
        raise DataError(
            f"{path}: column {column!r}, row {row} holds a string that is not UTF-8 ({exc.reason}): parquet "
            "strings are UTF-8; write the file again with its text encoded as UTF-8"
        ) from None


def _first_undecodable_cell(table: pa.Table) -> tuple[str | None, int | None]:
    """(column, row) of the first string in `table` that is not UTF-8, by bisection over each failing
    column's prefixes (log2(rows) conversions of that column, on the error path only)."""

    def decodes(column: pa.ChunkedArray, end: int) -> bool:
        try:
            column.slice(0, end).to_pylist()
            return True
        except UnicodeDecodeError:
            return False

    for name in table.column_names:
        column = table.column(name)
        if decodes(column, len(column)):
            continue
        good, bad = 0, len(column)  # the first `good` rows decode; the first `bad` rows do not
        while bad - good > 1:
            middle = (good + bad) // 2
            good, bad = (middle, bad) if decodes(column, middle) else (good, middle)
        return name, good
    return None, None


def load_prompts(
    path: str,
    tokenizer: Tokenizer,
    *,
    max_prompt_length: int,
    overflow: Overflow = "truncate_left",
    columns: Columns = DAPO_COLUMNS,
) -> list[PromptExample]:
    """Prompts of a parquet file, jsonl file or hub data set (data/hub.py) read by `columns`, each once (an
    evaluation takes k samples of a problem with SamplingParams.n = k)."""
    from data.hub import read_by_datasets, read_dataset_rows

    rows = (read_dataset_rows if read_by_datasets(path) else read_parquet_rows)(path, columns.required)
    examples, _ = rows_to_examples(
        rows, tokenizer, max_prompt_length=max_prompt_length, overflow=overflow, source_name=path, columns=columns
    )
    return examples


@dataclass
class PromptSampler:
    """Yields batches of prompts, reshuffled each epoch with a seeded generator.

    Every rank draws the same global order and takes its contiguous slice of each global batch, so the
    position (`epoch`, `cursor`) is the whole state, identical on every rank, and resuming from a
    checkpoint replays exactly the prompts an uninterrupted run would have seen.
    """

    examples: list[PromptExample]
    seed: int = 0
    shuffle: bool = True
    dp_rank: int = 0
    dp_size: int = 1
    epoch: int = 0
    cursor: int = 0
    _order: list[int] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        if not self.examples:
            raise ValueError("PromptSampler needs at least one example")
        if not 0 <= self.dp_rank < self.dp_size:
            raise ValueError(f"dp_rank {self.dp_rank} out of range for dp_size {self.dp_size}")
        self._order = self._epoch_order(self.epoch)

    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(range(len(self.examples)))
        if self.shuffle:
            random.Random(f"{self.seed}-{epoch}").shuffle(order)
        return order

    def next_batch(self, global_batch_size: int) -> list[PromptExample]:
        """This rank's share of the next `global_batch_size` prompts (wrapping into a new epoch)."""
        if global_batch_size % self.dp_size:
            raise ValueError(f"global batch of {global_batch_size} prompts does not divide over {self.dp_size} ranks")
        picked: list[int] = []
        while len(picked) < global_batch_size:
            if self.cursor == len(self._order):
                self.epoch, self.cursor = self.epoch + 1, 0
                self._order = self._epoch_order(self.epoch)
            take = min(global_batch_size - len(picked), len(self._order) - self.cursor)
            picked.extend(self._order[self.cursor : self.cursor + take])
            self.cursor += take
        share = global_batch_size // self.dp_size
        mine = picked[self.dp_rank * share : (self.dp_rank + 1) * share]
        return [self.examples[i] for i in mine]

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "cursor": self.cursor, "num_examples": len(self.examples), "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        if state["num_examples"] != len(self.examples) or state["seed"] != self.seed:
            raise ValueError(
                f"data position was saved for {state['num_examples']} prompts with seed {state['seed']}; "
                f"this run has {len(self.examples)} prompts with seed {self.seed}"
            )
        self.epoch, self.cursor = state["epoch"], state["cursor"]
        self._order = self._epoch_order(self.epoch)


def synthetic_task_rows(data: DataConfig, split: str) -> list[dict]:
    """The rows of one split of the synthetic task a [data] section describes: data.synthetic_task at
    data.synthetic_difficulty, data.synthetic_num_<split> problems from data.seed (tasks/)."""
    count = data.synthetic_num_train if split == "train" else data.synthetic_num_eval
    task = data.synthetic_task
    rows: dict[str, Callable[..., list[dict]]] = {
        "arithmetic": synthetic_arithmetic_rows,
        "chain": synthetic_chain_rows,
        "coin": synthetic_coin_rows,
        "fork": synthetic_fork_rows,
        "scan": synthetic_scan_rows,
    }
    prose = {"answer_line_share": data.synthetic_answer_share} if task == "arithmetic" else {}
    return rows[task](count, difficulty=data.synthetic_difficulty, split=split, seed=data.seed, **prose)


def load_split(data: DataConfig, split: str, tokenizer: Tokenizer) -> list[PromptExample]:
    """The prompts of data.train_path or data.eval_path (`split` "train" or "eval"): a prompt set read by the
    section's columns, or the synthetic task's split (the DAPO schema); prompts of at most data.max_prompt_length
    tokens."""
    path, longest, overflow = getattr(data, f"{split}_path"), data.max_prompt_length, data.prompt_overflow
    if path == "synthetic":
        rows, name = synthetic_task_rows(data, split), f"synthetic {split}"
        return rows_to_examples(rows, tokenizer, max_prompt_length=longest, overflow=overflow, source_name=name)[0]
    return load_prompts(path, tokenizer, max_prompt_length=longest, overflow=overflow, columns=columns_of(data))
