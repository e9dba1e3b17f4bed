"""The rollout engine protocol: what train.py needs from any inference engine.

Two implementations exist: `rollout.torch_engine.TorchEngine` (this repo's Qwen2 with a KV cache, CPU or
GPU) and `rollout.sglang_engine.SGLangEngine` (SGLang on GPUs). `generate(engine, prompts, params)` runs a round
on any of them, as nano-vllm's LLMEngine.generate does: submit, poll until done, gather. train.py only sees this
protocol, through the guard that drives it on every rank (run/guard.py GuardedEngine: the same loop, each poll
agreed by every rank and the engine's progress watched).

Conventions shared by every engine:
  * Prompts and completions are token ids; no tokenizer is involved.
  * `submit(prompts, params)` starts params.n samples of each prompt; `poll()` returns the completions that
    finished since the last poll, in any order (prompt p's carry prompt_index p), and how many tokens the
    engine produced meanwhile: its progress. `generate` hands them back grouped by prompt: all `n` samples of
    prompt 0, then prompt 1, ...
  * A completion's `logprobs[i]` is log_softmax(logits / T)[token_ids[i]], computed from the very logits
    the token was sampled from (before any top-p / top-k truncation); at temperature 0 (greedy) it is
    the log_softmax of the raw logits. These are the "old policy" log-probs of DAPO's ratio (Eq. 10).
  * When a stop token is sampled it IS included in `token_ids` (with its log-prob) and the finish
    reason is "stop". "length" means `max_new_tokens` (or the engine's context) ran out; "abort" means
    the engine gave up on the sample (SGLang), a failure.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol, runtime_checkable

import torch

from errors import RunStopped

FinishReason = Literal["stop", "length", "abort"]


@dataclass(frozen=True)
class SamplingParams:
    """How to sample.

    max_new_tokens: at most this many tokens per completion (>= 1).
    temperature: logits are divided by it before softmax; 0 means greedy (argmax).
    top_p: nucleus sampling; keep the smallest set of most-likely tokens whose probability mass is
        >= top_p (1.0 = off). Applied after top-k.
    top_k: keep only the k most likely tokens (-1 = off).
    n: samples per prompt (the DAPO group size G).
    stop_token_ids: sampling one of these ends the completion (the token is kept, reason "stop").
    seed: seeds the sampler of one `generate` call: the same seed, prompts and engine settings give
        the same samples. None lets the engine advance its own seed. (SGLang seeds once at start.)
    """

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    n: int = 1
    stop_token_ids: tuple[int, ...] = field(default=())
    seed: int | None = None

    def __post_init__(self) -> None:
        # Accept any iterable of ints for stop tokens but store a tuple so the params stay hashable.
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"SamplingParams.max_new_tokens must be an int >= 1, got {self.max_new_tokens!r}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature must be finite and >= 0, got {self.temperature!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or (self.top_k != -1 and self.top_k < 1):
            raise ValueError(f"SamplingParams.top_k must be -1 (off) or an int >= 1, got {self.top_k!r}")
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"SamplingParams.n must be an int >= 1, got {self.n!r}")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError(f"SamplingParams.stop_token_ids must be non-negative, got {self.stop_token_ids}")


@dataclass
class Completion:
    """One sampled response: `token_ids` and their per-token `logprobs` (same length).

    finish_reason "stop": the last token is the stop token that was sampled (kept, with its log-prob);
    "length": max_new_tokens (or the engine's context) was reached; "abort": the engine gave up.
    """

    prompt_index: int
    sample_index: int
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason

    def __post_init__(self) -> None:
        if len(self.token_ids) != len(self.logprobs):
            raise ValueError(f"Completion has {len(self.token_ids)} tokens but {len(self.logprobs)} log-probs")
        if self.finish_reason not in ("stop", "length", "abort"):
            raise ValueError(f"finish_reason must be 'stop', 'length' or 'abort', got {self.finish_reason!r}")


class EngineDied(RunStopped, RuntimeError):
    """The engine's process ended (crashed, killed, or ended by its own crash handling): it serves no further
    call. The trainer's state lives in the trainer's process and is intact; rollout/engine_process.py."""

    def line(self) -> str:
        return f"error: the rollout engine died: {self}"


class EngineFailure(RuntimeError):
    """The engine returned an aborted request or failed; carries how many requests were in flight."""


def check_completions(completions: Sequence[Completion], num_prompts: int, n: int) -> None:
    """Raise EngineFailure unless the engine returned n completions per prompt, none aborted, grouped by
    prompt (prompt p's at positions p * n ... p * n + n - 1). Scoring the rest of an incomplete answer
    would bias the reward and the accuracy."""
    expected = num_prompts * n
    if len(completions) != expected:
        raise EngineFailure(
            f"the engine returned {len(completions)} completions for {num_prompts} prompts x "
            f"{n} samples (expected {expected})"
        )
    aborted = [c for c in completions if c.finish_reason == "abort"]
    if aborted:
        raise EngineFailure(
            f"the engine aborted {len(aborted)} of {expected} requests (finish reason 'abort'), "
            f"first: prompt {aborted[0].prompt_index}, sample {aborted[0].sample_index}"
        )
    for p in range(num_prompts):
        found = [c.prompt_index for c in completions[p * n : (p + 1) * n]]
        if any(index != p for index in found):
            raise EngineFailure(
                f"completions are not grouped by prompt: positions {p * n} to {(p + 1) * n - 1} "
                f"should all belong to prompt {p}, got prompt indices {found}"
            )


@dataclass
class Polled:
    """What one poll returns: the completions that finished since the last poll (any order), the tokens the
    engine produced meanwhile over all its requests (SGLang reports a request's every 50 tokens and at its end),
    and whether this rank's round is over (nothing of it left in the engine)."""

    completions: list[Completion]
    tokens: int
    done: bool


@runtime_checkable
class Engine(Protocol):
    """An inference engine that shares the GPUs with the trainer. With SGLang each call is a collective over the
    ranks that share one engine (its tensor parallelism): every rank of it makes the same calls.

    submit(prompts, params): start params.n samples of every prompt (none: the rank still takes part); an
        engine with samples in flight refuses it, and every call below but poll and shutdown.
    poll(): generate for one slice (torch: poll_steps scheduler steps; SGLang: up to poll_s seconds, less once a
        prompt's samples are back) and return what finished, the tokens produced and whether the round is over
        (`Polled`); nothing in flight: nothing and done, at once.
    update_weights(named_tensors): one bucket of (Hugging Face name, full tensor) pairs, copied into the
        engine's existing weights; the whole bucket is validated before anything is written.
    release_memory() / resume_memory(): free the KV cache (and weights, where supported) while the
        trainer runs; take it back before the next rollout.
    shutdown(): free everything; the engine is unusable afterwards.
    """

    def submit(self, prompts: list[list[int]], params: SamplingParams) -> None: ...

    def poll(self) -> Polled: ...

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None: ...

    def release_memory(self) -> None: ...

    def resume_memory(self) -> None: ...

    def shutdown(self) -> None: ...


def generate(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
    """params.n completions of every prompt, grouped by prompt (prompt 0's n first): submit, then `gather` the
    engine's polls. One process, no guard: a notebook's or a test's round (train.py's: run/guard.py)."""
    engine.submit(prompts, params)
    return gather(engine.poll, len(prompts), params.n)


def gather(poll: Callable[[], Polled], num_prompts: int, n: int) -> list[Completion]:
    """Poll until a poll says done; the completions of every poll, grouped by prompt and checked
    (`check_completions`)."""
    completions: list[Completion] = []
    while True:
        polled = poll()
        completions += polled.completions
        if polled.done:
            break
    completions.sort(key=lambda c: (c.prompt_index, c.sample_index))
    check_completions(completions, num_prompts, n)
    return completions


class Generator(Protocol):
    """The engine as evaluation and the rollout phase call it: run/guard.py GuardedEngine, whose generate is the
    loop above on every rank (params.n completions per prompt, grouped by prompt), and whose everyone(flag) is an
    agreement of the ranks."""

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]: ...

    def resume_memory(self) -> None: ...

    def everyone(self, flag: bool) -> bool: ...


def checked_bucket(
    named_tensors: Iterable[tuple[str, torch.Tensor]], weights: dict[str, tuple[torch.Size, torch.dtype]]
) -> list[tuple[str, torch.Tensor]]:
    """A bucket for update_weights, refused whole (before anything is written) unless each entry is a weight of
    `weights` (Hugging Face name: (shape, dtype)), at most once, a tensor of that shape and dtype."""
    bucket, seen = list(named_tensors), set()
    for name, tensor in bucket:
        if name not in weights:
            raise KeyError(f"update_weights: unknown weight {name!r}: the engine's model has no such parameter")
        if name in seen:
            raise ValueError(f"update_weights: weight {name!r} appears twice in one bucket")
        seen.add(name)
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"update_weights: {name!r} is a {type(tensor).__name__}, not a tensor")
        shape, dtype = weights[name]
        if tensor.shape != shape or tensor.dtype != dtype:
            raise ValueError(
                f"update_weights: {name!r} has shape {tuple(tensor.shape)}, has dtype {tensor.dtype}; the engine's "
                f"weight has shape {tuple(shape)}, dtype {dtype}"
            )
    return bucket


def validate_prompts(prompts: list[list[int]], max_prompt_len: int, vocab_size: int | None = None) -> None:
    """Refuse bad prompts with an error that names the prompt: empty, too long, or out-of-vocabulary ids.

    max_prompt_len is the longest prompt that still leaves room for one generated token.
    """
    if not isinstance(prompts, (list, tuple)) or len(prompts) == 0:
        raise ValueError("generate() needs a non-empty list of prompts (each a list of token ids)")
    for i, prompt in enumerate(prompts):
        if len(prompt) == 0:
            raise ValueError(f"prompt {i} is empty; every prompt needs at least one token")
        if len(prompt) > max_prompt_len:
            raise ValueError(
                f"prompt {i} has {len(prompt)} tokens, longer than the engine's context allows "
                f"({max_prompt_len} tokens, leaving room for one generated token)"
            )
        if vocab_size is not None:
            lo, hi = min(prompt), max(prompt)
            if lo < 0 or hi >= vocab_size:
                bad = lo if lo < 0 else hi
                raise ValueError(f"prompt {i} has token id {bad} outside the vocabulary [0, {vocab_size})")
