"""One row of the DAPO-Math-17k schema, read field by field: what each field may hold, and why a row is skipped.

    {"data_source": str, "prompt": [{"role": str, "content": str}, ...],
     "reward_model": {"ground_truth": str | [str, ...], ...}, "extra_info": {"solution": str, ...}}

Every value a parquet file can put in a field is either read as stated here or makes the row skipped with
a reason (the load summary counts the rows per reason); nothing is converted silently:

  * text fields (message role and content, data_source, answers, solution): str, or bytes that decode as
    UTF-8 (a binary column written without the string annotation, as older Spark and Impala versions do);
    any other type skips the row;
  * reward_model.ground_truth: one answer, or a list of accepted answers (a response is correct when it
    matches any of them, as verl's QA scorers treat a list of golden answers: search_r1_like_qa_em.em_check;
    verl's math_dapo itself takes a single string). An answer is text, or an int (written in decimal), or
    a finite float (an integral float, as a pandas int column with a missing value stores its ints, written
    as the int; any other float in Python's shortest round-trip form: 0.5 -> "0.5"). A bool, a record, a
    nested list, NaN, an empty list and an answer that normalises to nothing (which every answer that
    normalises to nothing would match) skip the row;
  * data_source: text, or absent / null / "" (then "unknown");
  * extra_info: a record or absent; extra_info.solution (the worked solution of the supervised warm-up):
    text or absent. extra_info of another type is metadata this reader does not use.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from errors import DataError
from model.tokenizer import CHAT_ROLES
from rl.math_normalize import normalize_final_answer
from rl.reward import GroundTruth


class RowSkipped(ValueError):
    """A row that cannot be used; the message is the reason, worded alike for every row with the problem."""


@dataclass(frozen=True)
class PromptRow:
    """What a usable row holds, each field as the reader uses it."""

    messages: list[dict[str, str]]
    ground_truth: GroundTruth
    data_source: str
    solution: str | None


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


def _ground_truth(reward_model: object) -> GroundTruth:
    field = "reward_model.ground_truth"
    if reward_model is None:
        raise RowSkipped("reward_model.ground_truth is missing")
    if not isinstance(reward_model, Mapping):
        raise RowSkipped(f"reward_model is {_kind(reward_model)}, not a record with a ground_truth")
    value = reward_model.get("ground_truth")
    if value is None:
        raise RowSkipped(f"{field} is missing")
    if isinstance(value, (list, tuple)):
        for item in value:
            if isinstance(item, (list, tuple, Mapping)):
                raise RowSkipped(f"{field} is a list holding {_kind(item)}; a list of answers holds answers")
        answers = tuple(dict.fromkeys(_answer(item, f"an answer in {field}") for item in value))
        if not answers:
            raise RowSkipped(f"{field} is an empty list")
        return answers[0] if len(answers) == 1 else answers
    if isinstance(value, Mapping):
        raise RowSkipped(f"{field} is a record, not an answer or a list of answers")
    return _answer(value, field)


def _messages(prompt: object) -> list[dict[str, str]]:
    if prompt is None:
        raise RowSkipped("prompt is missing")
    if not isinstance(prompt, (list, tuple)):
        raise RowSkipped(f"prompt is {_kind(prompt)}, not a list of {{role, content}} messages")
    if not prompt:
        raise RowSkipped("prompt is an empty list")
    messages = []
    for message in prompt:  # every row of a file passes here (duplicates included): str takes the short path
        if not isinstance(message, Mapping):
            raise RowSkipped(f"a 'prompt' message is {_kind(message)}, not a {{role, content}} record")
        role, content = message.get("role"), message.get("content")
        role = role if type(role) is str else _text(role, "a 'prompt' message's role")
        if role not in CHAT_ROLES:
            raise RowSkipped(f"a 'prompt' message has role {role!r}; the chat template knows {', '.join(CHAT_ROLES)}")
        content = content if type(content) is str else _text(content, "a 'prompt' message's content")
        messages.append({"role": role, "content": content})
    return messages


def read_messages(row: object) -> list[dict[str, str]]:
    """The prompt messages of one row (what identifies a duplicate); RowSkipped with the reason."""
    if not isinstance(row, Mapping):
        raise RowSkipped(f"the row is {_kind(row)}, not a record")
    return _messages(row.get("prompt"))


def read_row(row: Mapping[str, object], messages: list[dict[str, str]] | None = None) -> PromptRow:
    """The fields of one row of the schema, read as the module docstring says; RowSkipped with the reason.
    `messages`: the row's `read_messages`, when the caller has read them already."""
    messages = read_messages(row) if messages is None else messages
    ground_truth = _ground_truth(row.get("reward_model"))
    source = row.get("data_source")
    data_source = "unknown" if source is None or source == "" else _text(source, "data_source") or "unknown"
    extra = row.get("extra_info")
    solution = extra.get("solution") if isinstance(extra, Mapping) else None
    if solution is not None:
        solution = _text(solution, "extra_info.solution")
    return PromptRow(messages, ground_truth, data_source, solution)


def check_columns(source: str, columns: Sequence[str], required: Sequence[str], what: str) -> None:
    """A DataError naming the columns of `required` (the DAPO-Math-17k schema's) that `source`, a `what` ("prompt
    file", "prompt set") with `columns`, lacks."""
    missing = [c for c in required if c not in columns]
    if missing:
        raise DataError(
            f"{source}: no column {', '.join(repr(c) for c in missing)} (it has {', '.join(columns)}); "
            f"a {what} needs the columns {', '.join(required)} of the DAPO-Math-17k schema"
        )
