"""The rehearsal's host-memory ledger (preflight/host_ledger.py): against the resident memory of real gloo
ranks, its per-node verdict, and its rules for pinned blocks and the engine's processes."""

from __future__ import annotations

import json
import os

import pytest
import torch

import train
from config import load_config
from model.args import ModelArgs
from model.qwen2 import Qwen2
from preflight.gpu_ledger import GB, MemoryLedger
from preflight.host_ledger import RESULT_BYTES_PER_TOKEN, HostLedger, pinned_block_bytes
from preflight.rehearsal import rehearse, run_phases
from tests.dist_utils import run_ranks
from tests.host_memory import peak, reset_peak, return_freed_memory_at_once
from tests.qwen2_checkpoint import write_qwen2_checkpoint

CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")
DEMO_SCRATCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "demo_scratch.toml")  # no base policy
MiB = 1 << 20

# 197M parameters (788 MB in fp32): on 4 ranks every phase holds 190 MB to 1 GB of tensors, so the module
# tree (about 14 MB per rank, seen by no tracker) stays inside the 15%. The micro-batch is short: the compute
# of a CPU rank is what this test costs, and the host ledger is about the state.
ARGS = ModelArgs(
    vocab_size=8192,
    hidden_size=1024,
    num_layers=16,
    num_heads=8,
    num_kv_heads=2,
    intermediate_size=2816,
    tie_word_embeddings=False,
    max_position_embeddings=1024,
)


def gloo_gather_copies(world_size: int) -> int:
    """What gloo holds in host memory for all-gathers still in flight, at most: on this CPU rig FSDP's
    all-gather runs on gloo, which holds a copy of the call's output (the unit; at most with its input, 1/world
    of the unit) in buffers of its own and frees them from its worker thread after the call has returned, so
    one gather's copies can still be resident when FSDP's prefetch issues the next. Two copies of the largest gathered
    unit (a block's parameters in bf16; the root's lm_head and norm are smaller) bound it. On GPUs the
    gathers are NCCL's, on the device, and the host ledger rightly has no such part."""
    with torch.device("meta"):
        model = Qwen2(ARGS)
    block = sum(p.numel() for p in model.layers["0"].parameters())
    root = sum(p.numel() for p in model.lm_head.parameters()) + ARGS.hidden_size
    assert block > root and block > ARGS.vocab_size * ARGS.hidden_size  # the block is the largest unit
    return 2 * block * torch.bfloat16.itemsize * (world_size + 1) // world_size


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("qwen2-bf16"))
    write_qwen2_checkpoint(path, ARGS, dtype=torch.bfloat16, max_shard_size="40MB")
    return path


def job_config(path: str, world_size: int, **extra):
    """The checkpoint above, trained as a GPU recipe trains (fp32 state, bf16 compute, full activation
    checkpointing), with a micro-batch of 1,024 tokens and the torch engine."""
    values = {
        "model.hf_path": path,
        "model.preset": "",
        "model.dtype": "float32",
        "rollout.engine": "torch",
        "data.max_prompt_length": 32,
        "rollout.max_response_length": 96,
        "eval.max_response_length": 96,
        "algorithm.overlong_buffer": 32,
        "training.micro_batch_tokens": 128,
        "rollout.max_batch_size": 8,
        "parallelism.param_dtype": "bfloat16",
        "parallelism.activation_checkpoint": "full",
        "rehearse.world_size": world_size,
        "rehearse.gpu_memory_gb": 80.0,
    }
    values.update(extra)
    return load_config(DEMO_SCRATCH, [f"{k}={v}" for k, v in values.items()])


class ResidentLedger(MemoryLedger):
    """A ledger that also records, for each phase, the process's resident high-water mark above the
    resident set when the run started."""

    def __init__(self):
        super().__init__(10**12, 0)
        self.resident: dict[str, int] = {}
        self.start = reset_peak()

    def record(self, phase, *args, **kwargs):
        self.resident[phase] = peak() - self.start
        reset_peak()  # the next phase's high-water mark starts from what is resident now
        return super().record(phase, *args, **kwargs)


def _resident(rank, world_size, cfg):
    """train.py's phases on real gloo ranks, the policy read from the checkpoint (checkpoint/hf_load.py)."""
    from parallel.dims import ParallelDims
    from parallel.dist_env import DistEnv

    return_freed_memory_at_once()
    dims = ParallelDims(dp_shard=-1, world_size=world_size)
    dims.build_mesh("cpu")
    ledger = ResidentLedger()
    run_phases(cfg, DistEnv(rank, world_size, rank, torch.device("cpu"), dims), ledger, fill=True)
    return ledger.resident


# Four ranks of a 197M model run every phase in minutes on a 2-core machine: the default run takes two.
@pytest.mark.multiprocess
@pytest.mark.parametrize("world_size", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_the_host_ledger_matches_the_resident_memory_of_every_phase(checkpoint, world_size):
    """On CPU ranks the device is the host: every tensor the GPU ledger counts, the checkpoint read and the
    rest of the host ledger are resident memory, which each rank measures (VmHWM) phase by phase."""
    cfg = job_config(checkpoint, world_size)
    gpu, host, failure = rehearse(cfg)
    assert failure is None
    on_cpu = HostLedger.of(gpu.rows, host.node_bytes, host.facts, offload=False, device_is_host=True)
    # The process itself and the engine's (here: the stand-in's, which holds nothing) are not measured.
    predicted = {r.phase: r.rank_total - r.rank["process"] - r.rank["engine"] for r in on_cpu.rows}
    assert host.facts.load > 0 and on_cpu.rows[0].rank["load"] == host.facts.load
    phases = list(predicted)
    first_gather = phases.index("train: old log-probs")
    gather_copies = gloo_gather_copies(world_size)
    # Fresh interpreters: ranks forked from the test process inherit its heap, threads and mappings, and
    # measured up to twice the ledger after a full suite had run in it.
    for rank, resident in enumerate(run_ranks(_resident, world_size, cfg, start="spawn", timeout=900)):
        assert resident.keys() == predicted.keys()
        for phase, real in resident.items():
            # From the first all-gather on, gloo's copies may be resident too, in the phase that gathers or,
            # freed late by its worker thread, in the next: a bound the ledger is allowed to miss by.
            unseen = gather_copies if phases.index(phase) >= first_gather else 0
            assert -0.15 * real <= real - predicted[phase] <= 0.15 * real + unseen, (
                f"rank {rank}, phase '{phase}': the ledger says {predicted[phase] / MiB:.1f} MiB, "
                f"the process held {real / MiB:.1f} MiB"
            )
    # The phases differ: the comparison is not of one constant.
    assert predicted["train: optimizer step"] > 2.5 * predicted["engine start"]


def _gather_copies(rank, world_size, numel):
    """The resident peak of one all-gather above its own input and output tensors."""
    return_freed_memory_at_once()
    shard = torch.ones(numel // world_size, dtype=torch.bfloat16)
    out = torch.zeros(numel, dtype=torch.bfloat16)  # written: its pages are resident before the gather
    torch.distributed.all_gather_into_tensor(out, shard)  # the first call's one-time costs (code, connections)
    extra = []
    for _ in range(3):
        start = reset_peak()
        torch.distributed.all_gather_into_tensor(out, shard)
        extra.append(peak() - start)
    return max(extra)


@pytest.mark.multiprocess
def test_a_gloo_all_gather_holds_a_copy_of_its_output_at_most_with_its_input():
    """The rule gloo_gather_copies rests on: beyond its tensors, one all-gather holds a buffer of its output's
    size (measured: the output), never more than a copy of its input and output."""
    numel, world_size = 12 * 2**20, 4
    output, copies = numel * 2, (numel + numel // world_size) * 2
    for extra in run_ranks(_gather_copies, world_size, numel, start="spawn"):
        assert 0.9 * output <= extra <= 1.1 * copies, (extra / MiB, output / MiB, copies / MiB)


def test_pinned_blocks_are_powers_of_two():
    assert [pinned_block_bytes(n) for n in (0, 1, 2, 3, 4096, 4097)] == [0, 1, 2, 4, 4096, 8192]
    assert pinned_block_bytes(70_778_880) == 128 * MiB  # a gate_proj shard of Qwen2.5-32B over 8 ranks


def _rehearsal(capsys, argv):
    code = train.main(["--config", DEMO_SCRATCH, "--rehearse", *argv])
    out, err = capsys.readouterr()
    return code, json.loads(out.strip().splitlines()[-1]), out, err


def test_offloaded_state_is_counted_in_its_pinned_blocks_and_per_node(capsys):
    """cpu_offload on 16 ranks: parameters and gradients in power-of-two pinned blocks, AdamW's moments at
    their size; a node holds min(world, gpus_per_node) ranks and each engine's processes."""
    argv = ["--model.preset=qwen2.5-0.5b", "--parallelism.cpu_offload=true", "--rollout.engine=sglang"]
    argv += ["--rollout.tp_size=2", "--rehearse.world_size=16", "--rehearse.host_process_gb=3"]
    code, result, out, _ = _rehearsal(capsys, argv)
    assert code == 0 and "host memory per rank and per node" in out
    gpu_rows = {p["phase"]: p for p in result["rehearsal"]["phases"]}
    host = result["host"]
    rows = {p["phase"]: p for p in host["phases"]}
    assert host["ranks_per_node"] == 8
    step = rows["train: optimizer step"]["rank_gb"]
    shards = gpu_rows["load + shard"]["offloaded_gb"]["params"]
    assert shards > 0
    assert shards <= step["params"] < 2 * shards  # rounded up to powers of two, tensor by tensor
    assert step["grads"] == step["params"]
    moments = rows["resume"]["rank_gb"]["optimizer"]
    assert moments == pytest.approx(2 * shards, rel=0.01)  # pageable: not rounded
    # The step's temporaries: none with the fused CPU kernel (parallel/adamw.py), where the per-tensor loop held two
    # of the largest shard (the embedding's, 34 MB on 16 ranks) and a GPU step's foreach a copy of every shard.
    assert moments <= step["optimizer"] + step["temps"] <= moments + 0.002
    assert rows["rollout"]["rank_gb"]["grads"] == 0 and rows["resume"]["rank_gb"]["grads"] == step["grads"]
    assert rows["weight sync"]["rank_gb"]["staging"] > 0
    assert rows["load + shard"]["rank_gb"]["load"] > 0 and rows["engine start"]["rank_gb"]["load"] == 0
    # In the rollout each engine's leader also holds what a stop returns: a round's groups from each of its 2 ranks
    # (64 prompts over 16 ranks: 4 each, x demo_cpu's n = 8: 64 requests) of up to its 32 new tokens.
    result = RESULT_BYTES_PER_TOKEN * 64 * 32 / GB
    for phase, row in rows.items():
        rank = sum(row["rank_gb"].values())
        engines = 4 * 2 * 3 if row["rank_gb"]["engine"] else 0  # 4 engines of TP 2, 2 processes each
        engines += 4 * result if phase == "rollout" else 0
        assert row["node_gb"] == pytest.approx(8 * rank + engines, abs=0.01), phase
    assert host["peak_node_gb"] == max(r["node_gb"] for r in host["phases"])


def test_a_node_without_the_host_memory_exits_2_naming_the_phase_and_the_shortfall(capsys):
    argv = ["--model.preset=qwen2.5-0.5b", "--parallelism.cpu_offload=true", "--rollout.engine=torch"]
    argv += ["--rehearse.world_size=8", "--rehearse.host_process_gb=0.5", "--rehearse.host_memory_gb=10"]
    code, result, _, err = _rehearsal(capsys, argv)
    assert code == 2 and not result["fits"]
    peak_row = max(result["host"]["phases"], key=lambda r: r["node_gb"])
    first_short = next(r for r in result["host"]["phases"] if r["node_gb"] > 10)
    assert f"host memory: phase '{first_short['phase']}' needs {first_short['node_gb']:.1f} GB of 10 GB" in err
    assert first_short["phase"] != "load + shard"  # the processes and the shards fit; what training adds does not
    assert peak_row["node_gb"] > 10 and "GB short" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


def test_sglang_keeps_nothing_released_in_host_memory_only_its_processes():
    """The engine's host share is its processes: one scheduler per GPU, two more per engine."""
    from preflight.host_ledger import ENGINE_PROCESSES_PER_ENGINE, HostFacts

    facts = HostFacts(
        process=GB,
        load=0,
        pinned_params=0,
        pinned_grads=0,
        staging=0,
        engine_per_gpu=GB,
        engine_per_engine=ENGINE_PROCESSES_PER_ENGINE * GB,
        generate_result=3 * GB,
        ranks_per_node=8,
        engines_per_node=2,
        checkpoint_bytes=0,
    )
    gpu = MemoryLedger(80 * 10**9, 0)
    gpu.record("load + shard", {"params": 0}, 0)
    gpu.record("engine start", {"params": 0}, 10**9)
    gpu.record("rollout", {"params": 0}, 10**9)
    gpu.record("release", {"params": 0}, 10**8)
    host = HostLedger.of(gpu.rows, 10**12, facts, offload=False)
    # In the rollout each engine's leader also holds the second copy of a generate call's result.
    assert [r.node / GB for r in host.rows] == [8, 8 * 2 + 2 * 2, 8 * 2 + 2 * 2 + 2 * 3, 8 * 2 + 2 * 2]


def test_a_generate_results_second_copy_takes_what_the_ledger_counts_per_token():
    """The leader unpickles SGLang's output dicts of a call and makes Completions of them: measured with
    tracemalloc on outputs shaped as SGLang 0.5.21 returns them (tests/sglang_model.py), over random ids and
    log-probs (distinct objects, as the pipe delivers them). CPython's object sizes are fixed on 64-bit builds;
    the 10% allow for the allocator's rounding."""
    import pickle
    import random
    import tracemalloc

    from sglang_model import _output

    from preflight.host_ledger import RESULT_BYTES_PER_TOKEN
    from rollout.sglang_groups import completions_from_sglang

    requests, tokens, rng = 64, 256, random.Random(0)
    outputs = [
        _output(
            [rng.randrange(152064) for _ in range(tokens)],
            [-rng.random() for _ in range(tokens)],
            {"type": "length"},
            9,
            str(i),
        )
        for i in range(requests)
    ]
    sent = pickle.dumps(outputs)  # what crosses the pipe
    del outputs
    tracemalloc.start()
    try:
        received = pickle.loads(sent)
        completions = completions_from_sglang(received, requests, 1)
        held = tracemalloc.get_traced_memory()[0] / (requests * tokens)
    finally:
        tracemalloc.stop()
    assert len(completions) == requests and held <= RESULT_BYTES_PER_TOKEN <= 1.1 * held, held


def test_the_host_and_disk_figures_of_the_32b_and_7b_headers():
    """dapo_32b.toml's and dapo_7b.toml's host-memory and disk comments, recomputed from the presets."""
    from model.args import PRESETS, num_params
    from model.hf_adapter import hf_shapes
    from preflight.disk_needs import run_disk_bytes

    args = PRESETS["qwen2.5-32b"]
    shards = [-(-shape[0] // 8) * shape[1:].numel() * 4 for shape in hf_shapes(args).values()]
    assert round(sum(shards) / GB, 1) == 16.4
    assert round(sum(pinned_block_bytes(b) for b in shards) / GB, 1) == 29.5  # parameters, and gradients
    assert round(2 * sum(shards) / GB, 1) == 32.8  # AdamW's moments
    disk = run_disk_bytes(load_config(os.path.join(CONFIGS, "dapo_32b.toml")), args)
    assert [round(disk[k] / GB, 1) for k in ("checkpoint_in", "training_checkpoint", "hf_export")] == [
        65.5,
        393.2,
        131.1,
    ]
    assert round(disk["training_checkpoints_at_once"] / disk["training_checkpoint"]) == 3
    assert round(disk["total"] / 1e12, 2) == 1.38
    assert round(2 * num_params(args) / GB, 1) == 65.5
    disk = run_disk_bytes(load_config(os.path.join(CONFIGS, "dapo_7b.toml")), PRESETS["qwen2.5-7b"])
    assert [round(disk[k] / GB, 1) for k in ("checkpoint_in", "training_checkpoint", "hf_export")] == [15.2, 91.4, 30.5]
    assert round(disk["total"] / GB) == 320
