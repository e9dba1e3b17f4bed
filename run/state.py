"""Where a DAPO run stands, as plain data for its checkpoints (parallel/plain_state.py).

`TrainState` is the loop's own position (the last completed step, ...). `LoopPosition` is where the loop
stands in its data between two steps: the prompt sampler's position (plain already), the batch builder's
carry-over queue, whose groups (trainer.scoring.RolloutGroup) are stored as their prompt (once) and their
samples' fields, and the groups partial rollout stopped unfinished (trainer.types.Unfinished), each rebuilt as
the same objects on resume.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

from rl.data import PromptExample, PromptSampler
from rl.filter import DynamicBatchBuilder, ScoredGroup
from rollout.engine import Completion
from trainer.types import RolloutGroup, Sample, SkippedUpdates, Unfinished


@dataclasses.dataclass
class TrainState:
    """The loop's position: checkpointed with every step, beside the data's (`LoopPosition`)."""

    step: int = 0  # the last completed DAPO step
    sft_done: bool = False  # the supervised warm-up has run (it is not repeated on resume)
    tokens: int = 0  # response tokens trained on so far
    # The optimizer step's count of updates skipped in a row for a non-finite gradient (trainer/optimizer.py),
    # carried over steps and restarts.
    skipped: SkippedUpdates = dataclasses.field(default_factory=SkippedUpdates)

    def state_dict(self) -> dict[str, Any]:
        plain = {"step": self.step, "sft_done": self.sft_done, "tokens": self.tokens}
        return {**plain, "nonfinite_in_a_row": self.skipped.in_a_row}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        self.step, self.sft_done, self.tokens = saved["step"], saved["sft_done"], saved["tokens"]
        self.skipped.in_a_row = saved["nonfinite_in_a_row"]


def _group_to_plain(group: RolloutGroup) -> dict[str, Any]:
    samples = group.payload
    example = samples[0].example
    if any(s.example is not example for s in samples):
        raise ValueError("a carried-over group holds samples of different prompts")
    return {
        "example": dataclasses.asdict(example),
        "acc": group.acc,
        "score": group.score,
        "samples": [
            {f.name: getattr(s, f.name) for f in dataclasses.fields(s) if f.name != "example"} for s in samples
        ],
    }


def _group_from_plain(plain: dict[str, Any]) -> RolloutGroup:
    example = PromptExample(**plain["example"])
    samples = [Sample(example=example, **fields) for fields in plain["samples"]]
    return ScoredGroup(payload=samples, acc=plain["acc"], score=plain["score"])


def _unfinished_to_plain(group: Unfinished) -> dict[str, Any]:
    samples = [{"tokens": c.token_ids, "logprobs": c.logprobs, "finish": c.finish_reason} for c in group.samples]
    return {"example": dataclasses.asdict(group.example), "started": group.started, "samples": samples}


def _unfinished_from_plain(plain: dict[str, Any]) -> Unfinished:
    samples = [
        Completion(0, i, list(s["tokens"]), list(s["logprobs"]), s["finish"]) for i, s in enumerate(plain["samples"])
    ]
    return Unfinished(PromptExample(**plain["example"]), samples, plain["started"])


@dataclasses.dataclass(frozen=True)
class LoopPosition:
    """The data position between two steps: {"sampler": ..., "builder": ..., "unfinished": ...} in a checkpoint's
    train state; "unfinished": the groups partial rollout stopped, to continue (trainer/rollout_phase.py)."""

    sampler: dict[str, Any]
    builder: dict[str, Any]  # the builder's state, its carried-over groups as plain data
    unfinished: list[dict[str, Any]] = dataclasses.field(default_factory=list)

    @classmethod
    def of(
        cls, sampler: PromptSampler, builder: DynamicBatchBuilder[list[Sample]], unfinished: Iterable[Unfinished] = ()
    ) -> LoopPosition:
        state = builder.state_dict()
        carry = [(born, _group_to_plain(group)) for born, group in state["carry"]]
        return cls(sampler.state_dict(), dict(state, carry=carry), [_unfinished_to_plain(u) for u in unfinished])

    def plain(self) -> dict[str, Any]:
        return {"sampler": self.sampler, "builder": self.builder, "unfinished": self.unfinished}

    @classmethod
    def pop_from(cls, saved: dict[str, Any]) -> LoopPosition:
        """The position stored in a checkpoint's train state `saved` (its keys are removed from it)."""
        return cls(saved.pop("sampler"), saved.pop("builder"), saved.pop("unfinished", []))

    def restore(self, sampler: PromptSampler, builder: DynamicBatchBuilder[list[Sample]]) -> list[Unfinished]:
        """The sampler and builder as saved; returns the unfinished groups to continue."""
        sampler.load_state_dict(self.sampler)
        carry = [(born, _group_from_plain(g)) for born, g in self.builder["carry"]]
        builder.load_state_dict(dict(self.builder, carry=carry))
        return [_unfinished_from_plain(u) for u in self.unfinished]
