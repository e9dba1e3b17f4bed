"""A DAPO step of this project against TRL's `GRPOTrainer` on the same work, in one run.

Work per step, on both sides: 64 prompts x a group of 8 = 512 completions of at most 32 tokens
(temperature 1.0, top-p 1.0, no top-k), the rule reward plus the soft overlong punishment (Eq. 13),
token-level loss with clip-higher (eps_low 0.2, eps_high 0.28), truncated completions masked out,
no KL term, 2 optimizer updates of 256 completions each (AdamW, lr 1e-4, weight decay 0.1, grad-norm
clip 1.0). Both start from the same warmed-up demo policy: the demo's model trained for `--sft-steps`
supervised steps by train.py and saved with save_pretrained (config.json + safetensors + tokenizer),
and both draw prompts from the demo's synthetic training set (the same templated prompt tokens).
Each side runs its micro-batches at the same token budget: `--micro-samples` completions of at most
64 prompt + 32 response tokens (by default a whole mini-batch in one pass, on both sides).

  ours: `train.py --config configs/demo_cpu.toml` with the saved policy, dynamic sampling off (TRL has
        none), no evaluation or checkpoints; a step's time is the `time/step` of metrics.jsonl
        (generation, scoring, training, weight sync).
  TRL:  trl 1.16 `GRPOTrainer`, loss_type="dapo", epsilon_high=0.28, mask_truncated_completions=True,
        beta=0, num_generations=8, generation_batch_size=512 (two optimizer steps per generation), its
        transformers `generate` on CPU; a step's time runs from the start of the first of its two
        optimizer steps (generation included) to the end of the second.

Each side runs in its own subprocess with one torch thread, alternately `--repeats` times (the machine
may be shared: alternating spreads the neighbours' load over both); the first `--warmup` steps of every
run are left out and the median of the rest is reported. Prints a table and one JSON line.

TRL is a benchmark-only requirement (see bench/requirements-bench.txt); install it in a separate
virtual environment that sees this project's packages, then run the benchmark with that interpreter:

    python -m venv /tmp/trl-venv                    # "python": the interpreter of this project's environment
    python -c 'import site; print(site.getsitepackages()[0])' > /tmp/trl-venv/lib/python3.11/site-packages/project.pth
    /tmp/trl-venv/bin/pip install --no-deps -r bench/requirements-bench.txt
    /tmp/trl-venv/bin/python bench/vs_trl.py [--steps 4 --repeats 2 --sft-steps 200]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

PROMPTS, GROUP, UPDATES = 64, 8, 2
MAX_PROMPT, MAX_RESPONSE, OVERLONG_BUFFER = 64, 32, 8
LR, WEIGHT_DECAY, GRAD_CLIP = 1e-4, 0.1, 1.0
INSTALL_HINT = (
    "TRL is not installed in this interpreter: it is a benchmark-only requirement. Create a separate "
    "venv that sees this project's packages and run the benchmark with it (see this file's docstring): "
    "pip install --no-deps -r bench/requirements-bench.txt"
)


def run_env() -> dict:
    return dict(
        os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", PYTHONWARNINGS="ignore"
    )


def prepare_policy(workdir: str, sft_steps: int) -> str:
    """The warmed-up demo policy (HF layout) in workdir/policy, built once by train.py's supervised warm-up."""
    policy = os.path.join(workdir, "policy")
    if os.path.isfile(os.path.join(policy, "generation_config.json")):
        return policy
    run_dir = os.path.join(workdir, "prepare")
    command = [
        sys.executable,
        "train.py",
        "--config",
        "configs/demo_cpu.toml",
        "--training.steps=0",
        f"--training.sft_warmup_steps={sft_steps}",
        "--eval.at_start=false",
        "--eval.at_end=false",
        "--metrics.progress=false",
        "--checkpoint.enabled=false",
        f"--job.run_dir={run_dir}",
    ]
    done = subprocess.run(command, cwd=ROOT, env=run_env(), capture_output=True, text=True)
    if done.returncode != 0:
        sys.stderr.write(done.stdout[-3000:] + done.stderr[-3000:])
        raise SystemExit(f"preparing the warmed-up policy failed (exit {done.returncode})")
    os.replace(os.path.join(run_dir, "demo-cpu", "hf"), policy)
    from transformers import GenerationConfig

    from model.tokenizer import Tokenizer

    # transformers' generate stops at these ids (as the torch engine stops at the tokenizer's stop ids).
    stop_ids = Tokenizer.from_dir(policy).stop_ids
    GenerationConfig(eos_token_id=stop_ids, pad_token_id=stop_ids[-1]).save_pretrained(policy)
    return policy


def our_overrides(policy: str, run_dir: str, steps: int, micro_samples: int) -> list[str]:
    return [
        "--config",
        "configs/demo_cpu.toml",
        "--model.preset=",
        f"--model.hf_path={policy}",
        f"--training.steps={steps}",
        "--training.sft_warmup_steps=0",
        "--algorithm.dynamic_sampling=false",
        f"--training.train_batch_size={PROMPTS}",
        f"--training.mini_batch_size={PROMPTS // UPDATES}",
        f"--training.micro_batch_tokens={micro_samples * (MAX_PROMPT + MAX_RESPONSE)}",
        f"--rollout.n={GROUP}",
        f"--rollout.max_response_length={MAX_RESPONSE}",
        f"--data.max_prompt_length={MAX_PROMPT}",
        f"--algorithm.overlong_buffer={OVERLONG_BUFFER}",
        f"--optimizer.lr={LR}",
        "--optimizer.warmup_steps=1",
        f"--optimizer.weight_decay={WEIGHT_DECAY}",
        f"--optimizer.grad_clip={GRAD_CLIP}",
        "--job.cpu_threads=1",
        "--eval.at_start=false",
        "--eval.at_end=false",
        "--eval.interval=0",
        "--checkpoint.enabled=false",
        "--checkpoint.export_hf=false",
        "--metrics.progress=false",
        f"--job.run_dir={run_dir}",
        "--job.name=ours",
    ]


def run_ours(policy: str, workdir: str, steps: int, micro_samples: int, index: int, extra: list[str]) -> list[dict]:
    """One train.py run of `steps` DAPO steps; returns its metrics rows."""
    run_dir = os.path.join(workdir, f"ours-{index}")
    command = [sys.executable, "train.py", *our_overrides(policy, run_dir, steps, micro_samples), *extra]
    done = subprocess.run(command, cwd=ROOT, env=run_env(), capture_output=True, text=True)
    if done.returncode != 0:
        sys.stderr.write(done.stdout[-3000:] + done.stderr[-3000:])
        raise SystemExit(f"our run failed (exit {done.returncode})")
    with open(os.path.join(run_dir, "ours", "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def run_trl(policy: str, workdir: str, steps: int, micro_samples: int, index: int) -> list[dict]:
    """One TRL run (a subprocess running this file's `trl_worker`); returns one row per DAPO step."""
    out = os.path.join(workdir, f"trl-{index}.json")
    command = [sys.executable, os.path.abspath(__file__), "--trl-worker", policy, out, str(steps), str(micro_samples)]
    done = subprocess.run(command, cwd=ROOT, env=run_env(), capture_output=True, text=True)
    if done.returncode != 0:
        sys.stderr.write(done.stdout[-3000:] + done.stderr[-3000:])
        raise SystemExit(f"the TRL run failed (exit {done.returncode})")
    with open(out) as f:
        return json.load(f)


def trl_worker(policy: str, out: str, steps: int, micro_samples: int) -> None:
    """Train `steps` DAPO steps with TRL's GRPOTrainer and write each step's time and reward to `out`."""
    import torch

    torch.set_num_threads(1)
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import GRPOTrainer

    from rl.reward import compute_score, overlong_penalty

    tokenizer, rows = _trl_prompts(policy)

    def reward(completions, completion_ids, ground_truth, **_):
        """Rule reward (+1 / -1) plus the soft overlong punishment, as trainer/scoring.py computes them."""
        return [
            compute_score(text, truth)["score"] + overlong_penalty(len(ids), MAX_RESPONSE, OVERLONG_BUFFER)
            for text, ids, truth in zip(completions, completion_ids, ground_truth)
        ]

    marks: dict[int, tuple[float, float]] = {}

    class StepClock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            marks[state.global_step + 1] = (time.perf_counter(), 0.0)

        def on_step_end(self, args, state, control, **kw):
            marks[state.global_step] = (marks[state.global_step][0], time.perf_counter())

    model = AutoModelForCausalLM.from_pretrained(policy, dtype=torch.float32)
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=_grpo_config(out, steps, micro_samples),
        train_dataset=Dataset.from_list(rows),
        processing_class=tokenizer,
        callbacks=[StepClock()],
    )
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "reward" in entry]
    result = []
    for step in range(1, steps + 1):
        first, last = UPDATES * (step - 1) + 1, UPDATES * step
        result.append(
            {
                "step": step,
                "time/step": marks[last][1] - marks[first][0],
                "reward/mean": float(logs[step - 1]["reward"]) if len(logs) >= step else None,
            }
        )
    with open(out, "w") as f:
        json.dump(result, f)


def _trl_prompts(policy: str):
    """(the HF tokenizer TRL uses, the prompt rows of its data set): our training prompts as text that
    re-encodes to our prompt ids."""
    from config import load_config
    from model.tokenizer import Tokenizer
    from trainer.build import load_datasets

    ours = Tokenizer.from_dir(policy)
    cfg = load_config(
        os.path.join(ROOT, "configs", "demo_cpu.toml"),
        ["model.preset=", f"model.hf_path={policy}", f"data.max_prompt_length={MAX_PROMPT}"],
    )
    train_set, _ = load_datasets(cfg.data, ours, eval_size=cfg.eval.eval_size)
    tokenizer = ours.hf  # the transformers tokenizer our prompts were encoded with
    rows = [{"prompt": ours.decode(e.prompt_ids), "ground_truth": e.ground_truth} for e in train_set]
    for e, row in list(zip(train_set, rows))[:32]:  # TRL tokenizes the text: it must give our prompt tokens
        if tokenizer(row["prompt"], add_special_tokens=False)["input_ids"] != e.prompt_ids:
            raise SystemExit("the HF tokenizer does not re-encode the prompts to our prompt ids")
    return tokenizer, rows


def _grpo_config(out: str, steps: int, micro_samples: int):
    """TRL's settings for the same DAPO step as ours: group, clip-higher, token-level loss, no KL, same optimiser."""
    from trl import GRPOConfig

    rollout_batch = PROMPTS * GROUP
    ga = max(1, (rollout_batch // UPDATES) // micro_samples)
    return GRPOConfig(
        output_dir=os.path.join(os.path.dirname(out), "trl-out"),
        use_cpu=True,
        bf16=False,
        fp16=False,
        seed=0,
        per_device_train_batch_size=micro_samples,
        gradient_accumulation_steps=ga,
        steps_per_generation=ga * UPDATES,
        num_generations=GROUP,
        max_completion_length=MAX_RESPONSE,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        loss_type="dapo",
        epsilon=0.2,
        epsilon_high=0.28,
        beta=0.0,
        mask_truncated_completions=True,
        learning_rate=LR,
        weight_decay=WEIGHT_DECAY,
        max_grad_norm=GRAD_CLIP,
        lr_scheduler_type="constant",
        max_steps=steps * UPDATES,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        dataloader_num_workers=0,
        log_completions=False,
    )


def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=4, help="DAPO steps per run (default 4)")
    parser.add_argument("--warmup", type=int, default=1, help="first steps of each run left out (default 1)")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each side, alternating (default 2)")
    parser.add_argument("--sft-steps", type=int, default=200, help="supervised warm-up steps of the policy")
    parser.add_argument(
        "--micro-samples",
        type=int,
        default=256,
        help="completions per micro-batch on both sides (default 256: a whole mini-batch)",
    )
    parser.add_argument("--workdir", default="/tmp/vs_trl", help="policy and run folders (the policy is reused)")
    parser.add_argument("--ours-extra", default="", help="extra train.py overrides for our side, space-separated")
    return parser.parse_args()


def _print_report(opts, times: dict, rewards: dict, elapsed: float, trl_version: str) -> None:
    """The table of step times per side, their ratio, and one JSON line."""
    ours, theirs = statistics.median(times["ours"]), statistics.median(times["trl"])
    load = os.getloadavg()[0]
    print(
        f"\n{PROMPTS} prompts x {GROUP} samples, <= {MAX_RESPONSE} new tokens, {UPDATES} updates per step, "
        f"{opts.micro_samples} completions per micro-batch, 1 torch thread; median of {len(times['ours'])} steps "
        f"per side; load average {load:.1f} at the end; {elapsed:.0f} s in all"
    )
    print(f"{'side':<32}{'median s/step':>15}{'min':>8}{'max':>8}")
    for label, key in (("this project (train.py)", "ours"), (f"TRL {trl_version} GRPOTrainer", "trl")):
        print(f"{label:<32}{statistics.median(times[key]):>15.2f}{min(times[key]):>8.2f}{max(times[key]):>8.2f}")
    print(f"ratio (TRL / ours): {theirs / ours:.2f}x")
    print(
        json.dumps(
            {
                "bench": "vs_trl",
                "trl_version": trl_version,
                "prompts": PROMPTS,
                "group": GROUP,
                "updates": UPDATES,
                "micro_samples": opts.micro_samples,
                "sft_steps": opts.sft_steps,
                "ours_s_per_step": round(ours, 3),
                "trl_s_per_step": round(theirs, 3),
                "ratio": round(theirs / ours, 3),
                "ours_steps": [round(t, 3) for t in times["ours"]],
                "trl_steps": [round(t, 3) for t in times["trl"]],
                "ours_reward": rewards["ours"],
                "trl_reward": rewards["trl"],
                "load_average": round(load, 1),
                "ours_extra": opts.ours_extra,
            }
        )
    )


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--trl-worker":
        trl_worker(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
        return 0
    opts = _parse_args()
    if opts.steps <= opts.warmup:
        print(f"--steps ({opts.steps}) must exceed --warmup ({opts.warmup})", file=sys.stderr)
        return 2
    if (PROMPTS * GROUP // UPDATES) % opts.micro_samples:
        print(
            f"--micro-samples must divide the mini-batch of {PROMPTS * GROUP // UPDATES} completions", file=sys.stderr
        )
        return 2
    try:
        import trl
    except ImportError:
        print(INSTALL_HINT, file=sys.stderr)
        return 2

    os.makedirs(opts.workdir, exist_ok=True)
    policy = prepare_policy(opts.workdir, opts.sft_steps)
    times = {"ours": [], "trl": []}
    rewards = {"ours": [], "trl": []}
    start = time.perf_counter()
    for index in range(opts.repeats):
        for side in ("ours", "trl"):
            if side == "ours":
                rows = run_ours(policy, opts.workdir, opts.steps, opts.micro_samples, index, opts.ours_extra.split())
            else:
                rows = run_trl(policy, opts.workdir, opts.steps, opts.micro_samples, index)
            times[side] += [r["time/step"] for r in rows[opts.warmup :]]
            rewards[side].append([round(r["reward/mean"], 3) for r in rows])
            print(
                f"run {index + 1}/{opts.repeats} {side}: step times "
                f"{', '.join(format(r['time/step'], '.2f') for r in rows)} s",
                flush=True,
            )
    _print_report(opts, times, rewards, time.perf_counter() - start, trl.__version__)
    return 0


if __name__ == "__main__":
    sys.exit(main())
