"""Rollout throughput: TorchEngine vs Hugging Face transformers `generate`, same model, same prompts.

Workloads (P prompts x G samples, temperature 1.0, top-p 1.0, no top-k):
  fixed      32 x 8, every sample exactly 128 tokens (no stop token): the case least like RL.
  rl-demo    64 x 8 as the CPU demo, prompts of 20-40 tokens, budget 32 tokens.
  rl-recipe  16 x 16 (the recipe's group of 16), prompts of 32-128 tokens, budget 256 tokens (the
             recipe's 512 x 16 prompts x samples and 20480-token budget, scaled down for a CPU).
In the two RL workloads responses end at a stop token, with lengths that vary widely up to the budget,
as in RL rollouts. How: the model has random weights (init std 0.02), so its next-token distribution is
nearly uniform, and the first k token ids are stop ids; a response then stops with probability about
k / V at every token, a geometric length distribution (median about 0.7 x the mean, p90 about 2.3 x,
a tail that reaches the budget). k is chosen for an untruncated mean of about 14 tokens in rl-demo (the
demo's policy writes 14-18) and about 64 in rl-recipe. The measured distribution of both sides is printed.

The model is a Qwen2.5-shaped decoder (GQA, qkv bias, SwiGLU, RoPE 1e6), fp32 on both sides: by default
the `demo` preset that the CPU demo trains (4 layers, hidden 128, vocab 512, 0.9M parameters);
`--preset small` is a larger one (SMALL_ARGS). transformers gets the same weights (names mapped by
model/hf_adapter.py), left-padded prompts with `num_return_sequences=G`, the same stop ids as
`eos_token_id`, the same `max_new_tokens`; in `fixed`, no stop id and `min_new_tokens` = budget.

Fairness: one torch thread each, in one process; the two sides alternate `--repeats` times and the
median of each is kept. Only useful tokens count: a transformers row up to and including its first stop
token (the padding after it is not output), an engine completion's tokens. Metric: useful tokens per
second, and per CPU-second of the process (neighbours on a shared machine disturb it less); the ratio is
engine / transformers. Prints a table and one JSON line with every workload's ratios.

    python bench/rollout_throughput.py [--workloads fixed,rl-demo,rl-recipe] [--preset demo] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from model.args import ModelArgs, get_preset
from model.hf_adapter import hf_config_from_args
from model.qwen2 import build_model
from rollout.engine import SamplingParams
from rollout.torch_engine import TorchEngine
from run.guard import GuardedEngine
from tests.qwen2_checkpoint import hf_state_dict

# Qwen2.5-0.5B's proportions (head_dim 64, 7 query heads per kv head, SwiGLU 5.4x hidden, tied head)
# at a CPU-friendly size: 4 layers, hidden 448, vocab 8192 -> 18.6M parameters.
SMALL_ARGS = ModelArgs(
    vocab_size=8192,
    hidden_size=448,
    num_layers=4,
    num_heads=7,
    num_kv_heads=1,
    intermediate_size=2432,
    tie_word_embeddings=True,
    max_position_embeddings=1024,
)


@dataclass(frozen=True)
class Workload:
    name: str
    prompts: int
    samples: int
    budget: int  # max_new_tokens
    min_prompt: int
    max_prompt: int
    mean_length: int | None  # target mean response length (sets the stop ids); None: no stop, fixed length


WORKLOADS = {
    "fixed": Workload("fixed", 32, 8, 128, 16, 64, None),
    "rl-demo": Workload("rl-demo", 64, 8, 32, 20, 40, 14),
    "rl-recipe": Workload("rl-recipe", 16, 16, 256, 32, 128, 64),
}


def bench_args(preset: str) -> ModelArgs:
    return SMALL_ARGS if preset == "small" else get_preset(preset)


def stop_ids_for(workload: Workload, vocab_size: int) -> list[int]:
    """The first k ids, k = V / mean: with a near-uniform next-token distribution a response stops with
    probability k / V per token, so its untruncated length is geometric with that mean."""
    if workload.mean_length is None:
        return []
    return list(range(max(1, round(vocab_size / workload.mean_length))))


def hf_model_from(model, args: ModelArgs):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = hf_config_from_args(args)
    config.pop("architectures")
    config.pop("model_type")
    config.pop("torch_dtype")
    hf = Qwen2ForCausalLM(Qwen2Config(**config)).eval()
    hf.load_state_dict(hf_state_dict(model), strict=True)
    return hf


def useful_lengths(generated: torch.Tensor, stop_ids: list[int]) -> list[int]:
    """Per row of transformers' output (new tokens only): tokens up to and including the first stop id,
    or the whole row if it has none."""
    if not stop_ids:
        return [generated.shape[1]] * generated.shape[0]
    is_stop = torch.isin(generated, torch.tensor(stop_ids))
    first = is_stop.int().argmax(dim=1) + 1
    return torch.where(is_stop.any(dim=1), first, generated.shape[1]).tolist()


@torch.inference_mode()
def run_hf(hf, prompts, workload: Workload, stop_ids: list[int], seed: int):
    longest = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), longest, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):  # left padding, as transformers wants for batched generation
        ids[i, longest - len(p) :] = torch.tensor(p)
        mask[i, longest - len(p) :] = 1
    stops = (
        {"eos_token_id": stop_ids, "pad_token_id": stop_ids[0]}
        if stop_ids
        else {"eos_token_id": None, "pad_token_id": 0, "min_new_tokens": workload.budget}
    )
    torch.manual_seed(seed)
    start, cpu = time.perf_counter(), time.process_time()
    out = hf.generate(
        input_ids=ids,
        attention_mask=mask,
        do_sample=True,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        num_return_sequences=workload.samples,
        max_new_tokens=workload.budget,
        **stops,
    )
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    return useful_lengths(out[:, longest:], stop_ids), elapsed, cpu


def run_engine(engine, prompts, workload: Workload, stop_ids: list[int], seed: int):
    params = SamplingParams(
        max_new_tokens=workload.budget,
        temperature=1.0,
        top_p=1.0,
        n=workload.samples,
        seed=seed,
        stop_token_ids=stop_ids,
    )
    start, cpu = time.perf_counter(), time.process_time()
    completions = GuardedEngine(engine).generate(prompts, params)
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    return [len(c.token_ids) for c in completions], elapsed, cpu


def distribution(lengths: list[int], budget: int) -> dict:
    ordered = sorted(lengths)
    return {
        "mean": round(statistics.fmean(ordered), 1),
        "median": statistics.median(ordered),
        "p90": ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))],
        "max": ordered[-1],
        "at_budget": round(sum(n >= budget for n in ordered) / len(ordered), 3),
    }


def summarize(runs, budget: int) -> dict:
    """Median useful tokens/s (wall and CPU) over the runs, and the last run's length distribution."""
    return {
        "tokens": sum(runs[-1][0]),
        "wall_s": round(statistics.median(r[1] for r in runs), 3),
        "cpu_s": round(statistics.median(r[2] for r in runs), 3),
        "tokens_per_s": round(statistics.median(sum(r[0]) / r[1] for r in runs), 1),
        "tokens_per_cpu_s": round(statistics.median(sum(r[0]) / r[2] for r in runs), 1),
        "lengths": distribution(runs[-1][0], budget),
    }


def bench_workload(model, hf, args: ModelArgs, workload: Workload, opts) -> dict:
    stop_ids = stop_ids_for(workload, args.vocab_size)
    gen = torch.Generator().manual_seed(opts.seed)
    lengths = torch.randint(workload.min_prompt, workload.max_prompt + 1, (workload.prompts,), generator=gen)
    low = len(stop_ids)  # prompts without stop ids
    prompts = [torch.randint(low, args.vocab_size, (int(n),), generator=gen).tolist() for n in lengths]
    engine = TorchEngine(
        model,
        max_batch_size=workload.prompts * workload.samples,
        max_seq_len=workload.max_prompt + workload.budget,
        compile=opts.compile,
    )
    # Warm-up, untimed: allocator, and with --compile the compilation (batch and length are dynamic).
    small = Workload(workload.name, 4, 2, 8, workload.min_prompt, workload.max_prompt, workload.mean_length)
    run_engine(engine, prompts[:4], small, stop_ids, opts.seed)
    run_hf(hf, prompts[:2], small, stop_ids, opts.seed)
    hf_runs, engine_runs = [], []
    for i in range(opts.repeats):
        hf_runs.append(run_hf(hf, prompts, workload, stop_ids, opts.seed + i))
        engine_runs.append(run_engine(engine, prompts, workload, stop_ids, opts.seed + i))
    engine.shutdown()
    if workload.mean_length is None:
        expected = workload.prompts * workload.samples * workload.budget
        for name, runs in (("transformers", hf_runs), ("engine", engine_runs)):
            if any(sum(r[0]) != expected for r in runs):
                raise RuntimeError(f"{name} produced {[sum(r[0]) for r in runs]} tokens, expected {expected}")
    hf_stats, engine_stats = summarize(hf_runs, workload.budget), summarize(engine_runs, workload.budget)
    return {
        "prompts": workload.prompts,
        "samples": workload.samples,
        "budget": workload.budget,
        "prompt_tokens": [workload.min_prompt, workload.max_prompt],
        "stop_ids": len(stop_ids),
        "ratio": round(engine_stats["tokens_per_s"] / hf_stats["tokens_per_s"], 3),
        "ratio_cpu_time": round(engine_stats["tokens_per_cpu_s"] / hf_stats["tokens_per_cpu_s"], 3),
        "transformers": hf_stats,
        "engine": engine_stats,
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--workloads", default="fixed,rl-demo,rl-recipe", help=f"comma-separated, from {', '.join(WORKLOADS)}"
    )
    parser.add_argument("--preset", default="demo", help="a model/args.py preset, or 'small' (SMALL_ARGS)")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each side per workload (median kept)")
    parser.add_argument("--compile", action="store_true", help="compile the engine's decode step")
    parser.add_argument("--threads", type=int, default=1, help="torch threads for both (default 1)")
    parser.add_argument("--seed", type=int, default=0)
    opts = parser.parse_args()
    names = [n.strip() for n in opts.workloads.split(",") if n.strip()]
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown or not names:
        print(
            f"error: --workloads takes comma-separated names from {', '.join(WORKLOADS)}, got {opts.workloads!r}",
            file=sys.stderr,
        )
        sys.exit(2)
    if opts.repeats < 1:
        print(f"error: --repeats must be >= 1, got {opts.repeats}", file=sys.stderr)
        sys.exit(2)
    torch.set_num_threads(opts.threads)
    args = bench_args(opts.preset)
    model = build_model(args, seed=opts.seed)
    hf = hf_model_from(model, args)
    n_params = sum(p.numel() for p in model.parameters())
    print(
        f"model: {opts.preset} (Qwen2.5-shaped), {args.num_layers} layers, hidden {args.hidden_size}, "
        f"heads {args.num_heads}/{args.num_kv_heads} kv, vocab {args.vocab_size}, {n_params / 1e6:.1f}M params, "
        f"fp32, {torch.get_num_threads()} thread(s); median of {opts.repeats} alternated runs per side"
    )
    results = {}
    engine_name = "TorchEngine" + (" (compiled)" if opts.compile else "")
    header = (
        f"{'workload':<11}{'side':<23}{'tokens':>8}  {'lengths mean/med/p90/max':<26}"
        f"{'wall s':>8}{'tokens/s':>10}{'cpu s':>8}{'tok/cpu-s':>11}{'ratio':>8}{'(cpu)':>8}"
    )
    print(header)
    for name in names:
        workload = WORKLOADS[name]
        # A fresh copy per workload: the engine owns its model (and moves it to eval mode).
        engine_model = build_model(args, seed=opts.seed)
        result = bench_workload(engine_model, hf, args, workload, opts)
        results[name] = result
        for side, stats in (("transformers generate", result["transformers"]), (engine_name, result["engine"])):
            d = stats["lengths"]
            lengths = f"{d['mean']}/{d['median']}/{d['p90']}/{d['max']}"
            ratios = f"{result['ratio']:>7.2f}x{result['ratio_cpu_time']:>7.2f}x" if side == engine_name else ""
            print(
                f"{name:<11}{side:<23}{stats['tokens']:>8}  {lengths:<26}{stats['wall_s']:>8.2f}"
                f"{stats['tokens_per_s']:>10.1f}{stats['cpu_s']:>8.2f}{stats['tokens_per_cpu_s']:>11.1f}{ratios}"
            )
        print(
            f"{'':<11}{workload.prompts} prompts ({workload.min_prompt}-{workload.max_prompt} tokens) x "
            f"{workload.samples} samples, budget {workload.budget}, {result['stop_ids']} stop ids; "
            f"share at budget: transformers {result['transformers']['lengths']['at_budget']}, "
            f"engine {result['engine']['lengths']['at_budget']}"
        )
    print(
        json.dumps(
            {
                "bench": "rollout_throughput",
                "preset": opts.preset,
                "params": n_params,
                "threads": torch.get_num_threads(),
                "compile": opts.compile,
                "repeats": opts.repeats,
                "ratios": {name: r["ratio"] for name, r in results.items()},
                "ratios_cpu_time": {name: r["ratio_cpu_time"] for name, r in results.items()},
                "workloads": results,
            }
        )
    )


if __name__ == "__main__":
    main()
