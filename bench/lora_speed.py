"""The update phase with LoRA against full fine-tuning, in one run: CPU time of TrainPhase.run (old log-probs, the 16
mini-batch updates) on the same generated batch, of its optimizer steps alone, and the size of a training checkpoint.

One batch (64 prompts x 8 samples, one round) is generated once by the torch engine from bases/chain with the
configuration of the LoRA probe (configs/ablation_cpu.toml, full DAPO: bench/lora_probe.py); then each variant
(full fine-tuning, LoRA rank 1 and rank 8 on every linear) starts from the base and runs TrainPhase.run on that
batch, the variants taking turns, `--repeats` times each after one warm-up run, one torch thread (CPU time, so that a
shared machine's neighbours disturb it less than wall time). The fastest run of each counts. After its last run each
variant writes one training checkpoint (checkpoint/manager.py: its parameters or adapters, and AdamW's moments).
Prints a table (CPU seconds, the ratio to full, checkpoint bytes) and one JSON line.

    python bench/lora_speed.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import functools
import json
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from bench.train_phase_profile import PIECES, _profiled, build  # noqa: E402

# Inside "grad clip + AdamW" (trainer/optimizer.py OptimizerStep): AdamW's own step, and the finiteness check of every
# parameter after it (parallel/finite.py), which LoRA does not shrink.
STEP_PIECES = [
    *PIECES,
    ("AdamW step", "step", "torch/optim/adam.py"),
    ("finite check", "nonfinite_state", "finite.py"),
]

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
VARIANTS = {"full": None, "LoRA rank 1": 1, "LoRA rank 8": 8}
LORA_LR = 1.5e-4  # the LoRA probe's scale of lr (10x full's); the time of a step does not depend on it


def _policy(base: torch.nn.Module, rank: int | None) -> torch.nn.Module:
    from parallel.lora import Adapters, apply_lora

    model = copy.deepcopy(base)
    if rank is not None:
        apply_lora(model, Adapters(rank, 32.0, TARGETS, os.path.join(ROOT, "bases", "chain")))
    return model


def _run(cfg, dist, model, groups, lr: float) -> tuple[dict, tuple]:
    """One profiled TrainPhase.run from `model`'s current weights; (figures, (optimizer, scheduler))."""
    from trainer.observers import TrainWatch, no_display
    from trainer.optimizer import build_optimizer
    from trainer.update import TrainPhase

    optimizer, scheduler = build_optimizer(model.parameters(), dataclasses.replace(cfg.optimizer, lr=lr), foreach=True)
    phase = TrainPhase(cfg, model, optimizer, scheduler, dist, TrainWatch(no_display))
    _, cpu, wall, pieces = _profiled(functools.partial(phase.run, 1, groups), STEP_PIECES)
    return {"cpu_s": cpu, "wall_s": wall, "pieces": pieces}, (optimizer, scheduler)


def checkpoint_bytes(model, optimizer, scheduler) -> int:
    from checkpoint.manager import CheckpointManager

    with tempfile.TemporaryDirectory() as folder:
        path = CheckpointManager(folder).save(1, model, optimizer, scheduler, {"step": 1})
        return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3, help="profiled runs per variant; the fastest is kept")
    opts = parser.parse_args()
    torch.set_num_threads(1)
    overrides = ["algorithm.overlong_filter=true", "algorithm.dynamic_sampling=false", "rollout.engine=torch"]
    cfg, dist, base, engine, groups, _, _ = build(os.path.join(ROOT, "configs", "ablation_cpu.toml"), overrides)
    engine.shutdown()
    models = {name: _policy(base, rank) for name, rank in VARIANTS.items()}
    starts = {name: copy.deepcopy(m.state_dict()) for name, m in models.items()}
    runs: dict[str, list[dict]] = {name: [] for name in VARIANTS}
    last: dict[str, tuple] = {}
    for attempt in range(opts.repeats + 1):  # the first round warms the allocator up and is not counted
        for name, model in models.items():
            model.load_state_dict(starts[name])
            lr = cfg.optimizer.lr if VARIANTS[name] is None else LORA_LR
            figures, last[name] = _run(cfg, dist, model, groups, lr)
            if attempt:
                runs[name].append(figures)
    best = {name: min(r, key=lambda run: run["cpu_s"]) for name, r in runs.items()}
    sizes = {name: checkpoint_bytes(models[name], *last[name]) for name in VARIANTS}
    trained = {name: sum(p.numel() for p in m.parameters() if p.requires_grad) for name, m in models.items()}
    full = best["full"]
    samples = sum(len(g.payload) for g in groups)
    print(f"update phase of one DAPO step ({samples} samples, 16 updates), CPU s, the fastest of {opts.repeats} runs")
    head = f"{'variant':<14}{'trained':>10}{'update':>8}{'ratio':>7}{'backward':>10}{'clip+AdamW':>12}"
    head += f"{'AdamW step':>12}{'ratio':>8}{'checkpoint':>12}"
    print(head + "\n" + "-" * len(head))
    for name, run in best.items():
        step, step_full = run["pieces"]["AdamW step"], full["pieces"]["AdamW step"]
        print(
            f"{name:<14}{trained[name]:>10,}{run['cpu_s']:>8.2f}{run['cpu_s'] / full['cpu_s']:>7.2f}"
            f"{run['pieces']['backward']:>10.2f}{run['pieces']['grad clip + AdamW']:>12.3f}{step:>12.4f}"
            f"{step / step_full:>8.3f}{sizes[name] / 1e6:>9.2f} MB"
        )
    result = {
        name: {
            "trained_parameters": trained[name],
            "update_cpu_s": round(run["cpu_s"], 3),
            "update_ratio_to_full": round(run["cpu_s"] / full["cpu_s"], 3),
            "pieces_cpu_s": {k: round(v, 3) for k, v in run["pieces"].items()},
            "checkpoint_bytes": sizes[name],
        }
        for name, run in best.items()
    }
    print(json.dumps({"lora_speed": result, "repeats": opts.repeats, "load_average": os.getloadavg()[0]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
