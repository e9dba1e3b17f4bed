"""trainer/step_metrics.py: the step's reward, accuracy and lengths describe every generated sample, the
kept/* metrics the batch trained on; a step whose groups were all dropped still shows what it generated."""

import math

import pytest
from engines import ByGenerate
from test_trainer_rollout_phase import collect_batch

from data.prompts import PromptExample, PromptSampler
from rl.filter import DynamicBatchBuilder
from rollout.engine import Completion


class _Engine(ByGenerate):
    """Prompt k: sample 0 answers "1" (correct, 1 token) when k is even; every other sample answers "22"
    (wrong, 2 tokens), truncated ("length") when k is odd."""

    def __init__(self, all_wrong=False):
        self.all_wrong = all_wrong

    def generate(self, prompts, params):
        out = []
        for p, prompt in enumerate(prompts):
            k = prompt[0]
            for s in range(params.n):
                if s == 0 and k % 2 == 0 and not self.all_wrong:
                    out.append(Completion(p, s, [1], [-0.1], "stop"))
                else:
                    out.append(Completion(p, s, [2, 2], [-0.1, -0.1], "length" if k % 2 else "stop"))
        return out


def _row(engine, train_batch_size, max_rounds):
    examples = [PromptExample(prompt_ids=[k], ground_truth="1", data_source="t", messages=[]) for k in range(8)]
    builder = DynamicBatchBuilder(train_batch_size, max_rounds, max_staleness=0)
    return collect_batch(1, builder, engine, PromptSampler(examples, shuffle=False), 2)


def test_all_samples_and_kept_batch_are_logged_under_their_own_names():
    # One round of prompts 0 (1 of 4 correct: kept) and 1 (all wrong, truncated: dropped).
    groups, row = _row(_Engine(), train_batch_size=1, max_rounds=1)
    assert len(groups) == 1
    assert row["reward/mean"] == pytest.approx((1 - 7) / 8) and row["acc/mean"] == pytest.approx(1 / 8)
    assert row["response_length/mean"] == pytest.approx((1 + 7 * 2) / 8) and row["response_length/max"] == 2
    assert row["response_length/clip_ratio"] == pytest.approx(4 / 8)
    assert row["reward/truncated_mean"] == -1  # the four truncated samples are all wrong
    assert math.isnan(row["kept/reward/truncated_mean"])  # the kept group has none
    assert row["kept/reward/mean"] == pytest.approx((1 - 3) / 4) and row["kept/acc/mean"] == pytest.approx(1 / 4)
    assert row["kept/response_length/mean"] == pytest.approx(7 / 4) and row["kept/response_length/max"] == 2
    assert row["kept/response_length/clip_ratio"] == 0
    assert row["groups/kept_share"] == 0.5 and row["groups/all_wrong_share"] == 0.5
    assert row["gen/samples"] == 8  # 2 prompts x 4 samples: the x axis of accuracy against generated samples


def test_a_step_with_nothing_to_train_on_logs_what_it_generated():
    # Two rounds of two prompts, every group all wrong: the batch is empty.
    groups, row = _row(_Engine(all_wrong=True), train_batch_size=2, max_rounds=2)
    assert groups == [] and row["groups/in_batch"] == 0 and row["gen/rounds"] == 2 and row["gen/samples"] == 16
    assert row["reward/mean"] == -1 and row["acc/mean"] == 0 and row["response_length/mean"] == 2
    assert row["response_length/max"] == 2 and row["response_length/clip_ratio"] == pytest.approx(0.5)
    assert row["groups/all_wrong_share"] == 1 and row["groups/kept_share"] == 0
    assert type(row["gen/rounds"]) is int  # counts of whole things are written as integers to metrics.jsonl
    kept = [key for key in row if key.startswith("kept/")]
    assert len(kept) == 6 and all(math.isnan(row[key]) for key in kept)  # no batch: null in metrics.jsonl
