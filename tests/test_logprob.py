"""Chunked log-prob/entropy equals the naive full-logits computation, values and gradients."""

import math

import pytest
import torch
from numerics import assert_close_to_float64
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from model.logprob import _chunk_grad_logits, _chunk_stats, _finish_stats, token_logprobs
from tests.logprob_reference import naive_token_logprobs

V, H = 300, 24


def _inputs(shape=(3, 16), dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(*shape, H, generator=gen, dtype=torch.float64).to(dtype).requires_grad_()
    # Scale so logits are O(1-10), as for a trained head: a peaked but not one-hot distribution.
    weight = (torch.randn(V, H, generator=gen, dtype=torch.float64) * 0.4).to(dtype).requires_grad_()
    targets = torch.randint(0, V, shape, generator=gen)
    upstream = torch.randn(2, *shape, generator=gen, dtype=torch.float64)
    return hidden, weight, targets, upstream


def _run(fn, hidden, weight, targets, upstream, **kw):
    """Values and d(loss)/d(hidden, weight) for loss = sum(g1 * logp) [+ sum(g2 * entropy)]."""
    logp, entropy = fn(hidden, weight, targets, **kw)
    loss = (logp * upstream[0].to(logp.dtype)).sum()
    if kw.get("entropy_grad"):
        loss = loss + (entropy * upstream[1].to(entropy.dtype)).sum()
    grad_h, grad_w = torch.autograd.grad(loss, (hidden, weight))
    return {"logp": logp, "entropy": entropy, "grad_hidden": grad_h, "grad_weight": grad_w}


def _assert_within(actual, expected, tol, what):
    """max |a - e| <= tol * max(1, max |e|): a normwise bound. Used in float64 only, with tol = 1e-12: the values
    are sums of at most V = 300 products of size <= ~10, whose float64 rounding is <= 300 * eps64 * 10 = 7e-13."""
    err = (actual.double() - expected.double()).abs().max().item()
    scale = max(1.0, expected.double().abs().max().item())
    assert err <= tol * scale, f"{what}: max abs error {err:.3g} exceeds {tol:g} x {scale:.3g}"


def _float64(args):
    """The same inputs in float64 (a lower-precision input's values exactly), for the reference's float64 value."""
    return tuple(a.detach().double().requires_grad_(a.requires_grad) if a.is_floating_point() else a for a in args)


# N = 48 tokens: chunk 16 divides it, 7 and 13 do not, 1 is the extreme, 100 exceeds N (one chunk).
@pytest.mark.parametrize("chunk_size", [1, 7, 13, 16, 100])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
@pytest.mark.parametrize("entropy_grad", [False, True])
def test_chunked_matches_naive_fp32(chunk_size, temperature, entropy_grad):
    args = _inputs()
    kw = dict(temperature=temperature, entropy_grad=entropy_grad)
    got = _run(token_logprobs, *args, chunk_size=chunk_size, **kw)
    want = _run(naive_token_logprobs, *args, **kw)
    want64 = _run(naive_token_logprobs, *_float64(args), **kw)
    for key in want:
        assert got[key].dtype == torch.float32
        assert_close_to_float64(got[key], want[key], want64[key], key)


@pytest.mark.parametrize("chunk_size", [5, 48])
@pytest.mark.parametrize("entropy_grad", [False, True])
def test_chunked_matches_naive_fp64_to_rounding(chunk_size, entropy_grad):
    # In fp64 the only difference left is summation order, so the formulas must agree to ~1e-12.
    args = _inputs(dtype=torch.float64)
    kw = dict(temperature=0.8, entropy_grad=entropy_grad)
    got = _run(token_logprobs, *args, chunk_size=chunk_size, **kw)
    want = _run(naive_token_logprobs, *args, **kw)
    for key in want:
        _assert_within(got[key], want[key], 1e-12, key)


def test_hand_computed_values():
    # fp32 log-softmax over 3 logits of size <= 1.1: a few roundings of values <= 2, within 8 ulps (eps32 * 8 =
    # 1e-6) of the exact value.
    # h = [1], W = [[0], [ln 2], [ln 3]]: logits (0, ln 2, ln 3), p = (1/6, 2/6, 3/6).
    hidden = torch.tensor([[1.0]])
    weight = torch.tensor([[0.0], [math.log(2.0)], [math.log(3.0)]])
    logp, entropy = token_logprobs(hidden, weight, torch.tensor([2]), chunk_size=1)
    assert logp.item() == pytest.approx(math.log(0.5), abs=1e-6)
    p = [1 / 6, 2 / 6, 3 / 6]
    assert entropy.item() == pytest.approx(-sum(q * math.log(q) for q in p), abs=1e-6)
    # Temperature 2: logits (0, ln 2 / 2, ln 3 / 2), i.e. p proportional to (1, sqrt 2, sqrt 3).
    logp_t, _ = token_logprobs(hidden, weight, torch.tensor([0]), temperature=2.0)
    assert logp_t.item() == pytest.approx(-math.log(1 + math.sqrt(2) + math.sqrt(3)), abs=1e-6)
    # d logp_y / d h = W_y - sum_v p_v W_v = ln 3 - (2/6 ln 2 + 3/6 ln 3) at T = 1.
    hidden.requires_grad_()
    token_logprobs(hidden, weight, torch.tensor([2]))[0].sum().backward()
    assert hidden.grad.item() == pytest.approx(math.log(3) - (2 / 6 * math.log(2) + 3 / 6 * math.log(3)), abs=1e-6)


def test_leading_shapes_and_entropy_options():
    hidden, weight, targets, _ = _inputs(shape=(2, 5, 3))
    logp, entropy = token_logprobs(hidden, weight, targets, chunk_size=4)
    assert logp.shape == entropy.shape == (2, 5, 3)
    flat_logp, _ = token_logprobs(hidden.reshape(-1, H), weight, targets.reshape(-1), chunk_size=4)
    torch.testing.assert_close(logp.reshape(-1), flat_logp, rtol=0, atol=0)
    assert logp.requires_grad and not entropy.requires_grad  # entropy detached by default
    _, entropy_g = token_logprobs(hidden, weight, targets, entropy_grad=True)
    assert entropy_g.requires_grad
    lp_only, none = token_logprobs(hidden, weight, targets, with_entropy=False, chunk_size=4)
    assert none is None
    torch.testing.assert_close(lp_only, logp, rtol=0, atol=0)


def test_frozen_head_gets_no_gradient():
    hidden, weight, targets, _ = _inputs()
    weight = weight.detach()
    logp, _ = token_logprobs(hidden, weight, targets, chunk_size=7)
    (grad_h,) = torch.autograd.grad(logp.sum(), hidden)
    (want,) = torch.autograd.grad(naive_token_logprobs(hidden, weight, targets)[0].sum(), hidden)
    hidden64, weight64 = _float64((hidden, weight))
    (want64,) = torch.autograd.grad(naive_token_logprobs(hidden64, weight64, targets)[0].sum(), hidden64)
    assert_close_to_float64(grad_h, want, want64, "grad_hidden")


def test_bf16_inputs_follow_naive_bf16():
    args = _inputs(dtype=torch.bfloat16)
    got = _run(token_logprobs, *args, chunk_size=7, entropy_grad=True)
    want = _run(naive_token_logprobs, *args, entropy_grad=True)
    want64 = _run(naive_token_logprobs, *_float64(args), entropy_grad=True)
    assert got["logp"].dtype == torch.float32 and got["grad_weight"].dtype == torch.bfloat16
    # Same bf16 logits, fp32 softmax; bf16 gradients: each within the naive bf16 computation's own rounding.
    for key in ("logp", "grad_hidden", "grad_weight"):
        assert_close_to_float64(got[key], want[key], want64[key], key)


class _LargestTensor(TorchDispatchMode):
    """Records the largest tensor any op produces (forward and backward run in this thread on CPU)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("entropy_grad", [False, True])
def test_never_materializes_full_logits(entropy_grad):
    n, chunk = 64, 8  # H = 24 < n, so the [V, H] weight gradient is smaller than [n, V] logits
    hidden, weight, targets, upstream = _inputs(shape=(n,))
    for fn, kw in ((token_logprobs, dict(chunk_size=chunk)), (naive_token_logprobs, {})):
        with _LargestTensor() as probe:
            _run(fn, hidden, weight, targets, upstream, entropy_grad=entropy_grad, **kw)
        if fn is token_logprobs:
            assert probe.largest <= max(chunk * V, V * H), probe.largest
        else:  # the probe does see the naive version's full logits
            assert probe.largest >= n * V


def test_vocab_split_helpers_reproduce_full_result():
    """The per-chunk helpers combine across vocabulary slices (as a vocab-parallel head uses them)."""
    hidden, weight, targets, upstream = _inputs(shape=(10,), dtype=torch.float64)
    hidden, weight = hidden.detach(), weight.detach()
    t = 0.7
    want = _run(
        naive_token_logprobs,
        hidden.clone().requires_grad_(),
        weight.clone().requires_grad_(),
        targets,
        upstream,
        temperature=t,
        entropy_grad=True,
    )
    bounds = [(0, 120), (120, V)]
    slices = [(hidden @ weight[a:b].t()) / t for a, b in bounds]
    local_targets = [torch.where((targets >= a) & (targets < b), targets - a, -1) for a, b in bounds]
    row_max = torch.stack([z.amax(-1) for z in slices]).amax(0)  # all-reduce MAX
    stats = [_chunk_stats(z.clone(), y, row_max) for z, y in zip(slices, local_targets)]
    sums = [sum(s[i] for s in stats) for i in range(3)]  # all-reduce SUM
    logp, entropy, lse = _finish_stats(row_max, *sums)
    _assert_within(logp, want["logp"], 1e-12, "logp")
    _assert_within(entropy, want["entropy"], 1e-12, "entropy")
    grads = [
        _chunk_grad_logits(z.clone(), y, lse, upstream[0], entropy, upstream[1]) / t
        for z, y in zip(slices, local_targets)
    ]
    grad_w = torch.cat([g.t() @ hidden for g in grads])
    grad_h = sum(g @ weight[a:b] for g, (a, b) in zip(grads, bounds))  # all-reduce SUM
    _assert_within(grad_w, want["grad_weight"], 1e-12, "grad_weight")
    _assert_within(grad_h, want["grad_hidden"], 1e-12, "grad_hidden")


def test_bad_inputs_are_named():
    hidden, weight, targets, _ = _inputs()
    with pytest.raises(ValueError, match="targets shape"):
        token_logprobs(hidden, weight, targets[:, :3])
    with pytest.raises(ValueError, match=r"weight must be \[vocab, hidden=24\]"):
        token_logprobs(hidden, weight[:, :5], targets)
    with pytest.raises(ValueError, match=r"targets must lie in \[0, 300\)"):
        token_logprobs(hidden, weight, targets + V)
    with pytest.raises(ValueError, match="temperature must be positive"):
        token_logprobs(hidden, weight, targets, temperature=0.0)
    with pytest.raises(ValueError, match="chunk_size must be positive"):
        token_logprobs(hidden, weight, targets, chunk_size=0)
    with pytest.raises(ValueError, match="entropy_grad=True needs with_entropy=True"):
        token_logprobs(hidden, weight, targets, with_entropy=False, entropy_grad=True)
    with pytest.raises(ValueError, match="must share a dtype"):
        token_logprobs(hidden, weight.double(), targets)
