"""rl/loss.py against verl: the same per-token loss and aggregation as verl's, on awkward masks.

The reference below restates, line for line in meaning, two functions of verl
(github.com/volcengine/verl, verl/trainer/ppo/core_algos.py, as of commit b178a3c, January 2026):
`compute_policy_loss_vanilla` (the per-token clipped loss with dual clip) and `agg_loss` on its default
path (dp_size = 1, no global batch counts), with verl/utils/torch_functional.py `masked_sum`.
"""

import pytest
import torch

from tests.loss_calls import loss_with

VERL_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


def verl_masked_sum(values, mask, axis=None):
    """verl.utils.torch_functional.masked_sum: NaNs outside the mask are zeroed, then a masked sum."""
    return (torch.where(mask.bool(), values, 0.0) * mask).sum(axis=axis)


def verl_agg_loss(loss_mat, loss_mask, loss_agg_mode, loss_scale_factor=None):
    """verl core_algos.agg_loss with dp_size = 1, batch_num_tokens = global_batch_size = None."""
    if loss_agg_mode == "token-mean":
        return verl_masked_sum(loss_mat, loss_mask) / loss_mask.sum()
    if loss_agg_mode == "seq-mean-token-sum":
        seq_losses = torch.sum(loss_mat * loss_mask, dim=-1)
        seq_mask = (torch.sum(loss_mask, dim=-1) > 0).float()  # verl: "exclude fully masked sequences"
        return verl_masked_sum(seq_losses, seq_mask) / seq_mask.sum()
    if loss_agg_mode == "seq-mean-token-mean":
        seq_mask = torch.sum(loss_mask, dim=-1)
        seq_losses = torch.sum(loss_mat * loss_mask, dim=-1) / (seq_mask + 1e-8)
        seq_mask = (seq_mask > 0).float()
        return verl_masked_sum(seq_losses, seq_mask) / seq_mask.sum()
    if loss_agg_mode == "seq-mean-token-sum-norm":
        seq_losses = torch.sum(loss_mat * loss_mask, dim=-1)
        if loss_scale_factor is None:
            loss_scale_factor = loss_mask.shape[-1]
        return torch.sum(seq_losses) / loss_scale_factor
    raise ValueError(loss_agg_mode)


def verl_policy_loss(
    old_log_prob,
    log_prob,
    advantages,
    response_mask,
    loss_agg_mode,
    clip_ratio_low,
    clip_ratio_high,
    clip_ratio_c,
    loss_scale_factor=None,
):
    """verl core_algos.compute_policy_loss_vanilla's loss (no rollout importance weights)."""
    negative_approx_kl = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
    pg_losses3 = -advantages * clip_ratio_c
    clip_pg_losses2 = torch.min(pg_losses3, clip_pg_losses1)
    pg_losses = torch.where(advantages < 0, clip_pg_losses2, clip_pg_losses1)
    return verl_agg_loss(pg_losses, response_mask, loss_agg_mode, loss_scale_factor)


def _case(seed, batch, length, masked_rows=()):
    gen = torch.Generator().manual_seed(seed)
    old_logp = -torch.rand(batch, length, generator=gen, dtype=torch.float64) * 3
    logp = old_logp + (torch.rand(batch, length, generator=gen, dtype=torch.float64) - 0.5) * 3.0
    advantages = (torch.randn(batch, generator=gen, dtype=torch.float64) * 2)[:, None].expand(batch, length)
    lengths = torch.randint(1, length + 1, (batch,), generator=gen)
    mask = (torch.arange(length)[None, :] < lengths[:, None]).to(torch.float64)
    mask[list(masked_rows)] = 0.0
    return logp, old_logp, advantages.contiguous(), mask


def _both(case, agg, norm_len=None):
    """(ours, verl's) loss and gradient with respect to logp."""
    logp, old_logp, advantages, mask = case
    results = []
    for fn in ("ours", "verl"):
        x = logp.clone().requires_grad_()
        if fn == "ours":
            loss, _ = loss_with(
                x, old_logp, advantages, mask, agg=agg, clip_low=0.2, clip_high=0.28, clip_c=3.0, norm_len=norm_len
            )
        else:
            loss = verl_policy_loss(old_logp, x, advantages, mask, agg, 0.2, 0.28, 3.0, loss_scale_factor=norm_len)
        loss.backward()
        results.append((loss.detach(), x.grad))
    return results


CASES = {
    "random": dict(seed=0, batch=8, length=7),
    "fully masked rows": dict(seed=1, batch=8, length=7, masked_rows=(0, 3, 4)),
    "all but one row masked": dict(seed=2, batch=6, length=5, masked_rows=(0, 1, 2, 4, 5)),
    "single row": dict(seed=3, batch=1, length=9),
    "single token": dict(seed=7, batch=1, length=1),
    **{
        f"random masked {s}": dict(seed=10 + s, batch=5 + s, length=3 + s, masked_rows=tuple(range(0, 5 + s, 3)))
        for s in range(6)
    },
}


@pytest.mark.parametrize("agg", VERL_MODES)
@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("norm_len", [None, 16])
def test_loss_and_gradient_equal_verls(agg, name, norm_len):
    (ours, our_grad), (verl, verl_grad) = _both(_case(**CASES[name]), agg, norm_len)
    assert torch.isfinite(verl)
    # verl's seq-mean-token-mean divides by (tokens + 1e-8): a relative difference of at most 1e-8.
    torch.testing.assert_close(ours, verl, rtol=1e-7, atol=1e-12)
    torch.testing.assert_close(our_grad, verl_grad, rtol=1e-7, atol=1e-12)
    assert our_grad.abs().max() > 0


def test_the_fully_masked_rows_case_differs_from_counting_every_row():
    # The case above is not vacuous: counting all 8 rows instead of the 5 with tokens changes the loss.
    logp, old_logp, advantages, mask = _case(**CASES["fully masked rows"])
    ours, _ = loss_with(logp, old_logp, advantages, mask, agg="seq-mean-token-mean", clip_c=3.0)
    every_row, _ = loss_with(logp, old_logp, advantages, mask, agg="seq-mean-token-mean", clip_c=3.0, global_num_seqs=8)
    assert ours.item() == pytest.approx(every_row.item() * 8 / 5, rel=1e-12) and abs(ours.item()) > 0.1


@pytest.mark.parametrize("agg", VERL_MODES)
def test_all_rows_masked_gives_zero_where_verl_gives_nan(agg):
    """verl divides 0 by 0 when no token is valid (except seq-mean-token-sum-norm, which divides by T);
    here the loss is 0 with a zero gradient, so an empty micro-batch cannot poison the update."""
    logp, old_logp, advantages, _ = _case(seed=5, batch=3, length=4)
    mask = torch.zeros(3, 4, dtype=torch.float64)
    (ours, our_grad), (verl, _) = _both((logp, old_logp, advantages, mask), agg)
    assert ours.item() == 0.0 and torch.equal(our_grad, torch.zeros_like(our_grad))
    if agg == "seq-mean-token-sum-norm":
        assert verl.item() == 0.0
    else:
        assert torch.isnan(verl)
