"""What each DAPO technique does, seen on a CPU: three probes, each a task built so that one mechanism must act,
with arms that differ only in that technique's switches, over several seeds.

    python bench/mechanisms.py                        # every probe, 5 seeds per arm, into runs/mechanisms/
    python bench/mechanisms.py --probe clip_bias      # one probe (comma-separated names for several)
    python bench/mechanisms.py --quick                # 1 seed, fewer steps, into runs/mechanisms-quick/
    python bench/mechanisms.py --report               # tables and figures of the runs done so far, nothing trained
    python bench/mechanisms.py [--seeds 0,1,2,3,4] [--jobs 2] [--run-dir DIR] [--section.key=value ...]

The probes (bench/RESULTS.md, "What each technique does: the probes", has each design and its prediction):

    clip_bias       the clip of Eq. 10 under a reward with no signal (tasks/coin.py): eps_low / eps_high 0.2 / 0.2,
                    0.2 / 0.28, 0.1 / 0.28; entropy and the shares clipped at the upper and lower bounds
    rare_strategy   clip-higher on a rare but better first move (tasks/fork.py): eps_high 0.2, 0.28, and no upper
                    clip (the dual clip kept); the rare strategy's probability and the up-clipped share at the fork
    length_budget   overlong filtering, the soft punishment and the token-level loss where the length cap binds
                    on valid reasoning (tasks/scan.py): naive, + overlong filtering, + soft punishment, + token-mean;
                    truncation, early answers, the short strategy's share, accuracy by answer position, lengths

A probe is its task config configs/probes/<probe>.toml and its arms configs/probes/<probe>/N_<arm>.toml, each
arm exactly the [algorithm] keys its file sets (read as bench/ablation.py reads the Table 1 rungs; the first arm
is the reference the others are compared with). Every probe writes each step's trained samples
(metrics.rollout_dump, trainer/rollout_dump.py); the mechanism metrics are computed from them and from
metrics.jsonl (bench/mechanism_metrics.py).

Per probe, one supervised warm-up run (<probe>/warm-up/, train.py with training.steps = 0, job.seed 0) makes the
base policy: every arm of every seed starts from a copy of its step-0 checkpoint (bench/ablation.py
start_from_warm_up), so the arms of a seed are paired and the seeds (job.seed) vary the rollout's sampling; the
prompts come in the same order in every run (the data position is part of the checkpoint). rare_strategy also
measures its warm-up before any arm runs (bench/rare_strategy_check.py: the rare strategy's share of free
samples, and each strategy's accuracy with its first token forced), in <probe>/warm-up-check/check.json.

Resumable, two runs at a time, progress per run, the settings of each probe saved on the first launch and a
rerun with other settings refused: all as bench/ablation.py, whose job runner this uses. `--report` (and the end
of every launch) writes per probe table.md, results.json and figures/ (bench/mechanisms_report.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench import ablation  # noqa: E402
from bench.ablation import (  # noqa: E402
    Job,
    LadderError,
    Rung,
    check_ladder_file,
    check_overrides,
    effective_config,
    ladder_rungs,
    parse_numbers,
    parse_runner_arguments,
    run_timed,
    rung_job,
    runner_arguments,
    saved_timing,
    train_command,
    warm_up_job,
)
from config import config_to_dict  # noqa: E402

PROBES_DIR = os.path.join(ROOT, "configs", "probes")
DEFAULT_SEEDS = "0,1,2,3,4"
WARM_UP_SEED = 0  # the one warm-up of a probe runs with this job.seed
CHECK = "warm-up-check"


@dataclasses.dataclass(frozen=True)
class Probe:
    """A probe: its name (folder names, --probe), the overrides --quick adds, and whether its warm-up is checked
    (bench/rare_strategy_check.py) before its arms start."""

    name: str
    quick: tuple[str, ...]
    checked: bool = False

    @property
    def config(self) -> str:
        return os.path.join(PROBES_DIR, f"{self.name}.toml")

    @property
    def arms_dir(self) -> str:
        return os.path.join(PROBES_DIR, self.name)


PROBES = {
    p.name: p
    for p in (
        Probe("clip_bias", ("training.steps=12",)),
        # A quarter of the warm-up (and a sixth for the scan task): within 5 minutes, a policy that has not
        # learned the task yet. --quick shows that a probe runs and what it writes, not its outcome.
        Probe("rare_strategy", ("training.steps=12", "eval.interval=6", "training.sft_warmup_steps=150"), checked=True),
        Probe("length_budget", ("training.steps=10", "training.sft_warmup_steps=100")),
    )
}


@dataclasses.dataclass
class CheckJob(Job):
    """bench/rare_strategy_check.py on a probe's warm-up: done once its check.json exists."""

    def done(self) -> bool:
        return os.path.isfile(os.path.join(self.path, "check.json"))

    @property
    def label(self) -> str:
        return f"{self.prefix}{CHECK}"


def check_job(probe: Probe, warm: Job, overrides: list[str]) -> CheckJob:
    script = os.path.join(ROOT, "bench", "rare_strategy_check.py")
    folder = os.path.join(os.path.dirname(warm.path), CHECK)
    command = [sys.executable, script, "--policy", warm.path, "--config", probe.config, "--out", folder]
    command += [f"--{o}" for o in overrides]
    return CheckJob(WARM_UP_SEED, None, folder, 0, command, prefix=warm.prefix, needs=(warm,))


def plan_probe(probe: Probe, run_dir: str, seeds: list[int], arms: list[Rung], overrides: list[str]) -> list[Job]:
    """The probe's warm-up (and its check), then its arms seed by seed, each from the warm-up's step 0."""
    folder = os.path.join(run_dir, probe.name)
    base = train_command(probe.config, overrides)
    cfg = effective_config(probe.config, overrides, None)
    evaluate = bool(cfg.data.eval_path)
    warm = warm_up_job(base, WARM_UP_SEED, folder, prefix=f"{probe.name} | ", evaluate=evaluate)
    first = [warm, check_job(probe, warm, overrides)] if probe.checked else [warm]
    needs = tuple(first[1:])
    runs = [
        dataclasses.replace(
            rung_job(base, seed, os.path.join(folder, f"seed-{seed}"), arm, cfg.training.steps, warm), needs=needs
        )
        for seed in seeds
        for arm in arms
    ]
    return first + runs


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    runner_arguments(parser, "mechanisms")
    parser.add_argument("--probe", default=None, help=f"comma-separated probe names (default: all of {list(PROBES)})")
    parser.add_argument("--quick", action="store_true", help="1 seed and fewer steps (each probe's own)")
    return parse_runner_arguments(parser, argv)


def prepare(opts, overrides: list[str]):
    """(run folder, seeds, {probe: (arms, its overrides)}, jobs), every input checked before any work."""
    names = [n.strip() for n in opts.probe.split(",") if n.strip()] if opts.probe else list(PROBES)
    unknown = [n for n in names if n not in PROBES]
    if unknown or not names:
        raise LadderError(f"--probe {opts.probe!r}: unknown probe {unknown}; the probes are {', '.join(PROBES)}")
    seeds = parse_numbers(opts.seeds or ("0" if opts.quick else DEFAULT_SEEDS), "seeds")
    run_dir = os.path.abspath(
        opts.run_dir or os.path.join(ROOT, "runs", "mechanisms-quick" if opts.quick else "mechanisms")
    )
    probes, warm_ups, runs = {}, [], []
    for name in names:
        probe = PROBES[name]
        arms = ladder_rungs(probe.arms_dir)
        own = [*(probe.quick if opts.quick else ()), *overrides]
        check_overrides(own, arms, what=f"a switch of the {name} probe's arms")
        for arm in [None, *arms]:
            effective_config(probe.config, own, arm)  # every arm's configuration loads and validates
        probes[name] = (arms, own)
        jobs = plan_probe(probe, run_dir, seeds, arms, own)
        first = 2 if probe.checked else 1
        warm_ups += jobs[:first]
        runs += jobs[first:]
    return run_dir, seeds, probes, warm_ups + runs  # every warm-up first: the runner starts them before any arm


def main(argv=None) -> int:
    from bench.mechanisms_report import write_probe_report

    opts, overrides = parse_args(sys.argv[1:] if argv is None else argv)
    run_dir, seeds, probes, jobs = prepare(opts, overrides)
    if opts.report and not os.path.isdir(run_dir):
        raise LadderError(f"--report: no probe runs in {run_dir}; run them first, or name the folder with --run-dir")
    configs = {}
    for name, (_, own) in probes.items():
        configs[name] = config_to_dict(effective_config(PROBES[name].config, own, None))
        del configs[name]["job"]
    if not opts.report:
        for name, config in configs.items():
            task_config = os.path.relpath(PROBES[name].config, ROOT)
            check_ladder_file(os.path.join(run_dir, name), {"task_config": task_config, "config": config})
        title = f"mechanism probes in {run_dir}: {', '.join(probes)} x {len(seeds)} seeds (seeds {seeds})"
        code = run_timed(jobs, run_dir, title, workers=opts.jobs, threads=opts.threads)
        if code:
            return code
    timing = saved_timing(run_dir)
    for name, (arms, _) in probes.items():
        write_probe_report(os.path.join(run_dir, name), name, seeds, arms, configs[name], timing)
    return 0


def run_cli(argv=None) -> None:
    ablation.run_cli(argv, main)


if __name__ == "__main__":
    run_cli()
