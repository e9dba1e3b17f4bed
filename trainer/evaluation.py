"""Held-out evaluation inside the training loop: eval.py's avg@k / pass@k / maj@k on every rank's share."""

from __future__ import annotations

import os

import torch.distributed as dist

from eval import evaluate, flat_metrics, write_report


def _gather_over_dp(results: list, group) -> list:
    everyone = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, results, group=group)
    return [r for part in everyone for r in part]


def run_held_out_eval(engine, examples, tokenizer, params, dist_env, run_path: str, step: int, *,
                      strict_box: bool = False, progress=None) -> dict[str, float]:
    """Evaluate the engine's current weights; returns flat `eval/...` metrics and writes eval/step_N.json.

    Data-parallel ranks split the problems and merge their results over the data-parallel group;
    tensor-parallel peers evaluate the same share with the same weights and seeds.
    """
    engine.resume_memory()
    mine = examples[dist_env.dp_rank::dist_env.dp_size]
    gather = None
    if dist_env.world_size > 1:
        gather = lambda results: _gather_over_dp(results, dist_env.dp_group)
    report = evaluate(engine, mine, tokenizer, params, strict_box=strict_box, progress=progress, gather=gather)
    if dist_env.is_main:
        write_report(report, os.path.join(run_path, "eval", f"step_{step:06d}.json"))
    return flat_metrics(report)

