"""The FlexAttention decode path (rollout/paged_flex.py): its mask, checked on CPU with flex_attention's
eager reference implementation against the gathered-blocks path; the engine on CUDA where one exists."""

import pytest
import torch
from numerics import assert_close_to_float64
from torch.nn.attention.flex_attention import flex_attention

import rollout.paged_flex as paged_flex
from rollout.kv_cache import DecodeContext
from tests.engines import generate


@pytest.mark.filterwarnings("ignore:.*flex_attention called without torch.compile:UserWarning")
@pytest.mark.parametrize("kernel", ["eager", pytest.param("compiled", marks=pytest.mark.slow)])
def test_flex_block_mask_attends_exactly_like_the_gathered_blocks(monkeypatch, kernel):
    if kernel == "eager":  # flex_attention's reference implementation; "compiled" is inductor's CPU kernel
        monkeypatch.setattr(paged_flex, "compiled_flex_attention", lambda: flex_attention)
    torch.manual_seed(0)
    kv_heads, blocks, size, dim, heads = 2, 40, 16, 32, 4
    k_cache, v_cache = torch.randn(kv_heads, blocks + 1, size, dim), torch.randn(kv_heads, blocks + 1, size, dim)
    # Rows 0 and 2 share their first two (prompt) blocks; 40 is the scratch block padding the tables.
    tables = torch.tensor([[3, 7, 9, 40], [5, 1, 40, 40], [3, 7, 12, 2]])
    positions = torch.tensor([40, 20, 63])
    q, k, v = torch.randn(3, heads, 1, dim), torch.randn(3, kv_heads, 1, dim), torch.randn(3, kv_heads, 1, dim)
    gathered_k, gathered_v = [k_cache.clone()], [v_cache.clone()]
    want = DecodeContext(gathered_k, gathered_v, positions, tables).attend(0, q, k, v)
    want64 = DecodeContext([k_cache.double()], [v_cache.double()], positions, tables).attend(
        0, q.double(), k.double(), v.double()
    )
    flex_k, flex_v = [k_cache.clone()], [v_cache.clone()]
    got = paged_flex.FlexDecodeContext(flex_k, flex_v, positions, tables).attend(0, q, k, v)
    # Within fp32 rounding, measured against the gathered-blocks path in float64 (tests/numerics.py).
    assert_close_to_float64(got, want, want64, "flex decode attention")
    assert torch.equal(flex_k[0], gathered_k[0]) and torch.equal(flex_v[0], gathered_v[0])


@pytest.mark.gpu
def test_flex_decode_engine_on_cuda_matches_cpu():
    from model.args import PRESETS
    from model.qwen2 import build_model
    from rollout.engine import SamplingParams
    from rollout.torch_engine import TorchEngine

    args = PRESETS["tiny"].replace(init_std=0.2)
    prompts = [[5, 17, 42, 9, 100, 3, 77], [250], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13]]
    params = SamplingParams(max_new_tokens=12, temperature=0.0, n=2)
    cpu = TorchEngine(build_model(args, seed=15), max_batch_size=8, max_seq_len=256, block_size=128)
    flex = TorchEngine(
        build_model(args, seed=15), max_batch_size=8, max_seq_len=256, block_size=128, device="cuda", flex_decode=True
    )
    a, b = generate(cpu, prompts, params), generate(flex, prompts, params)
    assert [c.token_ids for c in a] == [c.token_ids for c in b]
    for x, y in zip(a, b):
        torch.testing.assert_close(torch.tensor(x.logprobs), torch.tensor(y.logprobs), rtol=0, atol=1e-4)
