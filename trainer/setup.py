"""Build what train.py needs from the configuration: tokenizer, prompt sets, policy, rollout engine."""

from __future__ import annotations

import copy
import logging
import os

import torch

from model.args import get_preset
from model.hf import load_hf
from model.qwen2 import build_model
from model.tokenizer import IM_END, Tokenizer, render_chat, train_bpe_tokenizer
from rl.data import load_prompts, rows_to_examples, synthetic_arithmetic_rows

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _synthetic_rows(cfg, split: str) -> list[dict]:
    count = cfg.data.synthetic_num_train if split == "train" else cfg.data.synthetic_num_eval
    return synthetic_arithmetic_rows(count, difficulty=cfg.data.synthetic_difficulty, split=split, seed=cfg.data.seed,
                                     answer_line_share=cfg.data.synthetic_answer_share)


def build_tokenizer(cfg, run_path: str, *, is_main: bool, barrier) -> Tokenizer:
    """The checkpoint's tokenizer, or one trained on the synthetic task (saved in the run folder).

    Only rank 0 trains the synthetic tokenizer; the others wait and load the saved copy, so every rank
    holds byte-identical vocabularies.
    """
    path = cfg.model.tokenizer_path or cfg.model.hf_path
    if path:
        return Tokenizer.from_dir(path)
    if cfg.data.train_path != "synthetic":
        raise ValueError("model.tokenizer_path (or model.hf_path) must be set for a real data set")
    saved = os.path.join(run_path, "tokenizer")
    if is_main and not os.path.isfile(os.path.join(saved, "tokenizer.json")):
        rows = _synthetic_rows(cfg, "train")
        texts = [render_chat(r["prompt"]) + r["extra_info"]["solution"] + IM_END for r in rows]
        vocab = get_preset(cfg.model.preset).vocab_size
        train_bpe_tokenizer(texts, vocab, split_words=False).save(saved)
    barrier()
    return Tokenizer.from_dir(saved)


def load_datasets(cfg, tokenizer):
    """(train examples, eval examples) from parquet files or the synthetic task."""
    max_len = cfg.data.max_prompt_length
    overflow = cfg.data.prompt_overflow

    def load(path, split):
        if path == "synthetic":
            return rows_to_examples(_synthetic_rows(cfg, split), tokenizer, max_prompt_length=max_len,
                                    overflow=overflow, source_name=f"synthetic {split}")[0]
        return load_prompts(path, tokenizer, max_prompt_length=max_len, overflow=overflow)

    train = load(cfg.data.train_path, "train")
    evals = load(cfg.data.eval_path, "eval") if cfg.data.eval_path else []
    if cfg.eval.eval_size:
        evals = evals[: cfg.eval.eval_size]
    return train, evals


def build_policy(cfg, device: torch.device) -> torch.nn.Module:
    """The policy in its training dtype on `device`: an HF checkpoint, or a preset with random weights."""
    dtype = DTYPES[cfg.model.dtype]
    if cfg.model.hf_path:
        model = load_hf(cfg.model.hf_path, dtype=dtype, device=device)
    else:
        model = build_model(get_preset(cfg.model.preset), device=device, dtype=dtype, seed=cfg.job.seed)
    model.attention_backend = cfg.model.attention_backend
    return model


def engine_group(tp_size: int, dist_env):
    """The process group of the `tp_size` consecutive ranks that share one SGLang engine (one per GPU of
    the engine), and the first GPU of that engine on this node. Every rank creates every group. A gloo
    control group (trainer/distributed.py): its ranks wait in it while the leader generates."""
    from trainer.distributed import new_control_group

    if dist_env.world_size == 1:
        if tp_size != 1:
            raise ValueError(f"rollout.tp_size = {tp_size} needs {tp_size} ranks (torchrun); this run has one")
        return None, 0
    if dist_env.world_size % tp_size:
        raise ValueError(f"rollout.tp_size = {tp_size} does not divide the world size {dist_env.world_size}")
    mine = None
    for start in range(0, dist_env.world_size, tp_size):
        group = new_control_group(list(range(start, start + tp_size)), dist_env.control_timeout_s)
        if start <= dist_env.rank < start + tp_size:
            mine = group
    return mine, dist_env.local_rank - dist_env.local_rank % tp_size


def build_engine(cfg, policy: torch.nn.Module, device: torch.device, max_prompt_length: int, dist_env=None):
    """The rollout engine. The torch engine gets its own copy of the (not yet parallelised) policy; an
    SGLang engine is shared by `rollout.tp_size` consecutive ranks (its TP group), colocated on their GPUs."""
    max_new = max(cfg.rollout.max_response_length, cfg.eval.max_response_length or 0)
    if cfg.rollout.engine == "torch":
        from rollout.torch_engine import TorchEngine

        engine_model = copy.deepcopy(policy)
        return TorchEngine(engine_model, max_batch_size=cfg.rollout.max_batch_size,
                           max_seq_len=max_prompt_length + max_new, device=device,
                           dtype=DTYPES[cfg.rollout.dtype], compile=cfg.rollout.compile, seed=cfg.job.seed,
                           cuda_graphs=cfg.rollout.cuda_graphs, block_size=cfg.rollout.block_size,
                           kv_cache_blocks=cfg.rollout.kv_cache_blocks or None, flex_decode=cfg.rollout.flex_decode)
    from rollout.sglang_engine import SGLangEngine, context_length_for

    group, base_gpu_id = engine_group(cfg.rollout.tp_size, dist_env)
    return SGLangEngine(model_path=cfg.model.hf_path, tp_size=cfg.rollout.tp_size, base_gpu_id=base_gpu_id,
                        mem_fraction_static=cfg.rollout.mem_fraction_static, dtype=cfg.rollout.dtype,
                        seed=cfg.job.seed, context_length=context_length_for(max_prompt_length, max_new),
                        group=group, device=device)
