"""Does the CPU demo learn, and where does its time go? Runs the README's main command (`train.py --config
configs/demo_cpu.toml`) into a fresh folder and reports held-out accuracy before and after DAPO, the wall time,
and the time of each phase, as a table and one JSON line.

    python bench/demo_learning.py [--run-dir DIR] [extra --section.key=value overrides...]

The demo's promise (README): at most 240 s on a 2-core CPU of the slowest kind measured, and held-out accuracy
up by at least 15 points (absolute) on both CPU code paths (`ATEN_CPU_CAPABILITY=avx2` / `avx512`: they sum
floats in other orders and sample other responses). The baseline is the same run's accuracy before DAPO.

Phases, from the time each line of the run's output arrived and from its metrics.jsonl:
    start       the interpreter, imports, data, model and engine, up to the first phase below
    warm-up     the supervised warm-up (none when the run starts from a base policy)
    eval        every held-out evaluation: before DAPO, every eval.interval steps, after DAPO
    generate    the DAPO steps' rollouts (time/generate), scoring (time/score) included
    train       the DAPO steps' updates (time/train) and weight syncs (time/sync)
    other       the rest of the DAPO loop: metrics rows, interval checkpoints, progress lines
    finish      the last checkpoint, the HF export and the plot, until the process exits
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ACCURACY = re.compile(r"held-out accuracy (before|after) DAPO: ([0-9.]+)%")
WARM_UP = re.compile(r"supervised warm-up: \d+ steps in ([0-9.]+)s")


def run_timed(command: list[str]) -> tuple[int, list[tuple[float, str]], float]:
    """(exit code, each output line with the seconds since the start at which it arrived, wall time)."""
    start = time.perf_counter()
    proc = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    lines = [(time.perf_counter() - start, line.rstrip("\n")) for line in proc.stdout]
    code = proc.wait()
    return code, lines, time.perf_counter() - start


def phases(lines: list[tuple[float, str]], rows: list[dict], wall: float) -> dict[str, float]:
    """Seconds per phase (module docstring). The evaluation before DAPO is not timed by the run; it is taken
    as long as the one after DAPO (the same problems, samples and response budget)."""

    def arrived(prefix: str) -> float:
        return next(t for t, line in lines if line.startswith(prefix))

    warm_up = sum(float(m.group(1)) for _, line in lines if (m := WARM_UP.search(line)))
    last_step = max(t for t, line in lines if re.match(r"step \d+ \|", line))
    after = arrived("held-out accuracy after DAPO")
    final_eval = after - last_step
    start = arrived("held-out accuracy before DAPO") - warm_up - final_eval
    total = {key: sum(row.get(f"time/{key}") or 0.0 for row in rows) for key in ("generate", "score", "train", "sync")}
    generate, train = total["generate"] + total["score"], total["train"] + total["sync"]
    evals = 2 * final_eval + sum(row.get("time/eval") or 0.0 for row in rows)
    return {
        "start": start,
        "warm-up": warm_up,
        "eval": evals,
        "generate": generate,
        "train": train,
        "other": wall - (start + warm_up + evals + generate + train) - (wall - after),
        "finish": wall - after,
    }


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    run_dir = tempfile.mkdtemp(prefix="demo_learning_")
    if "--run-dir" in argv:
        i = argv.index("--run-dir")
        run_dir = argv[i + 1]
        del argv[i : i + 2]
    command = [sys.executable, "train.py", "--config", "configs/demo_cpu.toml", f"--job.run_dir={run_dir}", *argv]
    code, lines, wall = run_timed(command)
    text = "\n".join(line for _, line in lines)
    found = dict((m.group(1), float(m.group(2))) for m in ACCURACY.finditer(text))
    if code != 0 or set(found) != {"before", "after"}:
        sys.stderr.write(text[-8000:] + "\n")
        print(f"demo run failed (exit {code})", file=sys.stderr)
        return 1
    with open(os.path.join(run_dir, "demo-cpu", "metrics.jsonl")) as f:
        rows = [row for row in map(json.loads, f) if row["step"] > 0]
    split = phases(lines, rows, wall)
    gain = found["after"] - found["before"]
    print(f"{'held-out before DAPO':>22} {'after DAPO':>12} {'gain (points)':>14} {'wall time':>11}")
    print(f"{found['before']:>21.1f}% {found['after']:>11.1f}% {gain:>14.1f} {wall:>10.1f}s")
    print("  ".join(f"{name} {seconds:.1f}s" for name, seconds in split.items()))
    split = {name: round(seconds, 1) for name, seconds in split.items()}
    result = {
        "bench": "demo_learning",
        "before": found["before"],
        "after": found["after"],
        "gain_points": round(gain, 1),
        "wall_s": round(wall, 1),
        "phases_s": split,
        "cpu_capability": os.environ.get("ATEN_CPU_CAPABILITY", "default for this CPU"),
        "run_dir": run_dir,
        "meets_target": gain >= 15.0 and wall <= 240,
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
