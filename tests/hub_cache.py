"""A Hugging Face hub cache written as huggingface_hub lays one out, from local files, so that tests resolve hub
ids with HF_HUB_OFFLINE=1 and no network:

    <cache>/models--org--name/blobs/<hash>                 each file's content once (LFS files: sha256, others:
                                                           their git blob sha1)
    <cache>/models--org--name/refs/main                    the commit the branch points at
    <cache>/models--org--name/snapshots/<commit>/<path>    relative symlinks into blobs/
    <cache>/datasets--org--name/...                        the same for a data set
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

LFS_SUFFIXES = (".safetensors", ".parquet", ".bin")


def put_in_hub_cache(
    cache: Path, repo_type: str, repo_id: str, files: dict[str, Path], *, commit: str, ref: str = "main"
) -> Path:
    """Store `files` ({path in the repository: local file}) as commit `commit` of `repo_id`, with branch `ref`
    pointing at it; returns the snapshot folder."""
    from huggingface_hub.file_download import repo_folder_name

    root = cache / repo_folder_name(repo_id=repo_id, repo_type=repo_type)
    (root / "blobs").mkdir(parents=True, exist_ok=True)
    (root / "refs").mkdir(exist_ok=True)
    (root / "refs" / ref).write_text(commit)
    snapshot = root / "snapshots" / commit
    for path_in_repo, source in files.items():
        data = source.read_bytes()
        if path_in_repo.endswith(LFS_SUFFIXES):
            digest = hashlib.sha256(data).hexdigest()
        else:
            digest = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
        blob = root / "blobs" / digest
        blob.write_bytes(data)
        link = snapshot / path_in_repo
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    return snapshot


def put_folder_in_hub_cache(cache: Path, repo_type: str, repo_id: str, folder: Path, *, commit: str) -> Path:
    """Every file under `folder` as commit `commit` of `repo_id` (paths relative to `folder`)."""
    files = {str(p.relative_to(folder)): p for p in sorted(folder.rglob("*")) if p.is_file()}
    return put_in_hub_cache(cache, repo_type, repo_id, files, commit=commit)
