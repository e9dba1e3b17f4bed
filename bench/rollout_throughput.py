"""Rollout throughput: TorchEngine vs Hugging Face transformers `generate`, same model, same prompts.

Workload (DAPO rollout shape, scaled to a CPU): P prompts x G samples, N new tokens each, temperature
1.0, top-p 1.0, no top-k, no stop token (every sample is exactly N tokens, so both sides produce the
same number of tokens). The model is a Qwen2.5-shaped decoder (GQA, qkv bias, SwiGLU, RoPE 1e6) with
random weights, fp32: by default the `demo` preset that the CPU demo trains (4 layers, hidden 128,
vocab 512, 1.0M parameters); `--preset small` is a larger one (see SMALL_ARGS). transformers gets
the same weights (names mapped by model/hf_adapter.py) and left-padded prompts with `num_return_sequences=G`;
the engine prefills each prompt once and shares it.

Metric: output tokens per second of each, and the ratio engine / transformers (target >= 3x on a
2-core CPU). The two are run alternately `--repeats` times and the best run of each is kept. On a
shared machine wall time depends on the neighbours, so the tokens per CPU-second of the process
(with one thread, the time it actually ran) are reported too. Prints a table and one JSON line.

    python bench/rollout_throughput.py [--preset demo] [--prompts 32 --samples 8 --new-tokens 128] [--compile]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from model.args import ModelArgs, get_preset  # noqa: E402
from model.hf_adapter import hf_config_from_args, hf_state_dict  # noqa: E402
from model.qwen2 import build_model  # noqa: E402
from rollout.engine import SamplingParams  # noqa: E402
from rollout.torch_engine import TorchEngine  # noqa: E402

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


def bench_args(preset: str) -> ModelArgs:
    return SMALL_ARGS if preset == "small" else get_preset(preset)


def hf_model_from(model, args: ModelArgs):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = hf_config_from_args(args)
    config.pop("architectures")
    config.pop("model_type")
    config.pop("torch_dtype")
    hf = Qwen2ForCausalLM(Qwen2Config(**config, pad_token_id=0)).eval()
    hf.load_state_dict(hf_state_dict(model), strict=True)
    return hf


@torch.inference_mode()
def run_hf(hf, prompts, samples, new_tokens, seed):
    longest = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), longest, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):  # left padding, as transformers wants for batched generation
        ids[i, longest - len(p) :] = torch.tensor(p)
        mask[i, longest - len(p) :] = 1
    torch.manual_seed(seed)
    start, cpu = time.perf_counter(), time.process_time()
    out = hf.generate(
        input_ids=ids,
        attention_mask=mask,
        do_sample=True,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        num_return_sequences=samples,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        pad_token_id=0,
        eos_token_id=None,
    )
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    produced = (out.shape[1] - longest) * out.shape[0]
    return produced, elapsed, cpu


def run_engine(engine, prompts, samples, new_tokens, seed):
    params = SamplingParams(max_new_tokens=new_tokens, temperature=1.0, top_p=1.0, n=samples, seed=seed)
    start, cpu = time.perf_counter(), time.process_time()
    completions = engine.generate(prompts, params)
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    produced = sum(len(c.token_ids) for c in completions)
    return produced, elapsed, cpu


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="demo", help="a model/args.py preset, or 'small' (SMALL_ARGS)")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--min-prompt", type=int, default=16)
    parser.add_argument("--max-prompt", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--compile", action="store_true", help="compile the engine's decode step")
    parser.add_argument("--threads", type=int, default=1, help="torch threads for both (default 1)")
    parser.add_argument("--seed", type=int, default=0)
    opts = parser.parse_args()
    torch.set_num_threads(opts.threads)
    args = bench_args(opts.preset)

    gen = torch.Generator().manual_seed(opts.seed)
    lengths = torch.randint(opts.min_prompt, opts.max_prompt + 1, (opts.prompts,), generator=gen).tolist()
    prompts = [torch.randint(1, args.vocab_size, (n,), generator=gen).tolist() for n in lengths]

    model = build_model(args, seed=opts.seed)
    hf = hf_model_from(model, args)
    engine = TorchEngine(
        model,
        max_batch_size=opts.prompts * opts.samples,
        max_seq_len=opts.max_prompt + opts.new_tokens,
        compile=opts.compile,
    )
    # Warm-up, untimed: allocator, and with --compile the compilation (batch and length are dynamic).
    run_engine(engine, prompts[:4], 2, 8, opts.seed)
    run_hf(hf, prompts[:2], 2, 8, opts.seed)

    expected = opts.prompts * opts.samples * opts.new_tokens
    hf_runs, eng_runs = [], []
    for _ in range(opts.repeats):
        hf_runs.append(run_hf(hf, prompts, opts.samples, opts.new_tokens, opts.seed))
        eng_runs.append(run_engine(engine, prompts, opts.samples, opts.new_tokens, opts.seed))
    for name, runs in (("transformers", hf_runs), ("engine", eng_runs)):
        if any(r[0] != expected for r in runs):
            raise RuntimeError(f"{name} produced {[r[0] for r in runs]} tokens, expected {expected}")
    hf_wall, hf_cpu = min(r[1] for r in hf_runs), min(r[2] for r in hf_runs)
    eng_wall, eng_cpu = min(r[1] for r in eng_runs), min(r[2] for r in eng_runs)

    n_params = sum(p.numel() for p in model.parameters())
    print(
        f"model: {opts.preset} (Qwen2.5-shaped), {args.num_layers} layers, hidden {args.hidden_size}, "
        f"heads {args.num_heads}/{args.num_kv_heads} kv, vocab {args.vocab_size}, {n_params / 1e6:.1f}M params, "
        f"fp32, {torch.get_num_threads()} thread(s)"
    )
    print(
        f"workload: {opts.prompts} prompts ({opts.min_prompt}-{opts.max_prompt} tokens) x {opts.samples} samples "
        f"x {opts.new_tokens} new tokens, temperature 1.0; best of {opts.repeats}"
    )
    print(f"{'engine':<28}{'tokens':>9}{'wall s':>9}{'tokens/s':>11}{'cpu s':>9}{'tokens/cpu-s':>14}")
    name = "TorchEngine" + (" (compiled)" if opts.compile else "")
    for label, wall, cpu in (("transformers generate", hf_wall, hf_cpu), (name, eng_wall, eng_cpu)):
        print(f"{label:<28}{expected:>9}{wall:>9.2f}{expected / wall:>11.1f}{cpu:>9.2f}{expected / cpu:>14.1f}")
    print(f"ratio (engine / transformers): {hf_wall / eng_wall:.2f}x tokens/s, {hf_cpu / eng_cpu:.2f}x tokens/cpu-s")
    print(
        json.dumps(
            {
                "bench": "rollout_throughput",
                "preset": opts.preset,
                "params": n_params,
                "prompts": opts.prompts,
                "samples": opts.samples,
                "new_tokens": opts.new_tokens,
                "threads": torch.get_num_threads(),
                "compile": opts.compile,
                "hf_tokens_per_s": round(expected / hf_wall, 1),
                "engine_tokens_per_s": round(expected / eng_wall, 1),
                "ratio": round(hf_wall / eng_wall, 3),
                "ratio_cpu_time": round(hf_cpu / eng_cpu, 3),
            }
        )
    )


if __name__ == "__main__":
    main()
