"""The held-out evaluation during training: every data-parallel rank evaluates its share of the problems with
its engine's current weights, and the ranks merge their results over the gloo control group."""

from __future__ import annotations

import glob
import os
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from evaluation.evaluate import call_params, checked_pass_ks, score_completions
from evaluation.metrics import ProblemResult
from evaluation.report import flat_metrics, make_report, write_report
from parallel.device_memory import return_cached_memory
from rewards.scorer import Scorer
from rollout.engine import Generator, SamplingParams

if TYPE_CHECKING:
    from data.prompts import PromptExample
    from model.tokenizer import Tokenizer
    from observe.progress import Progress
    from parallel.dist_env import DistEnv


def _merged(results: list[ProblemResult], dist_env: DistEnv) -> list[ProblemResult]:
    """The results of every data-parallel share in data-parallel order (tensor-parallel peers evaluate the same
    share: the first one's is kept), gathered over the gloo control group of all ranks (parallel/dist_env.py, with
    its long timeout: a rank waits there for the slowest)."""
    everyone: list[Any] = [None] * dist_env.world_size
    dist.all_gather_object(everyone, (dist_env.dp_rank, results), group=dist_env.control_group)
    shares: dict[int, list[ProblemResult]] = {}
    for dp_rank, share in everyone:
        shares.setdefault(dp_rank, share)
    return [r for dp_rank in sorted(shares) for r in shares[dp_rank]]


def run_held_out_eval(
    engine: Generator,
    examples: Sequence[PromptExample],
    tokenizer: Tokenizer,
    params: SamplingParams,
    dist_env: DistEnv,
    run_path: str,
    step: int,
    scorer: Scorer | None = None,
    *,
    strict_box: bool = False,
    pass_at: Sequence[int] = (),
    progress: Progress | None = None,
) -> dict[str, float]:
    """Evaluate the engine's current weights; returns flat `eval/...` metrics and writes eval/step_N.json.

    The trainer's cached GPU memory is handed back before the engine takes its memory back
    (parallel/device_memory.py). Data-parallel ranks split the problems and generate together (run/guard.py: a
    failure of any rank's engine stops them all); the ranks then agree that every share was scored (a rank whose
    scoring failed meets the others there, inside the guard's failures_agreed) and merge their results.
    Tensor-parallel peers evaluate the same share with the same weights and seeds. scorer: the run's reward (None:
    the rule reward, `strict_box` as in training). progress: advanced by this rank's problems once they are scored.
    """
    return_cached_memory(dist_env)
    mine = examples[dist_env.dp_rank :: dist_env.dp_size]
    ks = checked_pass_ks(params, mine, pass_at, None, shared=True)
    start = time.perf_counter()
    engine.resume_memory()
    completions = engine.generate([list(e.prompt_ids) for e in mine], call_params(params, mine, 0))
    stop_ids, k = params.stop_token_ids, params.n
    results = score_completions(
        mine, completions, tokenizer, k, strict_box=strict_box, stop_ids=stop_ids, scorer=scorer
    )
    engine.everyone(True)  # every share scored
    elapsed = time.perf_counter() - start
    if progress is not None:
        progress.update(len(mine))
    results = results if dist_env.world_size == 1 else _merged(results, dist_env)
    if not results:
        raise ValueError("evaluate() needs at least one example (none on any rank)")
    report = make_report(results, ks, params, strict_box, elapsed)
    if dist_env.is_main:
        write_report(report, os.path.join(run_path, "eval", f"step_{step:06d}.json"))
    return flat_metrics(report)


def discard_reports_after(run_path: str, step: int) -> None:
    """Remove eval/step_N.json for N > step: a run resumed at `step` trains those steps again (as the rows of
    metrics.jsonl past it are cut), and a report of the weights it no longer has must not be taken for theirs."""
    for path in glob.glob(os.path.join(run_path, "eval", "step_*.json")):
        if int(os.path.basename(path)[len("step_") : -len(".json")]) > step:
            os.remove(path)
