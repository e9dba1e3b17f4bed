"""The rollout engine of a run, specified once from its configuration and started where it is needed.

train.py starts it beside the sharded policy (`start_beside`: the torch engine gets its own full copy of
the weights, an SGLang engine is shared by `rollout.tp_size` consecutive ranks on their GPUs), eval.py over
a checkpoint directory (`start_from_checkpoint`), and the rehearsal sizes its stand-in from the same
specification (preflight/rehearsal.py). The engine holds the longest prompt and the longest response of
the run: a rollout's, or a held-out evaluation's when that is longer.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from model.hf_adapter import DTYPES

if TYPE_CHECKING:
    from config import Config
    from config.schema import RolloutConfig
    from model.qwen2 import Qwen2
    from parallel.dist_env import DistEnv
    from rollout.engine import Engine


@dataclass(frozen=True)
class EngineSpec:
    rollout: RolloutConfig  # the [rollout] section: engine kind, dtype, the torch engine's and SGLang's options
    max_prompt_length: int  # data.max_prompt_length
    max_new_tokens: int  # the longest response: Config.engine_max_new_tokens
    seed: int  # job.seed
    model_path: str = ""  # the HF checkpoint SGLang reads its weights from (model.hf_path)

    @classmethod
    def from_config(cls, cfg: Config) -> EngineSpec:
        return cls(cfg.rollout, cfg.data.max_prompt_length, cfg.engine_max_new_tokens, cfg.job.seed, cfg.model.hf_path)

    @property
    def dtype(self) -> torch.dtype:
        return DTYPES[self.rollout.dtype]

    @property
    def max_seq_len(self) -> int:
        return self.max_prompt_length + self.max_new_tokens

    def torch_engine(self, model: Qwen2, max_seq_len: int) -> Engine:
        """The torch engine over `model` (where it is, in its dtype) with the [rollout] settings."""
        from rollout.torch_engine import TorchEngine

        ro = self.rollout
        return TorchEngine(
            model,
            max_seq_len=max_seq_len,
            seed=self.seed,
            max_batch_size=ro.max_batch_size,
            compile=ro.compile,
            cuda_graphs=ro.cuda_graphs,
            block_size=ro.block_size,
            kv_cache_blocks=ro.kv_cache_blocks or None,  # 0: room for max_batch_size full sequences
        )

    def sglang_engine(self, model_path: str, **placement: Any) -> Engine:
        """An SGLang engine over the checkpoint `model_path` with the [rollout] settings; `placement`: its GPUs (or
        the CPU: device "cpu"), group and context."""
        from rollout.sglang_engine import SGLangEngine

        ro = self.rollout
        return SGLangEngine(
            model_path,
            tp_size=ro.tp_size,
            mem_fraction_static=ro.mem_fraction_static,
            dtype=ro.dtype,
            seed=self.seed,
            call_timeout_s=ro.call_timeout_s,
            max_batch_size=ro.max_batch_size,
            **placement,
        )

    def start_beside(self, policy: Qwen2, dist_env: DistEnv) -> Engine:
        """The engine of a training run, started after the policy is sharded (the torch engine: its own
        full copy, filled from the shards, every rank taking part in the gathers)."""
        if self.rollout.engine == "torch":
            from model.qwen2 import Qwen2
            from rollout.weight_sync import sync_weights

            with torch.device("meta"):
                engine_model = Qwen2(policy.args).to(self.dtype)
            engine_model.to_empty(device=dist_env.device)
            engine = self.torch_engine(engine_model, self.max_seq_len)
            sync_weights(policy, engine, bucket_bytes=self.rollout.weight_sync_bucket_mb << 20)
            return engine
        from rollout.sglang_engine import context_length_for

        group, base_gpu_id = engine_group(self.rollout.tp_size, dist_env)
        return self.sglang_engine(
            self.model_path,
            base_gpu_id=base_gpu_id,
            context_length=context_length_for(self.max_prompt_length, self.max_new_tokens),
            group=group,
            device=dist_env.device,
        )

    def start_from_checkpoint(self, model_dir: str, longest_prompt: int, max_new_tokens: int) -> Engine:
        """The engine over an HF checkpoint directory, on the GPU when there is one (eval.py). It never holds
        more context than the longest prompt plus `max_new_tokens`, nor more than the model's."""
        device = "cuda" if torch.cuda.is_available() else "cpu"
        if self.rollout.engine == "sglang":
            from rollout.sglang_engine import context_length_for

            context = context_length_for(longest_prompt, max_new_tokens)
            return self.sglang_engine(model_dir, device=None if device == "cuda" else device, context_length=context)
        from model.hf import load_hf

        model = load_hf(model_dir, dtype=self.dtype, device=device)
        max_seq_len = min(model.args.max_position_embeddings, longest_prompt + max_new_tokens)
        if max_seq_len < longest_prompt + max_new_tokens:
            print(
                f"warning: the model's context of {max_seq_len} tokens leaves the longest prompt "
                f"{max_seq_len - longest_prompt} of the {max_new_tokens} new tokens asked for; longer responses "
                f"end with finish reason 'length'",
                file=sys.stderr,
            )
        return self.torch_engine(model, max_seq_len)


def engine_group(tp_size: int, dist_env: DistEnv) -> tuple[Any, int]:
    """The process group of the `tp_size` consecutive ranks that share one SGLang engine (one per GPU of
    the engine), and the first GPU of that engine on this node. Every rank creates every group. A gloo
    control group (parallel/dist_env.py): its ranks wait in it while the leader generates."""
    from parallel.dist_env import new_control_group

    if dist_env.world_size == 1:
        if tp_size != 1:
            raise ValueError(f"rollout.tp_size = {tp_size} needs {tp_size} ranks (torchrun); this run has one")
        return None, 0
    if dist_env.world_size % tp_size:
        raise ValueError(f"rollout.tp_size = {tp_size} does not divide the world size {dist_env.world_size}")
    starts = range(0, dist_env.world_size, tp_size)
    groups = [new_control_group(list(range(start, start + tp_size)), dist_env.control_timeout_s) for start in starts]
    return groups[dist_env.rank // tp_size], dist_env.local_rank - dist_env.local_rank % tp_size
