"""The embedded rollout engine: this repo's Qwen2 with a paged KV cache, on CPU or GPU.

How a round runs (continuous batching over KV blocks; rollout/scheduler.py holds the state):
  1. The prompts are expanded into sequences (prompt 0 sample 0..n-1, prompt 1 sample 0..n-1, ...),
     all waiting.
  2. Waiting sequences are admitted while blocks are free (`kv_cache_blocks` of `block_size` positions)
     and fewer than `max_batch_size` run: the samples of a prompt admitted together are prefilled once
     (right-padded batch of at most `max_prefill_tokens` padded tokens, `PrefillContext`) and share
     the prompt's full blocks; each gets its own copy of a partial last block. The first token of every
     sequence is sampled from the prefill logits at its prompt's last position.
  3. One decode step feeds every running sequence its last token at its own position (`DecodeContext`
     over its block table), samples the next token, and retires sequences that sampled a stop token
     ("stop") or reached their token budget ("length"); their blocks return to the free list. When a
     running sequence needs a new block and none is free, the youngest running sequences are preempted
     and later recomputed (prefill of prompt + generated tokens), which leaves their outputs unchanged.
Both phases call the model's own forward with `context=...`, so the engine never duplicates its math.
`submit` queues the sequences of a round (rollout/engine.py Engine), `poll` runs at most `poll_steps` scheduler
steps and returns the sequences that finished; `generate` is a whole round (submit, poll until done, gather).

Sampling and log-probs follow rollout/sampling.py; the budget of a sequence is
min(max_new_tokens, max_seq_len - len(prompt)), so prompt + completion always fits the context.
Sampling draws one uniform per sampled row in batch order, so a fixed seed reproduces the samples for
fixed engine settings (a different block budget or batch size changes which rows share a step).

With `compile=True` the decode step runs under torch.compile: with dynamic shapes on CPU (batch and
block-table width vary between steps), and on CUDA with static shapes (max_batch_size rows; the block
table width rounded up to a multiple of 1/8 of a full-length sequence's blocks) under
mode="reduce-overhead", so each of at most 8 shapes is compiled and captured as a CUDA graph once (8 is
torch.compile's default recompile limit).
This engine is not tensor-parallel: every rank that runs it holds a full copy of the model.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch.nn.utils.rnn import pad_sequence

from model.args import ModelArgs
from model.hf_adapter import from_hf_name, to_hf_name
from rollout.engine import Completion, Polled, SamplingParams, checked_bucket, generate, validate_prompts
from rollout.kv_cache import DecodeContext, PagedKVCache, PrefillContext
from rollout.sampling import sample
from rollout.scheduler import BlockManager, Scheduler, SchedulerStats, Sequence

if TYPE_CHECKING:
    from model.qwen2 import Qwen2

# The decode step: (tokens [B], positions [B], block tables [B, W], per-layer k and v caches) -> logits [B, V].
DecodeStep = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor], list[torch.Tensor]], torch.Tensor]


class TorchEngine:
    """Rollout engine around a `model.qwen2.Qwen2` that it owns (hand it a copy, not the trainer's).

    max_batch_size: most sequences decoded together.
    max_seq_len: longest prompt + completion, in tokens (<= the model's max_position_embeddings).
    block_size: token positions per KV block.
    kv_cache_blocks: KV blocks (the engine's KV memory: kv_cache_blocks * block_size *
        `PagedKVCache.bytes_per_token`); None = max_batch_size full-length sequences' worth.
        At least one full-length sequence's blocks.
    device / dtype: move the model there once at construction (default: where it already is).
    compile: compile the decode step with torch.compile.
    cuda_graphs: with compile on CUDA, replay the decode step as CUDA graphs (mode "reduce-overhead").
    seed: seeds rounds whose SamplingParams.seed is None (round k uses seed + k).
    max_prefill_tokens: padded tokens per prefill forward (bounds prefill activation memory).
    poll_steps: scheduler steps (prefills and one decode step) a `poll` runs at most.
    """

    def __init__(
        self,
        model: Qwen2,
        *,
        max_batch_size: int,
        max_seq_len: int,
        device: str | torch.device | None = None,
        dtype: torch.dtype | None = None,
        compile: bool = False,
        seed: int = 0,
        max_prefill_tokens: int = 16384,
        cuda_graphs: bool = True,
        block_size: int = 16,
        kv_cache_blocks: int | None = None,
        poll_steps: int = 16,
    ) -> None:
        args = _checked_model_args(model, max_batch_size, max_seq_len, max_prefill_tokens, block_size)
        self.blocks_per_seq = -(-max_seq_len // block_size)
        if kv_cache_blocks is None:  # by default max_batch_size full-length sequences' worth
            kv_cache_blocks = max_batch_size * self.blocks_per_seq
        if kv_cache_blocks < self.blocks_per_seq:  # at least one full-length sequence's
            raise ValueError(
                f"kv_cache_blocks = {kv_cache_blocks} cannot hold one sequence of max_seq_len = {max_seq_len} "
                f"tokens; it needs at least {self.blocks_per_seq} blocks of {block_size}"
            )
        if device is not None or dtype is not None:
            model.to(device=device, dtype=dtype)
        model.eval().requires_grad_(False)
        first = next(model.parameters())
        self.model: Qwen2 | None = model  # None once shut down
        self.args: ModelArgs = args
        self.device = first.device
        self.dtype = first.dtype
        self.max_batch_size = max_batch_size
        self.max_seq_len = max_seq_len
        self.max_prefill_tokens = max_prefill_tokens
        self.block_size = block_size
        self.kv_cache_blocks = kv_cache_blocks
        self.seed = seed
        self.poll_steps = poll_steps
        self.stats = SchedulerStats()  # of the last round
        self.blocks = BlockManager(kv_cache_blocks, block_size)  # the last round's
        self._round: _Round | None = None  # the samples in flight
        self._calls = 0
        self._params = dict(model.named_parameters())
        self._weights = {to_hf_name(n): (p.shape, p.dtype) for n, p in self._params.items()}  # what a bucket may hold
        self._cache: PagedKVCache | None = None
        self._static_shapes = compile and self.device.type == "cuda"
        self._width_bucket = -(-self.blocks_per_seq // 8)
        # DecodeContext's reused gather buffers: eager CPU only (see kv_cache.py)
        self._gather_out = _empty_gather_buffers(self.dtype) if not compile and self.device.type == "cpu" else None
        self._decode = self._decode_step(compile, cuda_graphs)
        self.resume_memory()

    def _decode_step(self, compile: bool, cuda_graphs: bool) -> DecodeStep:
        """The decode step, compiled or eager (module docstring): with compile on CUDA, static shapes and
        (with cuda_graphs) CUDA graphs by mode "reduce-overhead"; elsewhere dynamic shapes."""
        if not compile:
            return self._decode_logits
        graphs = self._static_shapes and cuda_graphs
        return torch.compile(
            self._decode_logits, dynamic=not self._static_shapes, mode="reduce-overhead" if graphs else "default"
        )

    # ---------------------------------------------------------------------------------------------
    # Memory and weights
    # ---------------------------------------------------------------------------------------------

    def release_memory(self) -> None:
        """Free the KV cache (the weights stay: the next `update_weights` writes into them)."""
        self._refuse_in_flight("release_memory")
        self._cache = None
        if self._gather_out is not None:
            self._gather_out = _empty_gather_buffers(self.dtype)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def resume_memory(self) -> None:
        """Allocate the KV cache again (a no-op if it is allocated)."""
        if self._cache is None:
            a = self.args
            self._cache = PagedKVCache(
                a.num_layers, self.kv_cache_blocks, self.block_size, a.num_kv_heads, a.head_dim, self.device, self.dtype
            )
            if self._static_shapes:
                # CUDA graphs may only mutate inputs at fixed addresses; a resumed cache is re-recorded once.
                for t in self._cache.k + self._cache.v:
                    torch._dynamo.mark_static_address(t)

    def _refuse_in_flight(self, what: str) -> None:
        if self._round is not None:
            raise RuntimeError(f"{what}() while submitted samples are in flight")

    def shutdown(self) -> None:
        self._round = None
        self.release_memory()
        self._params = {}
        self.model = None

    @torch.no_grad()
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy one bucket of (HF name, tensor) pairs into the existing parameters with copy_.

        The whole bucket is checked first (known name, no duplicates, exact shape and dtype), so a bad
        bucket raises before any parameter changes. Storage is never re-allocated, so data pointers,
        compiled graphs and CUDA graphs stay valid.
        """
        if self.model is None:
            raise RuntimeError("the engine was shut down")
        self._refuse_in_flight("update_weights")
        for name, tensor in checked_bucket(named_tensors, self._weights):
            self._params[from_hf_name(name)].copy_(tensor)

    # ---------------------------------------------------------------------------------------------
    # Forward passes
    # ---------------------------------------------------------------------------------------------

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # Only the positions we sample from get projected to the vocabulary (not the whole prompt).
        assert self.model is not None  # submit refuses a shut-down engine
        return F.linear(hidden, self.model.output_weight()).float()

    def _decode_logits(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        block_tables: torch.Tensor,
        k_cache: list[torch.Tensor],
        v_cache: list[torch.Tensor],
    ) -> torch.Tensor:
        """tokens, positions [B], block_tables [B, W] -> next-token logits [B, V] (fp32), k/v written."""
        assert self.model is not None  # submit refuses a shut-down engine
        context = DecodeContext(k_cache, v_cache, positions, block_tables, self._gather_out)
        hidden = self.model(tokens.unsqueeze(1), positions.unsqueeze(1), context=context, return_hidden=True)
        return self._logits(hidden[:, 0])

    def _prefill_logits(self, groups: list[list[Sequence]]) -> torch.Tensor:
        """Prefill each group's token list once into its sequences' blocks; returns the last-position
        logits per sequence [sum of group sizes, V], in group order."""
        assert self.model is not None and self._cache is not None  # submit checks both
        rows = [group[0].prompt + group[0].token_ids for group in groups]
        lengths = torch.tensor([len(r) for r in rows], device=self.device)
        tokens = pad_sequence([torch.tensor(r, dtype=torch.long) for r in rows], batch_first=True).to(self.device)
        positions = torch.arange(tokens.shape[1], device=self.device).expand(len(rows), -1)
        writes = [self._prefill_writes(i, group) for i, group in enumerate(groups)]
        src_row, src_pos, dst_block, dst_offset = (torch.cat(parts).to(self.device) for parts in zip(*writes))
        context = PrefillContext(self._cache, src_row, src_pos, dst_block, dst_offset)
        hidden = self.model(tokens, positions, context=context, return_hidden=True)
        last = hidden[torch.arange(len(rows), device=self.device), lengths - 1]
        row_of_seq = torch.tensor([i for i, group in enumerate(groups) for _ in group], device=self.device)
        return self._logits(last)[row_of_seq]

    def _prefill_writes(
        self, row: int, group: list[Sequence]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(src_row, src_pos, dst_block, dst_offset) of one group: the shared full blocks once, from the
        first sequence's table, then the partial last block once per sequence."""
        n = group[0].num_tokens
        full = n - n % self.block_size
        pos = [torch.arange(full)] + [torch.arange(full, n) for _ in group if full < n]
        blocks = [torch.tensor(group[0].block_table[: full // self.block_size]).repeat_interleave(self.block_size)]
        blocks += [torch.full((n - full,), seq.block_table[-1]) for seq in group if full < n]
        positions, block_ids = torch.cat(pos), torch.cat(blocks).long()
        return torch.full_like(positions, row), positions, block_ids, positions % self.block_size

    def _decode_batch(self, running: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Decode inputs: last tokens, positions and block tables padded with the scratch block; on the
        static-shape (CUDA graph) path also padded to max_batch_size rows and a bucketed width."""
        width = max(len(seq.block_table) for seq in running)
        rows = len(running)
        if self._static_shapes:
            width = min(self.blocks_per_seq, -(-width // self._width_bucket) * self._width_bucket)
            rows = self.max_batch_size
        assert self._cache is not None  # submit checks it
        scratch = self._cache.scratch_block
        tables = [seq.block_table + [scratch] * (width - len(seq.block_table)) for seq in running]
        tables += [[scratch] * width] * (rows - len(running))
        pad = [0] * (rows - len(running))
        tokens = torch.tensor([seq.token_ids[-1] for seq in running] + pad, device=self.device)
        positions = torch.tensor([seq.position for seq in running] + pad, device=self.device)
        return tokens, positions, torch.tensor(tables, device=self.device)

    @staticmethod
    def _sample_into(
        seqs: list[Sequence],
        logits: torch.Tensor,
        params: SamplingParams,
        generator: torch.Generator,
        stop: frozenset[int],
    ) -> None:
        """Sample one token per row of logits and append it (with its log-prob) to that row's sequence."""
        tokens, logprobs = sample(logits, params.temperature, params.top_k, params.top_p, generator)
        for seq, token, logprob in zip(seqs, tokens.tolist(), logprobs.tolist()):
            seq.append(token, logprob, stop)

    # ---------------------------------------------------------------------------------------------
    # Generation
    # ---------------------------------------------------------------------------------------------

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        """params.n completions of every prompt, grouped by prompt: one whole round (rollout/engine.py generate)."""
        return generate(self, prompts, params)

    def submit(self, prompts: list[list[int]], params: SamplingParams) -> None:
        """Queue params.n samples of every prompt (rollout/engine.py Engine); the submit seeds the sampler:
        params.seed, or the engine's seed + the number of rounds so far."""
        if self.model is None:
            raise RuntimeError("the engine was shut down")
        if self._cache is None:
            raise RuntimeError("the KV cache is released; call resume_memory() before generating")
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        self._refuse_in_flight("submit")
        if not prompts:  # a rank without a share of the work still takes part: nothing to do
            return
        validate_prompts(prompts, self.max_seq_len - 1, self.args.vocab_size)
        seed = params.seed if params.seed is not None else self.seed + self._calls
        self._calls += 1
        generator = torch.Generator(device=self.device)
        generator.manual_seed(seed)
        self.blocks = BlockManager(self.kv_cache_blocks, self.block_size)
        scheduler = Scheduler(self.blocks, self.max_batch_size, self.max_prefill_tokens)
        self._round = _Round(scheduler, generator, params, frozenset(params.stop_token_ids))
        for p, prompt in enumerate(prompts):
            budget = min(params.max_new_tokens, self.max_seq_len - len(prompt))
            scheduler.add([Sequence(p, s, list(map(int, prompt)), budget) for s in range(params.n)])

    @torch.inference_mode()
    def poll(self) -> Polled:
        """At most poll_steps scheduler steps: the completions that finished in them and the tokens sampled."""
        r = self._round
        if r is None:
            return Polled([], 0, True)
        done, sampled = [], 0
        for _ in range(self.poll_steps):
            if r.scheduler.done():
                break
            finished, tokens = self._step(r)
            done += [_completion(seq) for seq in finished]
            sampled += tokens
        if r.scheduler.done():
            self.stats, self._round = r.scheduler.stats, None
        return Polled(done, sampled, self._round is None)

    def _step(self, r: _Round) -> tuple[list[Sequence], int]:
        """One scheduler step: the prefills it admits, then one decode step; the sequences that finished, and
        the tokens sampled."""
        assert self._cache is not None  # submit checks it, and release_memory refuses a round in flight
        retired: list[Sequence] = []
        sampled = 0
        while groups := r.scheduler.next_prefill():
            prefilled = [seq for group in groups for seq in group]
            self._sample_into(prefilled, self._prefill_logits(groups), r.params, r.generator, r.stop)
            retired, sampled = retired + r.scheduler.retire_finished(), sampled + len(prefilled)
        running = r.scheduler.next_decode()
        if running:  # else everything was preempted or retired: admit again
            logits = self._decode(*self._decode_batch(running), self._cache.k, self._cache.v)
            self._sample_into(running, logits[: len(running)], r.params, r.generator, r.stop)
            retired, sampled = retired + r.scheduler.retire_finished(), sampled + len(running)
        return retired, sampled


@dataclasses.dataclass
class _Round:
    """What runs between a submit and the poll that returns its last completion."""

    scheduler: Scheduler
    generator: torch.Generator
    params: SamplingParams
    stop: frozenset[int]


def _completion(seq: Sequence) -> Completion:
    return Completion(seq.prompt_index, seq.sample_index, seq.token_ids, seq.logprobs, seq.finish_reason or "abort")


def _checked_model_args(
    model: Qwen2, max_batch_size: int, max_seq_len: int, max_prefill_tokens: int, block_size: int
) -> ModelArgs:
    """The model's ModelArgs, after refusing a model that is not a Qwen2 and sizes it cannot serve."""
    args = getattr(model, "args", None)
    if not isinstance(args, ModelArgs) or not hasattr(model, "output_weight"):
        raise TypeError(f"TorchEngine needs a model.qwen2.Qwen2, got {type(model).__name__}")
    if max_batch_size < 1:
        raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
    if not 2 <= max_seq_len <= args.max_position_embeddings:
        raise ValueError(
            f"max_seq_len must be in [2, {args.max_position_embeddings}] (the model's "
            f"max_position_embeddings), got {max_seq_len}"
        )
    if max_prefill_tokens < 1:
        raise ValueError(f"max_prefill_tokens must be >= 1, got {max_prefill_tokens}")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    return args


def _empty_gather_buffers(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty k and v buffers for DecodeContext to gather the blocks into; it grows them as needed."""
    return torch.empty(0, dtype=dtype), torch.empty(0, dtype=dtype)
