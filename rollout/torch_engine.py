"""The embedded rollout engine: this repo's Qwen2 with a preallocated KV cache, on CPU or GPU.

How a `generate` call runs (continuous batching over a fixed pool of cache slots):
  1. The prompts are expanded into requests (prompt 0 sample 0..n-1, prompt 1 sample 0..n-1, ...).
  2. While there are free slots and waiting requests, the next requests are admitted: their distinct
     prompts are prefilled once (right-padded batch, `PrefillContext`) and each prompt's k/v is written
     into the slots of all its samples, so n samples share one prefill. The first token of every
     request is sampled from the prefill logits at its prompt's last position.
  3. One decode step feeds every occupied slot its last token at its own position (`DecodeContext`),
     samples the next token, and retires requests that sampled a stop token ("stop") or reached their
     token budget ("length"). Freed slots are refilled at the next step.
Both phases call the model's own forward with `context=...`, so the engine never duplicates its math.

Sampling and log-probs follow rollout/sampling.py; the budget of a request is
min(max_new_tokens, max_seq_len - len(prompt)), so prompt + completion always fits the context.

With `compile=True` the decode step runs under torch.compile: with dynamic shapes on CPU (batch and
cache length vary between steps), and on CUDA with static shapes (all slots; the cache length rounded
up to a multiple of max_seq_len / 8) under mode="reduce-overhead", so each of at most 8 shapes
is compiled and captured as a CUDA graph once (8 is torch.compile's default recompile limit).
This engine is not tensor-parallel: every rank that runs it holds a full copy of the model.
"""

from __future__ import annotations

import collections
from typing import Iterable

import torch
import torch.nn.functional as F

from model.args import ModelArgs
from model.hf_adapter import from_hf_name
from rollout.engine import Completion, SamplingParams, validate_prompts
from rollout.kv_cache import DecodeContext, KVCache, PrefillContext
from rollout.sampling import sample


class TorchEngine:
    """Rollout engine around a `model.qwen2.Qwen2` that it owns (hand it a copy, not the trainer's).

    max_batch_size: KV-cache slots, i.e. requests decoded together.
    max_seq_len: longest prompt + completion, in tokens (<= the model's max_position_embeddings).
    device / dtype: move the model there once at construction (default: where it already is).
    compile: compile the decode step with torch.compile.
    cuda_graphs: with compile on CUDA, replay the decode step as CUDA graphs (mode "reduce-overhead").
    seed: seeds calls whose SamplingParams.seed is None (call k uses seed + k).
    max_prefill_tokens: padded prompt tokens per prefill forward (bounds prefill activation memory).
    """

    def __init__(self, model: torch.nn.Module, *, max_batch_size: int, max_seq_len: int,
                 device: str | torch.device | None = None, dtype: torch.dtype | None = None,
                 compile: bool = False, seed: int = 0, max_prefill_tokens: int = 16384, cuda_graphs: bool = True):
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
        if device is not None or dtype is not None:
            model.to(device=device, dtype=dtype)
        model.eval().requires_grad_(False)
        first = next(model.parameters())
        self.model = model
        self.args: ModelArgs = args
        self.device = first.device
        self.dtype = first.dtype
        self.max_batch_size = max_batch_size
        self.max_seq_len = max_seq_len
        self.max_prefill_tokens = max_prefill_tokens
        self.seed = seed
        self._calls = 0
        self._params = dict(model.named_parameters())
        self._cache: KVCache | None = None
        self._static_shapes = compile and self.device.type == "cuda"
        self._kv_bucket = -(-max_seq_len // 8)
        if compile:
            if self._static_shapes:
                self._decode = torch.compile(self._decode_logits, dynamic=False,
                                             mode="reduce-overhead" if cuda_graphs else "default")
            else:
                self._decode = torch.compile(self._decode_logits, dynamic=True)
        else:
            self._decode = self._decode_logits
        self.resume_memory()

    # ---------------------------------------------------------------------------------------------
    # Memory and weights
    # ---------------------------------------------------------------------------------------------

    def release_memory(self) -> None:
        """Free the KV cache (the weights stay: the next `update_weights` writes into them)."""
        self._cache = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def resume_memory(self) -> None:
        """Allocate the KV cache again (a no-op if it is allocated)."""
        if self._cache is None:
            a = self.args
            self._cache = KVCache(a.num_layers, self.max_batch_size, a.num_kv_heads, self.max_seq_len,
                                  a.head_dim, self.device, self.dtype)
            if self._static_shapes:
                # CUDA graphs may only mutate inputs at fixed addresses; a resumed cache is re-recorded once.
                for t in self._cache.k + self._cache.v:
                    torch._dynamo.mark_static_address(t)

    def shutdown(self) -> None:
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
        bucket = list(named_tensors)
        targets = []
        seen = set()
        for hf_name, tensor in bucket:
            try:
                name = from_hf_name(hf_name)
            except KeyError:
                name = None
            param = self._params.get(name) if name is not None else None
            if param is None:
                raise KeyError(f"update_weights: unknown weight {hf_name!r}: the engine's model has no such parameter")
            if name in seen:
                raise ValueError(f"update_weights: weight {hf_name!r} appears twice in one bucket")
            seen.add(name)
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(f"update_weights: {hf_name!r} is a {type(tensor).__name__}, not a tensor")
            if tensor.shape != param.shape:
                raise ValueError(f"update_weights: {hf_name!r} has shape {tuple(tensor.shape)}, "
                                 f"the engine's is {tuple(param.shape)}")
            if tensor.dtype != param.dtype:
                raise ValueError(f"update_weights: {hf_name!r} has dtype {tensor.dtype}, the engine's is {param.dtype}")
            targets.append((param, tensor))
        for param, tensor in targets:
            param.copy_(tensor)

    # ---------------------------------------------------------------------------------------------
    # Forward passes
    # ---------------------------------------------------------------------------------------------

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # Only the positions we sample from get projected to the vocabulary (not the whole prompt).
        return F.linear(hidden, self.model.output_weight()).float()

    def _decode_logits(self, tokens: torch.Tensor, positions: torch.Tensor, kv_len: int,
                       k_cache: list[torch.Tensor], v_cache: list[torch.Tensor]) -> torch.Tensor:
        """tokens, positions [B] -> next-token logits [B, V] (fp32), k/v appended to the cache."""
        context = DecodeContext(k_cache, v_cache, positions, kv_len)
        hidden = self.model(tokens.unsqueeze(1), positions.unsqueeze(1), context=context, return_hidden=True)
        return self._logits(hidden[:, 0])

    def _prefill_logits(self, prompts: list[list[int]], slot_ids: list[int], row_of_slot: list[int]) -> torch.Tensor:
        """Prefill distinct prompts into their slots; returns the last-position logits per slot [S, V]."""
        lengths = torch.tensor([len(p) for p in prompts], device=self.device)
        t = int(lengths.max())
        tokens = torch.zeros(len(prompts), t, dtype=torch.long)
        for i, p in enumerate(prompts):
            tokens[i, : len(p)] = torch.tensor(p, dtype=torch.long)
        tokens = tokens.to(self.device)
        positions = torch.arange(t, device=self.device).expand(len(prompts), -1)
        row_index = torch.tensor(row_of_slot, device=self.device)
        context = PrefillContext(self._cache, torch.tensor(slot_ids, device=self.device), row_index)
        hidden = self.model(tokens, positions, context=context, return_hidden=True)
        last = hidden[torch.arange(len(prompts), device=self.device), lengths - 1]
        return self._logits(last)[row_index]

    # ---------------------------------------------------------------------------------------------
    # Generation
    # ---------------------------------------------------------------------------------------------

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        """Sample `params.n` completions per prompt; returns them grouped by prompt (see module doc)."""
        if self.model is None:
            raise RuntimeError("the engine was shut down")
        if self._cache is None:
            raise RuntimeError("the KV cache is released; call resume_memory() before generate()")
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        validate_prompts(prompts, self.max_seq_len - 1, self.args.vocab_size)
        prompts = [list(map(int, p)) for p in prompts]

        seed = params.seed if params.seed is not None else self.seed + self._calls
        self._calls += 1
        generator = torch.Generator(device=self.device)
        generator.manual_seed(seed)
        stop = frozenset(params.stop_token_ids)

        requests = [(p, s) for p in range(len(prompts)) for s in range(params.n)]
        budget = [min(params.max_new_tokens, self.max_seq_len - len(prompts[p])) for p, _ in requests]
        out_tokens: list[list[int]] = [[] for _ in requests]
        out_logprobs: list[list[float]] = [[] for _ in requests]
        finish: list[str | None] = [None] * len(requests)

        num_slots = self.max_batch_size if self._static_shapes else min(self.max_batch_size, len(requests))
        slot_request = [-1] * num_slots
        slot_position = [0] * num_slots  # where the slot's next input token goes
        slot_token = [0] * num_slots  # the slot's next input token
        waiting = collections.deque(range(len(requests)))

        def record(slots: list[int], tokens: torch.Tensor, logprobs: torch.Tensor) -> None:
            for slot, token, logprob in zip(slots, tokens.tolist(), logprobs.tolist()):
                r = slot_request[slot]
                out_tokens[r].append(token)
                out_logprobs[r].append(logprob)
                if token in stop:
                    finish[r] = "stop"
                elif len(out_tokens[r]) >= budget[r]:
                    finish[r] = "length"
                else:
                    slot_token[slot] = token
                    slot_position[slot] += 1
                    continue
                slot_request[slot] = -1

        while True:
            free = [s for s in range(num_slots) if slot_request[s] < 0]
            if waiting and free:
                admitted = [(slot, waiting.popleft()) for slot in free[: len(waiting)]]
                for chunk in self._prefill_chunks(admitted, requests, prompts):
                    distinct = list(dict.fromkeys(requests[r][0] for _, r in chunk))
                    row = {p: i for i, p in enumerate(distinct)}
                    slots = [slot for slot, _ in chunk]
                    for slot, r in chunk:
                        slot_request[slot] = r
                        slot_position[slot] = len(prompts[requests[r][0]]) - 1
                    logits = self._prefill_logits([prompts[p] for p in distinct], slots,
                                                  [row[requests[r][0]] for _, r in chunk])
                    record(slots, *sample(logits, params.temperature, params.top_k, params.top_p, generator))
            active = [s for s in range(num_slots) if slot_request[s] >= 0]
            if not active:
                if waiting:
                    continue
                break
            batch = num_slots if self._static_shapes else active[-1] + 1
            kv_len = max(slot_position[s] for s in active) + 1
            if self._static_shapes:
                kv_len = min(self.max_seq_len, -(-kv_len // self._kv_bucket) * self._kv_bucket)
            # Idle slots below `batch` compute on a dummy token at position 0; their output is ignored.
            occupied = [slot_request[s] >= 0 for s in range(batch)]
            tokens = torch.tensor([slot_token[s] if occupied[s] else 0 for s in range(batch)], device=self.device)
            positions = torch.tensor([slot_position[s] if occupied[s] else 0 for s in range(batch)], device=self.device)
            logits = self._decode(tokens, positions, kv_len, self._cache.k, self._cache.v)
            next_tokens, logprobs = sample(logits, params.temperature, params.top_k, params.top_p, generator)
            index = torch.tensor(active, device=self.device)
            record(active, next_tokens[index], logprobs[index])

        return [Completion(p, s, out_tokens[r], out_logprobs[r], finish[r]) for r, (p, s) in enumerate(requests)]

    def _prefill_chunks(self, admitted, requests, prompts):
        """Split admitted (slot, request) pairs into prefills of <= max_prefill_tokens padded tokens.

        Requests arrive prompt-major, so a prompt's samples are adjacent and land in the same chunk
        unless the chunk boundary falls between them (then that prompt is prefilled twice).
        """
        chunk, distinct, longest = [], set(), 0
        for slot, r in admitted:
            p = requests[r][0]
            if p not in distinct:
                new_longest = max(longest, len(prompts[p]))
                if chunk and new_longest * (len(distinct) + 1) > self.max_prefill_tokens:
                    yield chunk
                    chunk, distinct, new_longest = [], set(), len(prompts[p])
                distinct.add(p)
                longest = new_longest
            chunk.append((slot, r))
        if chunk:
            yield chunk

