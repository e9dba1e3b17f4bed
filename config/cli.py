"""train.py's command line: `--config PATH`, `--dry-run`, `--fresh` and `--section.key=value` overrides."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from config.loader import load, split_overrides
from config.schema import Config

DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "demo_cpu.toml")


def load_config(path: str | None = None, overrides: Sequence[str] = ()) -> Config:
    """Defaults, then the TOML file at `path` (and its bases), then `section.key=value` overrides; validated."""
    return load(Config, path, overrides)


def parse_cli(argv: Sequence[str] | None = None) -> tuple[Config, argparse.Namespace]:
    """`--config PATH`, `--dry-run`, `--fresh` and any number of `--section.key=value` / `--section.key value`."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        description="DAPO training (Algorithm 1 of arXiv 2503.14476).",
        epilog="Any setting can be overridden after the file: --section.key=value or --section.key value, "
               "e.g. --training.steps=10 --rollout.engine torch --optimizer.betas=0.9,0.95.")
    parser.add_argument("--config", default=DEFAULT_CONFIG, help="TOML file (default: configs/demo_cpu.toml)")
    parser.add_argument("--dry-run", action="store_true", help="validate, print the resolved config as JSON, exit")
    parser.add_argument("--fresh", action="store_true",
                        help="start the run over: move an existing run folder aside (to <name>.old-<n>) first")
    plain, overrides = split_overrides(argv)
    args = parser.parse_args(plain)
    args.overrides = overrides
    return load_config(args.config, overrides), args
