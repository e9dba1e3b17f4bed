"""The paged engine's scheduler state: shared prompt blocks, reference counts, admission by free blocks,
the prefill token budget, and preemption of the youngest sequences."""

import pytest

from rollout.scheduler import BlockManager, Scheduler, Sequence


def _seqs(prompt_len, n, prompt_index=0, budget=100):
    prompt = list(range(1, prompt_len + 1))
    return [Sequence(prompt_index, s, prompt, budget) for s in range(n)]


def _run(scheduler, seqs):
    """Put seqs in the running list, prefilled, whatever admission would allow (sets up a full cache)."""
    for seq in seqs:
        scheduler.blocks.allocate_prefill([seq], seq.num_tokens)
    scheduler.running.extend(seqs)


def test_samples_share_full_prompt_blocks_and_copy_the_partial_one():
    blocks = BlockManager(num_blocks=10, block_size=16)
    seqs = _seqs(37, 4)  # 2 full blocks + 5 tokens
    blocks.allocate_prefill(seqs, 37)
    shared = seqs[0].block_table[:2]
    assert all(s.block_table[:2] == shared for s in seqs)
    assert len({s.block_table[2] for s in seqs}) == 4  # one own partial block each
    assert blocks.num_free == 10 - 2 - 4
    assert [blocks.ref_count[b] for b in shared] == [4, 4]
    for s in seqs[:3]:
        blocks.release(s)
    assert blocks.num_free == 10 - 2 - 1  # shared blocks stay while one sample holds them
    blocks.release(seqs[3])
    assert blocks.num_free == 10 and set(blocks.ref_count) == {0}


def test_prompt_of_whole_blocks_is_shared_entirely_and_each_sample_appends_its_own_block():
    blocks = BlockManager(num_blocks=8, block_size=4)
    seqs = _seqs(8, 3)
    blocks.allocate_prefill(seqs, 8)
    assert blocks.num_free == 6
    for s in seqs:
        s.token_ids.append(0)  # first sampled token: its k/v go to position 8, a new block
        assert blocks.needs_block(s)
        blocks.append_block(s)
        assert blocks.ref_count[s.block_table[-1]] == 1
    assert blocks.num_free == 3


def test_admission_is_bounded_by_free_blocks_not_slots():
    blocks = BlockManager(num_blocks=12, block_size=4)
    scheduler = Scheduler(blocks, max_running=100, max_prefill_tokens=10_000)
    scheduler.add(_seqs(6, 8, prompt_index=0) + _seqs(6, 8, prompt_index=1))
    groups = scheduler.next_prefill()
    # prompt 0: 1 shared block + 8 partial blocks = 9 of 12. Prompt 1 would need 2 more, and admission
    # keeps one spare block per running sequence (8), so it waits although slots are plenty.
    assert [len(g) for g in groups] == [8]
    assert blocks.num_free == 3 and len(scheduler.running) == 8 and len(scheduler.waiting) == 8
    assert scheduler.next_prefill() == []
    for seq in scheduler.running[:6]:
        seq.finish_reason = "stop"
    scheduler.retire_finished()  # 6 partial blocks back (the shared one stays with the other 2): 9 free
    assert [len(g) for g in scheduler.next_prefill()] == [6]  # 9 - 2 spare = 7 = 1 shared + 6 partial


def test_prefill_batch_stays_within_the_padded_token_budget():
    blocks = BlockManager(num_blocks=100, block_size=4)
    scheduler = Scheduler(blocks, max_running=100, max_prefill_tokens=25)
    scheduler.add(_seqs(10, 2, 0) + _seqs(12, 2, 1) + _seqs(5, 2, 2))
    assert [len(g) for g in scheduler.next_prefill()] == [2, 2]  # 12 x 2 rows = 24 padded tokens
    assert [len(g) for g in scheduler.next_prefill()] == [2]
    # A single prompt longer than the budget is still admitted, alone.
    big = Scheduler(BlockManager(100, 4), max_running=100, max_prefill_tokens=8)
    big.add(_seqs(20, 1))
    assert [len(g) for g in big.next_prefill()] == [1]


def test_decode_preempts_the_youngest_and_the_oldest_progresses():
    blocks = BlockManager(num_blocks=4, block_size=4)
    scheduler = Scheduler(blocks, max_running=10, max_prefill_tokens=100)
    a, b, c = _seqs(4, 1, 0) + _seqs(4, 1, 1) + _seqs(4, 1, 2)
    _run(scheduler, [a, b, c])
    assert blocks.num_free == 1
    for s in (a, b, c):
        s.token_ids.append(7)  # position 4: each needs a second block, only one is free
    running = scheduler.next_decode()
    # a takes the free block; b needs one too, so the youngest, c, is preempted and gives its block to b.
    assert running == [a, b] and list(scheduler.waiting) == [c]
    assert c.block_table == [] and len(a.block_table) == len(b.block_table) == 2
    assert scheduler.stats.preemptions == 1
    # c comes back with its generated token once blocks free up: recomputed alone, 5 tokens -> 2 blocks.
    a.finish_reason = "stop"
    scheduler.retire_finished()
    assert scheduler.next_prefill() == []  # 2 free blocks, one kept spare for b
    b.finish_reason = "stop"
    scheduler.retire_finished()
    assert [len(g) for g in scheduler.next_prefill()] == [1] and len(c.block_table) == 2
    assert scheduler.running == [c] and c.token_ids == [7]


def test_a_sequence_preempts_itself_when_it_is_the_youngest():
    blocks = BlockManager(num_blocks=3, block_size=2)
    scheduler = Scheduler(blocks, max_running=10, max_prefill_tokens=100)
    a, b = _seqs(3, 1, 0) + _seqs(2, 1, 1)
    _run(scheduler, [a, b])
    assert blocks.num_free == 0
    a.token_ids.append(1)  # a: position 3, inside its second block
    b.token_ids.append(1)  # b: position 2 needs a second block, none is free, and b is the youngest
    assert scheduler.next_decode() == [a] and list(scheduler.waiting) == [b]
    assert b.block_table == [] and blocks.num_free == 1 and scheduler.stats.preemptions == 1


def test_nothing_admissible_with_nothing_running_is_an_error():
    scheduler = Scheduler(BlockManager(2, 4), max_running=4, max_prefill_tokens=100)
    scheduler.add(_seqs(9, 1))
    with pytest.raises(RuntimeError, match="cannot admit a sequence of 9 tokens"):
        scheduler.next_prefill()
