"""What the ablation's CPU task gives each DAPO technique to act on, measured on the warmed-up policy
before any technique is judged: one generation round of the rollout settings on training prompts.

    python bench/ablation_task.py --policy RUN_DIR/seed-0/warm-up [--prompts 256]
        [--config configs/ablation_cpu.toml] [--section.key=value ...]

RUN_DIR/seed-0/warm-up is the shared warm-up run of bench/ablation.py (its `hf/` export is the policy).
Reported, over every generated sample and group:
  * response lengths (mean, p10 / p50 / p90, max) and their spread within a group (mean over groups of the
    longest minus the shortest, and of the standard deviation): what the token-level loss weighs differently;
  * the share of samples that reach the budget (truncated: overlong filtering masks them, and a truncated
    answer scores -1) and of samples inside the soft punishment's buffer (Eq. 13 lowers their reward);
  * the share of tokens in truncated samples (their weight under the token-level mean) next to their share
    of samples (their weight under the sample-level mean);
  * the share of all-correct and all-wrong groups (dynamic sampling drops both);
  * accuracy, length and truncation per number of terms, and how often each solution style is written.
Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

_TERMS = re.compile(r"What is ([0-9 +]+)\?")
_EQUATION = re.compile(r"^\s*\d+(?: \+ \d+)+ = \d+\s*$")


def problem_terms(example) -> int:
    """The number of terms of a chain-sum prompt ("What is 3 + 4 + 5?" -> 3); 0 when it is not one."""
    match = _TERMS.search(example.messages[-1]["content"])
    return len(match.group(1).split("+")) if match else 0


def response_style(text: str, terms: int, truncated: bool) -> str:
    """Which of rl/synthetic_chain.py's styles a response follows, from its equation lines: "direct" (one line
    adding every term), "stepwise" (terms - 1 lines), "split" (more), "truncated", or "other"."""
    if truncated:
        return "truncated"
    lines = [line for line in text.split("\n") if _EQUATION.match(line)]
    if len(lines) == 1 and lines[0].count("+") == terms - 1 and terms > 2:
        return "direct"
    if len(lines) == terms - 1:
        return "stepwise"  # for two terms the direct and stepwise styles are the same line
    if len(lines) > terms - 1:
        return "split"
    return "other"


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _share(count: float, total: float) -> float:
    return count / total if total else float("nan")


def task_statistics(groups, *, max_response_length: int, overlong_buffer: int, texts=None) -> dict:
    """The statistics of the module docstring for scored `groups` (rl.filter.ScoredGroup of
    trainer.scoring.Sample). texts: each sample's response text in group order (None: no style shares)."""
    samples = [s for g in groups for s in g.payload]
    lengths = [len(s.response_ids) for s in samples]
    truncated = [s.finish_reason == "length" for s in samples]
    punished_from = max_response_length - overlong_buffer
    group_lengths = [[len(s.response_ids) for s in g.payload] for g in groups]
    spreads = [max(lengths) - min(lengths) for lengths in group_lengths]
    stds = [statistics.pstdev(lengths) for lengths in group_lengths]
    stats = {
        "samples": len(samples),
        "groups": len(groups),
        "accuracy": _share(sum(s.acc for s in samples), len(samples)),
        "length_mean": statistics.fmean(lengths),
        "length_p10": _percentile(lengths, 0.1),
        "length_p50": _percentile(lengths, 0.5),
        "length_p90": _percentile(lengths, 0.9),
        "length_max": max(lengths),
        "group_length_range_mean": statistics.fmean(spreads),
        "group_length_std_mean": statistics.fmean(stds),
        "truncated_share": _share(sum(truncated), len(samples)),
        "in_buffer_share": _share(sum(punished_from < n and not t for n, t in zip(lengths, truncated)), len(samples)),
        "truncated_token_share": _share(sum(n for n, t in zip(lengths, truncated) if t), sum(lengths)),
        "all_correct_share": _share(sum(all(g.acc) for g in groups), len(groups)),
        "all_wrong_share": _share(sum(not any(g.acc) for g in groups), len(groups)),
    }
    by_terms: dict[int, list] = {}
    for g in groups:
        by_terms.setdefault(problem_terms(g.payload[0].example), []).extend(g.payload)
    stats["by_terms"] = {
        k: {
            "samples": len(group),
            "accuracy": _share(sum(s.acc for s in group), len(group)),
            "length_mean": statistics.fmean(len(s.response_ids) for s in group),
            "truncated_share": _share(sum(s.finish_reason == "length" for s in group), len(group)),
        }
        for k, group in sorted(by_terms.items())
    }
    if texts is not None:
        styles = [
            response_style(text, problem_terms(s.example), s.finish_reason == "length")
            for s, text in zip(samples, texts)
        ]
        stats["style_shares"] = {name: _share(styles.count(name), len(styles)) for name in sorted(set(styles))}
    return stats


def policy_config(policy: str, config: str, overrides: list[str]):
    """(the configuration `config` with the --section.key=value `overrides` and the exported policy of the warm-up
    run folder `policy` as its model, that export's folder); torch set to the configuration's threads. Bad input
    is one line on stderr and exit code 2."""
    from config import ConfigError, load_config

    hf = os.path.join(policy, "hf")
    try:
        if not os.path.isfile(os.path.join(hf, "config.json")):
            raise ConfigError(f"no HF export at {hf}: run the warm-up first")
        cfg = load_config(config, ["model.preset=", f"model.hf_path={hf}", *[o[2:] for o in overrides]])
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    import torch

    torch.set_num_threads(max(cfg.job.cpu_threads, 1))
    return cfg, hf


def load_policy(cfg, policy_dir: str):
    """The policy exported in `policy_dir` (cfg.model.hf_path) with the tokenizer beside it, the training prompts
    of cfg, and a rollout engine over the policy (guarded: it generates): (tokenizer, train_set, model, engine)."""
    import torch

    from checkpoint.sharded_policy import build_policy
    from parallel.dist_env import init_distributed
    from rollout.engine_spec import EngineSpec
    from run.guard import GuardedEngine
    from trainer.build import build_tokenizer, load_datasets

    torch.manual_seed(cfg.job.seed)
    dist = init_distributed(1, -1, 1)
    tokenizer = build_tokenizer(cfg.model, cfg.data, policy_dir, is_main=True, barrier=lambda: None)
    train_set, _ = load_datasets(cfg.data, tokenizer)
    model = build_policy(cfg.model, dist.device, seed=cfg.job.seed)
    return tokenizer, train_set, model, GuardedEngine(EngineSpec.from_config(cfg).start_beside(model, dist))


def generate(cfg, policy_dir: str, prompts: int):
    """One generation round of `prompts` training prompts x rollout.n samples from the policy in
    `policy_dir`/hf, scored with the configuration's reward; returns (groups, response texts)."""
    from data.prompts import PromptSampler
    from rl.reward import response_text
    from trainer.rollout_phase import rollout_sampling
    from trainer.scoring import score_groups

    tokenizer, train_set, _, engine = load_policy(cfg, policy_dir)
    params = rollout_sampling(cfg.rollout, tokenizer.stop_ids, cfg.job.seed)
    sampler = PromptSampler(train_set, seed=cfg.data.seed, shuffle=cfg.data.shuffle)
    examples = sampler.next_batch(prompts)
    completions = engine.generate([e.prompt_ids for e in examples], params)
    groups = score_groups(examples, completions, tokenizer, cfg)
    stop = set(tokenizer.stop_ids)
    texts = [response_text(tokenizer, s.response_ids, stop) for g in groups for s in g.payload]
    engine.shutdown()
    return groups, texts


def print_report(stats: dict) -> None:
    pct = lambda x: f"{100 * x:.1f}%"  # noqa: E731
    print(f"{stats['groups']} prompts x {stats['samples'] // max(stats['groups'], 1)} samples")
    print(
        f"response length: mean {stats['length_mean']:.1f}, p10 / p50 / p90 {stats['length_p10']} / "
        f"{stats['length_p50']} / {stats['length_p90']}, max {stats['length_max']} tokens"
    )
    print(
        f"within a group: longest - shortest {stats['group_length_range_mean']:.1f} tokens, "
        f"std {stats['group_length_std_mean']:.1f} tokens (means over groups)"
    )
    print(
        f"truncated: {pct(stats['truncated_share'])} of samples, {pct(stats['truncated_token_share'])} of tokens; "
        f"inside the punishment buffer (not truncated): {pct(stats['in_buffer_share'])}"
    )
    print(
        f"accuracy {pct(stats['accuracy'])}; groups all correct {pct(stats['all_correct_share'])}, "
        f"all wrong {pct(stats['all_wrong_share'])}"
    )
    print(f"{'terms':>5} {'samples':>8} {'accuracy':>9} {'length':>7} {'truncated':>10}")
    for k, row in stats["by_terms"].items():
        print(
            f"{k:>5} {row['samples']:>8} {pct(row['accuracy']):>9} {row['length_mean']:>7.1f} "
            f"{pct(row['truncated_share']):>10}"
        )
    if "style_shares" in stats:
        print("styles: " + ", ".join(f"{name} {pct(share)}" for name, share in stats["style_shares"].items()))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--policy", required=True, help="a warm-up run folder holding hf/ (bench/ablation.py)")
    parser.add_argument("--config", default=os.path.join(ROOT, "configs", "ablation_cpu.toml"))
    parser.add_argument("--prompts", type=int, default=256, help="training prompts to generate for")
    opts, overrides = parser.parse_known_args(argv)
    cfg, hf = policy_config(opts.policy, opts.config, overrides)
    groups, texts = generate(cfg, hf, opts.prompts)
    stats = task_statistics(
        groups,
        max_response_length=cfg.rollout.max_response_length,
        overlong_buffer=cfg.algorithm.overlong_buffer,
        texts=texts,
    )
    print_report(stats)
    print(json.dumps({"bench": "ablation_task", "policy": opts.policy, **stats}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
