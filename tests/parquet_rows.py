"""Prompt-set files for tests: rows written as the parquet files a run reads."""

import datasets


def write_parquet_rows(rows: list[dict], path: str) -> None:
    datasets.Dataset.from_list(rows).to_parquet(path)
