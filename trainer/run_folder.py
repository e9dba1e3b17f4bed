"""The run folder: one directory per run holding everything the run writes.

    <job.run_dir>/<job.name>/
        config.json        the resolved configuration (what --dry-run prints)
        metrics.jsonl      one JSON line of metrics per step
        tensorboard/       event files (metrics.tensorboard = true)
        checkpoints/       distributed checkpoints, step_<N>/ (the newest complete one is resumed)
        hf/                the final policy as an HF checkpoint (+ tokenizer)
        tokenizer/         the tokenizer the run trained (synthetic task without a tokenizer path)
        plots/panel.png    the monitoring panel drawn from metrics.jsonl
"""

from __future__ import annotations

import json
import os
import shutil


class RunFolderError(RuntimeError):
    """The run folder cannot be used; raised before any work starts."""


MIN_FREE_BYTES = 64 << 20


def prepare_run_folder(run_dir: str, name: str, config_dict: dict, *, is_main: bool = True,
                       min_free_bytes: int = MIN_FREE_BYTES) -> str:
    """Create the run folder, prove it is writable and has room, and snapshot the configuration."""
    path = os.path.abspath(os.path.join(run_dir, name))
    if not is_main:
        return path
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
