"""data/prompt_row.py through the real parquet reader: every type a field of a DAPO-schema file can hold is either read
as documented (a list of accepted answers scores when any matches) or skips the row with its reason counted in the
load summary; nothing is turned into a string that can never score."""

import logging

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from data.prompts import DataError, load_prompts, rows_to_examples
from rl.reward import compute_score


class CharTokenizer:
    def encode_chat(self, messages):
        return [ord(c) % 256 for m in messages for c in m["content"]]


def _row(truth="1", content="What is 0 + 1?", source="src", solution=None):
    row = {
        "data_source": source,
        "prompt": [{"role": "user", "content": content}],
        "reward_model": {"style": "rule", "ground_truth": truth},
    }
    if solution is not None:
        row["extra_info"] = {"solution": solution}
    return row


def _load(tmp_path, row):
    """The row written to a parquet file (pyarrow infers each column's type from the value) and read back."""
    path = tmp_path / "one.parquet"
    pq.write_table(pa.Table.from_pylist([row]), str(path))
    return load_prompts(str(path), CharTokenizer(), max_prompt_length=100)


READ = [  # (row, what the example holds)
    (_row(truth=["12", "0"]), {"ground_truth": ("12", "0")}),
    (_row(truth=["12", "12"]), {"ground_truth": "12"}),  # one distinct answer: the plain answer
    (_row(truth=12), {"ground_truth": "12"}),  # int64 column
    (_row(truth=12.0), {"ground_truth": "12"}),  # how pandas stores an int column with a missing value
    (_row(truth=0.5), {"ground_truth": "0.5"}),
    (_row(truth=[3, 4]), {"ground_truth": ("3", "4")}),
    (_row(truth=b"12"), {"ground_truth": "12"}),  # a binary column (strings written without the UTF8 annotation)
    (_row(content=b"What is 2 + 2?"), {"messages": [{"role": "user", "content": "What is 2 + 2?"}]}),
    (_row(source=None), {"data_source": "unknown"}),
    (_row(source=b"math_dapo"), {"data_source": "math_dapo"}),
    (_row(solution="1 + 0 = 1\nAnswer: 1"), {"solution": "1 + 0 = 1\nAnswer: 1"}),
]


@pytest.mark.parametrize("row, expected", READ, ids=[repr(e) for _, e in READ])
def test_each_field_type_a_file_can_hold_is_read_as_documented(row, expected, tmp_path):
    (example,) = _load(tmp_path, row)
    assert {key: getattr(example, key) for key in expected} == expected


SKIPPED = [  # (row, the reason the load names)
    (_row(truth=True), "reward_model.ground_truth is a bool, not an answer"),
    (_row(truth={"answer": "12"}), "reward_model.ground_truth is a record, not an answer or a list of answers"),
    (_row(truth=[["12"]]), "reward_model.ground_truth is a list holding a list; a list of answers holds answers"),
    (_row(truth=[]), "reward_model.ground_truth is an empty list"),
    (_row(truth=None), "reward_model.ground_truth is missing"),
    (_row(truth=float("nan")), "reward_model.ground_truth is nan, not an answer"),
    (
        _row(truth="$ $"),
        "reward_model.ground_truth is empty once normalised; every answer that normalises to nothing would match it",
    ),
    (_row(truth=b"\xff12"), "reward_model.ground_truth is bytes that are not UTF-8 text"),
    (_row(content=7), "a 'prompt' message's content is an int, not text"),
    (_row(content=None), "a 'prompt' message's content is missing"),
    (_row(content=[{"type": "text", "text": "hi"}]), "a 'prompt' message's content is a list, not text"),
    ({**_row(), "prompt": 7}, "prompt is an int, not text or a list of {role, content} messages"),
    ({**_row(), "reward_model": "12"}, "reward_model is a str, not a record with a ground_truth"),
    (_row(source=7), "data_source is an int, not text"),
    (_row(solution=["1 + 0 = 1"]), "extra_info.solution is a list, not text"),
]


@pytest.mark.parametrize("row, reason", SKIPPED, ids=[r for _, r in SKIPPED])
def test_a_field_that_cannot_be_read_skips_the_row_with_its_reason(row, reason, tmp_path):
    with pytest.raises(DataError, match="no usable row") as info:
        _load(tmp_path, row)
    assert f"first problem: row 0: {reason} (its columns: " in str(info.value)


def test_a_list_of_accepted_answers_scores_when_any_of_them_matches(tmp_path):
    (example,) = _load(tmp_path, _row(truth=["12", "0"]))
    assert compute_score("so it is 0.\nAnswer: 0", example.ground_truth)["acc"]
    assert compute_score("Answer: 12", example.ground_truth)["acc"]
    assert not compute_score("Answer: 120", example.ground_truth)["acc"]
    assert compute_score("The answer is \\boxed{12}", example.ground_truth)["acc"]  # the boxed fallback too
    assert not compute_score("The answer is \\boxed{1}", example.ground_truth, strict_box=True)["acc"]
    with pytest.raises(TypeError, match="non-empty sequence of str"):
        compute_score("Answer: 1", ())


def test_the_load_summary_counts_skipped_rows_per_reason(caplog):
    rows = [_row(content="a"), _row(content="b", truth=True), _row(content="c", truth=False), _row(content=7)]
    with caplog.at_level(logging.WARNING, logger="data.prompts"):
        examples, stats = rows_to_examples(rows, CharTokenizer(), max_prompt_length=10, source_name="f.parquet")
    assert [e.messages[0]["content"] for e in examples] == ["a"]
    assert stats.skipped == {
        "reward_model.ground_truth is a bool, not an answer": 2,
        "a 'prompt' message's content is an int, not text": 1,
    }
    assert caplog.messages == [
        "f.parquet: 4 rows -> 1 prompts (0 duplicates dropped, 3 rows skipped (2 x reward_model.ground_truth is a "
        "bool, not an answer; 1 x a 'prompt' message's content is an int, not text), 0 left-truncated, "
        "0 dropped as too long)"
    ]
