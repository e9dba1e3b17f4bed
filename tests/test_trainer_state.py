"""The loop's data position (sampler, carried-over groups) survives a checkpoint as plain data."""

from checkpoint.manager import CheckpointManager
from data.prompts import PromptExample, PromptSampler
from model.args import PRESETS
from model.qwen2 import build_model
from rl.filter import DynamicBatchBuilder, ScoredGroup
from trainer.scoring import Sample
from trainer.state import LoopPosition


def _group(i):
    example = PromptExample(
        [1, 2, i], str(i), "synthetic", [{"role": "user", "content": f"{i} + 0"}], solution=f"Answer: {i}", index=i
    )
    samples = [
        Sample(
            example,
            [5, i, 7][: 2 + j],
            [-0.25 * j, -1.5, 0.1][: 2 + j],
            "stop" if j else "length",
            bool(j),
            1.0 if j else -1.0,
            str(i) if j else None,
            step=1,
        )
        for j in range(2)
    ]
    return ScoredGroup(payload=samples, acc=tuple(s.acc for s in samples), score=tuple(s.score for s in samples))


def test_carried_groups_and_the_sampler_position_round_trip_through_a_checkpoint(tmp_path):
    examples = [_group(i).payload[0].example for i in range(10)]
    sampler = PromptSampler(examples, seed=3)
    sampler.next_batch(4)
    builder = DynamicBatchBuilder(2, 1, max_staleness=2)
    builder.start_step(1)
    builder.add_round([_group(i) for i in range(5)])
    builder.finish()  # 2 trained, 3 carried over
    assert builder.num_carried == 3

    manager = CheckpointManager(str(tmp_path), keep=1)
    model = build_model(PRESETS["tiny"], seed=0)
    manager.save(1, model, train_state=LoopPosition.of(sampler.state_dict(), builder.state_dict()).plain())
    saved = manager.resume(build_model(PRESETS["tiny"], seed=1))

    sampler2, builder2 = PromptSampler(examples, seed=3), DynamicBatchBuilder(2, 1, max_staleness=2)
    LoopPosition.pop_from(saved).restore(sampler2, builder2)
    assert saved == {}
    assert sampler2.next_batch(4) == sampler.next_batch(4)
    builder.start_step(2)
    builder2.start_step(2)
    batch, _ = builder.finish()
    batch2, _ = builder2.finish()
    assert len(batch2) == 2 and builder2.num_carried == 1
    for group, group2 in zip(batch + builder._carry, batch2 + builder2._carry):
        if isinstance(group, tuple):
            assert group[0] == group2[0]
            group, group2 = group[1], group2[1]
        assert group2.payload == group.payload and group2.acc == group.acc and group2.score == group.score
        assert all(s.example is group2.payload[0].example for s in group2.payload)  # one prompt object per group


def test_a_checkpoint_of_a_partial_rollout_run_resumes_without_its_unfinished_groups(caplog):
    """Written before partial rollout was removed: the train state holds "unfinished" groups and every carried
    sample the fields continued_tokens and age. The unfinished groups are dropped with one line; the carried
    groups resume as they were."""
    sampler, builder = PromptSampler([_group(i).payload[0].example for i in range(4)]), DynamicBatchBuilder(2, 1)
    builder.start_step(1)
    builder.add_round([_group(i) for i in range(3)])
    builder.finish()  # 1 carried over
    saved = LoopPosition.of(sampler.state_dict(), builder.state_dict()).plain()
    for _, group in saved["builder"]["carry"]:
        for sample in group["samples"]:
            sample.update(continued_tokens=3, age=1)
    unfinished = {"example": saved["builder"]["carry"][0][1]["example"], "started": 1, "samples": []}
    saved["unfinished"] = [unfinished, unfinished]
    builder2 = DynamicBatchBuilder(2, 1)
    with caplog.at_level("WARNING"):
        LoopPosition.pop_from(saved).restore(PromptSampler(sampler.examples), builder2)
    assert saved == {} and builder2.num_carried == 1
    assert builder2._carry[0][1].payload == builder._carry[0][1].payload
    (line,) = [r.getMessage() for r in caplog.records]
    assert line == (
        "the checkpoint holds 2 groups that partial rollout (since removed) left unfinished: they are dropped, "
        "and the run resumes without them"
    )
