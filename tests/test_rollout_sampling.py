"""rollout/sampling.py and SamplingParams: truncation sets, distributions, log-probs, seeds."""

import math

import pytest
import torch

from rollout.engine import Completion, SamplingParams
from rollout.sampling import sample, truncate_logits

# Chi-square critical value for 3 degrees of freedom at p = 1e-4: a correct sampler fails this
# test once in 10,000 runs (the seeds are fixed, so in practice never).
CHI2_DF3_P1E4 = 21.11


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def _draw(logits_row, n, temperature, top_k=-1, top_p=1.0, seed=0):
    gen = torch.Generator().manual_seed(seed)
    tokens, logprobs = sample(logits_row.expand(n, -1).clone(), temperature, top_k, top_p, gen)
    return tokens, logprobs


def test_top_k_keeps_exactly_the_k_largest():
    logits = torch.tensor([[0.5, 3.0, -1.0, 2.0, 1.0, 2.5]])
    kept = truncate_logits(logits, top_k=3)
    assert torch.isfinite(kept).nonzero()[:, 1].tolist() == [1, 3, 5]
    assert torch.equal(kept[0, [1, 3, 5]], logits[0, [1, 3, 5]])


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    probs = torch.tensor([[0.05, 0.4, 0.1, 0.3, 0.15]])
    logits = probs.log()
    # Sorted: 0.4, 0.3, 0.15, 0.1, 0.05; cumulative 0.4, 0.7, 0.85 -> top_p 0.8 keeps three tokens.
    assert torch.isfinite(truncate_logits(logits, top_p=0.8)).nonzero()[:, 1].tolist() == [1, 3, 4]
    # Exactly reaching p keeps no more: 0.4 + 0.3 = 0.7.
    assert torch.isfinite(truncate_logits(logits, top_p=0.7 - 1e-6)).nonzero()[:, 1].tolist() == [1, 3]
    # A tiny p still keeps the most likely token.
    assert torch.isfinite(truncate_logits(logits, top_p=1e-3)).nonzero()[:, 1].tolist() == [1]


def test_top_k_then_top_p_renormalizes_between():
    probs = torch.tensor([[0.4, 0.3, 0.2, 0.1]])
    # top-k 2 leaves {0.4, 0.3} -> renormalised 0.571, 0.429; top-p 0.5 then keeps only the first.
    kept = truncate_logits(probs.log(), top_k=2, top_p=0.5)
    assert torch.isfinite(kept).nonzero()[:, 1].tolist() == [0]


def test_sampling_never_leaves_top_k_or_nucleus():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(64, 50, generator=gen) * 3
    for top_k, top_p in [(5, 1.0), (-1, 0.6), (10, 0.9)]:
        allowed = torch.isfinite(truncate_logits(logits / 0.8, top_k, top_p))
        for seed in range(20):
            tokens, _ = sample(logits, 0.8, top_k, top_p, torch.Generator().manual_seed(seed))
            assert allowed.gather(1, tokens[:, None]).all(), (top_k, top_p)


def test_logprobs_are_untruncated_log_softmax_of_scaled_logits():
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(8, 30, generator=gen)
    tokens, logprobs = sample(logits, 0.7, 5, 0.9, torch.Generator().manual_seed(0))
    expected = torch.log_softmax(logits / 0.7, dim=-1).gather(1, tokens[:, None]).squeeze(1)
    # An fp32 log_softmax of 30 values: a handful of roundings, within 8 ulps of the largest magnitude involved.
    ulps8 = 8 * torch.finfo(torch.float32).eps * max(1.0, (logits / 0.7).abs().max().item())
    torch.testing.assert_close(logprobs, expected, rtol=0, atol=ulps8)
    # Greedy: argmax and the raw logits' log_softmax.
    tokens, logprobs = sample(logits, 0.0)
    assert torch.equal(tokens, logits.argmax(-1))
    torch.testing.assert_close(logprobs, torch.log_softmax(logits, -1).max(-1).values, rtol=0, atol=ulps8)


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_shapes_the_distribution(temperature):
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])
    n = 40_000
    tokens, _ = _draw(logits, n, temperature, seed=3)
    counts = torch.bincount(tokens, minlength=4).double()
    want = torch.softmax(logits.double() / temperature, -1)
    assert _chi_square(counts, want) < CHI2_DF3_P1E4
    # The test has power: the distribution of another temperature is rejected by a wide margin.
    other = torch.softmax(logits.double() / (temperature * 1.5), -1)
    assert _chi_square(counts, other) > 10 * CHI2_DF3_P1E4


def test_top_p_sampling_follows_the_renormalized_nucleus():
    probs = torch.tensor([0.5, 0.25, 0.15, 0.06, 0.04])
    n = 40_000
    tokens, _ = _draw(probs.log(), n, 1.0, top_p=0.85, seed=4)
    counts = torch.bincount(tokens, minlength=5).double()
    assert counts[3:].sum() == 0  # outside the nucleus {0.5, 0.25, 0.15}
    want = probs[:3].double() / probs[:3].sum()
    expected = want * n
    chi2 = float(((counts[:3] - expected) ** 2 / expected).sum())
    assert chi2 < 18.42  # df 2, p = 1e-4


def test_fixed_seed_reproduces_and_other_seed_differs():
    logits = torch.randn(16, 100, generator=torch.Generator().manual_seed(5))
    a, _ = sample(logits, 1.0, generator=torch.Generator().manual_seed(7))
    b, _ = sample(logits, 1.0, generator=torch.Generator().manual_seed(7))
    c, _ = sample(logits, 1.0, generator=torch.Generator().manual_seed(8))
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


def test_sampling_params_refuse_bad_values():
    for bad in [
        dict(max_new_tokens=0),
        dict(max_new_tokens=4, temperature=-1.0),
        dict(max_new_tokens=4, temperature=math.inf),
        dict(max_new_tokens=4, top_p=0.0),
        dict(max_new_tokens=4, top_p=1.5),
        dict(max_new_tokens=4, top_k=0),
        dict(max_new_tokens=4, n=0),
        dict(max_new_tokens=4, stop_token_ids=[-2]),
    ]:
        with pytest.raises(ValueError, match="SamplingParams"):
            SamplingParams(**bad)
    assert SamplingParams(max_new_tokens=3, stop_token_ids=[5, 6]).stop_token_ids == (5, 6)


def test_completion_checks_lengths_and_reason():
    with pytest.raises(ValueError, match="log-probs"):
        Completion(0, 0, [1, 2], [0.0], "stop")
    with pytest.raises(ValueError, match="finish_reason"):
        Completion(0, 0, [1], [0.0], "eos")
