"""`python tests/planted_train.py ARGS...` runs train.py with the planted reward of the end-to-end tests
(half of the random responses count as correct), so a random tiny model produces groups with spread."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import rl.reward
import train  # noqa: E402


def planted_score(solution, ground_truth, strict_box=False):
    correct = sum(map(ord, solution)) % 2 == 0
    return {"score": 1.0 if correct else -1.0, "acc": correct, "pred": None}


if __name__ == "__main__":
    rl.reward.compute_score = planted_score
    sys.argv[0] = "train.py"
    train.run_cli(sys.argv[1:])
