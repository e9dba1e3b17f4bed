"""Packed rows (document ids + restarting positions) equal running each sample alone: logits and gradients."""

import copy
import itertools

import pytest
import torch
from numerics import assert_close_to_float64

from model.args import get_preset
from model.qwen2 import build_model

LENGTHS = [[5, 9, 3, 7], [11, 6]]  # two packed rows; the second is padded to the first's length
PAD_DOC = -1


def _samples(vocab, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [[torch.randint(0, vocab, (n,), generator=gen) for n in row] for row in LENGTHS]


def _pack(samples):
    """tokens, positions, document ids [rows, T]; padding is its own document (never attended to by samples)."""
    width = max(sum(len(s) for s in row) for row in samples)
    tokens = torch.zeros(len(samples), width, dtype=torch.long)
    positions = torch.zeros_like(tokens)
    docs = torch.full_like(tokens, PAD_DOC)
    for r, row in enumerate(samples):
        start = 0
        for d, s in enumerate(row):
            tokens[r, start : start + len(s)] = s
            positions[r, start : start + len(s)] = torch.arange(len(s))
            docs[r, start : start + len(s)] = d
            start += len(s)
        positions[r, start:] = torch.arange(width - start)
    return tokens, positions, docs


def _loss_weights(vocab, seed=1):
    """A fixed random projection of the logits, so the loss touches every vocabulary entry."""
    return torch.randn(vocab, generator=torch.Generator().manual_seed(seed))


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def _separate(model, samples, proj):
    """Each sample's logits run alone, and the gradients of the summed projected logits over all samples."""
    model.zero_grad()
    logits = []
    for row in samples:
        for s in row:
            out = model(s.unsqueeze(0))[0]
            (out @ proj.to(out.dtype)).sum().backward()  # gradients accumulate over the separate runs
            logits.append(out.detach())
    return logits, _grads(model)


def test_packed_equals_separate_forward_and_gradients():
    model = build_model(get_preset("tiny"), seed=0)
    vocab = model.args.vocab_size
    samples = _samples(vocab)
    proj = _loss_weights(vocab)

    tokens, positions, docs = _pack(samples)
    packed_logits = model(tokens, positions=positions, document_ids=docs)
    valid = docs != PAD_DOC
    (packed_logits[valid] @ proj).sum().backward()
    packed_grads = _grads(model)
    packed = [
        packed_logits[r, start - len(s) : start].detach()
        for r, row in enumerate(samples)
        for start, s in zip(itertools.accumulate(len(s) for s in row), row)
    ]
    # The same sums in another order (one packed row vs per-sample): equal within fp32 rounding, measured
    # against the separate runs in float64 (tests/numerics.py).
    separate, separate_grads = _separate(model, samples, proj)
    separate64, separate_grads64 = _separate(copy.deepcopy(model).double(), samples, proj)
    assert_close_to_float64(packed, separate, separate64, "logits")
    assert_close_to_float64(packed_grads, separate_grads, separate_grads64, "gradients")


def test_without_document_mask_samples_would_leak():
    # Guards the test above: dropping the document mask (plain causal attention over the packed row)
    # changes every sample after the first, so the equality really depends on the mask.
    model = build_model(get_preset("tiny-tied"), seed=1)
    samples = _samples(model.args.vocab_size, seed=2)
    tokens, positions, docs = _pack(samples)
    with torch.no_grad():
        masked = model(tokens, positions=positions, document_ids=docs)
        leaky = model(tokens, positions=positions)
        alone = model(samples[0][1].unsqueeze(0))[0]
        alone64 = model.double()(samples[0][1].unsqueeze(0))[0]
    second = slice(LENGTHS[0][0], LENGTHS[0][0] + LENGTHS[0][1])
    assert_close_to_float64(masked[0, second], alone, alone64, "masked")
    assert (leaky[0, second] - alone).abs().max() > 1e-3


def test_segmented_and_explicit_mask_attention_agree():
    """Contiguous documents take the segmented path; interleaved ones the explicit mask: same result."""
    import torch

    from model.qwen2 import DocumentMaskContext

    torch.manual_seed(0)
    docs = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2, 2, 3], [5, 5, 5, 5, 5, 5, 7, 7, 7, 7]])
    segmented = DocumentMaskContext(docs)
    assert segmented.mask is None
    shuffled = DocumentMaskContext(torch.tensor([[0, 1, 0, 1, 1, 2, 2, 2, 2, 3], [5, 5, 5, 5, 5, 5, 7, 7, 7, 7]]))
    assert shuffled.mask is not None
    explicit = DocumentMaskContext.__new__(DocumentMaskContext)
    same = docs.unsqueeze(2) == docs.unsqueeze(1)
    explicit.mask = (same & torch.ones(10, 10, dtype=torch.bool).tril()).unsqueeze(1)
    q = torch.randn(2, 4, 10, 8, requires_grad=True)
    k, v = torch.randn(2, 2, 10, 8, requires_grad=True), torch.randn(2, 2, 10, 8, requires_grad=True)
    a, b = segmented.attend(0, q, k, v), explicit.attend(0, q, k, v)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    b64 = explicit.attend(0, q64, k64, v64)
    assert_close_to_float64(a, b, b64, "attention")
    ga = torch.autograd.grad(a.square().sum(), (q, k, v))
    gb = torch.autograd.grad(b.square().sum(), (q, k, v))
    gb64 = torch.autograd.grad(b64.square().sum(), (q64, k64, v64))
    assert_close_to_float64(ga, gb, gb64, "attention gradients")


def _no_vector_isa() -> bool:
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    return not pick_vec_isa()


@pytest.mark.skipif(
    "_no_vector_isa()",
    reason="inductor compiles FlexAttention for a CPU only with vector instructions (AVX2, AVX-512, NEON)",
)
def test_flex_document_mask_agrees_with_the_cpu_path_forward():
    """The GPU path's block mask (FlexAttention, compiled) gives the CPU path's result; forward only:
    FlexAttention has no backward on CPU."""
    from model.qwen2 import DocumentMaskContext, FlexDocumentContext, compiled_flex_attention

    torch.manual_seed(0)
    many_short = torch.repeat_interleave(torch.arange(52), torch.tensor([3, 2, 4, 1] * 13))  # 130 tokens
    docs = torch.stack([many_short, torch.tensor([5] * 60 + [7] * 70)])
    flex = FlexDocumentContext(docs)
    assert flex._flex is compiled_flex_attention()  # never the unfused eager fallback
    q = torch.randn(2, 4, 130, 16)
    k, v = torch.randn(2, 2, 130, 16), torch.randn(2, 2, 130, 16)
    with torch.no_grad():
        want = DocumentMaskContext(docs).attend(0, q, k, v)
        want64 = DocumentMaskContext(docs).attend(0, q.double(), k.double(), v.double())
        got = flex.attend(0, q, k, v)
    assert_close_to_float64(got, want, want64, "flex attention")
