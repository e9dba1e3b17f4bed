"""Three DAPO steps on one GPU: a Qwen2.5-0.5B-shaped random model, the torch engine, bf16, compile.

    python bench/dapo_gpu_steps.py [--out DIR] [--steps 3] [--preset qwen2.5-0.5b]

Runs train.py's own loop (synthetic arithmetic prompts, a reward that marks half of the random
responses correct so every group trains) and reports the time split of each step (generate, score,
train, sync) and tokens/s, as a table and one JSON line. Refuses to run without CUDA.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None, help="run folder root (default: a temporary folder)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--preset", default="qwen2.5-0.5b")
    parser.add_argument("--compile", type=int, default=1)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/dapo_gpu_steps.py needs a CUDA device", file=sys.stderr)
        return 2

    import rl.reward
    import train
    from tests.planted_train import planted_score

    rl.reward.compute_score = planted_score
    root = args.out or tempfile.mkdtemp(prefix="dapo_gpu_")
    overrides = {
        "job.run_dir": root,
        "job.name": "gpu",
        "model.preset": args.preset,
        "model.dtype": "float32",
        "data.synthetic_num_train": 2048,
        "data.synthetic_num_eval": 16,
        "data.max_prompt_length": 128,
        "rollout.engine": "torch",
        "rollout.n": 16,
        "rollout.max_response_length": 512,
        "rollout.dtype": "bfloat16",
        "rollout.compile": bool(args.compile),
        "rollout.max_batch_size": 512,
        "algorithm.overlong_buffer": 128,
        "algorithm.overlong_filter": False,
        "training.steps": args.steps,
        "training.train_batch_size": 32,
        "training.mini_batch_size": 8,
        "training.micro_batch_tokens": 16384,
        "training.sft_warmup_steps": 0,
        "parallelism.param_dtype": "bfloat16",
        "parallelism.compile": bool(args.compile),
        "eval.at_start": False,
        "eval.at_end": False,
        "eval.interval": 0,
        "checkpoint.enabled": False,
        "checkpoint.export_hf": False,
    }
    argv = ["--config", "configs/demo_cpu.toml"] + [f"--{k}={v}" for k, v in overrides.items()]
    train.main(argv)
    rows = [json.loads(line) for line in open(os.path.join(root, "gpu", "metrics.jsonl")) if '"loss"' in line]
    keys = (
        "time/generate",
        "time/score",
        "time/train",
        "time/sync",
        "time/step",
        "tokens_per_s",
        "response_length/mean",
    )
    print(f"{'step':>4} " + " ".join(f"{k:>22}" for k in keys))
    for row in rows:
        print(f"{row['step']:>4} " + " ".join(f"{row[k]:>22.3f}" for k in keys))
    print(
        json.dumps(
            {
                "bench": "dapo_gpu_steps",
                "preset": args.preset,
                "compile": bool(args.compile),
                "device": torch.cuda.get_device_name(),
                "steps": [{k: r[k] for k in keys} for r in rows],
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
