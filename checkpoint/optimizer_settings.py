"""On resume the run's configured optimizer settings win over the checkpoint's; the schedule keeps its position.

A checkpoint holds the optimizer's param groups (lr, betas, eps, weight decay, ...) and the LR schedule's base
rates as they were at the save. A run started from a checkpoint made under another configuration (one warm-up
shared by runs at several learning rates) would otherwise train at the checkpoint's rate. The schedule's
position (its step count) stays the checkpoint's; its rates are moved to the configured base rate:

    lr = lr_saved * base_configured / base_saved

exact for torch's schedules, whose rate is the base rate times a factor of the step.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.optim.lr_scheduler import LRScheduler


def configured_settings(optimizer: torch.optim.Optimizer, lr_scheduler: LRScheduler | None) -> dict[str, Any]:
    """The run's own settings, taken before a checkpoint is loaded over them."""
    groups = [{k: v for k, v in g.items() if k not in ("params", "initial_lr")} for g in optimizer.param_groups]
    return {"groups": groups, "base_lrs": list(lr_scheduler.base_lrs) if lr_scheduler is not None else None}


def restore_configured(
    settings: dict[str, Any], optimizer: torch.optim.Optimizer, lr_scheduler: LRScheduler | None, saved: dict | None
) -> str:
    """After a load: the configured settings back in `optimizer`, the schedule's saved state `saved` (None: the
    checkpoint has none) loaded at its position with the configured base rates. Returns what the checkpoint
    had otherwise ("lr 0.0001 -> 1.5e-05, weight_decay 0.0 -> 0.1"), or ""."""
    changed, scheduled = {}, lr_scheduler is not None and saved is not None
    for group, wanted in zip(optimizer.param_groups, settings["groups"]):
        for key, value in wanted.items():
            # A scheduled rate moves by design; the kernel (parallel/adamw.py) is always this run's choice.
            if group.get(key) != value and key not in ("foreach", "fused") and (key != "lr" or not scheduled):
                changed[key] = f"{key} {group.get(key)!r} -> {value!r}"
            group[key] = value
    if lr_scheduler is not None and saved is not None:
        bases, was = settings["base_lrs"], saved["base_lrs"]
        last = [lr * (base / old) for lr, base, old in zip(saved["_last_lr"], bases, was)]
        lr_scheduler.load_state_dict({**saved, "base_lrs": bases, "_last_lr": last})
        for group, lr, base in zip(optimizer.param_groups, last, bases):
            group["lr"], group["initial_lr"] = lr, base
        if bases != was:
            changed["lr"] = f"lr {', '.join(map(str, was))} -> {', '.join(map(str, bases))} (at the schedule's step)"
    return ", ".join(changed.values())
