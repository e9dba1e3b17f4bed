"""Qwen2.5 model arguments and presets.

The presets carry the exact architecture values of the official Qwen2.5 *base* checkpoints'
`config.json` files (hidden size, layers, heads, KV heads, intermediate size, vocabulary, RoPE base,
RMSNorm epsilon, tied embeddings). Tiny presets serve tests and the CPU demo.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ModelArgs:
    vocab_size: int = 151936
    hidden_size: int = 896
    num_layers: int = 24
    num_heads: int = 14
    num_kv_heads: int = 2
    intermediate_size: int = 4864
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = True
    max_position_embeddings: int = 32768
    init_std: float = 0.02

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"ModelArgs.{name} must be positive, got {getattr(self, name)}")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not divisible by num_kv_heads {self.num_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim {self.head_dim} must be even for rotary embeddings")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def replace(self, **changes: Any) -> ModelArgs:  # field name -> a value of that field's type
        return dataclasses.replace(self, **changes)


def num_params(args: ModelArgs) -> int:
    """Exact parameter count of `model.qwen2.Qwen2` built from `args` (tied head counted once)."""
    h, kv = args.hidden_size, args.num_kv_heads * args.head_dim
    attention = h * h + h + 2 * (h * kv + kv) + h * h  # q (w+b), k and v (w+b), o (no bias)
    mlp = 3 * h * args.intermediate_size
    per_layer = attention + mlp + 2 * h  # + two norms
    heads = 1 if args.tie_word_embeddings else 2  # the embedding, and the output head unless tied
    return args.num_layers * per_layer + h + heads * args.vocab_size * h  # + final norm


# Values of the official Qwen/Qwen2.5-*B (base) config.json files. 0.5B-3B tie the output head to the
# embedding; 7B and larger have vocab 152064 and a separate head; 14B/32B/72B use rms_norm_eps 1e-5.
PRESETS: dict[str, ModelArgs] = {
    "qwen2.5-0.5b": ModelArgs(151936, 896, 24, 14, 2, 4864, 1e6, 1e-6, True, 32768),
    "qwen2.5-1.5b": ModelArgs(151936, 1536, 28, 12, 2, 8960, 1e6, 1e-6, True, 131072),
    # Qwen/Qwen2.5-Math-1.5B: the 1.5B shapes with a 4,096-token context and RoPE base 10,000.
    "qwen2.5-math-1.5b": ModelArgs(151936, 1536, 28, 12, 2, 8960, 1e4, 1e-6, True, 4096),
    "qwen2.5-3b": ModelArgs(151936, 2048, 36, 16, 2, 11008, 1e6, 1e-6, True, 32768),
    # Qwen/Qwen2.5-Math-7B: the 7B shapes with a 4,096-token context and RoPE base 10,000.
    "qwen2.5-math-7b": ModelArgs(152064, 3584, 28, 28, 4, 18944, 1e4, 1e-6, False, 4096),
    "qwen2.5-7b": ModelArgs(152064, 3584, 28, 28, 4, 18944, 1e6, 1e-6, False, 131072),
    "qwen2.5-14b": ModelArgs(152064, 5120, 48, 40, 8, 13824, 1e6, 1e-5, False, 131072),
    "qwen2.5-32b": ModelArgs(152064, 5120, 64, 40, 8, 27648, 1e6, 1e-5, False, 131072),
    "qwen2.5-72b": ModelArgs(152064, 8192, 80, 64, 8, 29568, 1e6, 1e-5, False, 131072),
    # Tiny shapes with Qwen2.5's structure (GQA, qkv bias, SwiGLU) for tests and the CPU demo.
    "tiny": ModelArgs(256, 64, 2, 4, 2, 128, 1e6, 1e-6, False, 1024),
    "tiny-tied": ModelArgs(256, 64, 2, 4, 2, 128, 1e6, 1e-6, True, 1024),
    "demo": ModelArgs(512, 128, 4, 4, 2, 384, 1e6, 1e-6, True, 512),
}


def get_preset(name: str) -> ModelArgs:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown model preset {name!r}; known presets: {', '.join(PRESETS)}") from None


def training_flops(args: ModelArgs, doc_lengths: list[list[int]], head_tokens: int | None = None) -> float:
    """Forward + backward model FLOPs (3x forward) of packed rows of documents with these lengths:

        6 * block linear weights per token + 12 * L * H * c per token + 6 * V * H per head token,

    c being the number of keys the token attends to (its position in its document + 1); head tokens are
    those whose logits are computed (default: all; the RL trainer only needs the response tokens').
    Recomputation by activation checkpointing is not counted (the usual MFU convention)."""
    h, kv, inter = args.hidden_size, args.num_kv_heads * args.head_dim, args.intermediate_size
    block_linear = 2 * h * h + 2 * h * kv + 3 * h * inter
    tokens = sum(sum(row) for row in doc_lengths)
    head_tokens = tokens if head_tokens is None else head_tokens
    attended_keys = sum(n * (n + 1) // 2 for row in doc_lengths for n in row)
    return (
        6 * args.num_layers * block_linear * tokens
        + 6 * args.vocab_size * h * head_tokens
        + 12 * args.num_layers * h * attended_keys
    )
