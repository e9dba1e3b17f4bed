"""SGLang requests and outputs by group: the leader's record of groups in flight (`GroupLedger`) and, in the
engine's process, the groups that run between its calls (`GroupRunner`).

A group is a prompt's n samples, each its own request with SGLang's n = 1 (sglang_sampling_params). Its
budget: min(max_new_tokens, context - 2 - prompt length), so a long prompt ends with finish reason "length"
(as in the torch engine) instead of SGLang refusing the whole batch (it raises when input + max_new_tokens
exceeds the context).

`GroupRunner` wraps what the engine process builds (sglang.Engine, or the tests' strict model), passes every
other call through, and runs each group as one batch of Engine.async_generate on the engine's event loop,
Engine.loop: not streaming, a batch returns once all its requests have finished (srt/managers/
tokenizer_manager.py TokenizerManager._handle_batch_request, _collect_batch_responses). SGLang's scheduler
keeps generating between calls; its outputs are read whenever the loop runs.

Progress (`poll_groups`' token count): the scheduler sends a request's new tokens to the tokenizer manager every
SGLANG_FORCE_STREAM_INTERVAL (50) tokens also when it does not stream, and at its end (srt/managers/
scheduler_components/output_streamer.py, accept; srt/environ.py); TokenizerManager._handle_batch_output appends
them to the request's ReqState.output_ids in tokenizer_manager.rid_to_state, and deletes the state when the
request finishes (its output then carries its rid as meta_info["id"]). The rules, each cited, are modelled in
tests/sglang_model.py (its docstring's "Progress of requests that do not stream"; StrictSGLang.step).
"""

from __future__ import annotations

import asyncio
from collections.abc import Hashable
from typing import Any

from rollout.engine import Completion, SamplingParams

_FINISH_TYPES = ("stop", "length", "abort")
Key = tuple[int, int]  # a group in flight on the leader: (rank in the engine group, the group's key there)
Batch = tuple[Key, list[list[int]], list[dict[str, object]]]  # a group's SGLang inputs and sampling params


def sglang_sampling_params(params: SamplingParams, max_new_tokens: int | None = None) -> dict[str, object]:
    """Our SamplingParams as the sampling_params dict of one SGLang request (temperature 0 is greedy there
    too); `max_new_tokens` overrides the params' own (a per-prompt cap). SGLang's `n` stays 1: the n
    samples are n requests (see the module docstring)."""
    out: dict[str, object] = {
        "max_new_tokens": params.max_new_tokens if max_new_tokens is None else max_new_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k,
        "no_stop_trim": True,
    }
    if params.stop_token_ids:
        out["stop_token_ids"] = list(params.stop_token_ids)
    return out


def completions_from_sglang(
    outputs: list[dict[str, Any]],  # SGLang's output dicts: JSON-like values
    num_prompts: int,
    n: int,
) -> list[Completion]:
    """SGLang's output dicts (prompt-major, n per prompt) as Completions: token ids and log-probs from
    meta_info["output_token_logprobs"], checked against `output_ids`, and the finish reason's type."""
    if len(outputs) != num_prompts * n:
        raise ValueError(f"SGLang returned {len(outputs)} outputs for {num_prompts} prompts x {n} samples")
    completions = []
    for i, out in enumerate(outputs):
        prompt_index, sample_index = divmod(i, n)
        meta = out.get("meta_info") or {}
        entries = meta.get("output_token_logprobs")
        if entries is None:
            raise ValueError(f"SGLang output {i} has no meta_info['output_token_logprobs'] (was return_logprob set?)")
        token_ids = [int(entry[1]) for entry in entries]
        logprobs = [float(entry[0]) for entry in entries]
        reason = meta.get("finish_reason")
        kind = reason.get("type") if isinstance(reason, dict) else reason
        if isinstance(reason, dict) and reason.get("matched") == "NaN happened":
            # SGLang then replaces the last output id by a stop id; say what happened, not that ids disagree.
            raise ValueError(f"SGLang output {i}: the model produced NaN logits (finish_reason {reason!r})")
        if kind not in _FINISH_TYPES:
            raise ValueError(f"SGLang output {i} has finish_reason {reason!r}; expected type stop, length or abort")
        output_ids = [int(t) for t in out.get("output_ids", token_ids)]
        # A trimmed stop token is the only difference we accept between the two token lists.
        trimmed_stop = kind == "stop" and output_ids == token_ids[:-1]
        if output_ids != token_ids and not trimmed_stop:
            raise ValueError(
                f"SGLang output {i}: output_ids {output_ids[:8]}... disagree with the log-prob token ids "
                f"{token_ids[:8]}..."
            )
        completions.append(Completion(prompt_index, sample_index, token_ids, logprobs, kind))
    return completions


class GroupLedger:
    """The leader's groups in flight, by Key: how many samples each has."""

    def __init__(self) -> None:
        self.groups: dict[Key, int] = {}

    def add(self, rank_prompts: list[list[list[int]]], params: SamplingParams, max_tokens: int) -> list[Batch]:
        """Record every rank's prompts as groups keyed (rank, prompt index); the SGLang batch of each: n copies of
        its prompt, each with the budget min(max_new_tokens, max_tokens - prompt length)."""
        batch: list[Batch] = []
        for rank, prompts in enumerate(rank_prompts):
            for p, prompt in enumerate(prompts):
                sampling = sglang_sampling_params(params, min(params.max_new_tokens, max_tokens - len(prompt)))
                batch.append(((rank, p), [list(prompt)] * params.n, [sampling] * params.n))
        self.groups.update({key: params.n for key, _, _ in batch})
        return batch

    def idle(self, rank: int) -> bool:
        """Whether no group of `rank` is in flight."""
        return all(r != rank for r, _ in self.groups)

    def join(self, outputs: dict[Key, list[dict]], ranks: int) -> list[list[Completion]]:
        """The completions of the groups in `outputs` (SGLang's, one per sample), per rank, and forgets them. An
        abort is a failure."""
        parts: list[list[Completion]] = [[] for _ in range(ranks)]
        for (rank, key), outs in outputs.items():
            n = self.groups.pop((rank, key))
            for s, c in enumerate(completions_from_sglang(outs, n, 1)):
                if c.finish_reason == "abort":
                    raise RuntimeError(f"SGLang aborted a request of rank {rank}, group {key}: {outs[s]}")
                parts[rank].append(Completion(key, s, c.token_ids, c.logprobs, c.finish_reason))
        return parts


class GroupRunner:
    """`engine` with groups of requests running in the background (see the module docstring)."""

    def __init__(self, engine: Any) -> None:  # sglang.Engine or a stand-in with its interface
        self.engine = engine
        self.tasks: dict[Hashable, asyncio.Task] = {}
        self.reported: dict[str, int] = {}  # tokens counted so far of each request in flight, by rid

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    def submit_groups(self, groups: list[tuple[Hashable, list[list[int]], list[dict]]]) -> None:
        """Start each (key, input_ids, sampling_params) batch as a task on the engine's loop."""
        for key, input_ids, sampling_params in groups:
            request = self.engine.async_generate(
                input_ids=input_ids, sampling_params=sampling_params, return_logprob=True
            )
            self.tasks[key] = self.engine.loop.create_task(request)

    def poll_groups(self, wait_s: float) -> tuple[dict[Hashable, list[dict]], int]:
        """Run the loop until a group has finished or wait_s has passed: the outputs of the finished groups, and
        the tokens SGLang reported meanwhile (module docstring)."""
        if self.tasks:
            self.engine.loop.run_until_complete(
                asyncio.wait(self.tasks.values(), timeout=wait_s, return_when=asyncio.FIRST_COMPLETED)
            )
        # Each finished group's outputs (a group whose batch raised raises here, failing the call).
        done = [key for key, task in self.tasks.items() if task.done()]
        finished = {key: self.tasks.pop(key).result() for key in done}
        counts = {rid: len(state.output_ids) for rid, state in self.engine.tokenizer_manager.rid_to_state.items()}
        ended = {
            o["meta_info"]["id"]: len(o["meta_info"]["output_token_logprobs"]) for g in finished.values() for o in g
        }
        tokens = sum(n - self.reported.get(rid, 0) for rid, n in {**counts, **ended}.items())
        self.reported.update(counts)
        for rid in ended:
            self.reported.pop(rid, None)
        return finished, tokens


def with_groups(target: Any, **server_args: object) -> GroupRunner:
    """The engine process's target: `target(**server_args)` (sglang.Engine's start) wrapped in a GroupRunner."""
    return GroupRunner(target(**server_args))
