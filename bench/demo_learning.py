"""Does the CPU demo learn? Runs `train.py --config configs/demo_cpu.toml` and reports held-out accuracy
before and after DAPO and the wall time, as a table and one JSON line.

    python bench/demo_learning.py [--run-dir DIR] [extra --section.key=value overrides...]

The demo's promise (README): within 6 minutes on a 2-core CPU (the idle AVX-512 machine of bench/RESULTS.md
takes under 3; a CPU twice as slow must fit too), held-out accuracy improves by at least 15 points (absolute)
from the supervised warm-up's level (17-19 points measured with the AVX-512 and AVX2 code paths). The baseline
is the same run's accuracy before DAPO.
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
PATTERN = re.compile(r"held-out accuracy (before|after) DAPO: ([0-9.]+)%")


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    run_dir = tempfile.mkdtemp(prefix="demo_learning_")
    if "--run-dir" in argv:
        i = argv.index("--run-dir")
        run_dir = argv[i + 1]
        del argv[i : i + 2]
    command = [sys.executable, "train.py", "--config", "configs/demo_cpu.toml", f"--job.run_dir={run_dir}", *argv]
    start = time.perf_counter()
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - start
    found = dict((m.group(1), float(m.group(2))) for m in PATTERN.finditer(result.stdout + result.stderr))
    if result.returncode != 0 or set(found) != {"before", "after"}:
        sys.stderr.write(result.stdout[-4000:] + result.stderr[-4000:])
        print(f"demo run failed (exit {result.returncode})", file=sys.stderr)
        return 1
    gain = found["after"] - found["before"]
    print(f"{'held-out before DAPO':>22} {'after DAPO':>12} {'gain (points)':>14} {'wall time':>11}")
    print(f"{found['before']:>21.1f}% {found['after']:>11.1f}% {gain:>14.1f} {wall:>10.1f}s")
    print(
        json.dumps(
            {
                "bench": "demo_learning",
                "before": found["before"],
                "after": found["after"],
                "gain_points": round(gain, 1),
                "wall_s": round(wall, 1),
                "run_dir": run_dir,
                "meets_target": gain >= 15.0 and wall <= 360,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
