"""preflight/sglang_memory.py: SGLang 0.5.21's per-GPU memory plan, against hand-computed values."""

import pytest

from model.args import PRESETS, num_params
from preflight.sglang_memory import (
    GIB,
    MIB,
    EngineMemoryError,
    EngineMemoryPlan,
    chunked_prefill_size,
    cuda_graph_bytes,
    kv_cell_bytes,
    max_running_requests,
    plan_engine_memory,
    prefill_cuda_graph_sizes,
    weight_bytes_per_rank,
)

TINY = PRESETS["tiny"]  # vocab 256, hidden 64, 2 layers, 4 heads, 2 kv heads (head_dim 16), mlp 128, untied
QWEN32B = PRESETS["qwen2.5-32b"]


def test_weight_shard_per_tp_rank():
    # One rank holds the whole model: the parameter count (vocab 256 is already a multiple of 64).
    assert weight_bytes_per_rank(TINY, 1, 2) == num_params(TINY) * 2
    # 32B on 8 ranks, by hand: per layer q 5 heads + k, v 1 head each: 7 * 128 * (5120 + 1) = 4,588,416;
    # o 5120 * 640 = 3,276,800; mlp 3 * 5120 * 3456 = 53,084,160; norms 10,240 -> 60,959,616 x 64 layers
    # = 3,901,415,424; embedding and head 2 * 19,008 * 5120 = 194,641,920; final norm 5120.
    assert weight_bytes_per_rank(QWEN32B, 8, 2) == (3_901_415_424 + 194_641_920 + 5120) * 2
    # tiny on 4 ranks, 2 kv heads: each rank keeps one kv head (replicated), not half of one. Per layer
    # q, k, v one head each 3 * 16 * (64 + 1) = 3120, o 64 * 16 = 1024, mlp 3 * 64 * 32 = 6144, norms 128;
    # embedding and head 2 * 64 * 64 = 8192; final norm 64.
    assert weight_bytes_per_rank(TINY, 4, 1) == 2 * (3120 + 1024 + 6144 + 128) + 8192 + 64
    with pytest.raises(ValueError, match="must divide num_heads"):
        weight_bytes_per_rank(QWEN32B, 16, 2)
    # Vocabulary padded to a multiple of 64 before the split: 100 rows -> 128.
    odd = TINY.replace(vocab_size=100)
    assert weight_bytes_per_rank(TINY, 1, 1) - weight_bytes_per_rank(odd, 1, 1) == 2 * (256 - 128) * 64


def test_kv_cell_and_request_cap():
    assert kv_cell_bytes(TINY, 1, 2) == 2 * 2 * 16 * 2 * 2  # kv heads x (k, v) x head_dim x layers x bytes
    assert kv_cell_bytes(QWEN32B, 8, 2) == 1 * 2 * 128 * 64 * 2  # 8 kv heads over 8 ranks
    assert kv_cell_bytes(QWEN32B, 16, 2) == kv_cell_bytes(QWEN32B, 8, 2)  # fewer heads than ranks: one each
    assert max_running_requests(100_000, 1000) == 4096  # 100 x 512 capped at 4096
    assert max_running_requests(1000, 1000) == 500  # at most half the tokens
    assert max_running_requests(8000, 10_000) == 2048  # 409 raised to at least 2048 (below half the tokens)
    assert max_running_requests(10_000, 1000, requested=64) == 64


def test_kv_pool_from_free_memory_at_start():
    weights = num_params(TINY) * 2
    plan = plan_engine_memory(
        TINY,
        tp_size=1,
        dtype_bytes=2,
        gpu_total_bytes=GIB,
        gpu_free_bytes_at_start=GIB,
        mem_fraction_static=0.5,
        context_length=1000,
        untagged_bytes=0,
        disable_cuda_graph=True,
    )
    # rest = (pre - weights) - pre * (1 - 0.5) with pre = 1 GiB; 256 bytes per token.
    tokens = int(GIB - weights - GIB * 0.5) // 256
    requests = 4096  # tokens / 1000 * 512 is far above 4096
    assert plan == EngineMemoryPlan(
        weights=weights, kv_cache=tokens * 256 + (requests + 1) * 1004 * 4, cuda_graph=0, other=0, kv_tokens=tokens
    )


def test_what_the_trainer_holds_at_start_shrinks_the_pool():
    # Not mem_fraction_static x total: 10 GiB still held by the trainer cost 0.9 x 10 GiB of KV cache.
    common = dict(tp_size=8, dtype_bytes=2, gpu_total_bytes=80 * GIB, mem_fraction_static=0.9, context_length=22528)
    empty = plan_engine_memory(QWEN32B, gpu_free_bytes_at_start=79 * GIB, **common)
    busy = plan_engine_memory(QWEN32B, gpu_free_bytes_at_start=69 * GIB, **common)
    cell = kv_cell_bytes(QWEN32B, 8, 2)
    assert empty.weights == busy.weights
    assert abs((empty.kv_tokens - busy.kv_tokens) * cell - 0.9 * 10 * GIB) <= cell
    # The engine's untagged share is spent before its baseline: pre = 79 - 1 GiB.
    assert empty.kv_tokens == int((78 * GIB - empty.weights) - 78 * GIB * 0.1) // cell
    # Decode graphs of up to 512 requests on an 80 GB GPU with tp >= 4, 2 MiB each, and the 58 prefill graphs.
    assert empty.cuda_graph == (512 * 2 + 58 * 8) * MIB == cuda_graph_bytes(80 * GIB, 8)
    assert cuda_graph_bytes(80 * GIB, 2) == (256 * 2 + 58 * 8) * MIB


def test_prefill_cuda_graphs_are_counted():
    """Prefill graphs are on by default on CUDA (cuda_graph_config.py default_prefill_backend): SGLang reserves
    8 MiB for each captured size (memory_hook.py reserve_for_graph_mb), sizes up to chunked_prefill_size."""
    # chunked_prefill_size 8192 on an 80 GB GPU: 4..32 by 4 (8 sizes), 48..256 by 16 (14), 288..512 by 32 (8),
    # 576..1024 by 64 (8), 1280..4096 by 256 (12), 4608..8192 by 512 (8): 58 sizes.
    assert chunked_prefill_size(80 * GIB) == 8192 and len(prefill_cuda_graph_sizes(8192)) == 58
    assert prefill_cuda_graph_sizes(8192)[:3] == [4, 8, 12] and prefill_cuda_graph_sizes(8192)[-1] == 8192
    # 16 GB: chunked prefill 2048 -> 8 + 14 + 8 + 8 + 4 (1280..2048 by 256) = 42 sizes; 141 GB: 8192; 192 GB: 16384.
    assert len(prefill_cuda_graph_sizes(chunked_prefill_size(16 * GIB))) == 42
    assert chunked_prefill_size(141 * 10**9) == 8192 and chunked_prefill_size(192 * GIB) == 16384
    assert cuda_graph_bytes(80 * GIB, 2, prefill_graphs=False) == 256 * 2 * MIB
    # The old estimate counted decode graphs only: 58 x 8 MiB = 464 MiB per GPU were missing.
    assert cuda_graph_bytes(80 * GIB, 2) - 256 * 2 * MIB == 464 * MIB


def test_held_by_released_tags():
    plan = EngineMemoryPlan(weights=100, kv_cache=20, cuda_graph=3, other=7, kv_tokens=5)
    assert plan.held() == 130
    assert plan.held(["kv_cache", "weights"]) == 10
    # Graphs are not captured under the memory saver unless SGLANG_MEMORY_SAVER_CUDA_GRAPH is set: their tag
    # frees nothing (full_cuda_graph_backend.py, breakable_cuda_graph_backend.py).
    assert plan.held(("kv_cache", "weights", "cuda_graph")) == 10
    releasable = EngineMemoryPlan(
        weights=100, kv_cache=20, cuda_graph=3, other=7, kv_tokens=5, cuda_graph_releasable=True
    )
    assert releasable.held(("kv_cache", "weights", "cuda_graph")) == 7
    with pytest.raises(ValueError, match="unknown SGLang memory tags"):
        plan.held(["activations"])


def test_sglang_refuses_to_start_without_kv_memory():
    common = dict(tp_size=8, dtype_bytes=2, gpu_total_bytes=80 * GIB, context_length=22528)
    # A trainer still holding 70 GiB leaves 9 GiB: 0.9 of (9 - 1) GiB is less than the 7.6 GiB shard.
    with pytest.raises(EngineMemoryError, match=r"leave no memory for the KV cache .*_profile_available_bytes"):
        plan_engine_memory(QWEN32B, gpu_free_bytes_at_start=9 * GIB, mem_fraction_static=0.9, **common)
    with pytest.raises(EngineMemoryError, match="Not enough memory"):
        plan_engine_memory(
            TINY,
            tp_size=1,
            dtype_bytes=2,
            gpu_total_bytes=GIB,
            gpu_free_bytes_at_start=GIB,
            mem_fraction_static=0.5,
            untagged_bytes=0,
            page_size=1 << 40,
        )
    with pytest.raises(ValueError, match="mem_fraction_static"):
        plan_engine_memory(TINY, gpu_free_bytes_at_start=GIB, mem_fraction_static=1.2, **common)
