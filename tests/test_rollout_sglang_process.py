"""The SGLang engine in its own process (rollout/engine_process.py), with the strict model of sglang 0.5.21
(tests/sglang_model.py) as the process's target: the model's crashes end that process the way SGLang's end
the process that owns the Engine (SIGQUIT to it, whose handler SIGKILLs its tree), and the trainer's side
sees EngineDied, never the signal. Each test starts one engine process (a fresh interpreter: seconds)."""

import functools
import mmap
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from dist_utils import GlooRanks, run_ranks
from engines import generate
from sglang_model import StrictSGLang, chain, children, flatten_bucket, serialize

from model.args import PRESETS
from model.hf import save_hf
from model.hf_adapter import to_hf_name
from model.qwen2 import build_model
from rollout.engine import EngineDied, SamplingParams
from rollout.engine_process import EngineCallError, EngineProcess
from rollout.sglang_engine import SGLangEngine
from rollout.weight_sync import sync_weights

ARGS = PRESETS["tiny"]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def engine_class(**model_options):
    """SGLangEngine whose engine process builds the strict model; CUDA IPC payloads are CPU stand-ins."""

    class Engine(SGLangEngine):
        engine_target = functools.partial(StrictSGLang, **model_options)

        def _flatten_bucket(self, bucket):
            return flatten_bucket(bucket)

        def _serialize(self, payload):
            return serialize(payload)

    return Engine


def engine_children(before: set[int]) -> set[int]:
    """Children of this process started since `before`, but multiprocessing's resource tracker (one per
    process, started with the first spawned process, ends with this process)."""
    from multiprocessing import resource_tracker

    return children() - before - {resource_tracker._resource_tracker._pid}


@pytest.fixture
def checkpoint(tmp_path):
    save_hf(build_model(ARGS, seed=0), str(tmp_path / "hf"))
    return str(tmp_path / "hf")


def _named(model):
    return [(to_hf_name(n), p.detach()) for n, p in model.named_parameters()]


def test_the_engine_runs_in_a_process_and_session_of_its_own(checkpoint):
    before = children()
    engine = engine_class()(checkpoint, dtype=torch.float32)
    process = engine._engine
    pid = process.process.pid
    assert pid in children() and os.getsid(pid) == pid != os.getsid(0)
    out = generate(engine, [[1, 2, 3]], SamplingParams(max_new_tokens=2, n=2))
    assert [c.token_ids for c in out] == [chain(3, 2)[0]] * 2
    engine.release_memory()
    trainer = build_model(ARGS, seed=5)
    sync_weights(trainer, engine, bucket_bytes=50_000)  # the payload strings cross the pipe as they are
    engine.resume_memory()
    pushed = process.call("read", "model", deadline_s=60)
    for name, param in trainer.named_parameters():
        assert torch.equal(pushed[name], param), name
    with pytest.raises(EngineCallError, match="AttributeError: .*no_such_state"):
        process.call("read", "no_such_state", deadline_s=60)  # an error inside: the process serves on
    assert process.call("read", "calls", deadline_s=60)[-1] == ("resume", ("kv_cache",))
    engine.shutdown()
    assert process.process.exitcode == 0 and engine_children(before) == set()
    with pytest.raises(EngineDied, match="shut down"):
        engine.submit([[1]], SamplingParams(max_new_tokens=1))


def test_a_signal_while_the_engine_process_is_spawned_runs_the_trainers_handler(monkeypatch):
    """SIGINT / SIGTERM are blocked in the spawning thread only (the child inherits them blocked): a SIGTERM sent
    to the trainer meanwhile, which the kernel hands to another of its threads, runs the trainer's handler (it was
    dropped when the trainer also ignored them around the spawn, a disposition being the whole process's)."""
    import multiprocessing.context
    import threading

    from rollout.engine_process import EngineProcess

    received = []
    previous = signal.signal(signal.SIGTERM, lambda sig, frame: received.append(sig))
    idle = threading.Event()
    other = threading.Thread(target=idle.wait)  # a thread of the trainer that does not block SIGTERM
    other.start()
    real_start = multiprocessing.context.SpawnProcess.start

    def start(process):
        os.kill(os.getpid(), signal.SIGTERM)  # to the process, while its spawning thread blocks it
        real_start(process)

    monkeypatch.setattr(multiprocessing.context.SpawnProcess, "start", start)
    try:
        EngineProcess(dict, {}, name="a dict").close(timeout_s=30)
        time.sleep(0.1)  # a handler runs at the main thread's next bytecode
    finally:
        idle.set()
        other.join()
        signal.signal(signal.SIGTERM, previous)
    assert received == [signal.SIGTERM]


@pytest.mark.parametrize("phase", ["release"])  # every phase, in train.py: tests/test_train_engine_process.py
def test_a_scheduler_crash_ends_only_the_engine_process(checkpoint, phase):
    """SGLang's crash path (SIGQUIT to the engine's owner, which SIGKILLs its tree) ends the engine process;
    the call raises EngineDied naming it, every later call raises at once, and no process is left."""
    before = children()
    engine = engine_class(crash={phase: 1})(checkpoint, dtype=torch.float32)
    pid = engine._engine.process.pid
    trainer = build_model(ARGS, seed=5)
    steps = {
        "generate": lambda: generate(engine, [[1, 2]], SamplingParams(max_new_tokens=2)),
        "release": engine.release_memory,
        "update": lambda: sync_weights(trainer, engine, bucket_bytes=50_000),
        "resume": engine.resume_memory,
    }
    with pytest.raises(EngineDied, match=rf"the SGLang engine process \(pid {pid}\) ended during .*killed by SIGKILL"):
        for name in ("generate", "release", "update", "resume"):
            steps[name]()
    assert engine_children(before) == set()
    for call in steps.values():
        with pytest.raises(EngineDied, match=f"pid {pid}"):
            call()
    engine.shutdown()


def test_a_killed_engine_process_and_a_sigquit_are_engine_deaths(checkpoint, tmp_path):
    before = children()
    announce = str(tmp_path / "calls")
    engine = engine_class(delay={"async_generate": 30.0}, announce=announce)(checkpoint, dtype=torch.float32)
    pid = engine._engine.process.pid
    started = time.monotonic()
    killer = subprocess.Popen(
        [sys.executable, "-c", _KILL_WHEN_ANNOUNCED, announce, "async_generate", str(pid), str(int(signal.SIGKILL))]
    )
    with pytest.raises(EngineDied, match=r"ended during poll_groups \(killed by SIGKILL\)"):
        generate(engine, [[1]], SamplingParams(max_new_tokens=1))
    assert time.monotonic() - started < 25  # noticed while waiting, not after the call's 30 s
    killer.wait(timeout=30)
    engine.shutdown()
    # SIGQUIT is SGLang's own "a child failed" signal: its handler kills the engine's process tree.
    engine = engine_class()(checkpoint, dtype=torch.float32)
    os.kill(engine._engine.process.pid, signal.SIGQUIT)
    with pytest.raises(EngineDied, match="killed by SIGKILL"):
        generate(engine, [[1]], SamplingParams(max_new_tokens=1))
    engine.shutdown()
    assert engine_children(before) == set()


_KILL_WHEN_ANNOUNCED = """
import os, sys, time
path, what, pid, sig = sys.argv[1:]
while not (os.path.exists(path) and what in open(path).read().split()):
    time.sleep(0.02)
os.kill(int(pid), int(sig))
"""


_TRAINER_WITH_AN_ENGINE = """
import functools, os, signal, sys
sys.path[:0] = [{root!r}, os.path.join({root!r}, "tests")]
import torch
from sglang_model import StrictSGLang
from rollout.engine import SamplingParams
from rollout.sglang_engine import SGLangEngine
from run.guard import GuardedEngine

class Engine(SGLangEngine):
    engine_target = functools.partial(StrictSGLang)

if __name__ == "__main__":
    seen = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, frame: seen.append(signal.Signals(signum).name))
    engine = Engine({checkpoint!r}, dtype=torch.float32)
    GuardedEngine(engine).generate([[1]], SamplingParams(max_new_tokens=1))  # SGLang installs its SIGTERM handler now
    os.killpg(0, signal.SIGINT)  # a terminal's Ctrl-C: the whole foreground process group
    os.kill(engine._engine.process.pid, signal.SIGTERM)  # a launcher signalling every process of the job
    out = GuardedEngine(engine).generate([[1, 2]], SamplingParams(max_new_tokens=1))
    engine.shutdown()
    print(seen, out[0].token_ids, engine._engine is None)
"""


def test_terminal_signals_reach_the_trainer_and_not_the_engine(checkpoint):
    """A Ctrl-C (SIGINT to the process group) and a SIGTERM sent to the engine process itself after its first
    request (SGLang's drain-and-exit handler installed) leave the engine serving: stopping is the trainer's
    decision, made by its own handlers."""
    script = _TRAINER_WITH_AN_ENGINE.format(root=ROOT, checkpoint=checkpoint)
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, start_new_session=True
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split("\n")[0] == f"['SIGINT'] {chain(2, 1)[0]} True"


def _leader_crash_worker(rank, world, checkpoint):
    import torch.distributed as dist

    engine = engine_class(crash={"update": 2})(checkpoint, tp_size=world, dtype=torch.float32, group=dist.group.WORLD)
    generate(engine, [[1 + rank]], SamplingParams(max_new_tokens=1), GlooRanks(rank, world))
    engine.release_memory()
    trainer = build_model(ARGS, seed=5)
    try:
        sync_weights(trainer, engine, bucket_bytes=50_000)  # every rank raises at the same bucket
    except EngineDied as exc:
        died = str(exc)
    try:
        engine.resume_memory()
    except EngineDied as exc:
        again = str(exc)
    engine.shutdown()
    return died, again == died


@pytest.mark.multiprocess
def test_the_leaders_engine_death_is_raised_on_every_rank_of_its_group(checkpoint):
    results = run_ranks(_leader_crash_worker, 2, checkpoint, timeout=120)
    assert results[0] == results[1]
    died, same = results[0]
    assert same and "ended during update_weights_from_tensor (killed by SIGKILL)" in died


def _map(path: str) -> mmap.mmap:
    """Map a 4 KiB file under /dev/shm, creating it, as SGLang's processes map their shared buffers."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    os.ftruncate(fd, 4096)
    try:
        return mmap.mmap(fd, 4096)
    finally:
        os.close(fd)


class _MapsSharedMemory:
    """An engine process's target that maps files under /dev/shm and keeps them mapped."""

    def __init__(self, paths):
        self.maps = [_map(p) for p in paths]

    def shutdown(self):
        pass


@pytest.mark.skipif(not os.path.isdir("/proc/self") or not os.path.isdir("/dev/shm"), reason="needs Linux's /proc")
@pytest.mark.parametrize("end", ["close", "killed"])
def test_the_shared_memory_the_engine_mapped_is_removed_when_it_ends(end):
    """No SGLang shutdown removes its /dev/shm files (a CPU engine's 258 MiB all-reduce buffer): the engine
    process removes those its processes mapped at start, however it ends; a file the trainer maps stays."""
    own, shared = (f"/dev/shm/dapo-test-{os.getpid()}-{end}-{name}" for name in ("own", "shared"))
    keep = _map(shared)
    try:
        process = EngineProcess(_MapsSharedMemory, {"paths": [own, shared]})
        assert process.shm_files == {own} and os.path.exists(own)
        if end == "killed":
            os.kill(process.process.pid, signal.SIGKILL)
            with pytest.raises(EngineDied):
                process.call("shutdown", deadline_s=30)
        process.close()
        assert not os.path.exists(own) and os.path.exists(shared)
    finally:
        keep.close()
        for path in (own, shared):
            if os.path.exists(path):
                os.unlink(path)
