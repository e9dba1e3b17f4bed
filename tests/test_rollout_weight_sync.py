"""rollout/weight_sync.py: buckets, dtype cast, and sync from FSDP / TP / 2-D sharded trainers (gloo, CPU)."""

import copy
import re

import pytest
import torch
from dist_utils import GlooRanks, run_ranks

from model.args import PRESETS
from model.hf_adapter import to_hf_name
from model.qwen2 import build_model
from rollout.torch_engine import TorchEngine
from rollout.weight_sync import check_room_to_gather, iter_weight_buckets, sync_weights
from run.guard import GuardedEngine

ARGS = PRESETS["tiny"]


def _distinct_model(seed: int, args=ARGS):
    """A model whose every tensor (norms and biases included) holds distinct random values."""
    model = build_model(args, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1000)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    return model


class _Recorder:
    """Wraps an engine and records every bucket's names and size."""

    def __init__(self, engine):
        self.engine, self.dtype, self.buckets = engine, engine.dtype, []

    def update_weights(self, named_tensors):
        named_tensors = list(named_tensors)
        self.buckets.append([(n, t.numel() * t.element_size()) for n, t in named_tensors])
        self.engine.update_weights(named_tensors)


def _assert_engine_holds(engine, model, dtype=torch.float32):
    for (name, p), (_, want) in zip(engine.model.named_parameters(), model.named_parameters()):
        assert torch.equal(p, want.detach().to(dtype)), name


def test_single_process_sync_in_buckets():
    trainer = _distinct_model(1)
    engine = TorchEngine(build_model(ARGS, seed=2), max_batch_size=2, max_seq_len=32)
    pointers = [p.data_ptr() for p in engine.model.parameters()]
    recorder = _Recorder(engine)
    bucket_bytes = 40_000
    sent = sync_weights(trainer, recorder, bucket_bytes=bucket_bytes)
    _assert_engine_holds(engine, trainer)
    assert [p.data_ptr() for p in engine.model.parameters()] == pointers
    sizes = {to_hf_name(n): p.numel() * 4 for n, p in trainer.named_parameters()}
    assert sent == sum(sizes.values())
    assert [n for b in recorder.buckets for n, _ in b] == list(sizes)  # every weight once, in order
    assert len(recorder.buckets) > 3
    for bucket in recorder.buckets:
        # A bucket closes as soon as it reaches the limit: without its last tensor it is below it.
        assert sum(s for _, s in bucket[:-1]) < bucket_bytes


def test_cast_to_engine_dtype_and_compiled_wrapper_names():
    trainer = torch.compile(_distinct_model(3))  # parameters appear as "_orig_mod.<name>"
    engine = TorchEngine(build_model(ARGS, seed=4), max_batch_size=2, max_seq_len=32, dtype=torch.bfloat16)
    sync_weights(trainer, engine)  # dtype taken from engine.dtype
    _assert_engine_holds(engine, trainer, torch.bfloat16)


def test_shards_move_to_the_engine_device_before_gathering():
    """parallelism.cpu_offload keeps the shards on the CPU; the engine (SGLang: CUDA IPC) needs them on
    its GPU. "meta" stands in for the GPU here: every tensor handed over must be on the engine's device."""

    class OnDevice:
        dtype, device, seen = torch.float32, torch.device("meta"), []

        def update_weights(self, named_tensors):
            self.seen.extend((n, t.device) for n, t in named_tensors)

    engine = OnDevice()
    sync_weights(_distinct_model(6), engine, bucket_bytes=30_000)
    assert len(engine.seen) == len(list(_distinct_model(6).parameters()))
    assert {device for _, device in engine.seen} == {torch.device("meta")}
    buckets = list(iter_weight_buckets(_distinct_model(6), device="meta", dtype=torch.bfloat16))
    assert {(t.device, t.dtype) for b in buckets for _, t in b} == {(torch.device("meta"), torch.bfloat16)}


def test_bad_bucket_size():
    with pytest.raises(ValueError, match="bucket_bytes"):
        next(iter_weight_buckets(_distinct_model(5), bucket_bytes=0))


# ---------------------------------------------------------------------------------------------------
# Sharded trainers: FSDP2 (fully_shard) and TP (parallelize_module) applied with torch's public APIs.
# ---------------------------------------------------------------------------------------------------


def _tp_plan():
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.o_proj": RowwiseParallel(),
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(),
    }


def _shard(model, kind, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    if kind == "fsdp":
        mesh = init_device_mesh("cpu", (world,))
        for layer in model.layers.values():
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif kind == "tp":
        mesh = init_device_mesh("cpu", (world,))
        for layer in model.layers.values():
            parallelize_module(layer, mesh, _tp_plan())
    elif kind == "2d":
        mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
        for layer in model.layers.values():
            parallelize_module(layer, mesh["tp"], _tp_plan())
            fully_shard(layer, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    return model


def _sharded_sync_worker(rank, world, kinds):
    from torch.distributed.tensor import DTensor

    reference = _distinct_model(7)  # the same full weights on every rank
    synced = []
    for kind in kinds:
        trainer = _shard(copy.deepcopy(reference), kind, world)
        sharded = [n for n, p in trainer.named_parameters() if isinstance(p, DTensor)]
        assert sharded, f"{kind}: no parameter was sharded"
        for dtype in (torch.float32, torch.bfloat16):
            engine = TorchEngine(build_model(ARGS, seed=8), max_batch_size=2, max_seq_len=32, dtype=dtype)
            pointers = [p.data_ptr() for p in engine.model.parameters()]
            recorder = _Recorder(engine)
            sync_weights(trainer, recorder, bucket_bytes=30_000)
            assert len(recorder.buckets) > 1
            _assert_engine_holds(engine, reference, dtype)
            assert [p.data_ptr() for p in engine.model.parameters()] == pointers
            synced.append((kind, dtype))
    return synced


def _spawn(world, kinds):
    synced = [(kind, dtype) for kind in kinds for dtype in (torch.float32, torch.bfloat16)]
    assert run_ranks(_sharded_sync_worker, world, kinds) == [synced] * world


class _FailsAtFirstBucket(_Recorder):
    def update_weights(self, named_tensors):
        raise RuntimeError("the engine refused the bucket")


def _one_engine_fails_worker(rank, world):
    trainer = _shard(_distinct_model(7), "fsdp", world)
    engine = TorchEngine(build_model(ARGS, seed=8), max_batch_size=2, max_seq_len=32)
    receiver = _FailsAtFirstBucket(engine) if rank == 0 else _Recorder(engine)
    try:  # the engine as train.py drives it: the ranks agree after every bucket
        sync_weights(trainer, GuardedEngine(receiver, GlooRanks(rank, world)), bucket_bytes=30_000)
    except RuntimeError as exc:
        return str(exc), len(receiver.buckets)
    return None, len(receiver.buckets)


@pytest.mark.multiprocess
def test_a_failed_update_on_one_rank_stops_every_rank_at_that_bucket():
    """Rank 0's engine refuses the first bucket: the ranks agree on it right after that bucket, and both stop
    there, neither left in an all-gather of the next bucket that the other never enters."""
    (error0, got0), (error1, got1) = run_ranks(_one_engine_fails_worker, 2, timeout=60)
    assert "the engine refused the bucket" in error0
    assert re.fullmatch(r"update_weights \(\d+ tensors\): failed on another rank \(see its log\)", error1), error1
    assert got0 == 0 and got1 == 1


def test_a_gather_that_cannot_fit_on_the_gpu_is_refused_before_it_starts(monkeypatch):
    """Gathering needs what the allocator can hand out: the GPU's free memory plus its cached blocks."""
    mib = 1 << 20
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (3 * mib, 80 << 30))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 5 * mib)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 4 * mib)
    check_room_to_gather(4 * mib, torch.device("cuda", 0))  # 3 MiB free + 1 MiB cached
    with pytest.raises(torch.OutOfMemoryError, match="gathering 5 MiB of weights on cuda:0: 4 MiB are free"):
        check_room_to_gather(5 * mib, torch.device("cuda", 0))
    check_room_to_gather(5 * mib, "cpu")  # host memory: not the allocator's to check


def _shard_fails_worker(rank, world):
    """sync_weights through the guard; rank 1 cannot ready the third tensor (of the second bucket) for its gather."""
    import rollout.weight_sync

    tensors = rollout.weight_sync.iter_hf_tensors

    def failing(source):
        for index, pair in enumerate(tensors(source)):
            if rank == 1 and index == 2:
                raise torch.OutOfMemoryError("injected: no room to move the shard")
            yield pair

    rollout.weight_sync.iter_hf_tensors = failing
    trainer = _shard(_distinct_model(7), "fsdp", world)
    receiver = _Recorder(TorchEngine(build_model(ARGS, seed=8), max_batch_size=2, max_seq_len=32))
    try:
        sync_weights(trainer, GuardedEngine(receiver, GlooRanks(rank, world)), bucket_bytes=30_000)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}", len(receiver.buckets)
    return None, len(receiver.buckets)


@pytest.mark.multiprocess
def test_a_shard_that_fails_to_prepare_on_one_rank_stops_every_rank_before_its_gather():
    """Rank 1 fails to ready a shard of the second bucket (buckets of 1, 6, 4, ... tensors): the ranks agree on it
    before that bucket's gathers, so both stop after the first bucket, none left in an all-gather the other never
    enters (a 60 s test, a 30-minute gloo timeout)."""
    (error0, got0), (error1, got1) = run_ranks(_shard_fails_worker, 2, timeout=60)
    assert error1 == "OutOfMemoryError: injected: no room to move the shard"
    bucket = "the weight sync's bucket 2 (its shards, before their gathers)"
    assert error0 == f"RuntimeError: {bucket}: failed on another rank (see its log)"
    assert got0 == got1 == 1


def _after_no_grad_forward_worker(rank, world, folder):
    from checkpoint.manager import CheckpointManager
    from model.args import PRESETS as presets
    from parallel.dims import ParallelDims
    from parallel.parallelize import parallelize_qwen2

    args = presets["tiny-tied"]
    dims = ParallelDims(world_size=world)
    model = build_model(args, seed=3)
    parallelize_qwen2(model, dims.build_mesh("cpu"), dims, param_dtype=torch.bfloat16)
    master = {n: p.detach().full_tensor().clone() for n, p in model.named_parameters()}
    with torch.no_grad():  # leaves the root unit and the last block gathered, in bf16
        model(torch.randint(0, args.vocab_size, (1, 8)), return_hidden=True)
    engine = TorchEngine(build_model(args, seed=9), max_batch_size=1, max_seq_len=16)  # fp32
    sync_weights(model, engine)
    for name, p in engine.model.named_parameters():
        assert torch.equal(p, master[name]), name
    with torch.no_grad():
        model(torch.randint(0, args.vocab_size, (1, 8)), return_hidden=True)
    manager = CheckpointManager(folder)
    manager.save(1, model)
    fresh = build_model(args, seed=4)
    parallelize_qwen2(fresh, dims.build_mesh("cpu"), dims, param_dtype=torch.bfloat16)
    manager.load(1, fresh)
    for name, p in fresh.named_parameters():
        assert torch.equal(p.full_tensor(), master[name]), name
    return rank


@pytest.mark.multiprocess
def test_sync_and_checkpoint_after_a_no_grad_forward_read_the_fp32_master_weights(tmp_path):
    assert run_ranks(_after_no_grad_forward_worker, 2, str(tmp_path / "ckpt")) == [0, 1]


@pytest.mark.multiprocess
def test_sync_from_fsdp2_and_tp2_trainers():
    _spawn(2, ("fsdp", "tp"))


@pytest.mark.multiprocess
@pytest.mark.slow
def test_sync_from_2d_fsdp_tp_trainer():
    _spawn(4, ("2d",))
