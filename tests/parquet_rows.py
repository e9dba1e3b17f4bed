"""Rows of the DAPO schema written as a parquet prompt file, as the datasets library writes one."""


def write_parquet_rows(rows: list[dict], path: str) -> None:
    import datasets

    datasets.Dataset.from_list(rows).to_parquet(path)
