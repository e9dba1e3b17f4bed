"""Run configuration, shared by train.py and eval.py.

A run is described by a TOML file whose tables are the sections of config/schema.py (`[job]`,
`[model]`, ...). Every key has a default there, so a file holds only what it changes. Values are
resolved in this order, the later winning:
  1. the defaults (for the algorithm: the DAPO recipe, arXiv 2503.14476 Sec. 4.1 and verl's script);
  2. the file named by a top-level `base = "other.toml"` key (resolved relative to the file that names
     it; bases may chain);
  3. the file itself;
  4. command-line overrides `--section.key=value` or `--section.key value`.
Each value is checked against its field's annotation, then against its bound and the rules of its
section (config/loader.py). Any problem raises `ConfigError` naming the key, where it was set and what
is wrong.

Settings that only matter when training starts (model and data paths) may stay unset in a recipe:
`check_runnable(cfg)` (preflight/checks.py) refuses them just before training, so `--dry-run` works on
shipped recipes.
"""

from config.cli import DEFAULT_CONFIG, config_parser, load_config, parse_cli, parse_config_args
from config.loader import sections, split_overrides, validate
from config.loader import to_dict as config_to_dict
from config.schema import Config
from errors import ConfigError

SECTIONS: dict[str, type] = sections(Config)

__all__ = [
    "DEFAULT_CONFIG",
    "SECTIONS",
    "Config",
    "ConfigError",
    "config_parser",
    "config_to_dict",
    "load_config",
    "parse_cli",
    "parse_config_args",
    "split_overrides",
    "validate",
]
