"""Your own task (docs/your-own-task.md): a prompt set read by its own columns, a reward function of the user's by
path, and the GSM8K example end to end on a CPU: the shipped jsonl in GSM8K's columns, the demo base, the example
reward in worker processes; a reward that fails stops the run with a checkpoint and the fixed rerun resumes."""

import json
import os
import sys

import pytest

import eval as eval_command
import train
from checkpoint.manager import CheckpointManager
from data.prompt_row import Columns
from data.prompts import load_prompts, rows_to_examples
from errors import DataError, RewardError
from model.tokenizer import Tokenizer
from tasks.arithmetic import synthetic_arithmetic_rows
from tasks.catalog import DAPO_PROMPT_TEMPLATE
from tests.parquet_rows import write_parquet_rows

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))
from gsm8k_reward import gsm8k_reward  # noqa: E402


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.from_dir(os.path.join(ROOT, "bases", "demo"))


# ------------------------------------------------------------------------------------------ columns


def test_a_text_prompt_becomes_one_user_message_in_the_chosen_template(tokenizer):
    rows = [{"question": "What is 2 + 3?", "answer": "#### 5", "source": "mine", "id": 7}]
    for template, content in [
        ("dapo", DAPO_PROMPT_TEMPLATE.replace("{problem}", "What is 2 + 3?")),
        ("none", "What is 2 + 3?"),
        ("Q: {problem} A: \\boxed{}", "Q: What is 2 + 3? A: \\boxed{}"),
    ]:
        (example,), _ = rows_to_examples(
            rows, tokenizer, max_prompt_length=512, columns=Columns("question", "answer", template)
        )
        assert example.messages == [{"role": "user", "content": content}]
        assert example.prompt_ids == tokenizer.encode_chat(example.messages)
        assert example.ground_truth == "#### 5" and example.extra == {"source": "mine", "id": 7}


def test_a_message_prompt_and_a_nested_answer_path_are_read_and_the_other_columns_kept(tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 3?"}]
    row = {"chat": messages, "label": {"gold": {"value": 5}, "style": "rule"}, "data_source": "s", "meta": {"a": [1]}}
    (example,), _ = rows_to_examples(
        [row], tokenizer, max_prompt_length=512, columns=Columns("chat", "label.gold.value")
    )
    assert example.messages == messages and example.ground_truth == "5" and example.data_source == "s"
    assert example.extra == {"data_source": "s", "meta": {"a": [1]}}  # every column but chat and label


def test_a_missing_or_wrongly_typed_column_is_one_line_naming_it_and_the_columns_there(tmp_path, tokenizer):
    path = str(tmp_path / "gsm.parquet")
    write_parquet_rows([{"question": "What is 2 + 3?", "answer": "#### 5", "n": 1}], path)
    with pytest.raises(
        DataError, match=r"no column 'prompt', 'reward_model' \(it has question, answer, n\); a prompt "
    ):
        load_prompts(path, tokenizer, max_prompt_length=512)
    with pytest.raises(DataError, match=r"no column 'answr' \(it has question, answer, n\); .*data.answer_key"):
        load_prompts(path, tokenizer, max_prompt_length=512, columns=Columns("question", "answr"))
    line = r"no usable row \(1 rows read\); first problem: row 0: n is an int, not text or a list of \{role, content\}"
    with pytest.raises(DataError, match=line + r" messages \(its columns: question, answer, n\)$"):
        load_prompts(path, tokenizer, max_prompt_length=512, columns=Columns("n", "answer"))
    with pytest.raises(DataError, match=r"row 0: answer is a str, not a record with a value \(its columns: "):
        load_prompts(path, tokenizer, max_prompt_length=512, columns=Columns("question", "answer.value"))


def test_the_default_columns_read_the_dapo_schema_as_before(tokenizer):
    rows = synthetic_arithmetic_rows(6, split="train")
    examples, _ = rows_to_examples(rows, tokenizer, max_prompt_length=512)
    assert [e.messages for e in examples] == [r["prompt"] for r in rows]
    assert [e.ground_truth for e in examples] == [r["reward_model"]["ground_truth"] for r in rows]
    assert examples[0].extra == {k: rows[0][k] for k in ("data_source", "ability", "extra_info")}


# ------------------------------------------------------------------------------------------ the GSM8K reward


@pytest.mark.parametrize(
    "response, answer, correct, pred, boxed",
    [
        ("She has 72 clips in all.", "48 + 24 = 72\n#### 72", True, "72", 0.0),
        ("So the total is $1,000.", "#### 1000", True, "1000", 0.0),  # a comma in the response
        ("It costs 1000 dollars", "#### 1,000", True, "1000", 0.0),  # a comma in the answer
        ("The change is -3 degrees.", "#### -3", True, "-3", 0.0),  # negative
        ("The change is 3 degrees.", "#### -3", False, "3", 0.0),
        ("Each gets 2.50 dollars", "#### 2.5", True, "2.5", 0.0),  # decimals compare as numbers
        ("It takes 0.5 hours", "#### .5", True, "0.5", 0.0),
        ("First 12, then \\boxed{18}, and 20 left.", "#### 18", True, "18", 1.0),  # the box wins over the last number
        ("\\boxed{x} but 5", "#### 5", True, "5", 0.0),  # a box without a number does not count
        ("I do not know.", "#### 5", False, None, 0.0),
        ("7 apples", "7", True, "7", 0.0),  # "####" absent: the answer's own last number
        ("The answer is 8", "There are 3 + 5 = 8 apples", True, "8", 0.0),
    ],
)
def test_the_gsm8k_reward_on_hand_worked_cases(response, answer, correct, pred, boxed):
    (result,) = gsm8k_reward([response], [answer], data_source=["gsm8k"])
    assert result == {"score": 1.0 if correct else -1.0, "acc": correct, "pred": pred, "boxed": boxed}


def test_the_shipped_gsm8k_sums_are_the_synthetic_sums_in_gsm8k_columns():
    """examples/data/gsm8k_sums_*.jsonl, made again: the arithmetic task's level-2 splits (seed 0) asked as GSM8K
    asks its questions, each answer ending in "#### N"."""
    for name, split, count in (("train", "train", 256), ("test", "eval", 64)):
        with open(os.path.join(ROOT, "examples", "data", f"gsm8k_sums_{name}.jsonl")) as f:
            shipped = [json.loads(line) for line in f]
        expected = []
        for row in synthetic_arithmetic_rows(count, difficulty=2, split=split, seed=0):
            problem, truth = row["extra_info"]["solution"].split(" = ")[0], row["reward_model"]["ground_truth"]
            expected.append({"question": f"What is {problem}?", "answer": f"{problem} = {truth}\n#### {truth}"})
        assert shipped == expected


# ------------------------------------------------------------------------------------------ end to end

SMALL = ["--training.train_batch_size=8", "--training.mini_batch_size=8", "--rollout.n=4", "--eval.eval_size=8"]
SMALL += ["--eval.k=2", "--metrics.progress=false", "--metrics.tensorboard=false", "--checkpoint.export_hf=false"]


def _run(tmp_path, *extra):
    config = os.path.join(ROOT, "configs", "gsm8k_cpu.toml")
    return ["--config", config, f"--job.run_dir={tmp_path}", "--job.name=run", *SMALL, *extra]


def _rows(tmp_path):
    with open(tmp_path / "run" / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


def test_the_gsm8k_cpu_recipe_runs_its_five_steps_with_the_example_reward(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)  # the config's paths are the repository's
    assert train.main(_run(tmp_path)) == 0
    rows = _rows(tmp_path)
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3, 4, 5]
    assert [r["step"] for r in rows if "eval/avg_at_k" in r] == [0, 5]
    assert all(r["reward/gsm8k_reward/boxed"] == 0.0 for r in rows if "loss" in r)  # the base never boxes
    assert all(0 < r["acc/mean"] < 1 for r in rows if "loss" in r)


FLAKY = """
import os
CALLS = 0
def reward(responses, ground_truths, **columns):
    global CALLS
    CALLS += 1
    if CALLS == {fail_at}:
        raise ValueError("cannot parse " + repr(responses[0][:8]))
    return [float(sum(map(ord, r)) % 2) for r in responses]
"""


def test_a_reward_that_fails_mid_run_stops_it_with_a_checkpoint_and_the_fixed_rerun_resumes(tmp_path, monkeypatch):
    """Each of the two workers is called once by the check at start and once per step (one generation round); the
    third call, step 2's, raises. The run stops with step 1 checkpointed and one line; fixed, the same command
    resumes at step 2."""
    monkeypatch.chdir(ROOT)
    function = tmp_path / "flaky.py"
    function.write_text(FLAKY.format(fail_at=3))
    argv = _run(tmp_path, f"--reward.function={function}:reward", "--training.steps=3", "--eval.at_start=false")
    argv += ["--eval.at_end=false", "--algorithm.dynamic_sampling=false"]
    with pytest.raises(RewardError) as info:
        train.main(argv)
    line = info.value.line()
    assert line.startswith(f"reward error: reward function {function}:reward raised ValueError: cannot parse ")
    assert line.endswith(
        "; the run stops with a checkpoint of its last completed step: fix it, then rerun the same command"
    )
    assert CheckpointManager(str(tmp_path / "run" / "checkpoints")).complete_steps() == [1]
    assert [r["step"] for r in _rows(tmp_path)] == [1]
    function.write_text(FLAKY.format(fail_at=-1))
    assert train.main(argv) == 0
    assert [r["step"] for r in _rows(tmp_path)] == [1, 2, 3]


@pytest.mark.parametrize(
    "function, line",
    [
        ("examples/no_such_file.py:reward", r"no_such_file.py:reward cannot be imported: FileNotFoundError: "),
        ("examples/gsm8k_reward.py:gsm8k", r"gsm8k_reward.py:gsm8k cannot be imported: LookupError: .* no function"),
        ("examples/gsm8k_reward.py:last_number", r":last_number raised TypeError: last_number\(\) takes 1 positional"),
        ("examples/gsm8k_reward.py:NUMBER", r":NUMBER cannot be imported: LookupError: .* no function 'NUMBER'"),
    ],
)
def test_a_reward_that_cannot_be_used_is_one_line_before_anything_is_written(
    function, line, tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(ROOT)
    with pytest.raises(SystemExit) as exited:
        train.run_cli(_run(tmp_path, f"--reward.function={function}"))
    assert exited.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("reward error: reward function ") and __import__("re").search(line, err[-1]), err[-1]
    assert not (tmp_path / "run").exists()  # the launch was refused: its run folder is gone


def test_eval_scores_with_the_runs_reward_function(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    argv = ["--config", "configs/gsm8k_cpu.toml", "--model=bases/demo", "--eval.eval_size=8", "--eval.k=2"]
    report = eval_command.main([*argv, "--metrics.progress=false"])
    assert report["reward"] == f"{ROOT}/examples/gsm8k_reward.py:gsm8k_reward"
    assert report["overall"]["num_problems"] == 8
    rule = eval_command.main([*argv, "--metrics.progress=false", "--reward.function="])
    assert rule["reward"] == "rule"
    # The same responses (same seed): every one the rule reward counts (an "Answer: N" line) GSM8K's counts too.
    assert report["overall"]["avg@2"] >= rule["overall"]["avg@2"] and rule["overall"]["avg@2"] < 1
