import copy
import dataclasses
import random

import pytest
import torch
import torch.nn.functional as F
from numerics import assert_close_to_float64

from model.args import get_preset
from model.qwen2 import build_model
from trainer.losses import micro_batch_logprobs
from trainer.packing import PackItem, pack, pack_micro_batches, plan_micro_batches


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
    model64 = copy.deepcopy(model).double()

    def alone(model, item):
        """log-probs and entropies of one sample run alone, in the model's dtype (fp32 at least)."""
        logits = model(torch.tensor([item.prompt_ids + item.response_ids]))[0]
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32)) / 0.7
        start = len(item.prompt_ids) - 1
        reference = F.log_softmax(logits[start : start + len(item.response_ids)], -1)
        logp = reference.gather(-1, torch.tensor(item.response_ids)[:, None])[:, 0]
        return logp, -(reference.exp() * reference).sum(-1)

    got, want, want64 = [], [], []
    for mb in micro_batches:
        logp, entropy = micro_batch_logprobs(model, mb, temperature=0.7)
        for s, item in enumerate(mb.items):
            n = len(item.response_ids)
            got += [logp[s, :n], entropy[s, :n]]
            want += alone(model, item)
            want64 += alone(model64, item)
            assert (logp[s, n:] == 0).all()
    # Within fp32 rounding, measured against the samples run alone in float64 (tests/numerics.py).
    assert_close_to_float64(got, [w.detach() for w in want], [w.detach() for w in want64], "log-probs and entropies")


def test_padding_to_a_multiple_adds_a_separate_document_that_predicts_nothing():
    mb = pack([PackItem([1, 2], [3]), PackItem([4], [5, 6])], pad_to_multiple=4)
    assert mb.tokens.shape == (1, 8)
    assert mb.document_ids.tolist() == [[0, 0, 0, 1, 1, 1, 2, 2]]
    assert mb.positions.tolist() == [[0, 1, 2, 0, 1, 2, 0, 1]]
    assert mb.predict_positions.tolist() == [1, 3, 4]


def test_carried_over_samples_are_importance_weighted_and_fresh_ones_are_not():
    from config import Config
    from rl.correction import truncated_is_weights
    from rl.loss import policy_loss
    from rl.loss_modes import GlobalCounts
    from trainer.losses import DAPOLoss

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
    cfg = Config()  # clip 0.2 / 0.28, c = 10, token-mean, temperature 1
    local = GlobalCounts()  # the micro-batch alone
    loss, _ = DAPOLoss(cfg.algorithm, cfg.rollout)(model, mb, local)
    logp, _ = micro_batch_logprobs(model, mb)
    weights = truncated_is_weights(mb.old_logp, mb.rollout_logp, mb.mask, cap=2.0)
    expected_weights = torch.where(mb.stale.unsqueeze(1), weights, torch.ones_like(weights))
    assert not torch.allclose(expected_weights, torch.ones_like(weights))
    expected, _ = policy_loss(logp, mb.old_logp, mb.advantages, mb.mask, token_weights=expected_weights)
    # The same fp32 computation on both sides (one forward, one loss over 4 rows): equal to a few ulps.
    ulps = 8 * torch.finfo(torch.float32).eps * max(1.0, expected.abs().item())
    assert torch.allclose(loss, expected, rtol=0, atol=ulps)
    everything, _ = DAPOLoss(dataclasses.replace(cfg.algorithm, truncated_is=True), cfg.rollout)(model, mb, local)
    all_weighted, _ = policy_loss(logp, mb.old_logp, mb.advantages, mb.mask, token_weights=weights)
    assert torch.allclose(everything, all_weighted, rtol=0, atol=ulps)
