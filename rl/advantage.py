"""Group-normalised advantage (DAPO Eq. 9) and its broadcast over response tokens.

For the G responses o_1..o_G sampled for one prompt, with rewards R_1..R_G:

    A_i = (R_i - mean({R_j})) / (std({R_j}) + eps)            eps = 1e-6, std unbiased (1 / (G - 1))

and every token t of o_i gets A_{i,t} = A_i. Conventions (shared with verl's GRPO estimator):

  * a group of one response uses mean 0 and std 1, so A = R (there is nothing to compare with);
  * `norm_by_std=False` skips the division (Dr. GRPO): A_i = R_i - mean({R_j});
  * a group whose rewards are all equal gets A = 0 (0 / (0 + eps)).

Groups are consecutive blocks of `group_size` samples (the update passes one group at a time).
"""

from __future__ import annotations

import torch

from rl import checks


def group_advantages(
    scores: torch.Tensor, *, group_size: int, eps: float = 1e-6, norm_by_std: bool = True
) -> torch.Tensor:
    """Per-sample advantages [N] from per-sample scalar rewards `scores` [N] (Eq. 9), in groups of
    `group_size` consecutive samples. Statistics are computed in float64 and the result is returned in the
    dtype of `scores`.
    """
    checks.advantage_inputs(scores, group_size, eps, norm_by_std)
    n = scores.shape[0]
    index, num_groups = torch.arange(n, device=scores.device) // group_size, n // group_size  # each sample's group

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
