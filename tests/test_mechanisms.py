"""bench/mechanisms.py: every arm is its probe's config plus exactly its switches, the probes' regimes are what their
configs state, the mechanism metrics are what the samples say, and the tables' spreads and paired intervals are
what the runs measured."""

import json
import math
import os
import re
import statistics
import subprocess
import sys

import pytest

from bench.ablation import effective_config, ladder_rungs
from bench.ablation_report import interval95
from bench.mechanism_metrics import length_budget_rows, rare_strategy_rows
from bench.mechanisms import PROBES, run_cli
from bench.mechanisms_report import write_probe_report
from config import config_to_dict, load_config
from tests.test_ablation import assert_refused
from trainer.rollout_dump import dump_path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The keys a probe's arms may change: its technique's switches, and nothing else.
TECHNIQUE = {
    "clip_bias": {"clip_low", "clip_high"},
    "rare_strategy": {"clip_high"},
    "length_budget": {"loss_agg", "overlong_filter", "overlong_penalty"},
}


def _flat(cfg) -> dict:
    return {f"{s}.{k}": v for s, table in config_to_dict(cfg).items() for k, v in table.items()}


@pytest.mark.parametrize("name", list(PROBES))
def test_each_arm_is_the_probe_config_with_exactly_its_switches(name):
    probe = PROBES[name]
    arms = ladder_rungs(probe.arms_dir)
    base = _flat(load_config(probe.config))
    resolved = [_flat(effective_config(probe.config, [], arm)) for arm in arms]
    for arm, effective in zip(arms, resolved):
        assert set(arm.switches) <= TECHNIQUE[name], arm.name
        assert {k: effective[f"algorithm.{k}"] for k in arm.switches} == arm.switches, arm.name
        assert {k for k in base if base[k] != effective[k]} <= {f"algorithm.{k}" for k in arm.switches}, arm.name
    reference = resolved[0]
    for arm, effective in zip(arms[1:], resolved[1:]):  # every arm differs from the reference, in its technique only
        changed = {k for k in reference if reference[k] != effective[k]}
        assert changed and changed <= {f"algorithm.{k}" for k in TECHNIQUE[name]}, arm.name
        if name == "length_budget":  # one technique per arm against naive GRPO
            assert len(changed) == 1, arm.name
    assert effective_config(probe.config, [], arms[0]).algorithm.clip_high == 0.2  # the references: symmetric clips


def test_the_probes_regimes_are_what_their_configs_state(tmp_path):
    """16 updates per rollout step everywhere; the length cap truncates 10-15% of the scan task's worked solutions
    and the punishment's buffer is its last fifth; the fork's worked solutions go exactly in 2-5% of cases;
    the coin task's worked solution fits its cap."""
    from data.prompts import synthetic_task_rows
    from trainer.build import build_tokenizer

    for name, probe in PROBES.items():
        cfg = load_config(probe.config)
        assert cfg.training.train_batch_size // cfg.training.mini_batch_size * cfg.training.ppo_epochs == 16, name
        assert cfg.rollout.n == 8 and not cfg.algorithm.dynamic_sampling, name
        # The signal-free probe moves the policy ten times as fast as the two that have something to lose.
        assert cfg.optimizer.lr == (3e-4 if name == "clip_bias" else 3e-5), name
    cfg = load_config(PROBES["length_budget"].config)
    tokenizer = build_tokenizer(cfg.model, cfg.data, str(tmp_path / "scan"), is_main=True, barrier=lambda: None)
    rows = synthetic_task_rows(cfg.data, "train")
    lengths = [len(tokenizer.encode(r["extra_info"]["solution"])) + 1 for r in rows]  # with the stop token
    over = sum(n > cfg.rollout.max_response_length for n in lengths) / len(lengths)
    assert 0.10 <= over <= 0.15
    assert round(cfg.rollout.max_response_length / cfg.algorithm.overlong_buffer) == 5
    cfg = load_config(PROBES["rare_strategy"].config)
    fork = [r for r in synthetic_task_rows(cfg.data, "train") if r["extra_info"]["kind"] == "fork"]
    assert 0.02 <= statistics.fmean(r["extra_info"]["strategy"] == "exactly" for r in fork) <= 0.05
    cfg = load_config(PROBES["clip_bias"].config)
    tokenizer = build_tokenizer(cfg.model, cfg.data, str(tmp_path / "coin"), is_main=True, barrier=lambda: None)
    longest = max(
        len(tokenizer.encode(r["extra_info"]["solution"])) + 1 for r in synthetic_task_rows(cfg.data, "train")
    )
    assert longest <= cfg.rollout.max_response_length


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--probe", "nope"], "unknown probe ['nope']"),
        (["--algorithm.clip_high=0.3"], "algorithm.clip_high is a switch of the clip_bias probe's arms"),
        (["--probe", "length_budget", "--algorithm.loss_agg=token-mean"], "a switch of the length_budget probe's"),
        (["--job.seed=4"], "the ladder sets job.seed itself"),
        (["--seeds", "1,1"], "expected distinct integers"),
        (["--stray"], "unknown arguments --stray"),
    ],
)
def test_bad_input_is_one_line_and_exit_code_2(tmp_path, capsys, args, message):
    assert_refused(run_cli, ["--run-dir", str(tmp_path), *args], message, capsys)
    assert not os.listdir(tmp_path)  # refused before any work


# ---------------------------------------------------------------------------------------------- metrics


def _sample(index, response, *, acc=False, first=-0.1, length=10, finish="stop"):
    return {
        "prompt_index": index,
        "response": response,
        "acc": acc,
        "logprobs": [first],
        "length": length,
        "finish_reason": finish,
    }


def test_the_rare_strategys_share_probability_and_fork_entropy_from_the_samples():
    extra = [{"kind": "fork"}, {"kind": "fork"}, {"kind": "worded"}]
    p, q = 0.2, 0.9  # prompt 0: a rare sample drawn at p(rare) = 0.2; prompt 1: a common one at p(common) = 0.9
    samples = [
        _sample(0, "exactly\n11 + 12 = 23", acc=True, first=math.log(p)),
        _sample(0, "roughly\n11 + 12 is about 20", first=math.log(1 - p)),
        _sample(1, "roughly\n14 + 16 is about 30", acc=True, first=math.log(q)),
        _sample(1, "roughly\n14 + 17 is about 30", first=math.log(q)),
        _sample(2, "exactly\n1 + 1 = 2", acc=True, first=math.log(0.5)),  # not at the fork: left out
    ]
    (row,) = rare_strategy_rows([], {4: samples}, extra)
    assert row["step"] == 4 and row["rare/share"] == pytest.approx(1 / 4)
    assert row["rare/prob"] == pytest.approx((p + (1 - q)) / 2)
    entropy = lambda x: -x * math.log(x) - (1 - x) * math.log(1 - x)  # noqa: E731
    assert row["fork/entropy"] == pytest.approx((entropy(p) + entropy(1 - q)) / 2)
    assert (row["acc/fork"], row["acc/rare"], row["acc/common"]) == (0.5, 1.0, pytest.approx(1 / 3))


def test_truncation_early_answers_styles_and_accuracy_by_position_from_the_samples():
    extra = [{"numbers": [23, 45, 38, 11], "position": 3}, {"numbers": [24, 45, 37, 11], "position": 1}]
    samples = [
        _sample(0, "23 odd\n45 odd\n38 even\nAnswer: 38", acc=True, length=12),
        _sample(0, "23 is odd, not it\nAnswer: 45", length=9),  # early
        _sample(0, "23 is odd, not it\n45 is odd, not it\n38 is", length=20, finish="length"),
        _sample(1, "24 is even, found it\nAnswer: 24", acc=True, length=8),
    ]
    (row,) = length_budget_rows([], {2: samples}, extra)
    assert row["truncated"] == 0.25 and row["early"] == 0.25 and row["short"] == pytest.approx(1 / 4)
    assert row["acc"] == 0.5 and row["len/right"] == 10 and row["len/wrong"] == pytest.approx(14.5)
    assert row["acc/pos3"] == pytest.approx(1 / 3) and row["acc/pos1"] == 1.0 and row["acc/pos2"] is None
    assert row["acc/late"] == pytest.approx(1 / 3)  # positions 3 and 4 of 4


# ---------------------------------------------------------------------------------------------- the report


def test_the_table_holds_the_runs_means_spreads_and_paired_intervals(tmp_path):
    """Made-up clip_bias runs: entropy 1 at step 1, then a per-arm, per-seed level; the table's change, mean,
    spread and paired difference from the reference arm are the hand-computed ones."""
    arms = ladder_rungs(PROBES["clip_bias"].arms_dir)
    seeds, steps = [0, 1, 2], 8
    level = {("1_symmetric", 0): 0.7, ("1_symmetric", 1): 0.8, ("1_symmetric", 2): 0.6}
    level |= {("2_clip_higher", s): level[("1_symmetric", s)] + d for s, d in zip(seeds, (0.1, 0.2, 0.15))}
    level |= {("3_tight_low", s): 1.2 for s in seeds}
    for (arm, seed), value in level.items():
        folder = tmp_path / "clip_bias" / f"seed-{seed}" / arm
        folder.mkdir(parents=True)
        with open(folder / "metrics.jsonl", "w") as f:
            for step in range(1, steps + 1):
                row = {"step": step, "entropy": 1.0 if step == 1 else value, "pg_clipfrac": 0.03}
                f.write(json.dumps(row | {"pg_clipfrac_upper": 0.01 * seed}) + "\n")
    results = write_probe_report(str(tmp_path / "clip_bias"), "clip_bias", seeds, arms, {"training": {"steps": steps}})
    table = {row["arm"]: row["measures"] for row in results["table"]}
    change = table["2_clip_higher"][0]  # entropy, last 5 steps - step 1
    assert change["per_seed"] == {0: pytest.approx(-0.2), 1: pytest.approx(0.0), 2: pytest.approx(-0.25)}
    assert change["mean"] == pytest.approx(-0.15) and change["std"] == pytest.approx(statistics.stdev([-0.2, 0, -0.25]))
    assert change["diff_mean"] == pytest.approx(0.15) and change["diff_std"] == pytest.approx(0.05)
    assert change["diff_ci"] == pytest.approx(interval95([0.1, 0.2, 0.15]))
    assert change["diff_ci"][0] == pytest.approx(0.15 - 4.302652729749464 * 0.05 / math.sqrt(3), rel=1e-9)
    upper, lower = table["3_tight_low"][2], table["3_tight_low"][3]  # clip shares, mean over every step
    assert upper["per_seed"] == {0: 0.0, 1: pytest.approx(0.01), 2: pytest.approx(0.02)}
    assert lower["per_seed"][2] == pytest.approx(0.01)
    assert "diff_mean" not in table["1_symmetric"][0]  # the reference
    text = (tmp_path / "clip_bias" / "table.md").read_text()
    assert "| 2_clip_higher | -0.150 ± 0.132 | -0.200 / 0.000 / -0.250 | +0.100 / +0.200 / +0.150 |" in text
    assert os.path.getsize(results["figure"]) > 10_000


@pytest.mark.slow
def test_a_tiny_rare_strategy_probe_runs_its_warm_up_check_and_arms(tmp_path):
    tiny = [
        "--data.synthetic_num_train=200",
        "--data.synthetic_num_eval=8",
        "--training.sft_warmup_steps=10",
        "--training.steps=2",
        "--training.train_batch_size=4",
        "--rollout.n=4",
        "--eval.k=1",
        "--eval.interval=1",
        "--checkpoint.export_hf=false",
    ]
    command = [sys.executable, os.path.join(ROOT, "bench", "mechanisms.py"), "--probe", "rare_strategy", "--quick"]
    done = subprocess.run(
        [*command, "--run-dir", str(tmp_path), "--jobs", "2", *tiny], cwd=ROOT, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    probe = tmp_path / "rare_strategy"
    check = json.loads((probe / "warm-up-check" / "check.json").read_text())
    assert 0 < check["p_rare_mean"] < 1 and set(check["accuracy_forced"]) == {"roughly", "exactly"}
    for arm in ladder_rungs(PROBES["rare_strategy"].arms_dir):
        run = probe / "seed-0" / arm.name
        assert json.loads((run / "finished.json").read_text())["step"] == 2
        assert os.path.isfile(dump_path(str(run), 2))
    assert re.search(r"\| 3_no_upper_clip \| [\d.]+ ± 0\.00 \|", (probe / "table.md").read_text())
    again = subprocess.run([*command, "--run-dir", str(tmp_path), *tiny], cwd=ROOT, capture_output=True, text=True)
    assert again.returncode == 0 and "0 of 5 runs to do" in again.stdout  # resumable: nothing left
