"""bench/partial_rollout.py's arithmetic on hand-made runs: per-seed summaries, the paired accuracy, the estimate."""

import json
import os

import pytest

from bench.partial_rollout import compare_runs, recipe_estimate

RUNG = "6_dynamic_sampling_dapo"


def _run(folder, seed, rows):
    path = os.path.join(folder, f"seed-{seed}", RUNG)
    os.makedirs(path)
    with open(os.path.join(path, "metrics.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    open(os.path.join(path, "finished.json"), "w").write("{}")


def _step(step, generate, tokens=None, **extra):
    row = {
        "step": step,
        "loss": 0.0,
        "time/generate": generate,
        "time/score": 1.0,
        "time/step": 2 * generate,
        "gen/samples": 1024,
        "gen/samples_per_kept_sample": 2.0,
        "gen/rounds": 2,
        "response_length/mean": 30.0,
    }
    return row | ({"gen/tokens": tokens} if tokens is not None else {}) | extra


def test_runs_are_compared_per_seed_both_finished(tmp_path):
    off, on = str(tmp_path / "off"), str(tmp_path / "on")
    _run(off, 0, [_step(1, 9.0), _step(2, 11.0), {"step": 2, "eval/avg_at_k": 0.25}])
    _run(on, 0, [_step(1, 4.0, 12288, **{"partial/continued_share": 0.5}), {"step": 2, "eval/avg_at_k": 0.3}])
    _run(off, 1, [_step(1, 9.0), {"step": 1, "eval/avg_at_k": 0.5}])  # no seed-1 run with the switch
    out = compare_runs(off, on)
    assert out["seeds"] == [0] and out["accuracy_gain"] == [pytest.approx(0.05)]
    before, after = out["per_seed"][0]["off"], out["per_seed"][0]["on"]
    assert before["rollout_s"] == 11.0 and after["rollout_s"] == 5.0 and before["step_s"] == 20.0
    # Without gen/tokens every sample was generated whole: 30 tokens x 1024 samples over the 512 kept.
    assert before["tokens_per_kept_sample"] == 60.0 and after["tokens_per_kept_sample"] == 24.0
    assert after["continued_share"] == 0.5 and before["continued_share"] == 0.0


def test_the_estimate_scales_decode_steps_by_the_budgets():
    out = recipe_estimate({"off": {"decode_steps": 200.0}, "on": {"decode_steps": 100.0}}, 128, 0.03)
    assert out["scale"] == 160 and out["ratio"] == 2.0
    assert out["rollout_hours"]["off"] == pytest.approx(200 * 160 * 0.03 / 3600)
