"""A model's parameters under the names of the plain module, without the components wrappers add.

Wrapping a module in another one adds a path component to every parameter name below it:
`torch.compile(module)` returns an OptimizedModule holding the module as `_orig_mod`, and torch's
`checkpoint_wrapper` holds a block as `_checkpoint_wrapped_module`. These components are not part of the
model's layout (checkpoint keys, HF names, engine weights), so they are dropped here, where parallel
code reads the parameters. parallel/ itself compiles and checkpoints blocks in place (compile.py,
activation_checkpoint.py), so the models it builds carry neither; a model wrapped from outside still
reads under its plain names.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

WRAPPER_COMPONENTS = ("_orig_mod", "_checkpoint_wrapped_module")


def plain_name(name: str) -> str:
    """`name` without the path components of WRAPPER_COMPONENTS ("layers.0._orig_mod.norm.weight" ->
    "layers.0.norm.weight")."""
    return ".".join(part for part in name.split(".") if part not in WRAPPER_COMPONENTS)


def plain_named_parameters(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(plain name, detached parameter) in the module's registration order; tensors are not copied."""
    for name, param in model.named_parameters():
        yield plain_name(name), param.detach()
