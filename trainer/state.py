"""Where a DAPO run stands, as plain data for its checkpoints (checkpoint/plain_state.py).

`TrainState` is the loop's own position (the last completed step, ...). `LoopPosition` is where the loop
stands in its data between two steps: the prompt sampler's position (plain already) and the batch builder's
carry-over queue, whose groups (trainer.scoring.RolloutGroup) are stored as their prompt (once) and their
samples' fields, each rebuilt as the same objects on resume.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from data.prompts import PromptExample, PromptSampler
from rl.filter import DynamicBatchBuilder, ScoredGroup
from trainer.types import RolloutGroup, Sample, SkippedUpdates

log = logging.getLogger("train")


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
        "example": dataclasses.asdict(dataclasses.replace(example, extra={})),  # scored: its columns are not needed
        "acc": group.acc,
        "score": group.score,
        "samples": [
            {f.name: getattr(s, f.name) for f in dataclasses.fields(s) if f.name != "example"} for s in samples
        ],
    }


def _group_from_plain(plain: dict[str, Any]) -> RolloutGroup:
    example = PromptExample(**plain["example"])
    known = {f.name for f in dataclasses.fields(Sample)}  # older checkpoints also hold partial rollout's fields
    samples = [
        Sample(example=example, **{k: v for k, v in fields.items() if k in known}) for fields in plain["samples"]
    ]
    return ScoredGroup(payload=samples, acc=plain["acc"], score=plain["score"])


@dataclasses.dataclass(frozen=True)
class LoopPosition:
    """The data position between two steps: {"sampler": ..., "builder": ...} in a checkpoint's train state."""

    sampler: dict[str, Any]
    builder: dict[str, Any]  # the builder's state, its carried-over groups as plain data

    @classmethod
    def of(cls, sampler: dict[str, Any], builder: dict[str, Any]) -> LoopPosition:
        """The position of the sampler's and the builder's `state_dict()`s."""
        carry = [(born, _group_to_plain(group)) for born, group in builder["carry"]]
        return cls(dict(sampler), dict(builder, carry=carry))

    def plain(self) -> dict[str, Any]:
        return {"sampler": self.sampler, "builder": self.builder}

    @classmethod
    def pop_from(cls, saved: dict[str, Any]) -> LoopPosition:
        """The position stored in a checkpoint's train state `saved` (its keys are removed from it). The groups a
        run with partial rollout (since removed) left unfinished are dropped, with one line: their prompts are
        skipped, as a group dropped for its age was."""
        unfinished = saved.pop("unfinished", [])
        if unfinished:
            log.warning(
                "the checkpoint holds %d groups that partial rollout (since removed) left unfinished: they are "
                "dropped, and the run resumes without them",
                len(unfinished),
            )
        return cls(saved.pop("sampler"), saved.pop("builder"))

    def restore(self, sampler: PromptSampler, builder: DynamicBatchBuilder[list[Sample]]) -> None:
        """The sampler and builder as saved."""
        sampler.load_state_dict(self.sampler)
        carry = [(born, _group_from_plain(g)) for born, g in self.builder["carry"]]
        builder.load_state_dict(dict(self.builder, carry=carry))
