"""train.py with the SGLang engine in its own process (the strict model of sglang 0.5.21 standing for it,
tests/strict_engine_train.py): the engine dying in each phase stops every rank with EngineDied after a
checkpoint of the last completed step, and a signal in each phase checkpoints, exits 143 / 130 and leaves
no process behind."""

import json
import os
import signal
import subprocess
import sys
import time
import uuid

import pytest
import torch

import train
from checkpoint.manager import CheckpointManager
from config import load_config
from model.args import get_preset
from model.hf import save_hf
from model.qwen2 import build_model
from model.tokenizer import Tokenizer
from rollout.engine import EngineDied
from tests.dist_utils import run_ranks
from tests.strict_engine_train import use_strict_model
from tests.test_rollout_sglang_process import children, engine_children
from tests.test_train_e2e import DEMO_SCRATCH, overrides, read_rows
from trainer.build import build_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """The demo preset as an HF checkpoint (what SGLang loads) with the synthetic task's tokenizer."""
    path = tmp_path_factory.mktemp("hf")
    cfg = load_config(DEMO_SCRATCH, ["data.synthetic_num_train=64"])
    build_tokenizer(cfg.model, cfg.data, str(path), is_main=True, barrier=lambda: None)
    save_hf(build_model(get_preset("demo"), seed=0), str(path / "hf"))
    return str(path)


def sglang_argv(run_dir, hf_dir, steps=2, **extra):
    settings = {
        "model.preset": "",
        "model.hf_path": os.path.join(hf_dir, "hf"),
        "model.tokenizer_path": os.path.join(hf_dir, "tokenizer"),
        "rollout.engine": "sglang",
        "algorithm.dynamic_sampling": False,  # every group is trained on: the model's answers have no spread
        "checkpoint.interval": 100,  # a checkpoint after a stop is the stop's own
    }
    settings.update(extra)
    return overrides(str(run_dir), steps=steps, **settings)


def saved_steps(run_dir):
    return CheckpointManager(os.path.join(run_dir, "run", "checkpoints")).complete_steps()


# The calls of a 2-step run: step 1 async_generate (1-4: one per group, run by a poll), release (1), sync: resume
# ["weights"] (1) and begin, update per bucket (1, 2, ...); step 2 resume ["kv_cache"] (2), async_generate (5-8), ...
@pytest.mark.parametrize(
    "phase, call, during",
    [
        ("async_generate", 5, "poll_groups"),
        ("release", 2, "release_memory_occupation"),
        ("resume", 2, "resume_memory_occupation"),
        ("update", 1, "update_weights_from_tensor"),
    ],
)
def test_the_engine_dying_in_each_phase_checkpoints_the_last_step(tmp_path, hf_dir, monkeypatch, phase, call, during):
    use_strict_model(monkeypatch.setattr, crash={phase: call})
    before = children()
    with pytest.raises(EngineDied, match=rf"ended during {during} \(killed by SIGKILL\)\. Checkpoint of step 1 saved"):
        train.main(sglang_argv(tmp_path, hf_dir))
    # Step 1 completed in every case (the update crashed after its training): a new checkpoint of it, and its row.
    assert saved_steps(tmp_path) == [1]
    assert [r["step"] for r in read_rows(str(tmp_path)) if "loss" in r] == [1]
    assert engine_children(before) == set()


def _marked(marker: str) -> list[int]:
    """Processes whose environment carries `marker` (every descendant of a run, reparented or not)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    if marker.encode() in f.read():
                        found.append(int(entry))
            except OSError:
                continue
    return found


def run_script(argv, options, *, signal_at=None, timeout=300):
    """tests/strict_engine_train.py ARGV in a session of its own; signal_at = (phase, signal, to the group):
    sent once the phase is announced. Returns (exit code, stderr, processes of the run left afterwards)."""
    marker = f"DAPO_TEST_RUN={uuid.uuid4().hex}"
    env = dict(os.environ, STRICT_SGLANG=json.dumps(options), DAPO_TEST_RUN=marker.split("=")[1])
    process = subprocess.Popen(
        [sys.executable, "tests/strict_engine_train.py", *argv],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    if signal_at is not None:
        phase, sig, to_group = signal_at
        deadline = time.monotonic() + timeout
        announced = options["announce"]
        while not (os.path.exists(announced) and phase in open(announced).read().split()):
            assert process.poll() is None and time.monotonic() < deadline, process.communicate()
            time.sleep(0.02)
        (os.killpg if to_group else os.kill)(process.pid, sig)
    _, stderr = process.communicate(timeout=timeout)
    time.sleep(0.5)  # a process killed by the run's end needs a moment to leave /proc
    return process.returncode, stderr, _marked(marker)


def test_an_engine_death_exits_1_with_one_line_and_the_same_command_resumes(tmp_path, hf_dir, monkeypatch):
    argv = sglang_argv(tmp_path, hf_dir, steps=3)
    code, stderr, left = run_script(argv, {"crash": {"async_generate": 5}})
    last = stderr.strip().splitlines()[-1]
    assert code == 1 and left == [], stderr[-3000:]
    assert last.startswith("error: the rollout engine died: the SGLang engine process (pid ") and last.endswith(
        "ended during poll_groups (killed by SIGKILL). Checkpoint of step 1 saved; rerun the same command to resume"
    ), last
    assert "Traceback" not in stderr and saved_steps(tmp_path) == [1]
    use_strict_model(monkeypatch.setattr)
    assert train.main(argv) == 0  # resumed at step 2
    assert [r["step"] for r in read_rows(str(tmp_path)) if "loss" in r] == [1, 2, 3]


@pytest.mark.parametrize(
    "phase, sig, to_group, code",
    [
        ("async_generate", signal.SIGTERM, False, 143),  # a launcher's SIGTERM to the trainer
        ("train", signal.SIGINT, True, 130),  # Ctrl-C: SIGINT to the whole foreground process group
        ("update", signal.SIGTERM, False, 143),  # during the weight sync
    ],
)
def test_a_signal_in_each_phase_checkpoints_and_leaves_no_process(tmp_path, hf_dir, phase, sig, to_group, code):
    announce = str(tmp_path / "calls")
    options = {"announce": announce, "delay": {"async_generate": 1.0, "update": 1.0}, "train_delay": 1.0}
    code_, stderr, left = run_script(sglang_argv(tmp_path, hf_dir, steps=4), options, signal_at=(phase, sig, to_group))
    assert code_ == code and left == [], stderr[-3000:]
    assert "a checkpoint was saved: run the same command again to resume" in stderr.strip().splitlines()[-1]
    # The first announced phase is step 1's: a signal during its generation stops before training it.
    assert saved_steps(tmp_path) == ([0] if phase == "async_generate" else [1])


def _engine_group_run(rank, world, argv):
    try:
        train.main(argv)
    except EngineDied as exc:
        return str(exc)


@pytest.mark.multiprocess
def test_an_engine_death_stops_every_rank_of_its_group(tmp_path, hf_dir, monkeypatch):
    use_strict_model(monkeypatch.setattr, crash={"async_generate": 5})
    argv = sglang_argv(tmp_path, hf_dir, **{"rollout.tp_size": 2, "parallelism.dp_shard": 2})
    died = run_ranks(_engine_group_run, 2, argv, timeout=300)
    assert all("ended during poll_groups (killed by SIGKILL). Checkpoint of step 1 saved" in d for d in died), died
    assert saved_steps(tmp_path) == [1]


def _stopped_at(rank, world, argv):
    try:
        train.main(argv)
    except EngineDied as exc:
        return exc.exit_code, str(exc), time.time()


# A hang in each call kind of a 2-step run (counted as above); the first flush closes step 1's update session in
# step 2's resume.
@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "kind, call, during, saved",
    [
        ("async_generate", 5, "poll_groups", 1),
        ("update", 1, "update_weights_from_tensor", 1),
        pytest.param("release", 2, "release_memory_occupation", 1, marks=pytest.mark.slow),
        pytest.param("resume", 2, "resume_memory_occupation", 1, marks=pytest.mark.slow),
        # The first flush is step 1's wait for an idle scheduler before its release, so step 0 is the last complete
        pytest.param("flush", 1, "flush_cache", 0, marks=pytest.mark.slow),
    ],
)
def test_a_hung_engine_stops_every_rank_with_a_checkpoint_at_its_deadline(
    tmp_path, hf_dir, monkeypatch, kind, call, during, saved
):
    announce, deadline = str(tmp_path / "calls"), 15  # every other call must answer within it, on a loaded machine too
    use_strict_model(monkeypatch.setattr, hang={kind: call}, announce=announce)
    settings = {"rollout.tp_size": 2, "parallelism.dp_shard": 2, "rollout.call_timeout_s": deadline}
    ended = run_ranks(_stopped_at, 2, sglang_argv(tmp_path, hf_dir, **settings))
    hung_at = float(next(line for line in open(announce) if line.startswith("hang")).split()[1])
    for code, message, at in ended:  # every rank: exit code 1, the checkpoint of the step before, at the deadline
        assert code == 1 and f"ended during {during} (no answer within its deadline of {deadline} s: hung" in message
        assert message.endswith(f"Checkpoint of step {saved} saved; rerun the same command to resume")
        assert deadline <= at - hung_at < deadline + 30, at - hung_at
    assert saved_steps(tmp_path) == [saved]


def test_a_slow_engine_that_keeps_producing_is_never_stopped(tmp_path, hf_dir, monkeypatch):
    """A round lasts ~9 s (up to 300 tokens a request, a scheduler step every 0.03 s), longer than the progress
    window of 4 s and than the deadline the throughput guess gave it (call_timeout_s + 16 requests x 300 tokens /
    2500 tokens/s = 5.9 s); SGLang reports each request's tokens every 50 (every 1.5 s): it finishes, and so does
    the evaluation after it, on the same path."""
    use_strict_model(monkeypatch.setattr, tick_s=0.03)
    # A stop id the model's tokens (below 256) never reach: every response runs to its 300 tokens.
    monkeypatch.setattr(Tokenizer, "stop_ids", property(lambda self: [511]))
    settings = {"rollout.call_timeout_s": 4, "rollout.max_response_length": 300, "training.micro_batch_tokens": 512}
    evaluation = {"eval.at_end": True, "eval.k": 2, "eval.max_response_length": 300}
    argv = sglang_argv(tmp_path, hf_dir, steps=1, **settings, **evaluation)
    assert train.main(argv) == 0
    (row,) = [r for r in read_rows(str(tmp_path)) if "loss" in r]
    assert row["time/generate"] > 4 + 16 * 300 / 2500 and row["response_length/mean"] == 300, row
    assert "eval/avg_at_k" in read_rows(str(tmp_path))[-1]


def _stalled(rank, world, argv):
    try:
        train.main(argv)
    except EngineDied as exc:
        return exc.exit_code, str(exc), time.time()


@pytest.mark.multiprocess
def test_an_engine_that_stops_producing_is_killed_within_the_progress_window(tmp_path, hf_dir, monkeypatch):
    """Its scheduler stalls while SGLang's tokenizer manager still answers: every poll returns in time, with no
    token. Both ranks of its group stop within call_timeout_s and a poll of the round's start, exit code 1, after a
    checkpoint; its processes are killed."""
    announce, window = str(tmp_path / "calls"), 4
    use_strict_model(monkeypatch.setattr, stall_after=0, announce=announce)
    settings = {"rollout.tp_size": 2, "parallelism.dp_shard": 2, "rollout.call_timeout_s": window}
    before = children()
    ended = run_ranks(_stalled, 2, sglang_argv(tmp_path, hf_dir, **settings))
    started = min(float(line.split()[1]) for line in open(announce) if line.startswith("async_generate"))
    for code, message, at in ended:
        assert (
            code == 1 and f"no request produced a token or finished for {window} s (rollout.call_timeout_s)" in message
        )
        assert message.endswith(
            "hung, its processes killed. Checkpoint of step 0 saved; rerun the same command to resume"
        )
        assert window <= at - started < window + 1 + 20, at - started  # + a poll, + a loaded machine's slack
    assert saved_steps(tmp_path) == [0] and engine_children(before) == set()


def test_a_trainer_killed_outright_takes_its_engine_with_it(tmp_path, hf_dir):
    """A launcher's SIGKILL after its grace period: the engine process dies with its trainer (PR_SET_PDEATHSIG)."""
    announce = str(tmp_path / "calls")
    options = {"announce": announce, "delay": {"async_generate": 30.0}}
    code, _, left = run_script(
        sglang_argv(tmp_path, hf_dir), options, signal_at=("async_generate", signal.SIGKILL, False)
    )
    assert code == -signal.SIGKILL and left == []


def _failing_bucket(rank, world, argv, failing_rank):
    """train.main on this rank, whose second weight bucket fails to serialize on `failing_rank` (before its
    engine group's gather): (the error, seconds from the failure to the stop)."""
    from rollout.sglang_engine import SGLangEngine

    serialize, buckets, failed_at = SGLangEngine._serialize, [], []

    def failing(self, payload):
        buckets.append(1)
        if rank == failing_rank and len(buckets) == 2:
            failed_at.append(time.time())
            raise RuntimeError("injected serialization failure")
        return serialize(self, payload)

    SGLangEngine._serialize = failing
    return _main_until_it_stops(argv)


def _main_until_it_stops(argv):
    """train.main(argv): (its error, or "finished"; when it ended)."""
    try:
        train.main(argv)
    except RuntimeError as exc:
        return str(exc), time.time()
    return "finished", time.time()


@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_a_bucket_that_fails_to_prepare_on_one_rank_stops_every_rank_at_once(tmp_path, hf_dir, monkeypatch, world):
    """Rank 1's flattening or serialization of a weight bucket fails before its engine group's gather: it enters
    the gather with its error, every rank of the group raises it, and the ranks agree at that bucket: every rank
    stops with a checkpoint within seconds, none waits in a collective for the 6-hour group timeout."""
    use_strict_model(monkeypatch.setattr)
    settings = {"rollout.tp_size": 2, "parallelism.dp_shard": world, "rollout.weight_sync_bucket_mb": 1}
    settings["training.mini_batch_size"] = world  # whole groups on each rank: one a rank per update
    start = time.time()
    ended = run_ranks(_failing_bucket, world, sglang_argv(tmp_path, hf_dir, **settings), 1, timeout=600)
    for rank, (message, _) in enumerate(ended):  # ranks 0 and 1 share the failing engine, 2 and 3 another
        why = "rank 1: RuntimeError: injected serialization failure" if rank < 2 else "failed on another rank"
        assert "update_weights (" in message and why in message, message
        assert "Checkpoint of step 1 saved; rerun the same command to resume" in message, message
    stops = [at for _, at in ended]
    assert max(stops) - min(stops) < 20 and max(stops) - start < 300  # together, and no collective's timeout
    assert saved_steps(tmp_path) == [1]


def _one_rank_fails(rank, world, argv, failing_rank, where):
    """train.main on this rank, where on `failing_rank` the step's scoring fails (where = "scoring": in the step's
    last round, the engine's next call being its group's release), or the step's weight sync cannot ready a shard
    of its second bucket for the gather (where = "shard": an out-of-memory error, injected): (the error, when this
    rank stopped)."""
    import rollout.weight_sync
    import trainer.rollout_phase

    score, tensors = trainer.rollout_phase.score_groups, rollout.weight_sync.iter_hf_tensors

    def failing_score(*args, **kwargs):
        if rank == failing_rank:
            raise RuntimeError("injected scoring failure")
        return score(*args, **kwargs)

    def failing_tensors(source):  # the demo preset's buckets of 1 MB: 13, 22, 14 and 1 tensors
        for index, pair in enumerate(tensors(source)):
            if rank == failing_rank and index == 20:
                raise torch.OutOfMemoryError("injected: no room to move the shard")
            yield pair

    if where == "scoring":
        trainer.rollout_phase.score_groups = failing_score
    else:
        rollout.weight_sync.iter_hf_tensors = failing_tensors
    return _main_until_it_stops(argv)


@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
@pytest.mark.parametrize(
    "where, stopped_in, why, saved",
    [
        ("scoring", "step 1, rollout", "RuntimeError: injected scoring failure", 0),
        ("shard", "the weight sync's bucket 2", "OutOfMemoryError: injected: no room to move the shard", 1),
    ],
)
def test_a_failure_on_one_rank_before_an_engine_collective_stops_every_rank_with_a_checkpoint(
    tmp_path, hf_dir, monkeypatch, world, where, stopped_in, why, saved
):
    """Rank 1 fails where its peers, with no failure of their own, would go on into a collective rank 1 never
    enters: its scoring in the step's only round (the peers would go on into their engine group's collective of
    the release) or readying a shard of the weight sync's second bucket (the peers would go on into its gather).
    The ranks agree there instead (on leaving the rollout; before each bucket's gathers), so every rank stops
    with a checkpoint within seconds (the groups' timeout is 30 s here, 6 hours by default)."""
    use_strict_model(monkeypatch.setattr)
    settings = {"rollout.tp_size": 2, "parallelism.dp_shard": world, "algorithm.max_num_gen_batches": 1}
    settings |= {"rollout.round_timeout_s": 30, "training.train_batch_size": world, "training.mini_batch_size": world}
    settings |= {"rollout.weight_sync_bucket_mb": 1}
    start = time.time()
    ended = run_ranks(_one_rank_fails, world, sglang_argv(tmp_path, hf_dir, **settings), 1, where, timeout=300)
    for rank, (message, _) in enumerate(ended):
        cause = f"on data-parallel rank 1: {why}" if rank == 1 else "failed on another rank (see its log)"
        assert message.startswith(stopped_in) and cause in message, message
        end = f"Checkpoint of step {saved} saved; rerun the same command to resume (with the cause fixed)"
        assert message.endswith(end), message
    stops = [at for _, at in ended]
    assert max(stops) - min(stops) < 20 and max(stops) - start < 30 + 60, stops  # no collective's timeout
    assert saved_steps(tmp_path) == [saved]
