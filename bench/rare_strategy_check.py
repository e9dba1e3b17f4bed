"""The rare-strategy probe's warm-up, measured before any arm runs (bench/mechanisms.py runs it after the warm-up):
is the rare strategy rare, and is it better?

    python bench/rare_strategy_check.py --policy RUN/rare_strategy/warm-up [--out DIR] [--prompts 256]
        [--config configs/probes/rare_strategy.toml] [--section.key=value ...]

On the first `--prompts` fork training prompts (tasks/fork.py), with the warm-up's exported policy:
  * p0: the policy's probability of the rare strategy's first token after each prompt (a forward pass), mean and
    quartiles over the prompts; and the share of rollout.n free samples per prompt that choose it;
  * each strategy's accuracy with its first line forced (the prompt followed by the strategy's words, then
    rollout.n samples at the rollout's temperature), and the accuracy of the free samples by the strategy they chose.
Writes check.json into --out (default: the policy's folder), prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def first_token_probs(model, examples, token: int) -> list[float]:
    """p(token | prompt) for each example: the probability that the response starts with `token`."""
    import torch

    from trainer.losses import micro_batch_logprobs
    from trainer.packing import PackItem, pack

    probs = []
    with torch.no_grad():
        for start in range(0, len(examples), 32):
            mb = pack([PackItem(e.prompt_ids, [token]) for e in examples[start : start + 32]])
            logp, _ = micro_batch_logprobs(model, mb, with_entropy=False)
            probs += logp[:, 0].exp().tolist()
    return probs


def measure(cfg, policy_dir: str, prompts: int) -> dict:
    """The statistics of the module docstring for the policy exported in `policy_dir`."""
    from bench.ablation_task import load_policy
    from data.prompts import synthetic_task_rows
    from rl.reward import compute_score, response_text
    from tasks.fork import COMMON, RARE, STRATEGIES, response_strategy
    from trainer.rollout_phase import rollout_sampling

    tokenizer, train_set, model, engine = load_policy(cfg, policy_dir)
    kinds = {row["extra_info"]["index"]: row["extra_info"]["kind"] for row in synthetic_task_rows(cfg.data, "train")}
    examples = [e for e in train_set if kinds[e.index] == "fork"][:prompts]
    params = rollout_sampling(cfg.rollout, tokenizer.stop_ids, cfg.job.seed)
    stop = set(tokenizer.stop_ids)

    def sampled(prefix: str) -> list[tuple[str | None, bool]]:
        """(strategy, correct) of rollout.n samples per example, the response forced to start with `prefix`."""
        ids = tokenizer.encode(prefix) if prefix else []
        completions = engine.generate([e.prompt_ids + ids for e in examples], params)
        out = []
        for c in completions:
            text = prefix + response_text(tokenizer, c.token_ids, stop)
            truth = examples[c.prompt_index].ground_truth
            out.append((response_strategy(text), bool(compute_score(text, truth)["acc"])))
        return out

    model.eval()
    p0 = first_token_probs(model, examples, tokenizer.encode(RARE)[0])
    free = sampled("")
    forced = {strategy: sampled(strategy) for strategy in STRATEGIES}
    engine.shutdown()

    def accuracy(samples) -> float | None:
        return statistics.fmean(acc for _, acc in samples) if samples else None

    quartiles = statistics.quantiles(p0, n=4)
    return {
        "prompts": len(examples),
        "samples_per_prompt": params.n,
        "p_rare_mean": statistics.fmean(p0),
        "p_rare_quartiles": quartiles,
        "rare_share_free": statistics.fmean(s == RARE for s, _ in free),
        "accuracy_free": accuracy(free),
        "accuracy_free_by_strategy": {s: accuracy([x for x in free if x[0] == s]) for s in STRATEGIES},
        "accuracy_forced": {s: accuracy(samples) for s, samples in forced.items()},
        "common": COMMON,
        "rare": RARE,
    }


def print_report(stats: dict) -> None:
    pct = lambda x: "-" if x is None else f"{100 * x:.1f}%"  # noqa: E731
    rare, common = stats["rare"], stats["common"]
    q = stats["p_rare_quartiles"]
    print(f"{stats['prompts']} fork prompts x {stats['samples_per_prompt']} samples")
    print(
        f"p0 = p({rare!r} first | prompt): mean {pct(stats['p_rare_mean'])}, quartiles {pct(q[0])} / {pct(q[1])} / "
        f"{pct(q[2])}; share of free samples {pct(stats['rare_share_free'])}"
    )
    for s in (common, rare):
        print(
            f"{s!r}: accuracy forced {pct(stats['accuracy_forced'][s])}, "
            f"of the free samples that chose it {pct(stats['accuracy_free_by_strategy'][s])}"
        )
    print(f"free samples: accuracy {pct(stats['accuracy_free'])}")


def main(argv=None) -> int:
    from bench.ablation_task import policy_config
    from errors import write_atomically

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--policy", required=True, help="the probe's warm-up run folder (holding hf/)")
    parser.add_argument("--config", default=os.path.join(ROOT, "configs", "probes", "rare_strategy.toml"))
    parser.add_argument("--out", default=None, help="folder of check.json (default: --policy)")
    parser.add_argument("--prompts", type=int, default=256, help="fork training prompts to measure on")
    opts, overrides = parser.parse_known_args(argv)
    cfg, hf = policy_config(opts.policy, opts.config, overrides)
    stats = measure(cfg, hf, opts.prompts)
    print_report(stats)
    out = opts.out or opts.policy
    write_atomically(os.path.join(out, "check.json"), json.dumps(stats, indent=2) + "\n")
    print(json.dumps({"bench": "rare_strategy_check", "policy": opts.policy, **stats}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
