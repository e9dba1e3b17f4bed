"""Partial rollout on the SGLang engine (rollout/sglang_engine.py submit / poll / stop over
rollout/sglang_groups.py) against the strict model of sglang 0.5.21 (tests/sglang_model.py, "Background
requests"): in this process, in the engine's own process, and on two gloo ranks sharing one engine. The model's
tokens follow t' = (7 t + 3) % 256 from the input's last token, so a sample stopped and continued must come out
as the uninterrupted one: tokens and log-probs joined without a gap or a repeat."""

import dataclasses
import functools
import time

import pytest
import torch
from dist_utils import run_ranks
from sglang_model import InThisProcess, StrictSGLang, flatten_bucket, serialize
from test_rollout_sglang import Crashed, crashes  # noqa: F401  (crashes: its autouse fixture, here too)

from model.args import PRESETS
from model.hf import save_hf
from model.hf_adapter import to_hf_name
from model.qwen2 import build_model
from rollout.engine import Completion, GroupRequest, PartialEngine, SamplingParams
from rollout.sglang_engine import SGLangEngine, context_length_for
from rollout.sglang_groups import GroupRunner, with_groups


@pytest.fixture
def checkpoint(tmp_path):
    save_hf(build_model(PRESETS["tiny"], seed=0), str(tmp_path))
    return str(tmp_path)


def chain(last, count):
    """The strict model's tokens and log-probs after a last input token."""
    tokens = []
    for _ in range(count):
        last = (7 * last + 3) % 256
        tokens.append(last)
    return tokens, [-((t % 5) + 1) / 10 for t in tokens]


def engine_class(**model_options):
    """SGLangEngine over the strict model hosted in this process, wrapped as the engine process wraps it."""

    class Engine(SGLangEngine):
        def _launch(self, **kwargs):
            return InThisProcess(GroupRunner(StrictSGLang(**model_options, **kwargs)))

        def _flatten_bucket(self, bucket):
            return flatten_bucket(bucket)

        def _serialize(self, payload):
            return serialize(payload)

    return Engine


def model(engine):
    """The strict model inside an engine of `engine_class`."""
    return engine._engine.engine.engine


def _order(completions):
    return sorted(completions, key=lambda c: (c.prompt_index, c.sample_index))


def _regroup(completions, prompts):
    keys = sorted({c.prompt_index for c in completions})
    return [GroupRequest(k, prompts[k], [c for c in completions if c.prompt_index == k]) for k in keys]


def _drain(engine, samples):
    out = []
    while len(out) < samples:
        out += engine.poll()
    return _order(out)


PROMPTS = {0: [5, 1], 1: [9, 20], 2: [3]}  # keys need not be 0..n-1


def test_groups_finish_one_by_one_and_stopped_ones_continue_losslessly(checkpoint):
    """Group 0 stops at its 2nd token (a stop id) and comes back alone, whole; the others are stopped and
    continued, ending as the uninterrupted chain of 40 tokens, log-probs and all."""
    engine = engine_class(tick_s=0.002)(checkpoint, dtype=torch.float32, poll_s=0.05)
    assert isinstance(engine, PartialEngine)
    stops = (chain(1, 2)[0][1],)  # prompt 0's 2nd token; never in the other chains' first 40
    assert all(stops[0] not in chain(p[-1], 40)[0] for k, p in PROMPTS.items() if k)
    params = SamplingParams(max_new_tokens=40, n=2, stop_token_ids=stops)
    engine.submit([GroupRequest(k, p) for k, p in PROMPTS.items()], params)
    first = []
    while not first:
        first = engine.poll()
    assert [(c.prompt_index, c.finish_reason, c.token_ids) for c in first] == [(0, "stop", chain(1, 2)[0])] * 2
    stopped = _order(engine.stop())
    assert {c.prompt_index for c in stopped} == {1, 2}
    assert all(c.finish_reason == "abort" and 0 < len(c.token_ids) < 40 for c in stopped)
    assert engine._engine.running == 0  # every request is back: the scheduler is idle
    engine.submit(_regroup(stopped, PROMPTS), params)
    done = _drain(engine, 4)
    for c in done:
        tokens, logprobs = chain(PROMPTS[c.prompt_index][-1], 40)
        assert (c.token_ids, c.logprobs, c.finish_reason) == (tokens, logprobs, "length")
    calls = engine._engine.calls
    assert calls.count("async_generate") == 3 + 2 and "abort" in calls and "generate" not in calls


def test_an_abort_that_lands_on_the_budgets_last_token_or_a_stop_token_finishes_the_sample(checkpoint):
    """The scheduler stalls after 4 steps; the abort's own decode step adds a 5th token, with finish reason
    "abort" from SGLang. With a budget of 5 that sample has finished ("length"), and so has one whose 5th token
    is a stop id ("stop"): continuing either would exceed its budget or run past its end."""
    fifth = chain(3, 5)[0][4]
    engine = engine_class(stall_after=4)(checkpoint, dtype=torch.float32, poll_s=0.05)
    for params, reason in (
        (SamplingParams(max_new_tokens=5), "length"),
        (SamplingParams(max_new_tokens=9, stop_token_ids=(fifth,)), "stop"),
        (SamplingParams(max_new_tokens=9), "abort"),
    ):
        model(engine).steps = 0
        engine.submit([GroupRequest(0, [3])], params)
        assert engine.poll() == []
        (c,) = engine.stop()
        assert (c.token_ids, c.finish_reason) == (chain(3, 5)[0], reason)


def test_waiting_requests_come_back_without_tokens_and_start_over(checkpoint):
    """With 2 requests running at once, the other 4 are waiting when stopped: "Abort in waiting queue", none of
    their tokens. Continued, they start from their prompt."""
    engine = engine_class(max_running=2, stall_after=3)(checkpoint, dtype=torch.float32, poll_s=0.05)
    params = SamplingParams(max_new_tokens=8, n=2)
    engine.submit([GroupRequest(k, p) for k, p in PROMPTS.items()], params)
    assert engine.poll() == []
    stopped = _order(engine.stop())
    assert [len(c.token_ids) for c in stopped] == [4, 4, 0, 0, 0, 0]
    assert all(c.finish_reason == "abort" for c in stopped)
    model(engine).stall_after = None
    done = _drain_after_submit(engine, _regroup(stopped, PROMPTS), params)
    assert all(c.token_ids == chain(PROMPTS[c.prompt_index][-1], 8)[0] for c in done)


def _drain_after_submit(engine, groups, params):
    engine.submit(groups, params)
    return _drain(engine, len(groups) * params.n)


def test_a_group_submitted_just_before_stop_is_stopped_too(checkpoint):
    """An abort reaches only the requests the scheduler holds: the first one stop() sends finds none of a group
    submitted a moment before (its batch has not run yet). stop() sends it again until every group is back, so
    the group ends within seconds, not after its 200 steps of 50 ms."""
    engine = engine_class(tick_s=0.05)(checkpoint, dtype=torch.float32)
    engine.submit([GroupRequest(0, [3])], SamplingParams(max_new_tokens=200))
    start = time.monotonic()
    (c,) = engine.stop()
    assert c.finish_reason == "abort" and 0 < len(c.token_ids) < 200 and time.monotonic() - start < 5
    assert engine._engine.calls.count("abort") >= 2


def test_the_model_aborts_only_what_it_holds_and_releasing_before_the_requests_are_back_crashes(checkpoint):
    """The two rules above, on the model itself: an abort before a batch reaches the scheduler misses it; a
    release while aborted requests are still held is the idle assertion's crash."""
    model = GroupRunner(
        StrictSGLang(
            model_path=checkpoint,
            tp_size=1,
            dtype="float32",
            mem_fraction_static=0.6,
            context_length=64,
            enable_memory_saver=True,
            skip_tokenizer_init=True,
            tick_s=0.001,
        )
    )
    model.submit_groups([("g", [[3]], [{"max_new_tokens": 30, "no_stop_trim": True}])])
    model.tokenizer_manager.abort_request(abort_all=True)  # nothing held yet
    (out,) = model.poll_groups(wait_s=10.0)["g"]
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 30}
    model.submit_groups([("h", [[3]], [{"max_new_tokens": 30, "no_stop_trim": True}])])
    model.poll_groups(wait_s=0.01)  # held now
    model.tokenizer_manager.abort_request(abort_all=True)
    with pytest.raises(Crashed, match="idle"):
        model.release_memory_occupation(["kv_cache", "weights"])


def test_other_calls_are_refused_while_groups_are_in_flight(checkpoint):
    engine = engine_class(stall_after=2)(checkpoint, dtype=torch.float32, poll_s=0.01)
    params = SamplingParams(max_new_tokens=9, n=2)
    engine.submit([GroupRequest(0, [3])], params)
    trainer = build_model(PRESETS["tiny"], seed=1)
    bucket = [(to_hf_name(n), p.detach()) for n, p in list(trainer.named_parameters())[:1]]
    for call in (
        lambda: engine.generate([[1]], params),
        lambda: engine.update_weights(bucket),
        engine.release_memory,
        engine.resume_memory,
    ):
        with pytest.raises(RuntimeError, match="in flight; stop"):
            call()
    with pytest.raises(ValueError, match="group key 0 is already in flight"):
        engine.submit([GroupRequest(0, [4])], params)
    assert len(engine.stop()) == 2
    engine.release_memory()  # idle now


def test_the_context_for_a_run_takes_a_sample_stopped_one_token_short_of_its_budget(checkpoint):
    """train.py's context (context_length_for) must take prompt + all but one of the budget as input: SGLang
    refuses inputs of context - 6 tokens or more. Stopped at 19 of 20 tokens, the continuation runs; a finished
    sample of the group, 20 tokens long, is not an input and is not refused as one."""
    context = context_length_for(12, 20)
    engine = engine_class(stall_after=18)(checkpoint, dtype=torch.float32, context_length=context, poll_s=0.05)
    params = SamplingParams(max_new_tokens=20)
    prompt = list(range(1, 13))
    engine.submit([GroupRequest(0, prompt)], params)
    engine.poll()
    (c,) = engine.stop()
    assert len(c.token_ids) == 19 and c.finish_reason == "abort"
    model(engine).stall_after = None
    finished = Completion(0, 1, *chain(12, 20), "length")
    params = dataclasses.replace(params, n=2)
    done = _drain_after_submit(engine, [GroupRequest(0, prompt, [c, finished])], params)
    assert [(d.token_ids, d.finish_reason) for d in done] == [(chain(12, 20)[0], "length")] * 2


# -- through the engine's own process, and two ranks sharing one engine ---------------------------------------


class Engine(SGLangEngine):
    engine_target = functools.partial(StrictSGLang, tick_s=0.002)

    def _flatten_bucket(self, bucket):
        return flatten_bucket(bucket)

    def _serialize(self, payload):
        return serialize(payload)


def test_partial_rollout_through_the_engine_process(checkpoint):
    engine = Engine(checkpoint, dtype=torch.float32, poll_s=0.02)
    try:
        params = SamplingParams(max_new_tokens=30, n=2)
        engine.submit([GroupRequest(k, p) for k, p in PROMPTS.items()], params)
        engine.poll()
        stopped = engine.stop()
        assert len(stopped) == 6 and any(c.finish_reason == "abort" for c in stopped)
        done = _drain_after_submit(engine, _regroup(stopped, PROMPTS), params)
        assert [c.token_ids for c in done] == [chain(PROMPTS[c.prompt_index][-1], 30)[0] for c in done]
    finally:
        engine.shutdown()


def _two_ranks(rank, world, checkpoint):
    import torch.distributed as dist

    engine = Engine(checkpoint, tp_size=world, dtype=torch.float32, group=dist.group.WORLD, poll_s=0.02)
    try:
        params = SamplingParams(max_new_tokens=25, n=2)
        mine = {0: [rank + 1], 1: [rank + 7, 2]}  # the same keys on both ranks
        engine.submit([GroupRequest(k, p) for k, p in mine.items()] if rank == 0 else [], params)
        engine.submit([GroupRequest(k, p) for k, p in mine.items()] if rank == 1 else [], params)
        engine.poll()
        stopped = engine.stop()
        engine.submit(_regroup(stopped, mine), params)
        done = []
        while True:
            done += engine.poll()
            left = torch.tensor([float(len(done) < 4)])
            dist.all_reduce(left, op=dist.ReduceOp.MAX)  # every rank polls as long as any still waits
            if not left.item():
                break
        done = _order(done)
        return [(c.prompt_index, c.token_ids == chain(mine[c.prompt_index][-1], 25)[0]) for c in done]
    finally:
        engine.shutdown()


@pytest.mark.multiprocess
def test_two_ranks_sharing_one_engine_get_their_own_groups_back(checkpoint):
    for result in run_ranks(_two_ranks, 2, checkpoint, timeout=180):
        assert result == [(0, True), (0, True), (1, True), (1, True)]


def test_with_groups_builds_the_target_and_passes_other_calls_through():
    runner = with_groups(dict, a=1)
    assert isinstance(runner, GroupRunner) and runner.engine == {"a": 1} and runner.get("a") == 1
