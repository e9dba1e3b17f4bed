"""Sequences in flight at a fixed KV memory budget: the paged TorchEngine vs a fixed-slot cache.

Baseline: the fixed-slot cache the engine had before paging, one [max_seq_len] cache row per
sequence: `--slots` S rows hold S sequences, however short they turn out, and each of a prompt's
samples holds its own copy of the prompt. The paged engine gets the same bytes:
    blocks = S * max_seq_len / block_size - 1        (the -1 pays for its scratch block)
and admits sequences by free blocks (prompt blocks shared by the samples, see rollout/scheduler.py).
The baseline is run as the same engine limited to S sequences with blocks enough for S full-length
ones, which is exactly what the fixed-slot cache allows.

Workload (RL's rollout shape on a CPU): P prompts x G samples; responses end at a stop token with
long-tailed lengths up to max_new_tokens. The lengths come from the model: random weights with a
small init spread give a near-uniform next-token distribution, and `--stop-tokens` K ids stop, so a
response stops at each step with probability about K / vocab (a geometric length distribution whose
mean is far below the cap, as early in RL training). The realised distribution is printed.

Metric: sequences in flight (decoded together) at the peak and on average while others wait (when
memory is the limit), decode steps, preemptions, and wall time of both, in one run; prints a table and
one JSON line.

    python bench/paged_capacity.py [--preset demo] [--prompts 32 --samples 8 --max-new-tokens 448 --slots 8]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from model.args import get_preset  # noqa: E402
from model.qwen2 import build_model  # noqa: E402
from rollout.engine import SamplingParams  # noqa: E402
from rollout.kv_cache import PagedKVCache  # noqa: E402
from rollout.torch_engine import TorchEngine  # noqa: E402
from run.guard import GuardedEngine  # noqa: E402


def capacity(
    preset: str = "demo",
    prompts: int = 32,
    samples: int = 8,
    max_new_tokens: int = 448,
    slots: int = 8,
    block_size: int = 16,
    stop_tokens: int = 16,
    min_prompt: int = 16,
    max_prompt: int = 48,
    seed: int = 0,
) -> dict:
    """Run the workload on both caches at the same KV bytes; returns the numbers (see module doc)."""
    args = get_preset(preset).replace(init_std=0.02)
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_prompt, max_prompt + 1, (prompts,), generator=gen).tolist()
    prompt_ids = [torch.randint(stop_tokens, args.vocab_size, (n,), generator=gen).tolist() for n in lengths]
    max_seq_len = max_prompt + max_new_tokens
    per_token = PagedKVCache.bytes_per_token(args.num_layers, args.num_kv_heads, args.head_dim, torch.float32)
    budget = slots * max_seq_len * per_token
    paged_blocks = budget // (block_size * per_token) - 1
    params = SamplingParams(max_new_tokens=max_new_tokens, n=samples, seed=seed, stop_token_ids=range(stop_tokens))
    blocks_per_seq = -(-max_seq_len // block_size)
    runs = {}
    for name, max_batch, blocks in (
        ("fixed-slot", slots, slots * blocks_per_seq),
        ("paged", prompts * samples, paged_blocks),
    ):
        engine = TorchEngine(
            build_model(args, seed=seed),
            max_batch_size=max_batch,
            max_seq_len=max_seq_len,
            block_size=block_size,
            kv_cache_blocks=blocks,
        )
        start = time.perf_counter()
        out = GuardedEngine(engine).generate(prompt_ids, params)
        wall = time.perf_counter() - start
        s = engine.stats
        runs[name] = {
            "in_flight_peak": s.peak_running,
            "in_flight_mean_saturated": round(s.mean_running_saturated, 2),
            "decode_steps": s.decode_steps,
            "preemptions": s.preemptions,
            "wall_s": round(wall, 3),
            "response_lengths": sorted(len(c.token_ids) for c in out),
            "stopped": sum(c.finish_reason == "stop" for c in out),
        }
    runs["fixed-slot"]["in_flight_peak"] = min(runs["fixed-slot"]["in_flight_peak"], slots)
    return {
        "bench": "paged_capacity",
        "preset": preset,
        "prompts": prompts,
        "samples": samples,
        "max_new_tokens": max_new_tokens,
        "max_seq_len": max_seq_len,
        "block_size": block_size,
        "kv_budget_bytes": budget,
        "fixed_slots": slots,
        "paged_blocks": paged_blocks,
        "runs": runs,
        "ratio_in_flight_saturated": round(
            runs["paged"]["in_flight_mean_saturated"] / runs["fixed-slot"]["in_flight_mean_saturated"], 2
        ),
        "ratio_in_flight_peak": round(runs["paged"]["in_flight_peak"] / runs["fixed-slot"]["in_flight_peak"], 2),
    }


def _distribution(lengths: list[int]) -> str:
    q = lambda f: lengths[min(len(lengths) - 1, int(f * len(lengths)))]  # noqa: E731
    return f"mean {statistics.mean(lengths):.1f}, median {q(0.5)}, p90 {q(0.9)}, p99 {q(0.99)}, max {lengths[-1]}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="demo")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=448)
    parser.add_argument("--slots", type=int, default=8, help="sequences the fixed-slot cache holds")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--stop-tokens", type=int, default=16, help="token ids 0..K-1 stop a response")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    opts = parser.parse_args()
    torch.set_num_threads(opts.threads)
    r = capacity(
        opts.preset,
        opts.prompts,
        opts.samples,
        opts.max_new_tokens,
        opts.slots,
        opts.block_size,
        opts.stop_tokens,
        seed=opts.seed,
    )
    print(
        f"model: {opts.preset}, random weights (init std 0.02), fp32; workload: {opts.prompts} prompts x "
        f"{opts.samples} samples, up to {opts.max_new_tokens} new tokens, stop tokens 0..{opts.stop_tokens - 1}"
    )
    print(
        f"KV budget: {r['kv_budget_bytes'] / 2**20:.2f} MiB = {opts.slots} fixed slots of {r['max_seq_len']} "
        f"tokens = {r['paged_blocks']} blocks of {opts.block_size} (+1 scratch)"
    )
    print(f"{'cache':<12}{'peak':>7}{'mean*':>8}{'steps':>8}{'preempt':>9}{'wall s':>8}  response lengths")
    for name, run in r["runs"].items():
        print(
            f"{name:<12}{run['in_flight_peak']:>7}{run['in_flight_mean_saturated']:>8.1f}{run['decode_steps']:>8}"
            f"{run['preemptions']:>9}{run['wall_s']:>8.2f}  {_distribution(run['response_lengths'])}, "
            f"{run['stopped']}/{len(run['response_lengths'])} at a stop token"
        )
    print("peak / mean*: sequences in flight, at most / on average over the decode steps while others wait")
    print(
        f"ratio (paged / fixed-slot): {r['ratio_in_flight_saturated']:.2f}x in flight (mean*), "
        f"{r['ratio_in_flight_peak']:.2f}x at the peak"
    )
    for run in r["runs"].values():
        run["response_lengths"] = _distribution(run["response_lengths"])
    print(json.dumps(r))


if __name__ == "__main__":
    main()
