"""Partial rollout (rollout.partial) end to end on the torch engine: a round ends once the batch is full, its
unfinished groups are continued in the next step, their older tokens' pi_old is the engine's log-prob of the
policy that generated them (or they are masked), and a run killed with SIGKILL resumes them losslessly."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

import rl.reward
import train
from parallel.checkpoint import CheckpointManager
from rl.data import PromptExample
from rl.filter import ScoredGroup
from tests.planted_train import planted_score
from tests.test_train_e2e import overrides, read_rows
from trainer.packing import pack
from trainer.types import Sample
from trainer.update import pack_items_for_groups

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# One and a half groups decode at a time (max_batch_size = 1.5 n), so a round's groups finish one after another, and
# the batch of 4 groups is full long before the round's 12 groups are done: what runs then is stopped.
PARTIAL = {
    "rollout.partial": True,
    "rollout.max_batch_size": 6,
    "rollout.max_response_length": 12,
    "rollout.gen_batch_multiplier": 3,
    "training.micro_batch_tokens": 160,
}


def rows_by_step(run_dir):
    return {r["step"]: r for r in read_rows(run_dir) if "loss" in r}


def test_a_partial_round_stops_once_full_and_the_next_step_continues_its_groups(tmp_path, monkeypatch):
    monkeypatch.setattr(rl.reward, "compute_score", planted_score)
    train.main(overrides(str(tmp_path / "partial"), steps=3, **PARTIAL))
    partial = rows_by_step(str(tmp_path / "partial"))
    for step in (1, 2, 3):
        assert partial[step]["groups/in_batch"] == 4 and partial[step]["gen/rounds"] == 1
        assert partial[step]["partial/groups_stopped"] > 0  # the round ended before its 12 groups were done
        # A whole round generates 12 groups x 4 samples of up to 12 tokens (with a stop token, fewer); this
        # one at most half of them.
        assert 0 < partial[step]["gen/tokens"] <= 12 * 4 * 12 / 2
    assert partial[1]["partial/continued_share"] == 0
    # The groups stopped at step - 1 come first in the next round (a continued one may be filtered out by Eq. 11).
    continued = [partial[step] for step in (2, 3) if partial[step]["partial/continued_share"] > 0]
    assert continued
    for row in continued:
        assert row["partial/age/max"] == 1 and 0 < row["partial/continued_token_share"] < 1
        # Their older tokens were drawn by the weights before the last update: the trainer's differ.
        assert row["partial/mismatch/mean_abs_logp"] > 0
    assert all(partial[step]["partial/groups_dropped_old"] == 0 for step in (1, 2, 3))


def test_continued_tokens_are_marked_older_and_masked_on_request():
    example = PromptExample(prompt_ids=[1, 2], ground_truth="1", data_source="t", messages=[])
    samples = [
        Sample(example, [3, 4, 5], [-1.0, -2.0, -3.0], "stop", True, 1.0, None, 2, continued_tokens=2, age=1),
        Sample(example, [6], [-0.5], "stop", False, -1.0, None, 2),
    ]
    group = ScoredGroup(samples, (True, False), (1.0, -1.0))
    for mask_older, expected_mask in ((False, [[1, 1, 1], [1, 0, 0]]), (True, [[0, 0, 1], [1, 0, 0]])):
        (items,) = pack_items_for_groups(
            [group], adv_eps=1e-6, norm_by_std=True, overlong_filter=False, step=2, mask_older=mask_older
        )
        mb = pack(items)
        assert mb.older.tolist() == [[True, True, False], [False, False, False]]
        assert mb.mask.tolist() == expected_mask
        assert items[0].group_num_tokens == (2 if mask_older else 4)


def _run(command, run_dir, **extra):
    return command + overrides(run_dir, steps=6, **dict(PARTIAL, **extra))


@pytest.mark.slow
def test_a_partial_run_killed_with_sigkill_and_rerun_equals_an_uninterrupted_one(tmp_path):
    """Killed after step 3's row (its unfinished groups in the checkpoint), the rerun continues those groups and
    writes the same rows: every value but the times."""
    straight, killed = str(tmp_path / "straight"), str(tmp_path / "killed")
    command = [sys.executable, "tests/planted_train.py"]
    subprocess.run(_run(command, straight), cwd=ROOT, check=True, capture_output=True, timeout=600)
    process = subprocess.Popen(_run(command, killed), cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    checkpoints = os.path.join(killed, "run", "checkpoints")
    deadline = time.time() + 600
    while not (os.path.isdir(checkpoints) and 3 in CheckpointManager(checkpoints).complete_steps()):
        assert process.poll() is None and time.time() < deadline
        time.sleep(0.02)
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=60)
    done = CheckpointManager(checkpoints).complete_steps()
    assert done and done[-1] < 6
    with open(os.path.join(checkpoints, f"step-{done[-1]:08d}", "train_state", "rank-00000.json")) as f:
        assert json.load(f)["train_state"]["unfinished"], "the checkpoint holds the groups to continue"
    subprocess.run(_run(command, killed), cwd=ROOT, check=True, capture_output=True, timeout=600)
    expected, got = rows_by_step(straight), rows_by_step(killed)
    assert sorted(got) == sorted(expected) == list(range(1, 7))
    for step in expected:
        untimed = {k: v for k, v in expected[step].items() if not k.startswith("time/") and k != "tokens_per_s"}
        assert json.dumps({k: got[step][k] for k in untimed}, sort_keys=True) == json.dumps(untimed, sort_keys=True)
