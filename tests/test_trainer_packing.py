import random

import pytest
import torch
import torch.nn.functional as F

from model.args import get_preset
from model.qwen2 import build_model
from trainer.packing import PackItem, pack, pack_micro_batches, plan_micro_batches
from trainer.policy import micro_batch_logprobs


def _items(seed=0, n=5):
    rng = random.Random(seed)
    return [
        PackItem(
            [rng.randrange(256) for _ in range(rng.randint(1, 7))],
            [rng.randrange(256) for _ in range(rng.randint(0, 6))],
            advantage=rng.uniform(-1, 1),
            group_id=i // 2,
        )
        for i in range(n)
    ]


def test_plan_respects_the_budget_and_uses_every_sample_once():
    lengths = [7, 3, 9, 1, 4, 4, 6, 2]
    plan = plan_micro_batches(lengths, token_budget=10)
    assert sorted(i for row in plan for i in row) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in row) <= 10 for row in plan)
    assert len(plan) == 4  # 36 tokens need at least 4 rows of 10
    with pytest.raises(ValueError, match="sample 2 has 9 tokens.*budget 8"):
        plan_micro_batches(lengths, token_budget=8)


def test_pack_layout_positions_and_targets():
    items = [PackItem([1, 2, 3], [4, 5], advantage=0.5), PackItem([6], [7, 8, 9], advantage=-1.0, loss_weight=0.0)]
    mb = pack(items)
    assert mb.tokens.tolist() == [[1, 2, 3, 4, 5, 6, 7, 8, 9]]
    assert mb.positions.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 3]]
    assert mb.document_ids.tolist() == [[0, 0, 0, 0, 0, 1, 1, 1, 1]]
    # Response token k of a sample is predicted by the hidden state one position earlier.
    assert mb.predict_positions.tolist() == [2, 3, 5, 6, 7]
    assert mb.targets.tolist() == [4, 5, 7, 8, 9]
    assert mb.layout.tolist() == [[0, 1, -1], [2, 3, 4]]
    assert mb.mask.tolist() == [[1, 1, 0], [0, 0, 0]]
    assert mb.advantages.tolist() == [[0.5, 0.5, 0.0], [-1.0, -1.0, -1.0]]
    assert mb.grid(torch.arange(5.0) + 1).tolist() == [[1, 2, 0], [3, 4, 5]]


def test_packed_logprobs_equal_each_sample_alone():
    torch.manual_seed(0)
    model = build_model(get_preset("tiny"), seed=1)
    items = _items(seed=3, n=6)
    micro_batches = pack_micro_batches(items, token_budget=16)
    assert len(micro_batches) > 1
    for mb in micro_batches:
        logp, entropy = micro_batch_logprobs(model, mb, temperature=0.7)
        for s, item in enumerate(mb.items):
            seq = torch.tensor([item.prompt_ids + item.response_ids])
            logits = model(seq)[0].float() / 0.7
            n = len(item.response_ids)
            start = len(item.prompt_ids) - 1
            reference = F.log_softmax(logits[start : start + n], -1)
            expected = reference.gather(-1, torch.tensor(item.response_ids)[:, None])[:, 0]
            assert torch.allclose(logp[s, :n], expected, atol=1e-5)
            ref_entropy = -(reference.exp() * reference).sum(-1)
            assert torch.allclose(entropy[s, :n], ref_entropy, atol=1e-5)
            assert (logp[s, n:] == 0).all()


def test_padding_to_a_multiple_adds_a_separate_document_that_predicts_nothing():
    mb = pack([PackItem([1, 2], [3]), PackItem([4], [5, 6])], pad_to_multiple=4)
    assert mb.tokens.shape == (1, 8)
    assert mb.document_ids.tolist() == [[0, 0, 0, 1, 1, 1, 2, 2]]
    assert mb.positions.tolist() == [[0, 1, 2, 0, 1, 2, 0, 1]]
    assert mb.predict_positions.tolist() == [1, 3, 4]


def test_carried_over_samples_are_importance_weighted_and_fresh_ones_are_not():
    from rl.correction import truncated_is_weights
    from rl.loss import policy_loss
    from trainer.policy import dapo_micro_batch_loss

    torch.manual_seed(0)
    model = build_model(get_preset("tiny"), seed=1)
    items = _items(seed=5, n=4)
    for i, it in enumerate(items):
        it.response_ids = it.response_ids or [1]
        it.rollout_logprobs = [-1.0 - 0.1 * i] * len(it.response_ids)
        it.stale = i % 2 == 1
    mb = pack(items)
    with torch.no_grad():
        mb.old_logp, _ = micro_batch_logprobs(model, mb)
    kwargs = dict(
        global_num_tokens=None,
        global_num_seqs=None,
        global_num_groups=None,
        temperature=1.0,
        clip_low=0.2,
        clip_high=0.28,
        clip_c=10.0,
        agg="token-mean",
    )
    loss, _ = dapo_micro_batch_loss(model, mb, **kwargs)
    logp, _ = micro_batch_logprobs(model, mb)
    weights = truncated_is_weights(mb.old_logp, mb.rollout_logp, mb.mask, cap=2.0)
    expected_weights = torch.where(mb.stale.unsqueeze(1), weights, torch.ones_like(weights))
    assert not torch.allclose(expected_weights, torch.ones_like(weights))
    expected, _ = policy_loss(logp, mb.old_logp, mb.advantages, mb.mask, token_weights=expected_weights)
    assert torch.allclose(loss, expected, atol=1e-7)
    everything, _ = dapo_micro_batch_loss(model, mb, truncated_is=True, **kwargs)
    all_weighted, _ = policy_loss(logp, mb.old_logp, mb.advantages, mb.mask, token_weights=weights)
    assert torch.allclose(everything, all_weighted, atol=1e-7)
