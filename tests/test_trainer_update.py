"""trainer/update.py: the gradients of TrainPhase's packed, micro-batched updates (on one rank or split over
data-parallel ranks) equal the DAPO loss of rl/loss.py computed directly on each sample alone, also when
overlong filtering masks samples or whole groups, and short batches add no empty updates. Both sides run in
float64 (see GRAD_TOLERANCE_EPS)."""

import copy
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from dist_utils import GlooRanks, OneProcess
from numerics import cascade_sum_rtol
from test_parallel_parity import LORA, _random_b

from config import Config
from data.prompts import PromptExample
from model.args import PRESETS
from model.qwen2 import build_model
from parallel.lora import apply_lora
from rl.advantage import group_advantages
from rl.filter import ScoredGroup
from rl.loss import AGG_MODES, POLICY_LOSSES, LossSettings, policy_loss
from trainer.observers import TrainWatch, no_display
from trainer.scoring import Sample
from trainer.update import TrainPhase

ARGS = PRESETS["tiny"]
MAX_RESPONSE = 8


class _RecordingSGD(torch.optim.SGD):
    """Plain SGD that keeps, for every update, the weights it was computed at and the gradients."""

    def __init__(self, params, lr):
        super().__init__(params, lr=lr)
        self.updates = []

    def step(self, closure=None):
        params = self.param_groups[0]["params"]
        self.updates.append(
            ([p.detach().clone() for p in params], [None if p.grad is None else p.grad.clone() for p in params])
        )
        return super().step(closure)


class _NoSchedule:
    def step(self):
        pass


def _groups(
    num_groups: int,
    group_size: int = 4,
    seed: int = 0,
    truncate_second: bool = False,
    truncate_groups: tuple[int, ...] = (),
):
    gen = torch.Generator().manual_seed(seed)
    groups = []
    for g in range(num_groups):
        example = PromptExample(
            prompt_ids=torch.randint(1, ARGS.vocab_size, (3 + g,), generator=gen).tolist(),
            ground_truth="1",
            data_source="test",
            messages=[],
        )
        samples = []
        for i in range(group_size):
            n = int(torch.randint(1, MAX_RESPONSE + 1, (1,), generator=gen))
            score = 1.0 if (i + g) % 3 == 0 else -1.0
            finish = "length" if (truncate_second and i == 1) or g in truncate_groups else "stop"
            samples.append(
                Sample(
                    example,
                    torch.randint(1, ARGS.vocab_size, (n,), generator=gen).tolist(),
                    (-torch.rand(n, generator=gen)).tolist(),
                    finish,
                    score > 0,
                    score,
                    None,
                    1,
                )
            )
        groups.append(
            ScoredGroup(payload=samples, acc=tuple(s.acc for s in samples), score=tuple(s.score for s in samples))
        )
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
    logits = model(ids)[0]
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # fp32 at least; a float64 model stays
    start = len(sample.example.prompt_ids) - 1  # the logits at position t predict token t + 1
    logp = F.log_softmax(logits[start : start + len(sample.response_ids)], dim=-1)
    return logp.gather(-1, torch.tensor(sample.response_ids).unsqueeze(-1)).squeeze(-1)


def _reference_grads(model, old_model, groups, cfg):
    """The DAPO mini-batch loss on padded [samples, tokens] tensors, one forward per sample, no packing."""
    samples = [s for g in groups for s in g.payload]
    width = max(len(s.response_ids) for s in samples)
    pad = lambda x: F.pad(x, (0, width - len(x)))  # noqa: E731
    with torch.no_grad():
        old = torch.stack([pad(_sample_logp(old_model, s)) for s in samples])
    if cfg.algorithm.old_logprobs == "rollout":  # pi_old is the engine's: fp32 values, exact in float64
        old = torch.stack([pad(torch.tensor(s.rollout_logprobs, dtype=torch.float64)) for s in samples])
    new = torch.stack([pad(_sample_logp(model, s)) for s in samples])
    mask, adv, group_ids = torch.zeros(len(samples), width), torch.zeros(len(samples), width), []  # fp32, as packed
    row = 0
    for gi, group in enumerate(groups):
        advantages = group_advantages(torch.tensor(group.score, dtype=torch.float64), group_size=len(group.payload))
        for i, s in enumerate(group.payload):
            keep = not (cfg.algorithm.overlong_filter and s.finish_reason == "length")
            mask[row, : len(s.response_ids)] = float(keep)
            adv[row, : len(s.response_ids)] = float(advantages[i])
            group_ids.append(gi)
            row += 1
    alg = cfg.algorithm
    settings = LossSettings(alg.clip_low, alg.clip_high, alg.clip_c, alg.loss_agg, alg.policy_loss, MAX_RESPONSE)
    loss, _ = policy_loss(new, old, adv, mask, settings, group_ids=torch.tensor(group_ids))
    model.zero_grad(set_to_none=True)
    loss.backward()
    return [p.grad for p in model.parameters() if p.requires_grad]


# The trainer and the reference run in float64: what these tests check is which weights, pi_old, masks and counts
# each update uses, and in float64 the two differ only by summation order. In fp32 this comparison differed by up
# to 130 eps32 x max|gradient| after the lr = 20 steps (large weights make it ill-conditioned), and where each
# result lands inside that depends on the CPU's instruction set: a 2-core EPYC without AVX-512 exceeded a
# tolerance read off an AVX-512 machine. In float64 the same comparison measured 24, 44 and 79 eps64 x max(1, max
# |gradient|) with the AVX2, AVX-512 and scalar kernels; 1e4 eps64 keeps a margin of over 100 on that and stays
# eight orders of magnitude below the gradient change a wrong weight, pi_old or mask makes (>= 1e-3).
GRAD_TOLERANCE_EPS = 1e4


def _assert_grads_match(got, model, old_model, groups, cfg):
    """The trainer's gradients equal the unpacked loss's (`_reference_grads` at `model`'s weights against
    `old_model` as pi_old), both in float64, within GRAD_TOLERANCE_EPS eps64 x max(1, max |gradient|)."""
    assert all(g is not None and g.dtype == torch.float64 for g in got)
    want = _reference_grads(model, old_model, groups, cfg)
    scale = max(1.0, max(w.abs().max().item() for w in want))
    error = max((g - w).abs().max().item() for g, w in zip(got, want))
    assert error <= GRAD_TOLERANCE_EPS * torch.finfo(torch.float64).eps * scale, (error, scale)


def _train(groups, cfg, lr=0.0, lora=False):
    model = build_model(ARGS, seed=0)
    if lora:  # the adapters train, the base is frozen (parallel/lora.py)
        apply_lora(model, LORA)
        _random_b(model)
    model = model.double()
    start = copy.deepcopy(model)
    optimizer = _RecordingSGD([p for p in model.parameters() if p.requires_grad], lr=lr)
    stats = (
        TrainPhase(cfg, model, optimizer, _NoSchedule(), OneProcess(), TrainWatch(no_display)).run(1, groups).metrics()
    )
    return start, optimizer.updates, stats


@pytest.mark.parametrize(
    "agg,overlong_filter,lora",
    [(agg, f, False) for agg in AGG_MODES for f in (False, True)] + [("token-mean", True, True)],
)
def test_one_update_equals_the_unpacked_loss(agg, overlong_filter, lora):
    """Micro-batches (packed, token budget 16) sum to the whole mini-batch's gradient; with LoRA, the adapters'."""
    groups = _groups(4, truncate_second=True)
    cfg = _config(
        algorithm__loss_agg=agg,
        algorithm__overlong_filter=overlong_filter,
        training__train_batch_size=4,
        training__mini_batch_size=4,
    )
    start, updates, stats = _train(groups, cfg, lora=lora)
    assert len(updates) == 1 and stats["updates"] == 1
    _assert_grads_match(updates[0][1], start, start, groups, cfg)


@pytest.mark.parametrize("variant", POLICY_LOSSES)
def test_mini_batches_and_epochs_step_from_the_moved_weights_against_the_step_start_policy(variant):
    # Large SGD steps move the policy enough that later updates see ratios outside the clip range. GSPO's
    # per-response ratio needs each response whole in one row of the loss: the packed micro-batches give it that.
    groups = _groups(4)
    cfg = _config(
        training__train_batch_size=4,
        training__mini_batch_size=2,
        training__ppo_epochs=2,
        algorithm__policy_loss=variant,
    )
    # CISPO keeps the gradient of the clipped tokens: at lr = 20 its weights grow to ~500 and log-probs to ~-2000,
    # where the two sides' rounding no longer agrees; at lr = 2 its weights stay near 1 and over half of the
    # tokens' importance weights are clipped.
    start, updates, stats = _train(groups, cfg, lr=2.0 if variant == "cispo" else 20.0)
    assert len(updates) == 4 and stats["updates"] == 4 and type(stats["updates"]) is int
    assert stats["pg_clipfrac"] + stats["pg_clipfrac_lower"] > 0  # the clip was exercised
    # The upper clip is a part of pg_clipfrac; the tokens it caps have a pi_old probability (NaN: none capped).
    assert 0 <= stats["pg_clipfrac_upper"] <= stats["pg_clipfrac"]
    prob = stats["token_prob/clipped_upper_mean"]
    assert (0 < prob <= 1) if stats["pg_clipfrac_upper"] > 0 else math.isnan(prob)
    first = stats["pg_clipfrac_upper/first_token"]  # a share of the first tokens; none clipped when no token was
    assert 0 <= first <= 1 and (stats["pg_clipfrac_upper"] > 0 or first == 0)
    for (weights, grads), part in zip(updates, [groups[:2], groups[2:], groups[:2], groups[2:]]):
        model = copy.deepcopy(start)
        with torch.no_grad():
            for p, w in zip(model.parameters(), weights):
                p.copy_(w)
        _assert_grads_match(grads, model, start, part, cfg)


def test_short_batch_adds_no_empty_update_to_the_metrics():
    groups = _groups(1)  # one group where two mini-batches were planned (on_shortfall = "fill")
    cfg = _config(training__train_batch_size=4, training__mini_batch_size=2)
    start, updates, stats = _train(groups, cfg)
    assert len(updates) == 1 and stats["updates"] == 1
    grads = updates[0][1]
    flat = torch.cat([g.flatten() for g in grads if g is not None])
    # The logged norm nests three float64 norms (of each tensor, of those, of the device meshes': each a cascade sum
    # over at most all the elements) and is stored as fp32 (parallel/grad_clip.py): half an fp32 ulp on top.
    rtol = 3 * cascade_sum_rtol(flat.numel(), torch.float64) + torch.finfo(torch.float32).eps / 2
    assert stats["grad_norm"] == pytest.approx(float(torch.linalg.vector_norm(flat)), rel=rtol)
    _assert_grads_match(grads, start, start, groups, cfg)


@pytest.mark.parametrize("agg", AGG_MODES)
def test_fully_masked_samples_and_groups_take_no_share_of_the_update(agg):
    # Group 1 was truncated in every sample and the second sample of each group too (overlong filtering):
    # the sequence and group counts the trainer passes leave them out, as rl/loss.py does in one call.
    groups = _groups(4, truncate_second=True, truncate_groups=(1,))
    cfg = _config(
        algorithm__loss_agg=agg,
        algorithm__overlong_filter=True,
        training__train_batch_size=4,
        training__mini_batch_size=4,
    )
    start, updates, stats = _train(groups, cfg)
    assert len(updates) == 1
    _assert_grads_match(updates[0][1], start, start, groups, cfg)


def test_a_mini_batch_with_every_sample_masked_is_no_update():
    groups = _groups(2, truncate_groups=(1,))  # the second mini-batch holds only the truncated group
    cfg = _config(algorithm__overlong_filter=True, training__train_batch_size=2, training__mini_batch_size=1)
    start, updates, stats = _train(groups, cfg)
    assert len(updates) == 1 and stats["updates"] == 1
    _assert_grads_match(updates[0][1], start, start, groups[:1], cfg)


DP_GROUPS = dict(num_groups=4, truncate_second=True, truncate_groups=(3,))  # rank 1 holds the masked group


# GSPO and CISPO take pi_old from the samples' rollout log-probs (about -0.5 against the tiny model's ~-5), so that
# their ratios lie far from 1, where a per-response ratio taken over the wrong tokens would change the gradient.
DP_RUNS = [(agg, "dapo") for agg in AGG_MODES] + [
    (agg, variant) for variant in ("gspo", "cispo") for agg in ("token-mean", "seq-mean-token-mean")
]


def _dp_config(agg, variant, **overrides):
    old_logprobs = "recompute" if variant == "dapo" else "rollout"
    return _config(
        algorithm__loss_agg=agg,
        algorithm__overlong_filter=True,
        algorithm__policy_loss=variant,
        algorithm__old_logprobs=old_logprobs,
        **overrides,
    )


def _dp_rank_grads(rank, world_size):
    groups = _groups(**DP_GROUPS)
    share = groups[rank * 2 : (rank + 1) * 2]
    out = {}
    for agg, variant in DP_RUNS:
        cfg = _dp_config(agg, variant, training__train_batch_size=4, training__mini_batch_size=4)
        model = build_model(ARGS, seed=0).double()
        optimizer = _RecordingSGD(model.parameters(), lr=0.0)
        TrainPhase(cfg, model, optimizer, _NoSchedule(), GlooRanks(rank, world_size), TrainWatch(no_display)).run(
            1, share
        )
        out[agg, variant] = optimizer.updates[0][1]
    return out


@pytest.mark.multiprocess
def test_data_parallel_ranks_sum_to_the_one_process_gradient_with_masked_rows():
    from tests.dist_utils import run_ranks

    ranks = run_ranks(_dp_rank_grads, 2)
    groups = _groups(**DP_GROUPS)
    start = build_model(ARGS, seed=0).double()
    for run in DP_RUNS:
        summed = [a + b for a, b in zip(ranks[0][run], ranks[1][run])]
        _assert_grads_match(summed, start, start, groups, _dp_config(*run))


def _check_no_update(stats, model, start):
    assert stats["updates"] == 0 and stats["train_tokens"] == 0
    for key in ("loss", "grad_norm", "entropy", "token_prob/mean", "pg_clipfrac", "ppo_kl"):
        assert math.isnan(stats[key]), key  # logged as null: nothing was trained on
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), start.parameters()))


def test_a_step_with_nothing_to_train_on_is_no_update_and_no_schedule_step():
    model = build_model(ARGS, seed=0)
    start = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 4))  # train.py's warm-up
    cfg = _config(algorithm__overlong_filter=True, training__train_batch_size=4, training__mini_batch_size=2)
    phase = TrainPhase(cfg, model, optimizer, scheduler, OneProcess(), TrainWatch(no_display))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # Every group dropped by dynamic sampling; then every sample overlong-filtered.
        for step, groups in ((1, []), (2, _groups(2, truncate_groups=(0, 1)))):
            stats = phase.run(step, groups).metrics()
            _check_no_update(stats, model, start)
            assert stats["lr"] == pytest.approx(0.25e-3) and scheduler.last_epoch == 0
        groups = _groups(4)
        stats = phase.run(
            3, groups
        ).metrics()  # the first update runs at the warm-up's first rate, then the schedule moves
    assert stats["updates"] == 2 and stats["lr"] == pytest.approx(0.25e-3) and scheduler.last_epoch == 1
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.5e-3)
    assert stats["train_tokens"] == sum(len(s.response_ids) for g in groups for s in g.payload)
    assert not [w for w in caught if "optimizer.step()" in str(w.message)], [str(w.message) for w in caught]


def test_each_micro_batch_loss_is_read_to_the_host_once(monkeypatch):
    """The loss value crosses to the host once per micro-batch (a device sync each time on a GPU)."""
    from trainer.losses import DAPOLoss

    losses, reads = [], []
    real_loss, real_item = DAPOLoss.__call__, torch.Tensor.item

    def recording_loss(self, *args, **kwargs):
        loss, metrics = real_loss(self, *args, **kwargs)
        losses.append(loss)
        return loss, metrics

    def counting_item(self):
        if any(self is loss for loss in losses):
            reads.append(self)
        return real_item(self)

    monkeypatch.setattr(DAPOLoss, "__call__", recording_loss)
    monkeypatch.setattr(torch.Tensor, "item", counting_item)
    _, _, stats = _train(_groups(4), _config(training__train_batch_size=4, training__mini_batch_size=2))
    assert len(losses) > 2 and math.isfinite(stats["loss"])
    assert len(reads) == len(losses)
