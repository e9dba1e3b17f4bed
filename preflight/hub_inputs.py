"""A run's inputs named by hub id, fetched before anything reads them (model/hub.py, data/hub.py).

The configuration's hub ids become what a path would have been: model.hf_path and model.tokenizer_path the
snapshot folders in the hub cache, the data sets their ids pinned to the commit fetched, so the run folder's
config.json records the exact versions. Under torchrun one process per node downloads and the node's others
wait on the gloo control group (parallel/dist_env.py `node_first`), then find the files in the cache.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import TYPE_CHECKING

from data.hub import fetch_dataset
from errors import ConfigError
from model.hub import MODEL_PATTERNS, TOKENIZER_PATTERNS, HubName, fetch_snapshot, hub_name
from preflight.checks import check_inputs

if TYPE_CHECKING:
    from config import Config
    from parallel.dist_env import DistEnv

log = logging.getLogger(__name__)

TRAIN_INPUTS = ("model.hf_path", "model.tokenizer_path", "data.train_path", "data.eval_path")
EVAL_INPUTS = ("model.hf_path", "model.tokenizer_path", "data.eval_path")


def _value(cfg: Config, key: str) -> str:
    section, field = key.split(".")
    return getattr(getattr(cfg, section), field)


def _fetched(key: str, value: str, name: HubName, cached: bool) -> str:
    """A hub id's local form: a model's snapshot folder, a data set's id pinned to the commit fetched."""
    what = f"{key} = {value!r}"
    if key.startswith("data."):
        return fetch_dataset(name, what, cached=cached)
    patterns = TOKENIZER_PATTERNS if key == "model.tokenizer_path" else MODEL_PATTERNS
    return fetch_snapshot(name, "model", patterns, what, cached=cached)


def fetch_hub_inputs(cfg: Config, keys: tuple[str, ...] = TRAIN_INPUTS, dist_env: DistEnv | None = None) -> Config:
    """`cfg` with the hub ids among `keys` fetched (module docstring); `cfg` itself when none is an id. With
    `dist_env`, each node's first process downloads, then the others read its revisions and files from the cache
    (every rank must call this: all hold the same `cfg`)."""
    names = {key: hub_name(_value(cfg, key), splits=key.startswith("data.")) for key in keys}
    named = {key: name for key, name in names.items() if name is not None}
    if not named:
        return cfg

    def fetch_all(cached: bool = False) -> Config:
        fetched = cfg
        for key, name in named.items():
            section, field = key.split(".")
            local = _fetched(key, _value(cfg, key), name, cached)
            fetched = replace(fetched, **{section: replace(getattr(fetched, section), **{field: local})})
        return fetched

    if dist_env is None:
        return fetch_all()
    return dist_env.node_first(lambda: fetch_all(cached=dist_env.local_rank != 0))


def fetch_training_inputs(cfg: Config, dist_env: DistEnv) -> Config:
    """`fetch_hub_inputs` of train.py's inputs, then the checks check_runnable could not make of them before."""
    fetched = fetch_hub_inputs(cfg, TRAIN_INPUTS, dist_env)
    if fetched is not cfg:
        check_inputs(fetched)
    return fetched


def cached_model(cfg: Config) -> Config:
    """For the rehearsal, which reads a checkpoint's shapes and sizes but downloads nothing: model.hf_path's hub
    id as its snapshot when the cache holds one, else unset (the rehearsal then takes rehearse.preset)."""
    name = hub_name(cfg.model.hf_path)
    if name is None:
        return cfg
    try:
        folder = fetch_snapshot(name, "model", MODEL_PATTERNS, "model.hf_path", cached=True)
    except ConfigError:
        folder = ""
        log.info("model.hf_path = %r is not in the hub cache: rehearsing rehearse.preset", cfg.model.hf_path)
    return replace(cfg, model=replace(cfg.model, hf_path=folder))
