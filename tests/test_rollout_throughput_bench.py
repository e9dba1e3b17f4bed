"""bench/rollout_throughput.py counts only useful tokens on the transformers side, and its RL workloads'
stop ids give the intended mean response length."""

import torch

from bench.rollout_throughput import (
    WORKLOADS,
    distribution,
    stop_ids_for,
    useful_lengths,
)


def test_transformers_rows_count_up_to_and_including_the_first_stop_id():
    generated = torch.tensor(
        [
            [7, 8, 2, 9, 2],  # first stop (2) at index 2 -> 3 tokens, the rest is padding
            [1, 7, 7, 7, 7],  # stop at index 0 -> 1 token
            [7, 8, 9, 9, 9],  # no stop: ran to the budget -> 5 tokens
        ]
    )
    assert useful_lengths(generated, [1, 2]) == [3, 1, 5]
    assert useful_lengths(generated, []) == [5, 5, 5]


def test_stop_ids_set_the_mean_length_and_fixed_has_none():
    assert stop_ids_for(WORKLOADS["fixed"], 512) == []
    assert stop_ids_for(WORKLOADS["rl-demo"], 512) == list(range(37))  # 512 / 14 = 36.6: stop p = 37/512
    assert stop_ids_for(WORKLOADS["rl-recipe"], 512) == list(range(8))  # 512 / 64: stop p = 1/64


def test_length_distribution_summary():
    assert distribution([1, 2, 3, 4, 5, 6, 7, 8, 9, 32], 32) == {
        "mean": 7.7,
        "median": 5.5,
        "p90": 32,
        "max": 32,
        "at_budget": 0.1,
    }
