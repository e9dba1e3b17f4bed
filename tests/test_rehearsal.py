"""The rehearsal (train.py --rehearse): its ledger against real measurements, its verdicts, and the build
order and cache returns it checks."""

import json
import os

import pytest
import torch

import train
from config import load_config
from preflight.gpu_ledger import MemoryLedger
from preflight.rehearsal import rehearse, run_phases
from tests.dist_utils import run_ranks

CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")
DEMO_SCRATCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "demo_scratch.toml")  # no base policy


def small_config(world_size, **extra):
    """The demo preset with a micro-batch of 1,024 tokens and the torch engine (no SGLang on CPU)."""
    values = {
        "model.preset": "demo",
        "rollout.engine": "torch",
        "data.max_prompt_length": 64,
        "rollout.max_response_length": 448,
        "eval.max_response_length": 448,
        "algorithm.overlong_buffer": 64,
        "training.micro_batch_tokens": 1024,
        "rollout.max_batch_size": 8,
        "parallelism.param_dtype": "bfloat16",
        "parallelism.activation_checkpoint": "full",
        "rehearse.world_size": world_size,
        "rehearse.gpu_memory_gb": 1.0,
        "rehearse.context_gb": 0.0,
    }
    values.update(extra)
    return load_config(DEMO_SCRATCH, [f"{k}={v}" for k, v in values.items()])


def _measured(rank, world_size, cfg):
    """train.py's phases on real gloo ranks with real tensors, measured by PyTorch's memory trackers."""
    import checkpoint.sharded_policy
    from parallel.dims import ParallelDims
    from parallel.dist_env import DistEnv

    dims = ParallelDims(dp_shard=-1, world_size=world_size)
    dims.build_mesh("cpu")
    ledger = MemoryLedger(10**12, 0)
    # fill=False: the checkpoint is read into host memory, which the ledger does not count (here the host
    # and the "GPU" are one device); the shards it fills are allocated either way. Their values are whatever
    # the allocator left there: zeroed in place (no memory), so that the gradient norm is finite and the
    # optimizer step is not skipped.
    shard_policy = checkpoint.sharded_policy.shard_policy

    def zeroed(*args, **kwargs):
        policy = shard_policy(*args, **kwargs)
        with torch.no_grad():
            for p in policy.parameters():
                p.zero_()
        return policy

    checkpoint.sharded_policy.shard_policy = zeroed
    run_phases(cfg, DistEnv(rank, world_size, rank, torch.device("cpu"), dims), ledger, fill=False)
    return {row.phase: row.trainer_peak for row in ledger.rows}


@pytest.mark.multiprocess
@pytest.mark.parametrize("world_size", [2, 4])
def test_the_ledger_matches_the_measured_peak_of_every_phase(world_size):
    cfg = small_config(world_size)
    ledger, _, _ = rehearse(cfg)
    predicted = {row.phase: row.trainer_peak for row in ledger.rows}
    measured = run_ranks(_measured, world_size, cfg)
    for rank_peaks in measured:
        assert rank_peaks.keys() == predicted.keys()
        for phase, real in rank_peaks.items():
            assert real > 0, phase
            assert abs(predicted[phase] - real) <= 0.15 * real, (phase, predicted[phase], real)
    # The phases that hold more than the state differ: the comparison is not of constants.
    assert predicted["train: forward+backward"] > 1.5 * predicted["rollout"]


def test_a_phase_that_does_not_fit_exits_2_naming_it_and_the_shortfall(capsys):
    cfg_args = [
        "--config",
        DEMO_SCRATCH,
        "--rehearse",
        "--model.preset=demo",
        "--rollout.engine=torch",
        "--rehearse.world_size=2",
        "--rehearse.gpu_memory_gb=0.05",
        "--rehearse.context_gb=0",
        "--training.micro_batch_tokens=4096",
    ]
    assert train.main(cfg_args) == 2
    out, err = capsys.readouterr()
    result = json.loads(out.strip().splitlines()[-1])
    assert not result["fits"]
    first_short = next(p for p in result["rehearsal"]["phases"] if p["total_gb"] > 0.05)
    assert f"phase '{first_short['phase']}' needs {first_short['total_gb']:.1f} GB" in err
    assert "GB short" in err and "Traceback" not in err


def test_every_phase_is_in_the_table_and_fits_with_enough_memory(capsys):
    argv = [
        "--config",
        DEMO_SCRATCH,
        "--rehearse",
        "--model.preset=demo",
        "--rollout.engine=torch",
        "--rehearse.world_size=8",
        "--rehearse.gpu_memory_gb=80",
    ]
    assert train.main(argv) == 0
    out = capsys.readouterr().out
    for phase in (
        "load + shard",
        "engine start",
        "rollout",
        "release",
        "train: old log-probs",
        "train: forward+backward",
        "train: optimizer step",
        "weight sync",
        "resume",
    ):
        assert phase in out
    assert json.loads(out.strip().splitlines()[-1])["fits"]


def test_the_rehearsal_needs_an_architecture(capsys):
    argv = ["--config", os.path.join(CONFIGS, "dapo_32b.toml"), "--rehearse", "--rehearse.preset="]
    with pytest.raises(SystemExit) as exit_info:
        train.run_cli(argv)
    assert exit_info.value.code == 2
    assert "rehearse.preset" in capsys.readouterr().err


def test_the_optimizer_step_holds_the_state_and_one_foreach_temporary():
    """AdamW's foreach step on 8 fake ranks: 2 x the sharded fp32 parameters of state, plus one temporary
    of their size, not the global-shape tensors of DTensor's sharding propagation."""
    cfg = small_config(8, **{"model.preset": "qwen2.5-0.5b", "rehearse.gpu_memory_gb": 80.0})
    ledger, _, _ = rehearse(cfg)
    rows = {row.phase: row for row in ledger.rows}
    params = rows["rollout"].trainer["params"]
    assert rows["train: optimizer step"].trainer["optimizer"] == pytest.approx(3 * params, rel=0.02)
    assert rows["resume"].trainer["optimizer"] == pytest.approx(2 * params, rel=0.02)


def test_an_engine_without_room_for_its_kv_pool_fails_at_engine_start(capsys):
    """SGLang's rule (preflight/sglang_memory.py): the KV pool is sized from the memory free at engine start."""
    argv = [
        "--config",
        DEMO_SCRATCH,
        "--rehearse",
        "--model.preset=demo",
        "--rollout.engine=sglang",
        "--rehearse.world_size=2",
        "--rehearse.gpu_memory_gb=2",
        "--rehearse.context_gb=1.99",
    ]
    assert train.main(argv) == 2
    err = capsys.readouterr().err
    assert "phase 'engine start'" in err and "SGLang would refuse to start" in err


@pytest.mark.slow
def test_dapo_32b_fits_8_gpus_of_80_gb(capsys):
    """The shipped recipe on one node (about 2-3 minutes on one core)."""
    assert train.main(["--config", os.path.join(CONFIGS, "dapo_32b.toml"), "--rehearse"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["fits"] and result["world_size"] == 8 and result["rehearsal"]["gpu_gb"] == 80
    host = result["host"]
    assert host["ranks_per_node"] == 8 and host["peak_node_gb"] < 1000  # the host of every phase, load included
    assert [p["phase"] for p in host["phases"]] == [p["phase"] for p in result["rehearsal"]["phases"]]


@pytest.mark.multiprocess
def test_ranks_forked_after_a_rehearsal_shard_correctly():
    """DTensor caches specs by value and a mesh equals any mesh of the same ranks: without clearing them,
    gloo ranks forked after a rehearsal were handed the fake world's rank-0 mesh for some parameters."""
    from model.args import get_preset
    from model.qwen2 import build_model
    from tests.test_colocation_order import _sharded_values

    rehearse(small_config(2))
    expected = build_model(get_preset("tiny"), seed=0)
    for values in run_ranks(_sharded_values, 2, ["parallelism.dp_shard=2"]):
        for name, value in values.items():
            assert torch.equal(value, expected.get_parameter(name).detach()), name
