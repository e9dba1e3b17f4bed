"""LoRA rank 1 and rank 8 against full fine-tuning, full DAPO on the ablation's chain task (bench/RESULTS.md, "LoRA
rank 1 against full fine-tuning": the design and the prediction, written before any run).

    python bench/lora_probe.py            # the lr sweep (rank 1, seed 5), 3 arms x seeds 0-4, into runs/lora-probe/
    python bench/lora_probe.py --quick    # 8 steps, 2 lrs, seed 0, 200 held-out problems, into runs/lora-probe-quick/
    python bench/lora_probe.py --report   # the tables of the runs done so far, nothing trained
    python bench/lora_probe.py [--seeds 0,1,2,3,4] [--jobs 2] [--threads 1] [--run-dir DIR] [--section.key=value ...]

Every run is `train.py --config configs/ablation_cpu.toml` with the switches of
configs/ablation/6_dynamic_sampling_dapo.toml (full DAPO) and a held-out evaluation every 5 steps; the arms add

    full      nothing (every weight trained at the task config's lr, the ablation's 1.5e-5)
    rank1     lora.enabled, lora.rank 1, lora.alpha 32, optimizer.lr = the sweep's pick
    rank8     the same with lora.rank 8

Every arm of a seed starts from bases/chain with the same job.seed, so the arms of a seed are paired (each run
evaluates step 0 itself: the same number in every arm of a seed, a check of the pairing). The sweep runs rank 1 on
seed 5 at each lr of SWEEP_LRS and picks the one with the highest mean held-out accuracy over the evaluations of the
second half (steps > S/2, bench/ablation_report.py late_mean); it runs first, beside the full arm, then the LoRA arms
at its pick. Resumable,
`--jobs` runs at a time, the settings saved on the first launch and a rerun with others refused, progress per run:
bench/ablation.py's runner. The report (`--report`, and the end of every launch) writes table.md and results.json:
held-out avg@4 per arm and evaluation step (mean ± std over seeds), the paired differences rank1 - full, rank8 -
full and rank1 - rank8 with their 95% t-intervals, the training accuracy per step (acc/mean), the sweep's table and
the verdict of the rule fixed before the runs: rank 1 matched full if the interval of rank1 - full at the last step
lies inside [-MARGIN, +MARGIN] points, did worse if its upper end is below 0, else not decided.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench import ablation  # noqa: E402
from bench.ablation import (  # noqa: E402
    TASK_CONFIG,
    Job,
    LadderError,
    Rung,
    check_ladder_file,
    effective_config,
    ladder_rungs,
    parse_numbers,
    parse_runner_arguments,
    run_timed,
    rung_overrides,
    runner_arguments,
    saved_timing,
    train_command,
)
from bench.ablation_report import HELD_OUT, _mean_std, interval95, late_mean, read_run  # noqa: E402
from config import config_to_dict  # noqa: E402

SWEEP_SEED = 5  # not one of the probe's seeds: the pick does not favour the pairs it is judged on
SWEEP_LRS = ("5e-5", "1.5e-4", "4.5e-4")  # a third, one and three times the published 10x of full's 1.5e-5
QUICK_LRS = ("5e-5", "4.5e-4")
ALPHA = 32  # for every rank: scale alpha / r ("LoRA Without Regret")
MARGIN = 3.0  # points: the verdict's equivalence margin, under half of what full DAPO gains over the base here
COMMON = ["eval.interval=5"]
QUICK = ["training.steps=8", "eval.interval=4", "data.synthetic_num_eval=200"]
PAIRS = (("rank1", "full"), ("rank8", "full"), ("rank1", "rank8"))


def arm_overrides(arm: str, lr: str) -> list[str]:
    """The overrides of one arm ("full", "rankN") on top of the task config and the DAPO switches."""
    if arm == "full":
        return []
    return ["lora.enabled=true", f"lora.rank={int(arm[4:])}", f"lora.alpha={ALPHA}", f"optimizer.lr={lr}"]


def run_job(base: list[str], folder: str, name: str, seed: int, steps: int, extra: list[str]) -> Job:
    """One train.py run in folder/name."""
    command = [*base, *[f"--{o}" for o in extra], f"--job.run_dir={folder}", f"--job.name={name}"]
    command += [f"--job.seed={seed}", "--metrics.progress=false"]
    return Job(seed, Rung(0, name, "", {}), os.path.join(folder, name), steps, command)


@dataclasses.dataclass
class Plan:
    run_dir: str
    seeds: list[int]
    lrs: tuple[str, ...]
    overrides: list[str]  # the DAPO switches, the probe's and the command line's: every run's
    steps: int

    def base(self) -> list[str]:
        return train_command(TASK_CONFIG, self.overrides)

    def sweep_jobs(self) -> list[Job]:
        folder = os.path.join(self.run_dir, "sweep")
        extra = lambda lr: arm_overrides("rank1", lr)  # noqa: E731
        return [run_job(self.base(), folder, f"lr-{lr}", SWEEP_SEED, self.steps, extra(lr)) for lr in self.lrs]

    def arm_jobs(self, arms: tuple[str, ...], lr: str = "") -> list[Job]:
        folder = lambda seed: os.path.join(self.run_dir, f"seed-{seed}")  # noqa: E731
        extra = lambda arm: arm_overrides(arm, lr)  # noqa: E731
        return [
            run_job(self.base(), folder(seed), arm, seed, self.steps, extra(arm)) for seed in self.seeds for arm in arms
        ]


def sweep_rows(plan: Plan) -> list[dict]:
    """Per lr: the held-out accuracy at each evaluation and the second-half mean (None where not run yet)."""
    rows = []
    for lr in plan.lrs:
        run = read_run(os.path.join(plan.run_dir, "sweep", f"lr-{lr}"))
        held_out = dict(zip(*run.series(HELD_OUT))) if run else {}
        rows.append({"lr": lr, "held_out": held_out, "late_mean": late_mean(run, plan.steps) if run else None})
    return rows


def picked_lr(rows: list[dict]) -> str | None:
    """The lr with the highest second-half mean, once every lr has one."""
    if any(r["late_mean"] is None for r in rows):
        return None
    return max(rows, key=lambda r: r["late_mean"])["lr"]


def probe_table(plan: Plan) -> dict:
    """Held-out accuracy per arm and evaluation step over seeds, the paired differences, training accuracy."""
    runs = {
        (arm, s): read_run(os.path.join(plan.run_dir, f"seed-{s}", arm))
        for arm in ("full", "rank1", "rank8")
        for s in plan.seeds
    }
    held = {key: dict(zip(*run.series(HELD_OUT))) if run else {} for key, run in runs.items()}
    steps = sorted({s for values in held.values() for s in values})
    table: dict = {"steps": steps, "arms": {}, "pairs": {}, "train_acc": {}}
    for arm in ("full", "rank1", "rank8"):
        per_seed = {s: [100 * held[arm, seed][s] for seed in plan.seeds if s in held[arm, seed]] for s in steps}
        table["arms"][arm] = {s: {"per_seed": v, "mean_std": _mean_std(v)} for s, v in per_seed.items()}
        acc = [dict(zip(*run.series("acc/mean"))) for seed in plan.seeds if (run := runs[arm, seed])]
        table["train_acc"][arm] = (
            {t: statistics.fmean(a[t] for a in acc) for t in sorted(set.intersection(*map(set, acc))) if acc}
            if acc
            else {}
        )
    for a, b in PAIRS:
        table["pairs"][f"{a} - {b}"] = {}
        for s in steps:
            diffs = [
                100 * (held[a, seed][s] - held[b, seed][s])
                for seed in plan.seeds
                if s in held[a, seed] and s in held[b, seed]
            ]
            table["pairs"][f"{a} - {b}"][s] = {
                "per_seed": diffs,
                "mean_std": _mean_std(diffs),
                "ci95": interval95(diffs),
            }
    return table


def verdict(table: dict) -> str:
    """The rule fixed before the runs (module docstring), on rank1 - full at the last evaluation step."""
    if not table["steps"]:
        return "no runs yet"
    last = table["steps"][-1]
    low, high = table["pairs"]["rank1 - full"][last]["ci95"]
    if low != low:  # nan: fewer than two seeds
        return f"not decided: fewer than two seeds at step {last}"
    where = f"rank1 - full at step {last}: 95% interval [{low:+.1f}, {high:+.1f}] points"
    if -MARGIN <= low and high <= MARGIN:
        return f"rank 1 matched full ({where}, inside ±{MARGIN:g})"
    if high < 0:
        return f"rank 1 did worse than full ({where})"
    return f"not decided ({where}; the margin is ±{MARGIN:g})"


def _cell(mean_std: tuple[float, float]) -> str:
    mean, std = mean_std
    return "-" if mean != mean else f"{mean:.1f} ± {std:.1f}"


def markdown(plan: Plan, sweep: list[dict], lr: str | None, table: dict) -> str:
    lines = [f"# LoRA probe in {plan.run_dir}", "", "## The lr sweep (rank 1, seed 5)", ""]
    evals = sorted({s for r in sweep for s in r["held_out"]})
    lines += [
        "| lr | " + " | ".join(f"step {s}" for s in evals) + " | second-half mean |",
        "|---" * (len(evals) + 2) + "|",
    ]
    for r in sweep:
        cells = [f"{100 * r['held_out'][s]:.1f}" if s in r["held_out"] else "-" for s in evals]
        late = "-" if r["late_mean"] is None else f"{100 * r['late_mean']:.1f}"
        lines.append(f"| {r['lr']}{' (picked)' if r['lr'] == lr else ''} | " + " | ".join(cells) + f" | {late} |")
    steps = table["steps"]
    lines += ["", f"## Held-out avg@4 (%), mean ± std over seeds {plan.seeds}; paired differences, 95% t-interval", ""]
    lines += ["| arm | " + " | ".join(f"step {s}" for s in steps) + " |", "|---" * (len(steps) + 1) + "|"]
    for arm, cells in table["arms"].items():
        lines.append(f"| {arm} | " + " | ".join(_cell(cells[s]["mean_std"]) for s in steps) + " |")
    for pair, cells in table["pairs"].items():
        row = [
            "-"
            if not cells[s]["per_seed"]
            else f"{cells[s]['mean_std'][0]:+.1f}"
            + (f" [{cells[s]['ci95'][0]:+.1f}, {cells[s]['ci95'][1]:+.1f}]" if len(cells[s]["per_seed"]) > 1 else "")
            for s in steps
        ]
        lines.append(f"| {pair} | " + " | ".join(row) + " |")
    lines += ["", "## Training accuracy (acc/mean), mean over seeds, per block of 5 steps", ""]
    for arm, acc in table["train_acc"].items():
        blocks = [list(acc.values())[i : i + 5] for i in range(0, len(acc), 5)]
        lines.append(f"- {arm}: " + " / ".join(f"{100 * statistics.fmean(b):.1f}" for b in blocks))
    lines += ["", f"Verdict: {verdict(table)}", ""]
    return "\n".join(lines)


def draw(plan: Plan, table: dict) -> None:
    """figure.png: held-out accuracy per evaluation step, per arm the mean over seeds and the lowest to highest seed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for i, (arm, cells) in enumerate(table["arms"].items()):
        steps = [s for s in table["steps"] if cells[s]["per_seed"]]
        ax.plot(steps, [cells[s]["mean_std"][0] for s in steps], "-o", color=f"C{i}", markersize=3.5, label=arm)
        low, high = [min(cells[s]["per_seed"]) for s in steps], [max(cells[s]["per_seed"]) for s in steps]
        ax.fill_between(steps, low, high, color=f"C{i}", alpha=0.15)
    ax.set(xlabel="DAPO step", ylabel="held-out avg@4 (%)", title="Full fine-tuning against LoRA rank 1 and 8")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(plan.run_dir, "figure.png"), dpi=120)
    plt.close(fig)


def write_report(plan: Plan, lr: str | None) -> None:
    sweep, table = sweep_rows(plan), probe_table(plan)
    if table["steps"]:
        draw(plan, table)
    text = markdown(plan, sweep, lr, table)
    results = {
        "lr": lr,
        "sweep": sweep,
        "table": table,
        "verdict": verdict(table),
        "timing": saved_timing(plan.run_dir),
    }
    with open(os.path.join(plan.run_dir, "table.md"), "w") as f:
        f.write(text)
    with open(os.path.join(plan.run_dir, "results.json"), "w") as f:
        json.dump(results, f, indent=1, default=str)
    print(text)
    print(json.dumps({"lora_probe": {"lr": lr, "verdict": results["verdict"], "timing": results["timing"]}}))


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    runner_arguments(parser, "lora-probe")
    parser.add_argument("--quick", action="store_true", help="8 steps, 2 lrs, seed 0: " + " ".join(QUICK))
    return parse_runner_arguments(parser, argv)


def prepare(opts, overrides: list[str]) -> Plan:
    """The plan of the command line, every run's configuration loaded and checked before any work."""
    dapo = next(r for r in ladder_rungs(ablation.RUNGS_DIR) if r.number == 6)
    every = [*rung_overrides(dapo), *COMMON, *(QUICK if opts.quick else []), *overrides]
    for arm in ("full", "rank1", "rank8"):
        cfg = effective_config(TASK_CONFIG, [*every, *arm_overrides(arm, SWEEP_LRS[0])], None)
    seeds = parse_numbers(opts.seeds or ("0" if opts.quick else "0,1,2,3,4"), "seeds")
    if SWEEP_SEED in seeds:
        raise LadderError(f"--seeds: seed {SWEEP_SEED} is the sweep's; the probe's pairs use other seeds")
    run_dir = os.path.abspath(
        opts.run_dir or os.path.join(ROOT, "runs", "lora-probe-quick" if opts.quick else "lora-probe")
    )
    return Plan(run_dir, seeds, QUICK_LRS if opts.quick else SWEEP_LRS, every, cfg.training.steps)


def main(argv=None) -> int:
    opts, overrides = parse_args(sys.argv[1:] if argv is None else argv)
    plan = prepare(opts, overrides)
    if opts.report:
        if not os.path.isdir(plan.run_dir):
            raise LadderError(
                f"--report: no probe runs in {plan.run_dir}; run them first, or name the folder with --run-dir"
            )
        write_report(plan, picked_lr(sweep_rows(plan)))
        return 0
    config = config_to_dict(effective_config(TASK_CONFIG, plan.overrides, None))
    del config["job"]
    check_ladder_file(
        plan.run_dir, {"task_config": "configs/ablation_cpu.toml", "config": config, "lrs": list(plan.lrs)}
    )
    # The full arm does not wait for the sweep: it runs beside it.
    title = f"LoRA probe in {plan.run_dir}: the lr sweep (rank 1, seed {SWEEP_SEED}, lr {', '.join(plan.lrs)}) and full"
    first = plan.sweep_jobs() + plan.arm_jobs(("full",))
    code = run_timed(first, plan.run_dir, title, workers=opts.jobs, threads=opts.threads)
    lr = picked_lr(sweep_rows(plan))
    if code or lr is None:
        return code or 1
    print(f"the sweep picks lr {lr} for rank 1 and rank 8", flush=True)
    title = f"LoRA probe in {plan.run_dir}: rank1 and rank8 at lr {lr} x seeds {plan.seeds}"
    code = run_timed(
        plan.arm_jobs(("rank1", "rank8"), lr), plan.run_dir, title, workers=opts.jobs, threads=opts.threads
    )
    write_report(plan, lr)
    return code


def run_cli(argv=None) -> None:
    ablation.run_cli(argv, main)


if __name__ == "__main__":
    run_cli()
