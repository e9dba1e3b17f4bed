"""Shared-prompt packing (trainer/packing.py, model/shared_prompt_attention.py): a group's samples hold one
prompt copy, and the log-probs, entropies and gradients equal the one-copy-per-sample packing."""

import types

import pytest
import torch
from numerics import assert_close_to_float64

from config import Config
from model.args import PRESETS
from model.qwen2 import build_model
from model.shared_prompt_attention import SharedPromptContext
from trainer.losses import micro_batch_logprobs
from trainer.packing import PackItem, pack, pack_micro_batches
from trainer.update import shares_prompts

ARGS = PRESETS["tiny"]


def _items(num_groups=3, group_size=4, seed=0, empty_response=False):
    gen = torch.Generator().manual_seed(seed)
    items = []
    for g in range(num_groups):
        prompt = torch.randint(1, ARGS.vocab_size, (2 + 3 * g,), generator=gen).tolist()
        for i in range(group_size):
            n = 0 if (empty_response and g == 1 and i == 2) else int(torch.randint(1, 9, (1,), generator=gen))
            items.append(
                PackItem(
                    prompt,
                    torch.randint(1, ARGS.vocab_size, (n,), generator=gen).tolist(),
                    advantage=float(i) - 1.5,
                    group_id=g,
                )
            )
    return items


def _logprobs_and_grads(model, mb):
    model.zero_grad()
    logp, entropy = micro_batch_logprobs(model, mb)
    weights = torch.linspace(-1.0, 2.0, logp.numel(), dtype=logp.dtype).view_as(logp)  # a made-up upstream gradient
    (logp * weights * (mb.layout >= 0)).sum().backward()
    return logp.detach(), entropy, [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("pad_to_multiple, empty_response", [(1, False), (8, False), (1, True)])
def test_one_prompt_copy_gives_the_same_log_probs_entropy_and_gradients(pad_to_multiple, empty_response):
    model = build_model(ARGS, seed=0)
    items = _items(empty_response=empty_response)
    shared = pack(items, pad_to_multiple, share_prompts=True)
    alone = pack(items, pad_to_multiple)
    once = sum(len(items[g * 4].prompt_ids) for g in range(3)) + sum(len(it.response_ids) for it in items)
    padding = -once % pad_to_multiple
    assert shared.tokens.shape[1] == once + padding  # each prompt once
    assert shared.prompt_segments.shape[0] == 3 + (padding > 0)  # the padding is a prompt nobody reads
    assert torch.equal(shared.targets, alone.targets) and torch.equal(shared.layout, alone.layout)
    got, want = _logprobs_and_grads(model, shared), _logprobs_and_grads(model, alone)
    # Equal within fp32 rounding, measured against the one-copy-per-sample packing in float64 (tests/numerics.py).
    want64 = _logprobs_and_grads(model.double(), alone)
    for what, got_i, want_i, want64_i in zip(("log-probs", "entropy", "gradients"), got, want, want64):
        assert_close_to_float64(got_i, want_i, want64_i, what)


def test_micro_batches_hold_every_sample_once_within_the_budget_and_split_big_groups():
    items = _items(num_groups=4, group_size=8, seed=1)
    budget = 40
    mbs = pack_micro_batches(items, budget, share_prompts=True)
    seen = [id(it) for mb in mbs for it in mb.items]
    assert sorted(seen) == sorted(id(it) for it in items)
    assert all(mb.tokens.shape[1] <= budget for mb in mbs)
    # Fewer tokens than one copy per sample, and the targets on the grid are each sample's response.
    assert sum(mb.tokens.shape[1] for mb in mbs) < sum(it.num_tokens for it in items)
    for mb in mbs:
        for s, it in enumerate(mb.items):
            n = len(it.response_ids)
            assert mb.targets[mb.layout[s, :n]].tolist() == it.response_ids
            assert (mb.layout[s, n:] == -1).all()
            # Response token 0 is predicted by the last prompt token, which holds the prompt's last id.
            assert mb.tokens[0, mb.predict_positions[mb.layout[s, 0]]] == it.prompt_ids[-1]
    with pytest.raises(ValueError, match="budget"):
        pack_micro_batches(items, 8, share_prompts=True)


def test_segments_must_cover_the_row_once():
    with pytest.raises(ValueError, match="cover"):
        SharedPromptContext(torch.tensor([[0, 3]]), torch.tensor([[2, 2, 0]]), 4)


def _cfg(**overrides):
    cfg = Config()
    for key, value in overrides.items():
        section, name = key.split("__")
        setattr(getattr(cfg, section), name, value)
    return cfg


@pytest.mark.parametrize(
    "overrides, tp, device, expected",
    [
        ({}, 1, "cpu", True),
        ({"training__share_prompts": False}, 1, "cpu", False),
        ({}, 2, "cpu", False),  # sequence-parallel rows
        ({}, 1, "cuda", False),  # FlexAttention's document block mask
        ({"model__attention_backend": "sdpa"}, 1, "cuda", True),
        ({"parallelism__compile": True}, 1, "cpu", False),
    ],
)
def test_prompts_are_shared_only_where_the_attention_supports_it(overrides, tp, device, expected):
    dist_env = types.SimpleNamespace(dims=types.SimpleNamespace(tp=tp))
    assert shares_prompts(_cfg(**overrides), dist_env, device) is expected
