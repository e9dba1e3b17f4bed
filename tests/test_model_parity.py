"""Our Qwen2 vs transformers.Qwen2ForCausalLM (eager attention) in fp32 on random weights: equal within fp32
rounding, measured against transformers' model in float64 (tests/numerics.py)."""

import copy

import pytest
import torch
from numerics import assert_close_to_float64

from model.args import ModelArgs
from model.hf_adapter import hf_config_from_args, to_hf_name
from model.logprob import token_logprobs
from model.qwen2 import Qwen2

# (heads, kv heads): MHA, GQA 2:1, MQA 8:1; two eps values; tied and untied; RoPE bases 1e6 and 1e4.
CASES = [
    dict(num_heads=4, num_kv_heads=4, rms_norm_eps=1e-6, tie_word_embeddings=False, rope_theta=1e6),
    dict(num_heads=4, num_kv_heads=2, rms_norm_eps=1e-5, tie_word_embeddings=True, rope_theta=1e6),
    dict(num_heads=8, num_kv_heads=1, rms_norm_eps=1e-6, tie_word_embeddings=True, rope_theta=1e4),
    dict(num_heads=8, num_kv_heads=2, rms_norm_eps=1e-2, tie_word_embeddings=False, rope_theta=1e6),
]


def _pair(case, seed=0):
    """HF model with every parameter random (norm weights and biases too), and ours with its weights."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    args = ModelArgs(
        vocab_size=200, hidden_size=64, num_layers=2, intermediate_size=96, max_position_embeddings=256, **case
    )
    config = Qwen2Config(
        **{k: v for k, v in hf_config_from_args(args).items() if k != "architectures"}, attn_implementation="eager"
    )
    torch.manual_seed(seed)
    hf = Qwen2ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.1)
    ours = Qwen2(args).eval()
    hf_state = hf.state_dict()
    ours.load_state_dict({n: hf_state[to_hf_name(n)].clone() for n, _ in ours.named_parameters()}, strict=True)
    return args, hf, ours


def _max_err(a, b):
    return (a - b).abs().max().item()


@pytest.mark.parametrize(
    "case",
    CASES,
    ids=lambda c: (
        f"h{c['num_heads']}kv{c['num_kv_heads']}-eps{c['rms_norm_eps']:g}-"
        f"{'tied' if c['tie_word_embeddings'] else 'untied'}"
    ),
)
def test_logits_match_transformers(case):
    args, hf, ours = _pair(case)
    if args.tie_word_embeddings:
        assert ours.lm_head is None and hf.lm_head.weight is hf.model.embed_tokens.weight
    tokens = torch.randint(0, args.vocab_size, (3, 21), generator=torch.Generator().manual_seed(1))
    # Explicit positions with a jump (0..9, then 40..50): relative distances change, so RoPE must use the given
    # positions, not the token index.
    positions = torch.cat([torch.arange(0, 10), torch.arange(40, 51)]).expand(3, -1)
    hf64 = copy.deepcopy(hf).double()
    with torch.no_grad():
        want, want64, got = hf(tokens).logits, hf64(tokens).logits, ours(tokens)
        want_shift, got_shift = hf(tokens, position_ids=positions).logits, ours(tokens, positions=positions)
        want_shift64 = hf64(tokens, position_ids=positions).logits
    assert got.shape == (3, 21, args.vocab_size)
    print(f"max |logits - HF| = {_max_err(got, want):.2e} (default), {_max_err(got_shift, want_shift):.2e} (jump)")
    assert_close_to_float64([got, got_shift], [want, want_shift], [want64, want_shift64], "logits")
    assert _max_err(want[:, 10:], want_shift[:, 10:]) > 1e-2  # the jump really changes the output


def test_hidden_states_and_logprobs_match_transformers():
    args, hf, ours = _pair(CASES[1], seed=3)
    tokens = torch.randint(0, args.vocab_size, (2, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        hf_out, hf_out64 = (
            hf(tokens, output_hidden_states=True),
            copy.deepcopy(hf).double()(tokens, output_hidden_states=True),
        )
        hidden = ours(tokens, return_hidden=True)
        logp, _ = token_logprobs(hidden[:, :-1], ours.output_weight(), tokens[:, 1:], chunk_size=5)

    def hf_logp(out):
        return out.logits[:, :-1].log_softmax(-1).gather(-1, tokens[:, 1:, None]).squeeze(-1)

    # HF's last hidden state is after the final norm.
    assert_close_to_float64(hidden, hf_out.hidden_states[-1], hf_out64.hidden_states[-1], "hidden states")
    assert_close_to_float64(logp, hf_logp(hf_out), hf_logp(hf_out64), "log-probs")


def test_gradients_match_transformers():
    args, hf, ours = _pair(CASES[2], seed=4)
    tokens = torch.randint(0, args.vocab_size, (2, 12), generator=torch.Generator().manual_seed(5))
    hf64 = copy.deepcopy(hf).double()
    for model in (hf, hf64):
        model(tokens).logits.log_softmax(-1)[..., 7].sum().backward()
    ours(tokens).log_softmax(-1)[..., 7].sum().backward()
    names = [n for n, _ in ours.named_parameters()]
    hf_grads = [dict(hf.named_parameters())[to_hf_name(n)].grad for n in names]
    hf_grads64 = [dict(hf64.named_parameters())[to_hf_name(n)].grad for n in names]
    got = [p.grad for p in ours.parameters()]
    print(f"max |grad - HF grad| = {max(_max_err(g, w) for g, w in zip(got, hf_grads)):.2e}")
    assert_close_to_float64(got, hf_grads, hf_grads64, "gradients")


def test_a_float64_model_keeps_float64_in_the_norm_and_the_rotary_embedding():
    # The suite's float64 references (tests/numerics.py) need float64 throughout: the fp32 statistic of RMSNorm
    # and the fp32 rotation are "at least fp32", never a cast down.
    from model.qwen2 import RMSNorm, _rotate_half, apply_rotary, rotary_cos_sin

    gen = torch.Generator().manual_seed(0)
    x = (1 + torch.rand(2, 3, 64, generator=gen, dtype=torch.float64) / 3) * (1 + 2**-30)  # not fp32-representable
    norm = RMSNorm(64, eps=1e-6).double()
    want = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    assert (norm(x) - want).abs().max().item() <= 8 * torch.finfo(torch.float64).eps * want.abs().max().item()
    heads = x.view(2, 3, 4, 16).transpose(1, 2)  # [B, H, T, D]
    cos, sin = rotary_cos_sin(torch.arange(3).expand(2, 3), 16, 1e4)
    rotated = heads * cos.unsqueeze(1) + _rotate_half(heads) * sin.unsqueeze(1)
    assert (apply_rotary(heads, cos, sin) - rotated).abs().max().item() <= 8 * torch.finfo(torch.float64).eps * 2
