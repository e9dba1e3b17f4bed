"""trainer/distributed.py: the gloo control groups outlast a slow engine (gloo ranks, CPU)."""

import pytest

from dist_utils import run_ranks

SLOW = 4.0  # seconds the slow rank generates; the default group's timeout is half of it


def _slow_engine_worker(rank, world, store_path):
    import time
    from datetime import timedelta

    import torch.distributed as dist

    from trainer.distributed import init_distributed
    from trainer.setup import engine_group

    # The default group gets a timeout shorter than one generation (NCCL's is 10 minutes, rounds take hours).
    dist.destroy_process_group()
    dist.init_process_group("gloo", rank=rank, world_size=world, store=dist.FileStore(store_path, world),
                            timeout=timedelta(seconds=SLOW / 2))
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
