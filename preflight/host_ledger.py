"""Host-memory ledger of a colocated run, phase by phase, per rank and per node.

The GPU ledger (preflight/gpu_ledger.py) keeps apart what the trainer holds in host memory; this ledger
adds what else lives there. For each phase, one rank (its process and its GPU's share of the engine):

    process     the trainer process itself: interpreter, torch, CUDA and NCCL host state (assumed:
                [rehearse] host_process_gb, not measured)
    load        the checkpoint read beside the shards (checkpoint/hf_load.py load_transient_bytes: one
                tensor's resident pages); the load phase only
    params      CPU-offloaded fp32 parameter shards, pinned (see below)
    grads       CPU-offloaded fp32 gradient shards, pinned; cached from the first backward on
    optimizer   AdamW's two fp32 moments (pageable); in the optimizer step also its temporaries, which the
                trackers count as its state: none with the fused CPU kernel (parallel/adamw.py; the per-tensor
                loop held two of the largest shard; both measured in tests/test_offload_adamw.py)
    temps       other trainer tensors in host memory (the offloaded step's that the trackers see as
                temporaries; on a CPU job, whose device is the host, the activations and gathered units)
    staging     weight sync: one offloaded shard cast to the engine's dtype on the host before it crosses
                (rollout/weight_sync.py iter_weight_buckets); the weight-sync phase only
    engine      SGLang's scheduler process of this GPU (one per TP rank), from the engine's start on

and per node: ranks per node x one rank, plus each engine's own processes (its detokenizer, and the
process that owns `sglang.Engine`), each assumed the size of a process, and in the rollout the second copy of an
engine call's result that each engine's leader rank unpickles from the engine's process (the first is the
process's own): SGLang's output dicts and the Completions made of them, RESULT_BYTES_PER_TOKEN per generated
token (CPython 3.11: a token is an int id twice, a float log-prob, a 3-tuple and list slots; measured with
tracemalloc in tests/test_host_ledger.py) for the requests a stop returns (host_facts) x the longest response.

Pinned memory (torch 2.13, CUDA): FSDP2 with CPUOffloadPolicy(pin_memory=True) pins every sharded parameter
(torch/distributed/fsdp/_fully_shard/_fsdp_param.py FSDPParam._init_sharded_param and reset_sharded_param:
`.pin_memory()`) and copies every reduced gradient to the CPU with `non_blocking=True`
(_fsdp_collectives.py foreach_reduce), which allocates pinned memory. Both go through the caching host
allocator (ATen/cuda/PinnedMemoryAllocator.h: at::getHostAllocator(kCUDA)), which rounds every block up to
a power of two (ATen/core/CachingHostAllocator.h allocate: "Round up the allocation to the nearest power of
two"; no upper limit unless PYTORCH_ALLOC_CONF sets pinned_max_round_threshold_mb, c10/core/AllocatorConfig.h)
and keeps freed blocks for reuse: gradients freed by zero_grad stay resident as cached pinned blocks.

SGLang 0.5.21 with the memory saver keeps nothing of a released tag in host memory here: the weights region
backs up to the CPU only with --enable-weights-cpu-backup (srt/model_executor/model_runner_components/
load_model_utils.py load_model: `enable_cpu_backup = ...enable_weights_cpu_backup`, default False in
srt/arg_groups/fields/exec_.py), which rollout/sglang_engine.py does not set; the KV pool's region has no
backup (srt/mem_cache/memory_pool.py: `memory_saver_adapter.region(GPU_MEMORY_TYPE_KV_CACHE)`); the CUDA-graph
region does back up (srt/model_executor/runner_backend/full_cuda_graph_backend.py: enable_cpu_backup=True)
but rollout/sglang_engine.py never releases it (RELEASED_TAGS); and the buffers stashed while the weights
are released are clones on the GPU (srt/managers/scheduler_components/weight_updater.py
_export_static_state). What remains is its processes: one scheduler per GPU
(srt/entrypoints/engine.py, a `mp.Process(target=run_scheduler_process_func)` per TP rank) and one
detokenizer per engine (_launch_detokenizer_subprocesses).

Page cache (not counted: the kernel reclaims it): every rank's loader and every SGLang scheduler read the
same checkpoint files (srt/model_loader/weight_utils.py safetensors_weights_iterator maps each file whole),
so they pass through the page cache once per node; the run's own checkpoints pass through it when written.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from preflight.gpu_ledger import GB, PhaseRow

if TYPE_CHECKING:
    from config import Config
    from model.args import ModelArgs
    from model.qwen2 import Qwen2

HOST_PARTS = ("process", "load", "params", "grads", "optimizer", "temps", "staging", "engine")
_LABELS = {"optimizer": "optim"}
ENGINE_PROCESSES_PER_ENGINE = 2  # the detokenizer and the process that owns sglang.Engine
RESULT_BYTES_PER_TOKEN = 190  # a generate result in the leader's process, per generated token (module docstring)


def pinned_block_bytes(nbytes: int) -> int:
    """The caching host allocator's block for a pinned allocation of `nbytes`: the next power of two."""
    return 1 << max(0, nbytes - 1).bit_length() if nbytes > 0 else 0


@dataclass(frozen=True)
class HostFacts:
    """What the host ledger needs to know about the job beside the GPU ledger's rows (bytes)."""

    process: int  # one process's own host memory (trainer, SGLang scheduler, detokenizer)
    load: int  # the checkpoint read's transient beside the shards
    pinned_params: int  # the pinned blocks of this rank's offloaded parameter shards (0 without offload)
    pinned_grads: int  # the pinned blocks of its offloaded gradient shards (0 without offload)
    staging: int  # weight sync's host-side cast of the largest offloaded shard (0 without offload)
    engine_per_gpu: int  # what the engine keeps in host memory per GPU (its scheduler process)
    engine_per_engine: int  # and per engine (its other processes)
    generate_result: int  # and in its leader rank during the rollout: the second copy of a round's completions
    ranks_per_node: int
    engines_per_node: int
    checkpoint_bytes: int  # the checkpoint's size on disk (page cache note)


@dataclass
class HostRow:
    phase: str
    rank: dict[str, int]  # per rank, by HOST_PARTS
    node: int

    @property
    def rank_total(self) -> int:
        return sum(self.rank.values())


@dataclass
class HostLedger:
    node_bytes: int  # host memory of one node
    facts: HostFacts
    offload: bool
    device_is_host: bool = False  # a CPU job: what the GPU ledger counts on the device is host memory too
    rows: list[HostRow] = field(default_factory=list)

    @classmethod
    def of(
        cls,
        gpu_rows: list[PhaseRow],
        node_bytes: int,
        facts: HostFacts,
        *,
        offload: bool,
        device_is_host: bool = False,
    ) -> HostLedger:
        ledger = cls(node_bytes, facts, offload, device_is_host)
        for row in gpu_rows:
            ledger.add(row)
        return ledger

    def add(self, row: PhaseRow) -> None:
        """The host row of a GPU ledger row (rows must come in phase order: the pinned gradient cache
        exists from the first phase that holds gradients on)."""
        f, first = self.facts, not self.rows
        parts = dict(dict.fromkeys(HOST_PARTS, 0), process=f.process, load=f.load if first else 0)
        if self.device_is_host:  # every tensor of the trainer, wherever the GPU ledger put it; nothing pinned
            held = {k: row.trainer.get(k, 0) + row.host_parts.get(k, 0) for k in row.trainer.keys() | row.host_parts}
            parts["params"], parts["grads"], parts["optimizer"] = held["params"], held["grads"], held["optimizer"]
            parts["temps"] = sum(v for k, v in held.items() if k not in ("params", "grads", "optimizer"))
        elif self.offload:
            parts["params"] = f.pinned_params
            grads_seen = row.host_parts.get("grads", 0) > 0 or bool(self.rows and self.rows[-1].rank["grads"])
            parts["grads"] = f.pinned_grads if grads_seen else 0
            parts["optimizer"] = row.host_parts.get("optimizer", 0)
            parts["temps"] = sum(v for k, v in row.host_parts.items() if k not in ("params", "grads", "optimizer"))
            if row.phase == "weight sync":
                parts["staging"] = f.staging
        if row.engine and not first:
            parts["engine"] = f.engine_per_gpu
        engines = f.engines_per_node * f.engine_per_engine if parts["engine"] else 0
        if row.phase == "rollout":
            engines += f.engines_per_node * f.generate_result
        self.rows.append(HostRow(row.phase, parts, f.ranks_per_node * sum(parts.values()) + engines))

    def peak(self) -> HostRow:
        return max(self.rows, key=lambda r: r.node)

    def first_overflow(self) -> HostRow | None:
        return next((row for row in self.rows if row.node > self.node_bytes), None)

    def table(self) -> str:
        f = self.facts
        head = (
            f"{'phase':<26}"
            + "".join(f"{_LABELS.get(k, k):>8}" for k in HOST_PARTS)
            + f"{'rank':>8}{'node':>9}  of {self.node_bytes / GB:.0f} GB, {f.ranks_per_node} ranks per node"
        )
        lines = [head, "-" * len(head)]
        for r in self.rows:
            flag = "" if r.node <= self.node_bytes else f"  SHORT BY {(r.node - self.node_bytes) / GB:.1f} GB"
            cells = "".join(f"{r.rank[k] / GB:>8.1f}" for k in HOST_PARTS)
            lines.append(f"{r.phase:<26}{cells}{r.rank_total / GB:>8.1f}{r.node / GB:>9.1f}{flag}")
        peak = self.peak()
        lines.append(
            f"host peak per node: {peak.node / GB:.1f} GB ({peak.phase}); per engine "
            f"{f.engine_per_engine / GB:.1f} GB of its own processes (in the rollout also {f.generate_result / GB:.1f} "
            f"GB of a generate result in its leader) x {f.engines_per_node} engines per node. "
            f"Page cache, not counted: the checkpoint ({f.checkpoint_bytes / GB:.1f} GB) once per node."
        )
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {
            "node_gb": self.node_bytes / GB,
            "ranks_per_node": self.facts.ranks_per_node,
            "peak_node_gb": round(self.peak().node / GB, 3),
            "page_cache_checkpoint_gb": round(self.facts.checkpoint_bytes / GB, 3),
            "phases": [
                {
                    "phase": r.phase,
                    "node_gb": round(r.node / GB, 3),
                    "rank_gb": {k: round(v / GB, 3) for k, v in r.rank.items()},
                }
                for r in self.rows
            ],
        }


def host_facts(cfg: Config, policy: Qwen2, args: ModelArgs) -> HostFacts:
    """The HostFacts of the job `cfg` describes ([rehearse], [parallelism], [rollout], [model]), from this
    rank's (possibly fake) sharded `policy` of architecture `args`."""
    from torch.distributed.tensor import DTensor

    from checkpoint.hf_load import load_transient_bytes
    from model.args import num_params
    from model.hf_adapter import DTYPES
    from preflight.disk_needs import checkpoint_dtype_and_bytes

    reh, offload, ro = cfg.rehearse, cfg.parallelism.cpu_offload, cfg.rollout
    process = int(reh.host_process_gb * GB)
    stored, checkpoint_bytes = checkpoint_dtype_and_bytes(cfg.model.hf_path, args)
    shards = [p.to_local() if isinstance(p, DTensor) else p for p in policy.parameters()]
    pinned = [pinned_block_bytes(t.numel() * t.element_size()) if offload else 0 for t in shards]
    trained = [size for size, p in zip(pinned, policy.parameters()) if p.requires_grad]  # LoRA: frozen ones get none
    ranks_per_node = min(reh.world_size, reh.gpus_per_node)
    # The most requests an engine returns at once: a round's groups from each of its rollout.tp_size ranks.
    requests = -(-cfg.prompts_per_round // max(1, reh.world_size // cfg.parallelism.tp)) * ro.n * ro.tp_size
    sglang = cfg.rollout.engine == "sglang"
    return HostFacts(
        process=process,
        load=load_transient_bytes(policy, stored, shards_on_device=not offload),
        pinned_params=sum(pinned),
        pinned_grads=sum(trained),  # the gradient shards have their parameters' shapes and dtype
        staging=max(t.numel() for t in shards) * DTYPES[ro.dtype].itemsize if offload else 0,
        engine_per_gpu=process if sglang else 0,
        engine_per_engine=ENGINE_PROCESSES_PER_ENGINE * process if sglang else 0,
        generate_result=RESULT_BYTES_PER_TOKEN * requests * ro.max_response_length * sglang,
        ranks_per_node=ranks_per_node,
        engines_per_node=max(1, ranks_per_node // cfg.rollout.tp_size) if sglang else 0,
        checkpoint_bytes=checkpoint_bytes or num_params(args) * stored.itemsize,
    )
