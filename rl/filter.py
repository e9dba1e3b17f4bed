"""Dynamic sampling (DAPO Eq. 11): train only on groups whose outcomes differ.

Eq. 11 constrains the objective to prompts whose G responses are neither all correct nor all wrong:

    0 < |{o_i : is_equivalent(a, o_i)}| < G

A group with identical rewards has zero advantage for every response (Eq. 9), so it contributes no
gradient and only dilutes the batch. Generalised to any per-sample metric v_1..v_G (accuracy by
default, or the shaped reward including the overlong penalty):

    keep  <=>  max(v) - min(v) > tol          (tol absorbs float noise for non-binary rewards)

For 0/1 accuracies this is exactly 0 < #correct < G. A group of one response is always kept (its
advantage is its reward, see rl/advantage.py), as verl does.

`DynamicBatchBuilder` runs the over-sampling loop of the recipe: it collects kept groups from
successive generation rounds until `train_batch_size` of them are available, hands out exactly that
many, and carries the surplus over to later steps (first in, first out; groups older than
`max_staleness` steps are dropped) instead of throwing it away:

    builder.start_step(step)                      # carried-over groups come first
    while not builder.full() and builder.rounds < max_rounds:
        builder.add_round(generate_and_score())   # list of ScoredGroup
    batch, stats = builder.finish()

`FilterStats` (rl/stats.py) describes the groups generated in this step before filtering (all correct, all
wrong), the groups kept, and where the batch came from.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from rl import checks
from rl.stats import FilterStats


def keep_group(values: Sequence[float], tol: float = 1e-6) -> bool:
    """Eq. 11 keep rule: the group's metric has spread, max - min > tol; a single sample is kept."""
    floats = checks.group_values(values, tol)
    return len(floats) == 1 or max(floats) - min(floats) > tol


Payload = TypeVar("Payload")


@dataclass(frozen=True, eq=False)
class ScoredGroup(Generic[Payload]):
    """The G scored responses to one prompt.

    payload: whatever the training loop needs later (token ids, log-probs, ...); never inspected.
    acc:     per-sample correctness (bool, or 0/1).
    score:   per-sample shaped reward (correctness reward plus overlong penalty).
    """

    payload: Payload
    acc: tuple[bool, ...]
    score: tuple[float, ...]

    def __post_init__(self) -> None:
        acc, score = checks.scored(self.acc, self.score)
        object.__setattr__(self, "acc", acc)
        object.__setattr__(self, "score", score)

    @property
    def size(self) -> int:
        return len(self.acc)


class DynamicBatchBuilder(Generic[Payload]):
    """Collects kept groups over generation rounds into batches of exactly `train_batch_size` groups.

    Args:
        train_batch_size: groups (prompts) per training batch.
        max_rounds: most generation rounds per step (the recipe's `max_num_gen_batches`); after the last one a
            batch may be short (FilterStats.shortfall: what to do about it is the caller's, algorithm.on_shortfall).
        max_staleness: a surplus group generated at step s may be used up to step s + max_staleness;
            0 disables the carry-over.
        enabled: False turns dynamic sampling off: every group is kept and one round fills the batch.
        metric: "acc" (default, filter before the overlong penalty) or "score" (shaped reward).
        tol: spread tolerance of `keep_group`.
    """

    def __init__(
        self,
        train_batch_size: int,
        max_rounds: int,
        *,
        max_staleness: int = 1,
        enabled: bool = True,
        metric: str = "acc",
        tol: float = 1e-6,
    ):
        checks.builder_settings(train_batch_size, max_rounds, max_staleness, metric, tol)
        self.train_batch_size = train_batch_size
        self.max_rounds = max_rounds
        self.max_staleness = max_staleness
        self.enabled = enabled
        self.metric = metric
        self.tol = tol
        self._carry: list[tuple[int, ScoredGroup[Payload]]] = []  # (step generated, group), oldest first
        self._step: int | None = None
        self._last_step: int | None = None
        self._kept: list[tuple[int, ScoredGroup[Payload]]] = []  # (step generated, group) of this step, oldest first
        self._rounds, self._from_carry, self._stale = 0, 0, 0

    # -- step lifecycle ---------------------------------------------------------------------------

    def start_step(self, step: int) -> None:
        """Begin collecting the batch of `step`: drop stale carried groups, put the rest first."""
        checks.new_step(step, self._step, self._last_step)
        fresh = [(born, group) for born, group in self._carry if step - born <= self.max_staleness]
        self._step, self._stats, self._rounds = step, FilterStats(), 0
        self._from_carry, self._stale = len(fresh), len(self._carry) - len(fresh)
        self._carry, self._kept = [], fresh

    def add_round(self, groups: Iterable[ScoredGroup[Payload]]) -> None:
        """Record one generation round: keep the groups with spread (Eq. 11), count what it generated."""
        step = checks.step_started(self._step, "add_round")
        generated = checks.new_round(groups, ScoredGroup, self._rounds, self.max_rounds, step)
        kept = [group for group in generated if self.keeps(group)]
        self._kept.extend((step, group) for group in kept)
        self._rounds += 1
        samples = sum(group.size for group in generated)
        all_correct, all_wrong = sum(all(g.acc) for g in generated), sum(not any(g.acc) for g in generated)
        self._stats.count_round(len(generated), samples, all_correct, all_wrong, len(kept))

    def keeps(self, group: ScoredGroup[Payload]) -> bool:
        """Whether add_round keeps this group: its `metric` values have spread (Eq. 11), or filtering is off."""
        values = group.acc if self.metric == "acc" else group.score
        return not self.enabled or keep_group(values, self.tol)

    def full(self) -> bool:
        """True once the batch can be handed out (with dynamic sampling off: after one round)."""
        checks.step_started(self._step, "full")
        return len(self._kept) >= self.train_batch_size or (not self.enabled and self._rounds >= 1)

    @property
    def rounds(self) -> int:
        """Generation rounds added in the current step."""
        return self._rounds

    @property
    def num_kept(self) -> int:
        """Groups kept so far in the current step (carried-over ones included)."""
        return len(self._kept)

    @property
    def num_carried(self) -> int:
        """Groups waiting in the carry-over queue (between steps)."""
        return len(self._carry)

    def finish(self) -> tuple[list[ScoredGroup[Payload]], FilterStats]:
        """End the step: the batch (oldest groups first, possibly short of train_batch_size after max_rounds
        rounds) and what the filter did (`FilterStats`)."""
        step = checks.step_started(self._step, "finish")
        batch = self._kept[: self.train_batch_size]
        surplus = self._kept[self.train_batch_size :]
        self._step, self._last_step = None, step
        self._carry.extend(surplus)
        self._stats.count_batch(len(batch), self._from_carry, len(surplus), self._stale, self.train_batch_size)
        return [group for _, group in batch], self._stats

    # -- checkpointing ----------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """The carry-over queue and the last finished step (between steps only)."""
        if self._step is not None:
            raise RuntimeError(f"state_dict: step {self._step} is in progress")
        return {"carry": list(self._carry), "last_step": self._last_step}

    def load_state_dict(self, state: dict) -> None:
        if self._step is not None:
            raise RuntimeError(f"load_state_dict: step {self._step} is in progress")
        self._carry = list(state["carry"])
        self._last_step = state["last_step"]
