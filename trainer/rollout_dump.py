"""The samples each step trained on, one JSON line per sample (metrics.rollout_dump), as verl's rollout data dir:

    <run folder>/rollouts/step_000012.rank0.jsonl

    {"step": 12, "prompt_index": 4017, "ground_truth": "1", "response": "Digits: 0310...\\nAnswer: 1", "pred": "1",
     "acc": true, "score": 1.0, "advantage": 0.93, "length": 21, "finish_reason": "stop", "logprobs": [...]}

prompt_index is the prompt's position in the training set (data/prompts.py PromptExample.index), response the text the
reward read (rl/reward.py response_text), score the reward with the soft overlong punishment, advantage the Eq. 9
value the update trains with (trainer/update.py; the update's observer writes the file, trainer/observers.py),
length in tokens, logprobs the rollout policy's log-probability of each response token (4 decimals). With dynamic
sampling on, a step's file holds the groups it kept.

One file per step and data-parallel rank, written whole (a resumed run that redoes a step overwrites its file):
what a run leaves is exactly the steps it completed, each once.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from errors import write_atomically
from rl.reward import response_text

if TYPE_CHECKING:
    from config import Config
    from model.tokenizer import Tokenizer
    from parallel.dist_env import DistEnv
    from trainer.types import RolloutGroup

FOLDER = "rollouts"


def dump_path(run_path: str, step: int, dp_rank: int = 0) -> str:
    return os.path.join(run_path, FOLDER, f"step_{step:06d}.rank{dp_rank}.jsonl")


def sample_lines(
    step: int, groups: list[RolloutGroup], advantages: list[list[float]], tokenizer: Tokenizer
) -> Iterator[dict]:
    """One dict per sample of `groups`, in order, each with its advantage (one list per group; the fields of the
    module docstring)."""
    stop_ids = set(tokenizer.stop_ids)
    for group, group_advantages in zip(groups, advantages, strict=True):
        for sample, advantage in zip(group.payload, group_advantages, strict=True):
            yield {
                "step": step,
                "prompt_index": sample.example.index,
                "ground_truth": sample.example.ground_truth,
                "response": response_text(tokenizer, sample.response_ids, stop_ids),
                "pred": sample.pred,
                "acc": sample.acc,
                "score": sample.score,
                "advantage": advantage,
                "length": len(sample.response_ids),
                "finish_reason": sample.finish_reason,
                "logprobs": [round(x, 4) for x in sample.rollout_logprobs],
            }


def rollout_dump(
    cfg: Config, run_path: str, tokenizer: Tokenizer, dist_env: DistEnv
) -> Callable[[int, list[RolloutGroup], list[list[float]]], None]:
    """dump(step, groups, advantages): writes the step's file when metrics.rollout_dump is on (on one rank of each
    data-parallel group), else does nothing."""
    tp = dist_env.dims.tp_mesh().get_local_rank() if dist_env.mesh is not None and dist_env.dims.tp > 1 else 0
    if not cfg.metrics.rollout_dump or tp != 0:
        return lambda step, groups, advantages: None

    def dump(step: int, groups: list[RolloutGroup], advantages: list[list[float]]) -> None:
        text = "".join(json.dumps(line) + "\n" for line in sample_lines(step, groups, advantages, tokenizer))
        write_atomically(dump_path(run_path, step, dist_env.dp_rank), text)

    return dump


def read_dump(run_path: str, step: int) -> list[dict]:
    """Every rank's samples of one step ([] when the step has no dump)."""
    folder, prefix = os.path.join(run_path, FOLDER), f"step_{step:06d}.rank"
    if not os.path.isdir(folder):
        return []
    rows = []
    for name in sorted(n for n in os.listdir(folder) if n.startswith(prefix) and n.endswith(".jsonl")):
        with open(os.path.join(folder, name)) as f:
            rows += [json.loads(line) for line in f if line.strip()]
    return rows
