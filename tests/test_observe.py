"""Metrics JSONL + TensorBoard logging and the progress display's plain-line mode."""

import io
import json
import math
import os
import time

import numpy as np
import pytest
import torch

from observe.metrics_log import MetricsLogger, read_metrics
from observe.progress import Progress


def _lines(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


# ------------------------------------------------------------------------------------------ metrics log


def test_jsonl_lines_hold_numbers_and_null_for_non_finite(tmp_path):
    with MetricsLogger(str(tmp_path / "run")) as log:
        log.log(
            1,
            {
                "reward/mean": 0.5,
                "gen/rounds": 3,
                "entropy": float("nan"),
                "grad_norm": torch.tensor(2.0),
                "tokens_per_s": np.float32(1.5),
                "ppo_kl": float("inf"),
                "lr": None,
                "flag": True,
            },
        )
        log.log(2, {"reward/mean": -0.25})
    path = tmp_path / "run" / "metrics.jsonl"
    text = path.read_text()
    assert "NaN" not in text and "Infinity" not in text  # strict JSON
    first, second = _lines(path)
    assert first == {
        "step": 1,
        "reward/mean": 0.5,
        "gen/rounds": 3,
        "entropy": None,
        "grad_norm": 2.0,
        "tokens_per_s": 1.5,
        "ppo_kl": None,
        "lr": None,
        "flag": 1,
    }
    assert isinstance(first["gen/rounds"], int)
    assert second == {"step": 2, "reward/mean": -0.25}


def test_reopening_appends_and_truncate_after_drops_redone_steps(tmp_path):
    run = str(tmp_path)
    with MetricsLogger(run) as log:
        for step in range(1, 6):
            log.log(step, {"x": step})
    with MetricsLogger(run) as log:  # resumed from a checkpoint at step 3
        assert log.truncate_after(3) == 2
        log.log(4, {"x": 40})
    assert [(r["step"], r["x"]) for r in read_metrics(os.path.join(run, "metrics.jsonl"))] == [
        (1, 1),
        (2, 2),
        (3, 3),
        (4, 40),
    ]


def test_a_closed_logger_refuses_to_truncate_and_keeps_the_file(tmp_path):
    log = MetricsLogger(str(tmp_path))
    log.log(1, {"x": 1})
    log.close()
    with pytest.raises(RuntimeError, match="closed"):
        log.truncate_after(0)
    assert [r["step"] for r in read_metrics(os.path.join(str(tmp_path), "metrics.jsonl"))] == [1]


def test_only_rank_zero_writes(tmp_path):
    run = tmp_path / "run"
    with MetricsLogger(str(run), tensorboard=True, rank=1) as log:
        log.log(1, {"x": 1.0})
        assert log.truncate_after(0) == 0
    assert not run.exists()


def test_bad_metrics_are_refused_by_name(tmp_path):
    with MetricsLogger(str(tmp_path)) as log:
        with pytest.raises(TypeError, match="metric 'note' must be a number, got str"):
            log.log(1, {"note": "hello"})
        with pytest.raises(TypeError, match="metric 'vec'"):
            log.log(1, {"vec": torch.ones(2)})
        with pytest.raises(ValueError, match="step must be an int >= 0"):
            log.log(-1, {"x": 1})
        with pytest.raises(ValueError, match="key 'step'"):
            log.log(1, {"step": 1})
    with pytest.raises(RuntimeError, match="closed"):
        log.log(2, {"x": 1})


def test_tensorboard_scalars_use_the_jsonl_keys(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with MetricsLogger(str(tmp_path), tensorboard=True) as log:
        log.log(1, {"reward/mean": 0.25, "eval/avg_at_k": 0.5})
        log.log(2, {"reward/mean": 0.75, "entropy": float("nan")})
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert sorted(events.Tags()["scalars"]) == ["entropy", "eval/avg_at_k", "reward/mean"]
    assert [(e.step, e.value) for e in events.Scalars("reward/mean")] == [(1, 0.25), (2, 0.75)]
    assert [(e.step, e.value) for e in events.Scalars("eval/avg_at_k")] == [(1, 0.5)]
    assert math.isnan(events.Scalars("entropy")[0].value)


def test_read_metrics_names_the_bad_line_and_tolerates_a_cut_last_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "x": 1}\n{"step": 2, "x": 2}\n{"step": 3, "x"')  # killed mid-write
    assert [r["step"] for r in read_metrics(str(path))] == [1, 2]
    path.write_text('{"step": 1}\nnot json\n{"step": 3}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl:2: not a JSON line"):
        read_metrics(str(path))
    path.write_text('{"x": 1}\n')
    with pytest.raises(ValueError, match="int 'step'"):
        read_metrics(str(path))
    with pytest.raises(FileNotFoundError, match="no metrics file"):
        read_metrics(str(tmp_path / "absent.jsonl"))


def test_a_resumed_logger_drops_redone_steps_in_jsonl_and_tensorboard_and_a_cut_last_line(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with MetricsLogger(str(tmp_path), tensorboard=True) as log:
        for step in (1, 2, 3):
            log.log(step, {"loss": float(step)})
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "loss": 0.12')  # killed mid-write
    # TensorBoard reads event files in name order: the creation second, then the host, pid and a per-process
    # counter written without padding (".9" sorts after ".10"). A resumed run starts in a later second; so does
    # this one, or two writers of one second in one test process could be read in either order.
    started = int(time.time())
    while int(time.time()) == started:
        time.sleep(0.01)
    with MetricsLogger(str(tmp_path), tensorboard=True, resume_after=1) as log:
        for step in (2, 3, 4):
            log.log(step, {"loss": 10.0 * step})
    assert [(r["step"], r["loss"]) for r in read_metrics(str(tmp_path / "metrics.jsonl"))] == [
        (1, 1.0),
        (2, 20.0),
        (3, 30.0),
        (4, 40.0),
    ]
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [(1, 1.0), (2, 20.0), (3, 30.0), (4, 40.0)]
    # A cut last line is removed even when no complete line is dropped, so the next line starts clean.
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 5, "lo')
    with MetricsLogger(str(tmp_path), resume_after=4) as log:
        log.log(5, {"loss": 50.0})
    assert [r["step"] for r in read_metrics(str(tmp_path / "metrics.jsonl"))] == [1, 2, 3, 4, 5]


# ------------------------------------------------------------------------------------------ progress


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_plain_lines_when_not_a_terminal_with_rate_and_eta():
    out, clock = io.StringIO(), Clock()
    progress = Progress(total=10, desc="generate", unit="prompts", file=out, plain_interval=5.0, clock=clock)
    clock.now += 2.0
    progress.update(2)  # 2 s since start < 5 s: no line yet
    assert out.getvalue() == ""
    clock.now += 3.0
    progress.update(3, acc=0.25)  # 5 prompts in 5 s: 1 prompt/s, 5 left -> ETA 5 s
    assert out.getvalue() == "generate: 5/10 prompts (50%) | 1 prompts/s | elapsed 00:05 | ETA 00:05 | acc=0.25\n"
    clock.now += 1.0
    progress.update(4)  # 1 s since the last line: quiet
    clock.now += 1.0
    progress.update(1)
    progress.close()  # the final line always comes
    lines = out.getvalue().splitlines()
    assert len(lines) == 2
    assert lines[1] == "generate: 10/10 prompts (100%) | 1.43 prompts/s | elapsed 00:07 | acc=0.25"
    assert "\r" not in out.getvalue()  # no bar fragments in a log file
    progress.update(1)
    progress.close()
    assert len(out.getvalue().splitlines()) == 2  # closed: nothing more


def test_short_phase_with_leave_false_prints_nothing_and_unknown_total_has_no_eta():
    out, clock = io.StringIO(), Clock()
    with Progress(total=4, desc="micro-steps", file=out, leave=False, clock=clock) as progress:
        progress.update(4)
    assert out.getvalue() == ""
    with Progress(total=None, desc="rounds", unit="rounds", file=out, clock=clock) as progress:
        clock.now += 4.0
        progress.update(2)
    assert out.getvalue() == "rounds: 2 rounds | 0.5 rounds/s | elapsed 00:04\n"


def test_disabled_progress_is_silent():
    out = io.StringIO()
    with Progress(total=3, file=out, enabled=False) as progress:
        progress.update(3)
    assert out.getvalue() == ""


def test_a_terminal_gets_a_tqdm_bar():
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    out = Terminal()
    with Progress(total=4, desc="eval", unit="problems", file=out) as progress:
        progress.update(4)
    text = out.getvalue()
    assert "eval: 100%" in text and "4/4" in text and "\r" in text


def test_progress_refuses_bad_arguments():
    with pytest.raises(ValueError, match="total must be >= 0"):
        Progress(total=-1)
    with pytest.raises(ValueError, match="plain_interval"):
        Progress(total=1, plain_interval=0)
