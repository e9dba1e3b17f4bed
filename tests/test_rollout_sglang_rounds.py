"""Generation on the SGLang engine (rollout/sglang_engine.py submit / poll over rollout/sglang_groups.py) against
the strict model of sglang 0.5.21 (tests/sglang_model.py, "Generation" and "Progress"): in this process, in the
engine's own process, and on two gloo ranks sharing one engine. The model's tokens follow t' = (7 t + 3) % 256
from the input's last token (sglang_model.chain)."""

import functools
import time

import pytest
import torch
from dist_utils import GlooRanks, run_ranks
from engines import generate
from sglang_model import FORCE_STREAM_INTERVAL, InThisProcess, StrictSGLang, chain, flatten_bucket, serialize
from test_rollout_sglang import Crashed, crashes  # noqa: F401  (crashes: its autouse fixture, here too)

from model.args import PRESETS
from model.hf import save_hf
from model.hf_adapter import to_hf_name
from model.qwen2 import build_model
from rollout.engine import Engine, SamplingParams
from rollout.sglang_engine import SGLangEngine
from rollout.sglang_groups import GroupRunner, with_groups


@pytest.fixture
def checkpoint(tmp_path):
    save_hf(build_model(PRESETS["tiny"], seed=0), str(tmp_path))
    return str(tmp_path)


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


def _drain(engine, samples):
    out, tokens = [], []
    while len(out) < samples:
        polled = engine.poll()
        out += polled.completions
        tokens.append(polled.tokens)
    return sorted(out, key=lambda c: (c.prompt_index, c.sample_index)), tokens


PROMPTS = [[5, 1], [9, 20], [3]]


def test_prompts_come_back_whole_as_they_finish(checkpoint):
    """Prompt 0 stops at its 2nd token (a stop id) and comes back alone, its n samples together; the others come
    back after their 40 tokens, as the model's chain, log-probs and all."""
    engine = engine_class(tick_s=0.002)(checkpoint, dtype=torch.float32, poll_s=0.05)
    assert isinstance(engine, Engine)
    stops = (chain(1, 2)[0][1],)  # prompt 0's 2nd token; never in the other chains' first 40
    assert all(stops[0] not in chain(p[-1], 40)[0] for p in PROMPTS[1:])
    params = SamplingParams(max_new_tokens=40, n=2, stop_token_ids=stops)
    engine.submit(PROMPTS, params)
    first = []
    while not first:
        first = engine.poll().completions
    assert [(c.prompt_index, c.finish_reason, c.token_ids) for c in first] == [(0, "stop", chain(1, 2)[0])] * 2
    done, _ = _drain(engine, 4)
    for c in done:
        tokens, logprobs = chain(PROMPTS[c.prompt_index][-1], 40)
        assert (c.token_ids, c.logprobs, c.finish_reason) == (tokens, logprobs, "length")
    assert model(engine).running == 0  # every request is back: the scheduler is idle
    calls = model(engine).calls
    assert calls.count("async_generate") == 3 and "generate" not in calls


def test_a_poll_reports_the_tokens_sglang_reported(checkpoint):
    """Progress: a request's tokens reach the tokenizer manager every FORCE_STREAM_INTERVAL and at its end; the
    polls' token counts add up to every token generated, and a stalled scheduler reports none."""
    engine = engine_class(tick_s=0.001)(checkpoint, dtype=torch.float32, poll_s=0.01)
    length = 3 * FORCE_STREAM_INTERVAL + 7
    engine.submit([[5], [6]], SamplingParams(max_new_tokens=length, n=2))
    done, tokens = _drain(engine, 4)
    assert sum(tokens) == 4 * length and [len(c.token_ids) for c in done] == [length] * 4
    assert sum(1 for t in tokens if t) > 1  # reported while running, not only at the end
    assert model(engine).tokenizer_manager.rid_to_state == {}  # every state deleted
    stalled = engine_class(stall_after=FORCE_STREAM_INTERVAL + 1)(checkpoint, dtype=torch.float32, poll_s=0.01)
    stalled.submit([[5]], SamplingParams(max_new_tokens=length))
    seen, start = [], time.monotonic()
    while sum(seen) < FORCE_STREAM_INTERVAL and time.monotonic() - start < 60:  # a loaded machine ticks slowly
        seen.append(stalled.poll().tokens)
    after = [stalled.poll().tokens for _ in range(5)]  # stalled: nothing more, however long it is polled
    assert sum(seen) == FORCE_STREAM_INTERVAL and after == [0] * 5


def test_other_calls_are_refused_while_groups_are_in_flight(checkpoint):
    engine = engine_class(stall_after=2)(checkpoint, dtype=torch.float32, poll_s=0.01)
    params = SamplingParams(max_new_tokens=9, n=2)
    engine.submit([[3]], params)
    trainer = build_model(PRESETS["tiny"], seed=1)
    bucket = [(to_hf_name(n), p.detach()) for n, p in list(trainer.named_parameters())[:1]]
    for call in (
        lambda: engine.submit([[1]], params),
        lambda: engine.update_weights(bucket),
        engine.release_memory,
        engine.resume_memory,
    ):
        with pytest.raises(RuntimeError, match="while submitted groups are in flight"):
            call()
    model(engine).stall_after = None
    assert len(_drain(engine, 2)[0]) == 2
    engine.release_memory()  # idle now


# -- through the engine's own process, and two ranks sharing one engine ---------------------------------------


class ProcessEngine(SGLangEngine):
    engine_target = functools.partial(StrictSGLang, tick_s=0.002)

    def _flatten_bucket(self, bucket):
        return flatten_bucket(bucket)

    def _serialize(self, payload):
        return serialize(payload)


def test_a_round_through_the_engine_process(checkpoint):
    engine = ProcessEngine(checkpoint, dtype=torch.float32, poll_s=0.02)
    try:
        done = generate(engine, PROMPTS, SamplingParams(max_new_tokens=30, n=2))
        assert [c.token_ids for c in done] == [chain(PROMPTS[c.prompt_index][-1], 30)[0] for c in done]
    finally:
        engine.shutdown()


def _two_ranks(rank, world, checkpoint):
    import torch.distributed as dist

    engine = ProcessEngine(checkpoint, tp_size=world, dtype=torch.float32, group=dist.group.WORLD, poll_s=0.02)
    try:
        mine = [[rank + 1], [rank + 7, 2]]  # the same prompt indices on both ranks
        done = generate(engine, mine, SamplingParams(max_new_tokens=25, n=2), GlooRanks(rank, world))
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
