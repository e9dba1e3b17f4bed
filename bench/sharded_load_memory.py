"""Host memory of loading a checkpoint into a sharded policy: each rank reading only its rows vs the whole model.

Measured: train.py's build (checkpoint/sharded_policy.py build_sharded_policy), whose ranks read only the rows of their
shards (checkpoint/hf_load.py). Baseline, in the same run: the same sharded model filled the way it was filled
before, the whole fp32 policy built on every rank (model/hf.py load_hf) and then sliced (copy_into_shards).
Each rank's high-water mark of resident memory (VmHWM, reset before) above its resident set at the start.
The checkpoint is written by transformers' save_pretrained in bf16, in several files with an index.
Prints a table and one JSON line.

    python bench/sharded_load_memory.py [--ranks 4] [--layers 8] [--hidden 1024] [--layout fsdp|fsdp-tp]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from model.args import ModelArgs, num_params  # noqa: E402
from tests.dist_utils import run_ranks  # noqa: E402
from tests.host_memory import peak, reset_peak, return_freed_memory_at_once  # noqa: E402
from tests.qwen2_checkpoint import write_qwen2_checkpoint  # noqa: E402

MiB = 1 << 20
LAYOUTS = {"fsdp": ["parallelism.dp_shard=-1"], "fsdp-tp": ["parallelism.dp_shard=-1", "parallelism.tp=2"]}


def _load(rank, world_size, path, layout, whole_first):
    from torch.distributed.tensor import DTensor

    from checkpoint.sharded_policy import build_policy, build_sharded_policy, copy_into_shards, shard_policy
    from config import load_config
    from parallel.dist_env import init_distributed

    return_freed_memory_at_once()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    overrides = [f"model.hf_path={path}", "model.preset=", "parallelism.param_dtype=bfloat16", *LAYOUTS[layout]]
    cfg = load_config(os.path.join(root, "configs", "demo_cpu.toml"), overrides)
    dist_env = init_distributed(cfg.parallelism.dp_replicate, cfg.parallelism.dp_shard, cfg.parallelism.tp)
    start = reset_peak()
    if whole_first:  # the baseline: every rank builds the whole policy, then keeps its slices
        policy = shard_policy(cfg.model, cfg.parallelism, dist_env)
        source = build_policy(cfg.model, torch.device("cpu"), seed=0)
        copy_into_shards(policy, ((name, p.detach()) for name, p in source.named_parameters()))
        del source
    else:
        policy = build_sharded_policy(cfg.model, cfg.parallelism, dist_env, seed=0)
    shards = sum((p.to_local() if isinstance(p, DTensor) else p).nbytes for p in policy.parameters())
    return peak() - start, shards


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layout", choices=sorted(LAYOUTS), default="fsdp")
    opts = parser.parse_args()
    args = ModelArgs(
        vocab_size=8192,
        hidden_size=opts.hidden,
        num_layers=opts.layers,
        num_heads=opts.hidden // 128,
        num_kv_heads=2,
        intermediate_size=opts.hidden * 11 // 4,
        tie_word_embeddings=False,
        max_position_embeddings=256,
    )
    with tempfile.TemporaryDirectory() as path:
        write_qwen2_checkpoint(path, args, dtype=torch.bfloat16, max_shard_size="40MB")
        files = len([f for f in os.listdir(path) if f.endswith(".safetensors")])
        rows = {}
        for label, whole_first in (("whole policy, then sliced (baseline)", True), ("own rows only", False)):
            rows[label] = run_ranks(_load, opts.ranks, path, opts.layout, whole_first)
    params = num_params(args)
    print(
        f"{params / 1e6:.0f}M parameters, bf16 checkpoint in {files} files ({params * 2 / MiB:.0f} MiB), fp32 policy "
        f"({params * 4 / MiB:.0f} MiB), {opts.ranks} gloo ranks, layout {opts.layout}"
    )
    print(f"{'load':<38}{'shards MiB':>12}{'peak MiB (max over ranks)':>28}{'peak - shards':>15}")
    for label, per_rank in rows.items():
        high, shards = max(per_rank)
        print(f"{label:<38}{shards / MiB:>12.1f}{high / MiB:>28.1f}{(high - shards) / MiB:>15.1f}")
    base, ours = (max(per_rank)[0] for per_rank in rows.values())
    print(f"ratio (own rows / baseline): {ours / base:.2f}")
    summary = {label: [{"peak": h, "shards": s} for h, s in per_rank] for label, per_rank in rows.items()}
    print(json.dumps({"bench": "sharded_load_memory", "parameters": params, "ranks": opts.ranks, "rows": summary}))


if __name__ == "__main__":
    main()
