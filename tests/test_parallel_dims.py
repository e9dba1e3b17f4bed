"""Parallel dimensions are validated against the world size and the model."""

from __future__ import annotations

import pytest
import torch

from config.schema import ParallelismConfig
from model.args import PRESETS
from model.qwen2 import build_model
from parallel.dims import ParallelDims, check_tp_divides
from parallel.parallelize import parallelize_qwen2


def test_dp_shard_takes_the_rest_of_the_world():
    dims = ParallelDims(dp_replicate=2, tp=2, world_size=16)
    assert (dims.dp_replicate, dims.dp_shard, dims.tp, dims.dp) == (2, 4, 2, 8)
    assert dims.hsdp_enabled and dims.tp_enabled and dims.fsdp_enabled
    single = ParallelDims(world_size=1)
    assert single.dp == 1 and not single.fsdp_enabled and not single.tp_enabled


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"tp": 3, "world_size": 8}, "not divisible by dp_replicate \\* tp"),
        ({"dp_shard": 2, "tp": 2, "world_size": 8}, "does not equal the world size 8"),
        ({"tp": 0, "world_size": 4}, "ParallelDims.tp must be a positive integer"),
        ({"dp_shard": -2, "world_size": 4}, "dp_shard must be a positive integer or -1"),
    ],
)
def test_inconsistent_dims_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ParallelDims(**kwargs)


@pytest.mark.parametrize("tp,kv_heads,field", [(8, 4, "num_heads"), (4, 6, "num_kv_heads")])
def test_tp_must_divide_heads_and_kv_heads(tp, kv_heads, field):
    args = PRESETS["tiny"].replace(num_heads=12, hidden_size=96, num_kv_heads=kv_heads)
    with pytest.raises(ValueError, match=f"does not divide the model's {field}"):
        check_tp_divides(args, tp)


def test_tp_must_divide_vocabulary():
    with pytest.raises(ValueError, match="vocab_size"):
        check_tp_divides(PRESETS["tiny"].replace(vocab_size=255), 2)
    check_tp_divides(PRESETS["tiny"], 2)  # divisible: accepted


def test_mesh_needs_a_process_group():
    with pytest.raises(RuntimeError, match="initialised process group"):
        ParallelDims(world_size=1).build_mesh("cpu")


def test_single_process_parallelize_applies_ac_only_and_rejects_unknown_options():
    model = build_model(PRESETS["tiny"], seed=0)
    parallelize_qwen2(model, None, ParallelDims(world_size=1), activation_checkpoint="full", param_dtype=torch.float32)
    assert all(getattr(b.forward, "__wrapped__", None) is not None for b in model.layers.values())
    with pytest.raises(TypeError, match="unexpected keyword argument 'compiled'"):
        parallelize_qwen2(model, None, ParallelDims(world_size=1), compiled=True)
    # bf16 compute on fp32 weights is FSDP's mixed precision: without a process group it is refused up front.
    fresh = build_model(PRESETS["tiny"], seed=0)
    with pytest.raises(ValueError, match="mixed precision runs through FSDP"):
        parallelize_qwen2(fresh, None, ParallelDims(world_size=1), activation_checkpoint="full")
    assert all(getattr(b.forward, "__wrapped__", None) is None for b in fresh.layers.values())


def test_parallelize_reads_the_parallelism_section_and_leaves_it_unchanged():
    # The [parallelism] section as train.py loads it: dtypes by name, AC every 2nd block of the 2.
    section = ParallelismConfig(param_dtype="float32", activation_checkpoint="selective", ac_every_k_blocks=2)
    model = build_model(PRESETS["tiny"], seed=0)
    assert len(model.layers) == 2
    parallelize_qwen2(model, None, ParallelDims(world_size=1), section)
    wrapped = [getattr(b.forward, "__wrapped__", None) is not None for b in model.layers.values()]
    assert wrapped == [True, False]
    # A keyword override applies to this call only; the section keeps its values.
    fresh = build_model(PRESETS["tiny"], seed=0)
    parallelize_qwen2(fresh, None, ParallelDims(world_size=1), section, activation_checkpoint="full")
    assert all(getattr(b.forward, "__wrapped__", None) is not None for b in fresh.layers.values())
    assert section == ParallelismConfig(param_dtype="float32", activation_checkpoint="selective", ac_every_k_blocks=2)
    # The section's bf16 default over fp32 weights is mixed precision: refused without a process group.
    with pytest.raises(ValueError, match="param_dtype torch.bfloat16 differs"):
        parallelize_qwen2(build_model(PRESETS["tiny"], seed=0), None, ParallelDims(world_size=1), ParallelismConfig())
