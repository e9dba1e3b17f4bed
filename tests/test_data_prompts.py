import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from data.prompts import (
    DataError,
    PromptSampler,
    load_prompts,
    rows_to_examples,
)
from rl.reward import compute_score
from tasks.arithmetic import synthetic_arithmetic_rows
from tasks.catalog import DAPO_PROMPT_TEMPLATE
from tests.parquet_rows import write_parquet_rows


class CharTokenizer:
    """One token per character of the joined message contents: enough to test lengths and truncation."""

    def encode_chat(self, messages):
        return [ord(c) % 256 for m in messages for c in m["content"]]


def _row(content, truth="1", source="src"):
    return {
        "data_source": source,
        "prompt": [{"role": "user", "content": content}],
        "ability": "MATH",
        "reward_model": {"style": "rule", "ground_truth": truth},
        "extra_info": {"index": 0},
    }


def test_deduplicates_and_counts_skipped_rows():
    rows = [_row("a"), _row("a"), _row("b"), {"prompt": [{"role": "user", "content": "c"}]}, _row("a")]
    examples, stats = rows_to_examples(rows, CharTokenizer(), max_prompt_length=10)
    assert [e.messages[0]["content"] for e in examples] == ["a", "b"]
    assert (stats.rows, stats.duplicates, stats.skipped_rows) == (5, 2, 1)
    assert "row 3" in stats.first_problem and "ground_truth" in stats.first_problem


def test_duplicates_whose_ground_truth_scores_otherwise_keep_the_first_and_are_counted_and_named(caplog):
    rows = [
        _row("a", "5"),
        _row("a", "5"),  # a plain repeat
        _row("a", 5),  # the same answer as an int: scored alike
        _row("b", ["7", "seven"]),
        _row("a", "6"),  # another answer
        _row("b", ("seven", "7")),  # the same accepted answers in another order
        _row("a", ["5", "6"]),  # 6 is accepted too: another ground truth
        _row("b", "7"),  # "seven" no longer accepted
    ]
    with caplog.at_level("INFO", logger="data.prompts"):
        examples, stats = rows_to_examples(rows, CharTokenizer(), max_prompt_length=10, source_name="set.parquet")
    assert [(e.messages[0]["content"], e.ground_truth) for e in examples] == [("a", "5"), ("b", ("7", "seven"))]
    assert (stats.duplicates, stats.conflicting) == (6, 3)
    [record] = caplog.records
    assert record.levelname == "WARNING" and record.getMessage() == (
        "set.parquet: 8 rows -> 2 prompts (6 duplicates dropped (3 of them with another ground truth than the "
        "first, which is kept: row 4 answers '6' where row 0 answers '5'), 0 rows skipped, 0 left-truncated, "
        "0 dropped as too long)"
    )


def test_a_role_the_chat_template_does_not_know_skips_the_row_and_names_it():
    odd = _row("b")
    odd["prompt"] = [{"role": "human", "content": "b"}]
    examples, stats = rows_to_examples([_row("a"), odd], CharTokenizer(), max_prompt_length=10)
    assert [e.messages[0]["content"] for e in examples] == ["a"] and stats.skipped_rows == 1
    assert (
        stats.first_problem
        == "row 1: a 'prompt' message has role 'human'; the chat template knows system, user, assistant"
    )


def test_long_prompts_are_left_truncated_or_dropped():
    rows = [_row("0123456789"), _row("short")]
    kept, stats = rows_to_examples(rows, CharTokenizer(), max_prompt_length=6)
    assert kept[0].prompt_ids == [ord(c) for c in "456789"] and stats.truncated == 1
    kept, stats = rows_to_examples(rows, CharTokenizer(), max_prompt_length=6, overflow="drop")
    assert [e.messages[0]["content"] for e in kept] == ["short"] and stats.dropped_too_long == 1


def test_file_without_usable_rows_names_file_and_first_problem(tmp_path):
    path = str(tmp_path / "bad.parquet")
    write_parquet_rows(
        [{"prompt": [{"role": "user", "content": "x"}], "reward_model": {"style": "rule"}, "data_source": "s"}], path
    )
    with pytest.raises(DataError, match=r"bad\.parquet: no usable row.*row 0.*ground_truth"):
        load_prompts(path, CharTokenizer(), max_prompt_length=100)
    with pytest.raises(DataError, match="not found"):
        load_prompts(str(tmp_path / "missing.parquet"), CharTokenizer(), max_prompt_length=100)


def _one_line_error(path):
    with pytest.raises(DataError) as info:
        load_prompts(str(path), CharTokenizer(), max_prompt_length=100)
    message = str(info.value)
    assert str(path) in message and "\n" not in message
    return message


def test_unusable_files_are_one_data_error_naming_the_file_and_the_problem(tmp_path):
    empty = tmp_path / "empty.parquet"
    empty.write_bytes(b"")
    assert _one_line_error(empty) == f"{empty}: the file is empty (0 bytes), not a parquet file"
    text = tmp_path / "rows.parquet"
    text.write_text("prompt,answer\nwhat is 1+1?,2\n")  # a CSV under a parquet name
    assert _one_line_error(text).startswith(f"{text}: cannot be read as parquet (")
    no_rows = tmp_path / "no_rows.parquet"
    pq.write_table(pa.Table.from_pylist([_row("a")]).slice(0, 0), str(no_rows))  # the schema, zero rows
    assert _one_line_error(no_rows) == (
        f"{no_rows}: the parquet file has no rows (columns: data_source, prompt, ability, reward_model, extra_info)"
    )
    other_schema = tmp_path / "other.parquet"
    write_parquet_rows([{"question": "What is 1 + 1?", "answer": "2"}], str(other_schema))
    assert _one_line_error(other_schema) == (
        f"{other_schema}: no column 'prompt', 'reward_model' (it has question, answer); a prompt file needs its "
        "prompt's and its answer's: name them with data.prompt_key and data.answer_key (default: the DAPO-Math-17k "
        "schema's prompt and reward_model.ground_truth)"
    )
    assert _one_line_error(tmp_path / "missing.parquet") == f"data file not found: {tmp_path / 'missing.parquet'}"


def test_parquet_round_trip(tmp_path):
    path = str(tmp_path / "train.parquet")
    rows = synthetic_arithmetic_rows(20, difficulty=2, split="train", seed=3)
    write_parquet_rows(rows + rows[:5], path)
    examples = load_prompts(path, CharTokenizer(), max_prompt_length=4096)
    assert len(examples) == 20
    assert examples[0].ground_truth == rows[0]["reward_model"]["ground_truth"]
    assert examples[0].solution == rows[0]["extra_info"]["solution"]


def test_synthetic_task_is_seeded_disjoint_and_self_consistent():
    train = synthetic_arithmetic_rows(300, difficulty=3, split="train", seed=1)
    evals = synthetic_arithmetic_rows(60, difficulty=3, split="eval", seed=1)
    assert train == synthetic_arithmetic_rows(300, difficulty=3, split="train", seed=1)

    def problems(rows):
        return {r["prompt"][0]["content"] for r in rows}

    assert not problems(train) & problems(evals)

    # Nor does eval hold the commuted twin of a training problem ("b + a" is "a + b", same solution).
    def operands(rows):
        return {tuple(sorted(c.split("What is ")[1].split("?")[0].split(" + "))) for c in problems(rows) if " + " in c}

    big_train = synthetic_arithmetic_rows(2000, difficulty=2, split="train")
    big_eval = synthetic_arithmetic_rows(200, difficulty=2, split="eval")
    assert len(operands(big_eval)) > 150 and not operands(big_train) & operands(big_eval)
    assert len(problems(train)) == 300
    for row in train[:50]:
        content = row["prompt"][0]["content"]
        assert content.startswith("Solve the following math problem step by step.")
        assert content == DAPO_PROMPT_TEMPLATE.format(problem=content.split("\n\n")[1])
        expression = content.split("\n\n")[1].removeprefix("What is ").removesuffix("?")
        assert str(eval(expression)) == row["reward_model"]["ground_truth"]
        assert compute_score(row["extra_info"]["solution"], row["reward_model"]["ground_truth"])["acc"]


def test_synthetic_task_refuses_impossible_requests():
    with pytest.raises(ValueError, match="difficulty"):
        synthetic_arithmetic_rows(5, difficulty=9)
    with pytest.raises(ValueError, match="difficulty 1 gives at most 72 distinct train problems; asked for 100"):
        synthetic_arithmetic_rows(100, difficulty=1)


def _examples(n):
    return rows_to_examples([_row(str(i)) for i in range(n)], CharTokenizer(), max_prompt_length=10)[0]


def test_sampler_shards_cover_the_global_batch_and_resume_exactly():
    examples = _examples(10)
    ranks = [PromptSampler(examples, seed=5, dp_rank=r, dp_size=2) for r in range(2)]
    first = [[e.index for e in s.next_batch(4)] for s in ranks]
    assert len(set(first[0]) | set(first[1])) == 4
    reference = PromptSampler(examples, seed=5)
    assert [e.index for e in reference.next_batch(4)] == first[0] + first[1]

    sampler = PromptSampler(examples, seed=5)
    for _ in range(3):
        sampler.next_batch(4)  # crosses an epoch boundary (12 > 10)
    saved = sampler.state_dict()
    expected = [e.index for e in sampler.next_batch(4)]
    resumed = PromptSampler(examples, seed=5)
    resumed.load_state_dict(saved)
    assert [e.index for e in resumed.next_batch(4)] == expected
    assert saved["epoch"] == 1


def test_sampler_refuses_mismatched_state_and_indivisible_batches():
    sampler = PromptSampler(_examples(10), seed=5, dp_size=2)
    with pytest.raises(ValueError, match="does not divide"):
        sampler.next_batch(3)
    other = PromptSampler(_examples(8), seed=5)
    with pytest.raises(ValueError, match="saved for 10 prompts"):
        other.load_state_dict(sampler.state_dict())


def test_synthetic_solutions_can_mix_answer_formats():
    rows = synthetic_arithmetic_rows(400, difficulty=2, split="train", seed=2, answer_line_share=0.5)
    same_problems = synthetic_arithmetic_rows(400, difficulty=2, split="train", seed=2)
    assert [r["prompt"] for r in rows] == [r["prompt"] for r in same_problems]
    scored = [compute_score(r["extra_info"]["solution"], r["reward_model"]["ground_truth"])["acc"] for r in rows]
    with_line = ["\nAnswer: " in r["extra_info"]["solution"] for r in rows]
    assert scored == with_line  # prose solutions state the right result but miss the format the reward reads
    assert 0.4 < sum(with_line) / len(rows) < 0.6
    with pytest.raises(ValueError, match="answer_line_share"):
        synthetic_arithmetic_rows(5, answer_line_share=1.5)
