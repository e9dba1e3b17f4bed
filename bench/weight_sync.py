"""Weight sync cost: `sync_weights(trainer, engine)` vs a plain `copy_` of the same bytes.

Baseline: for every parameter, engine_param.copy_(trainer_param) (the least work that moves the
bytes). Measured: rollout.weight_sync.sync_weights, which walks the trainer in HF names, builds
buckets, and calls TorchEngine.update_weights (name mapping, whole-bucket validation, copy_).
Both move the same bytes between the same two models, alternately, best of `--repeats`.
Target: ratio <= 1.5. Prints a table and one JSON line.

    python bench/weight_sync.py [--preset qwen2.5-0.5b] [--bucket-mb 256] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from model.args import get_preset  # noqa: E402
from model.qwen2 import build_model  # noqa: E402
from rollout.torch_engine import TorchEngine  # noqa: E402
from rollout.weight_sync import sync_weights  # noqa: E402


def plain_copy(trainer, engine_model):
    with torch.no_grad():
        for dst, src in zip(engine_model.parameters(), trainer.parameters()):
            dst.copy_(src)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="qwen2.5-0.5b")
    parser.add_argument("--bucket-mb", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: leave torch's default)")
    opts = parser.parse_args()
    if opts.threads:
        torch.set_num_threads(opts.threads)

    args = get_preset(opts.preset)
    trainer = build_model(args, seed=1)
    engine = TorchEngine(build_model(args, seed=2), max_batch_size=1, max_seq_len=16)
    engine.release_memory()  # the KV cache plays no part here
    total = sum(p.numel() * p.element_size() for p in trainer.parameters())

    plain_copy(trainer, engine.model)  # warm-up: page in both models
    sync_weights(trainer, engine, bucket_bytes=opts.bucket_mb << 20)
    copy_times, sync_times = [], []
    for _ in range(opts.repeats):
        start = time.perf_counter()
        plain_copy(trainer, engine.model)
        copy_times.append(time.perf_counter() - start)
        start = time.perf_counter()
        sent = sync_weights(trainer, engine, bucket_bytes=opts.bucket_mb << 20)
        sync_times.append(time.perf_counter() - start)
    assert sent == total
    for p, q in zip(engine.model.parameters(), trainer.parameters()):
        assert torch.equal(p, q)

    t_copy, t_sync = min(copy_times), min(sync_times)
    print(
        f"model: {opts.preset}, {total / 2**20:.0f} MiB fp32 in {len(list(trainer.parameters()))} tensors; "
        f"buckets of {opts.bucket_mb} MiB; best of {opts.repeats}; {torch.get_num_threads()} threads"
    )
    print(f"{'method':<34}{'seconds':>10}{'GiB/s':>10}")
    print(f"{'plain copy_ (baseline)':<34}{t_copy:>10.3f}{total / t_copy / 2**30:>10.2f}")
    print(f"{'sync_weights -> TorchEngine':<34}{t_sync:>10.3f}{total / t_sync / 2**30:>10.2f}")
    print(f"ratio (sync / copy_): {t_sync / t_copy:.2f}x")
    print(
        json.dumps(
            {
                "bench": "weight_sync",
                "preset": opts.preset,
                "bytes": total,
                "bucket_mb": opts.bucket_mb,
                "copy_s": round(t_copy, 4),
                "sync_s": round(t_sync, 4),
                "ratio": round(t_sync / t_copy, 3),
            }
        )
    )


if __name__ == "__main__":
    main()
