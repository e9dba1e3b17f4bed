"""Group-normalised advantage (DAPO Eq. 9) and its broadcast over response tokens.

For the G responses o_1..o_G sampled for one prompt, with rewards R_1..R_G:

    A_i = (R_i - mean({R_j})) / (std({R_j}) + eps)            eps = 1e-6, std unbiased (1 / (G - 1))

and every token t of o_i gets A_{i,t} = A_i. Conventions (shared with verl's GRPO estimator):

  * a group of one response uses mean 0 and std 1, so A = R (there is nothing to compare with);
  * `norm_by_std=False` skips the division (Dr. GRPO): A_i = R_i - mean({R_j});
  * a group whose rewards are all equal gets A = 0 (0 / (0 + eps)).

Groups are given either by a size (consecutive blocks of `group_size` samples) or by one id per
sample (any order; ints in a tensor or any hashable values in a sequence).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

from rl import checks


def group_advantages(
    scores: torch.Tensor,
    *,
    group_size: int | None = None,
    group_ids: torch.Tensor | Sequence[Hashable] | None = None,
    eps: float = 1e-6,
    norm_by_std: bool = True,
) -> torch.Tensor:
    """Per-sample advantages [N] from per-sample scalar rewards `scores` [N] (Eq. 9).

    Exactly one of `group_size` and `group_ids` must be given. Statistics are computed in float64
    and the result is returned in the dtype of `scores`.
    """
    checks.advantage_inputs(scores, group_size, group_ids, eps, norm_by_std)
    index, num_groups = _group_index(scores.shape[0], group_size, group_ids, scores.device)

    x = scores.to(torch.float64)
    zeros = torch.zeros(num_groups, dtype=torch.float64, device=x.device)
    count = zeros.index_add(0, index, torch.ones_like(x))
    mean = zeros.index_add(0, index, x) / count
    squares = zeros.index_add(0, index, (x - mean[index]) ** 2)
    std = torch.sqrt(squares / (count - 1).clamp(min=1))
    single = count == 1
    mean = torch.where(single, 0.0, mean)
    std = torch.where(single, 1.0, std)

    advantages = x - mean[index]
    if norm_by_std:
        advantages = advantages / (std[index] + eps)
    return advantages.to(scores.dtype)


def _group_index(
    n: int, group_size: int | None, group_ids: torch.Tensor | Sequence[Hashable] | None, device: torch.device
) -> tuple[torch.Tensor, int]:
    """Group number in [0, num_groups) of every sample, and num_groups."""
    if group_size is not None:
        return torch.arange(n, device=device) // group_size, n // group_size
    assert group_ids is not None  # exactly one of the two is given (rl/checks.py)
    if isinstance(group_ids, torch.Tensor):
        distinct, index = torch.unique(group_ids, return_inverse=True)
        return index.to(device), distinct.numel()
    numbering: dict[Hashable, int] = {}
    index = [numbering.setdefault(gid, len(numbering)) for gid in group_ids]
    return torch.tensor(index, dtype=torch.long, device=device), len(numbering)
