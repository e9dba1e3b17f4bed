"""Partial rollout on the torch engine (rollout/engine.py PartialEngine): groups submitted, heard of as they
finish, the rest stopped with their tokens and log-probs, and continued later, losslessly, under the same or
newer weights."""

import copy
import dataclasses

import pytest
import torch
from numerics import assert_close_to_float64
from test_rollout_torch_engine import ARGS, PROMPTS, _assert_match_the_trainer, _engine, _trainer_logprobs

from model.hf_adapter import to_hf_name
from model.qwen2 import build_model
from rollout.engine import Completion, GroupRequest, PartialEngine, SamplingParams
from rollout.torch_engine import TorchEngine


def _groups(prompts=PROMPTS):
    return [GroupRequest(p, prompt) for p, prompt in enumerate(prompts)]


def _regroup(completions, prompts=PROMPTS):
    """The groups stop() returned, ready to be submitted again."""
    keys = sorted({c.prompt_index for c in completions})
    return [GroupRequest(k, prompts[k], [c for c in completions if c.prompt_index == k]) for k in keys]


def _order(completions):
    return sorted(completions, key=lambda c: (c.prompt_index, c.sample_index))


def _finish(engine, groups, params):
    """Submit the groups and poll until every one has come back."""
    engine.submit(groups, params)
    out = []
    while len(out) < len(groups) * params.n:
        out += engine.poll()
    return _order(out)


def _all_blocks_free(engine):
    return engine.blocks.num_free == engine.kv_cache_blocks and not any(engine.blocks.ref_count)


def test_satisfies_the_partial_engine_protocol():
    assert isinstance(_engine(), PartialEngine)


def test_a_stopped_greedy_sample_continues_to_the_uninterrupted_one():
    """Stopped after 5 scheduler steps (6 tokens of 14) and continued under the same weights, every greedy
    sample ends as the uninterrupted run's: the same tokens, the finish reason, the trainer's log-probs."""
    params = SamplingParams(max_new_tokens=14, temperature=0.0, n=2)
    whole = _engine(seed=3).generate(PROMPTS, params)
    engine = _engine(seed=3, poll_steps=5)
    engine.submit(_groups(), params)
    assert engine.poll() == []  # no group finished within the slice
    stopped = _order(engine.stop())
    assert _all_blocks_free(engine)
    for s, w in zip(stopped, whole):
        assert s.finish_reason == "abort" and len(s.token_ids) == 6 and s.token_ids == w.token_ids[:6]
    continued = _finish(engine, _regroup(stopped), params)
    assert [(c.token_ids, c.finish_reason) for c in continued] == [(w.token_ids, w.finish_reason) for w in whole]
    for c, s in zip(continued, stopped):
        assert c.logprobs[:6] == s.logprobs  # the stopped part is kept as it was
    _assert_match_the_trainer(continued, build_model(ARGS, seed=3), 1.0)


def test_groups_are_heard_of_as_they_finish_and_whole():
    """With prompt 0's 3rd greedy token a stop token, its group (both samples) finishes first and comes back
    alone, complete, while the others still run; stop() then returns only the others."""
    free = _engine(seed=8).generate(PROMPTS, SamplingParams(max_new_tokens=10, temperature=0.0))
    stop = free[0].token_ids[2]
    assert all(stop not in c.token_ids[:5] for c in free[1:])
    params = SamplingParams(max_new_tokens=10, temperature=0.0, n=2, stop_token_ids=[stop])
    engine = _engine(seed=8, poll_steps=4)
    engine.submit(_groups(), params)
    first = engine.poll()
    assert [(c.prompt_index, c.sample_index) for c in first] == [(0, 0), (0, 1)]
    assert all(c.finish_reason == "stop" and c.token_ids == free[0].token_ids[:3] for c in first)
    rest = engine.stop()
    assert sorted({c.prompt_index for c in rest}) == [1, 2, 3] and all(c.finish_reason == "abort" for c in rest)
    assert engine.poll() == [] and engine.stop() == []  # nothing in flight


def test_a_continued_sample_takes_each_tokens_log_prob_from_the_weights_that_sampled_it():
    """Sampled under weights A, stopped, continued under weights B: the tokens before the stop keep A's
    log-probs, the continuation's (its first token included) are B's as the trainer recomputes them over
    prompt + all tokens, within fp32 rounding measured against float64."""
    old, new = build_model(ARGS, seed=5), build_model(ARGS, seed=6)
    params = SamplingParams(max_new_tokens=12, temperature=1.0, n=2, seed=4)
    engine = TorchEngine(copy.deepcopy(old), max_batch_size=8, max_seq_len=64, poll_steps=4)
    engine.submit(_groups(), params)
    assert engine.poll() == []
    stopped = _order(engine.stop())
    engine.update_weights([(to_hf_name(n), p.detach()) for n, p in new.named_parameters()])
    continued = _finish(engine, _regroup(stopped), dataclasses.replace(params, seed=5))
    got, want, want64, stale = {"A": [], "B": []}, {"A": [], "B": []}, {"A": [], "B": []}, []
    for c, s in zip(continued, stopped):
        k, prompt = len(s.token_ids), PROMPTS[c.prompt_index]
        assert c.token_ids[:k] == s.token_ids and c.logprobs[:k] == s.logprobs and k < len(c.token_ids) <= 12
        for name, model, part in (("A", old, slice(0, k)), ("B", new, slice(k, None))):
            got[name].append(torch.tensor(c.logprobs[part]))
            want[name].append(_trainer_logprobs(model, prompt, c.token_ids, 1.0)[part])
            want64[name].append(_trainer_logprobs(copy.deepcopy(model).double(), prompt, c.token_ids, 1.0)[part])
        stale.append(_trainer_logprobs(old, prompt, c.token_ids, 1.0)[k:])
    assert_close_to_float64(got["A"], want["A"], want64["A"], "log-probs before the stop, weights A")
    assert_close_to_float64(got["B"], want["B"], want64["B"], "log-probs of the continuation, weights B")
    assert max((g - w).abs().max().item() for g, w in zip(got["B"], stale)) > 0.1  # not A's


def test_a_continuation_keeps_within_the_budget_and_ends_for_the_right_reason():
    """A 24-token context leaves the 13-token prompt a budget of 11 of the 20 asked; 1 in 16 token ids stops.
    Stopped and continued samples end at a stop token (its only one, kept) or at exactly their budget."""
    stops = tuple(range(0, 256, 16))
    params = SamplingParams(max_new_tokens=20, temperature=1.0, n=4, seed=1, stop_token_ids=stops)
    engine = _engine(seed=11, max_seq_len=24, poll_steps=3)
    engine.submit(_groups(), params)
    polled = engine.poll()
    stopped = engine.stop()
    assert any(c.finish_reason == "abort" and c.token_ids for c in stopped)  # continued from a few tokens
    continued = polled + _finish(engine, _regroup(stopped), params)
    reasons = set()
    for c in continued:
        budget = min(20, 24 - len(PROMPTS[c.prompt_index]))
        assert 1 <= len(c.token_ids) == len(c.logprobs) <= budget
        assert not set(c.token_ids[:-1]) & set(stops)
        want = "stop" if c.token_ids[-1] in stops else "length"
        assert c.finish_reason == want and (want == "stop" or len(c.token_ids) == budget)
        reasons.add(c.finish_reason)
    assert reasons == {"stop", "length"}
    _assert_match_the_trainer(continued, build_model(ARGS, seed=11), 1.0)


def test_stop_frees_every_kv_block_also_of_preempted_samples():
    """A cache of one full sequence plus one block preempts; after the stop every block is free, and the
    samples (running, preempted or waiting when stopped) continue to the uninterrupted greedy run."""
    params = SamplingParams(max_new_tokens=14, temperature=0.0, n=2)
    whole = _engine(seed=16, max_seq_len=32, block_size=4).generate(PROMPTS, params)
    engine = _engine(seed=16, max_seq_len=32, block_size=4, kv_cache_blocks=9, poll_steps=7)
    engine.submit(_groups(), params)
    assert engine.poll() == []
    stopped = engine.stop()
    assert engine.stats.preemptions > 0 and _all_blocks_free(engine)
    assert any(c.token_ids == [] for c in stopped) and any(c.token_ids for c in stopped)
    continued = _finish(engine, _regroup(stopped), params)
    assert [c.token_ids for c in continued] == [w.token_ids for w in whole]
    assert _all_blocks_free(engine)


def test_groups_join_while_others_run_and_finished_groups_pass_through():
    params = SamplingParams(max_new_tokens=6, temperature=0.0, n=2)
    whole = _engine(seed=2).generate(PROMPTS, params)
    engine = _engine(seed=2, poll_steps=2)
    engine.submit(_groups()[:2], params)
    assert engine.poll() == []
    done = [Completion(9, s, [7, 8], [-0.5, -0.25], "length") for s in range(2)]
    engine.submit(_groups()[2:] + [GroupRequest(9, [1, 2], done)], params)
    assert engine.poll() == done  # a group whose samples all finished comes back as it came, at the next poll
    out = _order(_drain(engine, 4 * 2))
    assert [c.token_ids for c in out] == [w.token_ids for w in whole]


def _drain(engine, samples):
    out = []
    while len(out) < samples:
        out += engine.poll()
    return out


def test_refusals_leave_the_engine_as_it_was():
    params = SamplingParams(max_new_tokens=6, n=2, seed=0)
    engine = _engine(seed=1)
    with pytest.raises(ValueError, match="1 samples for n = 2"):
        engine.submit([GroupRequest(0, [1, 2], [Completion(0, 0, [3], [-1.0], "abort")])], params)
    with pytest.raises(ValueError, match="no budget left"):
        full = [Completion(0, s, [3] * 6, [-1.0] * 6, "abort") for s in range(2)]
        engine.submit([GroupRequest(0, [1, 2], full)], params)
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        engine.submit([GroupRequest(0, [1, 2]), GroupRequest(1, [])], params)
    assert engine.poll() == [] and engine.stop() == []  # nothing was queued
    engine.submit(_groups(), params)
    with pytest.raises(ValueError, match="already in flight"):
        engine.submit([GroupRequest(0, [5])], params)
    with pytest.raises(ValueError, match="while groups sampled with"):
        engine.submit([GroupRequest(7, [5])], dataclasses.replace(params, temperature=0.5))
    engine.submit([GroupRequest(7, [5])], dataclasses.replace(params, seed=99))  # only the seed differs: joins
    for call in (
        lambda: engine.generate([[1]], params),
        lambda: engine.update_weights([]),
        engine.release_memory,
    ):
        with pytest.raises(RuntimeError, match="in flight; stop"):
            call()
    assert len(engine.stop()) == 5 * 2
    engine.release_memory()
    with pytest.raises(RuntimeError, match="resume_memory"):
        engine.submit(_groups(), params)


def test_a_seeded_round_with_a_stop_reproduces():
    def run():
        engine = _engine(seed=4, poll_steps=3)
        params = SamplingParams(max_new_tokens=9, n=3, seed=21)
        engine.submit(_groups(), params)
        engine.poll()
        stopped = engine.stop()
        return [(c.token_ids, c.logprobs) for c in _finish(engine, _regroup(stopped), params)]

    assert run() == run()
