"""Colocation order on a GPU: the engine starts after the policy is sharded, and the trainer's cached memory
is handed back before the engine takes memory."""

import os

import pytest
import torch
from torch.distributed.tensor import DTensor

import rl.reward
import train
from checkpoint.sharded_policy import build_sharded_policy
from config import load_config
from model.args import get_preset
from model.qwen2 import build_model
from parallel.device_memory import observe_cache_returns
from preflight.rehearsal import fake_dist_env, fake_job
from rollout.engine_spec import EngineSpec
from tests.dist_utils import run_ranks
from tests.planted_train import planted_score
from tests.test_train_e2e import overrides
from trainer.build import build_policy_and_engine

CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")
DEMO_SCRATCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "demo_scratch.toml")  # no base policy


def test_the_engine_starts_when_the_policy_holds_only_its_shards(monkeypatch):
    """8 ranks (fake process group): at engine start every parameter is an FSDP shard on the device,
    1/8 of the full tensor; nothing full-size was left on the device for the engine to size around."""
    cfg = load_config(DEMO_SCRATCH, ["model.preset=tiny", "parallelism.dp_shard=-1"])
    seen = {}

    def start_beside(spec, policy, dist_env):
        seen["params"] = {
            name: (p.shape, p.to_local().shape if isinstance(p, DTensor) else None, p.device)
            for name, p in policy.named_parameters()
        }
        return object()

    monkeypatch.setattr(EngineSpec, "start_beside", start_beside)
    with fake_job(8):
        build_policy_and_engine(cfg, fake_dist_env(cfg, 8))
    assert seen["params"]
    for name, (full, local, device) in seen["params"].items():
        assert local is not None, f"{name} is a full tensor when the engine starts"
        assert local[0] == -(-full[0] // 8) and local[1:] == full[1:], name
        assert device.type == "cpu", name  # materialised, not meta


def _sharded_values(rank, world_size, layout):
    from parallel.dist_env import init_distributed

    cfg = load_config(DEMO_SCRATCH, ["model.preset=tiny", "parallelism.param_dtype=float32"] + layout)
    dist_env = init_distributed(cfg.parallelism.dp_replicate, cfg.parallelism.dp_shard, cfg.parallelism.tp)
    policy = build_sharded_policy(cfg.model, cfg.parallelism, dist_env, seed=cfg.job.seed)
    return {name: (p.full_tensor() if isinstance(p, DTensor) else p).detach() for name, p in policy.named_parameters()}


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "layout", [["parallelism.dp_shard=2"], ["parallelism.tp=2", "parallelism.dp_shard=1"]], ids=["fsdp2", "tp2"]
)
def test_the_sharded_policy_holds_the_seeded_initialization(layout):
    expected = build_model(get_preset("tiny"), seed=0)
    for values in run_ranks(_sharded_values, 2, layout):
        assert values.keys() == dict(expected.named_parameters()).keys()
        for name, value in values.items():
            torch.testing.assert_close(value, expected.get_parameter(name), rtol=0, atol=0, msg=name)


class RecordingEngine:
    """Passes every call to the real engine and records the ones that take or give back memory."""

    def __init__(self, engine, events):
        self._engine, self._events = engine, events

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def resume_memory(self):
        self._events.append("resume_memory")
        return self._engine.resume_memory()

    def release_memory(self):
        self._events.append("release_memory")
        return self._engine.release_memory()

    def update_weights(self, bucket):
        self._events.append("update_weights")
        return self._engine.update_weights(bucket)


def test_cached_memory_is_returned_before_the_engine_takes_memory(tmp_path, monkeypatch):
    events = []
    start_beside = EngineSpec.start_beside
    monkeypatch.setattr(
        EngineSpec, "start_beside", lambda spec, *a, **k: RecordingEngine(start_beside(spec, *a, **k), events)
    )
    monkeypatch.setattr(rl.reward, "compute_score", planted_score)
    with observe_cache_returns(lambda: events.append("return")):
        assert train.main(overrides(str(tmp_path), steps=2)) == 0
    assert events.count("release_memory") == 2
    # After each release, the first call that takes memory back comes after a return of the cache.
    for i, event in enumerate(events):
        if event == "release_memory":
            takes = next(j for j in range(i + 1, len(events)) if events[j] in ("update_weights", "resume_memory"))
            assert "return" in events[i + 1 : takes], events


def test_cached_memory_is_returned_before_every_resume_including_evaluation(tmp_path, monkeypatch):
    """The engine maps its KV cache back for evaluation too: the weight sync before it leaves its buckets (and
    their flattened copies) in the trainer's allocator cache, which the engine cannot use."""
    events = []
    start_beside = EngineSpec.start_beside
    monkeypatch.setattr(
        EngineSpec, "start_beside", lambda spec, *a, **k: RecordingEngine(start_beside(spec, *a, **k), events)
    )
    monkeypatch.setattr(rl.reward, "compute_score", planted_score)
    argv = overrides(str(tmp_path), steps=2, **{"eval.interval": 1, "eval.at_start": True, "eval.at_end": True})
    with observe_cache_returns(lambda: events.append("return")):
        assert train.main(argv) == 0
    resumes = [i for i, event in enumerate(events) if event == "resume_memory"]
    assert len(resumes) == 2 + 3  # each step's rollouts, and the evaluations at steps 0, 1 and 2
    assert all(events[i - 1] == "return" for i in resumes), events


def test_the_wait_for_every_rank_s_cache_is_on_the_gloo_group(monkeypatch):
    """return_cached_memory's barrier (and DistEnv.barrier) waits on the control group, whose timeout is
    rollout.round_timeout_s, never on NCCL's 10-minute watchdog (docs/gpu.md, what bounds each wait)."""
    import torch.distributed as dist

    from parallel.device_memory import return_cached_memory
    from parallel.dist_env import DistEnv

    control, groups = object(), []
    monkeypatch.setattr(dist, "barrier", lambda group=None: groups.append(group))
    return_cached_memory(DistEnv(0, 2, 0, torch.device("cpu"), None, control))  # type: ignore[arg-type]
    assert groups == [control]
