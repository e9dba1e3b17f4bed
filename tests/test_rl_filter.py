"""Dynamic sampling (Eq. 11): the keep rule and the batch builder with carry-over."""

import math

import pytest

from observe.records import row
from rl.filter import DynamicBatchBuilder, ScoredGroup, keep_group

# -- keep rule -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "values, kept",
    [
        ([True, False, False, True], True),  # 0 < 2 < 4
        ([1, 0, 0, 0], True),  # 0 < 1 < 4
        ([True, True, True, False], True),  # 0 < 3 < 4
        ([True, True, True, True], False),  # all correct: #correct = G
        ([False, False, False], False),  # all wrong: #correct = 0
        ([True], True),  # one response: kept, its advantage is its reward
        ([False], True),
        ([1.0, 1.0 + 1e-9], False),  # float noise below the tolerance
        ([-1.0, -1.0 - 1e-7], False),
        ([1.0, 0.75], True),  # a real difference, e.g. an overlong penalty
        ([-1.0, -1.0, -1.25], True),
    ],
)
def test_keep_rule(values, kept):
    assert keep_group(values) is kept


def test_keep_rule_tolerance_is_configurable():
    assert keep_group([1.0, 1.0 + 1e-9], tol=0.0)
    assert not keep_group([1.0, 1.5], tol=0.5)
    assert keep_group([1.0, 1.5001], tol=0.5)


def test_keep_rule_rejects_bad_input():
    with pytest.raises(ValueError, match="empty group"):
        keep_group([])
    with pytest.raises(ValueError, match="non-finite"):
        keep_group([1.0, float("nan")])
    with pytest.raises(ValueError, match="tol"):
        keep_group([1.0], tol=-1)


# -- groups ------------------------------------------------------------------------------------------


def group(name, acc, score=None):
    """A group whose payload is its name; score defaults to the +-1 correctness reward."""
    score = [1.0 if a else -1.0 for a in acc] if score is None else score
    return ScoredGroup(payload=name, acc=acc, score=score)


MIXED, ALL_RIGHT, ALL_WRONG = [1, 0, 0, 1], [1, 1, 1, 1], [0, 0, 0, 0]


def names(batch):
    return [g.payload for g in batch]


def test_scored_group_validation_and_properties():
    g = group("q", [1, 0, 0, 0])
    assert g.acc == (True, False, False, False) and g.score == (1.0, -1.0, -1.0, -1.0)
    assert g.size == 4
    with pytest.raises(ValueError, match="as many acc as score"):
        ScoredGroup(payload=None, acc=[1, 0], score=[1.0])
    with pytest.raises(ValueError, match="as many acc as score"):
        ScoredGroup(payload=None, acc=[], score=[])
    with pytest.raises(ValueError, match="bool or 0/1"):
        ScoredGroup(payload=None, acc=[0.5], score=[1.0])
    with pytest.raises(ValueError, match="non-finite score"):
        ScoredGroup(payload=None, acc=[1], score=[math.inf])


# -- builder -----------------------------------------------------------------------------------------


def test_rounds_until_full_then_surplus_is_carried_over():
    builder = DynamicBatchBuilder(train_batch_size=2, max_rounds=3)
    builder.start_step(0)
    builder.add_round([group("a", MIXED), group("b", ALL_RIGHT), group("c", ALL_WRONG)])
    assert not builder.full() and builder.rounds == 1
    builder.add_round([group("d", [0, 0, 0, 1]), group("e", [1, 1, 1, 0])])
    assert builder.full()
    batch, diag = builder.finish()
    assert names(batch) == ["a", "d"]
    assert builder.num_carried == 1
    # 5 groups of 4 generated (pass rates 0.5, 1, 0, 0.25, 0.75); kept a, d, e
    assert row(diag) == {
        "gen/rounds": 2,
        "groups/kept_share": 3 / 5,
        "groups/all_correct_share": 1 / 5,
        "groups/all_wrong_share": 1 / 5,
        "gen/samples": 20,
        "gen/samples_per_kept_sample": 20 / (3 * 4),
        "groups/in_batch": 2,
        "groups/from_carry": 0,
        "groups/carried_over": 1,
        "groups/dropped_stale": 0,
        "groups/shortfall": 0,
    }

    builder.start_step(1)  # the carried group comes first
    builder.add_round([group("f", MIXED), group("g", MIXED)])
    batch, diag = builder.finish()
    assert names(batch) == ["e", "f"]
    assert diag.from_carry.result() == 1 and diag.carried_over.result() == 1 and diag.kept_share.parts[0] == 2


def test_carry_over_is_fifo_and_can_fill_a_batch_without_generating():
    builder = DynamicBatchBuilder(train_batch_size=1, max_rounds=2, max_staleness=3)
    builder.start_step(0)
    builder.add_round([group("a", MIXED), group("b", MIXED), group("c", MIXED)])
    assert names(builder.finish()[0]) == ["a"]
    builder.start_step(1)
    assert builder.full()  # b and c are waiting: no generation needed
    batch, diag = builder.finish()
    assert names(batch) == ["b"] and diag.rounds.result() == 0 and diag.kept_share.parts[1] == 0
    assert diag.samples.result() == 0  # nothing generated: no share of anything
    assert diag.from_carry.result() == 1 and diag.carried_over.result() == 1
    builder.start_step(2)
    builder.add_round([group("d", MIXED)])
    assert names(builder.finish()[0]) == ["c"]  # older than d


def test_stale_groups_are_dropped():
    builder = DynamicBatchBuilder(train_batch_size=1, max_rounds=1, max_staleness=1)
    builder.start_step(0)
    builder.add_round([group("a", MIXED), group("b", MIXED), group("c", MIXED)])
    builder.finish()
    builder.start_step(1)  # b, c are one step old: usable
    assert names(builder.finish()[0]) == ["b"]
    builder.start_step(2)  # c is two steps old: dropped
    assert not builder.full()
    builder.add_round([group("d", MIXED)])
    batch, diag = builder.finish()
    assert names(batch) == ["d"] and diag.dropped_stale.result() == 1


def test_skipped_steps_count_towards_staleness():
    builder = DynamicBatchBuilder(train_batch_size=1, max_rounds=1, max_staleness=2)
    builder.start_step(0)
    builder.add_round([group("a", MIXED), group("b", MIXED)])
    builder.finish()
    builder.start_step(3)
    builder.add_round([group("c", MIXED)])
    batch, diag = builder.finish()
    assert names(batch) == ["c"] and diag.dropped_stale.result() == 1


def test_zero_staleness_disables_carry_over():
    builder = DynamicBatchBuilder(train_batch_size=1, max_rounds=1, max_staleness=0)
    builder.start_step(0)
    builder.add_round([group("a", MIXED), group("b", MIXED)])
    builder.finish()
    builder.start_step(1)
    assert not builder.full()
    builder.add_round([group("c", MIXED)])
    batch, diag = builder.finish()
    assert names(batch) == ["c"] and diag.dropped_stale.result() == 1


def test_a_short_batch_is_handed_out_and_counted():
    """After the last round a batch may be short: what to do about it is the observer's (algorithm.on_shortfall,
    trainer/rollout_phase.py on_shortfall)."""
    builder = DynamicBatchBuilder(train_batch_size=3, max_rounds=2)
    builder.start_step(5)
    builder.add_round([group("a", MIXED), group("x", ALL_RIGHT)])
    builder.add_round([group("b", MIXED), group("y", ALL_WRONG)])
    assert not builder.full() and builder.rounds == 2
    batch, diag = builder.finish()
    assert names(batch) == ["a", "b"] and diag.shortfall.result() == 1 and diag.in_batch.result() == 2


def test_disabled_keeps_everything_in_one_round():
    builder = DynamicBatchBuilder(train_batch_size=3, max_rounds=4, enabled=False)
    builder.start_step(0)
    builder.add_round([group("a", ALL_RIGHT), group("b", ALL_WRONG), group("c", MIXED)])
    assert builder.full()
    batch, diag = builder.finish()
    assert names(batch) == ["a", "b", "c"]
    assert diag.rounds.result() == 1 and diag.kept_share.parts[0] == 3 and diag.samples.result() == 12
    assert diag.all_correct_share.parts[0] == 1 and diag.kept_share.parts[1] == 3  # diagnostics are still computed


def test_disabled_with_a_short_round_hands_out_a_short_batch():
    builder = DynamicBatchBuilder(train_batch_size=3, max_rounds=4, enabled=False)
    builder.start_step(0)
    builder.add_round([group("a", ALL_RIGHT)])
    assert builder.full()
    batch, diag = builder.finish()
    assert names(batch) == ["a"] and diag.shortfall.result() == 2


def test_filter_on_shaped_score_instead_of_accuracy():
    # all correct, but one answer was overlong: no accuracy spread, but a reward spread
    overlong = group("o", [1, 1], score=[1.0, 0.5])
    by_acc = DynamicBatchBuilder(train_batch_size=1, max_rounds=1, metric="acc")
    by_acc.start_step(0)
    by_acc.add_round([overlong])
    assert not by_acc.full()
    by_score = DynamicBatchBuilder(train_batch_size=1, max_rounds=1, metric="score")
    by_score.start_step(0)
    by_score.add_round([overlong])
    assert by_score.full() and names(by_score.finish()[0]) == ["o"]


def test_training_loop_usage():
    rounds = iter(
        [
            [group(f"r0-{i}", ALL_WRONG if i % 2 else MIXED) for i in range(6)],  # 3 kept
            [group(f"r1-{i}", ALL_RIGHT if i % 3 else MIXED) for i in range(6)],  # 2 kept
            [group(f"r2-{i}", MIXED) for i in range(6)],
        ]
    )
    builder = DynamicBatchBuilder(train_batch_size=4, max_rounds=3)
    builder.start_step(0)
    while not builder.full() and builder.rounds < 3:
        builder.add_round(next(rounds))
    batch, diag = builder.finish()
    assert names(batch) == ["r0-0", "r0-2", "r0-4", "r1-0"]
    assert diag.rounds.result() == 2 and diag.carried_over.result() == 1
    assert (diag.all_wrong_share.parts[0], diag.all_correct_share.parts[0], diag.kept_share.parts[1]) == (3, 4, 12)


def test_misuse_is_refused():
    builder = DynamicBatchBuilder(train_batch_size=1, max_rounds=1)
    with pytest.raises(RuntimeError, match="start_step"):
        builder.add_round([])
    with pytest.raises(RuntimeError, match="start_step"):
        builder.finish()
    builder.start_step(3)
    with pytest.raises(RuntimeError, match="never finished"):
        builder.start_step(4)
    with pytest.raises(TypeError, match="ScoredGroup"):
        builder.add_round([("payload", [1, 0])])
    builder2 = DynamicBatchBuilder(train_batch_size=1, max_rounds=1)
    builder2.start_step(0)
    builder2.add_round([])
    with pytest.raises(RuntimeError, match="all 1 rounds"):
        builder2.add_round([])
    builder2.finish()
    with pytest.raises(ValueError, match="steps must increase"):
        builder2.start_step(0)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"train_batch_size": 0}, "train_batch_size"),
        ({"max_rounds": 0}, "max_rounds"),
        ({"max_staleness": -1}, "max_staleness"),
        ({"metric": "reward"}, "metric"),
        ({"tol": -0.1}, "tol"),
    ],
)
def test_bad_builder_arguments_are_named(kwargs, message):
    args = {"train_batch_size": 2, "max_rounds": 2} | kwargs
    with pytest.raises(ValueError, match=message):
        DynamicBatchBuilder(**args)


def test_builder_state_dict_round_trips_the_carry_over_queue():
    import pickle

    builder = DynamicBatchBuilder(train_batch_size=1, max_rounds=2, max_staleness=3)
    builder.start_step(1)
    builder.add_round([ScoredGroup(payload=f"g{i}", acc=(True, False), score=(1.0, -1.0)) for i in range(3)])
    batch, _ = builder.finish()
    assert [g.payload for g in batch] == ["g0"] and builder.num_carried == 2
    restored = DynamicBatchBuilder(train_batch_size=1, max_rounds=2, max_staleness=3)
    restored.load_state_dict(pickle.loads(pickle.dumps(builder.state_dict())))
    restored.start_step(2)
    assert restored.full()
    assert [g.payload for g in restored.finish()[0]] == ["g1"]
    with pytest.raises(ValueError, match="steps must increase"):
        restored.start_step(2)
    restored.start_step(3)
    with pytest.raises(RuntimeError, match="in progress"):
        restored.state_dict()
