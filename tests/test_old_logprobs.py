"""algorithm.old_logprobs: the torch engine's fp32 log-probs serve as pi_old without changing the step, "auto"
takes them only where they are exact, and carried-over samples are always recomputed."""

import copy
import logging

import pytest
import torch
from dist_utils import OneProcess
from numerics import assert_close_to_float64

from config import Config
from data.prompts import PromptExample
from model.args import PRESETS
from model.qwen2 import build_model
from rl.filter import ScoredGroup
from rollout.engine import SamplingParams
from rollout.torch_engine import TorchEngine
from tests.engines import generate
from trainer.mismatch import ROLLOUT_LOGP_TOLERANCE
from trainer.observers import TrainWatch, no_display
from trainer.packing import pack_micro_batches
from trainer.scoring import Sample
from trainer.update import (
    TrainPhase,
    fill_old_logprobs,
    old_logprob_source,
    pack_items_for_groups,
)

ARGS = PRESETS["tiny"]
MAX_RESPONSE = 8


class _RecordingAdamW(torch.optim.AdamW):
    """AdamW that keeps every update's gradients."""

    def __init__(self, params, lr):
        super().__init__(params, lr=lr, weight_decay=0.1)
        self.grads = []

    def step(self, closure=None):
        self.grads.append([p.grad.clone() for p in self.param_groups[0]["params"]])
        return super().step(closure)


class _NoSchedule:
    def step(self):
        pass


def _config(**overrides):
    cfg = Config()
    cfg.rollout.max_response_length = MAX_RESPONSE
    cfg.training.train_batch_size, cfg.training.mini_batch_size = 4, 2  # two updates
    cfg.training.micro_batch_tokens = 32
    for key, value in overrides.items():
        section, name = key.split("__")
        setattr(getattr(cfg, section), name, value)
    return cfg


FP32_TORCH = dict(
    rollout__engine="torch", rollout__dtype="float32", model__dtype="float32", parallelism__param_dtype="float32"
)


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (FP32_TORCH, "rollout"),
        (dict(FP32_TORCH, rollout__engine="sglang"), "recompute"),
        (dict(FP32_TORCH, rollout__dtype="bfloat16"), "recompute"),
        (dict(FP32_TORCH, parallelism__param_dtype="bfloat16"), "recompute"),
        (dict(FP32_TORCH, model__dtype="bfloat16"), "recompute"),
        ({}, "recompute"),  # the defaults: bf16 engine and compute
        (dict(FP32_TORCH, algorithm__old_logprobs="recompute"), "recompute"),
        (dict(FP32_TORCH, rollout__engine="sglang", algorithm__old_logprobs="rollout"), "rollout"),
    ],
)
def test_auto_takes_the_engine_log_probs_only_for_the_fp32_torch_engine(overrides, expected):
    assert old_logprob_source(_config(**overrides)) == expected


def _engine_groups(model, num_groups=4, group_size=4, seed=0, step=1):
    """Groups sampled by a torch engine on a copy of `model`, with the engine's log-probs and made-up rewards."""
    engine = TorchEngine(copy.deepcopy(model), max_batch_size=num_groups * group_size, max_seq_len=32, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    examples = [
        PromptExample(
            prompt_ids=torch.randint(1, ARGS.vocab_size, (3 + g,), generator=gen).tolist(),
            ground_truth="1",
            data_source="test",
            messages=[],
        )
        for g in range(num_groups)
    ]
    params = SamplingParams(
        max_new_tokens=MAX_RESPONSE, temperature=1.0, top_p=1.0, n=group_size, seed=seed, stop_token_ids=[5]
    )
    completions = generate(engine, [e.prompt_ids for e in examples], params)
    groups = []
    for g, example in enumerate(examples):
        samples = [
            Sample(
                example,
                list(c.token_ids),
                list(c.logprobs),
                c.finish_reason,
                (i + g) % 3 == 0,
                1.0 if (i + g) % 3 == 0 else -1.0,
                None,
                step,
            )
            for i, c in enumerate(completions[g * group_size : (g + 1) * group_size])
        ]
        groups.append(
            ScoredGroup(payload=samples, acc=tuple(s.acc for s in samples), score=tuple(s.score for s in samples))
        )
    return groups


def _train(model, groups, cfg):
    model = copy.deepcopy(model)
    optimizer = _RecordingAdamW(model.parameters(), lr=1e-2)
    stats = (
        TrainPhase(cfg, model, optimizer, _NoSchedule(), OneProcess(), TrainWatch(no_display)).run(1, groups).metrics()
    )
    return stats, optimizer.grads


def _sample_logprobs(model, groups) -> torch.Tensor:
    """log pi(token) of every sampled token, each sample run alone through `model` (in its dtype)."""
    out = []
    with torch.no_grad():
        for group in groups:
            for s in group.payload:
                ids = torch.tensor([s.example.prompt_ids + s.response_ids])
                logits = model(ids)[0, len(s.example.prompt_ids) - 1 : -1]
                logp = logits.to(torch.promote_types(logits.dtype, torch.float32)).log_softmax(-1)
                out.append(logp.gather(-1, torch.tensor(s.response_ids)[:, None]).squeeze(-1))
    return torch.cat(out)


def test_the_engine_log_probs_as_pi_old_leave_the_step_unchanged():
    model = build_model(ARGS, seed=0)
    groups = _engine_groups(model)
    recompute = _train(model, groups, _config(**FP32_TORCH, algorithm__old_logprobs="recompute"))
    rollout = _train(model, groups, _config(**FP32_TORCH))  # auto: the engine's log-probs
    recompute64 = _train(model.double(), groups, _config(**FP32_TORCH, algorithm__old_logprobs="recompute"))
    assert rollout[0]["updates"] == recompute[0]["updates"] == 2
    # The engine's log-probs are the trainer's within fp32 rounding, and so is every number of the step: each
    # measured against the trainer in float64 (tests/numerics.py).
    engine = torch.tensor([lp for group in groups for s in group.payload for lp in s.rollout_logprobs])
    trainer, trainer64 = _sample_logprobs(model.float(), groups), _sample_logprobs(model.double(), groups)
    assert_close_to_float64(engine, trainer, trainer64, "engine log-probs")
    for key in ("loss", "pg_clipfrac", "ppo_kl", "entropy", "grad_norm"):
        values = [
            torch.tensor(run[0][key], dtype=dtype)
            for run, dtype in ((rollout, torch.float32), (recompute, torch.float32), (recompute64, torch.float64))
        ]
        assert_close_to_float64(*values, key)
    flat = [[g for update in run[1] for g in update] for run in (rollout, recompute, recompute64)]  # every update's
    assert_close_to_float64(*flat, "gradients")
    # The mismatch is still measured (on the first mini-batch's loss pass), below the trainer's own threshold.
    assert 0 <= rollout[0]["mismatch/max_abs_logp"] < ROLLOUT_LOGP_TOLERANCE
    assert 0 <= recompute[0]["mismatch/max_abs_logp"] < ROLLOUT_LOGP_TOLERANCE


def test_carried_over_samples_and_inexact_log_probs_are_recomputed():
    model = build_model(ARGS, seed=0)
    fresh = _engine_groups(model, num_groups=2, step=2)
    stale = _engine_groups(model, num_groups=2, seed=1, step=1)  # drawn at step 1, trained at step 2
    for group in stale:
        for sample in group.payload:
            sample.rollout_logprobs = [-9.0] * len(sample.response_ids)  # an older policy's log-probs
    items = [
        it
        for g in pack_items_for_groups(fresh + stale, adv_eps=1e-6, norm_by_std=True, overlong_filter=False, step=2)
        for it in g
    ]
    micro_batches = pack_micro_batches(items, 32)
    assert any(mb.stale.any() for mb in micro_batches) and any(not mb.stale.any() for mb in micro_batches)
    recomputed = fill_old_logprobs(model, micro_batches, 1.0, 256, source="rollout")
    for mb in micro_batches:
        if mb.stale.any():
            assert any(mb is r for r in recomputed)
            assert (mb.old_logp[mb.mask > 0] > -9.0).all()  # the current policy's, not the stored ones
        else:
            assert not any(mb is r for r in recomputed)
            assert torch.equal(mb.old_logp, mb.rollout_logp)


class _OtherRankNeedsOneMore(OneProcess):
    """As if another data-parallel rank had one more micro-batch to recompute in every mini-batch."""

    def all_reduce(self, values, op="sum", group="dp"):
        return [v + 1 for v in values] if op == "max" else list(values)


def test_every_rank_runs_as_many_old_log_prob_forwards_as_the_rank_that_needs_most():
    model = build_model(ARGS, seed=0)
    groups = _engine_groups(model, num_groups=4)
    calls = []
    for dist_env in (OneProcess(), _OtherRankNeedsOneMore()):
        trained = copy.deepcopy(model)
        forwards = []
        trained.register_forward_hook(lambda module, args, out: forwards.append(torch.is_grad_enabled()))  # noqa: B023
        optimizer = _RecordingAdamW(trained.parameters(), lr=1e-2)
        TrainPhase(_config(**FP32_TORCH), trained, optimizer, _NoSchedule(), dist_env, TrainWatch(no_display)).run(
            1, groups
        )
        calls.append(forwards.count(False))  # the no-grad forwards: old log-probs
    assert calls == [0, 2]  # none needed here; one per mini-batch to keep in step with the other rank


def test_padding_rows_need_no_old_log_probs():
    from trainer.update import empty_micro_batch, needs_recompute

    assert not needs_recompute(empty_micro_batch(), "rollout")
    assert needs_recompute(empty_micro_batch(), "recompute")


def test_the_update_warns_when_the_engines_pi_old_strays_from_the_trainers(caplog):
    """TrainWatch.finish: where the engine's log-probs served as pi_old (the configured setting given), a gap
    above ROLLOUT_LOGP_TOLERANCE is one warning naming the step and the fix; none at the tolerance or when the
    trainer recomputed pi_old (no setting)."""
    watch = TrainWatch(no_display)
    for gap, setting, warned in [(0.5, "auto", True), (ROLLOUT_LOGP_TOLERANCE, "auto", False), (0.5, None, False)]:
        caplog.clear()
        watch.start(7, [], epochs=1, lr=1e-6).mismatch.max_abs_logp.add(gap)
        with caplog.at_level(logging.WARNING):
            watch.finish(setting)
        lines = [r.getMessage() for r in caplog.records]
        assert lines == (
            [
                "step 7: the engine's log-probs differ from the trainer's by up to 0.5, yet serve as pi_old "
                "(algorithm.old_logprobs = 'auto'); set it to 'recompute'"
            ]
            if warned
            else []
        )
