"""Who runs next in the paged torch engine: sequences, KV blocks, admission and preemption.

* `Sequence`: one sample (prompt p, sample s) with its generated tokens, log-probs, block table and
  finish reason. A running sequence holds its k/v for every token but the last one, which is the
  next decode input at position `num_tokens - 1`.
* `BlockManager`: the KV cache as `num_blocks` blocks of `block_size` token positions, a free list and
  a reference count per block. Block b holds the positions [i * block_size, (i + 1) * block_size) of
  every sequence whose block_table[i] == b.
* `Scheduler`: a waiting queue and a running list (oldest first). `next_prefill` admits waiting
  sequences while the running list has room (`max_running`), their blocks are free (beyond one spare
  block per running sequence) and the padded prefill stays within `max_prefill_tokens`; `next_decode`
  gives every running sequence the block its next token needs, preempting the youngest running
  sequences when blocks run out.

Prompt sharing: the n samples of a prompt admitted together are prefilled once. The prompt's FULL
blocks are shared by all of them (reference count n) and are read-only from then on; a partial last
block is NOT shared: each sample gets its own copy (the prefill writes the tail into each), because
every sample appends its own tokens to it. So a sequence only ever writes blocks it holds alone.

Preemption frees a sequence's blocks and puts it at the front of the waiting queue; when admitted
again it is recomputed: prompt + generated tokens are prefilled (alone, no sharing) and the next token
is sampled from the last position, exactly as the decode step would have. A sequence that fits the
cache alone always progresses (the oldest is never preempted for a younger one), so generation ends.
"""

from __future__ import annotations

import collections
import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rollout.engine import FinishReason


@dataclass(eq=False)
class Sequence:
    """One sample of one prompt: what it generated so far, where its k/v live, and why it ended."""

    prompt_index: int
    sample_index: int
    prompt: list[int]
    budget: int  # most tokens it may generate
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.token_ids)

    @property
    def position(self) -> int:
        """Where the next decode input (the last token) goes."""
        return self.num_tokens - 1

    def append(self, token: int, logprob: float, stop: frozenset[int]) -> None:
        self.token_ids.append(token)
        self.logprobs.append(logprob)
        if token in stop:
            self.finish_reason = "stop"
        elif len(self.token_ids) >= self.budget:
            self.finish_reason = "length"


class BlockManager:
    """Fixed-size KV blocks with reference counts (shared prompt blocks count once per holder)."""

    def __init__(self, num_blocks: int, block_size: int):
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.free_blocks = collections.deque(range(num_blocks))
        self.ref_count = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self.free_blocks)

    def blocks_for_prefill(self, num_tokens: int, holders: int) -> int:
        """Blocks a prefill of num_tokens takes when `holders` sequences share it (full blocks once,
        a partial last block once per holder)."""
        full, partial = divmod(num_tokens, self.block_size)
        return full + (holders if partial else 0)

    def allocate_prefill(self, seqs: list[Sequence], num_tokens: int) -> None:
        full, partial = divmod(num_tokens, self.block_size)
        shared = [self._take(len(seqs)) for _ in range(full)]
        for seq in seqs:
            seq.block_table = shared + ([self._take(1)] if partial else [])

    def needs_block(self, seq: Sequence) -> bool:
        return seq.position // self.block_size >= len(seq.block_table)

    def append_block(self, seq: Sequence) -> None:
        seq.block_table.append(self._take(1))

    def release(self, seq: Sequence) -> None:
        for block in seq.block_table:
            self.ref_count[block] -= 1
            if self.ref_count[block] == 0:
                self.free_blocks.append(block)
        seq.block_table = []

    def _take(self, holders: int) -> int:
        block = self.free_blocks.popleft()
        self.ref_count[block] = holders
        return block


@dataclass
class SchedulerStats:
    """What one round did: sequences in flight (decoded together: peak, mean while others wait), preemptions."""

    decode_steps: int = 0
    peak_running: int = 0
    saturated_steps: int = 0  # decode steps with sequences still waiting: the cache or batch is the limit
    saturated_running_sum: int = 0
    preemptions: int = 0

    @property
    def mean_running_saturated(self) -> float:
        """Mean sequences in flight while others wait: how many the memory (or max_batch_size) admits."""
        return self.saturated_running_sum / max(self.saturated_steps, 1)


class Scheduler:
    """Waiting queue and running list of one round; see the module docstring for the rules."""

    def __init__(self, blocks: BlockManager, max_running: int, max_prefill_tokens: int):
        self.blocks = blocks
        self.max_running = max_running
        self.max_prefill_tokens = max_prefill_tokens
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []
        self.stats = SchedulerStats()

    def add(self, seqs: list[Sequence]) -> None:
        self.waiting.extend(seqs)

    def done(self) -> bool:
        return not self.waiting and not self.running

    def next_prefill(self) -> list[list[Sequence]]:
        """Admit the next prefill batch: groups of sequences that share one token list (a prompt's fresh
        samples, or one preempted sequence to recompute). Empty when nothing can be admitted now."""
        groups: list[list[Sequence]] = []
        longest = 0
        while self.waiting and len(self.running) < self.max_running:
            first = self.waiting[0]
            num_tokens = first.num_tokens
            if groups and max(longest, num_tokens) * (len(groups) + 1) > self.max_prefill_tokens:
                break
            group = self._admissible_group(first, num_tokens)
            if not group:
                break
            for _ in group:
                self.waiting.popleft()
            self.blocks.allocate_prefill(group, num_tokens)
            self.running.extend(group)
            groups.append(group)
            longest = max(longest, num_tokens)
        if not groups and not self.running and self.waiting:
            # Cannot happen while the cache holds one full-length sequence (the engine checks that).
            raise RuntimeError(
                f"the KV cache ({self.blocks.num_blocks} blocks) cannot admit a sequence of "
                f"{self.waiting[0].num_tokens} tokens with nothing running"
            )
        return groups

    def _admissible_group(self, first: Sequence, num_tokens: int) -> list[Sequence]:
        """The longest run of waiting sequences starting at `first` that shares its prefill and fits."""
        # Admission leaves one free block per running sequence, so each can grow by a block before anything
        # is preempted: admitting into the last free blocks would preempt the newcomers at once (recompute).
        free = self.blocks.num_free - len(self.running)
        if self.blocks.blocks_for_prefill(num_tokens, 1) > free:
            return []
        group = [first]
        if first.token_ids:  # a preempted sequence is recomputed alone
            return group
        room = self.max_running - len(self.running)
        for seq in itertools.islice(self.waiting, 1, room):
            if seq.prompt_index != first.prompt_index or seq.token_ids:
                break
            if self.blocks.blocks_for_prefill(num_tokens, len(group) + 1) > free:
                break
            group.append(seq)
        return group

    def next_decode(self) -> list[Sequence]:
        """Every running sequence, each with a block for its next token; the youngest are preempted
        (blocks freed, back to the front of the waiting queue) while blocks are short."""
        for seq in self.running:  # the list iterator reads by index: popping the youngest ends it there
            if self.blocks.needs_block(seq):
                while not self.blocks.num_free and self.running[-1] is not seq:
                    self._preempt(self.running.pop())
                if not self.blocks.num_free:  # seq is the youngest itself
                    self._preempt(self.running.pop())
                    break
                self.blocks.append_block(seq)
        self.stats.decode_steps += 1
        self.stats.peak_running = max(self.stats.peak_running, len(self.running))
        if self.waiting:
            self.stats.saturated_steps += 1
            self.stats.saturated_running_sum += len(self.running)
        return list(self.running)

    def retire_finished(self) -> list[Sequence]:
        """Free the blocks of sequences that finished (stop token or budget); returns them."""
        finished = [seq for seq in self.running if seq.finish_reason is not None]
        for seq in finished:
            self.blocks.release(seq)
        self.running = [seq for seq in self.running if seq.finish_reason is None]
        return finished

    def _preempt(self, seq: Sequence) -> None:
        self.blocks.release(seq)
        self.waiting.appendleft(seq)
        self.stats.preemptions += 1
