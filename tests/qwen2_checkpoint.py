"""A Qwen2 checkpoint written by transformers' own `save_pretrained`, with random weights, for tests that
read checkpoints the way a run reads a downloaded one; our module's weights in transformers' layout."""

from __future__ import annotations

import torch

from model.args import ModelArgs
from model.hf_adapter import hf_config_from_args, iter_hf_tensors
from model.qwen2 import Qwen2


def hf_state_dict(model: Qwen2) -> dict[str, torch.Tensor]:
    """{HF name: tensor} of our module as transformers' `Qwen2ForCausalLM.state_dict()` lists it: a tied
    model's `lm_head.weight` is the embedding tensor itself. Tensors are not copied."""
    state = dict(iter_hf_tensors(model))
    if model.args.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    return state


def write_qwen2_checkpoint(path: str, args: ModelArgs, *, dtype: torch.dtype, max_shard_size: str, seed: int = 0):
    """Every tensor random (biases and norms too, so a misplaced row shows), stored in `dtype`, split into
    files of at most `max_shard_size` with an index."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = hf_config_from_args(args, dtype=dtype)
    with torch.device("meta"):
        model = Qwen2ForCausalLM(Qwen2Config(**{k: v for k, v in config.items() if k != "architectures"}))
    model = model.to_empty(device="cpu").to(dtype)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.05)
    model.save_pretrained(path, max_shard_size=max_shard_size)
