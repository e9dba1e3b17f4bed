"""Where the DAPO loop stands in its data, as plain data for a checkpoint (parallel/plain_state.py).

The prompt sampler's position is plain already. The batch builder's carry-over queue holds
ScoredGroups whose payload is a list of trainer.scoring.Sample: a group is stored as its prompt
(once) and its samples' fields, and rebuilt as the same objects on resume.
"""

from __future__ import annotations

import dataclasses

from rl.data import PromptExample
from rl.filter import ScoredGroup
from trainer.scoring import Sample


def _group_to_plain(group: ScoredGroup) -> dict:
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


def _group_from_plain(plain: dict) -> ScoredGroup:
    example = PromptExample(**plain["example"])
    samples = [Sample(example=example, **fields) for fields in plain["samples"]]
    return ScoredGroup(payload=samples, acc=plain["acc"], score=plain["score"])


def loop_position(sampler, builder) -> dict:
    """{"sampler": ..., "builder": ...}: the data position between two steps, as plain data."""
    state = builder.state_dict()
    carry = [(born, _group_to_plain(group)) for born, group in state["carry"]]
    return {"sampler": sampler.state_dict(), "builder": dict(state, carry=carry)}


def restore_loop_position(saved: dict, sampler, builder) -> None:
    """Put `loop_position`'s data (popped from the checkpoint's train state `saved`) back in place."""
    sampler.load_state_dict(saved.pop("sampler"))
    state = saved.pop("builder")
    builder.load_state_dict(dict(state, carry=[(born, _group_from_plain(g)) for born, g in state["carry"]]))
