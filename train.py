"""DAPO training entry point (Algorithm 1 of arXiv 2503.14476).

Until the full loop lands this runs a forward pass of the configured model to check the set-up.
"""

import argparse
import time

import torch

from model.args import get_preset, num_params
from model.qwen2 import build_model


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", default="configs/demo_cpu.toml")
    parser.add_argument("--preset", default="demo")
    args, _ = parser.parse_known_args()
    model_args = get_preset(args.preset)
    model = build_model(model_args, seed=0)
    tokens = torch.randint(0, model_args.vocab_size, (2, 64))
    start = time.perf_counter()
    with torch.no_grad():
        logits = model(tokens)
    print(f"model {args.preset}: {num_params(model_args):,} parameters; logits {tuple(logits.shape)} "
          f"in {time.perf_counter() - start:.3f}s")


if __name__ == "__main__":
    main()
