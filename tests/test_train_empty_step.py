"""train.py end to end with steps that have nothing to train on (every group all wrong): they log what was
generated, train 0 tokens, take no learning-rate schedule step, and a run resumed after them continues
exactly as the uninterrupted run."""

import warnings

import pytest

import rl.reward
import train
from tests.planted_train import planted_score
from tests.test_train_e2e import overrides, read_rows
from trainer.step_metrics import MetricsWriter

LR, WARMUP = 1e-3, 3
WRONG = {"now": True}  # the reward marks every response wrong while set


def switched_score(solution, ground_truth, strict_box=False):
    if WRONG["now"]:
        return {"score": -1.0, "acc": False, "pred": None}
    return planted_score(solution, ground_truth, strict_box)


def _run(run_dir, steps):
    assert train.main(overrides(run_dir, steps=steps, **{"optimizer.lr": LR, "optimizer.warmup_steps": WARMUP})) == 0
    return {r["step"]: r for r in read_rows(run_dir) if "train_tokens" in r}


def test_steps_without_training_keep_the_schedule_and_resume_exactly(tmp_path, monkeypatch):
    monkeypatch.setattr(rl.reward, "compute_score", switched_score)
    write = MetricsWriter.write

    def write_then_switch(self, step, row):  # steps 1-2 all wrong, then half the responses are right
        write(self, step, row)
        if step == 2:
            WRONG["now"] = False

    monkeypatch.setattr(MetricsWriter, "write", write_then_switch)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        WRONG["now"] = True
        straight = _run(str(tmp_path / "straight"), steps=4)
        WRONG["now"] = True
        _run(str(tmp_path / "resumed"), steps=2)
        WRONG["now"] = False
        resumed = _run(str(tmp_path / "resumed"), steps=4)  # resumes from the step-2 checkpoint
    assert not [w for w in caught if "optimizer.step()" in str(w.message)]

    for step in (1, 2):
        row = straight[step]
        assert row["train_tokens"] == 0 and row["updates"] == 0 and row["groups/in_batch"] == 0
        assert row["lr"] == pytest.approx(LR / WARMUP)  # the schedule did not move
        assert row["groups/all_wrong_share"] == 1 and row["acc/mean"] == 0
        assert row["reward/mean"] <= -1 and row["response_length/mean"] > 0  # what was generated
        assert row["kept/reward/mean"] is None and row["entropy"] is None and row["loss"] is None
    # The first updates run at the warm-up's first rate, as if the empty steps had not been.
    assert [straight[s]["lr"] for s in (3, 4)] == pytest.approx([LR / WARMUP, 2 * LR / WARMUP])
    assert all(straight[s]["updates"] == 2 and straight[s]["train_tokens"] > 0 for s in (3, 4))
    for step in (3, 4):
        for key in ("lr", "loss", "grad_norm", "reward/mean", "kept/reward/mean", "train_tokens"):
            assert resumed[step][key] == straight[step][key], (step, key)
