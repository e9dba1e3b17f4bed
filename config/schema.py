"""The run configuration's schema: one dataclass per TOML section, each field's bound beside it.

Every key has a default here, so a file holds only what it changes (for the algorithm: the DAPO recipe,
arXiv 2503.14476 Sec. 4.1 and verl's script). A section's `rules()` yields its cross-field rules as
(key, holds, rule); `Config.rules()` those across sections. config/loader.py checks them in that order.
"""

from __future__ import annotations

import math
import typing
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Literal

from config.loader import Rule, above, at_least, bounded
from model.args import PRESETS
from tasks.catalog import TASKS, problem_limit

DType = Literal["float32", "bfloat16"]
LossAgg = Literal[
    "token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm", "group-token-mean"
]


def _nucleus(default: float) -> float:
    return bounded(default, lambda v: 0 < v <= 1, "must be in (0, 1]")


def _top_k(default: int) -> int:
    return bounded(default, lambda v: v == -1 or v >= 1, "must be -1 (off) or >= 1")


def _preset(default: str) -> str:
    return bounded(default, lambda v: not v or v in PRESETS, f"unknown preset; known presets: {', '.join(PRESETS)}")


def _share(default: float) -> float:
    return bounded(default, lambda v: 0 <= v <= 1, "must be in [0, 1]")


def _fraction(default: float, note: str = "") -> float:
    return bounded(default, lambda v: 0 < v < 1, f"must be in (0, 1){note}")


# The floats the optimizer, the loss, the reward and the sampler read are float32, which holds at most FLOAT32_MAX
# (torch.finfo(torch.float32).max). The gradient norm (its clip, the non-finite check) squares every gradient in
# float32, so one above FLOAT32_ROOT ~ 1.8e19 makes it inf. Every policy loss clamps the ratio r to e^20 (rl/loss.py
# LOG_RATIO_CLAMP): a token's gradient -A r (A its advantage) stays below that root while |A| <= ADVANTAGE_MAX.
FLOAT32_MAX = 3.4028234663852886e38
FLOAT32_ROOT = math.sqrt(FLOAT32_MAX)
ADVANTAGE_MAX = FLOAT32_ROOT / math.exp(20)  # ~ 3.8e10


def _float32(default: float, low: float = 0, note: str = "float32 holds no more", high: float = FLOAT32_MAX) -> float:
    return bounded(default, lambda v: low < v <= high, f"must be in ({low}, {high:.4g}] ({note})")


def _sampling_temperature(default: float) -> float:
    """0 (greedy), or T >= 1 / FLOAT32_ROOT: the log-prob's gradient is (onehot - p) / T (model/logprob.py), past
    float32 when squared below it; the sampler's z / T is finite there for logits up to FLOAT32_ROOT."""
    low = 1 / FLOAT32_ROOT
    rule = f"must be 0 (greedy) or in [{low:.4g}, {FLOAT32_MAX:.4g}] (float32 carries no other z / T and its gradient)"
    return bounded(default, lambda v: v == 0 or low <= v <= FLOAT32_MAX, rule)


def _betas(default: tuple[float, float]) -> tuple[float, float]:
    return bounded(default, lambda v: all(0 <= b < 1 for b in v), "both betas must be in [0, 1)")


def _degree_or_rest(default: int) -> int:
    return bounded(default, lambda v: v == -1 or v >= 1, "must be -1 (all remaining ranks) or >= 1")


def _optional_count(default: int | None, none_means: str) -> int | None:
    return bounded(default, lambda v: v is None or v >= 1, f"must be >= 1 (or none: {none_means})")


TEMPLATE = 'must be "dapo", "none" or a text holding {problem}'
NO_KL = "must be 0: DAPO removes the KL penalty (Sec. 2.3) and this trainer keeps no reference model"


@dataclass
class JobConfig:
    name: str = bounded(  # run name; the run's folder is run_dir/name
        "dapo",
        lambda v: bool(v) and not set(v) & {"/", "\\"} and v not in (".", ".."),
        "must be a non-empty folder name without path separators",
    )
    run_dir: str = bounded("runs", bool, "must not be empty")  # root folder holding one folder per run
    seed: int = at_least(0, 0)  # seed for model initialisation and sampling
    # 0: torch's default (1 under torchrun), or with parallelism.cpu_offload the node's cores / its processes
    cpu_threads: int = at_least(0, 0, " (0 = automatic)")  # intra-op threads of each process (parallel/cpu_threads.py)


@dataclass
class ModelConfig:
    preset: str = _preset("")  # a name from model/args.py PRESETS (random init); "" = use hf_path
    hf_path: str = ""  # HF checkpoint directory, or a hub id org/name[@revision] (model/hub.py); "" = use preset
    tokenizer_path: str = ""  # tokenizer.json directory or hub id; "" = hf_path's, or a BPE trained on synthetic data
    dtype: DType = "float32"  # dtype of trained parameters and optimizer state (compute: parallelism.param_dtype)
    attention_backend: Literal["auto", "sdpa", "flex"] = "auto"  # auto: FlexAttention on CUDA, SDPA on CPU

    def rules(self) -> Iterator[Rule]:
        yield (
            "preset",
            not (self.preset and self.hf_path),
            f"set either model.preset or model.hf_path = {self.hf_path!r}, not both",
        )


@dataclass
class DataConfig:
    train_path: str = "synthetic"  # parquet, jsonl, hub id org/name[@rev][:config][:split] (data/hub.py), "synthetic"
    eval_path: str = "synthetic"  # held-out set, the same kinds (AIME 2024 in the paper), or "synthetic"
    prompt_key: str = bounded("prompt", bool, "must name a column")  # chat messages [{role, content}], or text
    answer_key: str = bounded("reward_model.ground_truth", bool, "must name a column")  # a.b: field b of column a
    # "dapo": DAPO-Math-17k's instruction around the text; "none": the text as it is; or a text holding {problem}
    prompt_template: str = bounded("dapo", lambda v: v in ("dapo", "none") or "{problem}" in v, TEMPLATE)  # see above
    max_prompt_length: int = at_least(2048, 1)  # prompt tokens after the chat template
    prompt_overflow: Literal["truncate_left", "drop"] = "truncate_left"  # what to do with longer prompts
    synthetic_task: Literal["arithmetic", "chain", "coin", "fork", "scan"] = "arithmetic"  # built-in: tasks/<name>.py
    synthetic_difficulty: int = at_least(2, 1)  # level of the synthetic task (tasks/catalog.py)
    synthetic_num_train: int = at_least(2000, 1)  # synthetic training problems
    synthetic_num_eval: int = at_least(200, 1)  # synthetic held-out problems (disjoint from training)
    synthetic_answer_share: float = _share(1.0)  # share of arithmetic worked solutions ending in the "Answer:" line
    shuffle: bool = True  # reshuffle the prompts every pass over the data
    seed: int = at_least(0, 0)  # seed for shuffling and for generating the synthetic task

    def rules(self) -> Iterator[Rule]:
        splits = [split for split in ("train", "eval") if getattr(self, f"{split}_path") == "synthetic"]
        if splits:
            levels = sorted(TASKS[self.synthetic_task])
            yield (
                "synthetic_difficulty",
                self.synthetic_difficulty in levels,
                f"must be one of the {self.synthetic_task} task's levels {levels}",
            )
            yield (
                "synthetic_answer_share",
                self.synthetic_task == "arithmetic" or self.synthetic_answer_share == 1.0,
                f"must be 1 with data.synthetic_task = {self.synthetic_task!r}: only the arithmetic task writes "
                "answers in prose (the chain task's worked solutions differ in length instead)",
            )
        for split in splits:
            most = problem_limit(self.synthetic_task, self.synthetic_difficulty, split)
            yield (
                f"synthetic_num_{split}",
                getattr(self, f"synthetic_num_{split}") <= most,
                f"must be <= {most}: the {split} split of difficulty {self.synthetic_difficulty} has no more "
                "distinct problems",
            )


@dataclass
class RolloutConfig:
    engine: Literal["torch", "sglang"] = "torch"  # rollout/torch_engine.py or rollout/sglang_engine.py
    n: int = at_least(16, 1)  # samples per prompt: the group size G
    temperature: float = _sampling_temperature(1.0)  # sampling temperature (0 = greedy)
    top_p: float = _nucleus(1.0)  # nucleus sampling mass, in (0, 1]
    top_k: int = _top_k(-1)  # keep the k most likely tokens; -1 = off
    max_response_length: int = at_least(20480, 1)  # L_max of Eq. 13: generation stops after this many tokens
    gen_batch_multiplier: int = at_least(3, 1)  # with dynamic sampling, prompts per round = this x train_batch_size
    tp_size: int = at_least(1, 1)  # tensor-parallel size of one engine instance
    mem_fraction_static: float = _fraction(0.8)  # share of GPU memory the engine may hold (weights + KV cache)
    dtype: Literal["float32", "bfloat16", "float16"] = "bfloat16"  # engine weights and activations
    compile: bool = True  # torch.compile the torch engine's decode step
    cuda_graphs: bool = True  # capture the decode step in CUDA graphs (CUDA only)
    weight_sync_bucket_mb: int = at_least(1024, 1)  # bucket size of the trainer -> engine weight copy
    round_timeout_s: int = at_least(21600, 1)  # longest a rank waits for another in a gloo group (run/guard.py)
    # Past it an engine is killed as hung: no request produced a token (run/guard.py), or a call got no answer
    call_timeout_s: int = at_least(600, 1)  # seconds: the progress window and each engine call's deadline
    max_batch_size: int = at_least(512, 1)  # most sequences the torch engine decodes at once
    block_size: int = at_least(16, 1)  # torch engine: token positions per paged KV-cache block
    kv_cache_blocks: int = at_least(0, 0)  # torch engine KV memory in blocks; 0 = max_batch_size full sequences

    @property
    def logprob_temperature(self) -> float:
        """The temperature of the log-probs pi(o_t | ...) the loss reads: the sampling temperature, the
        engine's log_softmax(logits / T); 1 for greedy rollouts (T = 0)."""
        return self.temperature if self.temperature > 0 else 1.0


@dataclass
class AlgorithmConfig:
    clip_low: float = _fraction(0.2, ": the lower clip bound is 1 - clip_low")  # eps_low of Eq. 10
    # 1 + clip_high and c are float32 constants of the loss; with r <= e^20 either clips nothing above ~4.9e8
    clip_high: float = _float32(0.28, 0, "the upper clip bound 1 + clip_high is a float32")  # eps_high of Eq. 10
    clip_c: float = _float32(10.0, 1, "the dual-clip bound must lie above the clip range; float32")  # dual clip c
    # dapo: Eq. 10; gspo: one clipped ratio per response (paper: clip_low 3e-4, clip_high 4e-4); cispo: REINFORCE
    # with the clipped ratio as a constant weight (paper: no lower bound, e.g. clip_low 0.999). Neither uses clip_c
    policy_loss: Literal["dapo", "gspo", "cispo"] = "dapo"  # the per-token policy loss: DAPO's, GSPO's or CISPO's
    loss_agg: LossAgg = "token-mean"  # loss aggregation; token-mean is DAPO's token-level loss (Sec. 3.3)
    overlong_filter: bool = False  # give truncated samples loss mask 0 (Sec. 3.4)
    overlong_penalty: bool = True  # add the soft overlong punishment of Eq. 13 to the reward
    overlong_buffer: int = at_least(4096, 1)  # L_cache of Eq. 13, in tokens
    overlong_penalty_factor: float = bounded(  # penalty at and beyond L_max (Eq. 13 uses 1); rewards lie in
        1.0,  # [-1 - factor, 1], so with norm_adv_by_std = false |A| <= 2 + factor <= ADVANTAGE_MAX (above)
        lambda v: 0 <= v <= ADVANTAGE_MAX - 2,
        f"must be in [0, {ADVANTAGE_MAX - 2:.3g}] (float32: a token's gradient is up to (2 + factor) e^20)",
    )
    dynamic_sampling: bool = True  # keep only groups with 0 < #correct < G (Eq. 11)
    filter_metric: Literal["acc", "score"] = "acc"  # what must vary within a kept group
    max_num_gen_batches: int = at_least(10, 1)  # generation rounds per step before on_shortfall applies
    on_shortfall: Literal["fill", "raise"] = "fill"  # batch not full after the last round: train on it, or stop
    carry_over_max_staleness: int = at_least(1, 0)  # steps a surplus kept group may wait for the next batch (0 = drop)
    adv_eps: float = above(1e-6, 0)  # eps of Eq. 9: A = (R - mean) / (std + eps)
    norm_adv_by_std: bool = True  # divide advantages by the group std (false: Dr. GRPO)
    truncated_is: bool = False  # weight tokens by min(pi_old / pi_rollout, cap) (truncated importance sampling)
    # A weight pi_old / pi_rollout is a ratio as r is: capped at most where the loss clamps r, e^20 (above)
    truncated_is_cap: float = _float32(2.0, high=math.exp(20), note="r's clamp, e^20")  # cap of the truncated IS weight
    strict_box: bool = False  # reward only a \boxed{} answer (strict mode of the math scorer)
    kl_coef: float = bounded(0.0, lambda v: v == 0, NO_KL)  # KL penalty: DAPO has none (Sec. 2.3), so only 0
    old_logprobs: Literal["auto", "recompute", "rollout"] = "auto"  # pi_old source; auto = engine's if all fp32 torch


@dataclass
class RewardConfig:
    # "" = the paper's rule reward (rl/reward.py, in the trainer's process); else "package.module:function" or
    # "path/file.py:function", run in worker processes (rewards/pool.py, docs/your-own-task.md)
    function: str = ""  # the reward function
    workers: int = at_least(2, 1)  # worker processes per trainer rank
    timeout_s: float = above(300.0, 0)  # seconds a batch may take; past it the run stops with a checkpoint
    recycle_batches: int = at_least(100, 0)  # a worker is replaced after this many batches (0 = never)
    recycle_rss_mb: int = at_least(4096, 0)  # ... or once its peak resident memory passes this (0 = never)


@dataclass
class OptimizerConfig:
    lr: float = _float32(1e-6)  # AdamW learning rate, constant after warm-up
    betas: tuple[float, float] = _betas((0.9, 0.999))  # AdamW (beta1, beta2)
    eps: float = above(1e-8, 0)  # AdamW epsilon
    weight_decay: float = at_least(0.1, 0)  # decoupled weight decay
    warmup_steps: int = at_least(20, 0)  # linear warm-up, in rollout steps
    grad_clip: float = at_least(1.0, 0)  # max global gradient norm; 0 = no clipping (the norm is still logged)


@dataclass
class TrainingConfig:
    steps: int = at_least(100, 0)  # rollout steps (Algorithm 1 iterations)
    train_batch_size: int = at_least(512, 1)  # prompts (groups) per step
    mini_batch_size: int = at_least(32, 1)  # prompts per optimizer update: train_batch_size / this updates per epoch
    micro_batch_tokens: int = at_least(22528, 1)  # token budget of one packed micro-batch (>= prompt + response)
    ppo_epochs: int = at_least(1, 1)  # passes over each step's batch
    share_prompts: bool = True  # a group's samples share one prompt copy in a micro-batch (SDPA, tp = 1, no compile)
    sft_warmup_steps: int = at_least(0, 0)  # supervised steps on solved examples before DAPO (0 = none)
    sft_lr: float = _float32(1e-4)  # learning rate of the supervised warm-up
    sft_batch_size: int = at_least(32, 1)  # examples per supervised step
    max_nonfinite_steps: int = at_least(3, 1)  # abort after this many non-finite updates in a row

    def rules(self) -> Iterator[Rule]:
        yield (
            "train_batch_size",
            self.train_batch_size % self.mini_batch_size == 0,
            f"must be divisible by training.mini_batch_size = {self.mini_batch_size} (whole mini-batches per step)",
        )


@dataclass
class ParallelismConfig:
    dp_replicate: int = at_least(1, 1)  # data-parallel replicas (HSDP outer dimension)
    dp_shard: int = _degree_or_rest(-1)  # FSDP shard degree; -1 = all ranks left after dp_replicate and tp
    tp: int = at_least(1, 1)  # tensor-parallel degree of the trainer
    param_dtype: DType = "bfloat16"  # FSDP mixed precision: compute dtype of gathered parameters
    reduce_dtype: DType = "float32"  # FSDP mixed precision: dtype of gradient reduce-scatter
    reshard_after_forward: bool = True  # free gathered parameters after each block's forward
    cpu_offload: bool = False  # keep sharded parameters, gradients and optimizer state in host memory
    compile: bool = False  # torch.compile each transformer block
    activation_checkpoint: Literal["none", "full", "selective"] = "none"  # recompute activations in backward
    ac_every_k_blocks: int = at_least(0, 0)  # "selective": 0 = per-operator policy, k >= 1 = every k-th block in full


# PPO's ratio pi / pi_old compares two forward passes of one policy; dropout would make them two policies
_ONE_POLICY = "must be 0: the ratio pi / pi_old of Eq. 10 needs one policy, and dropout would draw a new one per pass"
LoRATarget = Literal["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclass
class LoRAConfig:
    """Low-rank adapters on the frozen base (parallel/lora.py): the trained state is the adapters and their AdamW
    moments; the engines receive the merged weights W + (alpha / r) B A."""

    enabled: bool = False  # train adapters on every targeted linear of model.hf_path instead of every weight
    rank: int = at_least(8, 1)  # r (at most the narrowest targeted linear's width)
    alpha: float = above(32.0, 0)  # the low-rank term is scaled by alpha / r
    dropout: float = bounded(0.0, lambda v: v == 0, _ONE_POLICY)  # PEFT's lora_dropout: 0 only (see _ONE_POLICY)
    targets: tuple[LoRATarget, ...] = bounded(  # the adapted linears of every block; default all seven
        typing.get_args(LoRATarget), lambda v: 0 < len(v) == len(set(v)), "must name at least one linear, each once"
    )


@dataclass
class CheckpointConfig:
    enabled: bool = True  # write distributed checkpoints into the run folder
    interval: int = at_least(25, 1)  # steps between checkpoints
    warmup_interval: int = at_least(100, 0)  # supervised warm-up steps between warm-up checkpoints (0 = none)
    keep_latest_k: int = at_least(2, 0)  # checkpoints kept (0 = all)
    resume: bool = True  # resume from the newest complete checkpoint in the run folder
    export_hf: bool = True  # write the final policy as an HF checkpoint


@dataclass
class MetricsConfig:
    tensorboard: bool = False  # also write TensorBoard event files
    progress: bool = True  # progress bars on the console (plain lines when not a terminal)
    peak_tflops: float = at_least(0.0, 0)  # per-device peak for "mfu"; 0 = the datasheet bf16 value of a known GPU
    log_every: int = at_least(1, 1)  # steps between console lines (the JSONL gets every step)
    rollout_dump: bool = False  # each step's trained samples as JSONL in rollouts/ (trainer/rollout_dump.py)


@dataclass
class EvalConfig:
    interval: int = at_least(5, 0)  # steps between held-out evaluations (0 = only at start/end)
    at_start: bool = True  # evaluate before the first step
    at_end: bool = True  # evaluate after the last step
    k: int = at_least(32, 1)  # samples per problem (avg@k, pass@k, maj@k)
    temperature: float = _sampling_temperature(1.0)  # evaluation sampling temperature
    top_p: float = _nucleus(0.7)  # evaluation nucleus mass
    top_k: int = _top_k(-1)  # evaluation top-k; -1 = off
    greedy: bool = False  # one greedy sample per problem instead (needs k = 1)
    max_response_length: int | None = _optional_count(None, "the rollout's")  # None = rollout.max_response_length
    eval_size: int | None = _optional_count(None, "the whole set")  # problems evaluated; None = the whole set
    pass_at: tuple[int, ...] = ()  # the j of the reported pass@j; () = 1 and k

    def rules(self) -> Iterator[Rule]:
        yield "k", not self.greedy or self.k == 1, "must be 1 with eval.greedy: greedy decoding has one answer"
        yield "pass_at", all(1 <= j <= self.k for j in self.pass_at), f"each j must be in [1, eval.k = {self.k}]"


@dataclass
class RehearseConfig:
    world_size: int = at_least(8, 1)  # ranks (GPUs) of the rehearsed job (train.py --rehearse)
    gpu_memory_gb: float = above(80.0, 0)  # memory of one GPU, GB (1e9 bytes)
    preset: str = ""  # architecture rehearsed when model.hf_path is not set (a name from model/args.py PRESETS)
    context_gb: float = at_least(1.0, 0)  # trainer's CUDA context, NCCL buffers and allocator slack, GB per GPU
    # Host memory (preflight/host_ledger.py). The default node is the recipes' target, below the smallest
    # common node of 8 x 80 GB GPUs: AWS p4de.24xlarge has 1,152 GiB (1,237 GB); DGX A100 640GB, DGX H100 and
    # AWS p5.48xlarge have 2 TB (2 TiB), GCP a3-highgpu-8g 1,872 GB, Azure ND H100 v5 1,900 GiB (vendor specs).
    host_memory_gb: float = above(1000.0, 0)  # host memory of one node, GB (1e9 bytes)
    host_process_gb: float = at_least(4.0, 0)  # host memory of one process (trainer rank, SGLang process): assumed
    gpus_per_node: int = at_least(8, 1)  # ranks per node (torchrun --nproc_per_node); a node holds min(this, world)


@dataclass
class Config:
    job: JobConfig = field(default_factory=JobConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    rehearse: RehearseConfig = field(default_factory=RehearseConfig)

    @property
    def eval_max_new_tokens(self) -> int:
        """The longest held-out response: eval.max_response_length, else the rollout's."""
        return self.eval.max_response_length or self.rollout.max_response_length

    @property
    def engine_max_new_tokens(self) -> int:
        """The longest response the rollout engine generates: a rollout's, or an evaluation's if longer."""
        return max(self.rollout.max_response_length, self.eval_max_new_tokens)

    @property
    def engine_max_seq_len(self) -> int:
        """The longest sequence the rollout engine holds: the longest prompt and the longest response."""
        return self.data.max_prompt_length + self.engine_max_new_tokens

    @property
    def prompts_per_round(self) -> int:
        """Prompts one generation round draws: train_batch_size, x gen_batch_multiplier with dynamic sampling
        (the recipe over-samples so that enough groups survive the filter of Eq. 11)."""
        multiplier = self.rollout.gen_batch_multiplier if self.algorithm.dynamic_sampling else 1
        return self.training.train_batch_size * multiplier

    def rules(self) -> Iterator[Rule]:
        """The rules that span sections."""
        alg, ro = self.algorithm, self.rollout
        yield (
            "lora.enabled",
            not self.lora.enabled or bool(self.model.hf_path),
            "needs model.hf_path: adapters train on a pretrained base, and a preset's weights are random",
        )
        yield (
            "algorithm.overlong_buffer",
            not alg.overlong_penalty or alg.overlong_buffer <= ro.max_response_length,
            f"must be <= rollout.max_response_length = {ro.max_response_length} (Eq. 13 needs L_cache <= L_max)",
        )
        yield (
            "rollout.n",
            not alg.dynamic_sampling or ro.n >= 2,
            "must be >= 2 with algorithm.dynamic_sampling: a group of one never has 0 < #correct < G",
        )
        longest = self.data.max_prompt_length + ro.max_response_length
        yield (
            "training.micro_batch_tokens",
            self.training.micro_batch_tokens >= longest,
            f"must be >= data.max_prompt_length + rollout.max_response_length = {longest}: "
            "a packed micro-batch must hold the longest sample",
        )
        engine_len = self.engine_max_seq_len
        yield (
            "rollout.kv_cache_blocks",
            ro.kv_cache_blocks == 0 or ro.kv_cache_blocks * ro.block_size >= engine_len,
            f"must be 0 (auto) or hold one full-length sequence: >= {-(-engine_len // max(ro.block_size, 1))} blocks "
            f"of rollout.block_size = {ro.block_size} for data.max_prompt_length + the longest response = {engine_len}",
        )
