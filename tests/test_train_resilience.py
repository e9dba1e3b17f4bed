"""Resilience of train.py: signals, non-finite updates, engine failures, unusable run folders."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

import rl.loss
import rl.reward
import train
import trainer.build
import trainer.loop
import trainer.observers
import trainer.scoring
import trainer.update
from checkpoint.files import file_record
from checkpoint.manager import CheckpointManager
from errors import RunStopped
from rollout.torch_engine import TorchEngine
from run.folder import RunFolderError, accept_launch, discard_refused_launch, prepare_run_folder
from tests.planted_train import planted_score
from tests.test_train_e2e import overrides, read_rows

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_nonfinite_updates_are_skipped_then_the_run_stops_with_a_checkpoint(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(rl.reward, "compute_score", planted_score)
    real_loss = rl.loss.token_mean
    calls = {"n": 0}

    def poisoned(*args, **kwargs):
        loss = real_loss(*args, **kwargs)
        calls["n"] += 1
        # Micro-batch 1 of step 1 is NaN (one skipped update); from step 2 on every loss is NaN.
        if calls["n"] == 1 or calls["n"] > 2:
            loss = loss * float("nan")
        return loss

    monkeypatch.setattr(rl.loss, "token_mean", poisoned)
    argv = overrides(
        str(tmp_path),
        steps=4,
        **{
            "training.max_nonfinite_steps": 2,
            "training.mini_batch_size": 2,
            "training.micro_batch_tokens": 4096,
            "checkpoint.interval": 100,
        },
    )
    with pytest.raises(SystemExit) as info:
        train.run_cli(argv)
    assert info.value.code == 1 and capsys.readouterr().err.strip().splitlines()[-1] == (
        "error: 2 non-finite updates in a row at step 2; checkpoint saved: "
        f"{tmp_path / 'run' / 'checkpoints' / 'step-00000002'}"
    )  # one line, no traceback
    rows = [r for r in read_rows(str(tmp_path)) if "loss" in r]
    assert rows[0]["step"] == 1 and rows[0]["updates_skipped_nonfinite"] == 1
    # The step that stopped the run is logged too: a resume starts after it and would never log it.
    assert [r["step"] for r in rows] == [1, 2] and rows[1]["updates_skipped_nonfinite"] == 2
    assert CheckpointManager(str(tmp_path / "run" / "checkpoints")).complete_steps() == [2]


def test_the_non_finite_count_spans_a_restart(tmp_path, monkeypatch):
    monkeypatch.setattr(rl.reward, "compute_score", planted_score)
    real_loss = rl.loss.token_mean
    poison_from = {"call": 3}  # the first run: step 1 is finite, step 2's two updates are not
    calls = {"n": 0}

    def poisoned(*args, **kwargs):
        loss = real_loss(*args, **kwargs)
        calls["n"] += 1
        return loss * float("nan") if calls["n"] >= poison_from["call"] else loss

    monkeypatch.setattr(rl.loss, "token_mean", poisoned)
    settings = {
        "training.max_nonfinite_steps": 3,
        "training.mini_batch_size": 2,
        "training.micro_batch_tokens": 4096,
        "checkpoint.interval": 100,
    }
    train.main(overrides(str(tmp_path), steps=2, **settings))  # ends with 2 skipped updates in a row
    poison_from["call"], calls["n"] = 1, 0
    with pytest.raises(RunStopped, match="4 non-finite updates in a row at step 3"):
        train.main(overrides(str(tmp_path), steps=3, **settings))


def test_engine_failure_stops_with_a_checkpoint(tmp_path, monkeypatch):
    monkeypatch.setattr(rl.reward, "compute_score", planted_score)
    real_poll = TorchEngine.poll
    submits = []
    original_submit = TorchEngine.submit

    def counting_submit(self, prompts, params):
        submits.append(len(prompts))
        return original_submit(self, prompts, params)

    def flaky(self):
        if len(submits) >= 2:  # step 2's first poll fails
            raise RuntimeError("CUDA error: out of memory (simulated)")
        return real_poll(self)

    monkeypatch.setattr(TorchEngine, "submit", counting_submit)
    monkeypatch.setattr(TorchEngine, "poll", flaky)
    argv = overrides(str(tmp_path), steps=3, **{"algorithm.dynamic_sampling": False, "checkpoint.interval": 100})
    with pytest.raises(
        RuntimeError,
        match=r"step 2, rollout, generate \(4 prompts x 4 samples\): engine failed on generate \(4 prompts x 4 "
        r"samples\): RuntimeError: CUDA error: out of memory \(simulated\). Checkpoint of step 1 saved",
    ):
        train.main(argv)
    assert submits == [4, 4]
    assert CheckpointManager(str(tmp_path / "run" / "checkpoints")).complete_steps() == [1]


def test_shortfall_under_raise_stops_with_a_checkpoint_of_the_last_step(tmp_path, monkeypatch):
    steps_trained = []
    real_run = trainer.update.TrainPhase.run

    def counting_run(self, step, groups, **kwargs):
        steps_trained.append(step)
        return real_run(self, step, groups, **kwargs)

    def score(solution, ground_truth, strict_box=False):
        if len(steps_trained) >= 2:  # from step 3's rollouts on every group is all-correct: nothing is kept
            return {"score": 1.0, "acc": True, "pred": None}
        return planted_score(solution, ground_truth)

    monkeypatch.setattr(trainer.update.TrainPhase, "run", counting_run)
    monkeypatch.setattr(rl.reward, "compute_score", score)
    argv = overrides(str(tmp_path), steps=4, **{"algorithm.on_shortfall": "raise", "checkpoint.interval": 100})
    with pytest.raises(
        RuntimeError,
        match=r"dynamic sampling kept \d+ of 4 groups at step 3 after \d+ of \d+ generation rounds .*"
        r"Checkpoint of step 2 saved",
    ):
        train.main(argv)
    assert steps_trained == [1, 2]
    assert CheckpointManager(str(tmp_path / "run" / "checkpoints")).complete_steps() == [2]


def test_scoring_error_is_not_retried_as_an_engine_failure_and_stops_with_a_checkpoint(tmp_path, monkeypatch):
    generate_calls = []
    real_submit = TorchEngine.submit

    def counting_submit(self, prompts, params):
        generate_calls.append(len(prompts))
        return real_submit(self, prompts, params)

    def score(solution, ground_truth, strict_box=False):
        if len(generate_calls) >= 2:
            raise KeyError("broken scorer (simulated)")
        return planted_score(solution, ground_truth)

    monkeypatch.setattr(TorchEngine, "submit", counting_submit)
    monkeypatch.setattr(rl.reward, "compute_score", score)
    argv = overrides(str(tmp_path), steps=3, **{"algorithm.dynamic_sampling": False, "checkpoint.interval": 100})
    with pytest.raises(
        RuntimeError,
        match=r"step 2, rollout on data-parallel rank 0: KeyError: "
        r"'broken scorer \(simulated\)'. Checkpoint of step 1 saved",
    ):
        train.main(argv)
    assert len(generate_calls) == 2  # one round per step, no retry of the engine for a scorer bug
    assert CheckpointManager(str(tmp_path / "run" / "checkpoints")).complete_steps() == [1]


def test_unusable_run_folder_is_refused_before_any_work(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    with pytest.raises(RunFolderError, match=f"run folder {blocker}/run is not writable"):
        prepare_run_folder(str(blocker), "run", {})
    with pytest.raises(RunFolderError, match=r"MiB free; at least \d+ MiB are needed"):
        prepare_run_folder(str(tmp_path), "run", {}, min_free_bytes=1 << 62)
    result = subprocess.run(
        [sys.executable, "train.py", "--config", "configs/demo_cpu.toml", f"--job.run_dir={blocker}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2 and "is not writable" in result.stderr
    # A fresh run (no resume) refuses a folder with an earlier run's checkpoints; its config is left as it was.
    earlier = tmp_path / "runs" / "run"
    (earlier / "checkpoints" / "step-00000030").mkdir(parents=True)
    (earlier / "config.json").write_text("{}")
    with pytest.raises(
        RunFolderError,
        match=r"already holds checkpoints of an earlier run \(step-00000030\) and "
        r"checkpoint.resume = false",
    ):
        prepare_run_folder(str(tmp_path / "runs"), "run", {"new": 1}, resume=False)
    assert (earlier / "config.json").read_text() == "{}"
    assert prepare_run_folder(str(tmp_path / "runs"), "run", {"new": 1}, resume=True) == str(earlier)


def test_warm_up_without_worked_solutions_is_refused_before_the_policy_is_built(tmp_path, monkeypatch):
    from config import ConfigError
    from model.tokenizer import train_bpe_tokenizer
    from tasks.arithmetic import synthetic_arithmetic_rows
    from tests.parquet_rows import write_parquet_rows

    rows = synthetic_arithmetic_rows(32, split="train")
    for row in rows:
        del row["extra_info"]["solution"]  # as in DAPO-Math-17k
    path = str(tmp_path / "train.parquet")
    write_parquet_rows(rows, path)
    argv = overrides(str(tmp_path), **{"data.train_path": path, "training.sft_warmup_steps": 5})
    with pytest.raises(
        ConfigError,
        match=r"model.tokenizer_path is not set: data.train_path = '.*train.parquet' "
        r"needs the tokenizer of model.hf_path or model.tokenizer_path",
    ):
        train.main(argv)
    tokenizer_dir = str(tmp_path / "tokenizer")
    train_bpe_tokenizer([r["prompt"][0]["content"] for r in rows], 300).save(tokenizer_dir)
    monkeypatch.setattr(trainer.build, "build_policy_and_engine", lambda *a, **k: pytest.fail("the policy was built"))
    with pytest.raises(
        ConfigError,
        match=r"training.sft_warmup_steps = 5 needs worked solutions .* none of the 32 "
        r"prompts of data.train_path = '.*train.parquet' has one",
    ):
        train.main(argv + [f"--model.tokenizer_path={tokenizer_dir}"])


@pytest.fixture
def signal_handlers():
    """train.main installs its own SIGTERM / SIGINT handlers; put pytest's back afterwards."""
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)


def test_progress_covers_warm_up_rollout_training_and_eval(tmp_path, monkeypatch, signal_handlers):
    monkeypatch.setattr(rl.reward, "compute_score", planted_score)
    phases = []

    class Recording:
        def __init__(self, total=None, desc="", unit="it", **kwargs):
            self.total, self.desc, self.unit, self.n = total, desc, unit, 0
            phases.append(self)

        def set_total(self, total):
            self.total = total

        def update(self, n=1, **postfix):
            self.n += n

        def close(self):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            pass

    monkeypatch.setattr(trainer.observers, "Progress", Recording)
    train.main(overrides(str(tmp_path), steps=1, **{"training.sft_warmup_steps": 2, "eval.at_start": True}))
    seen = [(p.desc, p.unit, p.n, p.total) for p in phases if p.desc]  # (unnamed: the observers' idle displays)
    assert seen[0] == ("warm-up", "steps", 2, 2)
    assert seen[1] == ("eval at step 0", "problems", 8, 8)
    assert seen[2] == ("step 1 rollout", "groups", 4, 4)
    desc, unit, done, total = seen[3]
    assert (desc, unit) == ("step 1 train", "micro-batches") and done == total >= 2


def _folder_state(root):
    """Every file under `root` with its size and modification time."""
    return {
        os.path.relpath(os.path.join(d, f), root): (
            os.path.getsize(os.path.join(d, f)),
            os.path.getmtime(os.path.join(d, f)),
        )
        for d, _, files in os.walk(root)
        for f in files
    }


def test_rerun_of_a_finished_run_prints_its_result_and_does_nothing_else(
    tmp_path, monkeypatch, caplog, signal_handlers
):
    monkeypatch.setattr(rl.reward, "compute_score", planted_score)
    argv = overrides(str(tmp_path), steps=1, **{"eval.at_start": True, "eval.at_end": True})
    train.main(argv)
    first = read_rows(str(tmp_path))
    assert [(r["step"], "loss" in r) for r in first] == [(0, False), (1, True), (1, False)]
    before, after = first[0]["eval/avg_at_k"], first[2]["eval/avg_at_k"]
    files = _folder_state(tmp_path)
    for name in ("build_policy_and_engine", "load_datasets", "build_tokenizer"):
        monkeypatch.setattr(trainer.build, name, lambda *a, **k: pytest.fail("a finished run built something"))
    caplog.clear()
    with caplog.at_level("INFO", logger="train"):
        assert train.main(argv) == 0
    assert f"run folder {tmp_path}/run: this run finished at step 1" in caplog.text
    assert "run the same command with --fresh" in caplog.text
    assert f"held-out accuracy before DAPO: {100 * before:.1f}% (avg@4)" in caplog.text
    assert f"held-out accuracy after DAPO: {100 * after:.1f}% (avg@4)" in caplog.text
    assert _folder_state(tmp_path) == files  # nothing written, nothing moved
    # From the command line: the same lines and exit code 0.
    result = subprocess.run([sys.executable, "train.py", *argv], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert f"held-out accuracy after DAPO: {100 * after:.1f}% (avg@4)" in result.stderr
    assert _folder_state(tmp_path) == files


def test_a_run_of_no_dapo_step_does_not_call_its_evaluation_after_dapo(tmp_path, caplog, signal_handlers):
    with caplog.at_level("INFO", logger="train"):
        assert train.main(overrides(str(tmp_path), steps=0, **{"eval.at_end": True})) == 0
    [line] = [r.getMessage() for r in caplog.records if r.getMessage().startswith("held-out accuracy")]
    [row] = read_rows(str(tmp_path))
    assert (
        line == f"held-out accuracy with no DAPO step (training.steps = 0): {100 * row['eval/avg_at_k']:.1f}% (avg@4)"
    )


def test_fresh_moves_the_earlier_run_aside_and_starts_over(tmp_path, monkeypatch, caplog, signal_handlers):
    monkeypatch.setattr(rl.reward, "compute_score", planted_score)
    argv = overrides(str(tmp_path), steps=1, **{"eval.at_start": True})
    train.main(argv)
    earlier = _folder_state(tmp_path / "run")
    with caplog.at_level("WARNING", logger="train"):
        assert train.main(argv + ["--fresh"]) == 0
    assert f"--fresh: moved the earlier run folder to {tmp_path}/run.old-1" in caplog.text
    # Kept as it was; only its lock file names the --fresh run, which held it while moving it aside.
    assert {k: v for k, v in _folder_state(tmp_path / "run.old-1").items() if k != ".lock"} == {
        k: v for k, v in earlier.items() if k != ".lock"
    }
    assert [(r["step"], "loss" in r) for r in read_rows(str(tmp_path))] == [(0, False), (1, True)]
    assert os.path.isfile(tmp_path / "run" / "finished.json")
    assert train.main(argv + ["--fresh"]) == 0
    assert sorted(os.listdir(tmp_path)) == ["run", "run.old-1", "run.old-2"]
    # Without a checkpoint a rerun starts over: its step-0 evaluation replaces the earlier one.
    no_checkpoints = overrides(str(tmp_path / "again"), steps=1, **{"eval.at_start": True, "checkpoint.enabled": False})
    train.main(no_checkpoints)
    train.main(no_checkpoints)
    assert [(r["step"], "loss" in r) for r in read_rows(str(tmp_path / "again"))] == [(0, False), (1, True)]


def test_the_main_command_resumes_a_run_killed_during_the_warm_up(tmp_path):
    """SIGKILL (no chance to checkpoint) during the supervised warm-up; the same command continues it from
    its last warm-up checkpoint, with the demo config's own checkpoint.resume."""
    settings = {"training.sft_warmup_steps": 30, "training.sft_batch_size": 2, "checkpoint.warmup_interval": 3}
    argv = [a for a in overrides(str(tmp_path), steps=1, **settings) if not a.startswith("--checkpoint.resume")]
    command = [sys.executable, "tests/planted_train.py", *argv]
    warmup = tmp_path / "run" / "checkpoints" / "warm-up"
    process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while not (
        warmup.is_dir() and any(name.startswith("step-") and not name.endswith(".tmp") for name in os.listdir(warmup))
    ):
        assert process.poll() is None and time.time() < deadline, process.communicate()
        time.sleep(0.05)
    process.kill()
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == -signal.SIGKILL and "supervised warm-up:" not in stderr, stderr
    saved = CheckpointManager(str(warmup)).complete_steps()
    assert saved and saved[-1] % 3 == 0 and saved[-1] < 30

    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    resumed_at = int(re.search(r"supervised warm-up resumed after step (\d+) of 30", result.stderr).group(1))
    assert resumed_at >= saved[-1] and resumed_at % 3 == 0
    assert "sft step 0:" not in result.stderr and "sft step 29:" in result.stderr
    assert os.path.isfile(tmp_path / "run" / "finished.json") and not warmup.exists()
    assert CheckpointManager(str(tmp_path / "run" / "checkpoints")).complete_steps() == [0, 1]


def test_a_signal_during_the_final_evaluation_still_checkpoints(tmp_path, monkeypatch, signal_handlers):
    from run.signals import StopRequested

    monkeypatch.setattr(rl.reward, "compute_score", planted_score)
    real_eval = trainer.loop.run_held_out_eval

    def eval_then_sigterm(*args, **kwargs):
        result = real_eval(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGTERM)  # arrives during the final phase
        return result

    monkeypatch.setattr(trainer.loop, "run_held_out_eval", eval_then_sigterm)
    argv = overrides(str(tmp_path), steps=2, **{"eval.at_end": True, "checkpoint.interval": 100})
    with pytest.raises(StopRequested, match="stopped by SIGTERM after step 2"):
        train.main(argv)
    assert CheckpointManager(str(tmp_path / "run" / "checkpoints")).complete_steps() == [2]
    assert not os.path.exists(tmp_path / "run" / "finished.json")
    _rerun_finishes_without_evaluating_again(tmp_path, monkeypatch, argv, step=2)


def _final_evaluation_rows(tmp_path, step):
    return [r for r in read_rows(str(tmp_path)) if r["step"] == step and "eval/avg_at_k" in r]


def _rerun_finishes_without_evaluating_again(tmp_path, monkeypatch, argv, step):
    """The rerun of a finish whose final evaluation was written: it is not run again, and its row is logged once."""
    before = _final_evaluation_rows(tmp_path, step)
    monkeypatch.setattr(trainer.loop, "run_held_out_eval", lambda *a, **k: pytest.fail("evaluated again"))
    assert train.main(argv) == 0
    [row] = _final_evaluation_rows(tmp_path, step)
    assert before in ([], [row]) and os.path.isfile(tmp_path / "run" / "finished.json")
    with open(tmp_path / "run" / "eval" / f"step_{step:06d}.json") as f:
        report = json.load(f)
    assert row["eval/avg_at_k"] == report["overall"]["avg@4"]


# In a process of its own: SIGKILLed as soon as the final evaluation has written its report (its row not yet).
_KILLED_AFTER_THE_EVALUATION = """
import os, signal, sys
sys.path.insert(0, os.getcwd())
import rl.reward, train, trainer.loop
from tests.planted_train import planted_score
rl.reward.compute_score, evaluate = planted_score, trainer.loop.run_held_out_eval
def then_killed(*args, **kwargs):
    evaluate(*args, **kwargs)
    os.kill(os.getpid(), signal.SIGKILL)
trainer.loop.run_held_out_eval = then_killed
train.run_cli(sys.argv[1:])
"""


def test_a_run_killed_during_its_final_evaluation_logs_it_once_without_evaluating_again(
    tmp_path, monkeypatch, signal_handlers
):
    monkeypatch.setattr(rl.reward, "compute_score", planted_score)
    argv = overrides(str(tmp_path), steps=1, **{"eval.at_end": True})
    command = [sys.executable, "-c", _KILLED_AFTER_THE_EVALUATION, *argv]
    killed = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert killed.returncode == -signal.SIGKILL and not _final_evaluation_rows(tmp_path, 1), killed.stderr
    _rerun_finishes_without_evaluating_again(tmp_path, monkeypatch, argv, step=1)


class _Killed(BaseException):
    """Stands for a SIGKILL in this process: nothing catches it."""


def test_a_final_evaluation_of_a_step_trained_again_is_run_again(tmp_path, monkeypatch, signal_handlers):
    """Killed after the final evaluation, before the step had a checkpoint: the rerun trains that step again, and
    the report of the earlier weights is not taken for the new ones."""
    monkeypatch.setattr(rl.reward, "compute_score", planted_score)
    argv = overrides(str(tmp_path), steps=1, **{"eval.at_end": True, "checkpoint.interval": 100})
    evaluate, calls = trainer.loop.run_held_out_eval, []

    def killed_after(*args, **kwargs):
        evaluate(*args, **kwargs)
        raise _Killed

    monkeypatch.setattr(trainer.loop, "run_held_out_eval", killed_after)
    with pytest.raises(_Killed):
        train.main(argv)
    assert os.path.isfile(tmp_path / "run" / "eval" / "step_000001.json") and not _final_evaluation_rows(tmp_path, 1)
    monkeypatch.setattr(trainer.loop, "run_held_out_eval", lambda *a, **k: calls.append(1) or evaluate(*a, **k))
    assert train.main(argv) == 0
    assert calls == [1] and len(_final_evaluation_rows(tmp_path, 1)) == 1


def test_a_finished_run_whose_marker_is_unreadable_does_not_log_its_final_evaluation_twice(
    tmp_path, monkeypatch, signal_handlers
):
    monkeypatch.setattr(rl.reward, "compute_score", planted_score)
    argv = overrides(str(tmp_path), steps=1, **{"eval.at_end": True})
    assert train.main(argv) == 0
    (tmp_path / "run" / "finished.json").write_text('{"step": 1')  # cut short: the run is taken as unfinished
    _rerun_finishes_without_evaluating_again(tmp_path, monkeypatch, argv, step=1)


def test_a_stop_seen_on_another_rank_does_not_make_this_ranks_first_signal_the_second(monkeypatch):
    from run.signals import GracefulStop

    class OtherRankSignalled:
        def all_reduce(self, values, op="sum", group="dp"):
            return [1.0]

    monkeypatch.setattr(os, "_exit", lambda code: pytest.fail(f"exited with {code}"))
    stop = GracefulStop()
    assert stop.requested(OtherRankSignalled()) and stop.signal_name == "a signal on another rank"
    stop._handle(signal.SIGTERM, None)  # this rank's own first signal, e.g. during the checkpoint save
    assert stop.received == "SIGTERM"
    monkeypatch.setattr(os, "_exit", lambda code: (_ for _ in ()).throw(SystemExit(code)))
    with pytest.raises(SystemExit, match="143"):
        stop._handle(signal.SIGTERM, None)  # its second one exits at once


def _launch(run_dir, config):
    """A launch's run folder, then its acceptance (train.py: once its inputs loaded and its checkpoint resumed)."""
    accept_launch(prepare_run_folder(run_dir, "run", config), config)


def test_a_changed_configuration_on_resume_is_kept_beside_the_first_and_named(tmp_path, caplog):
    _launch(str(tmp_path), {"optimizer": {"lr": 0.001}, "job": {"seed": 0}})
    _launch(str(tmp_path), {"optimizer": {"lr": 0.001}, "job": {"seed": 0}})
    assert sorted(os.listdir(tmp_path / "run")) == ["config.json"]
    prepare_run_folder(str(tmp_path), "run", {"optimizer": {"lr": 0.5}, "job": {"seed": 0}})
    assert sorted(os.listdir(tmp_path / "run")) == ["config.json"]  # not accepted (yet): nothing written
    with caplog.at_level("WARNING", logger="train"):
        _launch(str(tmp_path), {"optimizer": {"lr": 0.5}, "job": {"seed": 0}})
    assert "optimizer.lr: 0.001 -> 0.5" in caplog.text and "config.launch-2.json" in caplog.text
    assert json.loads((tmp_path / "run" / "config.json").read_text())["optimizer"]["lr"] == 0.001
    assert json.loads((tmp_path / "run" / "config.launch-2.json").read_text())["optimizer"]["lr"] == 0.5


def test_a_refused_launch_removes_the_folders_it_made_and_nothing_an_earlier_launch_wrote(tmp_path):
    runs = tmp_path / "runs"
    discard_refused_launch(prepare_run_folder(str(runs), "first", {"a": 1}))  # made runs/ and runs/first/
    assert os.listdir(tmp_path) == []
    path = prepare_run_folder(str(runs), "first", {"a": 1})
    (runs / "other").mkdir()  # another run's folder, made meanwhile beside it
    discard_refused_launch(path)
    assert os.listdir(runs) == ["other"]  # the parent is not empty: kept
    _launch(str(runs), {"a": 1})  # an accepted launch
    (runs / "run" / "metrics.jsonl").write_text("{}\n")
    discard_refused_launch(prepare_run_folder(str(runs), "run", {"a": 2}))  # a resume, refused
    assert sorted(os.listdir(runs / "run")) == ["config.json", "metrics.jsonl"]  # as the earlier launch left it
    before = sorted(os.listdir(runs))
    path = prepare_run_folder(str(runs), "run", {"a": 2}, fresh=True)  # --fresh: the earlier folder moved aside
    discard_refused_launch(path)  # only the new folder goes; the earlier run stays where --fresh moved it
    assert sorted(os.listdir(runs)) == sorted(["other", "run.old-1"]) and "run" in before
    assert sorted(os.listdir(runs / "run.old-1")) == ["config.json", "metrics.jsonl"]


@pytest.mark.parametrize("damage", ['{"optimizer": {"lr": 0.0', "[1, 2]", b"\xff\xfe{}"])
def test_a_damaged_configuration_snapshot_is_named_in_one_line(tmp_path, damage):
    """Cut short by a crash of an older version (it was not written atomically), edited, or not text at all."""
    (tmp_path / "run").mkdir()
    config = tmp_path / "run" / "config.json"
    config.write_bytes(damage if isinstance(damage, bytes) else damage.encode())
    with pytest.raises(RunFolderError) as refused:
        prepare_run_folder(str(tmp_path), "run", {"optimizer": {"lr": 0.001}})
    assert str(refused.value).startswith(f"{config}, the configuration this run started with, is damaged (")
    assert str(refused.value).endswith("): restore it, or move it aside and this launch saves its own")
    os.rename(config, tmp_path / "aside.json")  # as the message says: the next launch saves its own
    _launch(str(tmp_path), {"optimizer": {"lr": 0.001}})
    assert json.loads(config.read_text()) == {"optimizer": {"lr": 0.001}}


@pytest.mark.slow
def test_sigterm_checkpoints_and_the_resumed_run_matches_an_uninterrupted_one(tmp_path):
    # Enough steps that the signal, sent once step 1 is logged, lands before the run ends (a step of this
    # tiny run takes about 0.1 s).
    STEPS = 12
    straight, interrupted = str(tmp_path / "straight"), str(tmp_path / "interrupted")
    command = [sys.executable, "tests/planted_train.py"]
    subprocess.run(
        command + overrides(straight, steps=STEPS, **{"checkpoint.interval": 100}),
        cwd=ROOT,
        check=True,
        capture_output=True,
        timeout=600,
    )
    process = subprocess.Popen(
        command + overrides(interrupted, steps=STEPS, **{"checkpoint.interval": 100}),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    metrics = os.path.join(interrupted, "run", "metrics.jsonl")
    deadline = time.time() + 600
    while not (os.path.exists(metrics) and any('"loss"' in line for line in open(metrics))):
        assert process.poll() is None and time.time() < deadline, process.communicate()
        time.sleep(0.05)
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=600)
    assert process.returncode == 143, stderr
    assert "run the same command again to resume" in stderr
    steps_done = CheckpointManager(os.path.join(interrupted, "run", "checkpoints")).complete_steps()
    assert steps_done and 1 <= steps_done[-1] < STEPS

    subprocess.run(
        command + overrides(interrupted, steps=STEPS, **{"checkpoint.interval": 100}),
        cwd=ROOT,
        check=True,
        capture_output=True,
        timeout=600,
    )
    expected = {r["step"]: r for r in read_rows(straight) if "loss" in r}
    got = {r["step"]: r for r in read_rows(interrupted) if "loss" in r}
    assert sorted(got) == list(range(1, STEPS + 1))
    for step in range(steps_done[-1] + 1, STEPS + 1):
        for key in ("loss", "reward/mean", "entropy", "grad_norm", "response_length/mean"):
            assert got[step][key] == expected[step][key], (step, key)


def _warm_up_on_ranks(rank, world_size, argv, crash_after=None):
    """train.main on this rank; with crash_after, every rank dies after that many warm-up steps (no signal)."""
    import trainer.warmup
    from model.hf import load_hf

    rl.reward.compute_score = planted_score
    if crash_after is not None:
        real_step = trainer.warmup.SFTWarmup.step

        def step(self):
            if self.done == crash_after:
                raise RuntimeError("killed (simulated)")
            return real_step(self)

        trainer.warmup.SFTWarmup.step = step
        try:
            train.main(argv)
        except RuntimeError as exc:
            return str(exc)
        finally:
            trainer.warmup.SFTWarmup.step = real_step
    steps_run = []
    real_step = trainer.warmup.SFTWarmup.step
    trainer.warmup.SFTWarmup.step = lambda self: steps_run.append(self.done) or real_step(self)
    try:
        train.main(argv)
    finally:
        trainer.warmup.SFTWarmup.step = real_step
    run = next(a.split("=", 1)[1] for a in argv if a.startswith("--job.run_dir="))
    exported = load_hf(os.path.join(run, "run", "hf"))
    return {"steps_run": steps_run, "params": dict(exported.named_parameters()) if rank == 0 else None}


@pytest.mark.multiprocess
def test_a_sharded_warm_up_resumed_on_two_ranks_ends_where_an_uninterrupted_one_does(tmp_path):
    from dist_utils import run_ranks

    settings = {
        "parallelism.dp_shard": 2,
        "training.sft_warmup_steps": 5,
        "training.sft_batch_size": 4,
        "checkpoint.warmup_interval": 2,
    }
    straight = run_ranks(_warm_up_on_ranks, 2, overrides(str(tmp_path / "straight"), steps=0, **settings))[0]
    interrupted = overrides(str(tmp_path / "interrupted"), steps=0, **settings)
    assert run_ranks(_warm_up_on_ranks, 2, interrupted, crash_after=3) == ["killed (simulated)"] * 2
    warmup = tmp_path / "interrupted" / "run" / "checkpoints" / "warm-up"
    assert CheckpointManager(str(warmup)).complete_steps() == [2]
    resumed = run_ranks(_warm_up_on_ranks, 2, interrupted)
    assert [r["steps_run"] for r in resumed] == [[2, 3, 4]] * 2  # steps 3-5 only: step 3 was lost with the crash
    assert straight["steps_run"] == [0, 1, 2, 3, 4] and not warmup.exists()
    for name, param in straight["params"].items():
        assert torch.equal(resumed[0]["params"][name], param), name


def test_a_checkpoint_that_would_run_code_stops_the_command_with_one_line(tmp_path, monkeypatch, signal_handlers):
    monkeypatch.setattr(rl.reward, "compute_score", planted_score)
    train.main(overrides(str(tmp_path), steps=1))
    step_1 = tmp_path / "run" / "checkpoints" / "step-00000001"
    # What an older version left (and anyone could plant): a pickled train state, listed in the manifest.
    for name in ("rank-00000.json", "rank-00000.safetensors"):
        os.remove(step_1 / "train_state" / name)
    torch.save({"train_state": {"step": 1}}, step_1 / "train_state" / "rank-00000.pt")
    manifest = json.loads((step_1 / "COMPLETE.json").read_text())
    manifest["files"] = {k: v for k, v in manifest["files"].items() if not k.startswith("train_state/")}
    manifest["files"]["train_state/rank-00000.pt"] = file_record(
        str(step_1 / "train_state" / "rank-00000.pt")
    ).to_json()
    (step_1 / "COMPLETE.json").write_text(json.dumps(manifest))
    result = subprocess.run(
        [sys.executable, "train.py", *overrides(str(tmp_path), steps=2)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        f"checkpoint error: {step_1}/train_state/rank-00000.pt is a pickle written by an older version of this "
        f"trainer; it is not loaded, because unpickling a file can run any code in it. Start the run over "
        f"(train.py --fresh moves the run folder aside) or remove {tmp_path}/run/checkpoints"
    )


def test_a_failed_step_still_shuts_the_engine_down_and_restores_the_signal_handlers(
    tmp_path, monkeypatch, signal_handlers
):
    shutdowns = []
    real_shutdown = TorchEngine.shutdown

    def counting_shutdown(self):
        shutdowns.append(self)
        return real_shutdown(self)

    def score(solution, ground_truth, strict_box=False):
        raise KeyError("broken scorer (simulated)")

    monkeypatch.setattr(TorchEngine, "shutdown", counting_shutdown)
    monkeypatch.setattr(rl.reward, "compute_score", score)
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    with pytest.raises(RuntimeError, match=r"broken scorer \(simulated\)'. Checkpoint of step 0 saved"):
        train.main(overrides(str(tmp_path), steps=2, **{"algorithm.dynamic_sampling": False}))
    assert len(shutdowns) == 1
    assert {sig: signal.getsignal(sig) for sig in handlers} == handlers
    assert not torch.distributed.is_initialized()


def test_a_signal_during_an_engine_call_stops_the_round_and_checkpoints(tmp_path, monkeypatch, signal_handlers):
    """A SIGTERM during step 2's submit stops the step after it: no poll runs, the last completed step is
    checkpointed."""
    from run.signals import StopRequested

    monkeypatch.setattr(rl.reward, "compute_score", planted_score)
    real_submit, real_poll = TorchEngine.submit, TorchEngine.poll
    calls = []

    def submit_then_sigterm(self, groups, params):
        calls.append("submit")
        if calls.count("submit") == 2:  # step 2's
            os.kill(os.getpid(), signal.SIGTERM)
        return real_submit(self, groups, params)

    monkeypatch.setattr(TorchEngine, "submit", submit_then_sigterm)
    monkeypatch.setattr(TorchEngine, "poll", lambda self: calls.append("poll") or real_poll(self))
    argv = overrides(str(tmp_path), steps=3, **{"algorithm.dynamic_sampling": False, "checkpoint.interval": 100})
    with pytest.raises(StopRequested, match="stopped by SIGTERM after step 1"):
        train.main(argv)
    assert calls[-1] == "submit" and calls.count("submit") == 2  # step 2: the submit, then the stop
    assert CheckpointManager(str(tmp_path / "run" / "checkpoints")).complete_steps() == [1]


def test_a_prompt_set_smaller_than_a_generation_round_is_warned_about_in_one_line(caplog):
    from config import load_config
    from trainer.build import warn_if_fewer_than_a_round

    cfg = load_config(None, ["training.train_batch_size=64"])  # x gen_batch_multiplier 3: 192 prompts a round
    with caplog.at_level("WARNING", logger="train"):
        warn_if_fewer_than_a_round(cfg, 192)
        assert caplog.records == []
        warn_if_fewer_than_a_round(cfg, 100)
    assert [r.getMessage() for r in caplog.records] == [
        "data.train_path holds 100 prompts, fewer than one generation round draws (192): a round repeats prompts "
        "and their groups are not independent; use more prompts or a smaller training.train_batch_size"
    ]


def test_a_report_of_a_step_the_rerun_trains_again_is_discarded_at_resume(tmp_path, monkeypatch, signal_handlers):
    """Finished with its final report, then the final checkpoint is found damaged: the rerun resumes from the step
    before and removes the later report, so a kill before its own final evaluation cannot leave the old weights'
    report to be taken for the retrained step's."""
    from tests.test_checkpoint_integrity import overwrite_16_bytes_inside_a_tensor

    monkeypatch.setattr(rl.reward, "compute_score", planted_score)
    argv = overrides(str(tmp_path), steps=2, **{"eval.at_end": True})
    assert train.main(argv) == 0
    report = tmp_path / "run" / "eval" / "step_000002.json"
    assert report.is_file()
    overwrite_16_bytes_inside_a_tensor(CheckpointManager(str(tmp_path / "run" / "checkpoints")).step_path(2))
    (tmp_path / "run" / "finished.json").unlink()
    evaluate = trainer.loop.run_held_out_eval

    def killed_before(*args, **kwargs):
        raise _Killed

    monkeypatch.setattr(trainer.loop, "run_held_out_eval", killed_before)
    with pytest.raises(_Killed):
        train.main(argv)  # step 2 trained again from step 1's checkpoint, killed before evaluating it
    assert not report.exists()
    calls: list[int] = []
    monkeypatch.setattr(trainer.loop, "run_held_out_eval", lambda *a, **k: calls.append(1) or evaluate(*a, **k))
    assert train.main(argv) == 0
    assert calls == [1] and len(_final_evaluation_rows(tmp_path, 2)) == 1


def _scoring_fails_on_rank_1(rank, world_size, argv):
    import evaluation.held_out

    rl.reward.compute_score = planted_score
    real = evaluation.held_out.score_completions

    def scoring(*args, **kwargs):
        if rank == 1:
            raise KeyError("broken scorer (simulated)")
        return real(*args, **kwargs)

    evaluation.held_out.score_completions = scoring
    try:
        train.main(argv)
    except RuntimeError as exc:
        return str(exc)
    return "finished"


@pytest.mark.multiprocess
def test_a_scoring_failure_on_one_rank_of_the_evaluation_stops_every_rank_with_a_checkpoint(tmp_path):
    """Rank 1's evaluation share fails to score after the generation every rank took part in: it meets the others
    where they agree that every share was scored, and both stop with step 0's checkpoint, neither left waiting in
    the gather of the results."""
    from tests.dist_utils import run_ranks

    argv = overrides(str(tmp_path), steps=1, **{"eval.at_start": True})
    first, second = run_ranks(_scoring_fails_on_rank_1, 2, argv, timeout=300)
    assert first.startswith("the evaluation at step 0: failed on another rank (see its log). Checkpoint of step 0")
    assert second.startswith("the evaluation at step 0 on data-parallel rank 1: KeyError: 'broken scorer")
    assert CheckpointManager(str(tmp_path / "run" / "checkpoints")).complete_steps() == [0]
