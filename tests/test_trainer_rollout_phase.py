"""Dynamic sampling inside the training loop: rounds until the batch is full, surplus carried over."""

import dataclasses
import logging
import types

import pytest
import torch
from engines import ByGenerate

from config import Config
from data.prompts import PromptExample, PromptSampler
from observe.records import row
from parallel.dims import ParallelDims
from parallel.dist_env import DistEnv
from rl.filter import DynamicBatchBuilder
from rollout.engine import Completion, EngineFailure
from run.guard import GuardedEngine
from run.signals import StopRequested
from trainer.observers import RolloutWatch, no_display
from trainer.rollout_phase import RolloutPhase, on_shortfall


def SingleProcess():
    return DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), dims=ParallelDims(world_size=1))


class DigitTokenizer:
    stop_ids = ()

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(ord("0") + i) for i in ids)


class PlantedEngine(ByGenerate):
    """Prompt k is answered correctly by samples whose index is in `pattern(k)`: known kept groups."""

    def __init__(self, pattern):
        self.pattern, self.calls = pattern, []

    def generate(self, prompts, params):
        self.calls.append(len(prompts))
        out = []
        for p, prompt in enumerate(prompts):
            k = prompt[0]
            for s in range(params.n):
                answer = [1] if s in self.pattern(k) else [2]
                out.append(Completion(p, s, answer, [-0.5], "stop"))
        return out


def _examples(n):
    # Ground truth "1": the response "Answer: 1" is correct, "Answer: 2" is wrong.
    return [PromptExample(prompt_ids=[k], ground_truth="1", data_source="t", messages=[]) for k in range(n)]


class AnswerTokenizer(DigitTokenizer):
    def decode(self, ids, skip_special_tokens=False):
        return "Answer: " + super().decode(ids, skip_special_tokens)


def collect_batch(step, builder, engine, sampler, per_round, n=4, runner=None, display=no_display):
    """RolloutPhase(...).collect_batch(step) with `per_round` prompts a round and n samples each: (this rank's
    groups, the phase's metrics by name). runner: the guard's phase runner (None: failures raised as they are, no
    stops)."""
    cfg = Config()
    cfg = dataclasses.replace(
        cfg,
        job=dataclasses.replace(cfg.job, seed=1),
        rollout=dataclasses.replace(cfg.rollout, n=n, max_response_length=4, gen_batch_multiplier=1),
        training=dataclasses.replace(cfg.training, train_batch_size=per_round),
        algorithm=dataclasses.replace(cfg.algorithm, overlong_penalty=False),
    )
    watch = RolloutWatch(builder, display)
    guarded = GuardedEngine(engine, SingleProcess(), runner, on_poll=watch.polled)
    groups = RolloutPhase(cfg, guarded, sampler, builder, AnswerTokenizer(), 0, watch).collect_batch(step)
    return groups, row(watch.metrics)


def test_rounds_fill_the_batch_and_surplus_is_carried_over():
    # Prompts whose id is divisible by 3 are mixed (1 of 4 correct); the others are all wrong (dropped).
    engine = PlantedEngine(lambda k: {0} if k % 3 == 0 else set())
    sampler = PromptSampler(_examples(30), shuffle=False)
    builder = DynamicBatchBuilder(train_batch_size=4, max_rounds=5, max_staleness=2)
    batch, diag = collect_batch(1, builder, engine, sampler, 6)
    # Round 1 sees prompts 0..5 (kept: 0, 3), round 2 sees 6..11 (kept: 6, 9): full after two rounds.
    assert engine.calls == [6, 6] and diag["gen/rounds"] == 2
    assert [g.payload[0].example.prompt_ids[0] for g in batch] == [0, 3, 6, 9]
    assert diag["gen/samples"] == 12 * 4 and diag["groups/all_wrong_share"] == pytest.approx(8 / 12)
    assert diag["gen/samples_per_kept_sample"] == pytest.approx(48 / 16)
    assert builder.num_carried == 0

    # Step 2: one round of 12 prompts (12..23) keeps 12, 15, 18, 21: exactly full; a third step with a
    # round of 12 (24..29, 0..5) keeps 24, 27, 0, 3 -> full; no surplus until a round over-fills.
    batch, diag = collect_batch(2, builder, engine, sampler, 12)
    assert diag["gen/rounds"] == 1 and [g.payload[0].example.prompt_ids[0] for g in batch] == [12, 15, 18, 21]
    batch, diag = collect_batch(3, builder, engine, sampler, 18)
    # 18 prompts: 24..29 then 0..11 -> kept 24, 27, 0, 3, 6, 9: four trained, two carried to step 4.
    assert [g.payload[0].example.prompt_ids[0] for g in batch] == [24, 27, 0, 3]
    assert builder.num_carried == 2 and diag["groups/carried_over"] == 2
    batch, diag = collect_batch(4, builder, engine, sampler, 6)
    assert [g.payload[0].example.prompt_ids[0] for g in batch][:2] == [6, 9]
    assert diag["groups/from_carry"] == 2


def test_a_round_hands_the_filter_its_groups_in_submission_order_not_the_order_they_finish():
    """Groups that finish last (the longest responses) must not lose their place in an over-full batch: the
    batch keeps the round's first groups, as one blocking generate call did."""

    class LastFirst(PlantedEngine):
        def poll(self):  # one group a poll, the last submitted first
            polled = super().poll()
            self.done = sorted(getattr(self, "done", []) + polled.completions, key=lambda c: -c.prompt_index)
            n = self.params.n
            finished, self.done = self.done[:n], self.done[n:]
            return dataclasses.replace(polled, completions=finished, tokens=len(finished), done=not self.done)

    engine = LastFirst(lambda k: {0})  # every group mixed: every group is kept
    builder = DynamicBatchBuilder(train_batch_size=4, max_rounds=1, max_staleness=1)
    sampler = PromptSampler(_examples(6), shuffle=False)
    batch, diag = collect_batch(1, builder, engine, sampler, 6, n=2)
    assert [g.payload[0].example.prompt_ids[0] for g in batch] == [0, 1, 2, 3] and diag["groups/carried_over"] == 2


def test_a_short_batch_after_the_last_round_is_counted_and_aborts_are_reported():
    engine = PlantedEngine(lambda k: {0} if k == 0 else set())
    sampler = PromptSampler(_examples(30), shuffle=False)
    builder = DynamicBatchBuilder(train_batch_size=4, max_rounds=2)
    batch, diag = collect_batch(1, builder, engine, sampler, 5, n=2)
    assert len(batch) == 1 and diag["gen/rounds"] == 2 and diag["groups/shortfall"] == 3

    class AbortingEngine(PlantedEngine):
        def generate(self, prompts, params):
            out = super().generate(prompts, params)
            out[1] = Completion(0, 1, [], [], "abort")
            return out

    aborting = AbortingEngine(lambda k: {0})
    with pytest.raises(EngineFailure, match="aborted 1 of 4 requests"):
        collect_batch(2, builder, aborting, sampler, 2, n=2)
    assert aborting.calls == [2]  # reported: the guard stops the run with a checkpoint


def test_a_short_batch_is_trained_on_with_one_line_or_stops_the_run(caplog):
    """algorithm.on_shortfall: "fill" logs one line (not a warning with a source line), "raise" raises."""
    builder = DynamicBatchBuilder(train_batch_size=4, max_rounds=2)
    builder.start_step(3)
    _, filtered = builder.finish()  # no round ran: all 4 missing
    filtered.rounds.add(2)
    with caplog.at_level(logging.WARNING, logger="train"):
        on_shortfall(filtered, 3, "fill", 2)
    (line,) = [r.getMessage() for r in caplog.records]
    assert (
        line
        == "dynamic sampling kept 0 of 4 groups at step 3 after 2 of 2 generation rounds; training on the smaller batch"
    )
    with pytest.raises(RuntimeError, match=r"kept 0 of 4 groups .* \(on_shortfall 'raise'\): allow more rounds"):
        on_shortfall(filtered, 3, "raise", 2)


def _engine_groups(rank, world_size):
    from rollout.engine_spec import engine_group

    env = DistEnv(
        rank=rank,
        world_size=world_size,
        local_rank=rank,
        device=torch.device("cpu"),
        dims=ParallelDims(world_size=world_size),
    )
    group, base_gpu = engine_group(2, env)
    return torch.distributed.get_process_group_ranks(group), base_gpu


@pytest.mark.multiprocess
def test_sglang_engine_groups_are_consecutive_ranks_on_their_first_gpu():
    from tests.dist_utils import run_ranks

    assert run_ranks(_engine_groups, 4) == [([0, 1], 0), ([0, 1], 0), ([2, 3], 2), ([2, 3], 2)]
    from rollout.engine_spec import engine_group

    with pytest.raises(ValueError, match="rollout.tp_size = 2 needs 2 ranks"):
        engine_group(2, SingleProcess())


class RecordingProgress:
    def __init__(self):
        self.updates, self.n = [], 0

    def update(self, n=1, **postfix):
        self.updates.append((n, postfix))
        self.n += n

    def close(self):
        pass


def test_the_display_shows_the_engines_tokens_after_each_poll_and_the_kept_groups_after_each_round():
    # Prompts 0, 3, 6 are mixed (kept); 7 prompts in one round, answered by the first poll, one token each.
    engine = PlantedEngine(lambda k: {0} if k % 3 == 0 else set())
    sampler = PromptSampler(_examples(30), shuffle=False)
    builder = DynamicBatchBuilder(train_batch_size=4, max_rounds=1)
    progress = RecordingProgress()
    batch, diag = collect_batch(1, builder, engine, sampler, 7, display=lambda total, desc, unit: progress)
    assert engine.calls == [7] and diag["gen/rounds"] == 1 and len(batch) == 3
    assert progress.updates == [(0, {"tokens": 28}), (3, {"rounds": 1})]


class StopAtBoundary:
    """A phase runner stand-in: a signal arrived; its stop raises (it saves nothing)."""

    stop = types.SimpleNamespace(signal_name="SIGTERM")

    def stop_if_requested(self, anyone=None):
        raise StopRequested("SIGTERM", 0)


def test_a_stop_requested_at_an_engine_call_ends_the_round():
    engine = PlantedEngine(lambda k: {0})
    sampler = PromptSampler(_examples(30), shuffle=False)
    builder = DynamicBatchBuilder(train_batch_size=4, max_rounds=2)
    with pytest.raises(StopRequested, match="stopped by SIGTERM"):
        collect_batch(1, builder, engine, sampler, 6, n=2, runner=StopAtBoundary())
    assert engine.calls == []  # stopped after the submit: the poll never ran
