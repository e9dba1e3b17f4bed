"""Training throughput and MFU of the policy update step (GPU only).

One training step = forward + chunked log-prob + DAPO-style token-level loss + backward + grad clip + AdamW,
on packed rows of 4096 tokens (documents of random lengths, positions restarting per document), with the
model parallelised by `parallel.parallelize_qwen2` (FSDP2 mixed precision: bf16 compute, fp32 master
weights and reduction). Qwen2.5-0.5B and 1.5B shapes, random initialisation; torch.compile on/off and
activation checkpointing none/full.

Baseline, measured in the same run: the GPU's bf16 dense matmul rate (8192^3 GEMMs). MFU is the model's
useful FLOP/s over that rate (also printed against the datasheet peak, 989 TFLOP/s for H100/H200 SXM).

Model FLOPs per token (forward + backward = 3x forward; recomputation from checkpointing not counted):
    6 * (block linear weights + V * H for the output head) + 12 * L * H * c
where c is the number of keys the token attends to (its position in its document + 1), so attention
FLOPs follow the packed documents exactly.

    python bench/train_mfu.py                                   # all 8 configurations on one GPU
    python bench/train_mfu.py --shapes qwen2.5-1.5b --compile on --ac none
    torchrun --nproc_per_node=8 bench/train_mfu.py              # FSDP over 8 GPUs (MFU per GPU)
    python bench/train_mfu.py --smoke-cpu                       # code-path check on a tiny model; no measurement

Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from model.args import ModelArgs, get_preset, training_flops  # noqa: E402
from model.qwen2 import build_model  # noqa: E402
from parallel.dims import ParallelDims  # noqa: E402
from parallel.grad_clip import clip_grad_norm_  # noqa: E402
from parallel.logprob import vocab_parallel_token_logprobs  # noqa: E402
from parallel.parallelize import parallelize_qwen2  # noqa: E402
from trainer.step_metrics import DATASHEET_BF16_TFLOPS as DATASHEET_BF16_TFLOPS_BY_GPU  # noqa: E402

DATASHEET_BF16_TFLOPS = DATASHEET_BF16_TFLOPS_BY_GPU["H200"]  # H100/H200 SXM dense bf16 (989)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default="qwen2.5-0.5b,qwen2.5-1.5b", help="comma-separated model presets")
    p.add_argument("--compile", choices=("both", "on", "off"), default="both")
    p.add_argument(
        "--ac",
        choices=("both", "none", "full", "selective"),
        default="both",
        help="activation checkpointing; 'both' = none and full",
    )
    p.add_argument("--row-tokens", type=int, default=4096, help="tokens per packed row (one micro-batch)")
    p.add_argument("--rows-per-step", type=int, default=4, help="micro-batches accumulated per optimizer step")
    p.add_argument("--min-doc", type=int, default=256)
    p.add_argument("--max-doc", type=int, default=2048)
    p.add_argument("--warmup", type=int, default=3, help="steps before timing (compilation happens here)")
    p.add_argument("--steps", type=int, default=8, help="timed steps")
    p.add_argument("--smoke-cpu", action="store_true", help="run the code path on CPU with a tiny model")
    return p.parse_args(argv)


# ---------------------------------------------------------------------------------------------------
# Process group and baseline
# ---------------------------------------------------------------------------------------------------


def init_distributed(device_type: str) -> tuple[int, int]:
    backend = "nccl" if device_type == "cuda" else "gloo"
    if "RANK" in os.environ:  # torchrun
        dist.init_process_group(backend)
    else:
        store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
        dist.init_process_group(backend, store=store, rank=0, world_size=1)
    rank, world = dist.get_rank(), dist.get_world_size()
    if device_type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    return rank, world


def measure_matmul_tflops(device: torch.device, dtype: torch.dtype, n: int, reps: int) -> float:
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(max(3, reps // 4)):  # long enough for the clocks to ramp up before timing
        a @ b
    _sync(device)
    start = time.perf_counter()
    for _ in range(reps):
        a @ b
    _sync(device)
    return 2 * n**3 * reps / (time.perf_counter() - start) / 1e12


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---------------------------------------------------------------------------------------------------
# Data and FLOPs
# ---------------------------------------------------------------------------------------------------


def packed_rows(n_rows: int, row_tokens: int, vocab: int, min_doc: int, max_doc: int, gen: torch.Generator):
    """Rows of `row_tokens` tokens packed with documents of random lengths (the last one cut to fit)."""
    rows, doc_lengths = [], []
    for _ in range(n_rows):
        lengths, left = [], row_tokens
        while left:
            n = min(left, int(torch.randint(min_doc, max_doc + 1, (1,), generator=gen)))
            lengths.append(n)
            left -= n
        tokens = torch.randint(0, vocab, (1, row_tokens), generator=gen)
        positions = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
        docs = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)]).unsqueeze(0)
        mask = torch.ones(1, row_tokens)
        ends = torch.tensor(lengths).cumsum(0) - 1
        mask[0, ends] = 0.0  # a document's last token has no next token in its document
        rows.append(
            {
                "tokens": tokens,
                "positions": positions,
                "document_ids": docs,
                "targets": tokens.roll(-1, 1),
                "mask": mask,
                "advantages": torch.randn(1, row_tokens, generator=gen),
            }
        )
        doc_lengths.append(lengths)
    return rows, doc_lengths


# ---------------------------------------------------------------------------------------------------
# One configuration
# ---------------------------------------------------------------------------------------------------


def run_config(args: ModelArgs, device: torch.device, world: int, compile_: bool, ac: str, opts, smoke: bool) -> dict:
    dims = ParallelDims(world_size=world)
    mesh = dims.build_mesh(device.type)
    model = build_model(args, device=device, dtype=torch.float32, seed=0)
    param_dtype = torch.float32 if smoke else torch.bfloat16
    parallelize_qwen2(
        model,
        mesh,
        dims,
        param_dtype=param_dtype,
        reduce_dtype=torch.float32,
        activation_checkpoint=ac,
        compile=compile_,
        compile_backend="aot_eager" if smoke else "inductor",
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.1, foreach=True)
    gen = torch.Generator().manual_seed(1234 + dist.get_rank())
    rows, doc_lengths = packed_rows(
        opts.rows_per_step, opts.row_tokens, args.vocab_size, opts.min_doc, opts.max_doc, gen
    )
    rows = [{k: v.to(device) for k, v in row.items()} for row in rows]
    global_tokens = sum(row["mask"].sum() for row in rows).reshape(1)
    dist.all_reduce(global_tokens)

    def step():
        for row in rows:
            hidden = model(row["tokens"], row["positions"], row["document_ids"], return_hidden=True)
            logp, _ = vocab_parallel_token_logprobs(hidden, model.output_weight(), row["targets"], chunk_size=1024)
            loss = -(logp * row["advantages"] * row["mask"]).sum() / global_tokens[0]
            loss.backward()
        clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(opts.warmup):
        step()
    _sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    for _ in range(opts.steps):
        step()
    _sync(device)
    seconds = (time.perf_counter() - start) / opts.steps
    flops = training_flops(args, doc_lengths)  # this rank's rows
    result = {
        "compile": compile_,
        "ac": ac,
        "step_s": round(seconds, 4),
        "tokens_per_s_per_device": round(opts.rows_per_step * opts.row_tokens / seconds, 1),
        "model_tflops_per_device": round(flops / seconds / 1e12, 2),
        "peak_mem_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 2) if device.type == "cuda" else None,
    }
    return result


def release(device: torch.device) -> None:
    """Free the previous configuration's model, optimizer state and compiled graphs before the next one."""
    gc.collect()
    torch._dynamo.reset()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def main(argv=None):
    opts = parse_args(argv)
    smoke = opts.smoke_cpu
    if not torch.cuda.is_available() and not smoke:
        print(
            "bench/train_mfu.py measures GPU training throughput and MFU; no CUDA device is available here. "
            "Run it on a GPU machine (use --smoke-cpu only to check the code path on a tiny model).",
            file=sys.stderr,
        )
        return 2
    device_type = "cpu" if smoke else "cuda"
    rank, world = init_distributed(device_type)
    device = torch.device("cpu") if smoke else torch.device("cuda", torch.cuda.current_device())
    if smoke:
        shapes = ["tiny"]
        opts.row_tokens, opts.rows_per_step, opts.min_doc, opts.max_doc = 64, 2, 8, 32
        opts.warmup, opts.steps = 2, 2
        peak = measure_matmul_tflops(device, torch.float32, 256, 3)
        device_name = "cpu (smoke run, not a measurement)"
    else:
        shapes = opts.shapes.split(",")
        peak = measure_matmul_tflops(device, torch.bfloat16, 8192, 200)  # ~0.3 s timed on an H200
        device_name = torch.cuda.get_device_name(device)
    compiles = {"both": [False, True], "on": [True], "off": [False]}[opts.compile]
    acs = {"both": ["none", "full"], "none": ["none"], "full": ["full"], "selective": ["selective"]}[opts.ac]

    results = []
    for shape in shapes:
        args = get_preset(shape)
        for compile_ in compiles:
            for ac in acs:
                r = run_config(args, device, world, compile_, ac, opts, smoke)
                release(device)
                r["shape"] = shape
                r["mfu_vs_measured"] = round(r["model_tflops_per_device"] / peak, 4)
                r["mfu_vs_datasheet"] = round(r["model_tflops_per_device"] / DATASHEET_BF16_TFLOPS, 4)
                results.append(r)
                if rank == 0:
                    print(f"done {shape} compile={compile_} ac={ac}: {r}", flush=True)

    if rank == 0:
        print(
            f"\n{device_name} x {world}; measured bf16 matmul (8192^3): {peak:.1f} TFLOP/s; "
            f"rows of {opts.row_tokens} tokens, {opts.rows_per_step} per step\n"
        )
        header = (
            f"{'shape':<14}{'compile':>8}{'ac':>6}{'step s':>9}{'tok/s/dev':>12}{'TFLOP/s':>9}{'MFU':>8}"
            f"{'MFU ds':>8}{'mem GiB':>9}"
        )
        print(header)
        print("-" * len(header))
        for r in results:
            print(
                f"{r['shape']:<14}{str(r['compile']):>8}{r['ac']:>6}{r['step_s']:>9.3f}"
                f"{r['tokens_per_s_per_device']:>12.0f}{r['model_tflops_per_device']:>9.1f}"
                f"{r['mfu_vs_measured']:>8.1%}{r['mfu_vs_datasheet']:>8.1%}{(r['peak_mem_gib'] or 0):>9.1f}"
            )
        summary = {
            "bench": "train_mfu",
            "device": device_name,
            "world_size": world,
            "matmul_tflops": round(peak, 1),
            "row_tokens": opts.row_tokens,
            "rows_per_step": opts.rows_per_step,
            "results": results,
        }
        print(json.dumps(summary))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
