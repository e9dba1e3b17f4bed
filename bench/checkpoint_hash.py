"""The cost of content hashes in checkpoints: a save with them against the same save without, in one run.

Baseline ("unhashed save"): what a checkpoint save did before content hashes: DCP's stock FileSystemWriter
(fsync on), the train state through safetensors' save_file, a manifest of file sizes, the rename. Measured:
  - "hashed write": the same DCP write through the hashing writer (XXH3-128 of the bytes as written);
  - "verified save": CheckpointManager.save as a run calls it: hashed, fsynced writes, the manifest, the
    rename (a save no longer reads its files back: checkpoint/manager.py);
  - "verify on resume": reading every file of the checkpoint and checking it, as a resume does before it
    loads (next to "load", the DCP load itself).
Each for a model at the CPU demo's size and one of a few hundred MB (AdamW state included), alternately,
best of `--repeats`. Also the single-core throughput of the hashes considered, on the same bytes.
Prints a table and one JSON line.

    python bench/checkpoint_hash.py [--repeats 5] [--sizes demo,300mb] [--dir DIR]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
import xxhash  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from checkpoint.files import WrittenFiles, hashing_writer  # noqa: E402
from checkpoint.manager import MANIFEST, CheckpointManager  # noqa: E402
from model.args import get_preset  # noqa: E402
from model.qwen2 import build_model  # noqa: E402

SIZES = {
    "demo": get_preset("demo"),
    # ~21.7M parameters: 87 MB of fp32 weights, 260 MB with AdamW's two moments.
    "300mb": get_preset("demo").replace(vocab_size=32000, hidden_size=384, num_layers=6, intermediate_size=1024),
}


def trained(args) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A model whose AdamW state exists (one step on random gradients), as a run's checkpoints hold it."""
    model = build_model(args, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    optimizer.step()
    optimizer.zero_grad()
    return model, optimizer


def unhashed_save(manager: CheckpointManager, step: int, model, optimizer) -> None:
    """The baseline: the save as it was before content hashes (sizes-only manifest, no read-back)."""
    tensors, param_groups = manager._dcp_state(model, optimizer)
    tmp = manager.step_path(step) + ".tmp"
    os.makedirs(os.path.join(tmp, "train_state"))
    dcp.save(tensors, checkpoint_id=tmp, no_dist=True)
    save_file({"t0": torch.zeros(4)}, os.path.join(tmp, "train_state", "rank-00000.safetensors"))
    with open(os.path.join(tmp, "train_state", "rank-00000.json"), "w") as f:
        json.dump({"optimizer_param_groups": param_groups}, f, default=str)
        os.fsync(f.fileno())
    sizes = {}
    for directory, _, files in os.walk(tmp):
        for name in files:
            sizes[os.path.relpath(os.path.join(directory, name), tmp)] = os.path.getsize(os.path.join(directory, name))
    with open(os.path.join(tmp, MANIFEST), "w") as f:
        json.dump({"files": sizes}, f)
        os.fsync(f.fileno())
    os.replace(tmp, manager.step_path(step))


def hashed_write(manager: CheckpointManager, step: int, model, optimizer) -> None:
    tensors, _ = manager._dcp_state(model, optimizer)
    path = manager.step_path(step) + ".hashed"
    dcp.save(tensors, storage_writer=hashing_writer(path, WrittenFiles(path)), no_dist=True)


def plain_write(manager: CheckpointManager, step: int, model, optimizer) -> None:
    tensors, _ = manager._dcp_state(model, optimizer)
    dcp.save(tensors, checkpoint_id=manager.step_path(step) + ".plain", no_dist=True)


def one_round(manager: CheckpointManager, step: int, model, optimizer, args) -> dict[str, float]:
    """Seconds of each operation once, the baseline first (steps `step` and `step + 1`)."""
    out, fresh = {}, trained(args)  # the model and optimizer the load fills
    for name, fn in (
        ("unhashed save", lambda: unhashed_save(manager, step, model, optimizer)),
        ("verified save", lambda: manager.save(step + 1, model, optimizer)),
        ("plain write", lambda: plain_write(manager, step, model, optimizer)),
        ("hashed write", lambda: hashed_write(manager, step, model, optimizer)),
        ("verify", lambda: manager.validate(step + 1)),
        ("load", lambda: manager.load(step + 1, *fresh)),
    ):
        start = time.perf_counter()
        fn()
        out[name] = time.perf_counter() - start
    return out


def measure(name: str, root: str, repeats: int) -> dict:
    model, optimizer = trained(SIZES[name])
    manager = CheckpointManager(os.path.join(root, name), keep=0)
    rounds = []
    for r in range(repeats):
        shutil.rmtree(manager.folder, ignore_errors=True)
        rounds.append(one_round(manager, 2 * r, model, optimizer, SIZES[name]))
    last = manager.step_path(2 * repeats - 1)
    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(last) for f in fs)
    best = {k: min(r[k] for r in rounds) for k in rounds[0]}
    return {"size": name, "bytes": size, **{k.replace(" ", "_") + "_s": round(v, 4) for k, v in best.items()}}


def hash_throughput(nbytes: int = 256 << 20) -> dict[str, float]:
    """GB/s of each hash on `nbytes` of random data in 8 MiB updates (one core, best of 3)."""
    data = memoryview(os.urandom(nbytes))
    out = {}
    for name, make in (
        ("xxh3_128", xxhash.xxh3_128),
        ("blake2b", hashlib.blake2b),
        ("sha256", hashlib.sha256),
        ("md5", hashlib.md5),
    ):
        best = float("inf")
        for _ in range(3):
            h, start = make(), time.perf_counter()
            for i in range(0, nbytes, 8 << 20):
                h.update(data[i : i + (8 << 20)])
            h.digest()
            best = min(best, time.perf_counter() - start)
        out[name] = round(nbytes / best / 1e9, 2)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--sizes", default="demo,300mb")
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary folder)")
    opts = parser.parse_args()
    warnings.filterwarnings("ignore")  # DCP's single-process notice
    root = tempfile.mkdtemp(dir=opts.dir, prefix="checkpoint_hash_")
    try:
        rows = [measure(name, root, opts.repeats) for name in opts.sizes.split(",")]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    throughput = hash_throughput()
    print(f"best of {opts.repeats}; hash throughput (GB/s, one core): {throughput}")
    print(
        f"{'size':<7}{'MB':>8}{'unhashed save':>15}{'verified save':>15}{'ratio':>7}"
        f"{'plain write':>13}{'hashed write':>14}{'ratio':>7}{'verify':>9}{'load':>8}"
    )
    for row in rows:
        row["save_ratio"] = round(row["verified_save_s"] / row["unhashed_save_s"], 3)
        row["write_ratio"] = round(row["hashed_write_s"] / row["plain_write_s"], 3)
        print(
            f"{row['size']:<7}{row['bytes'] / 1e6:>8.1f}{row['unhashed_save_s']:>15.3f}{row['verified_save_s']:>15.3f}"
            f"{row['save_ratio']:>7.2f}{row['plain_write_s']:>13.3f}{row['hashed_write_s']:>14.3f}"
            f"{row['write_ratio']:>7.2f}{row['verify_s']:>9.3f}{row['load_s']:>8.3f}"
        )
    print(json.dumps({"bench": "checkpoint_hash", "repeats": opts.repeats, "hash_gbps": throughput, "rows": rows}))


if __name__ == "__main__":
    main()
