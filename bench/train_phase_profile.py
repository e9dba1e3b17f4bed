"""Where the training phase of a DAPO step spends its time, at the CPU demo's shape.

One batch of 64 prompts x 8 samples is generated once by the torch engine from the warmed-up demo policy
of bench/vs_trl.py (made there if missing); then `TrainPhase.run` (old log-probs, packing, the two
mini-batch updates) is profiled on that same batch under each variant of the settings, with the process's
CPU time (one torch thread, so the neighbours of a shared machine disturb it less than wall time).
Prints a table of CPU seconds per piece for every variant and one JSON line.

    python bench/train_phase_profile.py [--workdir /tmp/vs_trl] [--repeats 3]
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import json
import os
import pstats
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from bench.vs_trl import GROUP, MAX_RESPONSE, OVERLONG_BUFFER, PROMPTS, UPDATES, prepare_policy  # noqa: E402

# before: pi_old recomputed, one prompt copy per sample; then the engine's log-probs as pi_old
# (algorithm.old_logprobs = "auto"); then also one prompt copy per group (training.share_prompts, the default).
VARIANTS = {
    "before": ["algorithm.old_logprobs=recompute", "training.share_prompts=false"],
    "+ engine pi_old": ["training.share_prompts=false"],
    "+ shared prompts": [],
}
# (label, function name as cProfile reports it, file suffix): cumulative CPU time of each.
PIECES = [
    ("old log-prob pass", "fill_old_logprobs", "trainer/update.py"),
    ("packing", "pack_micro_batches", "trainer/packing.py"),
    ("loss forward", "dapo_micro_batch_loss", "trainer/losses.py"),
    ("output head + log-prob (all passes)", "token_logprobs", "model/logprob.py"),
    ("attention (all passes)", "attend", ".py"),
    ("backward", "backward", "torch/_tensor.py"),
    ("grad clip + AdamW", "_clip_and_step", "trainer/update.py"),
]


def build(policy: str, micro_batch_tokens: int, extra: list[str]):
    from config import load_config
    from parallel.dist_env import init_distributed
    from rl.data import PromptSampler
    from rl.filter import DynamicBatchBuilder
    from rollout.engine import SamplingParams
    from trainer.rollout_phase import collect_batch
    from trainer.scoring import RewardSettings
    from trainer.setup import build_engine, build_policy, build_tokenizer, load_datasets

    cfg = load_config(
        os.path.join(ROOT, "configs", "demo_cpu.toml"),
        [
            "model.preset=",
            f"model.hf_path={policy}",
            "training.sft_warmup_steps=0",
            "algorithm.dynamic_sampling=false",
            f"training.train_batch_size={PROMPTS}",
            f"training.mini_batch_size={PROMPTS // UPDATES}",
            f"training.micro_batch_tokens={micro_batch_tokens}",
            f"rollout.n={GROUP}",
            f"rollout.max_response_length={MAX_RESPONSE}",
            f"algorithm.overlong_buffer={OVERLONG_BUFFER}",
            *extra,
        ],
    )
    torch.manual_seed(0)
    dist = init_distributed(1, -1, 1)
    tokenizer = build_tokenizer(cfg.model, cfg.data, policy, is_main=True, barrier=lambda: None)
    train_set, _ = load_datasets(cfg.data, tokenizer, eval_size=cfg.eval.eval_size)
    model = build_policy(cfg.model, dist.device, seed=cfg.job.seed)
    engine = build_engine(cfg, model, dist.device, cfg.data.max_prompt_length, dist)
    builder = DynamicBatchBuilder(PROMPTS, 1, on_shortfall="fill", max_staleness=0, enabled=False, metric="acc")
    params = SamplingParams(
        max_new_tokens=MAX_RESPONSE, temperature=1.0, top_p=1.0, n=GROUP, stop_token_ids=tokenizer.stop_ids, seed=0
    )
    reward = RewardSettings(MAX_RESPONSE, True, OVERLONG_BUFFER, 1.0, False)
    sampler = PromptSampler(train_set, seed=0, shuffle=True, dp_rank=0, dp_size=1)
    groups, _, _ = collect_batch(1, builder, engine, sampler, PROMPTS, params, tokenizer, reward, dist)
    return cfg, dist, model, groups


def profile_variant(cfg, dist, model, groups, extra: list[str], repeats: int) -> dict:
    """The fastest of `repeats` profiled TrainPhase.run calls on `groups`, from the same start weights."""
    from trainer.update import TrainPhase

    cfg = copy.deepcopy(cfg)
    for item in extra:  # "section.key=value", strings and booleans only
        key, value = item.split("=", 1)
        section, name = key.split(".")
        setattr(getattr(cfg, section), name, {"true": True, "false": False}.get(value, value))
    start_state = copy.deepcopy(model.state_dict())
    runs = []
    for attempt in range(repeats + 1):  # the first run warms the allocator up and is not counted
        model.load_state_dict(start_state)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
        phase = TrainPhase.from_config(model, optimizer, scheduler, cfg, dist, dist.device)
        profiler = cProfile.Profile(time.process_time)
        cpu, wall = time.process_time(), time.perf_counter()
        profiler.enable()
        stats = phase.run(1, groups)
        profiler.disable()
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
        table = pstats.Stats(profiler).stats
        pieces = {
            label: sum(
                v[3] for (path, _, fn), v in table.items() if fn == name and path.replace(os.sep, "/").endswith(where)
            )
            for label, name, where in PIECES
        }
        if attempt:
            runs.append({"cpu_s": cpu, "wall_s": wall, "pieces": pieces, "loss": stats["loss"]})
    model.load_state_dict(start_state)
    return min(runs, key=lambda run: run["cpu_s"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", default="/tmp/vs_trl", help="where bench/vs_trl.py keeps the warmed-up policy")
    parser.add_argument("--sft-steps", type=int, default=200)
    parser.add_argument("--micro-batch-tokens", type=int, default=512, help="default: the CPU demo's 512")
    parser.add_argument("--repeats", type=int, default=3, help="profiled runs per variant; the fastest is kept")
    opts = parser.parse_args()
    torch.set_num_threads(1)
    os.makedirs(opts.workdir, exist_ok=True)
    policy = prepare_policy(opts.workdir, opts.sft_steps)
    cfg, dist, model, groups = build(policy, opts.micro_batch_tokens, [])
    tokens = sum(len(s.response_ids) for g in groups for s in g.payload)
    results = {name: profile_variant(cfg, dist, model, groups, extra, opts.repeats) for name, extra in VARIANTS.items()}
    print(
        f"training phase of one step: {PROMPTS} prompts x {GROUP} samples ({tokens} response tokens), "
        f"{UPDATES} updates, micro-batches of <= {opts.micro_batch_tokens} tokens, 1 thread; CPU seconds, "
        f"fastest of {opts.repeats}"
    )
    names = list(results)
    print(f"{'piece':<36}" + "".join(f"{n:>20}" for n in names))
    for label, _, _ in PIECES:
        print(f"{label:<36}" + "".join(f"{results[n]['pieces'][label]:>20.3f}" for n in names))
    print(f"{'whole training phase (CPU s)':<36}" + "".join(f"{results[n]['cpu_s']:>20.3f}" for n in names))
    print(f"{'whole training phase (wall s)':<36}" + "".join(f"{results[n]['wall_s']:>20.3f}" for n in names))
    print(f"{'loss':<36}" + "".join(f"{results[n]['loss']:>20.6f}" for n in names))
    base = results[names[0]]["cpu_s"]
    print(f"{'speed-up over before (CPU time)':<36}" + "".join(f"{base / results[n]['cpu_s']:>19.2f}x" for n in names))
    print(
        json.dumps(
            {
                "bench": "train_phase_profile",
                "micro_batch_tokens": opts.micro_batch_tokens,
                "response_tokens": tokens,
                "variants": {
                    n: {
                        "cpu_s": round(r["cpu_s"], 3),
                        "wall_s": round(r["wall_s"], 3),
                        "loss": r["loss"],
                        "pieces": {k: round(v, 3) for k, v in r["pieces"].items()},
                    }
                    for n, r in results.items()
                },
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
