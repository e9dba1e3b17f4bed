"""Where a DAPO step spends its time: the training phase at the CPU demo's shape, or a whole step (generation
and training) at the shape of any configuration (the ablation ladder's rungs: configs/ablation_cpu.toml).

One batch is generated once by the torch engine from a warmed-up policy: the demo policy of bench/vs_trl.py
(made there if missing), or `--policy` (an HF checkpoint, e.g. the `hf/` of bench/ablation.py's warm-up run)
with `--config`'s shapes. Then `TrainPhase.run` (old log-probs, packing, the mini-batch updates) is profiled on
that same batch under each variant of the settings, with the process's CPU time (one torch thread, so the
neighbours of a shared machine disturb it less than wall time); with `--policy`, the generation call is
profiled the same way. Prints a table of CPU seconds per piece for every variant and one JSON line.

    python bench/train_phase_profile.py [--workdir /tmp/vs_trl] [--repeats 3]
    python bench/train_phase_profile.py --config configs/ablation_cpu.toml --policy runs/ablation/seed-0/warm-up/hf
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import dataclasses
import functools
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
    ("loss forward", "__call__", "trainer/losses.py"),  # DAPOLoss.__call__
    ("output head + log-prob (all passes)", "token_logprobs", "model/logprob.py"),
    ("attention (all passes)", "attend", ".py"),
    ("backward", "backward", "torch/_tensor.py"),
    ("grad clip + AdamW", "__call__", "trainer/optimizer.py"),  # OptimizerStep.__call__
]
GENERATION_PIECES = [
    ("prefill", "_prefill_logits", "rollout/torch_engine.py"),
    ("decode forward", "_decode_logits", "rollout/torch_engine.py"),
    ("decode attention (KV gather + attend)", "attend", "rollout/kv_cache.py"),
    ("decode inputs (block tables)", "_decode_batch", "rollout/torch_engine.py"),
    ("sampling + bookkeeping", "_sample_into", "rollout/torch_engine.py"),
]


def demo_overrides(policy: str, micro_batch_tokens: int) -> list[str]:
    """The CPU demo at bench/vs_trl.py's shape, from its warmed-up policy."""
    return [
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
    ]


def build(config: str, overrides: list[str]):
    """The configuration, the policy and its engine, and one generated batch of train_batch_size prompts
    (one round, no dynamic sampling): (cfg, dist, model, engine, groups, prompts, sampling params)."""
    from checkpoint.sharded_policy import build_policy
    from config import load_config
    from data.prompts import PromptSampler
    from parallel.dist_env import init_distributed
    from rollout.engine_spec import EngineSpec
    from run.guard import GuardedEngine
    from trainer.build import build_tokenizer, load_datasets
    from trainer.rollout_phase import rollout_sampling
    from trainer.scoring import score_groups

    cfg = load_config(config, overrides)
    torch.manual_seed(0)
    dist = init_distributed(1, -1, 1)
    tokenizer = build_tokenizer(cfg.model, cfg.data, cfg.model.hf_path, is_main=True, barrier=lambda: None)
    train_set, _ = load_datasets(cfg.data, tokenizer, eval_size=cfg.eval.eval_size)
    model = build_policy(cfg.model, dist.device, seed=cfg.job.seed)
    engine = GuardedEngine(EngineSpec.from_config(cfg).start_beside(model, dist))
    prompts = cfg.training.train_batch_size
    params = rollout_sampling(cfg.rollout, tokenizer.stop_ids, seed=0)
    sampler = PromptSampler(train_set, seed=0, shuffle=True, dp_rank=0, dp_size=1)
    examples = sampler.next_batch(prompts)
    completions = engine.generate([e.prompt_ids for e in examples], params)
    unboxed = dataclasses.replace(cfg, algorithm=dataclasses.replace(cfg.algorithm, strict_box=False))
    groups = score_groups(examples, completions, tokenizer, unboxed, step=1)
    batch = [g.payload[0].example.prompt_ids for g in groups]
    return cfg, dist, model, engine, groups, batch, params


def _profiled(call, pieces):
    """(result, CPU s, wall s, {label: cumulative CPU s}) of `call()` under cProfile with the CPU clock."""
    profiler = cProfile.Profile(time.process_time)
    cpu, wall = time.process_time(), time.perf_counter()
    profiler.enable()
    result = call()
    profiler.disable()
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    table = pstats.Stats(profiler).stats
    found = {
        label: sum(
            v[3] for (path, _, fn), v in table.items() if fn == name and path.replace(os.sep, "/").endswith(where)
        )
        for label, name, where in pieces
    }
    return result, cpu, wall, found


def profile_generation(engine, prompts, params, repeats: int) -> dict:
    """The fastest of `repeats` profiled generate calls of the batch's prompts (the same seed each time)."""
    runs = []
    for attempt in range(repeats + 1):  # the first call warms the allocator up and is not counted
        completions, cpu, wall, pieces = _profiled(lambda: engine.generate(prompts, params), GENERATION_PIECES)
        if attempt:
            tokens = sum(len(c.token_ids) for c in completions)
            runs.append({"cpu_s": cpu, "wall_s": wall, "pieces": pieces, "tokens": tokens})
    return min(runs, key=lambda run: run["cpu_s"])


def profile_variant(cfg, dist, model, groups, extra: list[str], repeats: int) -> dict:
    """The fastest of `repeats` profiled TrainPhase.run calls on `groups`, from the same start weights."""
    from trainer.observers import TrainWatch, no_display
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
        opt = cfg.optimizer
        optimizer = torch.optim.AdamW(model.parameters(), lr=opt.lr, weight_decay=opt.weight_decay)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
        phase = TrainPhase(cfg, model, optimizer, scheduler, dist, TrainWatch(no_display))
        stats, cpu, wall, pieces = _profiled(functools.partial(phase.run, 1, groups), PIECES)
        if attempt:
            runs.append({"cpu_s": cpu, "wall_s": wall, "pieces": pieces, "loss": stats.loss})
    model.load_state_dict(start_state)
    return min(runs, key=lambda run: run["cpu_s"])


def print_table(title: str, pieces, results: dict, whole: str, value_key: str | None = None) -> None:
    print(title)
    names = list(results)
    print(f"{'piece':<40}" + "".join(f"{n:>20}" for n in names))
    for label, _, _ in pieces:
        print(f"{label:<40}" + "".join(f"{results[n]['pieces'][label]:>20.3f}" for n in names))
    print(f"{f'whole {whole} (CPU s)':<40}" + "".join(f"{results[n]['cpu_s']:>20.3f}" for n in names))
    print(f"{f'whole {whole} (wall s)':<40}" + "".join(f"{results[n]['wall_s']:>20.3f}" for n in names))
    if value_key:
        print(f"{value_key:<40}" + "".join(f"{results[n][value_key]:>20.6f}" for n in names))


def _rounded(run: dict) -> dict:
    return dict(
        run,
        cpu_s=round(run["cpu_s"], 3),
        wall_s=round(run["wall_s"], 3),
        pieces={k: round(v, 3) for k, v in run["pieces"].items()},
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", default="/tmp/vs_trl", help="where bench/vs_trl.py keeps the warmed-up policy")
    parser.add_argument("--sft-steps", type=int, default=200)
    parser.add_argument("--micro-batch-tokens", type=int, default=512, help="demo shape only; default 512")
    parser.add_argument("--repeats", type=int, default=3, help="profiled runs per variant; the fastest is kept")
    parser.add_argument("--config", default=None, help="profile a step of this configuration (with --policy)")
    parser.add_argument("--policy", default=None, help="an HF checkpoint to start from (with --config)")
    opts = parser.parse_args()
    if (opts.config is None) != (opts.policy is None):
        parser.error("--config and --policy go together")
    torch.set_num_threads(1)
    if opts.policy is None:
        os.makedirs(opts.workdir, exist_ok=True)
        policy = prepare_policy(opts.workdir, opts.sft_steps)
        config, overrides = (
            os.path.join(ROOT, "configs", "demo_cpu.toml"),
            demo_overrides(policy, opts.micro_batch_tokens),
        )
    else:
        config = opts.config
        overrides = ["model.preset=", f"model.hf_path={opts.policy}", "training.sft_warmup_steps=0"]
        overrides += ["algorithm.dynamic_sampling=false"]
    cfg, dist, model, engine, groups, prompts, params = build(config, overrides)
    tokens = sum(len(s.response_ids) for g in groups for s in g.payload)
    out = {"bench": "train_phase_profile", "config": os.path.relpath(config, ROOT), "response_tokens": tokens}
    if opts.policy is not None:
        generation = {"as configured": profile_generation(engine, prompts, params, opts.repeats)}
        print_table(
            f"generation of one step: {len(prompts)} prompts x {params.n} samples (budget {params.max_new_tokens} "
            f"tokens), 1 thread; CPU seconds, fastest of {opts.repeats}",
            GENERATION_PIECES,
            generation,
            "generation",
        )
        out["generation"] = _rounded(generation["as configured"])
    results = {name: profile_variant(cfg, dist, model, groups, extra, opts.repeats) for name, extra in VARIANTS.items()}
    training = cfg.training
    print_table(
        f"training phase of one step: {len(groups)} prompts x {params.n} samples ({tokens} response tokens), "
        f"{training.train_batch_size // training.mini_batch_size} updates, micro-batches of <= "
        f"{training.micro_batch_tokens} tokens, 1 thread; CPU seconds, fastest of {opts.repeats}",
        PIECES,
        results,
        "training phase",
        "loss",
    )
    names = list(results)
    base = results[names[0]]["cpu_s"]
    print(f"{'speed-up over before (CPU time)':<40}" + "".join(f"{base / results[n]['cpu_s']:>19.2f}x" for n in names))
    out["micro_batch_tokens"] = training.micro_batch_tokens
    out["variants"] = {n: _rounded(r) for n, r in results.items()}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
