"""Parallel dimensions are validated against the world size and the model; float8 is refused where it cannot run.

The float8 conversion itself is checked in torchao's emulation mode (CPU): which linears are converted,
and that the float8 forward/backward stays close to fp32. The real float8 run is a GPU test.
"""

from __future__ import annotations

import pytest
import torch

from config.schema import ParallelismConfig
from model.args import PRESETS
from model.qwen2 import build_model
from parallel.dims import ParallelDims, check_tp_divides
from parallel.float8 import apply_float8, float8_module_filter
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
    with pytest.raises(TypeError, match="unknown option 'compiled'"):
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


def test_float8_refused_on_cpu():
    model = build_model(PRESETS["tiny"], seed=0)
    with pytest.raises(ValueError, match="float8 training needs a CUDA GPU"):
        apply_float8(model)
    with pytest.raises(ValueError, match="float8 training needs a CUDA GPU"):
        parallelize_qwen2(model, None, ParallelDims(world_size=1), float8=True, param_dtype=torch.float32)


def test_float8_filter_and_emulated_numerics():
    args = PRESETS["tiny"].replace(intermediate_size=120)  # 120 is not a multiple of 16: MLP stays bf16/fp32
    reference = build_model(args, seed=0)
    model = build_model(args, seed=0)
    apply_float8(model, emulate=True)
    converted = {n for n, m in model.named_modules() if type(m).__name__ == "Float8Linear"}
    assert converted == {f"layers.{i}.self_attn.{p}_proj" for i in range(2) for p in "qkvo"}
    assert not float8_module_filter(torch.nn.Linear(64, 64), "lm_head")
    tokens = torch.randint(0, args.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))

    def loss_and_grad(m):
        loss = torch.nn.functional.cross_entropy(m(tokens).flatten(0, 1), tokens.roll(-1, 1).flatten())
        loss.backward()
        return loss.item(), m.layers["0"].self_attn.q_proj.weight.grad.flatten()

    ref_loss, ref_grad = loss_and_grad(reference)
    f8_loss, f8_grad = loss_and_grad(model)
    cosine = torch.nn.functional.cosine_similarity(ref_grad, f8_grad, dim=0).item()
    print(f"float8 (emulated) loss {f8_loss:.5f} vs fp32 {ref_loss:.5f}; q_proj grad cosine {cosine:.4f}")
    # A quality threshold for a lossy format, not a rounding bound: e4m3 keeps 3 mantissa bits (2^-4 = 6% per
    # element), which the attention projections' sums average down to well under 1% of the loss.
    assert abs(f8_loss - ref_loss) < 1e-2 * abs(ref_loss) and f8_loss != ref_loss
    assert cosine > 0.95


@pytest.mark.gpu
def test_float8_training_on_gpu_matches_bf16():
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("float8 matmuls need compute capability >= 8.9")
    args = PRESETS["demo"]
    reference = build_model(args, device="cuda", dtype=torch.bfloat16, seed=0)
    model = build_model(args, device="cuda", dtype=torch.bfloat16, seed=0)
    apply_float8(model)
    gen = torch.Generator("cuda").manual_seed(0)
    tokens = torch.randint(0, args.vocab_size, (4, 256), device="cuda", generator=gen)
    losses = []
    for m in (reference, model):
        loss = torch.nn.functional.cross_entropy(m(tokens).float().flatten(0, 1), tokens.roll(-1, 1).flatten())
        loss.backward()
        losses.append(loss.item())
    assert abs(losses[0] - losses[1]) < 2e-2 * abs(losses[0]), losses


def _mixed_precision_worker(rank, world_size):
    from torch.distributed.fsdp import FSDPModule

    dims = ParallelDims(world_size=1)
    mesh = dims.build_mesh("cpu")
    model = build_model(PRESETS["tiny"], seed=0)
    parallelize_qwen2(model, mesh, dims)  # defaults: bf16 compute, fp32 reduction
    tokens = torch.randint(0, PRESETS["tiny"].vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    hidden = model(tokens, return_hidden=True)
    loss = hidden.float().square().mean()
    loss.backward()
    return {
        "fsdp": isinstance(model, FSDPModule),
        "compute": hidden.dtype,
        "loss": loss.item(),
        "master": {p.dtype for p in model.parameters()},
        "grads": {p.grad.dtype for p in model.parameters() if p.grad is not None},
    }


def test_one_rank_bf16_training_gets_fsdp_mixed_precision():
    from dist_utils import run_ranks

    out = run_ranks(_mixed_precision_worker, 1)[0]
    ref = build_model(PRESETS["tiny"], seed=0)
    tokens = torch.randint(0, PRESETS["tiny"].vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    ref_loss = ref(tokens, return_hidden=True).square().mean().item()
    assert out["fsdp"] and out["compute"] == torch.bfloat16
    assert out["master"] == {torch.float32} and out["grads"] == {torch.float32}
    # bf16 compute (eps 2^-7 = 7.8e-3): the loss squares the last bf16 activations (2 x half an ulp = 7.8e-3 relative)
    # after two layers of bf16 rounding; 2e-2 is 2.6 bf16 ulps.
    assert abs(out["loss"] - ref_loss) < 2e-2 * ref_loss and out["loss"] != ref_loss
