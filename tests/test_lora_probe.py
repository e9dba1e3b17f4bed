"""bench/lora_probe.py: its arms differ from the full DAPO run in the LoRA keys and the lr only, the sweep's seed stays
out of the pairs, the lr pick and the verdict follow the rules fixed before the runs."""

import math
import os

import pytest

from bench.ablation import TASK_CONFIG, LadderError, effective_config
from bench.lora_probe import MARGIN, SWEEP_SEED, arm_overrides, parse_args, picked_lr, prepare, verdict
from config import config_to_dict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _flat(cfg) -> dict:
    return {f"{s}.{k}": v for s, table in config_to_dict(cfg).items() for k, v in table.items()}


def test_the_arms_are_full_dapo_and_differ_only_in_the_lora_keys_and_the_lr():
    plan = prepare(*parse_args([]))
    assert plan.seeds == [0, 1, 2, 3, 4] and plan.steps == 30 and SWEEP_SEED not in plan.seeds
    configs = {
        arm: _flat(effective_config(TASK_CONFIG, [*plan.overrides, *arm_overrides(arm, "5e-5")], None))
        for arm in ("full", "rank1", "rank8")
    }
    full = configs["full"]
    assert full["algorithm.dynamic_sampling"] and full["algorithm.overlong_filter"] and not full["lora.enabled"]
    assert full["model.hf_path"] == os.path.join(ROOT, "bases", "chain") and full["eval.interval"] == 5
    for arm in ("rank1", "rank8"):
        changed = {k for k in full if full[k] != configs[arm][k]}
        assert {"lora.enabled", "optimizer.lr"} <= changed <= {"lora.enabled", "lora.rank", "optimizer.lr"}, changed
        assert configs[arm]["lora.alpha"] == 32 and configs[arm]["lora.rank"] == int(arm[4:])
    with pytest.raises(LadderError, match="seed 5 is the sweep's"):
        prepare(*parse_args(["--seeds", "0,5"]))


def test_the_sweep_picks_the_best_second_half_once_every_lr_has_one():
    rows = [{"lr": "5e-5", "late_mean": 0.26}, {"lr": "1.5e-4", "late_mean": 0.25}, {"lr": "4.5e-4", "late_mean": 0.24}]
    assert picked_lr(rows) == "5e-5"
    assert picked_lr([*rows[:2], {"lr": "4.5e-4", "late_mean": None}]) is None


@pytest.mark.parametrize(
    "interval, says",
    [
        ((-2.0, 1.0), "rank 1 matched full"),
        ((-3.9, -1.8), "rank 1 did worse than full"),
        ((-3.5, 0.5), "not decided"),
        ((math.nan, math.nan), "not decided: fewer than two seeds"),
    ],
)
def test_the_verdict_follows_the_rule_fixed_before_the_runs(interval, says):
    table = {"steps": [0, 30], "pairs": {"rank1 - full": {30: {"ci95": interval}}}}
    assert verdict(table).startswith(says) and (MARGIN == 3.0)
