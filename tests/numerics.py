"""Tolerances from error bounds, for tests that compare floating-point results.

A result computed in a floating dtype D carries rounding error bounded by c * n * eps(D) * sum|terms| for the
sums of n terms and the products that feed them (Higham, "Accuracy and Stability of Numerical Algorithms",
2nd ed., sections 3.1 and 4.2). The constant and the magnitudes depend on the quantity and its inputs; the
machine (vector width, number of threads, library kernels) only decides where inside the bound a result
lands. A tolerance read off one machine's output therefore fails on another (a 2-core CPU without AVX-512
sums in another order); these helpers derive tolerances instead:

* `assert_close_to_float64`: for a network's forward and backward pass the bound has no useful closed form,
  so it is measured. The test evaluates its reference once in D and once in float64; the difference is the
  size of D's rounding for this quantity, these inputs and this machine. The result under test (the same
  quantity computed another way in D: packed, sharded, compiled) rounds at the same eps over sums of the
  same lengths in another order, so its distance to the float64 value is of the same size. It must be within
  FACTOR times the reference's, over all compared tensors together: the largest of many rounding errors
  concentrates near a common value (over the suite's 1,000 such comparisons run with ATEN_CPU_CAPABILITY =
  avx512, avx2 and default, with 1 and 2 threads, the ratio of the two maxima stayed below 1.7), so FACTOR = 4
  is a margin over that spread, not a fit to one machine. A single value's rounding is one sample and does not
  concentrate (ratios up to 8 were seen): for it the floor of FLOOR_ULPS units of eps(D) * max|value| is the
  bound (single values were seen within 4.1 such units); the floor also covers a reference that happens to
  round almost exactly. A comparison whose errors are dominated by a few ill-conditioned elements (large
  weights after big optimizer steps) is run in float64 on both sides instead (tests/test_trainer_update.py).
* `cascade_sum_rtol`: the relative error of a sum (or a norm) of n values of one sign computed by torch's
  CPU reduction, which sums in a cascade (aten/src/ATen/native/cpu/SumKernel.cpp, cascade_sum): at most
  (ceil(log2 n) + 2) * eps(D) (pairwise summation's bound, Higham section 4.2, plus one rounding for the
  result and one for the final square root of a norm).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

FACTOR = 4.0
FLOOR_ULPS = 8.0


def eps(dtype: torch.dtype) -> float:
    """The unit roundoff's spacing at 1 (torch.finfo(dtype).eps)."""
    return torch.finfo(dtype).eps


def _tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    return list(value.values()) if isinstance(value, dict) else list(value)


def _max_abs(tensors: Sequence[torch.Tensor]) -> float:
    return max((t.abs().max().item() for t in tensors if t.numel()), default=0.0)


def _max_abs_diff(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> float:
    assert len(a) == len(b) and all(x.shape == y.shape for x, y in zip(a, b)), "compared tensors differ in shape"
    return _max_abs([x.double() - y.double() for x, y in zip(a, b)])


def assert_close_to_float64(got, ref, ref64, what: str = "") -> None:
    """`got` and `ref` (tensors, lists of tensors, or dicts with the same keys in the same order), computed in one
    dtype, against `ref64`, the reference in float64: max|got - ref64| <= FACTOR * max|ref - ref64| + FLOOR_ULPS *
    eps * max|ref64|, each maximum taken over all tensors (see the module docstring)."""
    got, ref, ref64 = _tensors(got), _tensors(ref), _tensors(ref64)
    dtype = ref[0].dtype
    assert all(t.dtype == dtype for t in got + ref), "got and ref must share the dtype whose rounding is measured"
    assert all(t.dtype == torch.float64 for t in ref64), "ref64 must be computed in float64"
    scale = _max_abs(ref64)
    rounding = _max_abs_diff(ref, ref64)
    tolerance = FACTOR * rounding + FLOOR_ULPS * eps(dtype) * scale
    error = _max_abs_diff(got, ref64)
    assert error <= tolerance, (
        f"{what}: max |got - float64| = {error:.3g} exceeds {FACTOR:g} x the {dtype} reference's own rounding "
        f"{rounding:.3g} + {FLOOR_ULPS:g} ulps of {scale:.3g} = {tolerance:.3g}"
    )


def cascade_sum_rtol(n: int, dtype: torch.dtype) -> float:
    """Relative error bound of a sum or a norm of `n` values of one sign computed by torch's cascade summation."""
    return (math.ceil(math.log2(max(n, 2))) + 2) * eps(dtype)
