"""SGLang requests and outputs by group: the leader's record of groups in flight (`GroupLedger`) and, in the
engine's process, the groups that run between its calls (`GroupRunner`, partial rollout).

A group is a prompt's n samples, each its own request with SGLang's n = 1 (sglang_sampling_params). Its
budget: min(max_new_tokens, context - 2 - prompt length), so a long prompt ends with finish reason "length"
(as in the torch engine) instead of SGLang refusing the whole batch (it raises when input + max_new_tokens
exceeds the context); a stopped sample continues from prompt + its tokens with the budget it has left.

`GroupRunner` wraps what the engine process builds (sglang.Engine, or the tests' strict model), passes every
other call through, and runs each group as one batch of Engine.async_generate on the engine's event loop,
Engine.loop: not streaming, a batch returns once all its requests have finished (srt/managers/
tokenizer_manager.py TokenizerManager._handle_batch_request, _collect_batch_responses). SGLang's scheduler
keeps generating between calls; its outputs are read whenever the loop runs. `stop_groups` aborts with
tokenizer_manager.abort_request(abort_all=True) (srt/managers/scheduler.py Scheduler.abort_request): a running
request ends after one more decode step, its output (tokens and log-probs so far) returned with finish reason
"abort"; one that reaches the scheduler after the abort runs on, so the abort is sent again until every group
is back. The rules, each cited, are modelled in tests/sglang_model.py ("Background requests").
"""

from __future__ import annotations

import asyncio
from collections.abc import Hashable
from typing import Any

from rollout.engine import Completion, GroupRequest, SamplingParams

ABORT_AGAIN_S = 1.0  # stop_groups repeats abort_all this often while groups are still out
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
    outputs: list[dict[str, Any]] | dict[str, Any],  # SGLang's output dicts: JSON-like values
    num_prompts: int,
    n: int,
) -> list[Completion]:
    """Translate SGLang's output dicts (prompt-major, n per prompt) into Completions; see module doc."""
    if isinstance(outputs, dict):
        outputs = [outputs]
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
    """The leader's groups in flight, by Key: (their samples, the indices of those SGLang generates, the
    samples' token budget, the stop ids)."""

    def __init__(self) -> None:
        self.groups: dict[Key, tuple[list[Completion], list[int], int, frozenset[int]]] = {}

    def add(self, rank_groups: list[list[GroupRequest]], params: SamplingParams, max_tokens: int) -> list[Batch]:
        """Record every rank's groups (a sample's budget: min(max_new_tokens, max_tokens - prompt length));
        the SGLang batch of each group with samples to generate: prompt + tokens so far, the budget left."""
        added: dict[Key, tuple[list[int], list[Completion], list[int], int]] = {}
        for rank, groups in enumerate(rank_groups):
            for g in groups:
                key, budget = (rank, g.key), min(params.max_new_tokens, max_tokens - len(g.prompt_ids))
                samples = g.start(params.n, budget)
                sent = [c.sample_index for c in samples if c.finish_reason == "abort"]
                if key in self.groups or key in added:
                    raise ValueError(f"rank {rank}: group key {g.key} is already in flight")
                added[key] = (g.prompt_ids, samples, sent, budget)
        stops = frozenset(params.stop_token_ids)
        self.groups.update({key: (samples, sent, budget, stops) for key, (_, samples, sent, budget) in added.items()})
        return [
            (
                key,
                [prompt + samples[s].token_ids for s in sent],
                [sglang_sampling_params(params, budget - len(samples[s].token_ids)) for s in sent],
            )
            for key, (prompt, samples, sent, budget) in added.items()
            if sent
        ]

    def idle(self) -> list[Key]:
        """The groups with nothing for SGLang to generate (every sample finished before)."""
        return [key for key, (_, sent, _, _) in self.groups.items() if not sent]

    def join(self, outputs: dict[Key, list[dict]], ranks: int, stopped: bool = False) -> list[list[Completion]]:
        """The completions of the groups in `outputs` (SGLang's, one per sample sent), per rank, and forgets them:
        a continuation's tokens and log-probs appended to the sample's. An abort is a failure unless `stopped`;
        its decode step's token is kept (rollout/sglang_groups.py GroupRunner) and can be a stop token or the
        budget's last: then the sample has finished ("stop", "length")."""
        parts: list[list[Completion]] = [[] for _ in range(ranks)]
        for (rank, key), outs in outputs.items():
            samples, sent, budget, stops = self.groups.pop((rank, key))
            for s, new in zip(sent, completions_from_sglang(outs, len(sent), 1)):
                tokens, reason = samples[s].token_ids + new.token_ids, new.finish_reason
                if reason == "abort" and not stopped:
                    raise RuntimeError(f"SGLang aborted a request of rank {rank}, group {key}: {outs[sent.index(s)]}")
                if reason == "abort" and tokens:
                    reason = "length" if len(tokens) >= budget else "stop" if tokens[-1] in stops else "abort"
                samples[s] = Completion(key, s, tokens, samples[s].logprobs + new.logprobs, reason)
            parts[rank] += samples
        return parts


class GroupRunner:
    """`engine` with groups of requests running in the background (see the module docstring)."""

    def __init__(self, engine: Any) -> None:  # sglang.Engine or a stand-in with its interface
        self.engine = engine
        self.tasks: dict[Hashable, asyncio.Task] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    def submit_groups(self, groups: list[tuple[Hashable, list[list[int]], list[dict]]]) -> None:
        """Start each (key, input_ids, sampling_params) batch as a task on the engine's loop."""
        for key, input_ids, sampling_params in groups:
            request = self.engine.async_generate(
                input_ids=input_ids, sampling_params=sampling_params, return_logprob=True
            )
            self.tasks[key] = self.engine.loop.create_task(request)

    def poll_groups(self, wait_s: float) -> dict[Hashable, list[dict]]:
        """Run the loop until a group has finished or wait_s has passed; the outputs of the finished groups."""
        self._run(wait_s, asyncio.FIRST_COMPLETED)
        return self._take_finished()

    def stop_groups(self) -> dict[Hashable, list[dict]]:
        """Abort every request and wait for all groups; their outputs (finished, or aborted with what they have)."""
        finished: dict[Hashable, list[dict]] = {}
        while self.tasks:
            self.engine.tokenizer_manager.abort_request(abort_all=True)
            self._run(ABORT_AGAIN_S, asyncio.ALL_COMPLETED)
            finished.update(self._take_finished())
        return finished

    def _run(self, wait_s: float, return_when: str) -> None:
        if self.tasks:
            self.engine.loop.run_until_complete(
                asyncio.wait(self.tasks.values(), timeout=wait_s, return_when=return_when)
            )

    def _take_finished(self) -> dict[Hashable, list[dict]]:
        """Each finished group's outputs (a group whose batch raised raises here, failing the call)."""
        done = [key for key, task in self.tasks.items() if task.done()]
        return {key: self.tasks.pop(key).result() for key in done}


def with_groups(target: Any, **server_args: object) -> GroupRunner:
    """The engine process's target: `target(**server_args)` (sglang.Engine's start) wrapped in a GroupRunner."""
    return GroupRunner(target(**server_args))
