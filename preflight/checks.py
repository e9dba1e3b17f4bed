"""The checks that only matter when a run starts: the paths exist, the sequences fit the model, and this
machine can run the settings (the rules are in preflight/machine.py)."""

from __future__ import annotations

import os

from config.schema import Config
from data.hub import read_by_datasets
from data.prompts import check_parquet_file, columns_of
from errors import ConfigError, broken_link
from model.args import PRESETS, ModelArgs
from model.hf import check_checksums
from model.hf_adapter import read_hf_config
from model.hub import hub_name
from preflight import limits
from preflight.machine import Machine, machine_fixes, probe_machine


def evaluates(cfg: Config) -> bool:
    """Whether the run evaluates on the held-out set at all (every `eval.interval` steps, at start or end)."""
    return bool(cfg.eval.interval or cfg.eval.at_start or cfg.eval.at_end)


def check_machine(cfg: Config, machine: Machine | None = None) -> None:
    """Refuse, in one error, every setting this machine cannot run, with the override that runs here.

    `machine`: a preflight.machine.Machine; None probes this one. The rules are in preflight/machine.py.
    """
    machine = probe_machine() if machine is None else machine
    fixes, launch = machine_fixes(cfg, machine)
    if not fixes and not launch:
        return
    lines = [f"this machine ({machine.describe()}) cannot run this configuration as set"]
    if fixes:
        lines[0] += "; to run it here, add: " + " ".join(f.flag for f in fixes)
        lines += [f"  {f.key} = {f.value!r}: {f.reason}" for f in fixes]
    lines += [f"  {problem}" for problem in launch]
    raise ConfigError("\n".join(lines))


def check_runnable(cfg: Config, machine: Machine | None = None) -> None:
    """The checks that only matter when training starts, before any data or model is loaded.

    In this order: this machine can run the settings (`check_machine`: first, because it reads no file and the paths
    of a recipe differ between the machines it may run on); a step's samples fit this node (preflight/limits.py);
    then `check_inputs`. Configuration problems raise ConfigError.
    """
    check_machine(cfg, machine)
    limits.check_rollout_batch_fits(cfg, limits.physical_memory())  # sizes no machine runs
    check_inputs(cfg)


def check_inputs(cfg: Config) -> None:
    """A checkpoint or tokenizer folder holds the files its SHA256SUMS lists and no other, when it has one; the
    paths are set and exist;
    the sequences fit the model; the data files are parquet prompt sets with rows (their footers only: an
    data.prompts.DataError); the torch engine's KV cache and an evaluation's samples fit (preflight/limits.py: the
    held-out set's size is read from its footer). A hub id (model/hub.py) passes as a name: train.py checks again
    once it is fetched (a data set's rows are checked as they are read)."""
    for folder in (cfg.model.hf_path, cfg.model.tokenizer_path):
        if os.path.isdir(folder):
            check_checksums(folder)  # a folder with a SHA256SUMS (a shipped base) is the one it lists, whole
    args = _model_args(cfg)
    _check_tokenizer_dir(cfg)
    _check_data_paths(cfg)
    for path in (cfg.data.train_path, cfg.data.eval_path):
        if path and path != "synthetic" and not read_by_datasets(path):
            check_parquet_file(path, columns_of(cfg.data).required)
    if args is None:
        return  # a hub id: the model's sizes are read once it is fetched
    _check_sequences_fit(cfg, args.max_position_embeddings)
    limits.check_torch_engine_fits(cfg, args, cfg.engine_max_seq_len)
    if evaluates(cfg):  # each rank evaluates its share of the problems in one call; a set read through `datasets`,
        problems = eval_problems(cfg)  # whose size is known only once read, at least one
        held = 1 if problems is None else problems * limits.node_share()
        limits.check_evaluation_fits(cfg, held, limits.physical_memory())


def eval_problems(cfg: Config) -> int | None:
    """The held-out problems an evaluation has at most: eval.eval_size, or the set's rows (the parquet footer's
    count, before duplicates are dropped; the synthetic task's); None for a set read through `datasets` (a hub id,
    a jsonl file) without eval.eval_size."""
    data = cfg.data
    if read_by_datasets(data.eval_path):
        return cfg.eval.eval_size
    if data.eval_path == "synthetic":
        rows = data.synthetic_num_eval
    else:
        import pyarrow.parquet as pq

        check_parquet_file(data.eval_path, columns_of(data).required)  # a DataError naming the file, before it is read
        with pq.ParquetFile(data.eval_path) as parquet:
            rows = parquet.metadata.num_rows
    return min(rows, cfg.eval.eval_size or rows)


def _model_args(cfg: Config) -> ModelArgs | None:
    """The model's architecture, after checking that the model is set: a preset's, or the config.json's of
    model.hf_path (None for a hub id not fetched yet)."""
    model = cfg.model
    if not model.preset and not model.hf_path:
        raise ConfigError(
            "model.hf_path is not set: set model.hf_path to a Qwen2.5 checkpoint directory (e.g. "
            f"--model.hf_path=/ckpt/Qwen2.5-32B), or model.preset to one of {', '.join(PRESETS)}"
        )
    if not model.hf_path:
        return PRESETS[model.preset]
    if hub_name(model.hf_path):
        return None  # read once fetched
    if not os.path.isfile(os.path.join(model.hf_path, "config.json")):
        problem = broken_link(model.hf_path) or "is not a checkpoint directory (no config.json)"
        raise ConfigError(
            f"model.hf_path = {model.hf_path!r} {problem}: set model.hf_path to a Qwen2.5 checkpoint directory"
        )
    # A config.json that is not JSON, lacks a size or names another architecture: a CheckpointError naming it.
    return read_hf_config(model.hf_path)


def _check_tokenizer_dir(cfg: Config) -> None:
    """model.tokenizer_path, when set, is a directory; the tokenizer's folder (it, else model.hf_path) holds
    tokenizer.json."""
    model = cfg.model
    if hub_name(model.tokenizer_path or model.hf_path):
        return  # checked once fetched
    if model.tokenizer_path and not os.path.isdir(model.tokenizer_path):
        problem = broken_link(model.tokenizer_path) or "is not a directory"
        raise ConfigError(
            f"model.tokenizer_path = {model.tokenizer_path!r} {problem}: set it to the "
            "folder holding tokenizer.json, or leave it empty"
        )
    tokenizer_key = "model.tokenizer_path" if model.tokenizer_path else "model.hf_path"
    tokenizer_dir = model.tokenizer_path or model.hf_path
    if tokenizer_dir and not os.path.isfile(os.path.join(tokenizer_dir, "tokenizer.json")):
        raise ConfigError(
            f"{tokenizer_key} = {tokenizer_dir!r} holds no tokenizer.json: set model.tokenizer_path to the folder "
            "that holds the checkpoint's tokenizer"
        )


def _check_data_paths(cfg: Config) -> None:
    """data.train_path and (when the run evaluates) data.eval_path are set, and are files or 'synthetic'; a
    real training set needs a tokenizer (only the synthetic task trains its own)."""
    model, data = cfg.model, cfg.data
    for key, what, also in (
        ("train_path", "DAPO-Math-17k", ""),
        ("eval_path", "AIME 2024", " (or turn evaluation off: eval.interval = 0, eval.at_start = eval.at_end = false)"),
    ):
        path = getattr(data, key)
        if not path and key == "eval_path" and not evaluates(cfg):
            continue  # no evaluation configured: no held-out set needed
        if not path:
            raise ConfigError(
                f"data.{key} is not set: set data.{key} to a parquet file in the {what} schema, or to 'synthetic'{also}"
            )
        if path != "synthetic" and not os.path.isfile(path) and not hub_name(path, splits=True):
            problem = "is a directory, not a file" if os.path.isdir(path) else broken_link(path) or "does not exist"
            raise ConfigError(
                f"data.{key} = {path!r} {problem}: set data.{key} to a parquet file in the "
                f"{what} schema, or to 'synthetic'"
            )
    if data.train_path != "synthetic" and not (model.tokenizer_path or model.hf_path):
        raise ConfigError(
            f"model.tokenizer_path is not set: data.train_path = {data.train_path!r} needs the "
            "tokenizer of model.hf_path or model.tokenizer_path (only the synthetic task trains its own)"
        )


def _check_sequences_fit(cfg: Config, max_positions: int | None) -> None:
    """The longest sequence the engine holds (prompt + response) fits the model's positions."""
    longest = cfg.engine_max_seq_len
    if max_positions is not None and longest > max_positions:
        raise ConfigError(
            f"data.max_prompt_length + the longest response = {longest} tokens exceed the model's "
            f"max_position_embeddings = {max_positions}"
        )
