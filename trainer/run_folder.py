"""The run folder: one directory per run holding everything the run writes.

    <job.run_dir>/<job.name>/
        config.json        the resolved configuration (what --dry-run prints)
        metrics.jsonl      one JSON line of metrics per step
        tensorboard/       event files (metrics.tensorboard = true)
        checkpoints/       distributed checkpoints, step-<N>/ (the newest complete one is resumed)
        hf/                the final policy as an HF checkpoint (+ tokenizer)
        tokenizer/         the tokenizer the run trained (synthetic task without a tokenizer path)
        plots/panel.png    the monitoring panel drawn from metrics.jsonl
"""

from __future__ import annotations

import json
import os
import re
import shutil


class RunFolderError(RuntimeError):
    """The run folder cannot be used; raised before any work starts."""


MIN_FREE_BYTES = 64 << 20


def prepare_run_folder(run_dir: str, name: str, config_dict: dict, *, is_main: bool = True,
                       min_free_bytes: int = MIN_FREE_BYTES, resume: bool = True) -> str:
    """Create the run folder, prove it is writable and has room, and snapshot the configuration.

    resume=False (checkpoint.resume = false) refuses a folder that already holds checkpoints: a fresh run
    there would have its own checkpoints shadowed and pruned by the earlier run's higher steps.
    """
    path = os.path.abspath(os.path.join(run_dir, name))
    if not is_main:
        return path
    checkpoints = os.path.join(path, "checkpoints")
    if not resume and os.path.isdir(checkpoints):
        earlier = sorted(n for n in os.listdir(checkpoints) if re.fullmatch(r"step-\d+", n))
        if earlier:
            raise RunFolderError(f"run folder {path} already holds checkpoints of an earlier run ({', '.join(earlier)}) "
                                 f"and checkpoint.resume = false; set checkpoint.resume = true to continue that run, "
                                 f"or choose another job.name or job.run_dir")
    try:
        os.makedirs(path, exist_ok=True)
        probe = os.path.join(path, ".write_probe")
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as exc:
        raise RunFolderError(f"run folder {path} is not writable: {exc.strerror or exc}") from exc
    free = shutil.disk_usage(path).free
    if free < min_free_bytes:
        raise RunFolderError(f"run folder {path} has only {free >> 20} MiB free; at least "
                             f"{min_free_bytes >> 20} MiB are needed for metrics and checkpoints")
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config_dict, f, indent=2)
    return path
