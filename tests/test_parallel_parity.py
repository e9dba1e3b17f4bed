"""Sharded training equals single-process training: FSDP=2, HSDP 2x1, TP=2 and FSDP 2 x TP 2 (gloo, fp32), with every
weight trained and with LoRA adapters on the frozen model (parallel/lora.py).

Every configuration runs the same DAPO-style token-level loss over packed micro-batches,
    loss_mb = -sum_tokens(A * mask * logp) / N_global,
where N_global counts the valid tokens of the whole mini-batch across all micro-batches and data-parallel
ranks, and the ranks hold micro-batches of different token counts. Summed over ranks (FSDP's gradient SUM),
the gradients must equal those of the single-process model on the whole mini-batch; so must the loss, the
total gradient norm used for clipping, every parameter after one clipped AdamW step, and the loss after that
step. The measured maximum errors are printed. With LoRA the trained parameters are the adapters, B set to seeded
random values first (at B = 0, A would get no gradient).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from dist_utils import packed_row, run_ranks
from numerics import assert_close_to_float64
from torch.distributed.tensor import DTensor

from model.args import PRESETS
from model.qwen2 import build_model
from parallel.dims import ParallelDims
from parallel.grad_clip import clip_grad_norm_
from parallel.logprob import vocab_parallel_token_logprobs
from parallel.lora import Adapters, _copy_full, adapted_linears, adapters_of, apply_lora
from parallel.parallelize import parallelize_qwen2

# Document lengths of each packed row, per dp rank: unequal document mixes and token counts.
MIXED_ROWS = [
    [[5, 7], [3, 4, 9]],  # dp rank 0: two micro-batches of 12 and 16 tokens
    [[16], [2, 10]],  # dp rank 1: 16 and 12 tokens
]
# Same mixes with every row 12 tokens long: one shape, so compiled blocks trace once.
EQUAL_ROWS = [
    [[5, 7], [3, 4, 5]],
    [[12], [2, 10]],
]


LORA = Adapters(2, 4.0, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"))


def _random_b(model):
    """Every adapter B set to seeded N(0, 0.3^2) values, the same full tensors on every rank (each keeps its part)."""
    g = torch.Generator().manual_seed(1)
    for _, linear in adapted_linears(model, adapters_of(model).targets):
        _copy_full(linear.lora_B, 0.3 * torch.randn(linear.lora_B.shape, generator=g))


def _trained(model):
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def _batches(num_dp: int, rows=MIXED_ROWS, seed: int = 0) -> list[list[dict]]:
    """Packed micro-batches for each of `num_dp` data-parallel ranks."""
    g = torch.Generator().manual_seed(seed)
    return [[packed_row(docs, PRESETS["tiny"].vocab_size, g) for docs in rows[r]] for r in range(num_dp)]


def _microbatch_loss(model, mb, global_tokens):
    hidden = model(mb["tokens"], mb["positions"], mb["document_ids"], return_hidden=True)
    logp, _ = vocab_parallel_token_logprobs(hidden, model.output_weight(), mb["targets"], chunk_size=8)
    return -(logp * mb["advantages"] * mb["mask"]).sum() / global_tokens


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def _optimizer(model):
    # eps 1e-6: k_proj's bias has an exactly-zero true gradient (softmax is shift-invariant), and Adam's
    # first step would amplify its rounding noise to about lr with a smaller eps.
    return torch.optim.AdamW([p for _, p in _trained(model)], lr=1e-3, eps=1e-6, weight_decay=0.1)


def _train_step(model, my_batches, global_tokens, dp_group):
    """Forward/backward over this rank's micro-batches, one AdamW step, and the loss afterwards."""
    loss = torch.zeros((), dtype=next(model.parameters()).dtype)
    for mb in my_batches:
        micro = _microbatch_loss(model, mb, global_tokens)
        micro.backward()
        loss += micro.detach()
    grads = {n: _full(p.grad).clone() for n, p in _trained(model)}
    # A small max norm, so clipping is active: its total norm spans FSDP- and TP-sharded gradients.
    grad_norm = clip_grad_norm_([p for _, p in _trained(model)], max_norm=0.05)
    _optimizer(model).step()
    params = {n: _full(p.detach()).clone() for n, p in model.named_parameters()}
    # Same forward as training (grad mode on), so compiled blocks reuse their graphs.
    after = sum((_microbatch_loss(model, mb, global_tokens).detach() for mb in my_batches), torch.zeros(()))
    if dp_group is not None:
        dist.all_reduce(loss, group=dp_group)
        dist.all_reduce(after, group=dp_group)
    return {"loss": loss, "grads": grads, "params": params, "loss_after": after, "grad_norm": grad_norm}


def _reference(preset, batches, dtype=torch.float32, lora=None):
    model = build_model(PRESETS[preset], seed=0)
    if lora is not None:
        apply_lora(model, lora)
        _random_b(model)
    model = model.to(dtype)
    flat = [mb for rank_batches in batches for mb in rank_batches]
    global_tokens = sum(mb["mask"].sum() for mb in flat)
    out = _train_step(model, flat, global_tokens, None)
    out["grad_norm"] = out["grad_norm"].to(dtype)  # clip_grad_norm_ reports fp32
    return out


def _sharded_worker(rank, world_size, presets, dims_kwargs, batches, parallel_kwargs=None):
    dims = ParallelDims(world_size=world_size, **dims_kwargs)
    mesh = dims.build_mesh("cpu")
    results = {}
    for preset in presets:
        model = build_model(PRESETS[preset], seed=0)
        parallelize_qwen2(
            model, mesh, dims, param_dtype=torch.float32, reduce_dtype=torch.float32, **(parallel_kwargs or {})
        )
        if adapters_of(model) is not None:
            _random_b(model)
        my_batches = batches[dims.dp_rank()]
        # The global token count is what the trainer all-reduces over the dp ranks.
        global_tokens = sum(mb["mask"].sum() for mb in my_batches).reshape(1)
        dp_group = dims.dp_mesh().get_group()
        dist.all_reduce(global_tokens, group=dp_group)
        results[preset] = _train_step(model, my_batches, global_tokens[0], dp_group)
    return results if rank == 0 else None


def _max_errors(out, ref):
    errors = {key: (out[key] - ref[key]).abs().item() for key in ("loss", "loss_after", "grad_norm")}
    assert ref["grad_norm"] > 0.05, "clipping should be active in this test"
    assert out["grads"].keys() == ref["grads"].keys(), "sharded model has different parameter names"
    errors["grad"] = max((out["grads"][n] - ref["grads"][n]).abs().max().item() for n in ref["grads"])
    errors["param"] = max((out["params"][n] - ref["params"][n]).abs().max().item() for n in ref["params"])
    worst = max(ref["grads"], key=lambda n: (out["grads"][n] - ref["grads"][n]).abs().max().item())
    return errors, worst


def _check(
    label,
    dims_kwargs,
    world_size,
    num_dp,
    presets=("tiny", "tiny-tied"),
    parallel_kwargs=None,
    rows=MIXED_ROWS,
    start="fork",
):
    """Run the sharded configuration and compare it with the single-process model (also used by other test files);
    `start`: how the ranks start (tests/dist_utils.py run_ranks)."""
    batches = _batches(num_dp, rows)
    results = run_ranks(_sharded_worker, world_size, presets, dims_kwargs, batches, parallel_kwargs, start=start)[0]
    lora = (parallel_kwargs or {}).get("lora")
    for preset in presets:
        ref, ref64 = _reference(preset, batches, lora=lora), _reference(preset, batches, torch.float64, lora=lora)
        probe = "layers.0.mlp.down_proj." + ("lora_A" if lora else "weight")
        assert ref["grads"][probe].abs().max() > 1e-4, "reference gradient is trivially small"
        out = results[preset]
        errors, worst = _max_errors(out, ref)
        print(f"{label} {preset}: max abs errors {errors} (largest gradient error in {worst})")
        # Equal within fp32 rounding: measured against the single process in float64 (tests/numerics.py).
        for key in ("loss", "loss_after", "grad_norm"):
            assert_close_to_float64(out[key], ref[key], ref64[key], f"{label} {preset}: {key}")
        for key in ("grads", "params"):
            names = list(ref[key])
            assert_close_to_float64(
                [out[key][n] for n in names],
                [ref[key][n] for n in names],
                [ref64[key][n] for n in names],
                f"{label} {preset}: {key} (worst gradient: {worst})",
            )


def test_fsdp2_matches_single_process():
    _check("FSDP=2", {"dp_shard": 2}, world_size=2, num_dp=2)


@pytest.mark.parametrize(
    "label,dims_kwargs,num_dp,ac",
    [
        ("LoRA FSDP=2", {"dp_shard": 2}, 2, "none"),
        ("LoRA TP=2 + per-op AC", {"dp_shard": 1, "tp": 2}, 1, "selective"),
    ],
)
def test_lora_sharded_matches_single_process(label, dims_kwargs, num_dp, ac):
    """Only the adapters train (their gradients, the clipped norm and the step), and FSDP's units and the TP plan
    (A replicated / B sharded for a column-wise base, the reverse for a row-wise one) change no value."""
    parallel = {"lora": LORA, "activation_checkpoint": ac, "ac_every_k_blocks": 0}
    _check(label, dims_kwargs, world_size=2, num_dp=num_dp, parallel_kwargs=parallel)


def test_hsdp_replicate2_matches_single_process():
    _check("HSDP 2x1", {"dp_replicate": 2, "dp_shard": 1}, world_size=2, num_dp=2, presets=("tiny",))


def test_tp2_matches_single_process():
    _check("TP=2", {"dp_shard": 1, "tp": 2}, world_size=2, num_dp=1)


@pytest.mark.multiprocess
def test_fsdp2_tp2_matches_single_process():
    _check("FSDP=2 x TP=2", {"dp_shard": 2, "tp": 2}, world_size=4, num_dp=2)


def _average_vs_sum_worker(rank, world_size, batches):
    from torch.distributed.fsdp import fully_shard

    dims = ParallelDims(dp_shard=2, world_size=world_size)
    mesh = dims.build_mesh("cpu")
    my_batches = batches[rank]
    global_tokens = sum(mb["mask"].sum() for rank_batches in batches for mb in rank_batches)
    grads = {}
    for kind in ("ours", "fsdp-default"):
        model = build_model(PRESETS["tiny"], seed=0)
        if kind == "ours":
            parallelize_qwen2(model, mesh, dims, param_dtype=torch.float32, reduce_dtype=torch.float32)
        else:  # torch's default reduction: the average over dp ranks
            for block in model.layers.values():
                fully_shard(block, mesh=mesh["dp_shard"])
            fully_shard(model, mesh=mesh["dp_shard"])
        if kind == "ours":
            # Outside a forward, FSDP holds the head as a dp-sharded DTensor: using it for log-probs is refused.
            try:
                mb = my_batches[0]
                vocab_parallel_token_logprobs(torch.zeros(1, 64), model.output_weight(), mb["targets"][:, :1])
                grads["sharded head"] = None
            except ValueError as e:
                grads["sharded head"] = str(e)
        for mb in my_batches:
            _microbatch_loss(model, mb, global_tokens).backward()
        grads[kind] = {n: _full(p.grad) for n, p in model.named_parameters()}
    return grads if rank == 0 else None


def test_unequal_token_counts_global_mean_is_exact():
    """Ranks hold different numbers of micro-batches' valid tokens; each micro-batch loss is divided by
    the global count. Our FSDP setup (gradient SUM) reproduces the whole-batch token-mean gradient; FSDP's
    default average is off by exactly the dp size, which is what the divide factor of 1 prevents."""
    batches = _batches(2)
    counts = [sum(int(mb["mask"].sum()) for mb in rank_batches) for rank_batches in batches]
    assert counts[0] != counts[1], counts
    grads = run_ranks(_average_vs_sum_worker, 2, batches)[0]
    global_tokens = sum(mb["mask"].sum() for rank_batches in batches for mb in rank_batches)
    ref, ref64 = {}, {}
    for dtype, out in ((torch.float32, ref), (torch.float64, ref64)):
        model = build_model(PRESETS["tiny"], seed=0).to(dtype)
        for rank_batches in batches:
            for mb in rank_batches:
                _microbatch_loss(model, mb, global_tokens).backward()
        out.update({n: p.grad for n, p in model.named_parameters()})
    names = list(ref)
    ours = max((grads["ours"][n] - ref[n]).abs().max().item() for n in ref)
    halved = max((grads["fsdp-default"][n] * 2 - ref[n]).abs().max().item() for n in ref)
    print(f"global token mean: sum-reduction error {ours:.3g}; default average x2 error {halved:.3g}")
    expected = ([ref[n] for n in names], [ref64[n] for n in names])
    assert_close_to_float64([grads["ours"][n] for n in names], *expected, "sum reduction")
    # The default is exactly the mean over ranks, i.e. half the true gradient (x2 is exact in binary).
    assert_close_to_float64([grads["fsdp-default"][n] * 2 for n in names], *expected, "default average x 2")
    assert max((grads["fsdp-default"][n] - ref[n]).abs().max().item() for n in ref) > 1e-3
    assert grads["sharded head"] is not None and "not tensor-parallel" in grads["sharded head"]


@pytest.mark.parametrize(
    "label,dims_kwargs,num_dp,ac",
    [
        ("FSDP=2 + full AC", {"dp_shard": 2}, 2, "full"),  # recomputation re-gathers the resharded block
        ("TP=2 + per-op AC", {"dp_shard": 1, "tp": 2}, 1, "selective"),  # recomputation inside TP collectives
    ],
)
def test_activation_checkpointing_under_sharding_matches(label, dims_kwargs, num_dp, ac):
    _check(
        label,
        dims_kwargs,
        world_size=2,
        num_dp=num_dp,
        presets=("tiny",),
        parallel_kwargs={"activation_checkpoint": ac, "ac_every_k_blocks": 0},
    )
