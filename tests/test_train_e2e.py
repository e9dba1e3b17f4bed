"""train.py end to end on CPU: one process, FSDP=2 and TP=2 on gloo, and an exact resume."""

import collections
import json
import os
import subprocess
import sys

import pytest
import torch

import rl.reward
import train
import trainer.build
import trainer.loop
import trainer.scoring
from model.args import get_preset
from model.hf import load_hf
from model.qwen2 import build_model
from tests.dist_utils import run_ranks
from tests.planted_train import planted_score
from tests.test_checkpoint_integrity import garbage_rank_json
from trainer.mismatch import ROLLOUT_LOGP_TOLERANCE

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = os.path.join(ROOT, "configs")
DEMO_SCRATCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "demo_scratch.toml")  # no base policy


def overrides(run_dir, steps=2, **extra):
    values = {
        "job.run_dir": run_dir,
        "job.name": "run",
        "model.preset": "demo",
        "data.synthetic_num_train": 64,
        "data.synthetic_num_eval": 8,
        "data.max_prompt_length": 64,
        "rollout.n": 4,
        "rollout.max_response_length": 6,
        "rollout.max_batch_size": 64,
        "algorithm.overlong_buffer": 2,
        "algorithm.overlong_filter": False,  # random responses all hit the limit
        "algorithm.max_num_gen_batches": 3,
        # Carried-over groups were sampled by older weights; without them the engine/trainer log-prob
        # comparison below is exact.
        "algorithm.carry_over_max_staleness": 0,
        "training.steps": steps,
        "training.train_batch_size": 4,
        "training.mini_batch_size": 2,
        "training.micro_batch_tokens": 128,
        "training.sft_warmup_steps": 0,
        "optimizer.lr": 1e-3,
        "optimizer.warmup_steps": 1,
        "eval.at_start": False,
        "eval.at_end": False,
        "eval.interval": 0,
        "checkpoint.interval": 1,
        "checkpoint.keep_latest_k": 3,
        "checkpoint.resume": True,
    }
    values.update(extra)
    return ["--config", DEMO_SCRATCH] + [f"--{k}={v}" for k, v in values.items()]


def read_rows(run_dir):
    with open(os.path.join(run_dir, "run", "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def assert_trained(run_dir, steps):
    rows = [r for r in read_rows(run_dir) if "loss" in r]
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    for row in rows:
        for key in ("loss", "entropy", "grad_norm", "pg_clipfrac", "ppo_kl", "reward/mean", "token_prob/mean"):
            assert row[key] is not None and torch.isfinite(torch.tensor(row[key])), (key, row)
        assert row["groups/in_batch"] == 4 and row["grad_norm"] > 0
        # The engine's log-probs of the sampled tokens are the trainer's (both fp32 here): the gap stays below the
        # threshold at which the trainer stops taking them as pi_old. That the gap is fp32 rounding is checked
        # against float64 in tests/test_old_logprobs.py and tests/test_rollout_torch_engine.py.
        assert row["mismatch/max_abs_logp"] < ROLLOUT_LOGP_TOLERANCE
    initial = build_model(get_preset("demo"), seed=0)
    exported = load_hf(os.path.join(run_dir, "run", "hf"))
    changed = [n for n, p in exported.named_parameters() if not torch.equal(p, initial.get_parameter(n))]
    assert len(changed) == len(list(initial.parameters())), "every parameter should have moved"


def test_two_steps_in_one_process(tmp_path, monkeypatch):
    monkeypatch.setattr(rl.reward, "compute_score", planted_score)
    assert train.main(overrides(str(tmp_path))) == 0
    assert_trained(str(tmp_path), 2)


def _rank_run(rank, world_size, argv):
    rl.reward.compute_score = planted_score
    return train.main(argv)


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "layout", [{"parallelism.dp_shard": 2}, {"parallelism.tp": 2, "parallelism.dp_shard": 1}], ids=["fsdp2", "tp2"]
)
def test_two_steps_on_two_ranks(tmp_path, layout):
    assert run_ranks(_rank_run, 2, overrides(str(tmp_path), **layout)) == [0, 0]
    assert_trained(str(tmp_path), 2)


def test_resume_reproduces_the_uninterrupted_run(tmp_path, monkeypatch):
    monkeypatch.setattr(rl.reward, "compute_score", planted_score)
    straight, resumed = str(tmp_path / "straight"), str(tmp_path / "resumed")
    assert train.main(overrides(straight, steps=2)) == 0
    assert train.main(overrides(resumed, steps=1)) == 0
    assert train.main(overrides(resumed, steps=2)) == 0  # resumes from the step-1 checkpoint
    expected = [r for r in read_rows(straight) if r["step"] == 2 and "loss" in r][0]
    got = [r for r in read_rows(resumed) if r["step"] == 2 and "loss" in r][0]
    assert [r["step"] for r in read_rows(resumed) if "loss" in r] == [1, 2]
    for key in (
        "loss",
        "reward/mean",
        "entropy",
        "grad_norm",
        "pg_clipfrac",
        "response_length/mean",
        "groups/kept_share",
        "gen/rounds",
    ):
        assert got[key] == expected[key], key


@pytest.mark.parametrize(
    "config",
    sorted(
        os.path.relpath(os.path.join(d, f), CONFIGS)
        for d, _, files in os.walk(CONFIGS)
        for f in files
        if f.endswith(".toml")
    ),
)
def test_dry_run_prints_the_resolved_config_without_building_a_model(config, capsys, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("--dry-run must not touch a model")

    monkeypatch.setattr(trainer.build, "build_policy_and_engine", refuse)
    assert train.main(["--config", os.path.join(CONFIGS, config), "--dry-run"]) == 0
    resolved = json.loads(capsys.readouterr().out)
    assert set(resolved) >= {"model", "rollout", "algorithm", "training", "parallelism"}
    assert resolved["algorithm"]["kl_coef"] == 0.0


def _torchrun(argv, timeout=600):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    return subprocess.run(
        [*command, "tests/planted_train.py", *argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.multiprocess
@pytest.mark.slow
def test_under_torchrun_a_line_every_rank_prints_comes_out_once(tmp_path):
    """Two ranks print the same progress lines and stop with the same error: each comes out once."""
    argv = overrides(str(tmp_path), steps=1, **{"parallelism.dp_shard": 2, "eval.at_end": True})
    done = _torchrun(argv)
    ours = [line for line in done.stderr.splitlines() if not line.startswith(("W1", "W0", "[W", "*****"))]
    assert done.returncode == 0 and ours, done.stderr
    assert [line for line, count in collections.Counter(ours).items() if count > 1] == [], done.stderr
    assert sum(line.startswith("held-out accuracy after DAPO") for line in ours) == 1
    # The same refusal on both ranks (their only checkpoint damaged): one line.
    garbage_rank_json(os.path.join(tmp_path, "run", "checkpoints", "step-00000001"))
    refused = _torchrun(overrides(str(tmp_path), steps=2, **{"parallelism.dp_shard": 2}))
    lines = [line for line in refused.stderr.splitlines() if line.startswith("checkpoint error: no intact checkpoint")]
    assert refused.returncode != 0 and len(lines) == 1, refused.stderr


def test_the_k_th_copy_of_a_line_is_printed_by_the_first_rank_to_reach_it(capsys):
    """observe/console.py on a store two ranks share; a store that no longer answers prints everything."""
    import torch.distributed as dist

    from observe.console import OncePerJob

    store = dist.HashStore()
    rank0, rank1 = OncePerJob(store), OncePerJob(store)
    for line in ("step 1", "step 1", "rank 1 alone"):
        rank1.print_line(line)
    for line in ("step 1", "step 1", "step 1"):
        rank0.print_line(line)  # the third copy is rank 0's own
    assert capsys.readouterr().err.splitlines() == ["step 1", "step 1", "rank 1 alone", "step 1"]

    class Gone:
        def add(self, key, amount):
            raise RuntimeError("connection refused")

    OncePerJob(Gone()).print_line("the store is gone")
    assert capsys.readouterr().err == "the store is gone\n"
