"""Input checks of the DAPO functions in rl/, one call each: a bad argument raises the error that names the
function, the argument and the rule it broke, so that the functions themselves read as the paper's formulas."""

from __future__ import annotations

import math
import operator
from collections.abc import Iterable, Sequence
from typing import Any, SupportsIndex, TypeVar, cast

import torch

T = TypeVar("T")
FILTER_METRICS = ("acc", "score")
Clips = tuple[float, float, float | None]  # eps_low, eps_high, dual-clip c (None: off)


def require(ok: object, message: str, error: type[Exception] = ValueError) -> None:
    if not ok:
        raise error(message)


def require_int(name: str, value: object, kind: str = "an int") -> int:
    """`value` as a Python int; any integer type (int, numpy and 0-d torch integers) passes, floats and
    bools are refused with a TypeError naming `name`."""
    try:
        if isinstance(value, bool):
            raise TypeError
        return operator.index(cast(SupportsIndex, value))  # anything else raises the TypeError caught below
    except TypeError:
        raise TypeError(f"{name} must be {kind}, got {value!r}") from None


def loss_inputs(
    logp: torch.Tensor,
    others: dict[str, torch.Tensor | None],
    agg: tuple[str, Sequence[str]],
    variant: tuple[str, Sequence[str]],
    clips: Clips,
) -> None:
    """policy_loss: logp [B, T], and the other per-token tensors of its shape; `agg` and `variant` each one of its
    known values; Eq. 10's constants (clip_low, clip_high, clip_c): 0 <= eps_low < 1, eps_high >= 0, the dual
    clip c > 1 (or None)."""
    require(logp.dim() == 2, f"policy_loss: logp must be [B, T], got shape {tuple(logp.shape)}")
    for name, tensor in others.items():
        if tensor is not None and tensor.shape != logp.shape:
            raise ValueError(f"policy_loss: {name} has shape {tuple(tensor.shape)}, logp has {tuple(logp.shape)}")
    for name, (value, known) in {"agg": agg, "variant": variant}.items():
        require(value in known, f"policy_loss: unknown {name} {value!r}; choose one of {tuple(known)}")
    clip_low, clip_high, clip_c = clips
    require(0 <= clip_low < 1, f"policy_loss: clip_low must be in [0, 1), got {clip_low}")
    require(clip_high >= 0, f"policy_loss: clip_high must be >= 0, got {clip_high}")
    require(clip_c is None or clip_c > 1, f"policy_loss: dual-clip constant clip_c must be > 1, got {clip_c}")


def count(given: float | torch.Tensor | None, name: str) -> None:
    """A caller's count (rl/loss.py `count`): None, a one-element tensor or a number >= 0."""
    if isinstance(given, torch.Tensor):
        require(given.numel() == 1, f"policy_loss: {name} must be a scalar, got shape {tuple(given.shape)}")
    elif given is not None:
        require(not isinstance(given, bool) and given >= 0, f"policy_loss: {name} must be a count >= 0, got {given!r}")


def answers(solution: object, ground_truth: object) -> tuple[str, ...]:
    """compute_score: a str solution; the accepted answers, a str or a non-empty list or tuple of str."""
    accepted = (ground_truth,) if isinstance(ground_truth, str) else ()
    accepted = tuple(ground_truth) if isinstance(ground_truth, (list, tuple)) else accepted
    ok = isinstance(solution, str) and accepted and all(isinstance(a, str) for a in accepted)
    expected = "a str solution and a str ground_truth (or a non-empty sequence of str)"
    require(ok, f"compute_score expects {expected}, got {type(solution).__name__} and {ground_truth!r}", TypeError)
    return accepted


def overlong_lengths(length: object, max_len: object, buffer_len: object, factor: float) -> list[int]:
    """overlong_penalty: int token counts, length >= 0, 0 < buffer_len <= max_len, factor >= 0; them as ints."""
    given = {"length": length, "max_len": max_len, "buffer_len": buffer_len}
    n, limit, buffer = [require_int(f"overlong_penalty: {k}", v, "an int number of tokens") for k, v in given.items()]
    require(n >= 0, f"overlong_penalty: length must be >= 0, got {n}")
    require(buffer > 0, f"overlong_penalty: buffer_len must be > 0, got {buffer}")
    require(buffer <= limit, f"overlong_penalty: buffer_len {buffer} exceeds max_len {limit}")
    require(factor >= 0, f"overlong_penalty: factor must be >= 0, got {factor}")
    return [n, limit, buffer]


def finish_reasons(loss_mask: torch.Tensor, reasons: Sequence[str]) -> None:
    """overlong_filter_mask: a [B, T] mask and one str finish reason per row."""
    require(loss_mask.dim() == 2, f"overlong_filter_mask: loss_mask must be [B, T], got shape {tuple(loss_mask.shape)}")
    rows = loss_mask.shape[0]
    ok = not isinstance(reasons, str) and len(reasons) == rows
    require(ok, f"overlong_filter_mask: need one finish reason per row ({rows}), got {reasons!r:.80}")
    if not all(isinstance(reason, str) for reason in reasons):
        raise TypeError(f"overlong_filter_mask: finish reasons must be strings, got {list(reasons)!r:.80}")


def advantage_inputs(scores: torch.Tensor, group_size: Any, eps: float, norm_by_std: bool) -> None:
    """group_advantages: finite scores [N]; eps > 0 when dividing by the std; group_size a positive int dividing N."""
    require(scores.dim() == 1, f"group_advantages: scores must be 1-D [N], got shape {tuple(scores.shape)}")
    require(torch.isfinite(scores).all(), "group_advantages: scores contain NaN or inf")
    # eps = 0 would turn a group of equal rewards into 0 / 0 instead of the documented A = 0.
    require(not norm_by_std or eps > 0, f"group_advantages: eps must be > 0 when dividing by the group std, got {eps}")
    ok = not isinstance(group_size, bool) and isinstance(group_size, int) and group_size > 0
    require(ok, f"group_advantages: group_size must be a positive int, got {group_size!r}")
    n = scores.shape[0]
    require(n % group_size == 0, f"group_advantages: {n} scores do not split into groups of {group_size}")


def group_values(values: Sequence[float], tol: float) -> list[float]:
    """keep_group: a non-empty group of finite values, tol >= 0; the values as floats."""
    require(len(values) > 0, "keep_group: empty group")
    require(tol >= 0, f"keep_group: tol must be >= 0, got {tol}")
    floats = [float(v) for v in values]
    require(all(math.isfinite(v) for v in floats), f"keep_group: non-finite metric value in {floats!r:.80}")
    return floats


def scored(acc: Iterable[Any], score: Iterable[float]) -> tuple[tuple[bool, ...], tuple[float, ...]]:
    """ScoredGroup: as many 0/1 acc values as finite scores (>= 1); them as bools and floats."""
    acc, score = tuple(acc), tuple(float(s) for s in score)
    if len(acc) == 0 or len(acc) != len(score):
        raise ValueError(f"ScoredGroup: need as many acc as score values (>= 1), got {len(acc)} and {len(score)}")
    require(all(a in (0, 1) for a in acc), f"ScoredGroup: acc values must be bool or 0/1, got {acc!r:.80}")
    require(all(math.isfinite(s) for s in score), f"ScoredGroup: non-finite score in {score!r:.80}")
    return tuple(bool(a) for a in acc), score


def builder_settings(batch: int, rounds: int, staleness: int, metric: str, tol: float) -> None:
    """DynamicBatchBuilder: positive batch size and round limit, staleness and tol >= 0, a known metric."""
    name = "DynamicBatchBuilder"
    require(batch > 0, f"{name}: train_batch_size must be > 0, got {batch}")
    require(rounds > 0, f"{name}: max_rounds must be > 0, got {rounds}")
    require(staleness >= 0, f"{name}: max_staleness must be >= 0, got {staleness}")
    require(metric in FILTER_METRICS, f"{name}: metric must be one of {FILTER_METRICS}, got {metric!r}")
    require(tol >= 0, f"{name}: tol must be >= 0, got {tol}")


def step_started(step: int | None, caller: str) -> int:
    """The step in progress; RuntimeError naming `caller` between steps."""
    if step is None:
        raise RuntimeError(f"{caller}: call start_step(step) first")
    return step


def new_step(step: int, current: int | None, last: int | None) -> None:
    """start_step: no step in progress, and steps that increase."""
    require(current is None, f"start_step({step}): step {current} was never finished", RuntimeError)
    require(last is None or step > last, f"start_step({step}): steps must increase (last was {last})")


def new_round(groups: Iterable[object], kind: type[T], rounds: int, max_rounds: int, step: int) -> list[T]:
    """add_round: a round left in this step, and items of `kind` (ScoredGroup); them as a list."""
    require(rounds < max_rounds, f"add_round: all {max_rounds} rounds of step {step} are used", RuntimeError)
    groups = list(groups)
    wrong = next((type(group).__name__ for group in groups if not isinstance(group, kind)), None)
    require(wrong is None, f"add_round: expected {kind.__name__} items, got {wrong}", TypeError)
    return cast("list[T]", groups)
