"""Qwen2.5 as plain `nn.Module`s.

No torch.distributed import here: FSDP2, tensor parallelism, compile and activation checkpointing are
applied from outside by `parallel/`. Submodule names follow Hugging Face's Qwen2 layout
(`layers.N.self_attn.q_proj`, ...) so the checkpoint key map in `model/hf_adapter.py` is a short table.

Attention is computed through an *attention context* built once per forward pass:
  - `CausalContext`: plain causal SDPA (unpacked rows);
  - `DocumentMaskContext`: SDPA with an explicit document-causal boolean mask (packed rows, CPU);
  - `FlexDocumentContext`: FlexAttention with a block mask (packed rows, GPU; no CPU backward);
and the rollout engine passes its own context that reads and writes a KV cache. Heads are derived from
tensor shapes, so the same code runs on tensor-parallel shards holding a subset of heads.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from model.args import ModelArgs


class RMSNorm(nn.Module):
    """y = w * x / sqrt(mean(x^2) + eps), the statistic computed in fp32 at least (as HF Qwen2; a float64
    model keeps float64)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.to(torch.promote_types(dtype, torch.float32))
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


def rotary_cos_sin(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [B, T, head_dim] for integer positions [B, T], in fp32 (HF rotate-half layout)."""
    inv_freq = 1.0 / (
        theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.int64).float() / head_dim)
    )
    freqs = positions.float().unsqueeze(-1) * inv_freq  # [B, T, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, H, T, D] rotated by cos/sin [B, T, D] (computed in fp32 at least, cast back to x's dtype)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    wide = x.to(torch.promote_types(x.dtype, torch.float32))
    return (wide * cos + _rotate_half(wide) * sin).to(x.dtype)


# ---------------------------------------------------------------------------------------------------
# Attention contexts: how q/k/v become attention output for one forward pass.
# ---------------------------------------------------------------------------------------------------


class AttentionContext(Protocol):
    """What `Attention` calls: q [B, H, T, D], k and v [B, H_kv, T, D] of layer `layer_id` -> [B, H, T, D]."""

    def attend(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor: ...


class CausalContext:
    """Unpacked rows: every row is one sequence starting at position 0."""

    def attend(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])


class DocumentMaskContext:
    """Packed rows with SDPA (CPU, or CUDA without FlexAttention): token i sees token j iff both are in
    the same document and j <= i.

    When every document is one contiguous run of its row (what trainer/packing.py builds), the runs
    are gathered into a [documents, longest, ...] batch and attended with plain causal SDPA: the cost
    is sum(len^2) instead of T^2, and the padding at the end of a short run is never seen by its real
    queries (causality) and is dropped afterwards. Otherwise an explicit [B, 1, T, T] boolean mask is
    used. Every query sees at least itself, so no softmax row is empty.
    """

    def __init__(self, document_ids: torch.Tensor) -> None:
        b, t = document_ids.shape
        flat = document_ids.reshape(-1)
        row = torch.arange(b * t, device=flat.device) // t
        starts_here = torch.ones(b * t, dtype=torch.bool, device=flat.device)
        starts_here[1:] = (flat[1:] != flat[:-1]) | (row[1:] != row[:-1])
        starts = starts_here.nonzero().squeeze(1)
        distinct = torch.unique(row * (int(flat.max()) - int(flat.min()) + 1) + (flat - flat.min())).numel()
        self.mask: torch.Tensor | None = None  # [B, 1, T, T], when the documents are not contiguous runs
        self.index: torch.Tensor | None = None  # [documents, longest] row positions, when they are
        self.valid: torch.Tensor | None = None  # [documents, longest], when they are
        if starts.numel() == distinct:  # contiguous documents: segment them
            lengths = torch.diff(starts, append=torch.tensor([b * t], device=flat.device))
            offsets = torch.arange(int(lengths.max()), device=flat.device)
            self.valid = offsets < lengths.unsqueeze(1)
            self.index = torch.where(self.valid, starts.unsqueeze(1) + offsets, 0)
        else:
            same_doc = document_ids.unsqueeze(2) == document_ids.unsqueeze(1)
            causal = torch.ones(t, t, dtype=torch.bool, device=document_ids.device).tril()
            self.mask = (same_doc & causal).unsqueeze(1)

    def attend(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        gqa = q.shape[1] != k.shape[1]
        if self.mask is not None:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask, enable_gqa=gqa)
        assert self.index is not None and self.valid is not None  # no mask: __init__ segmented the documents
        index = self.index
        b, _, t, d = q.shape

        def segments(x: torch.Tensor) -> torch.Tensor:  # [B, H, T, D] -> [documents, H, longest, D]
            return x.transpose(1, 2).reshape(b * t, x.shape[1], d)[index].transpose(1, 2)

        out = F.scaled_dot_product_attention(segments(q), segments(k), segments(v), is_causal=True, enable_gqa=gqa)
        # The valid entries, read in order, are positions 0 .. B*T-1: the runs partition every row.
        out = out.transpose(1, 2)[self.valid]
        return out.reshape(b, t, q.shape[1], d).transpose(1, 2)


@functools.cache
def compiled_flex_attention() -> Callable[..., torch.Tensor]:
    """flex_attention compiled once per process: called eagerly it falls back to an unfused version that
    materialises the full [heads, T, T] scores in fp32 (no memory saved by the block mask, and slow).
    Inside an already compiled block the call is inlined into that block's graph."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention)


class FlexDocumentContext:
    """Packed rows on GPU: FlexAttention with a document-causal block mask (sparse, no T x T tensor)."""

    def __init__(self, document_ids: torch.Tensor) -> None:
        from torch.nn.attention.flex_attention import create_block_mask

        self._flex = compiled_flex_attention()
        docs = document_ids

        def document_causal(
            b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor
        ) -> torch.Tensor:
            return (docs[b, q_idx] == docs[b, kv_idx]) & (q_idx >= kv_idx)

        bsz, t = docs.shape
        self.block_mask = create_block_mask(document_causal, bsz, None, t, t, device=docs.device)

    def attend(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return self._flex(q, k, v, block_mask=self.block_mask, enable_gqa=q.shape[1] != k.shape[1])


def build_attention_context(
    document_ids: torch.Tensor | None, device: torch.device, backend: str = "auto"
) -> CausalContext | DocumentMaskContext | FlexDocumentContext:
    """Pick the attention implementation: SDPA on CPU, FlexAttention for packed rows on CUDA."""
    if backend not in ("auto", "sdpa", "flex"):
        raise ValueError(f"attention backend must be 'auto', 'sdpa' or 'flex', got {backend!r}")
    if document_ids is None:
        return CausalContext()
    use_flex = backend == "flex" or (backend == "auto" and device.type == "cuda")
    if use_flex and device.type != "cuda":
        raise ValueError("FlexAttention has no backward on CPU; use attention backend 'sdpa' there")
    return FlexDocumentContext(document_ids) if use_flex else DocumentMaskContext(document_ids)


# ---------------------------------------------------------------------------------------------------
# Blocks
# ---------------------------------------------------------------------------------------------------


class Attention(nn.Module):
    """Grouped-query attention: q/k/v projections with bias, o_proj without."""

    def __init__(self, args: ModelArgs, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.head_dim = args.head_dim
        kv_dim = args.num_kv_heads * args.head_dim
        self.q_proj = nn.Linear(args.hidden_size, args.hidden_size, bias=True)
        self.k_proj = nn.Linear(args.hidden_size, kv_dim, bias=True)
        self.v_proj = nn.Linear(args.hidden_size, kv_dim, bias=True)
        self.o_proj = nn.Linear(args.hidden_size, args.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, context: AttentionContext) -> torch.Tensor:
        b, t, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds a slice of the heads.
        q = self.q_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = context.attend(self.layer_id, q, k, v)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.up_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.down_proj = nn.Linear(args.intermediate_size, args.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs, layer_id: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.self_attn = Attention(args, layer_id)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.mlp = MLP(args)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, context: AttentionContext) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, context)
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen2(nn.Module):
    """Qwen2.5 decoder. `forward(tokens [B, T]) -> logits [B, T, V]` (or final hidden states).

    Tied models have no `lm_head` parameter: the output projection uses `embed_tokens.weight`, so
    FSDP units and checkpoints hold the shared tensor exactly once.
    """

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        # ModuleDict keyed "0".."N-1" keeps HF-style names and lets parallel/ replace blocks in place.
        self.layers = nn.ModuleDict({str(i): TransformerBlock(args, i) for i in range(args.num_layers)})
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.lm_head = None if args.tie_word_embeddings else nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        self.attention_backend = "auto"

    def output_weight(self) -> torch.Tensor:
        """The [V, H] output projection (the embedding matrix when tied)."""
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    @torch.no_grad()
    def init_weights(self, seed: int | None = None) -> None:
        """Initialize in place (after `to_empty` from the meta device).

        N(0, init_std) weights, zero biases, unit norms.
        """
        gen = None if seed is None else torch.Generator(device="cpu").manual_seed(seed)
        for module in self.modules():
            if isinstance(module, RMSNorm):
                module.reset_parameters()
            elif isinstance(module, (nn.Linear, nn.Embedding)):
                w = module.weight
                values = torch.empty(w.shape, dtype=torch.float32).normal_(0.0, self.args.init_std, generator=gen)
                w.copy_(values.to(w.dtype))
                bias = getattr(module, "bias", None)  # Linear's (None without one); Embedding has none
                if bias is not None:
                    bias.zero_()

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
        *,
        context: AttentionContext | None = None,
        return_hidden: bool = False,
    ) -> torch.Tensor:
        """tokens [B, T]; positions [B, T] (default 0..T-1); document_ids [B, T] for packed rows.

        Packed rows: positions restart at 0 for each sample and tokens attend only within their
        document. `context` overrides the attention implementation (the rollout engine's KV cache).
        """
        if tokens.dim() != 2:
            raise ValueError(f"tokens must be [batch, seq], got shape {tuple(tokens.shape)}")
        if positions is None:
            if document_ids is not None:
                raise ValueError("packed rows (document_ids) need explicit per-token positions")
            positions = torch.arange(tokens.shape[1], device=tokens.device).expand(tokens.shape[0], -1)
        if context is None:
            context = build_attention_context(document_ids, tokens.device, self.attention_backend)
        cos, sin = rotary_cos_sin(positions, self.args.head_dim, self.args.rope_theta)
        h = self.embed_tokens(tokens)
        for layer in self.layers.values():
            h = layer(h, cos, sin, context)
        h = self.norm(h)
        if return_hidden:
            return h
        return F.linear(h, self.output_weight()) if self.lm_head is None else self.lm_head(h)


def build_model(
    args: ModelArgs, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32, seed: int | None = None
) -> Qwen2:
    """Construct on the meta device, materialise on `device`, then initialise (no double allocation)."""
    with torch.device("meta"):
        model = Qwen2(args)
    model.to_empty(device=device)
    model.init_weights(seed=seed)
    return model.to(dtype)
