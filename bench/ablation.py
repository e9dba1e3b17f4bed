"""DAPO's Table 1 ablation on a CPU: naive GRPO -> + overlong filtering -> + clip-higher -> + soft overlong
punishment -> + token-level loss -> + dynamic sampling (= DAPO), over several seeds.

    python bench/ablation.py                    # 6 rungs x 5 seeds into runs/ablation/
    python bench/ablation.py --quick            # 1 seed, fewer steps, into runs/ablation-quick/ (CI does not run it)
    python bench/ablation.py --report           # table and figures of the runs done so far, nothing trained
    python bench/ablation.py [--seeds 0,1,2,3,4] [--rungs 1,2] [--jobs 2] [--run-dir DIR] [--section.key=value ...]

Every rung is `train.py` on the CPU task of configs/ablation_cpu.toml with exactly the [algorithm] keys its
configs/ablation/N_*.toml file sets (read through the config loader: those files are the one source of the
switches), and nothing else changed: the learning rate, batch, steps and evaluation are the task config's,
the same for every rung. Overrides on the command line change the task config for every rung alike; a
Table 1 switch cannot be overridden.

Per seed, one warm-up run (`seed-S/warm-up/`: train.py with training.steps = 0) evaluates the base policy and ends
with a checkpoint of step 0 (the task config's base, bases/chain, is itself a supervised warm-up's result; a task
config without one trains its warm-up there); each rung's run folder (`seed-S/<rung>/`) starts from a copy of that
checkpoint, so every rung of a seed starts from the same weights, optimizer state, data position and random state.
The held-out accuracy at step 0 is the warm-up run's (every rung would measure the same number).

Resumable: a run folder that holds finished.json is done and skipped; an unfinished one resumes from its
newest checkpoint (train.py's own resume); a killed ladder continues where it stopped when run again. The
ladder's settings (the task config with the overrides) are saved in ladder.json on the first launch and a
rerun with other settings is refused. Progress is printed per rung; each run's output is in its folder's
train.log. At the end: the table (held-out avg@k per rung, mean and spread over seeds, the paired gain over the
rung before with its 95% interval, the clipped share and entropy; bench/ablation_report.py) as table.md and
results.json, and the figures (bench/ablation_figures.py), in the ladder folder. The ladder's learning rate
comes from a sweep on naive GRPO alone (bench/ablation_sweep.py).

Runs execute `--jobs` at a time (default 2: one torch thread each, on a 2-core machine) in their own
process groups; they die with the ladder (PR_SET_PDEATHSIG on Linux), and a SIGTERM / SIGINT to the ladder
is passed on once to each (they checkpoint and stop), a second one again (they exit at once).
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import tomllib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from checkpoint.manager import CheckpointManager  # noqa: E402
from config import ConfigError, config_to_dict, load_config  # noqa: E402
from run.folder import finished_at  # noqa: E402

TASK_CONFIG = os.path.join(ROOT, "configs", "ablation_cpu.toml")
RUNGS_DIR = os.path.join(ROOT, "configs", "ablation")
WARM_UP = "warm-up"
LADDER_FILE = "ladder.json"
# --quick: one seed and a third of the DAPO steps (the same for every rung), in its own folder.
QUICK_OVERRIDES = ["training.steps=10", "eval.interval=5"]
DEFAULT_SEEDS = "0,1,2,3,4"  # five: enough for a 95% t-interval of each rung's paired gain
_RUNG_FILE = re.compile(r"(\d+)_[\w-]+\.toml\Z")


class LadderError(ValueError):
    """Bad input to the ladder: one line, exit code 2."""


# ---------------------------------------------------------------------------------------------- rungs


@dataclasses.dataclass(frozen=True)
class Rung:
    number: int
    name: str  # the file name without .toml: also the rung's run folder name
    path: str
    switches: dict  # {algorithm key: value} as the rung file sets them (after its base chain)


def ladder_rungs(folder: str = RUNGS_DIR) -> list[Rung]:
    """The rungs of Table 1 from `folder`/N_*.toml, in order: each with the [algorithm] keys its file sets
    itself, at the values the project's config loader resolves for that file."""
    rungs = []
    for path in glob.glob(os.path.join(folder, "*.toml")):
        match = _RUNG_FILE.match(os.path.basename(path))
        if not match:
            continue
        with open(path, "rb") as f:
            keys = list(tomllib.load(f).get("algorithm", {}))
        if not keys:
            raise LadderError(f"{path}: no [algorithm] keys: a rung file sets the switches of its Table 1 row")
        algorithm = load_config(path).algorithm
        switches = {key: getattr(algorithm, key) for key in keys}
        rungs.append(Rung(int(match.group(1)), os.path.basename(path)[:-5], path, switches))
    rungs.sort(key=lambda r: r.number)
    if not rungs:
        raise LadderError(f"no rung files N_<name>.toml in {folder}")
    return rungs


def _text(value) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def rung_overrides(rung: Rung) -> list[str]:
    """The rung's switches as `algorithm.key=value` overrides."""
    return [f"algorithm.{key}={_text(value)}" for key, value in rung.switches.items()]


def effective_config(task_config: str, overrides: list[str], rung: Rung | None):
    """The configuration a rung trains with: the task config, the ladder's overrides, the rung's switches."""
    return load_config(task_config, [*overrides, *(rung_overrides(rung) if rung else [])])


def check_overrides(overrides: list[str], rungs: list[Rung], what: str = "a Table 1 switch") -> None:
    """Refuse an override of a rung's switch (each rung is exactly its file's switches; `what` names them) or of
    what the ladder sets per run (job.*, model.tokenizer_path)."""
    switched = {f"algorithm.{key}" for rung in rungs for key in rung.switches}
    for item in overrides:
        key = item.partition("=")[0]
        if key in switched:
            where = os.path.dirname(rungs[0].path)
            raise LadderError(f"--{item}: {key} is {what}; each run takes it from its file in {where}")
        if key.startswith("job.") or key == "model.tokenizer_path":
            raise LadderError(f"--{item}: the ladder sets {key} itself (use --run-dir and --seeds)")


# ---------------------------------------------------------------------------------------------- runs


@dataclasses.dataclass
class Job:
    """One train.py run of the ladder: a seed's warm-up (rung None) or one rung of a seed."""

    seed: int
    rung: Rung | None
    path: str  # its run folder
    steps: int  # training.steps it finishes at
    command: list[str]
    warm_up: Job | None = None  # the warm-up a rung starts from
    prefix: str = ""  # what the label starts with (bench/mechanisms.py: the probe's name)
    needs: tuple[Job, ...] = ()  # other runs that must be done before this one starts

    @property
    def label(self) -> str:
        return f"{self.prefix}seed {self.seed} | {self.rung.name if self.rung else WARM_UP}"

    def done(self) -> bool:
        step = finished_at(self.path)
        return step is not None and step >= self.steps

    def ready(self) -> bool:
        """Whether the warm-up it starts from and the runs it waits for are done."""
        return all(job.done() for job in (self.warm_up, *self.needs) if job is not None)


def train_command(task_config: str, overrides: list[str]) -> list[str]:
    """train.py on the task config with the overrides: what every run of a ladder starts from."""
    return [sys.executable, os.path.join(ROOT, "train.py"), "--config", task_config, *[f"--{o}" for o in overrides]]


def warm_up_job(base: list[str], seed: int, folder: str, prefix: str = "", evaluate: bool = True) -> Job:
    """The supervised warm-up run in `folder`/warm-up: train.py with training.steps = 0, its step-0 evaluation
    (unless not `evaluate`: a task without a held-out set), its step-0 checkpoint (every rung that starts from it
    gets a copy) and its HF export."""
    common = [f"--job.run_dir={folder}", f"--job.seed={seed}", "--metrics.progress=false"]
    command = [
        *base,
        *common,
        f"--job.name={WARM_UP}",
        "--training.steps=0",
        f"--eval.at_start={str(evaluate).lower()}",
    ]
    command += ["--eval.at_end=false", "--checkpoint.export_hf=true"]
    return Job(seed, None, os.path.join(folder, WARM_UP), 0, command, prefix=prefix)


def rung_job(
    base: list[str], seed: int, folder: str, rung: Rung, steps: int, warm: Job, warm_tokenizer: bool = True
) -> Job:
    """One rung of one seed in `folder`/<rung>: the task config plus the rung's switches, from `warm`'s step 0
    (with the tokenizer the warm-up trained, unless `warm_tokenizer` is off: a base policy brings its own)."""
    command = [*base, *[f"--{o}" for o in rung_overrides(rung)], f"--job.run_dir={folder}"]
    command += [f"--job.seed={seed}", f"--job.name={rung.name}", "--metrics.progress=false"]
    if warm_tokenizer:
        command += [f"--model.tokenizer_path={os.path.join(warm.path, 'tokenizer')}"]
    command += ["--eval.at_start=false"]
    return Job(seed, rung, os.path.join(folder, rung.name), steps, command, warm, prefix=warm.prefix)


def plan_jobs(run_dir: str, seeds: list[int], rungs: list[Rung], task_config: str, overrides: list[str]) -> list[Job]:
    """Every seed's warm-up, then every seed's rungs (seed by seed: an interrupted ladder has whole seeds)."""
    start = effective_config(task_config, overrides, None)
    steps = start.training.steps
    base = train_command(task_config, overrides)
    warm_ups = {seed: warm_up_job(base, seed, os.path.join(run_dir, f"seed-{seed}")) for seed in seeds}
    own_tokenizer = not start.model.hf_path  # a base policy brings its tokenizer; a warm-up run trains one
    jobs = [
        rung_job(base, seed, os.path.join(run_dir, f"seed-{seed}"), rung, steps, warm_ups[seed], own_tokenizer)
        for seed in seeds
        for rung in rungs
    ]
    return list(warm_ups.values()) + jobs


def start_from_warm_up(job: Job) -> None:
    """Give a rung's run folder the warm-up's step-0 checkpoint, unless it holds a checkpoint already (a rung
    that was started resumes from its own). Copied under a .tmp name, then renamed: never half a checkpoint."""
    own = CheckpointManager(os.path.join(job.path, "checkpoints"))
    if own.complete_steps():
        return
    source = CheckpointManager(os.path.join(job.warm_up.path, "checkpoints")).step_path(0)
    if not os.path.isdir(source):
        raise RuntimeError(f"the warm-up run {job.warm_up.path} finished without its step-0 checkpoint")
    target = own.step_path(0)
    shutil.rmtree(target + ".tmp", ignore_errors=True)
    os.makedirs(own.folder, exist_ok=True)
    shutil.copytree(source, target + ".tmp")
    os.replace(target + ".tmp", target)


def check_ladder_file(run_dir: str, settings: dict) -> None:
    """Save the ladder's settings on its first launch; refuse a rerun whose settings differ."""
    path = os.path.join(run_dir, LADDER_FILE)
    if not os.path.isfile(path):
        os.makedirs(run_dir, exist_ok=True)
        with open(path, "w") as f:
            json.dump(settings, f, indent=2)
        return
    with open(path) as f:
        saved = json.load(f)
    flat = lambda d: {f"{s}.{k}": v for s, t in d.items() for k, v in t.items()}  # noqa: E731
    before, now = flat(saved["config"]), flat(settings["config"])
    changed = sorted(k for k in before.keys() | now.keys() if before.get(k) != now.get(k))
    if changed:
        detail = ", ".join(f"{k}: {before.get(k)!r} -> {now.get(k)!r}" for k in changed[:4])
        raise LadderError(
            f"{run_dir} holds a ladder run with other settings ({detail}); every rung must share them: "
            f"rerun with the settings of {path}, or choose another --run-dir"
        )


# ---------------------------------------------------------------------------------------------- processes


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL when the ladder dies (a killed ladder leaves no run behind)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:  # not Linux: a killed ladder's runs finish on their own
        pass


@dataclasses.dataclass
class Running:
    job: Job
    process: subprocess.Popen
    started: float
    log_file: object
    metrics_seen: int = 0
    last_print: float = 0.0


def launch(job: Job, threads: int) -> Running:
    if job.warm_up is not None:
        start_from_warm_up(job)
    os.makedirs(job.path, exist_ok=True)
    log_file = open(os.path.join(job.path, "train.log"), "a")
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false")
    process = subprocess.Popen(
        [*job.command, f"--job.cpu_threads={threads}"],
        cwd=ROOT,
        stdout=log_file,
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,  # a terminal's Ctrl-C reaches the ladder only; it passes it on once
        preexec_fn=_die_with_parent,
    )
    log_file.write(f"ladder: launched pid {process.pid}\n")
    log_file.flush()
    return Running(job, process, time.perf_counter(), log_file)


def reap(running: Running) -> tuple[int, float] | None:
    """(exit code, CPU seconds of the run) once it ended, else None."""
    pid, status, usage = os.wait4(running.process.pid, os.WNOHANG)
    if pid == 0:
        return None
    running.process.returncode = os.waitstatus_to_exitcode(status)
    return running.process.returncode, usage.ru_utime + usage.ru_stime


def _format_row(row: dict, steps: int) -> str:
    parts = [f"step {row['step']}/{steps}"]
    if "acc/mean" in row:
        parts.append(f"acc {row['acc/mean']:.3f}")
        parts.append(f"len {row['response_length/mean']:.1f}")
        parts.append(f"trunc {row['response_length/clip_ratio']:.3f}")
        if row.get("entropy") is not None:
            parts.append(f"entropy {row['entropy']:.3f}")
        parts.append(f"{row['time/step']:.1f}s")
    if "eval/avg_at_k" in row:
        parts.append(f"held-out {100 * row['eval/avg_at_k']:.1f}%")
    return " | ".join(parts)


def report_progress(running: Running, every_s: float) -> None:
    """Print the run's new metrics lines: every held-out evaluation, else at most one line per `every_s`."""
    path = os.path.join(running.job.path, "metrics.jsonl")
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except OSError:
        return
    rows = []
    for line in lines[running.metrics_seen :]:
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            break  # a line being written: read it next time
    running.metrics_seen += len(rows)
    now = time.perf_counter()
    for row in rows:
        if "eval/avg_at_k" in row or now - running.last_print >= every_s:
            print(f"{running.job.label} | {_format_row(row, running.job.steps)}", flush=True)
            running.last_print = now


def _tail(path: str, lines: int = 15) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return ""


class Timing:
    """timing.json of the ladder folder: each launch of the ladder (wall time, load average seen) and each
    run's launches (wall and CPU seconds, exit code), accumulated over resumes."""

    def __init__(self, run_dir: str):
        self.path = os.path.join(run_dir, "timing.json")
        try:
            with open(self.path) as f:
                self.data = json.load(f)
        except (OSError, ValueError):
            self.data = {"ladder": [], "runs": {}}
        self.start, self.loads = time.perf_counter(), []
        self.data["ladder"].append({"started": time.strftime("%Y-%m-%d %H:%M:%S"), "wall_s": 0.0})

    def sample_load(self) -> None:
        self.loads.append(os.getloadavg()[0])

    def run_ended(self, job: Job, wall: float, cpu: float, code: int) -> None:
        key = os.path.relpath(job.path, os.path.dirname(self.path))
        self.data["runs"].setdefault(key, []).append({"wall_s": round(wall, 1), "cpu_s": round(cpu, 1), "exit": code})
        self.save()

    def save(self) -> None:
        launch = self.data["ladder"][-1]
        launch["wall_s"] = round(time.perf_counter() - self.start, 1)
        if self.loads:
            launch["load_mean"] = round(sum(self.loads) / len(self.loads), 2)
            launch["load_max"] = round(max(self.loads), 2)
        with open(self.path + ".tmp", "w") as f:
            json.dump(self.data, f, indent=2)
        os.replace(self.path + ".tmp", self.path)

    def totals(self) -> dict:
        return timing_totals(self.data)


def timing_totals(data: dict) -> dict:
    """Of timing.json's data: the wall time of every ladder launch and the CPU time of every run, summed; the
    mean load average seen while the ladder ran (mean over its launches)."""
    runs = [launch for launches in data["runs"].values() for launch in launches]
    loads = [launch["load_mean"] for launch in data["ladder"] if "load_mean" in launch]
    return {
        "ladder_wall_s": round(sum(launch["wall_s"] for launch in data["ladder"]), 1),
        "runs_cpu_s": round(sum(r["cpu_s"] for r in runs), 1),
        "load_mean": round(sum(loads) / len(loads), 2) if loads else None,
        "ladder_launches": len(data["ladder"]),
    }


def run_jobs(jobs: list[Job], *, workers: int, threads: int, timing: Timing, every_s: float = 20.0) -> int:
    """Run the unfinished jobs, `workers` at a time, each after its warm-up. Returns 0 when all finished, 1
    after a failed run (the others running are let finish, no new one starts), 128 + signal after a stop."""
    pending = [job for job in jobs if not job.done()]
    running: list[Running] = []
    signals: list[int] = []

    def on_signal(signum, frame):
        signals.append(signum)
        print(f"ladder: {signal.Signals(signum).name}: passed on to the running runs", file=sys.stderr, flush=True)
        for r in running:
            with_suppressed = r.process.returncode is None
            if with_suppressed:
                os.kill(r.process.pid, signum)

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    failed = []
    try:
        while True:
            startable = [j for j in pending if j.ready()]
            while not signals and not failed and startable and len(running) < workers:
                job = startable.pop(0)
                pending.remove(job)
                print(f"{job.label} | started ({job.path})", flush=True)
                running.append(launch(job, threads))
            timing.sample_load()
            for r in list(running):
                report_progress(r, every_s)
                ended = reap(r)
                if ended is None:
                    continue
                code, cpu = ended
                wall = time.perf_counter() - r.started
                report_progress(r, every_s)  # what it wrote after the last look
                r.log_file.close()
                running.remove(r)
                timing.run_ended(r.job, wall, cpu, code)
                if code == 0 and r.job.done():
                    print(f"{r.job.label} | finished in {wall:.0f} s ({cpu:.0f} CPU s)", flush=True)
                    continue
                failed.append(r.job)
                log = os.path.join(r.job.path, "train.log")
                print(f"{r.job.label} | FAILED (exit {code}); the end of {log}:\n{_tail(log)}", file=sys.stderr)
            if not running and (signals or failed or not pending or not startable):
                break
            time.sleep(1.0)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        timing.save()
    if signals:
        return 128 + signals[0]
    return 1 if failed or pending else 0


# ---------------------------------------------------------------------------------------------- command


def runner_arguments(parser: argparse.ArgumentParser, name: str) -> None:
    """The options every ladder of runs takes (this one, bench/mechanisms.py): where, which seeds, how many at
    once, and --report."""
    parser.add_argument("--run-dir", default=None, help=f"default runs/{name} (--quick: runs/{name}-quick)")
    parser.add_argument("--seeds", default=None, help="comma-separated job.seed values (default 0,1,2,3,4; --quick: 0)")
    parser.add_argument("--jobs", type=int, default=2, help="runs at once (default 2)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of each run (default 1)")
    parser.add_argument("--report", action="store_true", help="only write the tables and figures of finished runs")


def parse_runner_arguments(parser: argparse.ArgumentParser, argv) -> tuple[argparse.Namespace, list[str]]:
    """(options, the --section.key=value overrides), checked."""
    from config import split_overrides

    opts, rest = parser.parse_known_args(argv)
    plain, overrides = split_overrides(rest)
    if plain:
        raise LadderError(f"unknown arguments {' '.join(plain)} (overrides are written --section.key=value)")
    if opts.jobs < 1 or opts.threads < 1:
        raise LadderError("--jobs and --threads must be >= 1")
    return opts, overrides


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    runner_arguments(parser, "ablation")
    parser.add_argument("--rungs", default=None, help="comma-separated rung numbers (default: every rung file)")
    parser.add_argument("--quick", action="store_true", help="1 seed and fewer steps: " + " ".join(QUICK_OVERRIDES))
    parser.add_argument("--config", default=TASK_CONFIG, help="the task config every rung starts from")
    parser.add_argument("--rungs-dir", default=RUNGS_DIR, help="where the rung files N_<name>.toml are")
    opts, overrides = parse_runner_arguments(parser, argv)
    return opts, (QUICK_OVERRIDES if opts.quick else []) + overrides


def parse_numbers(text: str, what: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise LadderError(f"--{what} {text!r}: expected comma-separated integers") from None
    if not values or len(set(values)) != len(values) or min(values) < 0:
        raise LadderError(f"--{what} {text!r}: expected distinct integers >= 0")
    return values


def prepare(opts, overrides: list[str]):
    """(run folder, seeds, rungs, jobs) of the command line, every input checked before any work."""
    if not os.path.isfile(opts.config):
        raise LadderError(f"task config not found: {opts.config}")
    rungs = ladder_rungs(opts.rungs_dir)
    if opts.rungs:
        wanted = parse_numbers(opts.rungs, "rungs")
        unknown = sorted(set(wanted) - {r.number for r in rungs})
        if unknown:
            raise LadderError(f"--rungs: no rung file numbered {unknown} in {opts.rungs_dir}")
        rungs = [r for r in rungs if r.number in wanted]
    seeds = parse_numbers(opts.seeds or ("0" if opts.quick else DEFAULT_SEEDS), "seeds")
    check_overrides(overrides, rungs)
    for rung in [None, *rungs]:
        effective_config(opts.config, overrides, rung)  # every rung's configuration loads and validates
    default = os.path.join(ROOT, "runs", "ablation-quick" if opts.quick else "ablation")
    run_dir = os.path.abspath(opts.run_dir or default)
    jobs = plan_jobs(run_dir, seeds, rungs, os.path.abspath(opts.config), overrides)
    return run_dir, seeds, rungs, jobs


def main(argv=None) -> int:
    from bench.ablation_report import write_report

    opts, overrides = parse_args(sys.argv[1:] if argv is None else argv)
    run_dir, seeds, rungs, jobs = prepare(opts, overrides)
    if opts.report and not os.path.isdir(run_dir):
        raise LadderError(f"--report: no ladder in {run_dir}; run it first, or name its folder with --run-dir")
    base = config_to_dict(effective_config(opts.config, overrides, None))
    del base["job"]
    if not opts.report:
        check_ladder_file(run_dir, {"task_config": os.path.relpath(opts.config, ROOT), "config": base})
        title = f"ablation ladder in {run_dir}: {len(rungs)} rungs x {len(seeds)} seeds (seeds {seeds})"
        code = run_timed(jobs, run_dir, title, workers=opts.jobs, threads=opts.threads)
        if code:
            return code
    write_report(run_dir, seeds, rungs, base, saved_timing(run_dir))
    return 0


def run_timed(jobs: list[Job], run_dir: str, title: str, *, workers: int, threads: int) -> int:
    """`run_jobs` with what it has to do and what it cost printed, and its times kept in run_dir/timing.json.
    Returns run_jobs' exit code (0: every job done)."""
    timing = Timing(run_dir)
    todo = [job for job in jobs if not job.done()]
    print(f"{title}, {len(todo)} of {len(jobs)} runs to do, {workers} at a time", flush=True)
    code = run_jobs(jobs, workers=workers, threads=threads, timing=timing)
    totals = timing.totals()
    print(
        f"wall time {totals['ladder_wall_s']:.0f} s over all launches; the runs used {totals['runs_cpu_s']:.0f} "
        f"CPU s; mean load average {totals['load_mean']}",
        flush=True,
    )
    if code:
        print("stopped: run the same command again to continue where it stopped", file=sys.stderr)
    return code


def saved_timing(run_dir: str) -> dict | None:
    """The totals of run_dir/timing.json (None without one)."""
    try:
        with open(os.path.join(run_dir, "timing.json")) as f:
            return timing_totals(json.load(f))
    except (OSError, ValueError, KeyError):
        return None


def run_cli(argv=None, main=main) -> None:
    """`main(argv)` as a command: bad input is one line on stderr and exit code 2."""
    try:
        sys.exit(main(argv))
    except (LadderError, ConfigError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    run_cli()
