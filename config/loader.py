"""A generic loader for a configuration made of sections: one dataclass per TOML table.

It knows nothing of what the settings mean. Given the root dataclass (whose fields are the sections) it
  - reads a TOML file, after the file named by its top-level `base = "other.toml"` key (resolved relative
    to the file that names it; bases may chain);
  - applies command-line overrides `section.key=value` (text converted to the field's type);
  - checks every value against its field's annotation (ints widen to float; bool is not an int);
  - checks each field's bound (`bounded`, next to the field), then each section's cross-field
    `rules()`, then the root's `rules()` (rules across sections).
Every problem raises `ConfigError` naming the key, where it was set and what is wrong, with the closest
valid name for a misspelt section or key.
"""

from __future__ import annotations

import codecs
import dataclasses
import difflib
import math
import os
import tomllib
import types
import typing
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from errors import ConfigError, broken_link

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

Rule = tuple[str, bool, str]  # (key, holds, what it demands) as yielded by a `rules()` method
# An annotation as typing.get_type_hints returns it: a class, Literal[...], X | None, list[X], tuple[X, Y];
# typing has no type for such objects (TypeForm is not in Python 3.11), hence Any.
TypeForm = Any
_T = TypeVar("_T")
_Root = TypeVar("_Root", bound="DataclassInstance")


# ---------------------------------------------------------------------------------------- bounds


def bounded(default: _T, ok: Callable[[Any], bool], rule: str) -> _T:
    """A field with `default` whose value must satisfy `ok`; `rule` says what it demands ("must be ...")."""
    return dataclasses.field(default=default, metadata={"ok": ok, "rule": rule})


def at_least(default: _T, low: float, note: str = "") -> _T:
    """A field that must be >= low (`note` is appended to the rule, e.g. what 0 means)."""
    return bounded(default, lambda v: v >= low, f"must be >= {low}{note}")


def above(default: _T, low: float, note: str = "") -> _T:
    """A field that must be > low."""
    return bounded(default, lambda v: v > low, f"must be > {low}{note}")


def sections(root: type[DataclassInstance]) -> dict[str, type]:
    """{section name: its dataclass} of a root dataclass whose fields are all sections."""
    found: dict[str, type] = {}
    for f in dataclasses.fields(root):
        assert isinstance(f.default_factory, type), (
            f"{root.__name__}.{f.name} must be a section: field(default_factory=its class)"
        )
        found[f.name] = f.default_factory
    return found


# ---------------------------------------------------------------------------------------- types


class _Mismatch(Exception):
    pass


def _origin(tp: TypeForm) -> Any:
    """typing.get_origin(tp): list, tuple, Literal, a union, or None for a plain class. (Typed Any because
    typeshed's first overload, for ParamSpec arguments, is the one a checker picks for an Any argument.)"""
    return typing.get_origin(tp)


def _items(tp: TypeForm, n: int) -> list[TypeForm] | None:
    """Element types of a list/tuple type for `n` elements, or None when `n` does not fit the type."""
    args = typing.get_args(tp)
    if _origin(tp) is list or args[-1] is Ellipsis:
        return [args[0]] * n
    return list(args) if len(args) == n else None


def _type_name(tp: TypeForm) -> str:
    origin, args = _origin(tp), typing.get_args(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " or ".join("none" if a is type(None) else _type_name(a) for a in args)
    if origin in (tuple, list):
        if origin is list or args[-1] is Ellipsis:
            return f"a list of {_type_name(args[0])}"
        return f"a list of {len(args)} values ({', '.join(_type_name(a) for a in args)})"
    return {bool: "a bool (true/false)", int: "an int", float: "a number", str: "a string"}.get(tp, str(tp))


def _check_value(value: Any, tp: TypeForm) -> Any:
    """Return a TOML-native `value` as type `tp` (ints widen to float); raise _Mismatch otherwise."""
    origin, args = _origin(tp), typing.get_args(tp)
    if tp in (bool, int, str) and type(value) is tp:  # type(): a bool is not an int here
        return value
    if tp is float and type(value) in (int, float):
        if not math.isfinite(value):
            raise _Mismatch("a finite number")
        return float(value)
    if origin is Literal:
        if isinstance(value, str) and value in args:  # every Literal here is a set of strings
            return value
    elif origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        for arg in args:
            try:
                return _check_value(value, arg)
            except _Mismatch:
                pass
    elif (
        origin in (tuple, list)
        and isinstance(value, (list, tuple))
        and (item_types := _items(tp, len(value))) is not None
    ):
        return origin(_check_value(v, a) for v, a in zip(value, item_types))
    raise _Mismatch(_type_name(tp))


def _parse_text(text: str, tp: TypeForm) -> Any:
    """Convert a command-line string to type `tp` (bool: true/false/1/0; lists: `a,b` or `[a, b]`)."""
    origin, args = _origin(tp), typing.get_args(tp)
    try:
        if tp is str:
            return text
        if tp is bool:
            return {"true": True, "1": True, "false": False, "0": False}[text.strip().lower()]
        if tp in (int, float):
            return tp(text)
    except (KeyError, ValueError):
        raise _Mismatch(_type_name(tp)) from None
    if origin is Literal:
        return next((a for a in args if str(a) == text.strip()), text)  # no match: _check_value names the choices
    if origin in (typing.Union, types.UnionType):
        if type(None) in args and text.strip().lower() in ("none", "null"):
            return None
        for arg in args:
            try:
                return _check_value(_parse_text(text, arg), arg)
            except _Mismatch:
                pass
    elif origin in (tuple, list):
        if text.strip().startswith("["):
            try:
                return tomllib.loads(f"v = {text}")["v"]
            except tomllib.TOMLDecodeError:
                raise _Mismatch(_type_name(tp)) from None
        items = [t.strip() for t in text.split(",")] if text.strip() else []
        item_types = _items(tp, len(items))
        if item_types is not None:
            return [_parse_text(t, a) for t, a in zip(items, item_types)]
    raise _Mismatch(_type_name(tp))


def coerce(value: Any, tp: TypeForm, key: str, source: str, from_text: bool = False) -> Any:
    """`value` (TOML-native, or command-line text when `from_text`) as type `tp`; ConfigError naming `key`."""
    try:
        return _check_value(_parse_text(value, tp) if from_text else value, tp)
    except _Mismatch as e:
        expected = str(e)
        if _origin(tp) is Literal:
            raise ConfigError(f"{key} = {value!r} ({source}): unknown value; expected {expected}") from None
        raise ConfigError(f"{key} = {value!r} ({source}): wrong type; {key} expects {expected}") from None


# ---------------------------------------------------------------------------------------- loading


class _Schema:
    """The sections of a root dataclass and their keys' types, for lookups and "did you mean" hints."""

    def __init__(self, root: type[DataclassInstance]) -> None:
        self.sections = sections(root)
        self.types = {name: typing.get_type_hints(cls) for name, cls in self.sections.items()}  # {section: {key: type}}

    def unknown(self, section: str, key: str | None, source: str) -> ConfigError:
        """The error for an unknown section (key None) or key, with the closest valid name."""
        if key is None:
            guess = difflib.get_close_matches(section, self.sections, n=1)
            hint = f"did you mean [{guess[0]}]?" if guess else f"valid sections: {', '.join(self.sections)}"
            return ConfigError(f"unknown section [{section}] ({source}); {hint}")
        if not section:  # a bare key at the top of a file, outside any [section] table
            guess = [f"{s}.{key}" for s in self.sections if key in self.types[s]]
            hint = f"; did you mean '{guess[0]}' (under [{guess[0].split('.')[0]}])?" if guess else ""
            return ConfigError(
                f"unknown top-level key '{key}' ({source}): only 'base' and [section] tables are allowed{hint}"
            )
        # A key of another section first (`lr` under [training]), then the closest spelling in this section.
        guess = [f"{s}.{key}" for s in self.sections if key in self.types[s]] or [
            f"{section}.{g}" for g in difflib.get_close_matches(key, self.types[section], n=1)
        ]
        hint = (
            f"did you mean '{guess[0]}'?" if guess else f"valid keys of [{section}]: {', '.join(self.types[section])}"
        )
        return ConfigError(f"unknown key '{section}.{key}' ({source}); {hint}")

    def type_of(self, section: str, key: str, source: str) -> TypeForm:
        if section not in self.sections:
            raise self.unknown(section, None, source)
        if key not in self.types[section]:
            raise self.unknown(section, key, source)
        return self.types[section][key]


def _read_file(
    schema: _Schema,
    path: str,
    values: dict[str, dict[str, Any]],
    origins: dict[str, str],
    chain: tuple[str, ...] = (),
) -> None:
    """Merge `path` (after its `base`, if any) into `values`; record each key's source in `origins`."""
    real = os.path.realpath(path)
    if real in chain:
        raise ConfigError(f"{path}: base files form a cycle: {' -> '.join(chain + (real,))}")
    try:
        with open(path, "rb") as f:  # a UTF-8 byte-order mark (Windows editors write one) is not TOML: dropped
            data = tomllib.loads(f.read().removeprefix(codecs.BOM_UTF8).decode())
    except OSError as e:
        if broken_link(path):
            raise ConfigError(f"config file {path} {broken_link(path)}") from None
        if isinstance(e, FileNotFoundError):
            raise ConfigError(f"config file not found: {path}") from None
        raise ConfigError(f"cannot read config file {path}: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:  # the message carries "(at line L, column C)"
        raise ConfigError(f"{path}: invalid TOML: {e}") from None
    except UnicodeDecodeError as e:  # TOML files are UTF-8 by definition
        line = e.object[: e.start].count(b"\n") + 1
        raise ConfigError(
            f"{path}: not UTF-8 text (byte 0x{e.object[e.start]:02x} at line {line}): save the file as UTF-8"
        ) from None
    base = data.pop("base", None)
    if base is not None:
        if not isinstance(base, str):
            raise ConfigError(f"{path}: base must be the path of another TOML file, got {base!r}")
        base_path = os.path.join(os.path.dirname(path), base)
        if not os.path.isfile(base_path):
            why = broken_link(base_path) or "not found"
            raise ConfigError(f"{path}: base file {base!r} {why} (looked for {base_path})")
        _read_file(schema, base_path, values, origins, chain + (real,))
    for section, table in data.items():
        if not isinstance(table, dict):
            if section in schema.sections:
                raise ConfigError(f"{path}: '{section}' must be a table ([{section}]), got {table!r}")
            raise schema.unknown("", section, path)
        for key, value in table.items():
            tp = schema.type_of(section, key, path)
            values.setdefault(section, {})[key] = coerce(value, tp, f"{section}.{key}", path)
            origins[f"{section}.{key}"] = path


def _split_override(item: str) -> tuple[str, str, str]:
    text = item[2:] if item.startswith("--") else item
    name, sep, value = text.partition("=")
    section, dot, key = name.partition(".")
    if not sep or not dot or not section or not key:
        raise ConfigError(f"override {item!r} (command line) is not of the form section.key=value")
    return section, key, value


def load(root: type[_Root], path: str | None = None, overrides: Sequence[str] = ()) -> _Root:
    """An instance of `root`: its defaults, then the TOML file at `path` (and its bases), then the
    `section.key=value` overrides; validated (`validate`)."""
    schema = _Schema(root)
    values: dict[str, dict[str, Any]] = {}
    origins: dict[str, str] = {}
    if path is not None:
        _read_file(schema, path, values, origins)
    for item in overrides:
        section, key, text = _split_override(item)
        tp = schema.type_of(section, key, "command line")
        values.setdefault(section, {})[key] = coerce(text, tp, f"{section}.{key}", "command line", True)
        origins[f"{section}.{key}"] = "command line"
    cfg = root(**{name: cls(**values.get(name, {})) for name, cls in schema.sections.items()})
    validate(cfg, origins)
    return cfg


def split_overrides(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """(plain arguments, `section.key=value` overrides) of a command line; an override is written
    `--section.key=value` or `--section.key value`."""
    plain: list[str] = []
    overrides: list[str] = []
    items = iter(argv)
    for arg in items:
        name = arg[2:].partition("=")[0] if arg.startswith("--") else ""
        if "." not in name:
            plain.append(arg)
        elif "=" in arg:
            overrides.append(arg[2:])
        elif (value := next(items, "--")).startswith("--"):
            raise ConfigError(f"{arg} (command line) needs a value: {arg}=VALUE or {arg} VALUE")
        else:
            overrides.append(f"{name}={value}")
    return plain, overrides


def to_dict(cfg: DataclassInstance) -> dict[str, dict[str, Any]]:
    """{section: {key: value}} with tuples as lists: JSON-serialisable."""
    return {
        name: {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(getattr(cfg, name)).items()}
        for name in sections(type(cfg))
    }


# ---------------------------------------------------------------------------------------- validation


def _rules(obj: object) -> Iterable[Rule]:
    method = getattr(obj, "rules", None)
    return method() if method is not None else ()


def validate(cfg: DataclassInstance, origins: dict[str, str] | None = None) -> None:
    """Check each field's bound, then each section's `rules()`, then the root's; raise ConfigError on the
    first that fails. Rules are generators, so a later rule may rely on the ones before it holding.

    `origins` maps "section.key" to where it was set (a file or "command line"); `load` passes it so
    that errors say which file to fix. Without it (a configuration edited in code) errors name only the key.
    """

    def fail(key: str, rule: str) -> typing.NoReturn:
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        where = "" if origins is None else f" ({origins.get(key, 'default')})"
        raise ConfigError(f"{key} = {value!r}{where}: {rule}")

    for name in sections(type(cfg)):
        section = getattr(cfg, name)
        for f in dataclasses.fields(section):
            ok = f.metadata.get("ok")
            if ok is not None and not ok(getattr(section, f.name)):
                fail(f"{name}.{f.name}", f.metadata["rule"])
        for key, holds, rule in _rules(section):
            if not holds:
                fail(f"{name}.{key}", rule)
    for key, holds, rule in _rules(cfg):
        if not holds:
            fail(key, rule)
