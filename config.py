"""Run configuration: one dataclass per TOML section, loading, command-line overrides, validation.

A run is described by a TOML file whose tables are the sections below (`[job]`, `[model]`, ...). Every
key has a default here, so a file holds only what it changes. Values are resolved in this order, the
later winning:
  1. the defaults below (for the algorithm: the DAPO recipe, arXiv 2503.14476 Sec. 4.1 and verl's script);
  2. the file named by a top-level `base = "other.toml"` key (resolved relative to the file that names
     it; bases may chain);
  3. the file itself;
  4. command-line overrides `--section.key=value` or `--section.key value`.
Each value is checked against its field's annotation, then the whole configuration is validated. Any
problem raises `ConfigError` naming the key, where it was set and what is wrong.

Settings that only matter when training starts (model and data paths) may stay unset in a recipe:
`check_runnable(cfg)` refuses them just before training, so `--dry-run` works on shipped recipes.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import math
import os
import sys
import tomllib
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

from model.args import PRESETS
from rl.data import SYNTHETIC_LEVELS, synthetic_problem_limit

DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs", "demo_cpu.toml")
DType = Literal["float32", "bfloat16"]
LossAgg = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm",
                  "group-token-mean"]


class ConfigError(ValueError):
    """A configuration problem; the message names the key, its source and the failed rule."""


@dataclass
class JobConfig:
    name: str = "dapo"  # run name; the run's folder is run_dir/name
    run_dir: str = "runs"  # root folder holding one folder per run
    seed: int = 0  # seed for model initialisation and sampling
    cpu_threads: int = 0  # intra-op threads of each process (torch.set_num_threads); 0 = torch's default

    @property
    def run_path(self) -> str:
        return os.path.join(self.run_dir, self.name)


@dataclass
class ModelConfig:
    preset: str = ""  # a name from model/args.py PRESETS (random init); "" = use hf_path
    hf_path: str = ""  # HF checkpoint directory (config.json + safetensors); "" = use preset
    tokenizer_path: str = ""  # tokenizer.json directory; "" = hf_path's, or a BPE trained on the synthetic task
    dtype: DType = "float32"  # dtype of trained parameters and optimizer state (compute: parallelism.param_dtype)
    attention_backend: Literal["auto", "sdpa", "flex"] = "auto"  # auto: FlexAttention on CUDA, SDPA on CPU


@dataclass
class DataConfig:
    train_path: str = "synthetic"  # parquet in the DAPO-Math-17k schema, or "synthetic" (built-in arithmetic)
    eval_path: str = "synthetic"  # held-out set in the same schema (AIME 2024 in the paper), or "synthetic"
    max_prompt_length: int = 2048  # prompt tokens after the chat template
    prompt_overflow: Literal["truncate_left", "drop"] = "truncate_left"  # what to do with longer prompts
    synthetic_difficulty: int = 2  # level of the synthetic arithmetic task (rl/data.py SYNTHETIC_LEVELS)
    synthetic_num_train: int = 2000  # synthetic training problems
    synthetic_num_eval: int = 200  # synthetic held-out problems (disjoint from training)
    synthetic_answer_share: float = 1.0  # share of synthetic worked solutions ending in the "Answer:" line (rest: prose)
    shuffle: bool = True  # reshuffle the prompts every pass over the data
    seed: int = 0  # seed for shuffling and for generating the synthetic task


@dataclass
class RolloutConfig:
    engine: Literal["torch", "sglang"] = "torch"  # rollout/torch_engine.py or rollout/sglang_engine.py
    n: int = 16  # samples per prompt: the group size G
    temperature: float = 1.0  # sampling temperature (0 = greedy)
    top_p: float = 1.0  # nucleus sampling mass, in (0, 1]
    top_k: int = -1  # keep the k most likely tokens; -1 = off
    max_response_length: int = 20480  # L_max of Eq. 13: generation stops after this many tokens
    gen_batch_multiplier: int = 3  # with dynamic sampling, prompts per round = this x train_batch_size
    tp_size: int = 1  # tensor-parallel size of one engine instance
    mem_fraction_static: float = 0.8  # share of GPU memory the engine may hold (weights + KV cache)
    dtype: Literal["float32", "bfloat16", "float16"] = "bfloat16"  # engine weights and activations
    compile: bool = True  # torch.compile the torch engine's decode step
    cuda_graphs: bool = True  # capture the decode step in CUDA graphs (CUDA only)
    weight_sync_bucket_mb: int = 1024  # bucket size of the trainer -> engine weight copy
    round_timeout_s: int = 21600  # longest a rank waits for the others' generation (gloo control groups)
    max_batch_size: int = 512  # most sequences the torch engine decodes at once
    block_size: int = 16  # torch engine: token positions per paged KV-cache block
    kv_cache_blocks: int = 0  # torch engine KV memory, in blocks of block_size tokens; 0 = max_batch_size full sequences
    flex_decode: bool = False  # torch engine on CUDA: FlexAttention decode over the KV blocks (not yet run on a GPU)


@dataclass
class AlgorithmConfig:
    clip_low: float = 0.2  # eps_low of Eq. 10: ratios below 1 - eps_low are clipped
    clip_high: float = 0.28  # eps_high of Eq. 10 (clip-higher): ratios above 1 + eps_high are clipped
    clip_c: float = 10.0  # dual-clip bound c for negative advantages (> 1)
    loss_agg: LossAgg = "token-mean"  # loss aggregation; token-mean is DAPO's token-level loss (Sec. 3.3)
    overlong_filter: bool = False  # give truncated samples loss mask 0 (Sec. 3.4)
    overlong_penalty: bool = True  # add the soft overlong punishment of Eq. 13 to the reward
    overlong_buffer: int = 4096  # L_cache of Eq. 13, in tokens
    overlong_penalty_factor: float = 1.0  # penalty at and beyond L_max (Eq. 13 uses 1)
    dynamic_sampling: bool = True  # keep only groups with 0 < #correct < G (Eq. 11)
    filter_metric: Literal["acc", "score"] = "acc"  # what must vary within a kept group
    max_num_gen_batches: int = 10  # generation rounds per step before on_shortfall applies
    on_shortfall: Literal["fill", "raise"] = "fill"  # batch not full after the last round: train on it, or stop
    carry_over_max_staleness: int = 1  # steps a surplus kept group may wait for the next batch (0 = drop)
    adv_eps: float = 1e-6  # eps of Eq. 9: A = (R - mean) / (std + eps)
    norm_adv_by_std: bool = True  # divide advantages by the group std (false: Dr. GRPO)
    truncated_is: bool = False  # weight tokens by min(pi_old / pi_rollout, cap) (truncated importance sampling)
    truncated_is_cap: float = 2.0  # cap of the truncated importance weight
    strict_box: bool = False  # reward only a \boxed{} answer (strict mode of the math scorer)
    kl_coef: float = 0.0  # KL penalty: DAPO has none (Sec. 2.3), so only 0 is accepted


@dataclass
class OptimizerConfig:
    lr: float = 1e-6  # AdamW learning rate, constant after warm-up
    betas: tuple[float, float] = (0.9, 0.999)  # AdamW (beta1, beta2)
    eps: float = 1e-8  # AdamW epsilon
    weight_decay: float = 0.1  # decoupled weight decay
    warmup_steps: int = 20  # linear warm-up, in rollout steps
    grad_clip: float = 1.0  # max global gradient norm; 0 = no clipping (the norm is still logged)


@dataclass
class TrainingConfig:
    steps: int = 100  # rollout steps (Algorithm 1 iterations)
    train_batch_size: int = 512  # prompts (groups) per step
    mini_batch_size: int = 32  # prompts per optimizer update: train_batch_size / this updates per epoch
    micro_batch_tokens: int = 22528  # token budget of one packed micro-batch (>= longest prompt + response)
    ppo_epochs: int = 1  # passes over each step's batch
    sft_warmup_steps: int = 0  # supervised steps on solved examples before DAPO (0 = none)
    sft_lr: float = 1e-4  # learning rate of the supervised warm-up
    sft_batch_size: int = 32  # examples per supervised step
    max_nonfinite_steps: int = 3  # abort after this many non-finite updates in a row


@dataclass
class ParallelismConfig:
    dp_replicate: int = 1  # data-parallel replicas (HSDP outer dimension)
    dp_shard: int = -1  # FSDP shard degree; -1 = all ranks left after dp_replicate and tp
    tp: int = 1  # tensor-parallel degree of the trainer
    param_dtype: DType = "bfloat16"  # FSDP mixed precision: compute dtype of gathered parameters
    reduce_dtype: DType = "float32"  # FSDP mixed precision: dtype of gradient reduce-scatter
    reshard_after_forward: bool = True  # free gathered parameters after each block's forward
    cpu_offload: bool = False  # keep sharded parameters, gradients and optimizer state in host memory
    compile: bool = False  # torch.compile each transformer block
    activation_checkpoint: Literal["none", "full", "selective"] = "none"  # recompute activations in backward
    ac_every_k_blocks: int = 0  # "selective": 0 = per-operator policy, k >= 1 = every k-th block in full
    float8: bool = False  # float8 linear layers through torchao (CUDA only)


@dataclass
class CheckpointConfig:
    enabled: bool = True  # write distributed checkpoints into the run folder
    interval: int = 25  # steps between checkpoints
    keep_latest_k: int = 2  # checkpoints kept (0 = all)
    resume: bool = True  # resume from the newest complete checkpoint in the run folder
    export_hf: bool = True  # write the final policy as an HF checkpoint


@dataclass
class MetricsConfig:
    tensorboard: bool = False  # also write TensorBoard event files
    plot: bool = True  # draw the monitoring panel (PNG) at the end of the run
    progress: bool = True  # progress bars on the console (plain lines when not a terminal)
    peak_tflops: float = 0.0  # per-device peak for the "mfu" metric; 0 = the datasheet bf16 value of a known GPU
    log_every: int = 1  # steps between console lines (the JSONL gets every step)


@dataclass
class EvalConfig:
    interval: int = 5  # steps between held-out evaluations (0 = only at start/end)
    at_start: bool = True  # evaluate before the first step
    at_end: bool = True  # evaluate after the last step
    k: int = 32  # samples per problem (avg@k, pass@k, maj@k)
    temperature: float = 1.0  # evaluation sampling temperature
    top_p: float = 0.7  # evaluation nucleus mass
    greedy: bool = False  # one greedy sample per problem instead (needs k = 1)
    max_response_length: int | None = None  # None = rollout.max_response_length
    eval_size: int | None = None  # problems evaluated; None = the whole set


@dataclass
class Config:
    job: JobConfig = field(default_factory=JobConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)


SECTIONS: dict[str, type] = {f.name: f.default_factory for f in dataclasses.fields(Config)}
FIELD_TYPES: dict[str, dict[str, Any]] = {name: typing.get_type_hints(cls) for name, cls in SECTIONS.items()}


# ---------------------------------------------------------------------------------------- types


class _Mismatch(Exception):
    pass


def _items(tp, n: int):
    """Element types of a list/tuple type for `n` elements, or None when `n` does not fit the type."""
    args = typing.get_args(tp)
    if typing.get_origin(tp) is list or args[-1] is Ellipsis:
        return [args[0]] * n
    return list(args) if len(args) == n else None


def _type_name(tp) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " or ".join("none" if a is type(None) else _type_name(a) for a in args)
    if origin in (tuple, list):
        if origin is list or args[-1] is Ellipsis:
            return f"a list of {_type_name(args[0])}"
        return f"a list of {len(args)} values ({', '.join(_type_name(a) for a in args)})"
    return {bool: "a bool (true/false)", int: "an int", float: "a number", str: "a string"}.get(tp, str(tp))


def _check_value(value, tp):
    """Return a TOML-native `value` as type `tp` (ints widen to float); raise _Mismatch otherwise."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if (tp is bool and isinstance(value, bool)) or (tp is int and number and isinstance(value, int)):
        return value
    if tp is float and number:
        if not math.isfinite(value):
            raise _Mismatch("a finite number")
        return float(value)
    if tp is str and isinstance(value, str):
        return value
    if origin is Literal:
        if isinstance(value, str) and value in args:  # every Literal here is a set of strings
            return value
    elif origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        for arg in args:
            try:
                return _check_value(value, arg)
            except _Mismatch:
                pass
    elif origin in (tuple, list) and isinstance(value, (list, tuple)) and _items(tp, len(value)) is not None:
        return origin(_check_value(v, a) for v, a in zip(value, _items(tp, len(value))))
    raise _Mismatch(_type_name(tp))


def _parse_text(text: str, tp):
    """Convert a command-line string to type `tp` (bool: true/false/1/0; lists: `a,b` or `[a, b]`)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    try:
        if tp is str:
            return text
        if tp is bool:
            return {"true": True, "1": True, "false": False, "0": False}[text.strip().lower()]
        if tp in (int, float):
            return tp(text)
    except (KeyError, ValueError):
        raise _Mismatch(_type_name(tp)) from None
    if origin is Literal:
        return next((a for a in args if str(a) == text.strip()), text)  # no match: _check_value names the choices
    if origin in (typing.Union, types.UnionType):
        if type(None) in args and text.strip().lower() in ("none", "null"):
            return None
        for arg in args:
            try:
                return _check_value(_parse_text(text, arg), arg)
            except _Mismatch:
                pass
    elif origin in (tuple, list):
        if text.strip().startswith("["):
            try:
                return tomllib.loads(f"v = {text}")["v"]
            except tomllib.TOMLDecodeError:
                raise _Mismatch(_type_name(tp)) from None
        items = [t.strip() for t in text.split(",")] if text.strip() else []
        if _items(tp, len(items)) is not None:
            return [_parse_text(t, a) for t, a in zip(items, _items(tp, len(items)))]
    raise _Mismatch(_type_name(tp))


def _coerce(value, tp, key: str, source: str, from_text: bool = False):
    try:
        return _check_value(_parse_text(value, tp) if from_text else value, tp)
    except _Mismatch as e:
        expected = str(e)
        if typing.get_origin(tp) is Literal:
            raise ConfigError(f"{key} = {value!r} ({source}): unknown value; expected {expected}") from None
        raise ConfigError(f"{key} = {value!r} ({source}): wrong type; {key} expects {expected}") from None


# ---------------------------------------------------------------------------------------- loading


def _unknown(section: str, key: str | None, source: str) -> ConfigError:
    """The error for an unknown section (key None) or key, with the closest valid name."""
    if key is None:
        guess = difflib.get_close_matches(section, SECTIONS, n=1)
        hint = f"did you mean [{guess[0]}]?" if guess else f"valid sections: {', '.join(SECTIONS)}"
        return ConfigError(f"unknown section [{section}] ({source}); {hint}")
    if not section:  # a bare key at the top of a file, outside any [section] table
        guess = [f"{s}.{key}" for s in SECTIONS if key in FIELD_TYPES[s]]
        hint = f"; did you mean '{guess[0]}' (under [{guess[0].split('.')[0]}])?" if guess else ""
        return ConfigError(f"unknown top-level key '{key}' ({source}): only 'base' and [section] tables "
                           f"are allowed{hint}")
    # A key of another section first (`lr` under [training]), then the closest spelling in this section.
    guess = ([f"{s}.{key}" for s in SECTIONS if key in FIELD_TYPES[s]]
             or [f"{section}.{g}" for g in difflib.get_close_matches(key, FIELD_TYPES[section], n=1)])
    hint = f"did you mean '{guess[0]}'?" if guess else f"valid keys of [{section}]: {', '.join(FIELD_TYPES[section])}"
    return ConfigError(f"unknown key '{section}.{key}' ({source}); {hint}")


def _field_type(section: str, key: str, source: str):
    if section not in SECTIONS:
        raise _unknown(section, None, source)
    if key not in FIELD_TYPES[section]:
        raise _unknown(section, key, source)
    return FIELD_TYPES[section][key]


def _read_file(path: str, values: dict, origins: dict, chain: tuple[str, ...] = ()) -> None:
    """Merge `path` (after its `base`, if any) into `values`; record each key's source in `origins`."""
    real = os.path.realpath(path)
    if real in chain:
        raise ConfigError(f"{path}: base files form a cycle: {' -> '.join(chain + (real,))}")
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:  # the message carries "(at line L, column C)"
        raise ConfigError(f"{path}: invalid TOML: {e}") from None
    base = data.pop("base", None)
    if base is not None:
        if not isinstance(base, str):
            raise ConfigError(f"{path}: base must be the path of another TOML file, got {base!r}")
        base_path = os.path.join(os.path.dirname(path), base)
        if not os.path.isfile(base_path):
            raise ConfigError(f"{path}: base file {base!r} not found (looked for {base_path})")
        _read_file(base_path, values, origins, chain + (real,))
    for section, table in data.items():
        if not isinstance(table, dict):
            if section in SECTIONS:
                raise ConfigError(f"{path}: '{section}' must be a table ([{section}]), got {table!r}")
            raise _unknown("", section, path)
        for key, value in table.items():
            tp = _field_type(section, key, path)
            values.setdefault(section, {})[key] = _coerce(value, tp, f"{section}.{key}", path)
            origins[f"{section}.{key}"] = path


def _split_override(item: str) -> tuple[str, str, str]:
    text = item[2:] if item.startswith("--") else item
    name, sep, value = text.partition("=")
    section, dot, key = name.partition(".")
    if not sep or not dot or not section or not key:
        raise ConfigError(f"override {item!r} (command line) is not of the form section.key=value")
    return section, key, value


def load_config(path: str | None = None, overrides: typing.Sequence[str] = ()) -> Config:
    """Defaults, then the TOML file at `path` (and its bases), then `section.key=value` overrides."""
    values: dict[str, dict[str, Any]] = {}
    origins: dict[str, str] = {}
    if path is not None:
        _read_file(path, values, origins)
    for item in overrides:
        section, key, text = _split_override(item)
        tp = _field_type(section, key, "command line")
        values.setdefault(section, {})[key] = _coerce(text, tp, f"{section}.{key}", "command line", True)
        origins[f"{section}.{key}"] = "command line"
    cfg = Config(**{name: cls(**values.get(name, {})) for name, cls in SECTIONS.items()})
    validate(cfg, origins)
    return cfg


def config_to_dict(cfg: Config) -> dict[str, dict[str, Any]]:
    """{section: {key: value}} with tuples as lists: JSON-serialisable."""
    return {name: {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(getattr(cfg, name)).items()}
            for name in SECTIONS}


# ---------------------------------------------------------------------------------------- validation


def validate(cfg: Config, origins: dict[str, str] | None = None) -> None:
    """Check every constraint that needs no file system; raise ConfigError on the first that fails.

    `origins` maps "section.key" to where it was set (a file or "command line"); load_config passes it so
    that errors say which file to fix. Without it (a Config edited in code) errors name only the key.
    """

    def check(ok: bool, key: str, rule: str) -> None:
        if not ok:
            section, name = key.split(".")
            value = getattr(getattr(cfg, section), name)
            where = "" if origins is None else f" ({origins.get(key, 'default')})"
            raise ConfigError(f"{key} = {value!r}{where}: {rule}")

    job, model, data, ro, alg = cfg.job, cfg.model, cfg.data, cfg.rollout, cfg.algorithm
    opt, tr, par, ev = cfg.optimizer, cfg.training, cfg.parallelism, cfg.eval
    check(bool(job.name) and not set(job.name) & {"/", "\\"} and job.name not in (".", ".."), "job.name",
          "must be a non-empty folder name without path separators")
    check(bool(job.run_dir), "job.run_dir", "must not be empty")
    check(job.seed >= 0, "job.seed", "must be >= 0")
    check(job.cpu_threads >= 0, "job.cpu_threads", "must be >= 0 (0 = torch's default)")

    check(not model.preset or model.preset in PRESETS, "model.preset",
          f"unknown preset; known presets: {', '.join(PRESETS)}")
    check(not (model.preset and model.hf_path), "model.preset",
          f"set either model.preset or model.hf_path = {model.hf_path!r}, not both")

    check(0.0 <= cfg.data.synthetic_answer_share <= 1.0, "data.synthetic_answer_share", "must be in [0, 1]")
    synthetic_splits = [split for key, split in (("train_path", "train"), ("eval_path", "eval"))
                        if getattr(cfg.data, key) == "synthetic"]
    if synthetic_splits:
        check(cfg.data.synthetic_difficulty in SYNTHETIC_LEVELS, "data.synthetic_difficulty",
              f"must be one of the synthetic task's levels {sorted(SYNTHETIC_LEVELS)}")
    for split in synthetic_splits:
        most = synthetic_problem_limit(cfg.data.synthetic_difficulty, split)
        check(getattr(cfg.data, f"synthetic_num_{split}") <= most, f"data.synthetic_num_{split}",
              f"must be <= {most}: the {split} split of difficulty {cfg.data.synthetic_difficulty} has no more "
              f"distinct problems")
    for key in ("data.max_prompt_length", "data.synthetic_difficulty", "data.synthetic_num_train",
                "data.synthetic_num_eval", "rollout.n", "rollout.max_response_length",
                "rollout.gen_batch_multiplier", "rollout.tp_size", "rollout.weight_sync_bucket_mb",
                "rollout.round_timeout_s", "rollout.block_size",
                "rollout.max_batch_size", "algorithm.overlong_buffer", "algorithm.max_num_gen_batches",
                "training.train_batch_size", "training.mini_batch_size", "training.micro_batch_tokens",
                "training.ppo_epochs", "training.sft_batch_size", "training.max_nonfinite_steps",
                "parallelism.dp_replicate", "parallelism.tp",
                "checkpoint.interval", "metrics.log_every", "eval.k"):
        section, name = key.split(".")
        check(getattr(getattr(cfg, section), name) >= 1, key, "must be >= 1")
    for key in ("data.seed", "rollout.kv_cache_blocks", "algorithm.carry_over_max_staleness", "optimizer.weight_decay",
                "optimizer.warmup_steps", "optimizer.grad_clip", "training.steps", "training.sft_warmup_steps",
                "metrics.peak_tflops",
                "checkpoint.keep_latest_k", "eval.interval", "algorithm.overlong_penalty_factor",
                "parallelism.ac_every_k_blocks"):
        section, name = key.split(".")
        check(getattr(getattr(cfg, section), name) >= 0, key, "must be >= 0")
    for key in ("optimizer.lr", "optimizer.eps", "training.sft_lr", "algorithm.adv_eps",
                "algorithm.truncated_is_cap"):
        section, name = key.split(".")
        check(getattr(getattr(cfg, section), name) > 0, key, "must be > 0")

    for prefix, s in (("rollout", ro), ("eval", ev)):
        check(s.temperature >= 0, f"{prefix}.temperature", "must be >= 0 (0 = greedy)")
        check(0 < s.top_p <= 1, f"{prefix}.top_p", "must be in (0, 1]")
    check(ro.top_k == -1 or ro.top_k >= 1, "rollout.top_k", "must be -1 (off) or >= 1")
    check(0 < ro.mem_fraction_static < 1, "rollout.mem_fraction_static", "must be in (0, 1)")
    engine_len = data.max_prompt_length + max(ro.max_response_length, ev.max_response_length or 0)
    check(ro.kv_cache_blocks == 0 or ro.kv_cache_blocks * ro.block_size >= engine_len, "rollout.kv_cache_blocks",
          f"must be 0 (auto) or hold one full-length sequence: >= {-(-engine_len // max(ro.block_size, 1))} blocks "
          f"of rollout.block_size = {ro.block_size} for data.max_prompt_length + the longest response = {engine_len}")

    check(0 < alg.clip_low < 1, "algorithm.clip_low", "must be in (0, 1): the lower clip bound is 1 - clip_low")
    check(alg.clip_high > 0, "algorithm.clip_high", "must be > 0: the upper clip bound is 1 + clip_high")
    check(alg.clip_c > 1, "algorithm.clip_c", "must be > 1: the dual-clip bound must lie above the clip range")
    check(not alg.overlong_penalty or alg.overlong_buffer <= ro.max_response_length, "algorithm.overlong_buffer",
          f"must be <= rollout.max_response_length = {ro.max_response_length} (Eq. 13 needs L_cache <= L_max)")
    check(not alg.dynamic_sampling or ro.n >= 2, "rollout.n",
          "must be >= 2 with algorithm.dynamic_sampling: a group of one never has 0 < #correct < G")
    check(alg.kl_coef == 0, "algorithm.kl_coef",
          "must be 0: DAPO removes the KL penalty (Sec. 2.3) and this trainer keeps no reference model")

    check(all(0 <= b < 1 for b in opt.betas), "optimizer.betas", "both betas must be in [0, 1)")

    check(tr.train_batch_size % tr.mini_batch_size == 0, "training.train_batch_size",
          f"must be divisible by training.mini_batch_size = {tr.mini_batch_size} (whole mini-batches per step)")
    longest = data.max_prompt_length + ro.max_response_length
    check(tr.micro_batch_tokens >= longest, "training.micro_batch_tokens",
          f"must be >= data.max_prompt_length + rollout.max_response_length = {longest}: "
          "a packed micro-batch must hold the longest sample")
    check(par.dp_shard == -1 or par.dp_shard >= 1, "parallelism.dp_shard", "must be -1 (all remaining ranks) or >= 1")

    check(ev.max_response_length is None or ev.max_response_length >= 1, "eval.max_response_length",
          "must be >= 1 (or none: the rollout's)")
    check(ev.eval_size is None or ev.eval_size >= 1, "eval.eval_size", "must be >= 1 (or none: the whole set)")
    check(not ev.greedy or ev.k == 1, "eval.k", "must be 1 with eval.greedy: greedy decoding has one answer")


def check_runnable(cfg: Config) -> None:
    """The checks that only matter when training starts: paths exist, and sequences fit the model."""
    model, data = cfg.model, cfg.data
    if not model.preset and not model.hf_path:
        raise ConfigError("model.hf_path is not set: set model.hf_path to a Qwen2.5 checkpoint directory (e.g. "
                          f"--model.hf_path=/ckpt/Qwen2.5-32B), or model.preset to one of {', '.join(PRESETS)}")
    max_positions = None
    if model.hf_path:
        config_json = os.path.join(model.hf_path, "config.json")
        if not os.path.isfile(config_json):
            raise ConfigError(f"model.hf_path = {model.hf_path!r} is not a checkpoint directory (no config.json): "
                              "set model.hf_path to a Qwen2.5 checkpoint directory")
        with open(config_json) as f:
            max_positions = json.load(f).get("max_position_embeddings")
    else:
        max_positions = PRESETS[model.preset].max_position_embeddings
    if model.tokenizer_path and not os.path.isdir(model.tokenizer_path):
        raise ConfigError(f"model.tokenizer_path = {model.tokenizer_path!r} is not a directory: set it to the "
                          "folder holding tokenizer.json, or leave it empty")
    for key, what in (("train_path", "DAPO-Math-17k"), ("eval_path", "AIME 2024")):
        path = getattr(data, key)
        if not path:
            raise ConfigError(f"data.{key} is not set: set data.{key} to a parquet file in the {what} schema, "
                              "or to 'synthetic'")
        if path != "synthetic" and not os.path.isfile(path):
            raise ConfigError(f"data.{key} = {path!r} does not exist: set data.{key} to a parquet file in the "
                              f"{what} schema, or to 'synthetic'")
    if data.train_path != "synthetic" and not (model.tokenizer_path or model.hf_path):
        raise ConfigError(f"model.tokenizer_path is not set: data.train_path = {data.train_path!r} needs the "
                          "tokenizer of model.hf_path or model.tokenizer_path (only the synthetic task trains its own)")
    longest = data.max_prompt_length + max(cfg.rollout.max_response_length, cfg.eval.max_response_length or 0)
    if max_positions is not None and longest > max_positions:
        raise ConfigError(f"data.max_prompt_length + the longest response = {longest} tokens exceed the model's "
                          f"max_position_embeddings = {max_positions}")


# ---------------------------------------------------------------------------------------- command line


def parse_cli(argv: typing.Sequence[str] | None = None) -> tuple[Config, argparse.Namespace]:
    """`--config PATH`, `--dry-run` and any number of `--section.key=value` / `--section.key value`."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        description="DAPO training (Algorithm 1 of arXiv 2503.14476).",
        epilog="Any setting can be overridden after the file: --section.key=value or --section.key value, "
               "e.g. --training.steps=10 --rollout.engine torch --optimizer.betas=0.9,0.95.")
    parser.add_argument("--config", default=DEFAULT_CONFIG, help="TOML file (default: configs/demo_cpu.toml)")
    parser.add_argument("--dry-run", action="store_true", help="validate, print the resolved config as JSON, exit")
    plain, overrides = [], []
    i = 0
    while i < len(argv):
        arg = argv[i]
        name = arg[2:].partition("=")[0] if arg.startswith("--") else ""
        if "." not in name:
            plain.append(arg)
        elif "=" in arg:
            overrides.append(arg[2:])
        elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            overrides.append(f"{name}={argv[i + 1]}")
            i += 1
        else:
            raise ConfigError(f"{arg} (command line) needs a value: {arg}=VALUE or {arg} VALUE")
        i += 1
    args = parser.parse_args(plain)
    args.overrides = overrides
    return load_config(args.config, overrides), args
