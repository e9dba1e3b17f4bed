"""Prompt sets read through the `datasets` library: a hub data set by its id (model/hub.py), or a jsonl file.

    org/name[@revision][:split]            a set of one config (its only split when none is named)
    org/name[@revision]:config[:split]     a set of several configs, which its README's header lists: GSM8K's
                                           openai/gsm8k has main and socratic (openai/gsm8k:main:train)

The id's parquet and jsonl files, and the README whose header names each split's files, are fetched into the
hub cache, then `datasets.load_dataset` reads that snapshot folder by its own rules for splits, streaming (the
files where they lie, no copy). Not the id itself: with HF_HUB_OFFLINE=1 load_dataset reads only sets it once
prepared in its own cache, never the hub cache. The rows pass a parquet file's checks (data/prompts.py).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from pathlib import Path

from data.prompt_row import check_columns
from errors import DataError
from model.hub import HubName, fetch_snapshot, hub_name

DATA_PATTERNS = ["*.parquet", "*.jsonl", "README.md"]


def read_by_datasets(path: str) -> bool:
    """Whether data.train_path / data.eval_path is read here (a hub id or a jsonl file), not as parquet."""
    return path.endswith(".jsonl") or hub_name(path, splits=True) is not None


def fetch_dataset(name: HubName, what: str, *, cached: bool = False) -> str:
    """The hub data set `name` fetched (cached: found in the cache), as its id pinned to the commit fetched
    (`org/name@<commit>[:split]`): every later read, on every rank, finds the same files in the cache."""
    commit = os.path.basename(fetch_snapshot(name, "dataset", DATA_PATTERNS, what, cached=cached))
    return f"{name.repo_id}@{commit}" + (f":{name.split}" if name.split else "")


def read_dataset_rows(source: str, required_columns: Sequence[str] = ()) -> list[dict]:
    """All rows of the hub set or local jsonl file `source` as dicts; a DataError naming `source` when it has no
    such config or split, cannot be read, has no rows or lacks one of `required_columns`."""
    import datasets

    name = hub_name(source, splits=True)
    if name is None and not os.path.isfile(source):
        raise DataError(f"data file not found: {source}")
    if name is None and os.path.getsize(source) == 0:  # load_dataset fails on it without a message
        raise DataError(f"{source}: the file is empty (0 bytes)")
    config, split = None, None
    with _reading(source):
        if name is None:
            sets = datasets.load_dataset("json", data_files=source, streaming=True)
        else:
            folder = fetch_snapshot(name, "dataset", DATA_PATTERNS, repr(source))
            _refuse_parquet_without_rows(source, folder)
            config, split = _config_and_split(source, name, datasets.get_dataset_config_names(folder))
            sets = datasets.load_dataset(folder, config, streaming=True)
    split = split or (next(iter(sets)) if len(sets) == 1 else None)
    if split not in sets:
        which = f"no split {split!r}" if split else "several splits"
        example = f"{source.rpartition(':')[0] if split else source}:{next(iter(sets))}"
        raise DataError(f"{source}: {which}; its splits are {', '.join(sets)}: name one, as in {example}")
    with _reading(source):
        rows = list(sets[split])
    columns = sets[split].column_names or (list(rows[0]) if rows else [])
    if not rows:
        raise DataError(f"{source}: the split {split!r} has no rows (columns: {', '.join(columns) or 'none'})")
    check_columns(source, columns, required_columns, "prompt set")
    return rows


def _config_and_split(source: str, name: HubName, configs: list[str]) -> tuple[str | None, str | None]:
    """The config and the split an id names: `:config:split`, or one name, the config of a set that has several
    (GSM8K: main, socratic) and otherwise the split; a DataError naming the set's configs when it names none of
    them or, having several, none at all."""
    config, _, split = (name.split or "").rpartition(":")
    if not config and len(configs) > 1:  # one name: a config
        config, split = split, ""
    if (config or len(configs) > 1) and config not in configs:
        which = f"no config {config!r}" if config else "several configs"
        example = f"{name.repo_id}:{configs[0]} (and a split: {name.repo_id}:{configs[0]}:<split>)"
        raise DataError(f"{source}: {which}; its configs are {', '.join(configs)}: name one, as in {example}")
    return config or None, split or None


def _refuse_parquet_without_rows(source: str, folder: str) -> None:
    """datasets fails on a parquet file without rows with a message that names neither the file nor the cause
    (as data/prompts.py notes); its footer names both."""
    import pyarrow.parquet as pq

    for path in sorted(Path(folder).rglob("*.parquet")):
        if pq.ParquetFile(path).metadata.num_rows == 0:
            raise DataError(f"{source}: {path.relative_to(folder)} has no rows")


@contextlib.contextmanager
def _reading(source: str) -> Iterator[None]:
    """The library's errors for files it cannot read as one DataError naming `source` (and no log line of its
    own before it)."""
    import datasets
    import pyarrow as pa
    import yaml

    verbosity = datasets.logging.get_verbosity()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)
    try:
        yield
    except (datasets.exceptions.DatasetsError, FileNotFoundError, pa.ArrowException) as exc:
        raise DataError(f"{source}: cannot be read as a data set ({str(exc).splitlines()[0]})") from exc
    except yaml.YAMLError as exc:  # the README's header, which names the configs and their files
        raise DataError(f"{source}: its README.md header is not valid YAML ({' '.join(str(exc).split())})") from exc
    finally:
        datasets.logging.set_verbosity(verbosity)
