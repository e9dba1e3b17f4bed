"""Decode attention over contiguous per-sequence rows (DecodeWorkspace + RowDecodeContext) equals the
block-gather path (DecodeContext) over the same paged cache, with holes, compaction and growth; and the
engine, on an RL-shaped workload (many responses ending at stop tokens), still matches the trainer."""

import torch

from model.args import PRESETS
from model.logprob import token_logprobs
from model.qwen2 import build_model
from rollout.engine import SamplingParams
from rollout.kv_cache import DecodeContext, DecodeWorkspace, PagedKVCache, RowDecodeContext
from rollout.scheduler import Sequence
from rollout.torch_engine import TorchEngine

LAYERS, BLOCKS, BLOCK, KV_HEADS, HEADS, DIM = 2, 16, 4, 2, 4, 8


def _cache():
    cache = PagedKVCache(LAYERS, BLOCKS, BLOCK, KV_HEADS, DIM, torch.device("cpu"), torch.float32)
    gen = torch.Generator().manual_seed(0)
    for t in cache.k + cache.v:
        t.copy_(torch.randn(t.shape, generator=gen))
    return cache


def _gather_attend(cache, layer, tables, positions, q, k, v):
    width = max(len(t) for t in tables)
    padded = torch.tensor([t + [cache.scratch_block] * (width - len(t)) for t in tables])
    context = DecodeContext(cache.k, cache.v, torch.tensor(positions), padded)
    return context.attend(layer, q, k, v)


def _rows_attend(workspace, layer, seqs, positions, q, k, v):
    rows = [s.row for s in seqs]
    identity = rows == list(range(workspace.num_rows))
    length = max(positions) + 1
    workspace.ensure_length(length)
    context = RowDecodeContext(workspace, torch.tensor(positions), torch.tensor(rows), length, identity)
    return context.attend(layer, q, k, v)


def test_rows_equal_the_gather_with_holes_compaction_and_growth():
    tables = [[0, 1, 2], [3, 4], [5, 6, 7], [8]]
    positions = [9, 6, 11, 2]  # each the position of its new token, inside its last block
    seqs = [Sequence(i, 0, [1], 10, block_table=t) for i, t in enumerate(tables)]
    gather_cache, rows_cache = _cache(), _cache()
    workspace = DecodeWorkspace(rows_cache)
    width = max(len(t) for t in tables)
    workspace.load(seqs, torch.tensor([t + [rows_cache.scratch_block] * (width - len(t)) for t in tables]))
    gen = torch.Generator().manual_seed(1)
    live = [0, 1, 2, 3]
    free_blocks = iter(range(9, BLOCKS))
    for step in range(6):
        if step == 2:
            live = [0, 2, 3]  # sequence 1 finished: its row is a hole, q is scattered to rows
        if step == 4:
            workspace.compact([seqs[i] for i in live], max(positions[i] for i in live) + 1)
            assert [seqs[i].row for i in live] == [0, 1, 2] and workspace.num_rows == 3
        b = len(live)
        for layer in range(LAYERS):
            q, k, v = (torch.randn(b, h, 1, DIM, generator=gen) for h in (HEADS, KV_HEADS, KV_HEADS))
            want = _gather_attend(gather_cache, layer, [tables[i] for i in live], [positions[i] for i in live],
                                  q, k, v)
            got = _rows_attend(workspace, layer, [seqs[i] for i in live], [positions[i] for i in live], q, k, v)
            torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
        for i in live:  # next token; grows past the loaded width (workspace growth), new block when needed
            positions[i] += 1
            if positions[i] // BLOCK >= len(tables[i]):
                tables[i].append(next(free_blocks))
    assert workspace.k[0].shape[2] > width * BLOCK  # the rows grew in length on the way


def _trainer_logprobs(model, prompt, tokens):
    with torch.no_grad():
        hidden = model(torch.tensor([prompt + tokens]), return_hidden=True)[0]
    logp, _ = token_logprobs(hidden[len(prompt) - 1: -1], model.output_weight(), torch.tensor(tokens),
                             temperature=1.0, with_entropy=False)
    return logp


def test_rl_shaped_generation_matches_the_trainer_through_holes_and_compaction():
    """Stop ids take ~1/6 of the vocabulary: responses of widely varying length retire step after step,
    leaving holes that force compactions; every completion's log-probs still equal the trainer's."""
    args = PRESETS["tiny"]
    engine = TorchEngine(build_model(args, seed=5), max_batch_size=48, max_seq_len=48, block_size=4)
    stop = list(range(args.vocab_size // 6))
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(len(stop), args.vocab_size, (int(n),), generator=gen).tolist()
               for n in torch.randint(3, 12, (6,), generator=gen)]
    completions = engine.generate(prompts, SamplingParams(max_new_tokens=30, temperature=1.0, n=8, seed=4,
                                                           stop_token_ids=stop))
    lengths = [len(c.token_ids) for c in completions]
    assert min(lengths) < 5 and max(lengths) > 15, lengths
    assert engine._workspace.compactions >= 2
    reference = build_model(args, seed=5)
    for c in completions:
        assert (c.finish_reason == "stop") == (c.token_ids[-1] in stop)
        want = _trainer_logprobs(reference, prompts[c.prompt_index], c.token_ids)
        torch.testing.assert_close(torch.tensor(c.logprobs), want, rtol=0, atol=1e-5)
