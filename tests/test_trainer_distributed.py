"""parallel/dist_env.py: the gloo control groups outlast a slow engine (gloo ranks, CPU)."""

import os

import pytest
from dist_utils import run_ranks

SLOW = 10.0  # seconds the slow rank generates; the default group's timeout is half of it (its setup too, so not less)


def _default_group_shorter_than(seconds, rank, world, store_path):
    """Rebuild this rank's default process group with a timeout of half of `seconds`."""
    from datetime import timedelta

    import torch.distributed as dist

    dist.destroy_process_group()
    store = dist.FileStore(store_path, world)
    dist.init_process_group("gloo", rank=rank, world_size=world, store=store, timeout=timedelta(seconds=seconds / 2))


def _slow_engine_worker(rank, world, store_path):
    import time

    import torch.distributed as dist

    from parallel.dist_env import init_distributed
    from rollout.engine_spec import engine_group

    # The default group gets a timeout shorter than one generation (NCCL's is 10 minutes, rounds take hours).
    _default_group_shorter_than(SLOW, rank, world, store_path)
    env = init_distributed(1, -1, 1)  # control groups: the default timeout of rollout.round_timeout_s
    group, _ = engine_group(2, env)
    backend = dist.get_backend(group)
    # The leader generates while its follower waits inside the engine group for the result.
    if rank == 0:
        time.sleep(SLOW)
    box = [f"completions of rank {rank}"]
    dist.broadcast_object_list(box, src=0, group=group)
    # One rank's engine is slower; the per-round agreement waits for it.
    if rank == 1:
        time.sleep(SLOW)
    worst = env.all_reduce([float(rank)], op="max", group="world")[0]
    return backend, box[0], worst


@pytest.mark.multiprocess
def test_engine_groups_and_round_agreement_wait_for_a_slow_engine(tmp_path):
    got = run_ranks(_slow_engine_worker, 2, str(tmp_path / "store"), timeout=60)
    assert got == [("gloo", "completions of rank 0", 1.0)] * 2


_FAKE_WORLD = """
import os
os.environ.update(WORLD_SIZE="8", RANK="0", LOCAL_RANK="0")
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
from parallel.dist_env import init_distributed
from rollout.engine_spec import engine_group
env = init_distributed(1, -1, 1)
group, gpu = engine_group(4, env)
print(dist.get_backend(env.control_group), dist.get_backend(group), gpu)
"""


def test_control_groups_in_a_fake_world():
    """A rehearsal runs train.py's set-up as one rank of a fake world: there, gloo has no peers to join."""
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", _FAKE_WORLD], cwd=root, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["fake", "fake", "0"]


class _SlowEngine:
    """Answers every sample "1" (correct) after `delay` seconds, producing a token on every poll meanwhile (so
    the guard's progress rule never calls it hung)."""

    group = None

    def __init__(self, delay):
        self.delay, self.pending, self.since = delay, None, 0.0

    def resume_memory(self):
        pass

    def submit(self, prompts, params):
        import time

        self.pending, self.since = (len(prompts), params.n), time.monotonic()

    def poll(self):
        import time

        from rollout.engine import Completion, Polled

        if self.pending is None:
            return Polled([], 0, True)
        if time.monotonic() - self.since < self.delay:
            time.sleep(0.2)
            return Polled([], 1, False)
        prompts, n = self.pending
        self.pending = None
        return Polled(
            [Completion(p, s, [1], [-0.5], "stop") for p in range(prompts) for s in range(n)], prompts * n, True
        )


class _AnswerTokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return "Answer: " + "".join(str(i) for i in ids)


def _late_eval_worker(rank, world, store_path, run_path):

    from data.prompts import PromptExample
    from evaluation.held_out import run_held_out_eval
    from parallel.dist_env import init_distributed
    from rollout.engine import SamplingParams
    from run.guard import GuardedEngine

    # As above: the default group's timeout is shorter than one engine's evaluation (NCCL: 10 minutes).
    _default_group_shorter_than(SLOW, rank, world, store_path)
    env = init_distributed(1, -1, 1)
    problems = [PromptExample([k], "1", "t", []) for k in range(2)]
    engine = GuardedEngine(_SlowEngine(SLOW if rank == 1 else 0.0), env)  # rank 1's engine evaluates for longer
    metrics = run_held_out_eval(
        engine, problems, _AnswerTokenizer(), SamplingParams(max_new_tokens=2, n=2), env, run_path, 0
    )
    return metrics["eval/avg_at_k"]


@pytest.mark.multiprocess
def test_evaluation_waits_for_a_slow_engine_on_the_control_group(tmp_path):
    """The evaluation's merge waited on the data-parallel group (NCCL, no timeout given: 10 minutes) and a
    rank whose engine finished first timed out there; it waits on the gloo control group now."""
    got = run_ranks(_late_eval_worker, 2, str(tmp_path / "store"), str(tmp_path), timeout=60)
    assert got == [1.0, 1.0]
