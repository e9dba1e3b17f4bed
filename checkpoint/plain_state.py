"""Checkpoint state as plain data: a JSON file for the structure, a safetensors file for the tensors.

Neither format can execute code when read (JSON is text; safetensors is a JSON header and raw bytes),
unlike a pickle, whose loading may call any importable function. What can be stored:

    None, bool, int, float (NaN and infinities included), str     as JSON values
    dict with str keys, list                                      as JSON objects and arrays
    tuple                                                         {"__tuple__": [...]}
    torch.Tensor (dense, any dtype safetensors has)               {"__tensor__": "t<k>"}, bytes in the safetensors file

Anything else (a dataclass, a numpy array, an int-keyed dict) is refused at save time with the path of
the value, so what is saved always loads back equal: tuples stay tuples, tensors keep dtype and shape.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from safetensors.torch import load_file, save

from checkpoint.files import WrittenFiles, write_file

_TUPLE, _TENSOR = "__tuple__", "__tensor__"

# What this module stores and reads back: None, bool, int, float, str, tensors, and lists, tuples and str-keyed
# dicts of them, of any nesting; checked at run time (encode), so Any to the type checker, as a JSON value is.
PlainData = Any


class PlainStateError(ValueError):
    """A value cannot be stored as plain data, or a stored file is not what this module writes."""


def encode(value: PlainData, tensors: dict[str, torch.Tensor], where: str = "state") -> Any:  # -> a JSON value
    """`value` as JSON-ready data; its tensors are added to `tensors` under generated names."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, torch.Tensor):
        name = f"t{len(tensors)}"
        tensors[name] = value.detach().to("cpu", copy=True).contiguous()  # a copy: safetensors refuses shared memory
        return {_TENSOR: name}
    if isinstance(value, tuple):
        return {_TUPLE: [encode(v, tensors, f"{where}[{i}]") for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [encode(v, tensors, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict):
        for key in value:
            if not isinstance(key, str):
                raise PlainStateError(f"{where}: dict key {key!r} is a {type(key).__name__}; plain data needs str keys")
        if len(value) == 1 and next(iter(value)) in (_TUPLE, _TENSOR):
            raise PlainStateError(
                f"{where}: a dict whose only key is {next(iter(value))!r} would read back as "
                f"another type; rename the key"
            )
        return {key: encode(v, tensors, f"{where}.{key}") for key, v in value.items()}
    raise PlainStateError(
        f"{where}: a {type(value).__module__}.{type(value).__qualname__} is not plain data "
        f"(None, bool, int, float, str, list, tuple, str-keyed dict, torch.Tensor); convert it "
        f"before saving"
    )


def decode(value: Any, tensors: dict[str, torch.Tensor], where: str = "state") -> PlainData:  # value: JSON
    """The inverse of `encode`."""
    if isinstance(value, list):
        return [decode(v, tensors, where) for v in value]
    if isinstance(value, dict):
        if len(value) == 1 and _TUPLE in value:
            return tuple(decode(v, tensors, where) for v in value[_TUPLE])
        if len(value) == 1 and _TENSOR in value:
            if value[_TENSOR] not in tensors:
                raise PlainStateError(f"{where}: tensor {value[_TENSOR]!r} is missing from the tensor file")
            return tensors[value[_TENSOR]]
        return {key: decode(v, tensors, where) for key, v in value.items()}
    return value


def save_plain(value: PlainData, json_path: str, tensors_path: str, written: WrittenFiles | None = None) -> None:
    """Write `value` to `json_path` (structure) and `tensors_path` (safetensors), each fsynced; their sizes
    and content hashes go to `written` (checkpoint/files.py)."""
    tensors: dict[str, torch.Tensor] = {}
    data = encode(value, tensors)
    written = written if written is not None else WrittenFiles(os.path.dirname(json_path))
    write_file(json_path, json.dumps(data).encode("utf-8"), written)
    write_file(tensors_path, save(tensors), written)


def load_plain(json_path: str, tensors_path: str) -> PlainData:
    """Read what `save_plain` wrote; raises PlainStateError naming the file if either is not readable."""
    try:
        with open(json_path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise PlainStateError(f"{json_path} is not readable JSON: {exc}") from exc
    try:
        tensors = load_file(tensors_path)
    except Exception as exc:  # safetensors raises its own SafetensorError for malformed headers
        raise PlainStateError(f"{tensors_path} is not a readable safetensors file: {exc}") from exc
    return decode(data, tensors, where=json_path)
