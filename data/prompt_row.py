"""One row of a prompt set, read field by field: what each field may hold, and why a row is skipped.

The columns are the configuration's (`Columns`: data.prompt_key, data.answer_key, data.prompt_template); the
defaults are the DAPO-Math-17k schema's:

    {"data_source": str, "prompt": [{"role": str, "content": str}, ...],
     "reward_model": {"ground_truth": str | [str, ...], ...}, "extra_info": {"solution": str, ...}}

GSM8K's, for one, are {"question": str, "answer": str}: prompt_key "question", answer_key "answer". The prompt
column holds chat messages, used as they are, or a text, which becomes one user message (rendered with
data.prompt_template). The answer key is a column, or a path into records ("reward_model.ground_truth": the field
ground_truth of column reward_model). Every other column is the row's `extra`: a user's reward function receives
each as a keyword argument (rewards/scorer.py).

Every value a parquet file can put in a field is either read as stated here or makes the row skipped with
a reason (the load summary counts the rows per reason); nothing is converted silently:

  * text fields (a text prompt, message role and content, data_source, answers, solution): str, or bytes
    that decode as UTF-8 (a binary column written without the string annotation, as older Spark and Impala
    versions do); any other type skips the row;
  * the ground truth (default reward_model.ground_truth): one answer, or a list of accepted answers (a
    response is correct when it matches any of them, as verl's QA scorers treat a list of golden answers:
    search_r1_like_qa_em.em_check; verl's math_dapo itself takes a single string). An answer is text, or an
    int (written in decimal), or a finite float (an integral float, as a pandas int column with a missing
    value stores its ints, written as the int; any other float in Python's shortest round-trip form: 0.5 ->
    "0.5"). A bool, a record, a nested list, NaN, an empty list and an answer that normalises to nothing
    (which every answer that normalises to nothing would match) skip the row;
  * data_source: text, or absent / null / "" (then "unknown");
  * extra_info: a record or absent; extra_info.solution (the worked solution of the supervised warm-up):
    text or absent. extra_info of another type is metadata this reader does not use.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from errors import DataError
from model.tokenizer import CHAT_ROLES
from rl.math_normalize import normalize_final_answer
from rl.reward import GroundTruth
from tasks.catalog import DAPO_PROMPT_TEMPLATE


class RowSkipped(ValueError):
    """A row that cannot be used; the message is the reason, worded alike for every row with the problem."""


@dataclass(frozen=True)
class Columns:
    """Where a row's prompt and ground truth are (data.prompt_key, data.answer_key), and how a text prompt becomes
    the user message (data.prompt_template); the defaults are the DAPO-Math-17k schema's."""

    prompt: str = "prompt"
    answer: str = "reward_model.ground_truth"
    template: str = "dapo"

    @property
    def required(self) -> tuple[str, str]:
        """The columns a set must have: the prompt's, and the first part of the answer's path."""
        return self.prompt, self.answer.split(".")[0]

    def render(self, text: str) -> str:
        """A text prompt as its user message: in DAPO's template, as it is ("none"), or in the given one."""
        template = {"dapo": DAPO_PROMPT_TEMPLATE, "none": "{problem}"}.get(self.template, self.template)
        return template.replace("{problem}", text)


DAPO_COLUMNS = Columns()  # the DAPO-Math-17k schema's, which the synthetic tasks write too


@dataclass(frozen=True)
class PromptRow:
    """What a usable row holds, each field as the reader uses it."""

    messages: list[dict[str, str]]
    ground_truth: GroundTruth
    data_source: str
    solution: str | None
    extra: dict[str, Any] = field(default_factory=dict)  # the columns other than `Columns.required`


def _kind(value: object) -> str:
    """'a list', 'an int', ... for a reason."""
    name = type(value).__name__
    return f"an {name}" if name[0] in "aeiou" else f"a {name}"


def _text(value: object, field: str) -> str:
    """A text field: a str, or bytes that are UTF-8."""
    if isinstance(value, str):
        return value
    if isinstance(value, (bytes, bytearray)):
        try:
            return bytes(value).decode("utf-8")
        except UnicodeDecodeError:
            raise RowSkipped(f"{field} is bytes that are not UTF-8 text") from None
    if value is None:
        raise RowSkipped(f"{field} is missing")
    raise RowSkipped(f"{field} is {_kind(value)}, not text")


def _answer(value: object, field: str) -> str:
    """One accepted answer as the text the scorer compares (see the module docstring)."""
    if isinstance(value, bool):
        raise RowSkipped(f"{field} is a bool, not an answer")
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise RowSkipped(f"{field} is {value}, not an answer")  # NaN: pandas' missing value
        return str(int(value)) if value.is_integer() else repr(value)
    text = _text(value, field)
    if not normalize_final_answer(text):
        raise RowSkipped(f"{field} is empty once normalised; every answer that normalises to nothing would match it")
    return text


def field_at(row: Mapping[str, object], path: str) -> object:
    """The value at `path` ("a.b": field b of the record in column a): None where a part of it is missing; a
    RowSkipped where a part is not a record."""
    value: object = row
    parts = path.split(".")
    for depth, part in enumerate(parts):
        if value is None:
            return None
        if not isinstance(value, Mapping):
            raise RowSkipped(f"{'.'.join(parts[:depth])} is {_kind(value)}, not a record with a {part}")
        value = value.get(part)
    return value


def _ground_truth(row: Mapping[str, object], path: str) -> GroundTruth:
    """The answer at `path`, read as the module docstring says."""
    value = field_at(row, path)
    if value is None:
        raise RowSkipped(f"{path} is missing")
    if isinstance(value, (list, tuple)):
        for item in value:
            if isinstance(item, (list, tuple, Mapping)):
                raise RowSkipped(f"{path} is a list holding {_kind(item)}; a list of answers holds answers")
        answers = tuple(dict.fromkeys(_answer(item, f"an answer in {path}") for item in value))
        if not answers:
            raise RowSkipped(f"{path} is an empty list")
        return answers[0] if len(answers) == 1 else answers
    if isinstance(value, Mapping):
        raise RowSkipped(f"{path} is a record, not an answer or a list of answers")
    return _answer(value, path)


def _messages(prompt: object, columns: Columns) -> list[dict[str, str]]:
    key = columns.prompt
    if isinstance(prompt, (str, bytes, bytearray)):
        return [{"role": "user", "content": columns.render(_text(prompt, key))}]
    if prompt is None:
        raise RowSkipped(f"{key} is missing")
    if not isinstance(prompt, (list, tuple)):
        raise RowSkipped(f"{key} is {_kind(prompt)}, not text or a list of {{role, content}} messages")
    if not prompt:
        raise RowSkipped(f"{key} is an empty list")
    messages = []
    for message in prompt:  # every row of a file passes here (duplicates included): str takes the short path
        if not isinstance(message, Mapping):
            raise RowSkipped(f"a {key!r} message is {_kind(message)}, not a {{role, content}} record")
        role, content = message.get("role"), message.get("content")
        role = role if type(role) is str else _text(role, f"a {key!r} message's role")
        if role not in CHAT_ROLES:
            raise RowSkipped(f"a {key!r} message has role {role!r}; the chat template knows {', '.join(CHAT_ROLES)}")
        content = content if type(content) is str else _text(content, f"a {key!r} message's content")
        messages.append({"role": role, "content": content})
    return messages


def read_messages(row: object, columns: Columns = DAPO_COLUMNS) -> list[dict[str, str]]:
    """The prompt messages of one row (what identifies a duplicate); RowSkipped with the reason."""
    if not isinstance(row, Mapping):
        raise RowSkipped(f"the row is {_kind(row)}, not a record")
    return _messages(row.get(columns.prompt), columns)


def read_row(
    row: Mapping[str, object], messages: list[dict[str, str]] | None = None, columns: Columns = DAPO_COLUMNS
) -> PromptRow:
    """The fields of one row, read as the module docstring says; RowSkipped with the reason. `messages`: the row's
    `read_messages`, when the caller has read them already."""
    messages = read_messages(row, columns) if messages is None else messages
    ground_truth = _ground_truth(row, columns.answer)
    source = row.get("data_source")
    data_source = "unknown" if source is None or source == "" else _text(source, "data_source") or "unknown"
    extra = row.get("extra_info")
    solution = extra.get("solution") if isinstance(extra, Mapping) else None
    if solution is not None:
        solution = _text(solution, "extra_info.solution")
    others = {name: value for name, value in row.items() if name not in columns.required}
    return PromptRow(messages, ground_truth, data_source, solution, others)


def check_columns(source: str, columns: Sequence[str], required: Sequence[str], what: str) -> None:
    """A DataError naming the columns of `required` (Columns.required) that `source`, a `what` ("prompt file",
    "prompt set") with `columns`, lacks."""
    missing = [c for c in required if c not in columns]
    if missing:
        raise DataError(
            f"{source}: no column {', '.join(repr(c) for c in missing)} (it has {', '.join(columns)}); a {what} needs "
            f"its prompt's and its answer's: name them with data.prompt_key and data.answer_key (default: the "
            "DAPO-Math-17k schema's prompt and reward_model.ground_truth)"
        )
