"""Intra-op threads per process (parallel/cpu_threads.py): the CPU-offloaded optimizer gets the node's cores."""

import os

import pytest
import torch

from parallel.cpu_threads import intra_op_threads, set_intra_op_threads


def decide(configured=0, *, offload=True, cores=64, local=8, omp="1"):
    return intra_op_threads(
        configured, cpu_offload=offload, node_cores=cores, local_processes=local, omp_num_threads=omp
    )[0]


def test_offloading_under_torchrun_takes_the_cores_of_the_node_divided_by_its_processes():
    assert decide(cores=224, local=8) == 28  # torchrun's OMP_NUM_THREADS=1 is not a choice of the user
    assert decide(cores=64, local=8, omp=None) == 8
    assert decide(cores=2, local=1) == 2  # one process: every core
    assert decide(cores=6, local=4) == 1  # rounds down: never more threads than cores in all
    assert decide(cores=2, local=8) == 1  # at least one


def test_without_offload_torchs_default_stays():
    assert decide(offload=False) is None
    assert decide(offload=False, omp=None) is None


def test_an_explicit_setting_wins():
    assert decide(3) == 3
    assert decide(3, offload=False) == 3
    assert decide(3, omp="16") == 3
    assert decide(omp="16") is None  # a user's OMP_NUM_THREADS (torchrun only ever sets 1) is kept
    assert decide(omp=" 1 ") == 8


def test_the_decision_is_applied_and_said():
    before = torch.get_num_threads()
    try:
        threads, why = set_intra_op_threads(
            0, cpu_offload=True, environ={"LOCAL_WORLD_SIZE": "1", "OMP_NUM_THREADS": "1"}
        )
        assert threads == torch.get_num_threads() == len(os.sched_getaffinity(0))
        assert "processes on this node" in why and "CPU-offloaded optimizer" in why
        threads, why = set_intra_op_threads(1, cpu_offload=True, environ={})
        assert threads == 1 and why == "job.cpu_threads"
    finally:
        torch.set_num_threads(before)


class _Built(Exception):
    """Stops train.main where it would build the run: the threads are set by then."""


@pytest.mark.parametrize("offload", [True, False])
def test_train_sets_and_logs_the_threads_once_before_it_builds(offload, tmp_path, caplog, monkeypatch):
    import train

    def build(cfg, dist, fresh):
        raise _Built(torch.get_num_threads())

    monkeypatch.setattr(train, "build", build)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    caplog.set_level("INFO")
    argv = ["--config", "configs/demo_cpu.toml", f"--job.run_dir={tmp_path}", "--job.cpu_threads=0"]
    argv.append(f"--parallelism.cpu_offload={str(offload).lower()}")
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)  # what torchrun's OMP_NUM_THREADS=1 gives
        with pytest.raises(_Built) as built:
            train.main(argv)
    finally:
        torch.set_num_threads(before)
    assert built.value.args[0] == (len(os.sched_getaffinity(0)) if offload else 1)
    lines = [r.getMessage() for r in caplog.records if "intra-op CPU threads" in r.getMessage()]
    assert len(lines) == 1
    assert ("CPU-offloaded optimizer" in lines[0]) == offload
