"""Command lines over the configuration: `--config FILE`, short flags, `--section.key=value` overrides."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence

from config.loader import load, split_overrides
from config.schema import Config

DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "demo_cpu.toml")


def load_config(path: str | None = None, overrides: Sequence[str] = ()) -> Config:
    """Defaults, then the TOML file at `path` (and its bases), then `section.key=value` overrides; validated."""
    return load(Config, path, overrides)


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
