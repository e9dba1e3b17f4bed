"""Activation checkpointing: same gradients as without it, names unchanged, and the intended recomputation.

What gets recomputed is observed directly: a dispatch mode counts the aten ops executed during backward.
Relative to no checkpointing, "full" re-runs every block's forward (its matmuls included), per-op
"selective" re-runs the cheap ops but none of the matmuls, and "every 2nd block" re-runs block 0 only.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from numerics import assert_close_to_float64
from torch.utils._python_dispatch import TorchDispatchMode

from model.args import PRESETS
from model.qwen2 import build_model
from parallel.activation_checkpoint import apply_ac
from parallel.compile import apply_compile

ARGS = PRESETS["tiny"].replace(num_layers=4)
# Matmuls a re-run block executes: q, k, v, o, gate, up. Not down_proj: the backward needs only its input,
# and non-reentrant checkpointing stops recomputing once every saved tensor it needs is back.
MM_PER_BLOCK = 6


class _OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def _batch():
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, ARGS.vocab_size, (2, 12), generator=g)
    positions = torch.cat([torch.arange(5), torch.arange(7)]).expand(2, -1)
    docs = torch.cat([torch.zeros(5), torch.ones(7)]).long().expand(2, -1)
    return tokens, positions, docs


def _run(mode="none", selective="op", compile_backend=None, dtype=torch.float32):
    """Gradients and backward op counts of one forward/backward with the given checkpointing."""
    model = build_model(ARGS, seed=0).to(dtype)
    apply_ac(model, mode, selective=selective)
    if compile_backend:
        apply_compile(model, backend=compile_backend)
    tokens, positions, docs = _batch()
    logits = model(tokens, positions, docs)
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.roll(-1, 1).flatten())
    counter = _OpCounter()
    if compile_backend:  # compiled backward graphs run whole; there is nothing per-op to count
        loss.backward()
    else:
        with counter:
            loss.backward()
    return model, {n: p.grad for n, p in model.named_parameters()}, counter.counts


def _matmuls(counts):
    return counts["mm"] + counts["addmm"] + counts["bmm"]


@pytest.fixture(scope="module")
def baseline():
    return _run("none")


@pytest.fixture(scope="module")
def baseline64():
    return _run("none", dtype=torch.float64)[1]


def _assert_same_gradients(grads, base_grads, base_grads64, what):
    """Recomputation runs the same forward again: gradients equal within fp32 rounding (tests/numerics.py)."""
    names = list(base_grads)
    assert_close_to_float64(
        [grads[n] for n in names], [base_grads[n] for n in names], [base_grads64[n] for n in names], what
    )


@pytest.mark.parametrize(
    "mode,selective,rerun_blocks",
    [
        ("full", "op", 4),  # every block's forward again
        ("selective", "op", 0),  # no matmul again
        ("selective", "2", 2),  # blocks 0 and 2
        ("selective", 1, 4),  # every block: the same as full
    ],
)
def test_checkpointing_keeps_gradients_and_recomputes_as_intended(baseline, baseline64, mode, selective, rerun_blocks):
    base_model, base_grads, base_counts = baseline
    model, grads, counts = _run(mode, selective)
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in base_model.named_parameters()]
    error = max((grads[n] - base_grads[n]).abs().max().item() for n in grads)
    print(
        f"AC {mode}/{selective}: max grad error {error:.3g}; backward matmuls {_matmuls(counts)} "
        f"vs {_matmuls(base_counts)} without AC; silu {counts['silu']} vs {base_counts['silu']}"
    )
    _assert_same_gradients(grads, base_grads, baseline64, f"AC {mode}/{selective}")
    assert _matmuls(counts) == _matmuls(base_counts) + rerun_blocks * MM_PER_BLOCK
    # SwiGLU's forward silu runs again in every checkpointed block (the backward itself uses silu_backward).
    checkpointed = ARGS.num_layers if (mode == "full" or selective == "op") else rerun_blocks
    assert counts["silu"] == base_counts["silu"] + checkpointed


def test_selective_op_policy_saves_matmuls_but_not_elementwise(baseline):
    _, _, base_counts = baseline
    _, _, counts = _run("selective", "op")
    assert _matmuls(counts) == _matmuls(base_counts)
    assert counts["silu"] == base_counts["silu"] + ARGS.num_layers
    assert counts["rsqrt"] > base_counts["rsqrt"]  # RMSNorm statistics are recomputed


@pytest.mark.parametrize("mode,selective", [("full", "op"), ("selective", "op")])
def test_checkpointing_under_compile_matches(baseline, baseline64, mode, selective):
    _, base_grads, _ = baseline
    _, grads, _ = _run(mode, selective, compile_backend="aot_eager")
    error = max((grads[n] - base_grads[n]).abs().max().item() for n in grads)
    print(f"AC {mode}/{selective} + compile: max grad error {error:.3g}")
    _assert_same_gradients(grads, base_grads, baseline64, f"AC {mode}/{selective} + compile")


def test_bad_options_are_refused():
    model = build_model(PRESETS["tiny"], seed=0)
    with pytest.raises(ValueError, match="must be one of"):
        apply_ac(model, "partial")
    with pytest.raises(ValueError, match="positive block interval"):
        apply_ac(model, "selective", selective="0")
    with pytest.raises(ValueError, match="positive block interval"):
        apply_ac(model, "selective", selective="ops")
