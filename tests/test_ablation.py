"""bench/ablation.py: every rung is exactly its Table 1 file's switches on the CPU task, a killed ladder resumes,
and the table's means, spreads and gains are what the runs measured."""

import json
import math
import os
import re
import signal
import statistics
import subprocess
import sys
import time
import tomllib

import pytest

from bench.ablation import TASK_CONFIG, effective_config, ladder_rungs, main, run_cli
from bench.ablation_figures import draw_figures, seed_band
from bench.ablation_report import (
    RunResult,
    interval95,
    ladder_table,
    markdown_difference,
    markdown_table,
    paired_difference,
    series_points,
    t_quantile,
)
from config import config_to_dict, load_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _flat(cfg) -> dict:
    return {f"{s}.{k}": v for s, table in config_to_dict(cfg).items() for k, v in table.items()}


def _file_switches(path: str) -> dict:
    """The [algorithm] keys a rung file sets itself, at the values its whole base chain resolves to."""
    with open(path, "rb") as f:
        keys = tomllib.load(f)["algorithm"]
    resolved = load_config(path).algorithm
    return {key: getattr(resolved, key) for key in keys}


def test_each_rung_is_the_task_config_with_exactly_its_ablation_files_switches():
    rungs = ladder_rungs()
    assert [r.number for r in rungs] == [1, 2, 3, 4, 5, 6]
    task = _flat(load_config(TASK_CONFIG))
    for rung in rungs:
        switches = _file_switches(rung.path)
        effective = _flat(effective_config(TASK_CONFIG, [], rung))
        assert {k: effective[f"algorithm.{k}"] for k in switches} == switches, rung.name
        changed = {k for k in task if task[k] != effective[k]}
        assert changed <= {f"algorithm.{k}" for k in switches}, rung.name
    # The ladder's own first and last rungs: naive GRPO and the whole of DAPO on the CPU task.
    naive, dapo = (effective_config(TASK_CONFIG, [], r).algorithm for r in (rungs[0], rungs[-1]))
    assert (naive.clip_high, naive.loss_agg, naive.dynamic_sampling) == (0.2, "seq-mean-token-mean", False)
    assert (dapo.clip_high, dapo.loss_agg, dapo.dynamic_sampling) == (0.28, "token-mean", True) and dapo.overlong_filter


def test_the_regime_is_what_the_task_config_header_states(tmp_path):
    """The header of configs/ablation_cpu.toml states the updates per rollout step and where the soft punishment's
    buffer starts; the resolved configuration of every rung has those values, and the buffer starts beyond the
    longest worked solution of the task (so only a runaway answer reaches it)."""
    from data.prompts import synthetic_task_rows
    from tasks.chain import CHAIN_STYLES, chain_solution
    from trainer.build import build_tokenizer

    with open(TASK_CONFIG) as f:
        header = "".join(line[1:].strip() + " " for line in f if line.startswith("#"))
    updates = int(re.search(r"(\d+) updates per rollout step", header).group(1))
    l_max, l_cache = map(int, re.search(r"L_max = (\d+) tokens with a (\d+)-token buffer", header).groups())
    starts = int(re.search(r"the soft punishment starts beyond (\d+) tokens", header).group(1))
    longest = int(re.search(r"the longest worked solution is (\d+) tokens", header).group(1))
    assert starts == l_max - l_cache
    for rung in [None, *ladder_rungs()]:
        cfg = effective_config(TASK_CONFIG, [], rung)
        assert cfg.training.train_batch_size // cfg.training.mini_batch_size * cfg.training.ppo_epochs == updates
        assert cfg.training.train_batch_size % cfg.training.mini_batch_size == 0
        assert (cfg.rollout.max_response_length, cfg.algorithm.overlong_buffer) == (l_max, l_cache)
        assert cfg.eval.max_response_length == l_max
    cfg = load_config(TASK_CONFIG)
    tokenizer = build_tokenizer(cfg.model, cfg.data, str(tmp_path), is_main=True, barrier=lambda: None)
    rows = synthetic_task_rows(cfg.data, "train") + synthetic_task_rows(cfg.data, "eval")
    problems = [re.search(r"What is ([0-9 +]+)\?", row["prompt"][-1]["content"]).group(1) for row in rows]
    lengths = [  # with the stop token
        len(tokenizer.encode(chain_solution([int(t) for t in problem.split(" + ")], style))) + 1
        for problem in problems
        for style in CHAIN_STYLES
    ]
    assert max(lengths) == longest < starts


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--algorithm.clip_high=0.3"], "algorithm.clip_high is a Table 1 switch"),
        (["--job.seed=4"], "the ladder sets job.seed itself"),
        (["--rungs", "7"], "no rung file numbered [7]"),
        (["--seeds", "0,0"], "expected distinct integers"),
        (["--training.lr=1"], "unknown key 'training.lr'"),
        (["--stray"], "unknown arguments --stray"),
    ],
)
def test_bad_input_is_one_line_and_exit_code_2(tmp_path, capsys, args, message):
    assert_refused(run_cli, ["--run-dir", str(tmp_path), *args], message, capsys)
    assert not os.listdir(tmp_path)  # refused before any work


def assert_refused(command, argv: list[str], message: str, capsys) -> None:
    """`command(argv)` exits with code 2 after one line on stderr that holds `message`."""
    with pytest.raises(SystemExit) as info:
        command(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


def test_a_report_of_a_folder_with_no_ladder_is_one_line_and_exit_code_2(tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        run_cli(["--report", "--run-dir", str(tmp_path / "none")])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "no ladder in" in err and err.count("\n") == 1


# A ladder small enough for the default test run: 2 rungs, 1 seed, 4 steps of 4 prompts x 4 samples.
TINY = [
    "--data.synthetic_difficulty=1",
    "--data.synthetic_num_train=64",
    "--data.synthetic_num_eval=8",
    "--rollout.n=4",
    "--rollout.max_response_length=24",
    "--eval.max_response_length=24",
    "--algorithm.overlong_buffer=6",
    "--algorithm.max_num_gen_batches=2",
    "--training.steps=4",
    "--training.train_batch_size=4",
    "--training.mini_batch_size=2",
    "--training.sft_warmup_steps=20",
    "--training.sft_batch_size=8",
    "--eval.k=2",
    "--eval.interval=2",
    "--checkpoint.interval=1",
    "--checkpoint.export_hf=false",
]


def _ladder(run_dir, *extra):
    command = [sys.executable, os.path.join(ROOT, "bench", "ablation.py"), "--run-dir", str(run_dir)]
    return command + ["--rungs", "1,2", "--seeds", "0", "--jobs", "1", *TINY, *extra]


def _launched_pids(log_path: str) -> list[int]:
    with open(log_path) as f:
        return [int(line.split()[-1]) for line in f if line.startswith("ladder: launched pid")]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has ended
    except FileNotFoundError:
        return False


def test_a_killed_tiny_ladder_resumes_where_it_stopped(tmp_path, capsys):
    rung1 = tmp_path / "seed-0" / "1_naive_grpo"
    ladder = subprocess.Popen(_ladder(tmp_path), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 300
    # Mid-rung: step 2 or 3 checkpointed, step 4 to go. A tiny step takes ~0.15 s on a fast CPU and a checkpoint
    # is pruned once the next is written, so the watch polls often and takes either.
    mid_rung = [rung1 / "checkpoints" / f"step-0000000{step}" for step in (2, 3)]
    while not any(path.is_dir() for path in mid_rung):
        assert ladder.poll() is None, ladder.stdout.read()
        assert time.monotonic() < deadline, "the tiny ladder did not reach step 2 of its first rung"
        time.sleep(0.01)
    ladder.send_signal(signal.SIGKILL)
    ladder.wait()
    killed = _launched_pids(rung1 / "train.log")[-1]
    deadline = time.monotonic() + 30
    while _alive(killed):  # the run dies with the ladder
        assert time.monotonic() < deadline, "train.py outlived the killed ladder"
        time.sleep(0.2)
    assert not (rung1 / "finished.json").exists()

    done = subprocess.run(_ladder(tmp_path), cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "2 of 3 runs to do" in done.stdout  # the warm-up finished before the kill
    for rung in ("1_naive_grpo", "2_overlong_filtering"):  # progress per rung
        assert f"seed 0 | {rung} | started" in done.stdout and f"seed 0 | {rung} | finished" in done.stdout
    assert "seed 0 | 2_overlong_filtering | step 4/4 | held-out" in done.stdout
    warm_up = tmp_path / "seed-0" / "warm-up"
    assert len(_launched_pids(warm_up / "train.log")) == 1  # the warm-up is not redone
    log = (rung1 / "train.log").read_text()
    assert len(_launched_pids(rung1 / "train.log")) == 2
    resumed = int(log.rsplit("resumed from step ", 1)[1].split()[0])
    assert resumed >= 2  # from its own checkpoint, not from the warm-up's
    for rung in ladder_rungs()[:2]:
        run = tmp_path / "seed-0" / rung.name
        assert json.loads((run / "finished.json").read_text())["step"] == 4
        with open(run / "config.json") as f:
            ran = json.load(f)["algorithm"]  # the configuration train.py resolved and ran
        assert {k: ran[k] for k in rung.switches} == _file_switches(rung.path)
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        assert sorted(r["step"] for r in rows if "loss" in r) == [1, 2, 3, 4]  # redone steps logged once
    results = json.loads((tmp_path / "results.json").read_text())
    assert [row["seeds_done"] for row in results["table"][1:]] == [1, 1]
    assert "1_naive_grpo" in (tmp_path / "table.md").read_text()

    # Rerunning the finished ladder trains nothing; other settings are refused.
    capsys.readouterr()
    assert main(_ladder(tmp_path)[2:]) == 0
    assert "0 of 3 runs to do" in capsys.readouterr().out
    with pytest.raises(SystemExit) as refused:
        run_cli(_ladder(tmp_path, "--training.steps=5")[2:])
    assert refused.value.code == 2 and "training.steps: 4 -> 5" in capsys.readouterr().err


class _Rung:
    def __init__(self, number, name, switches, path):
        self.number, self.name, self.switches, self.path = number, name, switches, path


def _run(evals: dict, **per_step) -> RunResult:
    """A run with held-out evaluations {step: avg@k} and per-step metrics {key: [value at step 1, 2, ...]}."""
    rows = [{"step": s, "eval/avg_at_k": v} for s, v in evals.items()]
    for key, values in per_step.items():
        rows += [{"step": i + 1, key: v} for i, v in enumerate(values)]
    shares = {"groups/all_correct_share": [0.25] * 4, "groups/all_wrong_share": [0.5] * 4}
    for key, values in shares.items():
        rows += [{"step": i + 1, key: v} for i, v in enumerate(values)]
    return RunResult(rows)


# Rung b's clipped tokens at the upper bound (0.5%), their mean pi_old probability (null: none clipped at step 2).
B_EXTRA = {"pg_clipfrac_upper": [0.005] * 4, "token_prob/clipped_upper_mean": [0.1, None, 0.2, 0.3]}


def _fake_ladder(tmp_path):
    (tmp_path / "a.toml").write_text("# (AIME 2024 avg@32 = 30)\n")
    (tmp_path / "b.toml").write_text("# (AIME 2024 avg@32 = 50)\n")
    rungs = [
        _Rung(1, "a", {"clip_high": 0.2, "dynamic_sampling": False}, str(tmp_path / "a.toml")),
        _Rung(2, "b", {"clip_high": 0.28, "dynamic_sampling": True}, str(tmp_path / "b.toml")),
    ]
    runs = {
        ("warm-up", 0): _run({0: 0.30}),
        ("warm-up", 1): _run({0: 0.20}),
        ("a", 0): _run({2: 0.35, 4: 0.40}, entropy=[0.5] * 4, pg_clipfrac=[0.01] * 4, **{"gen/samples": [8] * 4}),
        ("a", 1): _run({2: 0.25, 4: 0.30}, entropy=[0.4] * 4, pg_clipfrac=[0.03] * 4, **{"gen/samples": [8] * 4}),
        ("b", 0): _run(
            {2: 0.45, 4: 0.50}, entropy=[0.6] * 4, pg_clipfrac=[0.01] * 4, **B_EXTRA, **{"gen/samples": [16] * 4}
        ),
        ("b", 1): _run(
            {2: 0.25, 4: 0.30}, entropy=[0.6] * 4, pg_clipfrac=[0.01] * 4, **B_EXTRA, **{"gen/samples": [24] * 4}
        ),
    }
    return rungs, runs


def test_the_table_holds_means_sample_spreads_and_paired_gains(tmp_path):
    rungs, runs = _fake_ladder(tmp_path)
    rows = ladder_table(runs, rungs, [0, 1], steps=4)
    start, a, b = rows
    assert start["final_mean"] == pytest.approx(0.25) and start["final_std"] == pytest.approx(0.0707107, abs=1e-6)
    assert a["final_mean"] == pytest.approx(0.35) and a["final_std"] == pytest.approx(0.0707107, abs=1e-6)
    # Paired per seed: b - a = 0.10 (seed 0) and 0.00 (seed 1): mean 0.05, sample std 0.0707.
    assert b["gain_mean"] == pytest.approx(0.05) and b["gain_std"] == pytest.approx(0.0707107, abs=1e-6)
    # Second-half mean: the evaluations after step 2 only (step 4): seed 0 0.50, seed 1 0.30.
    assert b["late_mean"] == pytest.approx(0.40) and b["paper"] == "50"
    assert a["gain_mean"] == pytest.approx(0.10) and a["gain_std"] == pytest.approx(0.0)  # over the warm-up
    # 95% t-interval of the paired gains over 2 seeds: 0.05 ± t(0.975, 1) x 0.0707 / sqrt(2) = 0.05 ± 12.706 x 0.05.
    t1 = math.tan(math.pi * 0.475)  # Student's t with one degree of freedom is the Cauchy distribution
    assert b["gain_ci"] == pytest.approx((0.05 - t1 * 0.05, 0.05 + t1 * 0.05), rel=1e-9)
    assert b["entropy_first"] == pytest.approx(0.6) and a["entropy_last"] == pytest.approx(0.45)
    assert a["pg_clipfrac"] == pytest.approx((0.01 + 0.03) / 2) and b["pg_clipfrac_upper"] == pytest.approx(0.005)
    table = markdown_table(rows, [0, 1], k=4)
    assert "| b | 40.0 ± 14.1 | 50.0 / 30.0 | +5.0 ± 7.1 | [-58.5, +68.5] | 40.0 ± 14.1 | 1.00 (0.50) " in table
    assert "| 0.600 -> 0.600 | 50 |" in table
    difference = paired_difference(rows, [0, 1])
    assert difference["per_seed"] == pytest.approx({0: 0.10, 1: 0.0}) and difference["positive"] == 1
    assert markdown_difference(difference, [0, 1]).startswith("b - a, per seed (+10.0, +0.0): +5.0 ± 7.1 points")


def test_the_t_quantile_is_students():
    """Against closed forms: df 1 is Cauchy (tan), df 2 has t = sqrt(2 / (1 - p^2) - 2) for P(|T| < t) = p;
    a large df approaches the normal quantile."""
    assert t_quantile(0.95, 1) == pytest.approx(math.tan(math.pi * 0.475), rel=1e-9)
    assert t_quantile(0.95, 2) == pytest.approx(math.sqrt(2 / (1 - 0.95**2) - 2), rel=1e-9)
    assert t_quantile(0.95, 4) == pytest.approx(2.776445105, rel=1e-8)  # Student's table, 4 degrees of freedom
    assert t_quantile(0.95, 2001) == pytest.approx(statistics.NormalDist().inv_cdf(0.975), rel=1e-3)
    low, high = interval95([1.0, 2.0, 3.0])
    assert (low + high) / 2 == pytest.approx(2.0) and high - 2.0 == pytest.approx(4.302652730 / math.sqrt(3), rel=1e-8)


def test_figures_are_drawn_small(tmp_path):
    rungs, runs = _fake_ladder(tmp_path)
    paths = draw_figures(runs, rungs, [0, 1], str(tmp_path / "figures"), group_size=8)
    names = sorted(os.path.basename(p) for p in paths)
    assert names == ["accuracy_per_rung.png", "clip_higher.png", "dynamic_sampling.png", "group_shares.png"]
    assert all(0 < os.path.getsize(p) < 200_000 for p in paths)
    # A metric a step may lack (no token clipped at the upper bound: null) is left out at that step only.
    x, mean, low, high = seed_band(runs, "b", [0, 1], "token_prob/clipped_upper_mean")
    assert x == [1, 3, 4] and mean == pytest.approx([0.1, 0.2, 0.3]) and low == high == mean
    runs[("b", 1)] = _run({2: 0.25, 4: 0.30}, pg_clipfrac_upper=[0.01, 0.02, 0.03, 0.04])
    assert seed_band(runs, "b", [0, 1], "token_prob/clipped_upper_mean")[0] == [1, 3, 4]  # one seed of two: kept
    x, mean, low, high = seed_band(runs, "b", [0, 1], "pg_clipfrac_upper")
    assert mean == pytest.approx([0.0075, 0.0125, 0.0175, 0.0225]) and high == pytest.approx([0.01, 0.02, 0.03, 0.04])


def test_task_statistics_of_two_hand_made_groups():
    from bench.ablation_task import response_style, task_statistics
    from data.prompts import PromptExample
    from rl.filter import ScoredGroup
    from trainer.types import Sample

    def example(text):
        return PromptExample([1], "0", "s", [{"role": "user", "content": f"What is {text}?"}])

    def group(ex, lengths, correct, reasons):
        samples = [
            Sample(ex, [5] * n, [0.0] * n, r, c, 1.0 if c else -1.0, None) for n, c, r in zip(lengths, correct, reasons)
        ]
        return ScoredGroup(payload=samples, acc=tuple(correct), score=tuple(s.score for s in samples))

    two, four = example("1 + 2"), example("1 + 2 + 3 + 4")
    groups = [
        group(two, [10, 20], [True, True], ["stop", "stop"]),  # all correct
        group(four, [30, 64], [False, False], ["stop", "length"]),  # all wrong, one truncated
    ]
    stats = task_statistics(groups, max_response_length=64, overlong_buffer=16, texts=None)
    assert stats["length_mean"] == pytest.approx((10 + 20 + 30 + 64) / 4)
    assert stats["group_length_range_mean"] == pytest.approx((10 + 34) / 2)
    assert stats["group_length_std_mean"] == pytest.approx((5 + 17) / 2)
    assert stats["truncated_share"] == 0.25 and stats["in_buffer_share"] == 0.0  # 64 is truncated, not in the buffer
    assert stats["truncated_token_share"] == pytest.approx(64 / 124)
    assert stats["all_correct_share"] == 0.5 and stats["all_wrong_share"] == 0.5 and stats["accuracy"] == 0.5
    assert stats["by_terms"][4] == {"samples": 2, "accuracy": 0.0, "length_mean": 47.0, "truncated_share": 0.5}
    assert response_style("1 + 2 + 3 + 4 = 10\nAnswer: 10", 4, False) == "direct"
    assert response_style("1 + 2 = 3\n3 + 3 = 6\n6 + 4 = 10\nAnswer: 10", 4, False) == "stepwise"
    assert response_style("1 + 2 = 3\n3 + 3 = 6\n6 + 4 = 10\n10 + 0 = 10\nAnswer: 10", 4, False) == "split"
    assert response_style("1 + 2 = 3\n3 + 3", 4, True) == "truncated"


def test_the_sweep_row_and_the_rule_that_picks_the_ladders_lr():
    from bench.ablation_sweep import chosen_lr, markdown, sweep_row

    rows = [
        {"step": s, "pg_clipfrac": 0.01 * s, "pg_clipfrac_upper": 0.001, "entropy": 0.3 - 0.01 * s}
        for s in range(1, 11)
    ]
    run = RunResult(
        rows
        + [{"step": 4, "eval/avg_at_k": 0.2}, {"step": 8, "eval/avg_at_k": 0.3}, {"step": 10, "eval/avg_at_k": 0.4}]
    )
    row = sweep_row("1e-5", run, steps=10)
    assert row["pg_clipfrac"] == pytest.approx(0.055) and row["pg_clipfrac_upper"] == pytest.approx(0.001)
    assert row["entropy_first"] == pytest.approx(0.27) and row["entropy_last"] == pytest.approx(0.22)
    assert row["late_mean"] == pytest.approx(0.35) and row["held_out"] == {4: 0.2, 8: 0.3, 10: 0.4}  # steps > 5
    # The largest lr within two points of the best second-half mean: 3e-5 (0.345 against 0.36), not 5e-5 (0.33).
    sweep = [{**row, "lr": lr, "late_mean": late} for lr, late in (("1e-5", 0.36), ("3e-5", 0.345), ("5e-5", 0.33))]
    assert chosen_lr(sweep) == "3e-5"
    assert "| 3e-5 | 5.50 (0.10) | 0.270 -> 0.220 | 20.0 | 30.0 | 40.0 | 34.5 |" in markdown(sweep, 0.15)


def test_series_skip_nulls_and_keep_the_last_value_of_a_relogged_step():
    rows = [
        {"step": 1, "x": 1.0},
        {"step": 2, "x": None},
        {"step": 3, "x": 3.0},
        {"step": 3, "x": 30.0},
        {"step": 4, "y": 1.0},
    ]
    assert series_points(rows, "x") == ([1, 3], [1.0, 30.0])
    assert series_points(rows, "z") == ([], [])
