"""SGLang smoke check on a GPU machine with requirements-gpu.txt installed, or on a CPU SGLang's CPU backend
runs on (docs/sglang-cpu.md; SGLANG_USE_CPU_ENGINE=1).

1. Save a small random Qwen2.5-shaped checkpoint (model.hf.save_hf, bf16) and start SGLangEngine on it.
2. Generate (temperature 1.0, n = 2) and compare SGLang's log-probs with the trainer's, recomputed by
   our model from the same checkpoint (fp32 compute on the bf16 weights, model.logprob). The baseline:
   bf16's own noise, the same gap for our model computing in bf16 on the same tokens.
3. The RL step's memory dance: release_memory(), sync_weights() from a second model with new weights
   (bucketed; CUDA IPC on a GPU), resume_memory(); generate again and compare with the new model's
   log-probs. Greedy outputs must change with the weights.
Prints a table and one JSON line; `run_smoke` returns the numbers (tests/test_rollout_sglang_cpu.py).

    python bench/sglang_smoke.py [--workdir /tmp/sglang_smoke] [--tp 1]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from model.args import ModelArgs  # noqa: E402
from model.hf import load_hf, save_hf  # noqa: E402
from model.logprob import token_logprobs  # noqa: E402
from model.qwen2 import build_model  # noqa: E402
from rollout.engine import SamplingParams  # noqa: E402
from rollout.sglang_engine import SGLangEngine, check_sglang_version  # noqa: E402
from rollout.weight_sync import sync_weights  # noqa: E402
from run.guard import GuardedEngine  # noqa: E402

# head_dim 64 as in Qwen2.5 (GPU attention kernels expect a standard head size); a wide init makes the
# random model's distributions peaked, so greedy outputs visibly depend on the weights.
SMOKE_ARGS = ModelArgs(
    vocab_size=2048,
    hidden_size=256,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    intermediate_size=704,
    tie_word_embeddings=False,
    max_position_embeddings=1024,
    init_std=0.1,
)


def _trainer_logprobs(model, prompts, completions, temperature):
    """Per-token log-probs of every completion as the trainer computes them (one forward per sequence)."""
    out = []
    weight = model.output_weight()
    with torch.no_grad():
        for c in completions:
            prompt = prompts[c.prompt_index]
            if not c.token_ids:
                out.append(torch.empty(0))
                continue
            seq = torch.tensor([prompt + c.token_ids], device=weight.device)
            hidden = model(seq, return_hidden=True)[0, len(prompt) - 1 : -1]
            logp, _ = token_logprobs(
                hidden,
                weight,
                torch.tensor(c.token_ids, device=weight.device),
                temperature=temperature,
                with_entropy=False,
            )
            out.append(logp.cpu())
    return out


def _max_and_mean_diff(completions, reference):
    return _max_and_mean_diff_of([torch.tensor(c.logprobs) for c in completions], reference)


def _max_and_mean_diff_of(logprobs, reference):
    diffs = torch.cat([(lp - r).abs() for lp, r in zip(logprobs, reference)])
    return float(diffs.max()), float(diffs.mean())


def run_smoke(workdir: str, tp_size: int = 1) -> dict:
    check_sglang_version()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    path = os.path.join(workdir, "ckpt")
    old = build_model(SMOKE_ARGS, device=device, dtype=torch.bfloat16, seed=1)
    new = build_model(SMOKE_ARGS, device=device, dtype=torch.bfloat16, seed=2)
    save_hf(old, path)
    reference_old = load_hf(path, dtype=torch.float32, device=device)

    engine = SGLangEngine(
        path,
        tp_size=tp_size,
        mem_fraction_static=0.3,
        dtype=torch.bfloat16,
        seed=0,
        context_length=512,
        device=None if device == "cuda" else device,
    )
    try:
        gen = torch.Generator().manual_seed(0)
        prompts = [
            torch.randint(0, SMOKE_ARGS.vocab_size, (int(n),), generator=gen).tolist()
            for n in torch.randint(4, 40, (8,), generator=gen)
        ]
        sampled = SamplingParams(max_new_tokens=32, temperature=1.0, n=2)
        greedy = SamplingParams(max_new_tokens=16, temperature=0.0)

        guarded = GuardedEngine(engine)  # generate: a submit and polls, as train.py drives it
        before = guarded.generate(prompts, sampled)
        greedy_before = guarded.generate(prompts, greedy)
        max_before, mean_before = _max_and_mean_diff(before, _trainer_logprobs(reference_old, prompts, before, 1.0))
        bf16 = _trainer_logprobs(load_hf(path, dtype=torch.bfloat16, device=device), prompts, before, 1.0)
        noise_max, noise_mean = _max_and_mean_diff_of(bf16, _trainer_logprobs(reference_old, prompts, before, 1.0))

        engine.release_memory()
        sync_weights(new, engine, bucket_bytes=1 << 20)  # several buckets
        engine.resume_memory()

        reference_new = build_model(SMOKE_ARGS, device=device, dtype=torch.float32, seed=2)
        with torch.no_grad():  # the bf16 weights SGLang now holds, computed in fp32
            for p, q in zip(reference_new.parameters(), new.parameters()):
                p.copy_(q.float())
        after = guarded.generate(prompts, sampled)
        greedy_after = guarded.generate(prompts, greedy)
        max_after, mean_after = _max_and_mean_diff(after, _trainer_logprobs(reference_new, prompts, after, 1.0))
        _, mean_greedy = _max_and_mean_diff(greedy_after, _trainer_logprobs(reference_new, prompts, greedy_after, 1.0))
    finally:
        engine.shutdown()

    return {
        "bench": "sglang_smoke",
        "completions": len(before),
        "finish_reasons": sorted({c.finish_reason for c in before + after}),
        "bf16_noise_max_abs_diff": noise_max,
        "bf16_noise_mean_abs_diff": noise_mean,
        "logprob_max_abs_diff_before": max_before,
        "logprob_mean_abs_diff_before": mean_before,
        "logprob_max_abs_diff_after": max_after,
        "logprob_mean_abs_diff_after": mean_after,
        "greedy_logprob_mean_abs_diff_after": mean_greedy,
        "greedy_changed_after_update": [c.token_ids for c in greedy_before] != [c.token_ids for c in greedy_after],
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--tp", type=int, default=1)
    opts = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        result = run_smoke(opts.workdir or tmp, opts.tp)
    print(f"{'check':<40}{'value':>14}")
    for key, value in result.items():
        if key != "bench":
            print(f"{key:<40}{str(value):>14}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
