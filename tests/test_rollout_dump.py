"""metrics.rollout_dump (trainer/rollout_dump.py): each step's trained samples as JSONL, with the advantages the
update uses, written once per completed step also when a run resumes."""

import os
from types import SimpleNamespace

import pytest
import torch

import rl.reward
import train
from data.prompts import PromptExample
from model.tokenizer import train_bpe_tokenizer
from rl.advantage import group_advantages
from rollout.engine import Completion
from tests.planted_train import planted_score
from tests.test_train_e2e import overrides, read_rows
from trainer.rollout_dump import dump_path, read_dump, sample_lines
from trainer.scoring import score_groups
from trainer.update import pack_items_for_groups


@pytest.fixture(scope="module")
def tokenizer():
    return train_bpe_tokenizer(["Answer: 42", "Answer: 7", "the sum is 42"] * 20, vocab_size=300)


def test_a_line_per_sample_with_the_updates_advantage(tokenizer):
    stop = tokenizer.stop_ids[0]
    texts = ["Answer: 42", "Answer: 7", "the sum is 42", "Answer: 42"]
    completions = []
    for i, text in enumerate(texts):
        ids = tokenizer.encode(text) + [stop] * (i != 2)
        completions.append(Completion(0, i, ids, [-0.25] * len(ids), "length" if i == 2 else "stop"))
    example = PromptExample(prompt_ids=[5, 6], ground_truth="42", data_source="t", messages=[], index=17)
    cfg = SimpleNamespace(  # what score_groups reads of a Config
        algorithm=SimpleNamespace(strict_box=False, overlong_penalty=False),
        rollout=SimpleNamespace(max_response_length=64),
    )
    groups = score_groups([example], completions, tokenizer, cfg, step=3)
    (items,) = pack_items_for_groups(groups, adv_eps=1e-6, norm_by_std=True, overlong_filter=False, step=3)
    lines = list(sample_lines(3, groups, [[item.advantage for item in items]], tokenizer))
    assert [line["response"] for line in lines] == texts
    assert [line["acc"] for line in lines] == [True, False, False, True]
    assert [line["score"] for line in lines] == [1.0, -1.0, -1.0, 1.0]
    # Eq. 9 of scores (1, -1, -1, 1): mean 0, unbiased std 2 / sqrt(3).
    expected = group_advantages(torch.tensor([1.0, -1.0, -1.0, 1.0], dtype=torch.float64), group_size=4)
    assert [line["advantage"] for line in lines] == expected.tolist()
    assert lines[0]["advantage"] == pytest.approx(3**0.5 / 2, rel=1e-5)
    assert [line["length"] for line in lines] == [len(c.token_ids) for c in completions]
    assert [line["finish_reason"] for line in lines] == ["stop", "stop", "length", "stop"]
    assert {line["step"] for line in lines} == {3} and {line["prompt_index"] for line in lines} == {17}
    assert lines[1]["pred"] == "7" and lines[0]["logprobs"] == [-0.25] * len(completions[0].token_ids)


def test_a_resumed_run_leaves_each_step_once_as_an_uninterrupted_one_does(tmp_path, monkeypatch):
    monkeypatch.setattr(rl.reward, "compute_score", planted_score)
    straight, resumed = str(tmp_path / "straight"), str(tmp_path / "resumed")
    assert train.main(overrides(straight, steps=2, **{"metrics.rollout_dump": True})) == 0
    assert train.main(overrides(resumed, steps=1, **{"metrics.rollout_dump": True})) == 0
    assert train.main(overrides(resumed, steps=2, **{"metrics.rollout_dump": True})) == 0
    for step in (1, 2):
        a, b = (dump_path(os.path.join(run, "run"), step) for run in (straight, resumed))
        with open(a) as first, open(b) as second:
            assert first.read() == second.read()
    rows = {r["step"]: r for r in read_rows(straight) if "loss" in r}
    for step, row in rows.items():
        samples = read_dump(os.path.join(straight, "run"), step)
        assert len(samples) == row["groups/in_batch"] * 4  # the trained groups (dynamic sampling kept them)
        assert sum(s["acc"] for s in samples) / len(samples) == pytest.approx(row["kept/acc/mean"])
        assert sum(s["length"] for s in samples) / len(samples) == pytest.approx(row["kept/response_length/mean"])
        assert sum(s["score"] for s in samples) / len(samples) == pytest.approx(row["kept/reward/mean"])
    files = sorted(os.listdir(os.path.join(straight, "run", "rollouts")))
    assert files == [os.path.basename(dump_path("", step)) for step in (1, 2)]  # nothing else left behind


def test_no_dump_unless_asked(tmp_path, monkeypatch):
    monkeypatch.setattr(rl.reward, "compute_score", planted_score)
    assert train.main(overrides(str(tmp_path), steps=1)) == 0
    assert not os.path.exists(os.path.join(tmp_path, "run", "rollouts"))
