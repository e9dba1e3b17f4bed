"""The run folder: one directory per run holding everything the run writes.

    <job.run_dir>/<job.name>/
        config.json        the resolved configuration of the first launch (what --dry-run prints);
                           config.launch-<n>.json for a later launch whose configuration differs; each written
                           once its launch is accepted (`accept_launch`): a refused launch writes neither, and
                           removes the folder when it created it
        finished.json      written when the run completed (final eval, export): rerunning prints the
                           held-out result and does nothing else
        metrics.jsonl      one JSON line of metrics per step
        tensorboard/       event files (metrics.tensorboard = true)
        checkpoints/       distributed checkpoints, step-<N>/ (the newest complete one is resumed)
        checkpoints/warm-up/  checkpoints of the supervised warm-up, removed once step-00000000/ holds its end
        hf/                the final policy as an HF checkpoint (+ tokenizer)
        tokenizer/         the tokenizer the run trained (synthetic task without a tokenizer path)
        eval/step_<N>.json one report per held-out evaluation
        .lock              held by the run's main process while it runs: a second run on the folder is refused
                           (run/lock.py)

Rerunning the same command resumes an unfinished run; `--fresh` moves the folder aside to
`<name>.old-<n>` (never deleted) and starts over.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import re
import shutil

from checkpoint.manager import CheckpointManager
from checkpoint.safe_dcp import flatten
from errors import RunFolderError, write_atomically
from evaluation.report import read_report
from run.lock import FolderBusyError, FolderLock

log = logging.getLogger("train")

WARMUP_CHECKPOINTS = os.path.join("checkpoints", "warm-up")


MIN_FREE_BYTES = 64 << 20


def prepare_run_folder(
    run_dir: str,
    name: str,
    config_dict: dict,
    *,
    is_main: bool = True,
    min_free_bytes: int = MIN_FREE_BYTES,
    resume: bool = True,
    fresh: bool = False,
    lock: FolderLock | None = None,
) -> str:
    """Create the run folder, prove it is writable and has room, and check the configuration snapshot of an
    earlier launch is readable (this launch's is written by `accept_launch`).

    lock: the run's lock on the folder (run/lock.py), taken before anything else: a folder another
    live run holds is refused (RunFolderError naming the holder), also with --fresh.

    fresh=True (train.py --fresh) first moves an existing folder aside to `<name>.old-<n>`, saying where.
    resume=False (checkpoint.resume = false) refuses a folder that already holds checkpoints: a fresh run
    there would have its own checkpoints shadowed and pruned by the earlier run's higher steps.
    """
    path = run_folder_path(run_dir, name)
    if not is_main:
        return path
    made = _first_missing(path)  # the folder, or the highest of its parents, that this launch creates
    if made is not None:
        _made_for_a_launch[path] = made
    _lock(lock, path)  # first: a folder another run holds is neither moved aside nor used
    if fresh and made is None:
        _move_aside(path)
        _made_for_a_launch[path] = path
    earlier = earlier_checkpoints(path)
    if not resume and earlier:
        raise RunFolderError(
            f"run folder {path} already holds checkpoints of an earlier run ({', '.join(earlier)}) "
            f"and checkpoint.resume = false; add --fresh to start over (the folder is moved "
            f"aside), set checkpoint.resume = true to continue that run, or choose another "
            f"job.name or job.run_dir"
        )
    _make_writable_folder(path)
    _lock(lock, path)  # the new folder, when --fresh moved the earlier one (and its lock file) aside
    _check_room(path, min_free_bytes)
    _changed_config(path, config_dict)  # a damaged snapshot is refused now; the snapshot is written on `accept_launch`
    return path


# Run folders this process created for a launch that is not accepted yet (`accept_launch`): what a refused launch
# leaves of them is removed (`discard_refused_launch`), never a folder an earlier launch made.
_made_for_a_launch: dict[str, str] = {}  # run folder -> the highest folder its launch created (itself or a parent)


def accept_launch(path: str, config_dict: dict) -> None:
    """The launch is accepted (its inputs loaded, its checkpoint resumed): its configuration snapshot is written
    (config.json, or config.launch-<n>.json when a resume's differs), and the folder is the run's to keep."""
    _made_for_a_launch.pop(path, None)
    _snapshot_config(path, config_dict)


def discard_refused_launch(path: str) -> None:
    """A launch refused before `accept_launch` (bad input: a NaN checkpoint, an unusable data row): the run folder
    it created, with all this launch wrote in it, is removed, and so are the parents it created while they are
    empty; call while holding its lock. A folder that existed before the launch is left as it was."""
    made = _made_for_a_launch.pop(path, None)
    if made is None:
        return
    shutil.rmtree(path, ignore_errors=True)
    while path != made and os.path.dirname(path) != path:
        path = os.path.dirname(path)
        try:
            os.rmdir(path)  # only while empty: another run may have made its folder there meanwhile
        except OSError:
            return


def _first_missing(path: str) -> str | None:
    """The highest folder of `path` (itself or a parent) that does not exist; None when `path` exists."""
    missing = None
    while not os.path.lexists(path) and os.path.dirname(path) != path:
        missing, path = path, os.path.dirname(path)
    return missing


def _move_aside(path: str) -> None:
    """Rename the earlier run folder to the first free `<path>.old-<n>` (never deleted), saying where."""
    n = 1
    while os.path.lexists(f"{path}.old-{n}"):
        n += 1
    try:
        os.replace(path, f"{path}.old-{n}")
    except OSError as exc:
        raise RunFolderError(
            f"--fresh: cannot move the earlier run folder {path} aside: {exc.strerror or exc}"
        ) from exc
    log.warning("--fresh: moved the earlier run folder to %s.old-%d (delete it when no longer needed)", path, n)


def _make_writable_folder(path: str) -> None:
    """Create the folder if needed and prove it is writable by writing and removing a probe file."""
    try:
        os.makedirs(path, exist_ok=True)
        probe = os.path.join(path, ".write_probe")
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as exc:
        raise RunFolderError(f"run folder {path} is not writable: {exc.strerror or exc}") from exc


def _check_room(path: str, min_free_bytes: int) -> None:
    """Refuse a folder on a disk with less than `min_free_bytes` free."""
    free = shutil.disk_usage(path).free
    if free < min_free_bytes:
        raise RunFolderError(
            f"run folder {path} has only {free >> 20} MiB free; at least "
            f"{min_free_bytes >> 20} MiB are needed for metrics and checkpoints"
        )


def run_folder_path(run_dir: str, name: str) -> str:
    """The absolute path of run `name`'s folder under `run_dir`."""
    return os.path.abspath(os.path.join(run_dir, name))


def _lock(lock: FolderLock | None, path: str) -> None:
    if lock is None:
        return
    try:
        lock.acquire()
    except FolderBusyError as exc:
        raise RunFolderError(str(exc)) from None
    except OSError as exc:
        raise RunFolderError(f"run folder {path} is not writable: {exc.strerror or exc}") from exc


def _changed_config(path: str, config_dict: dict) -> dict[str, tuple] | None:
    """The settings `config_dict` changes from the folder's first launch's config.json, key: (first value, this
    launch's), in key order; None when there was none. A damaged config.json is refused."""
    first = os.path.join(path, "config.json")
    if not os.path.isfile(first):
        return None
    try:
        with open(first, encoding="utf-8") as f:
            previous = flatten(json.load(f))
    except (OSError, ValueError, AttributeError) as exc:  # not JSON, not UTF-8, not an object
        raise RunFolderError(
            f"{first}, the configuration this run started with, is damaged ({type(exc).__name__}: {exc}): restore "
            "it, or move it aside and this launch saves its own"
        ) from None
    current = flatten(config_dict)
    keys = sorted(k for k in previous.keys() | current.keys() if previous.get(k) != current.get(k))
    return {k: (previous.get(k), current.get(k)) for k in keys}


def _snapshot_config(path: str, config_dict: dict) -> None:
    """config.json holds the first launch's configuration. A later launch (a resume) with a different one
    writes config.launch-<n>.json and names the changed keys: a resumed run takes this launch's optimizer
    settings (checkpoint/optimizer_settings.py) and the checkpoint's state (moments, the schedule's position, the
    data position)."""
    changed = _changed_config(path, config_dict)
    if changed is None:
        write_atomically(os.path.join(path, "config.json"), json.dumps(config_dict, indent=2))
        return
    if not changed:
        return
    n = 2
    while os.path.exists(os.path.join(path, f"config.launch-{n}.json")):
        n += 1
    write_atomically(os.path.join(path, f"config.launch-{n}.json"), json.dumps(config_dict, indent=2))
    log.warning(
        "this launch's configuration differs from config.json in %s (saved as config.launch-%d.json); "
        "the optimizer's settings are this launch's, its moments, the schedule's position and the data position "
        "the checkpoint's",
        ", ".join(f"{k}: {first!r} -> {now!r}" for k, (first, now) in changed.items()),
        n,
    )


FINISHED = "finished.json"


def mark_finished(path: str, step: int) -> None:
    """Record that the run completed step `step` with its final evaluation and export."""
    write_atomically(os.path.join(path, FINISHED), json.dumps({"step": step}))


def finished_at(path: str) -> int | None:
    """The step a finished run ended at (None: not finished)."""
    try:
        with open(os.path.join(path, FINISHED)) as f:
            return int(json.load(f)["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def earlier_checkpoints(path: str) -> list[str]:
    """Names of the checkpoints in run folder `path` (DAPO steps, then warm-up steps), relative to checkpoints/."""
    names = []
    for folder, prefix in (("checkpoints", ""), (WARMUP_CHECKPOINTS, "warm-up/")):
        manager = CheckpointManager(os.path.join(path, folder))
        names += [prefix + os.path.basename(manager.step_path(step)) for step in manager.complete_steps()]
    return names


def finished_run_report(run_dir: str, name: str, steps: int) -> list[str] | None:
    """What to print when run folder `run_dir/name` holds a run that finished at `steps` or later: that it is
    done, and its held-out accuracy before DAPO and after, from its eval reports. None: not finished."""
    path = run_folder_path(run_dir, name)
    step = finished_at(path)
    if step is None or step < steps:
        return None
    lines = [
        f"run folder {path}: this run finished at step {step} (metrics, checkpoint and HF export are "
        f"in it); nothing to do. To start over, run the same command with --fresh (the folder is moved aside)"
    ]
    reports = {}
    for file in glob.glob(os.path.join(path, "eval", "step_*.json")):
        match, report = re.search(r"step_(\d+)\.json$", file), read_report(file)
        if match is not None and report is not None:  # an unreadable report is left out of the summary
            reports[int(match.group(1))] = (report["overall"][f"avg@{report['k']}"], report["k"])
    if 0 in reports:
        lines.append(f"held-out accuracy before DAPO: {100 * reports[0][0]:.1f}% (avg@{reports[0][1]})")
    last = max((s for s in reports if s > 0), default=None)
    if last is not None:
        label = "after DAPO" if last == step else f"at step {last}"
        lines.append(f"held-out accuracy {label}: {100 * reports[last][0]:.1f}% (avg@{reports[last][1]})")
    if not reports:
        lines.append(f"no held-out evaluation was run; the training metrics are in {path}/metrics.jsonl")
    return lines
