"""Partial rollout (rollout.partial) against whole rounds, on the chain task of configs/ablation_cpu.toml at the
full DAPO rung (configs/ablation/6_dynamic_sampling_dapo.toml), in two parts.

1. The rollout phase alone (`--policy`): `--steps` rollout phases (Algorithm 1, lines 3-8) of one policy, its
   weights fixed, with the switch off and on, each from the same prompts (the sampler's seed), in one process,
   their steps interleaved so that the two meet the same load. Per variant: wall and CPU time per phase, the
   engine's decode steps per phase (its scheduler's forward passes over all rounds), tokens decoded per kept
   sample, rounds.
2. Training (`--runs OFF ON`): two folders of bench/ablation.py runs of rung 6 that differ only in the switch,
   e.g. `bench/ablation.py --rungs 6 --seeds 0,1,2 --run-dir runs/partial-on --rollout.partial=true` and the
   same without it (or the ladder's own folder). Per seed: held-out avg@k at the end, the rollout phase's and
   the step's mean wall time, tokens generated per kept sample, the share of continued samples.

At the end, an estimate at the 32B recipe's budget (configs/dapo_32b.toml, 20,480 new tokens) by a stated
model: decoding on GPUs is memory-bound, so a decode step costs about the same for 1 or 500 running sequences
and a round lasts its decode steps, which its longest sample sets; lengths scale with the budget (the task's
lengths / 128 x 20,480); the time of a decode step (`--decode-step-s`) is an assumption, not a measurement.

    python bench/partial_rollout.py --policy runs/ablation/seed-0/warm-up/hf [--steps 6]
    python bench/partial_rollout.py --runs runs/partial-off runs/partial-on
Prints a table and one JSON line (also written to --out).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

TASK = os.path.join(ROOT, "configs", "ablation_cpu.toml")
DAPO_RUNG = os.path.join(ROOT, "configs", "ablation", "6_dynamic_sampling_dapo.toml")
RECIPE_BUDGET = 20480  # configs/dapo_32b.toml rollout.max_response_length


def rung_overrides() -> list[str]:
    """Rung 6's [algorithm] switches, read through the config loader (bench/ablation.py's rule)."""
    from bench.ablation import ladder_rungs
    from bench.ablation import rung_overrides as of_rung

    (rung,) = [r for r in ladder_rungs() if r.path == DAPO_RUNG]
    return of_rung(rung)


def rollout_phase(policy: str, partial: bool, dist) -> Callable[[int], dict]:
    """The rollout phase of the policy at `policy` (an HF folder with its tokenizer), the switch as given, as a
    function of the step: its wall and CPU seconds, the engine's decode steps, rounds, tokens per kept sample."""
    import torch

    from config import load_config
    from observe.records import row
    from parallel.sharded_policy import build_policy
    from rl.data import PromptSampler
    from rl.filter import DynamicBatchBuilder
    from rollout.engine_spec import EngineSpec
    from run.guard import Guard
    from trainer.build import build_tokenizer, load_datasets
    from trainer.rollout_phase import RolloutPhase

    where = [f"model.hf_path={policy}", "model.preset=", f"rollout.partial={str(partial).lower()}"]
    cfg = load_config(TASK, [*rung_overrides(), *where])
    torch.manual_seed(cfg.job.seed)
    torch.set_num_threads(cfg.job.cpu_threads)  # as train.py runs it
    tokenizer = build_tokenizer(cfg.model, cfg.data, policy, is_main=True, barrier=lambda: None)
    train_set, _ = load_datasets(cfg.data, tokenizer)
    engine = EngineSpec.from_config(cfg).start_beside(build_policy(cfg.model, dist.device, seed=cfg.job.seed), dist)
    sampler = PromptSampler(train_set, seed=cfg.data.seed, shuffle=cfg.data.shuffle, dp_rank=0, dp_size=1)
    builder = DynamicBatchBuilder.from_config(cfg.algorithm, cfg.training.train_batch_size)
    phase = RolloutPhase.from_config(cfg, engine, sampler, builder, tokenizer, dist)
    decode_steps, stop = [0], engine.stop

    def counted_stop():  # every round ends with a stop, after which the engine's stats are the round's
        out = stop()
        decode_steps[0] += engine.stats.decode_steps
        return out

    engine.stop = counted_stop

    def run(step: int) -> dict:
        decode_steps[0], wall, cpu = 0, time.perf_counter(), time.process_time()
        batch = phase.collect(step, Guard(dist, None))
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        metrics, kept = row(batch.metrics), sum(len(g.payload) for g in batch.groups)
        return {
            "wall_s": wall,
            "cpu_s": cpu,
            "decode_steps": decode_steps[0],
            "rounds": metrics["gen/rounds"],
            "tokens_per_kept_sample": metrics["gen/tokens"] / max(kept, 1),
        }

    return run


def mean(rows: list[dict], key: str) -> float:
    return statistics.fmean(r[key] for r in rows)


def compare_phases(policy: str, steps: int) -> dict:
    """Part 1: both variants from the same policy and prompts in this process, their steps interleaved (off 1,
    on 1, off 2, ...) so that both meet the same load of a shared machine."""
    from parallel.dist_env import init_distributed

    dist = init_distributed(1, -1, 1)
    variants = {name: rollout_phase(policy, on, dist) for name, on in (("off", False), ("on", True))}
    phases: dict[str, list[dict]] = {name: [] for name in variants}
    for step in range(1, steps + 1):
        for name, run in variants.items():
            phases[name].append(run(step))
    keys = ("wall_s", "cpu_s", "decode_steps", "rounds", "tokens_per_kept_sample")
    out: dict = {name: {k: mean(rows, k) for k in keys} | {"phases": rows} for name, rows in phases.items()}
    out["speedup"] = {k: out["off"][k] / out["on"][k] for k in ("wall_s", "cpu_s", "decode_steps")}
    return out


def read_runs(folder: str, rung: str) -> dict[int, list[dict]]:
    """{seed: the metrics rows of its rung-`rung` run} of an ablation folder (finished runs only)."""
    runs = {}
    for seed_dir in sorted(os.listdir(folder)):
        path = os.path.join(folder, seed_dir, rung)
        if seed_dir.startswith("seed-") and os.path.isfile(os.path.join(path, "finished.json")):
            with open(os.path.join(path, "metrics.jsonl")) as f:
                runs[int(seed_dir[5:])] = [json.loads(line) for line in f]
    return runs


def compare_runs(off_dir: str, on_dir: str) -> dict:
    """Part 2: per seed both runs have finished, the end accuracy and the mean phase times and token counts."""
    rung = os.path.basename(DAPO_RUNG)[:-5]
    off, on = read_runs(off_dir, rung), read_runs(on_dir, rung)
    seeds = sorted(set(off) & set(on))
    if not seeds:
        raise SystemExit(f"error: no seed has a finished {rung} run in both {off_dir} and {on_dir}")

    def generated(r: dict) -> float:  # runs from before gen/tokens: every sample generated whole in its step
        return r["gen/tokens"] if "gen/tokens" in r else r["response_length/mean"] * r["gen/samples"]

    def summary(rows: list[dict]) -> dict:
        steps = [r for r in rows if "loss" in r]
        rollout = [r["time/generate"] + r["time/score"] for r in steps]
        kept = [r["gen/samples"] / r["gen/samples_per_kept_sample"] for r in steps]  # samples of kept groups
        evals = [(r["step"], r["eval/avg_at_k"]) for r in rows if "eval/avg_at_k" in r]
        return {
            "held_out": evals[-1][1],
            "evals": evals,
            "rollout_s": statistics.fmean(rollout),
            "step_s": statistics.fmean(r["time/step"] for r in steps),
            "tokens_per_kept_sample": statistics.fmean(generated(r) / k for r, k in zip(steps, kept)),
            "continued_share": statistics.fmean(r.get("partial/continued_share", 0.0) for r in steps),
            "rounds": statistics.fmean(r["gen/rounds"] for r in steps),
        }

    per_seed = {s: {"off": summary(off[s]), "on": summary(on[s])} for s in seeds}
    gains = [per_seed[s]["on"]["held_out"] - per_seed[s]["off"]["held_out"] for s in seeds]
    return {"seeds": seeds, "per_seed": per_seed, "accuracy_gain": gains}


def recipe_estimate(phases: dict, task_budget: int, decode_step_s: float) -> dict:
    """The stated model (module doc): decode steps per phase scaled by the budgets' ratio, times decode_step_s."""
    scale = RECIPE_BUDGET / task_budget
    hours = {v: phases[v]["decode_steps"] * scale * decode_step_s / 3600 for v in ("off", "on")}
    return {"scale": scale, "decode_step_s": decode_step_s, "rollout_hours": hours, "ratio": hours["off"] / hours["on"]}


def figure(result: dict, path: str) -> str:
    """Per step: the rollout phase's CPU seconds and decode steps of part 1; held-out accuracy over the training
    steps of part 2, mean over the seeds both variants finished."""
    from bench.ablation_figures import _figure, _save

    fig, axes = _figure(3)
    for name, style in (("off", "-"), ("on", "--")):
        label = f"rollout.partial = {'true' if name == 'on' else 'false'}"
        rows = result.get("phases", {}).get(name, {}).get("phases", [])
        steps = range(1, len(rows) + 1)
        axes[0].plot(steps, [r["cpu_s"] for r in rows], style, marker="o", label=label)
        axes[1].plot(steps, [r["decode_steps"] for r in rows], style, marker="o", label=label)
        if "runs" in result:
            evals = [seed[name]["evals"] for seed in result["runs"]["per_seed"].values()]
            xs = [step for step, _ in evals[0]]
            axes[2].plot(
                xs,
                [100 * statistics.fmean(e[i][1] for e in evals) for i in range(len(xs))],
                style,
                marker="o",
                label=f"{label} ({len(evals)} seeds)",
            )
    for ax, title, ylabel, xlabel in (
        (axes[0], "rollout phase, one policy", "CPU s per phase", "phase"),
        (axes[1], "rollout phase, one policy", "decode steps per phase", "phase"),
        (axes[2], "training (rung 6)", "held-out avg@4 (%)", "step"),
    ):
        ax.set_title(title, fontsize=10)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    return _save(fig, axes, os.path.dirname(path), os.path.basename(path), "partial rollout on the chain task")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--policy", help="an HF folder with its tokenizer (part 1), e.g. a warm-up run's hf/")
    parser.add_argument("--steps", type=int, default=6, help="rollout phases per variant (part 1)")
    parser.add_argument("--runs", nargs=2, metavar=("OFF", "ON"), help="two ablation folders (part 2)")
    parser.add_argument("--decode-step-s", type=float, default=0.03, help="assumed seconds per decode step at 32B")
    parser.add_argument("--phases-from", help="part 1's results from an earlier --out file, not measured again")
    parser.add_argument("--out", default=os.path.join(ROOT, "runs", "partial_rollout.json"))
    opts = parser.parse_args(argv)
    if not (opts.policy or opts.runs):
        parser.error("give --policy, --runs or both")
    result: dict = {"bench": "partial_rollout"}
    if opts.phases_from:
        with open(opts.phases_from) as f:
            result |= {k: v for k, v in json.load(f).items() if k in ("phases", "estimate")}
    if opts.policy:
        from config import load_config

        phases = result["phases"] = compare_phases(opts.policy, opts.steps)
        budget = load_config(TASK).rollout.max_response_length
        result["estimate"] = recipe_estimate(phases, budget, opts.decode_step_s)
        print(f"rollout phase, {opts.steps} steps of one policy ({opts.policy}), means per phase:")
        print(f"{'':<6}{'wall s':>9}{'CPU s':>9}{'decode steps':>14}{'rounds':>8}{'tokens / kept sample':>22}")
        for name in ("off", "on"):
            v = phases[name]
            print(
                f"{name:<6}{v['wall_s']:>9.2f}{v['cpu_s']:>9.2f}{v['decode_steps']:>14.1f}{v['rounds']:>8.2f}"
                f"{v['tokens_per_kept_sample']:>22.1f}"
            )
        print("off / on: " + ", ".join(f"{k} {x:.2f}x" for k, x in phases["speedup"].items()))
        e = result["estimate"]
        print(
            f"estimate at {RECIPE_BUDGET} tokens (lengths x {e['scale']:.0f}, {e['decode_step_s']} s a decode step, "
            f"assumed): {e['rollout_hours']['off']:.2f} h -> {e['rollout_hours']['on']:.2f} h a rollout phase, "
            f"{e['ratio']:.2f}x"
        )
    if opts.runs:
        runs = result["runs"] = compare_runs(*opts.runs)
        print(f"training, rung 6 with and without rollout.partial, seeds {runs['seeds']}:")
        print(
            f"{'seed':<6}{'held-out off':>14}{'on':>8}{'rollout s off':>15}{'on':>8}{'step s off':>12}{'on':>8}"
            f"{'tokens/kept off':>17}{'on':>8}{'continued':>11}"
        )
        for seed, v in runs["per_seed"].items():
            off, on = v["off"], v["on"]
            print(
                f"{seed:<6}{off['held_out']:>14.3f}{on['held_out']:>8.3f}{off['rollout_s']:>15.2f}"
                f"{on['rollout_s']:>8.2f}{off['step_s']:>12.2f}{on['step_s']:>8.2f}"
                f"{off['tokens_per_kept_sample']:>17.1f}{on['tokens_per_kept_sample']:>8.1f}"
                f"{on['continued_share']:>11.3f}"
            )
        gains = runs["accuracy_gain"]
        print(f"held-out on - off: {statistics.fmean(gains):+.3f} (per seed {', '.join(f'{g:+.3f}' for g in gains)})")
    os.makedirs(os.path.dirname(opts.out), exist_ok=True)
    result["figure"] = figure(result, opts.out[: -len(".json")] + ".png")
    with open(opts.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps({k: v for k, v in result.items() if k != "phases"} | {"out": opts.out}))


if __name__ == "__main__":
    main()
