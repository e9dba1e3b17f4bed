"""trainer/update.py: the gradients of TrainPhase's packed, micro-batched updates equal the DAPO loss of
rl/loss.py computed directly on each sample alone, and short batches add no empty updates."""

import copy
import types

import pytest
import torch
import torch.nn.functional as F

from config import Config
from model.args import PRESETS
from model.qwen2 import build_model
from rl.advantage import group_advantages
from rl.data import PromptExample
from rl.filter import ScoredGroup
from rl.loss import AGG_MODES, policy_loss
from trainer.scoring import Sample
from trainer.update import TrainPhase

ARGS = PRESETS["tiny"]
MAX_RESPONSE = 8


class _OneProcess:
    dp_rank, dp_size, world_size, rank = 0, 1, 1, 0
    dims = types.SimpleNamespace(tp=1)

    def all_reduce(self, values, op="sum", group="dp"):
        return list(values)


class _RecordingSGD(torch.optim.SGD):
    """Plain SGD that keeps, for every update, the weights it was computed at and the gradients."""

    def __init__(self, params, lr):
        super().__init__(params, lr=lr)
        self.updates = []

    def step(self, closure=None):
        params = self.param_groups[0]["params"]
        self.updates.append(([p.detach().clone() for p in params],
                             [None if p.grad is None else p.grad.clone() for p in params]))
        return super().step(closure)


class _NoSchedule:
    def step(self):
        pass


def _groups(num_groups: int, group_size: int = 4, seed: int = 0, truncate_second: bool = False):
    gen = torch.Generator().manual_seed(seed)
    groups = []
    for g in range(num_groups):
        example = PromptExample(prompt_ids=torch.randint(1, ARGS.vocab_size, (3 + g,), generator=gen).tolist(),
                                ground_truth="1", data_source="test", messages=[])
        samples = []
        for i in range(group_size):
            n = int(torch.randint(1, MAX_RESPONSE + 1, (1,), generator=gen))
            score = 1.0 if (i + g) % 3 == 0 else -1.0
            finish = "length" if truncate_second and i == 1 else "stop"
            samples.append(Sample(example, torch.randint(1, ARGS.vocab_size, (n,), generator=gen).tolist(),
                                  (-torch.rand(n, generator=gen)).tolist(), finish, score > 0, score, None, 1))
        groups.append(ScoredGroup(payload=samples, acc=tuple(s.acc for s in samples),
                                  score=tuple(s.score for s in samples)))
    return groups


def _config(**overrides):
    cfg = Config()
    cfg.rollout.max_response_length = MAX_RESPONSE
    cfg.optimizer.grad_clip = 0.0
    cfg.training.micro_batch_tokens = 16  # several micro-batches per mini-batch
    for key, value in overrides.items():
        section, name = key.split("__")
        setattr(getattr(cfg, section), name, value)
    return cfg


def _sample_logp(model, sample):
    ids = torch.tensor([sample.example.prompt_ids + sample.response_ids])
    logits = model(ids)[0].float()
    start = len(sample.example.prompt_ids) - 1  # the logits at position t predict token t + 1
    logp = F.log_softmax(logits[start:start + len(sample.response_ids)], dim=-1)
    return logp.gather(-1, torch.tensor(sample.response_ids).unsqueeze(-1)).squeeze(-1)


def _reference_grads(model, old_model, groups, cfg):
    """The DAPO mini-batch loss on padded [samples, tokens] tensors, one forward per sample, no packing."""
    samples = [s for g in groups for s in g.payload]
    width = max(len(s.response_ids) for s in samples)
    pad = lambda x: F.pad(x, (0, width - len(x)))  # noqa: E731
    with torch.no_grad():
        old = torch.stack([pad(_sample_logp(old_model, s)) for s in samples])
    new = torch.stack([pad(_sample_logp(model, s)) for s in samples])
    mask, adv, group_ids = torch.zeros(len(samples), width), torch.zeros(len(samples), width), []
    row = 0
    for gi, group in enumerate(groups):
        advantages = group_advantages(torch.tensor(group.score, dtype=torch.float64), group_size=len(group.payload))
        for i, s in enumerate(group.payload):
            keep = not (cfg.algorithm.overlong_filter and s.finish_reason == "length")
            mask[row, :len(s.response_ids)] = float(keep)
            adv[row, :len(s.response_ids)] = float(advantages[i])
            group_ids.append(gi)
            row += 1
    alg = cfg.algorithm
    loss, _ = policy_loss(new, old, adv, mask, clip_low=alg.clip_low, clip_high=alg.clip_high, clip_c=alg.clip_c,
                          agg=alg.loss_agg, group_ids=torch.tensor(group_ids), norm_len=MAX_RESPONSE)
    model.zero_grad(set_to_none=True)
    loss.backward()
    return [p.grad for p in model.parameters()]


def _assert_grads_match(got, want):
    for g, w in zip(got, want):
        assert g is not None
        assert torch.allclose(g, w, rtol=1e-4, atol=1e-6), float((g - w).abs().max())


def _train(groups, cfg, lr=0.0):
    model = build_model(ARGS, seed=0)
    start = copy.deepcopy(model)
    optimizer = _RecordingSGD(model.parameters(), lr=lr)
    stats = TrainPhase(model, optimizer, _NoSchedule(), cfg, _OneProcess(), torch.device("cpu")).run(1, groups)
    return start, optimizer.updates, stats


@pytest.mark.parametrize("agg", AGG_MODES)
@pytest.mark.parametrize("overlong_filter", [False, True])
def test_one_update_equals_the_unpacked_loss(agg, overlong_filter):
    groups = _groups(4, truncate_second=True)
    cfg = _config(algorithm__loss_agg=agg, algorithm__overlong_filter=overlong_filter,
                  training__train_batch_size=4, training__mini_batch_size=4)
    start, updates, stats = _train(groups, cfg)
    assert len(updates) == 1 and stats["updates"] == 1
    _assert_grads_match(updates[0][1], _reference_grads(start, start, groups, cfg))


def test_mini_batches_and_epochs_step_from_the_moved_weights_against_the_step_start_policy():
    # Large SGD steps move the policy enough that later updates see ratios outside the clip range.
    groups = _groups(4)
    cfg = _config(training__train_batch_size=4, training__mini_batch_size=2, training__ppo_epochs=2)
    start, updates, stats = _train(groups, cfg, lr=20.0)
    assert len(updates) == 4 and stats["updates"] == 4
    assert stats["pg_clipfrac"] + stats["pg_clipfrac_lower"] > 0  # the clip was exercised
    for (weights, grads), part in zip(updates, [groups[:2], groups[2:], groups[:2], groups[2:]]):
        model = copy.deepcopy(start)
        with torch.no_grad():
            for p, w in zip(model.parameters(), weights):
                p.copy_(w)
        _assert_grads_match(grads, _reference_grads(model, start, part, cfg))


def test_short_batch_adds_no_empty_update_to_the_metrics():
    groups = _groups(1)  # one group where two mini-batches were planned (on_shortfall = "fill")
    cfg = _config(training__train_batch_size=4, training__mini_batch_size=2)
    start, updates, stats = _train(groups, cfg)
    assert len(updates) == 1 and stats["updates"] == 1
    grads = updates[0][1]
    true_norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in grads if g is not None]))
    assert stats["grad_norm"] == pytest.approx(float(true_norm), rel=1e-5)
    _assert_grads_match(grads, _reference_grads(start, start, groups, cfg))
