"""Checkpoints and prompt sets named by hub id, fetched with huggingface_hub into its cache.

    Qwen/Qwen2.5-32B@<revision>                    a model at a branch, tag or commit (default: main)
    BytedTsinghua-SIA/AIME-2024@<revision>:train   a data set (data/hub.py); without a split, its only one

A value is a local path when it exists, starts with `/`, `.` or `~`, or ends in .parquet / .jsonl / .json;
otherwise `org/name[@revision][:split]` is a hub id. `snapshot_download` keeps the files in the hub cache
($HF_HUB_CACHE, default $HF_HOME/hub) and fetches only what is not there; HF_HUB_OFFLINE=1 reads the cache alone.
"""

from __future__ import annotations

import functools
import logging
import os
import re
from dataclasses import dataclass

from errors import ConfigError

log = logging.getLogger(__name__)

# What the loader, the engines and the export read of a checkpoint: weights, configs and the tokenizer (the
# files a Hugging Face tokenizer directory may hold, and the named chat templates beside the default one).
TOKENIZER_PATTERNS = [
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "additional_chat_templates/*",
]
MODEL_PATTERNS = ["*.safetensors", "*.safetensors.index.json", "config.json", "generation_config.json"]
MODEL_PATTERNS += TOKENIZER_PATTERNS

_PATH_PREFIXES = ("/", ".", "~")
_FILE_SUFFIXES = (".parquet", ".jsonl", ".json")
_HUB_ID = re.compile(r"(?P<repo_id>[^/@:]+/[^/@:]+)(?:@(?P<revision>[^:]+))?(?::(?P<split>.+))?")


@dataclass(frozen=True)
class HubName:
    repo_id: str
    revision: str | None = None  # None: the default branch
    split: str | None = None  # data sets only; None: the set's only split


def hub_name(value: str, *, splits: bool = False) -> HubName | None:
    """`value` as a hub id, or None when it names a local path (module docstring). splits: a `:split` may end it."""
    if not value or os.path.exists(value) or value.startswith(_PATH_PREFIXES) or value.endswith(_FILE_SUFFIXES):
        return None
    match = _HUB_ID.fullmatch(value)
    if match is None or (match["split"] and not splits):
        return None
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(match["repo_id"])
    except HFValidationError:
        return None
    return HubName(match["repo_id"], match["revision"], match["split"])


def local_path(value: str, bases: tuple[str, ...], *, splits: bool = False) -> str:
    """`value` as an absolute path: joined to the first of `bases` under which its first part exists (`bases/demo`
    is a path of the repository, `bases/dmeo` one that does not exist, never the id of a hub account named
    "bases"), else to the first base. Unchanged when it is empty, "synthetic" (the built-in prompt sets) or a hub id:
    one only where no base holds its first part, and `hub_name` takes it for one."""
    value = os.path.expanduser(value)
    found = [base for base in bases if os.path.lexists(os.path.join(base, value.split("/")[0]))]
    if value in ("", "synthetic") or (not found and hub_name(value, splits=splits)):
        return value
    return os.path.abspath(os.path.join((found or bases)[0], value))


@functools.cache
def _unreachable(endpoint: str) -> bool:
    """Whether the hub at `endpoint` answers nothing (no network, no route or name for it): asked once a process, in
    seconds, and said in one line. Ids are then read from the cache alone: huggingface_hub would otherwise try each
    commit-pinned one five times over ~23 s (its http_backoff, listing the files) before it read the cache."""
    import httpx2  # huggingface_hub's HTTP client
    from huggingface_hub.utils import get_session

    try:
        get_session().head(endpoint, timeout=5)
        return False
    except (httpx2.ConnectError, httpx2.TimeoutException) as exc:
        log.warning("the hub (%s) cannot be reached (%s): hub ids are read from the hub cache alone", endpoint, exc)
        return True


def fetch_snapshot(name: HubName, repo_type: str, patterns: list[str], what: str, *, cached: bool = False) -> str:
    """The folder of `name`'s snapshot in the hub cache holding the files that match `patterns`, downloading
    only those missing (cached: none). `what` names the value in errors ("model.hf_path = 'Qwen/Qwen2.5-32B'")."""
    import huggingface_hub
    from huggingface_hub import constants
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        IncompleteSnapshotError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    page = f"https://huggingface.co/{'datasets/' if repo_type == 'dataset' else ''}{name.repo_id}"
    offline = cached or (not constants.HF_HUB_OFFLINE and _unreachable(constants.ENDPOINT))
    try:
        return huggingface_hub.snapshot_download(
            name.repo_id, repo_type=repo_type, revision=name.revision, allow_patterns=patterns, local_files_only=offline
        )
    except GatedRepoError:  # before RepositoryNotFoundError, its base class
        problem = f"{name.repo_id} is gated: accept its terms on {page}, then log in (`hf auth login`) or set HF_TOKEN"
    except RepositoryNotFoundError:
        problem = (
            f"no {repo_type} {name.repo_id} on the hub (or a private one this login cannot read), and no such local "
            "path: check the name, or log in (`hf auth login`) or set HF_TOKEN"
        )
    except RevisionNotFoundError:
        problem = f"{name.repo_id} has no revision {name.revision!r}: name one of its branches, tags or commits"
    except LocalEntryNotFoundError as exc:  # no network (or offline) and nothing (or not everything) cached
        where = f"{constants.HF_HUB_CACHE}{' holds only part of it' * isinstance(exc, IncompleteSnapshotError)}"
        if constants.HF_HUB_OFFLINE:
            state = "offline (HF_HUB_OFFLINE is set)"
        else:
            state = "reading the cache only" if cached else "cannot reach the hub"
        problem = (
            f"{state} and not in the cache: {name.repo_id} ({where}), and no such local path: fetch it once with "
            "network, or give a local path"
        )
    except HfHubHTTPError as exc:  # the hub refused or failed otherwise (a bad token, an outage)
        problem = f"the hub answered {str(exc).splitlines()[0]} for {name.repo_id}"
    raise ConfigError(f"{what}: {problem}")
