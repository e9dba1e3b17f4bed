"""Peak memory and time: chunked vs naive token log-prob + entropy + backward.

Baseline: `naive_token_logprobs` (full [tokens, V] fp32 logits, autograd). Candidate: `token_logprobs`
at one or more chunk sizes. Each variant runs in a fresh subprocess. On CPU, peak memory is the
resident-set high-water mark (VmHWM, reset through /proc/self/clear_refs just before the measured
pass) minus the resident set just before it, so it counts every ATen allocation, including the
gradients the pass produces ([V, H] for the head and [N, H] for the hidden states). On CUDA it is
torch.cuda.max_memory_allocated minus memory_allocated before the pass.

    python bench/logprob_memory.py                       # 4096 tokens, V 151936, H 896, fp32, CPU
    python bench/logprob_memory.py --chunk-sizes 128,256,512,1024 --reps 3

Prints a table and one JSON line: {"memory_ratio": chunked/naive peak extra memory, "time_ratio": ...}
for the first chunk size listed (and per chunk size under "by_chunk").
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MIB = 1024**2


def _status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{key} not in /proc/self/status")


def _reset_rss_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # Linux >= 4.0: reset VmHWM to the current RSS


def worker(opts) -> dict:
    """One variant in this process: returns the best time and the largest peak over `reps` passes."""
    import torch

    sys.path.insert(0, ROOT)
    from model.logprob import token_logprobs
    from tests.logprob_reference import naive_token_logprobs

    device = torch.device(opts.device)
    torch.manual_seed(0)
    n, v, h = opts.tokens, opts.vocab, opts.hidden
    # In-place scaling: no temporary second copy of the [V, H] weight.
    hidden = torch.randn(n, h, device=device).requires_grad_()
    weight = torch.randn(v, h, device=device).mul_(0.02).requires_grad_()
    targets = torch.randint(0, v, (n,), device=device)
    upstream = torch.randn(n, device=device)  # a generic per-token gradient, as from the policy loss
    fn = naive_token_logprobs if opts.worker == "naive" else token_logprobs
    kwargs = {} if opts.worker == "naive" else {"chunk_size": opts.chunk}

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    times, peaks = [], []
    for _ in range(opts.reps):
        hidden.grad = weight.grad = None
        sync()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
        else:
            _reset_rss_peak()
            before = _status_kib("VmRSS") * 1024
        start = time.perf_counter()
        logp, entropy = fn(hidden, weight, targets, temperature=opts.temperature, with_entropy=True, **kwargs)
        (logp * upstream).sum().backward()
        entropy_mean = entropy.mean().item()  # the metric a trainer logs; forces the value to exist
        sync()
        times.append(time.perf_counter() - start)
        if device.type == "cuda":
            peaks.append(torch.cuda.max_memory_allocated() - before)
        else:
            peaks.append(_status_kib("VmHWM") * 1024 - before)
        del logp, entropy
    grads_bytes = (hidden.numel() + weight.numel()) * 4
    return {
        "variant": opts.worker,
        "chunk": opts.chunk if opts.worker != "naive" else None,
        "time_s": min(times),
        "times_s": times,
        "peak_extra_bytes": max(peaks),
        "grads_bytes": grads_bytes,
        "entropy_mean": entropy_mean,
        "threads": torch.get_num_threads(),
    }


def run_variant(opts, variant: str, chunk: int | None) -> dict:
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--worker",
        variant,
        "--tokens",
        str(opts.tokens),
        "--vocab",
        str(opts.vocab),
        "--hidden",
        str(opts.hidden),
        "--reps",
        str(opts.reps),
        "--device",
        opts.device,
        "--temperature",
        str(opts.temperature),
    ]
    if chunk is not None:
        cmd += ["--chunk", str(chunk)]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if out.returncode != 0:
        raise RuntimeError(f"variant {variant} (chunk {chunk}) failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--hidden", type=int, default=896)
    p.add_argument("--chunk-sizes", default="256,1024", help="comma-separated; the first one gives the headline ratios")
    p.add_argument("--reps", type=int, default=2, help="passes per variant (time: best; memory: largest)")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--device", default="cpu")
    p.add_argument("--worker", choices=["naive", "chunked"], help=argparse.SUPPRESS)
    p.add_argument("--chunk", type=int, help=argparse.SUPPRESS)
    opts = p.parse_args(argv)
    if opts.worker:
        print(json.dumps(worker(opts)))
        return

    chunks = [int(c) for c in opts.chunk_sizes.split(",") if c]
    logits_bytes = opts.tokens * opts.vocab * 4
    print(
        f"log-prob + entropy + backward: {opts.tokens} tokens, vocab {opts.vocab}, hidden {opts.hidden}, fp32, "
        f"{opts.device}; one full fp32 logits tensor = {logits_bytes / MIB:.0f} MiB"
    )
    naive = run_variant(opts, "naive", None)
    results = [naive] + [run_variant(opts, "chunked", c) for c in chunks]

    print(
        f"{'variant':<16}{'peak extra MiB':>16}{'w/o grads MiB':>15}{'time s':>10}{'mem ratio':>11}{'time ratio':>12}"
    )
    by_chunk = {}
    for r in results:
        name = "naive" if r["variant"] == "naive" else f"chunked@{r['chunk']}"
        mem_ratio = r["peak_extra_bytes"] / naive["peak_extra_bytes"]
        time_ratio = r["time_s"] / naive["time_s"]
        if r["variant"] != "naive":
            by_chunk[r["chunk"]] = {
                "memory_ratio": round(mem_ratio, 4),
                "time_ratio": round(time_ratio, 4),
                "peak_extra_mib": round(r["peak_extra_bytes"] / MIB, 1),
                "time_s": round(r["time_s"], 3),
            }
        print(
            f"{name:<16}{r['peak_extra_bytes'] / MIB:>16.0f}{(r['peak_extra_bytes'] - r['grads_bytes']) / MIB:>15.0f}"
            f"{r['time_s']:>10.2f}{mem_ratio:>11.3f}{time_ratio:>12.3f}"
        )
    drift = max(abs(r["entropy_mean"] - naive["entropy_mean"]) for r in results)
    print(f"mean entropy agrees across variants to {drift:.1e}")
    head = by_chunk[chunks[0]]
    print(
        json.dumps(
            {
                "bench": "logprob_memory",
                "tokens": opts.tokens,
                "vocab": opts.vocab,
                "hidden": opts.hidden,
                "device": opts.device,
                "chunk_size": chunks[0],
                "memory_ratio": head["memory_ratio"],
                "time_ratio": head["time_ratio"],
                "naive_peak_extra_mib": round(naive["peak_extra_bytes"] / MIB, 1),
                "naive_time_s": round(naive["time_s"], 3),
                "by_chunk": by_chunk,
            }
        )
    )


if __name__ == "__main__":
    main()
