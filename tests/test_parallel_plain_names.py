"""parallel/plain_names.py: wrapper modules (torch.compile's, torch's checkpoint_wrapper) do not leak into the
names under which parallel code reads, exports and syncs the parameters."""

import os

import torch
from safetensors.torch import load_file
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from checkpoint.hf_export import export_hf
from model.args import PRESETS
from model.hf_adapter import iter_hf_tensors
from model.qwen2 import build_model
from parallel.plain_names import plain_name, plain_named_parameters


def _wrapped(model):
    """`model` with every block inside torch's checkpoint_wrapper, the whole inside torch.compile's wrapper."""
    for layer_id, block in list(model.layers.items()):
        model.layers[layer_id] = checkpoint_wrapper(block)
    return torch.compile(model)


def test_plain_name_drops_wrapper_components_only():
    assert plain_name("layers.3._checkpoint_wrapped_module.self_attn.k_proj.bias") == "layers.3.self_attn.k_proj.bias"
    assert plain_name("_orig_mod.layers.3._orig_mod.mlp.up_proj.weight") == "layers.3.mlp.up_proj.weight"
    assert plain_name("layers.3.mlp.up_proj.weight") == "layers.3.mlp.up_proj.weight"
    assert plain_name("layers.3.my_orig_mod.weight") == "layers.3.my_orig_mod.weight"  # whole components only


def test_wrapped_model_reads_under_plain_and_hf_names():
    plain = build_model(PRESETS["tiny"], seed=1)
    want = [(n, p.data_ptr()) for n, p in plain.named_parameters()]
    wrapped = _wrapped(plain)
    assert [n for n, _ in wrapped.named_parameters()][0].startswith("_orig_mod.")
    assert any("_checkpoint_wrapped_module" in n for n, _ in wrapped.named_parameters())
    assert [(n, t.data_ptr()) for n, t in plain_named_parameters(wrapped)] == want  # same tensors, no copies
    assert [n for n, _ in iter_hf_tensors(plain_named_parameters(wrapped))] == [
        n for n, _ in iter_hf_tensors(build_model(PRESETS["tiny"], seed=2))
    ]


def test_export_of_a_wrapped_model_equals_the_plain_models(tmp_path):
    export_hf(build_model(PRESETS["tiny"], seed=3), str(tmp_path / "plain"))
    export_hf(_wrapped(build_model(PRESETS["tiny"], seed=3)), str(tmp_path / "wrapped"))
    plain, wrapped = (load_file(os.path.join(tmp_path, d, "model.safetensors")) for d in ("plain", "wrapped"))
    assert plain.keys() == wrapped.keys()
    assert all(torch.equal(plain[k], wrapped[k]) for k in plain)
