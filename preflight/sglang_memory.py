"""How much GPU memory an SGLang 0.5.21 engine takes on each GPU of its tensor-parallel group.

A pure function of the model shape, the engine's options and the memory free when the engine starts,
following the release's own sizing code (paths inside the sglang 0.5.21 wheel):

    pre     = free memory at the engine's baseline, the minimum over its TP ranks
              (srt/distributed/bootstrap.py measure_pre_model_load_memory, which calls
              srt/utils/common.py get_available_gpu_memory(distributed=True): torch.cuda.mem_get_info,
              MIN over ranks); the engine's own CUDA context and communicators already exist then
    weights = this TP rank's shard, loaded after the baseline
    rest    = (pre - weights) - pre * (1 - mem_fraction_static)
              (srt/mem_cache/kv_cache_configurator.py KVCacheConfigurator._profile_available_bytes:
              free memory after loading minus the slack pre * (1 - mem_fraction_static));
              rest <= 0 raises "Loaded weights leave no GPU memory for the KV cache"
    tokens  = rest // cell_size // page_size * page_size
              (srt/model_executor/pool_configurator.py DefaultPoolConfigurator.calculate_pool_sizes);
              tokens <= 0 raises "Not enough memory" (MemoryPoolConfig.__post_init__)
    cell_size = max(1, kv_heads // tp) * 2 * head_dim * layers * kv dtype bytes
              (DefaultPoolConfigurator._compute_cell_size, ModelConfig.get_num_kv_heads)

So the KV pool is NOT mem_fraction_static x total memory: it is mem_fraction_static x (memory free when
the engine starts) minus the weights. Whatever the trainer still holds at engine start shrinks it.
With enable_memory_saver (which we always set) the post-capture re-sizing is off
(srt/arg_groups/overrides.py post_capture_kv_sizing_planned returns False), so this pre-capture rule
is the one that applies.

CUDA graphs: decode graphs (backend "full") and, on CUDA, prefill graphs (backend "breakable") are on by
default (srt/model_executor/cuda_graph_config.py CudaGraphConfig, default_prefill_backend). Both are
captured under the memory saver only with SGLANG_MEMORY_SAVER_CUDA_GRAPH set (full_cuda_graph_backend.py
and breakable_cuda_graph_backend.py, their __init__; the variable defaults to off in srt/environ.py, and the
breakable backend refuses it): releasing the "cuda_graph" tag frees nothing otherwise, so their memory
stays for the engine's lifetime.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from model.args import ModelArgs
from rollout.sglang_engine import MEMORY_TAGS

GIB = 1 << 30
MIB = 1 << 20
# srt/layers/vocab_parallel_embedding.py DEFAULT_VOCAB_PADDING_SIZE: embedding rows are padded to it.
VOCAB_PADDING = 64
# srt/mem_cache/kv_cache_configurator.py: the req_to_token rows are context_len + 4 wide (int32).
REQ_TO_TOKEN_EXTRA_CONTEXT = 4
# Estimate of what the engine's processes hold outside any memory tag on each GPU: the CUDA context of
# its scheduler process (about 0.5 GiB with lazy module loading) plus NCCL / custom all-reduce buffers.
DEFAULT_UNTAGGED_BYTES = 1 * GIB


@dataclass(frozen=True)
class EngineMemoryPlan:
    """Bytes one GPU gives to the engine, by SGLang memory tag (see the module docstring)."""

    weights: int  # this TP rank's weight shard
    kv_cache: int  # the KV pool (token_to_kv and req_to_token, both tagged kv_cache)
    cuda_graph: int  # held by captured CUDA graphs (estimate, see cuda_graph_bytes)
    other: int  # no memory tag releases it (estimate: CUDA context, communicators)
    kv_tokens: int  # tokens the KV pool holds
    cuda_graph_releasable: bool = False  # SGLANG_MEMORY_SAVER_CUDA_GRAPH (module docstring): off by default

    def held(self, released: Iterable[str] = ()) -> int:
        """Bytes per GPU the engine holds with these memory tags released (release_memory_occupation)."""
        released = set(released)
        if unknown := released - set(MEMORY_TAGS):
            raise ValueError(f"unknown SGLang memory tags {sorted(unknown)}; the tags are {list(MEMORY_TAGS)}")
        if not self.cuda_graph_releasable:
            released.discard("cuda_graph")
        by_tag = {"weights": self.weights, "kv_cache": self.kv_cache, "cuda_graph": self.cuda_graph}
        return self.other + sum(size for tag, size in by_tag.items() if tag not in released)


class EngineMemoryError(ValueError):
    """SGLang would refuse to start: the KV pool would be empty or negative."""


def weight_bytes_per_rank(args: ModelArgs, tp_size: int, dtype_bytes: int) -> int:
    """Bytes of one TP rank's weight shard as SGLang's Qwen2 lays it out.

    Embedding and head: VocabParallelEmbedding / ParallelLMHead rows padded to a multiple of 64, split
    over tp (srt/layers/vocab_parallel_embedding.py pad_vocab_size); q/o/gate/up/down split over tp;
    k/v heads split over tp, or one head per rank (replicated) when there are fewer kv heads than ranks
    (srt/layers/linear.py QKVParallelLinear); norms replicated. A tied head shares the embedding.
    """
    h, d = args.hidden_size, args.head_dim
    if args.num_heads % tp_size or args.intermediate_size % tp_size:
        raise ValueError(
            f"tp_size {tp_size} must divide num_heads ({args.num_heads}) and intermediate_size "
            f"({args.intermediate_size}), as SGLang's parallel linear layers require"
        )
    vocab_rows = -(-args.vocab_size // VOCAB_PADDING) * VOCAB_PADDING // tp_size
    q_heads, kv_heads = args.num_heads // tp_size, max(1, args.num_kv_heads // tp_size)
    qkv = (q_heads + 2 * kv_heads) * d * (h + 1)  # weights and biases
    o = h * q_heads * d
    mlp = 3 * h * (args.intermediate_size // tp_size)
    per_layer = qkv + o + mlp + 2 * h
    embedding = vocab_rows * h
    head = 0 if args.tie_word_embeddings else vocab_rows * h
    return (args.num_layers * per_layer + h + embedding + head) * dtype_bytes


def kv_cell_bytes(args: ModelArgs, tp_size: int, kv_dtype_bytes: int) -> int:
    """KV bytes per token on one TP rank (DefaultPoolConfigurator._compute_cell_size for MHA/GQA)."""
    return max(1, args.num_kv_heads // tp_size) * 2 * args.head_dim * args.num_layers * kv_dtype_bytes


def decode_cuda_graph_max_bs(gpu_total_bytes: int, tp_size: int) -> int:
    """SGLang's default largest decode CUDA-graph batch (srt/arg_groups/memory_hook.py handle_gpu_memory_settings)."""
    for below_gib, below_tp4, from_tp4 in ((20, 8, 8), (35, 48, 160), (60, 32, 160), (160, 256, 512)):
        if gpu_total_bytes < below_gib * GIB:
            return below_tp4 if tp_size < 4 else from_tp4
    return 512


def chunked_prefill_size(gpu_total_bytes: int) -> int:
    """SGLang's default chunked_prefill_size by GPU size (handle_gpu_memory_settings), in tokens."""
    for below_gib, tokens in ((20, 2048), (60, 4096), (160, 8192)):
        if gpu_total_bytes < below_gib * GIB:
            return tokens
    return 16384


def prefill_cuda_graph_sizes(max_tokens: int) -> list[int]:
    """The token counts prefill graphs are captured for, up to max_tokens (srt/arg_groups/cuda_graph_hook.py
    generate_prefill_cuda_graph_batch_sizes); max_tokens defaults to chunked_prefill_size
    (handle_gpu_memory_settings: prefill max_bs for a non-MLA model)."""
    steps = [(4, 32, 4), (48, 256, 16), (288, 512, 32), (576, 1024, 64), (1280, 4096, 256), (4608, max_tokens, 512)]
    return [size for lo, hi, step in steps for size in range(lo, hi + 1, step) if size <= max_tokens]


def cuda_graph_bytes(gpu_total_bytes: int, tp_size: int, prefill_graphs: bool = True) -> int:
    """Estimate of the captured graphs' memory, SGLang's own reserve for them (srt/arg_groups/memory_hook.py
    reserve_for_graph_mb, non-MLA model): 2 MiB per batch slot of the largest decode graph, plus 8 MiB per
    captured prefill size when prefill graphs are on (the default on CUDA; prefill_cuda_graph_sizes), e.g.
    256 x 2 + 58 x 8 = 976 MiB on an 80 GB GPU at TP < 4."""
    prefill = len(prefill_cuda_graph_sizes(chunked_prefill_size(gpu_total_bytes))) if prefill_graphs else 0
    return (decode_cuda_graph_max_bs(gpu_total_bytes, tp_size) * 2 + prefill * 8) * MIB


def max_running_requests(kv_tokens: int, context_length: int, requested: int | None = None) -> int:
    """srt/mem_cache/kv_cache_configurator.py KVCacheConfigurator.resolve_max_num_reqs (no data parallel)."""
    if requested is not None:
        return min(requested, kv_tokens // 2)
    estimated = max(min(int(kv_tokens / context_length * 512), 4096), 2048)
    return min(estimated, kv_tokens // 2)


def plan_engine_memory(
    args: ModelArgs,
    *,
    tp_size: int,
    dtype_bytes: int,
    gpu_total_bytes: int,
    gpu_free_bytes_at_start: int,
    mem_fraction_static: float,
    context_length: int | None = None,
    page_size: int = 1,
    disable_cuda_graph: bool = False,
    untagged_bytes: int = DEFAULT_UNTAGGED_BYTES,
) -> EngineMemoryPlan:
    """The engine's memory per GPU, by SGLang 0.5.21's rule (module docstring).

    gpu_free_bytes_at_start: free memory (torch.cuda.mem_get_info) on the engine's GPUs when it starts,
        the smallest over its TP ranks; the trainer's tensors and allocator cache are not free.
    context_length: the engine's context (default: the model's max_position_embeddings).
    untagged_bytes: what the engine holds outside the memory tags (estimate); it is spent before SGLang
        takes its baseline.
    Raises EngineMemoryError where SGLang refuses to start.
    """
    if not 0.0 < mem_fraction_static < 1.0:
        raise ValueError(f"mem_fraction_static must be in (0, 1), got {mem_fraction_static}")
    if gpu_free_bytes_at_start > gpu_total_bytes:
        raise ValueError(
            f"gpu_free_bytes_at_start ({gpu_free_bytes_at_start}) exceeds gpu_total_bytes ({gpu_total_bytes})"
        )
    if page_size < 1 or tp_size < 1 or dtype_bytes < 1:
        raise ValueError("page_size, tp_size and dtype_bytes must be >= 1")
    context_length = context_length or args.max_position_embeddings
    weights = weight_bytes_per_rank(args, tp_size, dtype_bytes)
    pre = gpu_free_bytes_at_start - untagged_bytes  # the free memory at SGLang's baseline
    rest = (pre - weights) - pre * (1.0 - mem_fraction_static)
    if rest <= 0:
        minimum = 1.0 - (pre - weights) / pre if pre > 0 else 1.0
        raise EngineMemoryError(
            f"SGLang would refuse to start: the weights ({weights / GIB:.2f} GiB per GPU) leave no memory for "
            f"the KV cache when {gpu_free_bytes_at_start / GIB:.2f} GiB are free at engine start under "
            f"mem_fraction_static={mem_fraction_static} (it needs > {minimum:.3f}); free trainer memory before "
            "the engine starts, or raise rollout.mem_fraction_static "
            "(sglang srt/mem_cache/kv_cache_configurator.py KVCacheConfigurator._profile_available_bytes)"
        )
    cell = kv_cell_bytes(args, tp_size, dtype_bytes)
    tokens = int(rest) // cell // page_size * page_size
    if tokens <= 0:
        raise EngineMemoryError(
            f"SGLang would refuse to start: {rest / GIB:.3f} GiB for the KV cache hold no page of {page_size} "
            f"tokens ({cell} bytes each); raise rollout.mem_fraction_static "
            "(sglang srt/model_executor/pool_configurator.py MemoryPoolConfig.__post_init__: Not enough memory)"
        )
    requests = max_running_requests(tokens, context_length)
    req_to_token = (requests + 1) * (context_length + REQ_TO_TOKEN_EXTRA_CONTEXT) * 4
    return EngineMemoryPlan(
        weights=weights,
        kv_cache=tokens * cell + req_to_token,
        cuda_graph=0 if disable_cuda_graph else cuda_graph_bytes(gpu_total_bytes, tp_size),
        other=untagged_bytes,
        kv_tokens=tokens,
    )
