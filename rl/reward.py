"""Rule-based math reward, soft overlong punishment (Eq. 13) and overlong filtering.

Reward (the DAPO recipe's `math_dapo` rule):

    R(o, a) = +1 if the final answer of o equals a, else -1

(a may be a list of accepted answers: +1 when the final answer equals any of them.)

Only the last `SCORED_CHARS` = 300 characters of a response are read (the longest MATH-500 answer
has 159 characters; reading more only costs time). The final answer is found as follows:

  * default mode: the last match of the case-insensitive pattern `Answer\\s*:\\s*([^\\n]+)`; the
    prediction and the ground truth both go through `normalize_final_answer` (Minerva rules,
    rl/math_normalize.py) and must be equal as strings;
  * no "Answer:" line: the last `\\boxed{...}` among the last `BOXED_CHARS` = 100 characters,
    compared verbatim (no normalisation) with the ground truth;
  * `strict_box=True`: only that boxed check.

A response with no extractable answer scores -1 and reports `pred=None`. The scorer never raises
on a string and runs in time linear in the (bounded) scored window plus the ground truth.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING

import torch

from rl import checks
from rl.math_normalize import last_boxed_content, normalize_final_answer

if TYPE_CHECKING:
    from model.tokenizer import Tokenizer

GroundTruth = str | tuple[str, ...]  # one answer, or the accepted answers (data/prompt_row.py reads a row's)
SCORED_CHARS = 300
BOXED_CHARS = 100
_ANSWER_LINE = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")


def compute_score(solution: str, ground_truth: str | Sequence[str], strict_box: bool = False) -> dict:
    """Score one response: `{"score": 1.0 | -1.0, "acc": bool, "pred": str | None}`.

    `ground_truth` is the answer, or a sequence of accepted answers: correct when the prediction matches
    any of them (each compared as a single answer is). `pred` is the normalised "Answer:" text, or the
    verbatim boxed content in the boxed modes, or None when nothing could be extracted.
    """
    answers = checks.answers(solution, ground_truth)
    window = solution[-SCORED_CHARS:]
    pred: str | None
    found = [] if strict_box else _ANSWER_LINE.findall(window)
    if found:
        pred = normalize_final_answer(found[-1])
        correct = any(pred == normalize_final_answer(answer) for answer in answers)
    else:
        pred = last_boxed_content(window[-BOXED_CHARS:])
        correct = pred is not None and pred in answers
    return {"score": 1.0 if correct else -1.0, "acc": correct, "pred": pred}


def response_text(tokenizer: Tokenizer, token_ids: Sequence[int], stop_ids: Collection[int] = ()) -> str:
    """The text the reward reads, in training and in evaluation alike.

    A completion holds the generated ids only (no padding), ending with the stop token when it finished
    with "stop". The ids are decoded with special tokens skipped, as verl's reward managers decode the
    valid response ids: the stop token (<|im_end|>, <|endoftext|>) and any other special token the policy
    wrote inside its text are not text. A final stop id that is not a special token of the tokenizer is
    dropped as well: it ended the response and is no part of the answer.
    """
    ids = list(token_ids)
    if ids and ids[-1] in stop_ids:
        ids.pop()
    return tokenizer.decode(ids, skip_special_tokens=True)


def overlong_penalty(length: int, max_len: int, buffer_len: int, factor: float = 1.0) -> float:
    """Soft overlong punishment (DAPO Eq. 13), lengths in tokens, L_max = max_len, L_cache = buffer_len:

        R_length(y) = 0                                   if |y| <= L_max - L_cache
                    = ((L_max - L_cache) - |y|) / L_cache  if L_max - L_cache < |y| <= L_max
                    = -1                                  if |y| > L_max

    scaled by `factor`; it is added to the correctness reward. The middle branch equals -1 at
    |y| = L_max, so the penalty is continuous and never below -factor.
    """
    length, max_len, buffer_len = checks.overlong_lengths(length, max_len, buffer_len, factor)
    expected = max_len - buffer_len
    if length <= expected:
        return 0.0
    if length >= max_len:
        return -float(factor)
    return (expected - length) / buffer_len * factor


def overlong_filter_mask(loss_mask: torch.Tensor, finish_reasons: Sequence[str]) -> torch.Tensor:
    """Overlong filtering: a copy of `loss_mask` ([B, T]) with the rows of truncated samples zeroed.

    A sample is truncated when its finish reason is "length" (it hit the generation limit). Its
    tokens then take no part in the loss, so the policy is not punished for an unfinished answer.
    """
    checks.finish_reasons(loss_mask, finish_reasons)
    truncated = torch.tensor(
        [reason == "length" for reason in finish_reasons], dtype=torch.bool, device=loss_mask.device
    )
    return torch.where(truncated[:, None], torch.zeros_like(loss_mask), loss_mask)
