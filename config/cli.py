"""Command lines over the configuration: `--config FILE`, short flags, `--section.key=value` overrides."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from collections.abc import Callable, Sequence

from config.loader import load, split_overrides
from config.schema import Config
from model.hub import local_path

REPOSITORY = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_CONFIG = os.path.join(REPOSITORY, "configs", "demo_cpu.toml")
# The keys that name an input file or folder. A relative one is a path of the repository when a TOML file (or a
# default) gives it, as the shipped recipes' `bases/demo`; on the command line, of the working directory, as any
# shell argument, or else of the repository. Either way it is made absolute, unless it is a hub id (model/hub.py
# `local_path`), so the run folder's config.json records which it was. job.run_dir, an output, and the file of a
# reward.function "path/file.py:function" are made absolute the same way, but only against the working directory
# on the command line, and the repository in a file.
PATH_KEYS = ("model.hf_path", "model.tokenizer_path", "data.train_path", "data.eval_path")


def load_config(path: str | None = None, overrides: Sequence[str] = ()) -> Config:
    """Defaults, then the TOML file at `path` (and its bases), then `section.key=value` overrides; validated; paths
    made absolute (PATH_KEYS)."""
    return _absolute_paths(load(Config, path, overrides), {item.partition("=")[0] for item in overrides})


def config_parser(description: str, example: str) -> argparse.ArgumentParser:
    """An argument parser with `--config FILE` (default: the CPU demo recipe); `example` shows overrides."""
    parser = argparse.ArgumentParser(
        description=description,
        epilog=f"Any setting can be overridden after the file: --section.key=value or --section.key value, "
        f"e.g. {example}.",
    )
    parser.add_argument("--config", default=DEFAULT_CONFIG, help="TOML file (default: configs/demo_cpu.toml)")
    return parser


def parse_config_args(
    parser: argparse.ArgumentParser,
    argv: Sequence[str] | None = None,
    flags: Callable[[argparse.Namespace], list[str]] = lambda args: [],
) -> tuple[Config, argparse.Namespace]:
    """(configuration, parsed flags) of a command line: the `--config` file, then the overrides that
    `flags(args)` makes of short flags, then the `--section.key=value` overrides (kept in args.overrides)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    plain, overrides = split_overrides(argv)
    args = parser.parse_args(plain)
    args.overrides = overrides
    return load_config(args.config, [*flags(args), *overrides]), args


def absolute_spec(spec: str, base: str) -> str:
    """A "path/file.py:function" spec with its file (~ expanded) joined to the folder `base` and made absolute, so a
    worker finds it whatever its working directory; a "package.module:function" spec (or "") as it is."""
    target, _, name = spec.rpartition(":")
    if not target.endswith(".py"):
        return spec
    return f"{os.path.abspath(os.path.join(base, os.path.expanduser(target)))}:{name}"


def _absolute_paths(cfg: Config, command_line: set[str]) -> Config:
    """`cfg` with job.run_dir, reward.function's file and the values of PATH_KEYS absolute (`command_line`: the keys
    the command line set)."""
    here = os.getcwd()
    run_dir = os.path.join(here if "job.run_dir" in command_line else REPOSITORY, os.path.expanduser(cfg.job.run_dir))
    cfg = dataclasses.replace(cfg, job=dataclasses.replace(cfg.job, run_dir=os.path.abspath(run_dir)))
    spec = absolute_spec(cfg.reward.function, here if "reward.function" in command_line else REPOSITORY)
    cfg = dataclasses.replace(cfg, reward=dataclasses.replace(cfg.reward, function=spec))
    for key in PATH_KEYS:
        section, name = key.split(".")
        bases = (here, REPOSITORY) if key in command_line else (REPOSITORY,)
        value = local_path(getattr(getattr(cfg, section), name), bases, splits=section == "data")
        cfg = dataclasses.replace(cfg, **{section: dataclasses.replace(getattr(cfg, section), **{name: value})})
    return cfg


def parse_cli(argv: Sequence[str] | None = None) -> tuple[Config, argparse.Namespace]:
    """train.py: `--config PATH`, `--dry-run`, `--fresh`, `--rehearse` and any number of `--section.key=value` /
    `--section.key value`."""
    parser = config_parser(
        "DAPO training (Algorithm 1 of arXiv 2503.14476).",
        "--training.steps=10 --rollout.engine torch --optimizer.betas=0.9,0.95",
    )
    parser.add_argument("--dry-run", action="store_true", help="validate, print the resolved config as JSON, exit")
    parser.add_argument(
        "--fresh",
        action="store_true",
        help="start the run over: move an existing run folder aside (to <name>.old-<n>) first",
    )
    parser.add_argument(
        "--rehearse",
        action="store_true",
        help="print the run's per-GPU memory per phase, rehearsed on this CPU as one rank of the job ([rehearse])",
    )
    return parse_config_args(parser, argv)
