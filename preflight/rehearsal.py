"""A rehearsal of a whole run at full scale on one CPU: `python train.py --config X --rehearse`.

This process plays rank 0 of an N-rank job (`[rehearse] world_size`) on PyTorch's fake process group
(every collective returns at once) with fake tensors (FakeTensorMode: shapes, dtypes and sizes, no
data), so a 32B policy on 8 or 128 ranks needs seconds to minutes and no memory. It runs train.py's
phases in their real order, through the functions train.py itself calls:

    load + shard, engine start    train.py's build order (trainer/build.py build_policy_and_engine):
                                  checkpoint/sharded_policy.py, then the engine of rollout/engine_spec.py as
                                  a stand-in that holds memory by the engine's rules (preflight/sglang_memory.py)
    then train.py's step itself (trainer/loop.py StepPhases.step), each engine call a phase:
    rollout                       the step's resume: the engine holds everything while it generates
    release                       engine.release_memory()
    train: old log-probs          trainer/update.py fill_old_logprobs on one micro-batch of
                                  training.micro_batch_tokens tokens (one sample, the longest case)
    train: forward+backward       TrainPhase.loss_pass: trainer/losses.py DAPOLoss, backward
    train: optimizer step         TrainPhase.optimizer_step (trainer/optimizer.py): clip, AdamW with the run's
                                  kernel (parallel/adamw.py), zero, check
    weight sync                   rollout/weight_sync.py sync_weights into the stand-in engine
    resume                        the next step's resume

PyTorch's memory trackers (torch.distributed._tools: MemTracker for the build, FSDPMemTracker after it)
measure the trainer's tensors of each phase at its peak; preflight/gpu_ledger.py adds the allocator's
reserve, the CUDA context and the engine's share and checks each phase against the GPU's memory;
preflight/host_ledger.py adds what each rank and each node keeps in host memory (the checkpoint load, the
CPU-offloaded state in its pinned blocks, the processes) and checks each phase against a node's memory.
The fake device is the CPU (FSDP cannot run fake CUDA tensors without CUDA): with cpu_offload the
ledger moves parameters, gradients and optimizer state to host memory instead.
"""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.distributed.tensor._sharding_prop as sharding_prop
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._redistribute import _gen_transform_infos
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils._pytree import tree_leaves

from errors import ConfigError
from model.args import ModelArgs, get_preset, num_params
from parallel.adamw import fused_adamw
from parallel.device_memory import observe_cache_returns, return_cached_memory
from parallel.dims import ParallelDims
from parallel.fsdp import apply_fsdp  # noqa: F401  (imported before fake mode starts)
from preflight.disk_needs import run_disk_bytes
from preflight.gpu_ledger import GB, HOST_PARTS_WHEN_OFFLOADED, PARTS, MemoryLedger, parts_from_tracker
from preflight.host_ledger import HostLedger, host_facts
from preflight.sglang_memory import EngineMemoryError, EngineMemoryPlan, plan_engine_memory
from rl.loss_modes import GlobalCounts
from rollout.engine_spec import EngineSpec
from rollout.sglang_engine import RELEASED_TAGS, context_length_for
from trainer.loop import StepPhases
from trainer.observers import TrainWatch, no_display
from trainer.optimizer import build_optimizer
from trainer.packing import MicroBatch, PackItem, pack
from trainer.step_metrics import RolloutMetrics, StepRecord, StepTimes
from trainer.update import TrainPhase, fill_old_logprobs

if TYPE_CHECKING:
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker

    from config import Config
    from parallel.dist_env import DistEnv
    from preflight.gpu_ledger import PhaseRow
    from trainer.types import RolloutGroup


class RehearsalError(Exception):
    """A phase does not fit: the message names the phase and the shortfall."""

    phases: _Phases | None = None  # the run up to the phase that failed (run_phases)


# ---------------------------------------------------------------------------------------- the engine


@dataclass(eq=False)
class StandInEngine:
    """A rollout engine as the memory it holds on one GPU: its plan, by memory tag (preflight/sglang_memory.py),
    and the tags it releases for training; the calls train.py makes change which tags it holds."""

    plan: EngineMemoryPlan
    released_tags: tuple[str, ...]
    dtype: torch.dtype
    note: str = ""
    flattens_buckets: bool = False  # a weight bucket is concatenated on the GPU before it is sent
    released: set[str] = field(default_factory=set)

    def held(self) -> int:
        return self.plan.held(self.released)

    def release_memory(self) -> None:
        self.released = set(self.released_tags)

    def resume_memory(self) -> None:
        self.released = set()

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.released.discard("weights")  # the first bucket maps the weights back
        if self.flattens_buckets:  # FlattenedTensorBucket's torch.cat: the bucket twice while it is sent
            flat = torch.cat([t.detach().reshape(-1).view(torch.uint8) for _, t in named_tensors])
            del flat


def sglang_stand_in(spec: EngineSpec, args: ModelArgs, gpu_bytes: int, free_bytes: int) -> StandInEngine:
    """SGLang as its per-GPU memory, sized by its rule from the memory free when it starts
    (preflight/sglang_memory.py); RehearsalError where SGLang would refuse to start."""
    ro = spec.rollout
    try:
        plan = plan_engine_memory(
            args,
            tp_size=ro.tp_size,
            dtype_bytes=spec.dtype.itemsize,
            gpu_total_bytes=gpu_bytes,
            gpu_free_bytes_at_start=max(free_bytes, 0),
            mem_fraction_static=ro.mem_fraction_static,
            context_length=context_length_for(spec.max_prompt_length, spec.max_new_tokens),
        )
    except EngineMemoryError as exc:
        raise RehearsalError(
            f"phase 'engine start': {exc} ({free_bytes / GB:.1f} GB free of "
            f"{gpu_bytes / GB:.0f} GB when the engine starts)"
        ) from None
    return StandInEngine(
        plan,
        tuple(RELEASED_TAGS),
        spec.dtype,
        f"SGLang TP {ro.tp_size}: KV pool {plan.kv_tokens:,} tokens",
        flattens_buckets=True,  # SGLang's FlattenedTensorBucket (rollout/sglang_engine.py)
    )


def torch_stand_in(spec: EngineSpec, args: ModelArgs) -> StandInEngine:
    """The torch engine (rollout/torch_engine.py): a full copy of the weights, and a KV cache of
    max_batch_size slots x the longest sequence that it frees while the trainer runs."""
    nbytes, seq, batch = spec.dtype.itemsize, spec.max_seq_len, spec.rollout.max_batch_size
    kv = 2 * args.num_layers * batch * args.num_kv_heads * seq * args.head_dim * nbytes
    logits = batch * args.vocab_size * 4  # one decode step's fp32 logits
    return StandInEngine(
        EngineMemoryPlan(
            weights=num_params(args) * nbytes, kv_cache=kv, cuda_graph=0, other=logits, kv_tokens=batch * seq
        ),
        ("kv_cache",),
        spec.dtype,
        f"torch engine: KV cache {batch} x {seq} tokens",
    )


# ---------------------------------------------------------------------------------------- the phases


def _gpu_parts(tracker: MemTracker, kind: str) -> dict[str, int]:
    """The tracker's snapshot of the device that plays the GPU (the CPU; meta tensors hold no memory)."""
    snapshot = tracker.get_tracker_snapshot(kind)
    return parts_from_tracker(next((s for d, s in snapshot.items() if d.type == "cpu"), {}))


def rehearsal_args(cfg: Config) -> ModelArgs:
    if cfg.model.hf_path:
        from checkpoint.sharded_policy import policy_args

        return policy_args(cfg.model)
    return get_preset(cfg.model.preset or cfg.rehearse.preset)


def longest_micro_batch(cfg: Config, device: torch.device) -> MicroBatch:
    """The heaviest micro-batch the trainer meets: one sample filling training.micro_batch_tokens."""
    prompt = min(cfg.data.max_prompt_length, cfg.training.micro_batch_tokens - 1)
    response = cfg.training.micro_batch_tokens - prompt
    mb = pack([PackItem([1] * prompt, [1] * response, advantage=1.0, rollout_logprobs=[-1.0] * response)])
    # One document: plain causal attention (what FlexAttention's document mask costs for one sample).
    return replace(mb.to(device), document_ids=None)


def run_phases(cfg: Config, dist_env: DistEnv, ledger: MemoryLedger, *, fill: bool = False) -> _Phases:
    """train.py's phases in order on `dist_env` (fake or real ranks); each phase becomes a ledger row.
    Returns the run (its `policy` and `engine`).

    Raises RehearsalError at the first phase that cannot run (an engine without room for its KV pool); the
    error's `phases` is the run so far.
    """
    run = _Phases(cfg, dist_env, ledger)
    # train.py's return_cached_memory (parallel/device_memory.py) empties the allocator: the ledger's reserve follows.
    with observe_cache_returns(lambda: ledger.empty_cache(run.allocated_on_gpu())):
        try:
            run.build(fill)
            run.rehearse_step()
        except RehearsalError as exc:
            exc.phases = run
            raise
    return run


class _Phases(StepPhases):
    """The phases of run_phases, measured by PyTorch's trackers: MemTracker while the policy is built,
    FSDPMemTracker (which knows FSDP's parameter states) from then on. The step after the build is train.py's
    own sequence (trainer/loop.py StepPhases): its engine calls are measured phases (the engine's resume before
    the rollout is the "rollout" phase: the engine then holds everything it generates with; the next step's is
    "resume"), and its update is the trainer's, in three measured parts."""

    engine: StandInEngine  # type: ignore[assignment]  # the run's guarded engine, as the memory it holds

    def __init__(self, cfg: Config, dist_env: DistEnv, ledger: MemoryLedger):
        from torch.distributed._tools.mem_tracker import MemTracker

        self.args = rehearsal_args(cfg)
        self.cfg = replace(
            cfg, model=replace(cfg.model, preset="" if cfg.model.hf_path else (cfg.model.preset or cfg.rehearse.preset))
        )
        self.dist_env, self.dist, self.ledger = dist_env, dist_env, ledger
        self.bucket_bytes = cfg.rollout.weight_sync_bucket_mb << 20
        self.build_tracker = MemTracker()
        self.tracker: FSDPMemTracker | None = None  # from the build's end on
        self.resumes = 0

    def allocated_on_gpu(self) -> int:
        if self.tracker is not None:
            return self.ledger.gpu_bytes_of(_gpu_parts(self.tracker, "current"))
        # Until the engine starts, the build holds the sharded parameters: in host memory with cpu_offload.
        return 0 if self.ledger.offload else sum(_gpu_parts(self.build_tracker, "current").values())

    def built(self, kind: str, policy: torch.nn.Module) -> tuple[dict[str, int], dict[str, int]]:
        """(GPU parts, host bytes) of the build: it allocates parameters only. Sharded parameters are in
        host memory with cpu_offload; unsharded ones are wherever the build put them: the device."""
        total = sum(_gpu_parts(self.build_tracker, kind).values())
        host = 0
        if self.ledger.offload:
            host = sum(p.to_local().nbytes for p in policy.parameters() if isinstance(p, DTensor))
        return dict(dict.fromkeys(PARTS, 0), params=max(total - host, 0)), {"params": host}

    def start_engine(self, policy: torch.nn.Module) -> StandInEngine:
        """The engine train.py starts once the policy is sharded (rollout/engine_spec.py): a stand-in sized
        from the memory free at this moment."""
        cfg, ledger = self.cfg, self.ledger
        peak, host = self.built("peak", policy)
        ledger.record("load + shard", peak, 0, host=host)
        now, host = self.built("current", policy)
        free = ledger.gpu_bytes - ledger.context_bytes - max(ledger.reserved, now["params"])
        spec = EngineSpec.from_config(cfg)
        if spec.rollout.engine == "sglang":
            engine = sglang_stand_in(spec, self.args, ledger.gpu_bytes, free)
        else:
            engine = torch_stand_in(spec, self.args)
        row = ledger.record("engine start", now, engine.held(), engine.note, host=host)
        longest = cfg.data.max_prompt_length + cfg.rollout.max_response_length
        if (kv_tokens := engine.plan.kv_tokens) < longest:
            raise RehearsalError(
                f"phase 'engine start': the engine's KV pool holds {max(kv_tokens, 0):,} tokens, fewer than "
                f"one sample of {longest:,} (the trainer holds {row.trainer_peak / GB:.1f} GB of "
                f"{ledger.gpu_bytes / GB:.0f} GB when the engine starts, leaving {free / GB:.1f} GB free)"
            )
        # What follows the engine's start is a phase of its own: a new peak (a tracker measures since it was entered).
        self.build_tracker.__exit__(None, None, None)
        self.build_tracker.__enter__()
        return engine

    def build(self, fill: bool) -> None:
        """train.py's build order (trainer/build.py build_policy_and_engine): the sharded policy (its values
        only with `fill`: the memory of a rank's checkpoint read), the allocator's cache handed back, the engine."""
        from checkpoint.sharded_policy import fill_policy, shard_policy

        cfg = self.cfg
        with self.build_tracker:
            self.policy = policy = shard_policy(cfg.model, cfg.parallelism, self.dist_env, cfg.lora)
            if fill:
                fill_policy(policy, cfg.model, seed=cfg.job.seed)
            return_cached_memory(self.dist_env)
            self.engine = engine = self.start_engine(policy)
        parts, host = self.built("peak", policy)
        self.ledger.record("build done", parts, engine.held(), host=host)

    def phase(
        self,
        name: str,
        fn: Callable[[], object],
        note: str = "",
        on_host: tuple[str, ...] = HOST_PARTS_WHEN_OFFLOADED,
    ) -> PhaseRow:
        assert self.tracker is not None, "the phases after the build"
        self.tracker.reset_mod_stats()  # per-module statistics are kept for one pass only
        with self.tracker:
            fn()
        parts = _gpu_parts(self.tracker, "peak")
        return self.ledger.record(name, parts, self.engine.held(), note, on_host=on_host)

    def rehearse_step(self) -> None:
        """train.py's step after the build (trainer/loop.py StepPhases.step), then the next step's resume."""
        from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

        cfg, policy = self.cfg, self.policy
        # train.py's AdamW kernel: on GPUs torch's foreach (whole-group temporaries), on host memory (cpu_offload)
        # the fused one (parallel/adamw.py: no temporaries); the fake CPU device must be told which the run uses.
        # (cfg here is the run's as rehearsed, without cpu_offload: the ledger knows where the state lives.)
        fused = fused_adamw(self.ledger.offload)
        optimizer, scheduler = build_optimizer(policy.parameters(), cfg.optimizer, fused=fused, foreach=not fused)
        self.update = TrainPhase(cfg, policy, optimizer, scheduler, self.dist_env, TrainWatch(no_display))
        self.tracker = FSDPMemTracker(policy, optimizer)
        self.step(1)
        self.resume_engine()  # the next step's

    def resume_engine(self) -> None:
        self.resumes += 1
        self.phase("rollout" if self.resumes == 1 else "resume", super().resume_engine)

    def release_engine(self) -> None:
        self.phase("release", super().release_engine)
        if self.cfg.rollout.engine == "torch":  # TorchEngine.release_memory empties the allocator's cache itself
            self.ledger.empty_cache(self.allocated_on_gpu())

    def sync_weights(self) -> None:
        self.phase("weight sync", super().sync_weights, f"buckets of {self.cfg.rollout.weight_sync_bucket_mb} MB")

    def collect_batch(self, step: int) -> list[RolloutGroup]:
        """Generation holds the engine's memory, measured as the "rollout" phase: nothing to add here."""
        return []

    def train(self, step: int, groups: list[RolloutGroup], times: StepTimes) -> StepRecord:
        """The update on the heaviest micro-batch, in three phases: pi_old (recomputed, as a carried-over sample
        needs), a loss pass (forward, the DAPO loss, backward) and the optimizer step."""
        cfg, policy, update = self.cfg, self.policy, self.update
        metrics = update.watch.start(step, [], cfg.training.ppo_epochs, cfg.optimizer.lr)
        mb = longest_micro_batch(cfg, self.dist_env.device)
        counts = GlobalCounts(tokens=float(mb.targets.numel()), seqs=1.0, groups=1.0)
        tokens = f"{cfg.training.micro_batch_tokens:,} tokens"
        policy.train()
        temperature, chunk = update.loss.temperature, update.loss.chunk_size
        self.phase("train: old log-probs", lambda: fill_old_logprobs(policy, [mb], temperature, chunk), tokens)
        self.phase("train: forward+backward", lambda: update.loss_pass(mb, counts), tokens)
        # Offloaded, the step runs on the CPU: its temporaries are host memory too.
        on_host = (*HOST_PARTS_WHEN_OFFLOADED, "activations")
        self.phase("train: optimizer step", lambda: update.optimizer_step("the rehearsal's update"), on_host=on_host)
        return StepRecord(RolloutMetrics(), metrics, times)

    def after_step(self, step: int, record: StepRecord) -> None:
        pass


# ---------------------------------------------------------------------------------------- the command


@contextlib.contextmanager
def fake_job(world_size: int) -> Iterator[None]:
    """Rank 0 of a `world_size`-rank job on PyTorch's fake process group."""
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
        _forget_fake_meshes()


def _forget_fake_meshes() -> None:
    """Drop DTensor's sharding caches: their specs hold the fake world's meshes, and a mesh compares equal
    to any mesh of the same ranks, so a process forked later (a test's gloo ranks) would be handed a mesh
    whose coordinate is rank 0's."""
    torch._C._clear_DTensor_sharding_propagator_cache()  # the C++ fast path's cache
    propagator = DTensor._op_dispatcher.sharding_propagator
    propagator.propagate_op_sharding.cache_clear()
    propagator._propagate_tensor_meta_cached.cache_clear()
    _gen_transform_infos.cache_clear()


def fake_tensor_mode() -> FakeTensorMode:
    """FakeTensorMode in which plain tensors stay plain: an op whose tensor inputs are all real (the
    micro-batch's token ids, a meta-device module's parameters) runs for real; everything else, and
    every factory call off the meta device, is fake.

    Why: train.py builds its modules on the meta device and then calls `to_empty`; a module whose meta
    parameters were themselves fake cannot be moved (nn.Module._apply must swap a fake parameter in
    place, and the fake mode holds weak references to it). And the trainer's input checks read a few
    values of the (small, real) micro-batch, which a fake tensor cannot give. A value the trainer reads
    back from a fake tensor (a gradient norm, AdamW's step count) reads as 1, a flag (a finiteness check)
    as False: finite, nothing to report.
    """
    meta = torch.device("meta")

    def runs_for_real(args: Sequence[object], kwargs: Mapping[str, object] | None) -> bool:
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if any(isinstance(t, FakeTensor) for t in tensors):
            return False
        device = (kwargs or {}).get("device")
        if device is not None and torch.device(device) == meta:  # type: ignore[call-overload]  # a device spec
            return True
        if not tensors:
            return False  # a factory call: what the run allocates
        # Real inputs stay real, except where meta tensors are materialised on a device (to_empty).
        return device is None or not any(t.is_meta for t in tensors)

    class PlainStaysPlain(FakeTensorMode):
        def __torch_dispatch__(
            self,
            func: torch._ops.OpOverload,
            types: Sequence[type],
            args: Sequence[object] = (),
            kwargs: Mapping[str, object] | None = None,
        ) -> object:
            if func is torch.ops.aten._local_scalar_dense.default and isinstance(args[0], FakeTensor):
                return int(args[0].dtype != torch.bool)  # .item(), float(), bool() of a fake tensor
            if runs_for_real(args, kwargs):
                with unset_fake_temporarily():
                    return func(*args, **(kwargs or {}))
            return super().__torch_dispatch__(func, types, args, kwargs or {})

    return PlainStaysPlain(allow_non_fake_inputs=True)


@contextlib.contextmanager
def sharding_propagation_apart() -> Iterator[None]:
    """Let DTensor's sharding propagation use a fake mode of its own.

    It reuses the active fake mode when it finds one (torch.distributed.tensor._sharding_prop:
    `detect_fake_mode() or FakeTensorMode()`); then the memory tracker, which counts the ops of the fake
    mode it was entered under, also counts the global-shape tensors the propagation creates to infer
    output shapes. That made an AdamW step look like ~27x the sharded parameters on 7B / 8 ranks
    instead of the 2x state plus one foreach temporary that real tensors show.
    """
    detect = sharding_prop.detect_fake_mode
    sharding_prop.detect_fake_mode = lambda *args, **kwargs: None
    try:
        yield
    finally:
        sharding_prop.detect_fake_mode = detect


def fake_dist_env(cfg: Config, world_size: int) -> DistEnv:
    from parallel.dist_env import DistEnv

    par = cfg.parallelism
    dims = ParallelDims(dp_replicate=par.dp_replicate, dp_shard=par.dp_shard, tp=par.tp, world_size=world_size)
    dims.build_mesh("cpu")  # outside fake mode: the mesh holds real rank tensors
    return DistEnv(0, world_size, 0, torch.device("cpu"), dims)


def rehearse(cfg: Config) -> tuple[MemoryLedger, HostLedger, str | None]:
    """The GPU and host ledgers of a rehearsal of `cfg` on [rehearse] world_size x gpu_memory_gb, nodes of
    host_memory_gb, and the first failure (None when every phase ran and fits)."""
    reh = cfg.rehearse
    offload = cfg.parallelism.cpu_offload
    # The fake device is the CPU, where FSDP refuses cpu_offload: the ledger moves the state instead.
    run_cfg = replace(cfg, parallelism=replace(cfg.parallelism, cpu_offload=False, compile=False))
    ledger = MemoryLedger(int(reh.gpu_memory_gb * GB), int(reh.context_gb * GB), offload=offload)
    failure = None
    with fake_job(reh.world_size):
        dist_env = fake_dist_env(run_cfg, reh.world_size)
        with fake_tensor_mode(), sharding_propagation_apart():
            try:
                run = run_phases(run_cfg, dist_env, ledger)
            except RehearsalError as exc:
                assert exc.phases is not None  # run_phases attaches the run so far
                failure, run = str(exc), exc.phases
        assert run.policy is not None  # built before the engine, whose start is the first phase that can fail
        facts = host_facts(cfg, run.policy, run.args)  # shard shapes, on the fake mesh: no tensor is made
    host = HostLedger.of(ledger.rows, int(reh.host_memory_gb * GB), facts, offload=offload)
    if (row := ledger.first_overflow()) is not None:
        short = (
            f"phase '{row.phase}' needs {row.total / GB:.1f} GB of {ledger.gpu_bytes / GB:.0f} GB per GPU: "
            f"{(row.total - ledger.gpu_bytes) / GB:.1f} GB short"
        )
        failure = short if failure is None or failure.startswith(f"phase '{row.phase}'") else f"{short}; {failure}"
    if (host_row := host.first_overflow()) is not None:
        short = (
            f"host memory: phase '{host_row.phase}' needs {host_row.node / GB:.1f} GB of {host.node_bytes / GB:.0f} "
            f"GB per node ({facts.ranks_per_node} ranks of {host_row.rank_total / GB:.1f} GB and the engines' "
            f"processes): {(host_row.node - host.node_bytes) / GB:.1f} GB short"
        )
        failure = short if failure is None else f"{failure}; {short}"
    return ledger, host, failure


def main(cfg: Config) -> int:
    """Print the GPU and host ledgers' tables and one JSON line; 2 when a phase does not fit on a GPU or in a
    node's host memory (naming it and the shortfall)."""
    from preflight.hub_inputs import cached_model

    reh, cfg = cfg.rehearse, cached_model(cfg)  # a hub id's checkpoint when cached, else rehearse.preset
    if not (cfg.model.hf_path or cfg.model.preset or reh.preset):
        raise ConfigError(
            "the rehearsal needs an architecture: set model.hf_path, model.preset or rehearse.preset "
            "(e.g. --rehearse.preset=qwen2.5-32b)"
        )
    ledger, host, failure = rehearse(cfg)
    par = cfg.parallelism
    print(
        f"rehearsal: {cfg.job.name} as rank 0 of {reh.world_size} x {reh.gpu_memory_gb:g} GB "
        f"(fsdp {par.dp_shard}, tp {par.tp}, cpu_offload {par.cpu_offload}, micro-batch "
        f"{cfg.training.micro_batch_tokens:,} tokens, engine {cfg.rollout.engine} tp {cfg.rollout.tp_size}, "
        f"mem_fraction_static {cfg.rollout.mem_fraction_static})"
    )
    print("GPU memory per GPU (GB):")
    print(ledger.table())
    print("host memory per rank and per node (GB):")
    print(host.table())
    disk = run_disk_bytes(cfg, rehearsal_args(cfg))
    print(
        f"disk: checkpoint in {disk['checkpoint_in'] / GB:.1f} GB; a training checkpoint "
        f"{disk['training_checkpoint'] / GB:.1f} GB, {disk['training_checkpoints_at_once'] / GB:.1f} GB at most at "
        f"once; HF export {disk['hf_export'] / GB:.1f} GB; total {disk['total'] / GB:.1f} GB"
    )
    result = {"rehearsal": ledger.to_dict(), "host": host.to_dict(), "world_size": reh.world_size}
    result["disk_gb"] = {k: round(v / GB, 3) for k, v in disk.items()}
    print(json.dumps({**result, "fits": failure is None, "failure": failure}))
    if failure:
        print(f"does not fit: {failure}", file=sys.stderr)
        return 2
    return 0
