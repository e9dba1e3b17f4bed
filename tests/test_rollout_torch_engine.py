"""TorchEngine: parity with transformers and with the trainer's log-probs, sampling, stops, bad input,
memory release, and in-place weight updates."""

import copy

import pytest
import torch
from numerics import assert_close_to_float64

from model.args import PRESETS
from model.hf_adapter import hf_config_from_args, to_hf_name
from model.logprob import token_logprobs
from model.qwen2 import build_model
from rollout.engine import Engine, SamplingParams
from rollout.sampling import truncate_logits
from rollout.torch_engine import TorchEngine
from run.guard import GuardedEngine
from tests.engines import generate
from tests.qwen2_checkpoint import hf_state_dict

# A larger init spread than the default 0.02 makes the tiny random model's next-token distributions
# peaked, so greedy decoding has clear winners (no near-ties for float noise to flip).
ARGS = PRESETS["tiny"].replace(init_std=0.2)
TIED_ARGS = PRESETS["tiny-tied"].replace(init_std=0.2)
PROMPTS = [[5, 17, 42, 9, 100, 3, 77], [250], [8, 8, 8, 60], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13]]


def _engine(args=ARGS, seed=0, **kw):
    kw.setdefault("max_batch_size", 8)
    kw.setdefault("max_seq_len", 64)
    return TorchEngine(build_model(args, seed=seed), **kw)


def _hf_model(model):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = hf_config_from_args(model.args)
    for key in ("architectures", "model_type", "torch_dtype"):
        config.pop(key)
    hf = Qwen2ForCausalLM(Qwen2Config(**config)).eval()
    hf.load_state_dict(hf_state_dict(model), strict=True)
    return hf


def _trainer_logprobs(model, prompt, tokens, temperature):
    """What the trainer computes: one forward over prompt + completion, chunked log-probs."""
    seq = torch.tensor([prompt + tokens])
    with torch.no_grad():
        hidden = model(seq, return_hidden=True)[0]
    targets = torch.tensor(tokens)
    logp, _ = token_logprobs(
        hidden[len(prompt) - 1 : -1], model.output_weight(), targets, temperature=temperature, with_entropy=False
    )
    return logp


def _assert_match_the_trainer(completions, model, temperature=1.0):
    """Each completion's log-probs are the trainer's for its tokens within fp32 rounding, measured against the
    trainer in float64 (tests/numerics.py): another order of the same sums (KV cache, batched decode)."""
    model64 = copy.deepcopy(model).double()
    got = [torch.tensor(c.logprobs) for c in completions]
    want = [_trainer_logprobs(model, PROMPTS[c.prompt_index], c.token_ids, temperature) for c in completions]
    want64 = [_trainer_logprobs(model64, PROMPTS[c.prompt_index], c.token_ids, temperature) for c in completions]
    assert_close_to_float64(got, want, want64, "engine log-probs")


def test_satisfies_the_engine_protocol():
    assert isinstance(_engine(), Engine)


def test_generates_by_itself_as_the_guard_drives_it():
    """A round without the guard (TorchEngine.generate: submit, poll until done, gather) returns what the guard's
    generate returns for the same seed: every sample, grouped by prompt."""
    params = SamplingParams(max_new_tokens=6, n=3, seed=11)
    alone = _engine(seed=4, poll_steps=1).generate(PROMPTS, params)
    guarded = GuardedEngine(_engine(seed=4, poll_steps=1)).generate(PROMPTS, params)
    assert [(c.prompt_index, c.sample_index) for c in alone] == [(p, s) for p in range(len(PROMPTS)) for s in range(3)]
    assert [(c.token_ids, c.logprobs, c.finish_reason) for c in alone] == [
        (c.token_ids, c.logprobs, c.finish_reason) for c in guarded
    ]


@pytest.mark.parametrize("args", [ARGS, TIED_ARGS], ids=["untied", "tied"])
def test_greedy_matches_transformers_generate(args):
    engine = _engine(args, seed=3, max_batch_size=4)
    hf = _hf_model(build_model(args, seed=3))
    completions = generate(engine, PROMPTS, SamplingParams(max_new_tokens=12, temperature=0.0))
    assert [c.prompt_index for c in completions] == [0, 1, 2, 3]
    for prompt, completion in zip(PROMPTS, completions):
        with torch.no_grad():
            out = hf.generate(
                torch.tensor([prompt]),
                do_sample=False,
                max_new_tokens=12,
                min_new_tokens=12,
                pad_token_id=0,
                eos_token_id=None,
            )
        assert completion.token_ids == out[0, len(prompt) :].tolist()
        assert completion.finish_reason == "length"


@pytest.mark.parametrize("temperature,top_p,top_k", [(0.0, 1.0, -1), (1.0, 1.0, -1), (0.7, 0.9, 20)])
def test_logprobs_match_the_trainer(temperature, top_p, top_k):
    engine = _engine(seed=1, max_batch_size=5)  # fewer slots than requests: slots get refilled
    reference = build_model(ARGS, seed=1)
    params = SamplingParams(max_new_tokens=10, temperature=temperature, top_p=top_p, top_k=top_k, n=3, seed=11)
    completions = generate(engine, PROMPTS, params)
    assert len(completions) == 12
    _assert_match_the_trainer(completions, reference, temperature or 1.0)


def _hf_greedy(hf, prompt, new_tokens):
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([prompt]),
            do_sample=False,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            pad_token_id=0,
            eos_token_id=None,
        )
    return out[0, len(prompt) :].tolist()


def test_n_samples_share_prompt_blocks_and_match_transformers():
    """13-token prompt, blocks of 4: 3 full prompt blocks shared by the 3 samples plus one own block each
    is 6 blocks; unshared copies would need 12. With 6 blocks all three run together, never preempted."""
    prompt = PROMPTS[3]
    engine = _engine(seed=3, max_seq_len=16, block_size=4, kv_cache_blocks=6)
    completions = generate(engine, [prompt], SamplingParams(max_new_tokens=3, temperature=0.0, n=3))
    assert engine.stats.peak_running == 3 and engine.stats.preemptions == 0
    want = _hf_greedy(_hf_model(build_model(ARGS, seed=3)), prompt, 3)
    assert [c.token_ids for c in completions] == [want] * 3


@pytest.mark.parametrize("block_size", [4, 16])
def test_greedy_with_shared_blocks_matches_transformers_for_every_sample(block_size):
    engine = _engine(seed=3, block_size=block_size)
    hf = _hf_model(build_model(ARGS, seed=3))
    completions = generate(engine, PROMPTS, SamplingParams(max_new_tokens=12, temperature=0.0, n=3))
    for c in completions:
        assert c.token_ids == _hf_greedy(hf, PROMPTS[c.prompt_index], 12), (c.prompt_index, c.sample_index)


def test_preemption_leaves_greedy_outputs_and_logprobs_unchanged():
    """A block budget of one full-length sequence plus one block forces preemption and recompute."""
    params = SamplingParams(max_new_tokens=14, temperature=0.0, n=2)
    tight = _engine(seed=16, max_seq_len=32, block_size=4, kv_cache_blocks=9)
    roomy = _engine(seed=16, max_seq_len=32, block_size=4)
    preempted, free = generate(tight, PROMPTS, params), generate(roomy, PROMPTS, params)
    assert tight.stats.preemptions > 0 and roomy.stats.preemptions == 0
    hf = _hf_model(build_model(ARGS, seed=16))
    reference = build_model(ARGS, seed=16)
    for c, f in zip(preempted, free):
        assert c.token_ids == f.token_ids == _hf_greedy(hf, PROMPTS[c.prompt_index], 14)
    _assert_match_the_trainer(preempted, reference)


def test_sampled_logprobs_match_the_trainer_after_preemption():
    engine = _engine(seed=17, max_seq_len=32, block_size=4, kv_cache_blocks=10)
    reference = build_model(ARGS, seed=17)
    params = SamplingParams(max_new_tokens=16, temperature=0.9, top_p=0.95, n=3, seed=2)
    completions = generate(engine, PROMPTS, params)
    assert engine.stats.preemptions > 0
    for c in completions:
        assert c.finish_reason == "length" and len(c.token_ids) == min(16, 32 - len(PROMPTS[c.prompt_index]))
    _assert_match_the_trainer(completions, reference, 0.9)
    again = generate(_engine(seed=17, max_seq_len=32, block_size=4, kv_cache_blocks=10), PROMPTS, params)
    assert [c.token_ids for c in again] == [c.token_ids for c in completions]  # seeded: reproducible


def test_samples_stay_inside_top_k_and_nucleus_of_the_true_distribution():
    engine = _engine(seed=2)
    reference = build_model(ARGS, seed=2)
    params = SamplingParams(max_new_tokens=8, temperature=1.3, top_p=0.7, top_k=30, n=4, seed=0)
    for c in generate(engine, PROMPTS[:2], params):
        seq = PROMPTS[c.prompt_index] + c.token_ids
        with torch.no_grad():
            logits = reference(torch.tensor([seq]))[0, len(PROMPTS[c.prompt_index]) - 1 : -1]
        allowed = torch.isfinite(truncate_logits(logits / 1.3, 30, 0.7))
        assert allowed[torch.arange(len(c.token_ids)), torch.tensor(c.token_ids)].all()


def test_n_samples_grouped_by_prompt_and_distinct():
    engine = _engine(seed=4)
    completions = generate(engine, PROMPTS[:3], SamplingParams(max_new_tokens=6, n=4, seed=5))
    assert [(c.prompt_index, c.sample_index) for c in completions] == [(p, s) for p in range(3) for s in range(4)]
    for p in range(3):
        group = [tuple(c.token_ids) for c in completions if c.prompt_index == p]
        assert len(set(group)) > 1  # samples of one prompt are independent draws, not copies


def test_top_k_one_is_greedy():
    engine = _engine(seed=5)
    greedy = generate(engine, PROMPTS, SamplingParams(max_new_tokens=8, temperature=0.0))
    top1 = generate(engine, PROMPTS, SamplingParams(max_new_tokens=8, temperature=1.0, top_k=1, seed=9))
    assert [c.token_ids for c in greedy] == [c.token_ids for c in top1]


def test_fixed_seed_reproduces_across_slot_counts():
    params = SamplingParams(max_new_tokens=8, n=2, seed=123)
    a = generate(_engine(seed=6, max_batch_size=8), PROMPTS, params)
    b = generate(_engine(seed=6, max_batch_size=8), PROMPTS, params)
    c = generate(_engine(seed=6, max_batch_size=8), PROMPTS, SamplingParams(max_new_tokens=8, n=2, seed=124))
    assert [x.token_ids for x in a] == [x.token_ids for x in b]
    assert [x.token_ids for x in a] != [x.token_ids for x in c]


def test_greedy_is_independent_of_batching():
    """One slot (every request alone) and many slots (all together, refilled) give the same tokens."""
    params = SamplingParams(max_new_tokens=9, temperature=0.0, n=2)
    alone = generate(_engine(seed=7, max_batch_size=1), PROMPTS, params)
    batched = generate(_engine(seed=7, max_batch_size=3, max_prefill_tokens=16), PROMPTS, params)
    assert [c.token_ids for c in alone] == [c.token_ids for c in batched]
    _assert_match_the_trainer(alone, build_model(ARGS, seed=7))
    _assert_match_the_trainer(batched, build_model(ARGS, seed=7))


def test_stop_token_is_kept_and_ends_the_request():
    engine = _engine(seed=8)
    free = generate(engine, PROMPTS, SamplingParams(max_new_tokens=10, temperature=0.0))
    # Stop on the 4th greedy token of prompt 0: that request must end right there, keeping the token.
    stop = free[0].token_ids[3]
    stopped = generate(engine, PROMPTS, SamplingParams(max_new_tokens=10, temperature=0.0, stop_token_ids=[stop]))
    for f, s in zip(free, stopped):
        if stop in f.token_ids:
            cut = f.token_ids.index(stop) + 1
            assert s.token_ids == f.token_ids[:cut] and s.finish_reason == "stop"
        else:
            assert s.token_ids == f.token_ids and s.finish_reason == "length"
    assert stopped[0].finish_reason == "stop" and len(stopped[0].token_ids) <= 4
    _assert_match_the_trainer(stopped, build_model(ARGS, seed=8))  # the kept log-probs are the tokens' own


def test_length_finish_at_max_new_tokens_and_at_the_context_end():
    engine = _engine(seed=9, max_seq_len=16)
    prompts = [[1, 2, 3], list(range(1, 14)), list(range(1, 16))]  # 3, 13 and 15 tokens of 16
    completions = generate(engine, prompts, SamplingParams(max_new_tokens=5, temperature=0.0))
    assert [len(c.token_ids) for c in completions] == [5, 3, 1]
    assert all(c.finish_reason == "length" for c in completions)


def test_bad_input_is_refused():
    engine = _engine(max_seq_len=16)
    params = SamplingParams(max_new_tokens=4)
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        engine.submit([[1, 2], []], params)
    with pytest.raises(ValueError, match="prompt 0 has 16 tokens, longer than the engine's context"):
        engine.submit([list(range(16))], params)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.submit([[1, 256]], params)
    with pytest.raises(TypeError, match="SamplingParams"):
        engine.submit([[1]], {"max_new_tokens": 4})
    assert generate(engine, [], params) == []  # a rank without prompts takes part in a round, with nothing to do
    engine.submit([[1]], params)
    with pytest.raises(RuntimeError, match="submit\\(\\) while submitted samples are in flight"):
        engine.submit([[2]], params)
    with pytest.raises(ValueError, match="max_seq_len"):
        _engine(max_seq_len=ARGS.max_position_embeddings + 1)
    with pytest.raises(ValueError, match="kv_cache_blocks = 3 cannot hold one sequence of max_seq_len = 16"):
        _engine(max_seq_len=16, block_size=4, kv_cache_blocks=3)
    with pytest.raises(ValueError, match="block_size must be >= 1"):
        _engine(block_size=0)


def test_release_and_resume_memory():
    engine = _engine(seed=10)
    before = generate(engine, PROMPTS, SamplingParams(max_new_tokens=5, temperature=0.0))
    engine.release_memory()
    assert engine._cache is None
    with pytest.raises(RuntimeError, match="resume_memory"):
        engine.submit(PROMPTS, SamplingParams(max_new_tokens=5))
    engine.resume_memory()
    after = generate(engine, PROMPTS, SamplingParams(max_new_tokens=5, temperature=0.0))
    assert [c.token_ids for c in before] == [c.token_ids for c in after]


@pytest.mark.parametrize("args", [ARGS, TIED_ARGS], ids=["untied", "tied"])
def test_update_weights_in_place(args):
    engine = _engine(args, seed=11)
    pointers = {n: p.data_ptr() for n, p in engine.model.named_parameters()}
    new = build_model(args, seed=12)
    named = [(to_hf_name(n), p.detach().clone()) for n, p in new.named_parameters()]
    for i in range(0, len(named), 5):  # several buckets
        engine.update_weights(named[i : i + 5])
    assert {n: p.data_ptr() for n, p in engine.model.named_parameters()} == pointers
    for (n, p), (_, q) in zip(engine.model.named_parameters(), new.named_parameters()):
        assert torch.equal(p, q), n
    fresh = _engine(args, seed=12)
    params = SamplingParams(max_new_tokens=8, temperature=0.0)
    updated, expected = generate(engine, PROMPTS, params), generate(fresh, PROMPTS, params)
    assert [c.token_ids for c in updated] == [c.token_ids for c in expected]
    _assert_match_the_trainer(updated, new)


def test_bad_bucket_changes_nothing():
    engine = _engine(seed=13)
    snapshot = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    good = ("model.norm.weight", torch.full((ARGS.hidden_size,), 2.0))
    q = engine.model.layers["0"].self_attn.q_proj.weight
    bad_buckets = {
        "unknown weight 'model.layers.9.mlp.up_proj.weight'": [
            good,
            ("model.layers.9.mlp.up_proj.weight", torch.zeros(1)),
        ],
        "has shape": [good, ("model.layers.0.self_attn.q_proj.weight", torch.zeros(q.shape[0], q.shape[1] + 1))],
        "has dtype": [good, ("model.layers.0.self_attn.q_proj.weight", torch.zeros(q.shape, dtype=torch.float64))],
        "appears twice": [good, good],
    }
    for message, bucket in bad_buckets.items():
        with pytest.raises((KeyError, ValueError), match=message):
            engine.update_weights(bucket)
        for n, p in engine.model.named_parameters():
            assert torch.equal(p, snapshot[n]), (message, n)
    tied = _engine(TIED_ARGS)
    with pytest.raises(KeyError, match="unknown weight 'lm_head.weight'"):
        tied.update_weights([("lm_head.weight", torch.zeros(256, 64))])


@pytest.mark.slow
def test_compiled_decode_matches_eager():
    params = SamplingParams(max_new_tokens=12, temperature=0.8, n=2, seed=3)
    eager = generate(_engine(seed=14, max_batch_size=3), PROMPTS, params)
    compiled = generate(_engine(seed=14, max_batch_size=3, compile=True), PROMPTS, params)
    assert [c.token_ids for c in eager] == [c.token_ids for c in compiled]
    _assert_match_the_trainer(compiled, build_model(ARGS, seed=14), 0.8)


@pytest.mark.gpu
def test_cuda_engine_matches_cpu_and_compiled_cuda_graphs():
    params = SamplingParams(max_new_tokens=12, temperature=0.0, n=2)
    cpu = generate(_engine(seed=15), PROMPTS, params)
    cuda = generate(_engine(seed=15, device="cuda"), PROMPTS, params)
    graphs = generate(_engine(seed=15, device="cuda", compile=True), PROMPTS, params)
    assert [c.token_ids for c in cpu] == [c.token_ids for c in cuda] == [c.token_ids for c in graphs]
    for x, y in zip(cpu, graphs):
        torch.testing.assert_close(torch.tensor(x.logprobs), torch.tensor(y.logprobs), rtol=0, atol=1e-4)
