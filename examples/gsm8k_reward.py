"""A reward function for GSM8K (openai/gsm8k), to copy and change for your own task.

    [reward]
    function = "examples/gsm8k_reward.py:gsm8k_reward"

GSM8K's `answer` column ends with the result after "####" ("... so she has 72 clips.\n#### 72"). A response is
correct when its final answer, the content of its last \\boxed{} or else the last number it writes, equals that
result as a number: "1,000", "1000" and "1000.00" are equal; "-3" and "3" are not. An answer without "####" is read
the same way (its last number), so a data set whose answers are plain numbers works as it is.

The trainer calls it with a batch (docs/your-own-task.md): the decoded responses, the ground truths (the column
named by data.answer_key) and the prompt set's other columns as keyword arguments, which this function does not
need. It returns one dict per response: "score" (+1 correct, -1 not, as DAPO's rule reward), "acc" (what dynamic
sampling and avg@k read), "pred" (the answer it read, for maj@k and the rollout dumps) and "boxed", a number the
trainer logs each step as reward/gsm8k_reward/boxed: the share of responses that put their answer in \\boxed{}.
It needs nothing beyond the standard library.
"""

import re
from decimal import Decimal

NUMBER = re.compile(r"-?[\d,]*\.?\d+")  # 72, -3, 1,000, 0.5, .5
BOXED = re.compile(r"\\boxed\{([^{}]*)\}")


def last_number(text: str) -> Decimal | None:
    """The last number in `text` (thousands commas dropped), or None."""
    found = NUMBER.findall(text)
    return Decimal(found[-1].replace(",", "")) if found else None


def gsm8k_reward(responses: list[str], ground_truths: list[str], **columns: list) -> list[dict]:
    """One {"score", "acc", "pred", "boxed"} per response (module docstring)."""
    results = []
    for response, truth in zip(responses, ground_truths):
        expected = last_number(truth.rpartition("####")[2])  # the whole answer when it has no "####"
        boxed = [number for content in BOXED.findall(response) if (number := last_number(content)) is not None]
        predicted = boxed[-1] if boxed else last_number(response)  # the last boxed number, else the last number
        correct = predicted is not None and predicted == expected
        pred = None if predicted is None else format(predicted.normalize(), "f")  # 1000, not 1E+3
        results.append({"score": 1.0 if correct else -1.0, "acc": correct, "pred": pred, "boxed": float(bool(boxed))})
    return results
