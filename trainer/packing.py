"""Pack variable-length samples into token-budgeted micro-batches with no padding waste.

Each micro-batch is one row of concatenated samples: positions restart at 0 for every sample and
`document_ids` keep attention inside each sample (see model/qwen2.py). The loss needs per-sample
[S, L] tensors (sequence-level aggregation modes sum over a sample's tokens), so every micro-batch
also carries the layout that maps its response tokens to an [S, L] grid:

    response token k of sample s (the token at row position p_s + P_s + k) is predicted by the hidden
    state at p_s + P_s + k - 1;  `predict_positions` lists those row positions in [S, L] order and
    `targets` the tokens they predict, `layout` [S, L] indexes them (-1 = padding of the grid).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class PackItem:
    """One sample as the trainer sees it."""

    prompt_ids: list[int]
    response_ids: list[int]
    advantage: float = 0.0
    loss_weight: float = 1.0  # 0 removes the sample from the loss (overlong filtering)
    rollout_logprobs: list[float] | None = None  # the engine's log-probs of the response tokens
    group_id: int = 0
    group_num_tokens: int = 0  # loss tokens of this sample's whole group in the mini-batch (group-token-mean)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)


@dataclass
class MicroBatch:
    tokens: torch.Tensor  # [1, T] the packed row
    positions: torch.Tensor  # [1, T] restart at 0 for each sample
    document_ids: torch.Tensor  # [1, T] sample index within the row
    predict_positions: torch.Tensor  # [N] row positions whose hidden state predicts a response token
    targets: torch.Tensor  # [N] the response tokens they predict
    layout: torch.Tensor  # [S, L] index into the N response tokens, -1 where a sample is shorter than L
    mask: torch.Tensor  # [S, L] float: 1 for response tokens that enter the loss
    advantages: torch.Tensor  # [S, L] float: each sample's advantage on its tokens
    rollout_logp: torch.Tensor  # [S, L] float: the engine's log-probs (0 where unknown)
    group_ids: torch.Tensor  # [S]
    group_tokens: torch.Tensor  # [S] float: loss tokens of each sample's whole group in the mini-batch
    items: list[PackItem] = field(repr=False, default_factory=list)
    old_logp: torch.Tensor | None = None  # [S, L], filled by the trainer before the updates

    @property
    def num_samples(self) -> int:
        return len(self.items)

    def to(self, device) -> "MicroBatch":
        moved = {name: getattr(self, name).to(device) for name in
                 ("tokens", "positions", "document_ids", "predict_positions", "targets", "layout", "mask",
                  "advantages", "rollout_logp", "group_ids", "group_tokens")}
        old = self.old_logp.to(device) if self.old_logp is not None else None
        return MicroBatch(**moved, items=self.items, old_logp=old)

    def grid(self, per_token: torch.Tensor) -> torch.Tensor:
        """Scatter a [N] per-response-token tensor into the [S, L] grid (0 in the padding)."""
        gathered = per_token[self.layout.clamp(min=0)]
        return torch.where(self.layout >= 0, gathered, torch.zeros((), dtype=per_token.dtype, device=per_token.device))


def plan_micro_batches(lengths: list[int], token_budget: int) -> list[list[int]]:
    """Assign sample indices to rows of at most `token_budget` tokens (first-fit decreasing).

    Sorting longest first and placing each sample in the first row with room keeps the number of rows
    close to the minimum, sum(lengths) / token_budget.
    """
    if token_budget <= 0:
        raise ValueError(f"token budget must be positive, got {token_budget}")
    too_long = [(i, n) for i, n in enumerate(lengths) if n > token_budget]
    if too_long:
        i, n = too_long[0]
        raise ValueError(f"sample {i} has {n} tokens, more than the micro-batch token budget {token_budget} "
                         f"(training.micro_batch_tokens must be >= max prompt + max response length)")
    rows: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        for r, free in enumerate(room):
            if lengths[i] <= free:
                rows[r].append(i)
                room[r] -= lengths[i]
                break
        else:
            rows.append([i])
            room.append(token_budget - lengths[i])
    return [sorted(row) for row in rows]


def pack(items: list[PackItem], pad_to_multiple: int = 1) -> MicroBatch:
    """Concatenate `items` into one row and build the [S, L] response layout.

    pad_to_multiple: pad the row to a multiple of this many tokens (sequence parallelism shards the row
    over the tensor-parallel ranks); the padding is a document of its own and predicts nothing.
    """
    if not items:
        raise ValueError("cannot pack an empty list of samples")
    tokens, positions, docs, predict, targets = [], [], [], [], []
    lengths = [len(it.response_ids) for it in items]
    width = max(1, max(lengths))
    layout = torch.full((len(items), width), -1, dtype=torch.long)
    mask = torch.zeros(len(items), width)
    advantages = torch.zeros(len(items), width)
    rollout_logp = torch.zeros(len(items), width)
    offset = 0
    for s, it in enumerate(items):
        if not it.prompt_ids:
            raise ValueError(f"sample {s} has an empty prompt: its first response token has no predictor")
        seq = list(it.prompt_ids) + list(it.response_ids)
        start = len(tokens)
        tokens.extend(seq)
        positions.extend(range(len(seq)))
        docs.extend([s] * len(seq))
        n = len(it.response_ids)
        first = start + len(it.prompt_ids) - 1
        predict.extend(range(first, first + n))
        targets.extend(it.response_ids)
        layout[s, :n] = torch.arange(offset, offset + n)
        mask[s, :n] = it.loss_weight
        advantages[s, :n] = it.advantage
        if it.rollout_logprobs is not None:
            if len(it.rollout_logprobs) != n:
                raise ValueError(f"sample {s}: {len(it.rollout_logprobs)} rollout log-probs for {n} response tokens")
            rollout_logp[s, :n] = torch.tensor(it.rollout_logprobs, dtype=torch.float32)
        offset += n
    padding = -len(tokens) % pad_to_multiple
    tokens.extend([0] * padding)
    positions.extend(range(padding))
    docs.extend([len(items)] * padding)
    as_row = lambda values: torch.tensor(values, dtype=torch.long).unsqueeze(0)
    return MicroBatch(
        tokens=as_row(tokens), positions=as_row(positions), document_ids=as_row(docs),
        predict_positions=torch.tensor(predict, dtype=torch.long), targets=torch.tensor(targets, dtype=torch.long),
        layout=layout, mask=mask, advantages=advantages, rollout_logp=rollout_logp,
        group_ids=torch.tensor([it.group_id for it in items], dtype=torch.long),
        group_tokens=torch.tensor([float(it.group_num_tokens) for it in items]), items=list(items),
    )


def pack_micro_batches(items: list[PackItem], token_budget: int, pad_to_multiple: int = 1) -> list[MicroBatch]:
    """Pack a mini-batch's samples into as few budget-sized rows as first-fit decreasing finds."""
    plan = plan_micro_batches([it.num_tokens for it in items], token_budget)
    return [pack([items[i] for i in row], pad_to_multiple) for row in plan]
