"""train.py never loses or silently spoils a run: damaged checkpoints, a second run on the same folder, a full
disk, a policy gone non-finite, a resume with another model. Real runs of the tiny demo, real files."""

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

import rl.reward
import train
import trainer.loop
import trainer.scoring
from checkpoint.manager import CheckpointError, CheckpointManager
from parallel.finite import NonFiniteStateError
from run.lock import FolderBusyError, FolderLock
from tests.planted_train import planted_score
from tests.test_checkpoint_integrity import garbage_rank_json, overwrite_16_bytes_inside_a_tensor
from tests.test_train_e2e import overrides, read_rows

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PLANTED_TRAIN = [sys.executable, "tests/planted_train.py"]


@pytest.fixture
def planted(monkeypatch):
    """The planted reward (groups with spread from a random model), and pytest's signal handlers kept."""
    monkeypatch.setattr(rl.reward, "compute_score", planted_score)
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)


def _checkpoints(tmp_path) -> CheckpointManager:
    return CheckpointManager(str(tmp_path / "run" / "checkpoints"))


# ---- damaged checkpoints ------------------------------------------------------------------------------------


def test_a_run_resumes_from_the_newest_intact_checkpoint_and_says_which(tmp_path, planted, caplog):
    train.main(overrides(str(tmp_path), steps=2))
    damaged = overwrite_16_bytes_inside_a_tensor(_checkpoints(tmp_path).step_path(2))
    with caplog.at_level("INFO"):
        assert train.main(overrides(str(tmp_path), steps=3)) == 0
    lines = [r.getMessage() for r in caplog.records if r.name == "checkpoint.manager"]
    assert len(lines) == 1 and "step-00000002 is damaged" in lines[0] and damaged in lines[0], lines
    assert "resumed from step 1" in caplog.text
    assert [r["step"] for r in read_rows(str(tmp_path)) if "loss" in r] == [1, 2, 3]  # step 2 redone
    assert _checkpoints(tmp_path).complete_steps() == [1, 2, 3]
    assert all(_checkpoints(tmp_path).validate(s) is None for s in (1, 2, 3))


def test_a_run_whose_every_checkpoint_is_damaged_is_refused_in_one_line(tmp_path, planted):
    train.main(overrides(str(tmp_path), steps=1))
    step_1 = _checkpoints(tmp_path).step_path(1)
    garbage_rank_json(step_1)
    before = sorted(os.listdir(tmp_path / "run" / "checkpoints"))
    result = subprocess.run(
        PLANTED_TRAIN + overrides(str(tmp_path), steps=2), cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 2, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert "Traceback" not in result.stderr
    assert last.startswith("checkpoint error: no intact checkpoint to resume from in ")
    assert "step-00000001 is damaged (file train_state/rank-00000.json does not match its content hash" in last
    assert "--fresh" in last
    assert sorted(os.listdir(tmp_path / "run" / "checkpoints")) == before  # nothing moved aside, nothing redone
    assert [r["step"] for r in read_rows(str(tmp_path)) if "loss" in r] == [1]


def test_resuming_with_another_model_preset_is_one_line_naming_both_shapes(tmp_path, planted, capsys):
    train.main(overrides(str(tmp_path), steps=1))
    with pytest.raises(SystemExit) as exited:
        train.run_cli(overrides(str(tmp_path), steps=2, **{"model.preset": "tiny"}))
    err = capsys.readouterr().err.strip().splitlines()
    assert exited.value.code == 2 and len(err) == 1, err
    assert "holds model.embed_tokens.weight with shape [512, 128], this run's model has [256, 64]" in err[0]
    assert "written for another model" in err[0] and "--fresh" in err[0]
    assert not list((tmp_path / "run").glob("config.launch-*"))  # a refused launch leaves no snapshot


# ---- two runs, one folder -----------------------------------------------------------------------------------


def _wait_for(condition, process, what: str, timeout: float = 300) -> None:
    deadline = time.time() + timeout
    while not condition():
        if process.poll() is not None or time.time() > deadline:
            process.kill()
            pytest.fail(f"waiting for {what}: {process.communicate()[1]}")
        time.sleep(0.05)


def test_a_second_run_on_a_folder_in_use_is_refused_and_takes_it_over_once_the_holder_is_gone(tmp_path):
    argv = overrides(str(tmp_path), steps=400, **{"checkpoint.interval": 100})
    first = subprocess.Popen(
        PLANTED_TRAIN + argv, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    folder = str(tmp_path / "run")
    try:
        metrics = tmp_path / "run" / "metrics.jsonl"
        _wait_for(lambda: metrics.exists() and '"loss"' in metrics.read_text(), first, "the first run's step 1")
        seconds = [
            subprocess.Popen(PLANTED_TRAIN + argv + extra, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            for extra in ([], ["--fresh"])  # --fresh must not move the folder of a live run aside either
        ]
        for second in seconds:
            _, stderr = second.communicate(timeout=300)
            err = stderr.decode().strip().splitlines()
            assert second.returncode == 2 and "Traceback" not in stderr.decode(), stderr.decode()
            assert err[-1].startswith(f"error: run folder {folder} is in use by another run (pid {first.pid} on host ")
        assert first.poll() is None and sorted(os.listdir(tmp_path)) == ["run"]  # the first run goes on, in place
        with pytest.raises(FolderBusyError, match=f"pid {first.pid} on host"):
            FolderLock(folder).acquire()
    finally:
        first.kill()  # SIGKILL: no clean-up of any kind; the kernel releases the lock with the process
        first.communicate(timeout=60)
    with FolderLock(folder):  # taken over: its holder is gone
        pass


# ---- a full disk --------------------------------------------------------------------------------------------


def test_a_full_disk_in_the_warm_up_checkpoints_is_one_error_naming_the_intact_one(tmp_path, planted, monkeypatch):
    import torch.distributed.checkpoint.filesystem as dcp_filesystem

    real_write_item, real_save, saves = dcp_filesystem._write_item, CheckpointManager.save, []

    def save(self, step, *args, **kwargs):
        saves.append(step)
        return real_save(self, step, *args, **kwargs)

    def write_item(*args, **kwargs):
        if len(saves) >= 2:  # the disk is full from the second warm-up checkpoint on
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write_item(*args, **kwargs)

    monkeypatch.setattr(CheckpointManager, "save", save)
    monkeypatch.setattr(dcp_filesystem, "_write_item", write_item)
    settings = {"training.sft_warmup_steps": 6, "training.sft_batch_size": 2, "checkpoint.warmup_interval": 2}
    with pytest.raises(CheckpointError) as failed:
        train.main(overrides(str(tmp_path), steps=1, **settings))
    warmup = CheckpointManager(str(tmp_path / "run" / "checkpoints" / "warm-up"))
    message = str(failed.value)
    assert saves == [2, 4] and message.startswith("no space left on ") and "while saving step 4" in message
    assert f"the previous checkpoint (step 2, {warmup.step_path(2)}) is intact" in message
    assert os.listdir(warmup.folder) == ["step-00000002"] and warmup.validate(2) is None


def _can_mount_a_tmpfs() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(
        ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /mnt"],
        capture_output=True,
    )
    return probe.returncode == 0


@pytest.mark.skipif(not _can_mount_a_tmpfs(), reason="needs a user and mount namespace to mount a small tmpfs")
def test_a_real_full_disk_stops_the_run_in_one_line_and_keeps_the_previous_checkpoint(tmp_path):
    """train.py on a 96 MiB tmpfs (in a private mount namespace; the run folder asks for 64 MiB free at the
    start) fills it with checkpoints of ~10 MiB; the save that does not fit is the run's last act."""
    disk = tmp_path / "disk"
    disk.mkdir()
    argv = overrides(str(disk), steps=40, **{"checkpoint.keep_latest_k": 0})
    check = (
        "import json, os, sys; from checkpoint.manager import CheckpointManager; "
        f"m = CheckpointManager({str(disk / 'run' / 'checkpoints')!r}); "
        "print(json.dumps({'listing': sorted(os.listdir(m.folder)), "
        "'intact': [m.validate(s) is None for s in m.complete_steps()]}))"
    )
    script = (
        f"mount -t tmpfs -o size=96m tmpfs {disk} && cd {ROOT} && "
        f'{" ".join(PLANTED_TRAIN)} {" ".join(argv)}; echo exit=$? >&2; {sys.executable} -c "{check}"'
    )
    result = subprocess.run(
        ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", script],
        capture_output=True,
        text=True,
        timeout=600,
    )
    err = result.stderr.strip().splitlines()
    assert err[-1] == "exit=2" and "Traceback" not in result.stderr, result.stderr
    expected = f"checkpoint error: no space left on tmpfs (mounted at {disk}) while saving step "
    assert err[-2].startswith(expected), err[-2]
    failed_step = int(err[-2].split("while saving step ")[1].split()[0])
    assert f"the previous checkpoint (step {failed_step - 1}, " in err[-2] and err[-2].endswith("to resume")
    state = json.loads(result.stdout.strip().splitlines()[-1])
    assert state["listing"] == [f"step-{s:08d}" for s in range(1, failed_step)] and all(state["intact"]), state


# ---- a policy gone non-finite -------------------------------------------------------------------------------


def _plant_after_step(monkeypatch, step: int, plant, before_its_checkpoint: bool = True) -> None:
    """plant(trainer) right after `step`'s update, before its metrics row and checkpoint (or after them)."""
    real_after_step = trainer.loop.Trainer.after_step

    def after_step(self, at, row):
        if at == step and before_its_checkpoint:
            plant(self)
        real_after_step(self, at, row)
        if at == step and not before_its_checkpoint:
            plant(self)

    monkeypatch.setattr(trainer.loop.Trainer, "after_step", after_step)


def _assert_nothing_saved_after_step_1(tmp_path):
    assert _checkpoints(tmp_path).complete_steps() == [1] and _checkpoints(tmp_path).validate(1) is None
    assert not (tmp_path / "run" / "hf").exists() and not (tmp_path / "run" / "finished.json").exists()


def test_a_nan_planted_in_a_parameter_is_never_checkpointed_or_exported(tmp_path, planted, monkeypatch):
    def nan_weight(trainer_):
        with torch.no_grad():
            trainer_.parts.policy.norm.weight[0] = float("nan")

    _plant_after_step(monkeypatch, 2, nan_weight)
    with pytest.raises(NonFiniteStateError, match=r"step 2: the policy's weights hold NaN or inf in 1 tensor"):
        train.main(overrides(str(tmp_path), steps=3))
    _assert_nothing_saved_after_step_1(tmp_path)


def test_non_finite_optimizer_state_stops_the_run_before_a_nan_policy_is_saved(tmp_path, planted, monkeypatch):
    """AdamW moments gone NaN (as a damaged checkpoint once made them) turn the next update's weights NaN:
    the check after that optimizer step stops the run, and nothing after step 1 is checkpointed or exported."""

    def nan_moment(trainer_):
        optimizer = trainer_.parts.optimizer
        optimizer.state[trainer_.parts.policy.norm.weight]["exp_avg_sq"][0] = float("nan")

    _plant_after_step(monkeypatch, 1, nan_moment, before_its_checkpoint=False)
    settings = {"training.mini_batch_size": 2}
    with pytest.raises(NonFiniteStateError, match=r"step 2, mini-batch 0: after the optimizer step the policy's"):
        train.main(overrides(str(tmp_path), steps=3, **settings))
    assert [r["step"] for r in read_rows(str(tmp_path)) if "loss" in r] == [1]
    _assert_nothing_saved_after_step_1(tmp_path)


def test_weights_that_go_non_finite_in_the_optimizer_step_stop_the_run_unsaved(tmp_path, planted, monkeypatch):
    real_step, steps = torch.optim.AdamW.step, {"n": 0}

    def step_with_a_fault(self, *args, **kwargs):
        out = real_step(self, *args, **kwargs)
        steps["n"] += 1
        if steps["n"] == 2:  # step 2's first update (one update per step here)
            with torch.no_grad():
                next(iter(self.state))[0] = float("inf")
        return out

    monkeypatch.setattr(torch.optim.AdamW, "step", step_with_a_fault)
    with pytest.raises(NonFiniteStateError, match=r"step 2, mini-batch 0: after the optimizer step the policy's"):
        train.main(overrides(str(tmp_path), steps=3, **{"training.mini_batch_size": 4}))
    _assert_nothing_saved_after_step_1(tmp_path)


# ---- a signal to a finished run -----------------------------------------------------------------------------

# train.py (planted reward) that sends itself a SIGTERM as its engine shuts down and as it leaves the process
# group: once the run is finished (the first launch's end, a rerun of the finished run).
_SIGTERM_WHEN_DONE = """
import os, signal, sys
sys.path[:0] = [{root!r}, {tests!r}]
import rl.reward, train
from rollout.torch_engine import TorchEngine
from planted_train import planted_score

def sigterm_first(real):
    def wrapper(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        return real(*args, **kwargs)
    return wrapper

rl.reward.compute_score = planted_score
TorchEngine.shutdown = sigterm_first(TorchEngine.shutdown)
train.shutdown_distributed = sigterm_first(train.shutdown_distributed)
train.run_cli(sys.argv[1:])
"""


def test_a_sigterm_to_a_finished_run_says_so_and_exits_0(tmp_path):
    code = _SIGTERM_WHEN_DONE.format(root=ROOT, tests=os.path.join(ROOT, "tests"))
    for launch in ("the first", "a rerun"):
        result = subprocess.run(
            [sys.executable, "-c", code, *overrides(str(tmp_path), steps=1)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert result.returncode == 0, (launch, result.stderr[-3000:])
        assert "SIGTERM received: the run is finished; nothing to stop" in result.stderr, (launch, result.stderr)
        assert "saving a checkpoint" not in result.stderr and "Traceback" not in result.stderr
    assert "this run finished at step 1" in result.stderr


# train.py (planted reward) that sends itself a SIGTERM as it logs each line named on its command line, and one
# more as the interpreter tears the finished process down (atexit): every moment after training and its final
# evaluation, when a launcher's SIGTERM must not make a finished job look unfinished.
_SIGTERM_AT_LINES = """
import atexit, logging, os, signal, sys
sys.path[:0] = [{root!r}, {tests!r}]
import rl.reward, train
from planted_train import planted_score

class SigtermAt(logging.Handler):
    def emit(self, record):
        if record.getMessage().startswith({lines!r}):
            os.kill(os.getpid(), signal.SIGTERM)

logging.basicConfig(level=logging.INFO, format="%(message)s")
logging.getLogger().addHandler(SigtermAt())
atexit.register(os.kill, os.getpid(), signal.SIGTERM)
rl.reward.compute_score = planted_score
train.run_cli(sys.argv[1:])
"""


def test_a_sigterm_after_the_final_evaluation_or_the_last_line_or_in_the_teardown_still_exits_0(tmp_path):
    lines = ("held-out accuracy after DAPO", "curves: tensorboard")
    code = _SIGTERM_AT_LINES.format(root=ROOT, tests=os.path.join(ROOT, "tests"), lines=lines)
    settings = {"eval.at_end": True, "metrics.tensorboard": True, "checkpoint.export_hf": True}
    result = subprocess.run(
        [sys.executable, "-c", code, *overrides(str(tmp_path), steps=1, **settings)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    said = [line for line in result.stderr.splitlines() if line.startswith("SIGTERM received")]
    assert said == ["SIGTERM received: training is done; the run ends as planned (checkpoint, HF export), exit 0"] * 2
    assert "Traceback" not in result.stderr and "stopped by" not in result.stderr
    run = tmp_path / "run"
    assert json.loads((run / "finished.json").read_text()) == {"step": 1}
    assert (run / "hf" / "config.json").exists() and (run / "tensorboard").is_dir()


# ---- every write of a run: a full disk or a read-only folder ------------------------------------------------


def test_a_file_size_limit_in_the_hf_export_is_one_line_exit_2_and_removes_the_export(tmp_path):
    import resource

    def one_mb_files():  # as `ulimit -f 1024`, or a FAT volume's 4 GB at scale; the write then fails with EFBIG
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))

    # No checkpoint (its optimizer state would meet the limit first); the demo policy's export is 3.5 MB.
    settings = {"checkpoint.enabled": False, "checkpoint.export_hf": True}
    result = subprocess.run(
        PLANTED_TRAIN + overrides(str(tmp_path), steps=1, **settings),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=one_mb_files,
    )
    run = tmp_path / "run"
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert result.stderr.strip().splitlines()[-1] == (
        f"error: cannot write {run / 'hf'}: File too large; a file-size limit (ulimit -f) or the file system (FAT32: "
        "4 GB a file) caps it: raise the limit or write to another file system, then run the same command again"
    )
    assert not (run / "hf").exists() and not (run / "finished.json").exists()


def _disk_full_at(monkeypatch, name: str, error: int = errno.ENOSPC) -> None:
    """Writes to files whose name holds `name` (errors.py's atomic writes, metrics.jsonl's appends) fail as on a
    full disk: half the bytes go out, then the OS error. A read-only folder (EROFS) refuses the file itself."""
    import io

    import errors
    import observe.metrics_log

    class HalfThenFull(io.FileIO):
        def write(self, data):
            super().write(bytes(memoryview(data).cast("B")[: max(1, len(data) // 2)]))
            raise OSError(error, os.strerror(error), self.name)

    def fake_open(file, mode="r", *args, **kwargs):
        if name in os.path.basename(str(file)) and set(mode) & set("wa"):
            if error == errno.EROFS:
                raise OSError(error, os.strerror(error), str(file))
            return HalfThenFull(file, mode.replace("b", ""))
        return open(file, mode, *args, **kwargs)

    for module in (errors, observe.metrics_log):
        monkeypatch.setattr(module, "open", fake_open, raising=False)


@pytest.mark.parametrize(
    "path, error, settings",
    [
        ("config.json", errno.EROFS, {}),  # the run folder's configuration snapshot, on a read-only file system
        ("eval/step_000000.json", errno.ENOSPC, {"eval.at_start": True}),  # the evaluation report before DAPO
        ("metrics.jsonl", errno.ENOSPC, {}),
        ("hf", errno.ENOSPC, {}),  # the HF export
        pytest.param("finished.json", errno.ENOSPC, {}, marks=pytest.mark.slow),
    ],
)
def test_a_write_that_fails_is_one_line_exit_2_and_leaves_nothing_half_written(
    tmp_path, planted, monkeypatch, capsys, path, error, settings
):
    run, name = tmp_path / "run", os.path.basename(path)
    if path == "hf":  # safetensors writes through a file of its own and names the OS error in its message only

        def save_file(*args, **kwargs):
            raise RuntimeError("Error while serializing: I/O error: No space left on device (os error 28)")

        monkeypatch.setattr("safetensors.torch.save_file", save_file)
    else:
        _disk_full_at(monkeypatch, name, error)
    with pytest.raises(SystemExit) as stopped:
        train.run_cli(overrides(str(tmp_path), steps=1, **settings))
    err = capsys.readouterr().err.strip().splitlines()
    assert stopped.value.code == 2 and "Traceback" not in "\n".join(err)
    assert err[-1] == (
        f"error: cannot write {run / path}: {os.strerror(error)}; make room or make its folder writable, then run "
        "the same command again"
    )
    left = sorted(str(p.relative_to(run)) for p in run.rglob("*") if p.name.startswith(name))
    if name == "metrics.jsonl":  # the half line was cut off again
        assert left == ["metrics.jsonl"] and (run / "metrics.jsonl").read_text() == ""
    else:
        assert left == [], left
    assert not (run / "finished.json").exists()
