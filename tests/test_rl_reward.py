"""Rule-based reward (math scorer), soft overlong punishment (Eq. 13) and overlong filtering."""

import gc
import re
import time

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rl.math_normalize import (
    keep_first_dollar_pair,
    last_boxed_content,
    normalize_final_answer,
    unwrap_boxed_to_last_brace,
    unwrap_to_first_brace,
)
from rl.reward import compute_score, overlong_filter_mask, overlong_penalty

# (solution, ground truth, expected acc, expected pred) in the default mode.
DEFAULT_MODE_CASES = [
    # "Answer:" extraction
    ("Answer: 42", "42", True, "42"),
    ("answer: 42", "42", True, "42"),
    ("ANSWER : 42", "42", True, "42"),
    ("Answer:42", "42", True, "42"),
    ("Answer:\t42", "42", True, "42"),
    ("Answer:\n\n42", "42", True, "42"),  # \s* after the colon crosses newlines
    ("The final answer: 7", "7", True, "7"),
    ("Answer: 41\nAnswer: 42", "42", True, "42"),  # the last Answer line wins
    ("Answer: 41\nAnswer: 42", "41", False, "42"),
    ("answer:5\nanswer:6", "6", True, "6"),
    ("Answer: 3\n\nMore text after the answer.", "3", True, "3"),  # the line ends the answer
    ("Answer: 42\r\nbye", "42", True, "42"),  # the trailing \r is stripped
    ("Answer: Answer: 5", "5", False, "Answer:5"),  # one match swallows the whole line
    ("The answer is 5", "5", False, None),  # no colon, no box
    ("Answer:", "5", False, None),  # nothing after the colon
    ("Answer: ", "", True, ""),  # a space is an answer; it normalises to "" (exact equality)
    ("Answer: \\boxed{41}\nAnswer: 42", "42", True, "42"),
    ("\\boxed{41}\nAnswer: 42", "42", True, "42"),  # an Answer line beats a box
    ("Answer: 41 \\boxed{42}", "42", False, "4142"),  # the box is unwrapped inside the line
    # Minerva normalisation of the prediction
    ("Answer: x = 5", "5", True, "5"),  # text after the last "="
    ("Answer: 5 = x", "5", False, "x"),
    ("Answer: $42$", "42", True, "42"),
    ("Answer: \\$42", "42", True, "42"),
    ("Answer: \\$1.50", "1.50", True, "1.50"),
    ("Answer: 42 dollars", "42", True, "42"),
    ("Answer: 5 Dollars", "5", False, "5Dollars"),  # unit words are case-sensitive
    ("Answer: 5 inches", "5", True, "5"),
    ("Answer: 12 square feet", "12", True, "12"),
    ("Answer: 100 km", "100", True, "100"),
    ("Answer: 10 units", "10", True, "10"),
    ("Answer: 7 ways", "7", True, "7"),
    ("Answer: 25 students", "25", True, "25"),
    ("Answer: 5 minutes", "5", True, "5"),
    ("Answer: 5 points", "5", True, "5"),
    ("Answer: 6 cm^2", "6", False, "6^2"),  # "cm" goes, the exponent stays
    ("Answer: 4 \\text{ cm}", "4", True, "4"),
    ("Answer: 90^\\circ", "90", True, "90"),
    ("Answer: 90^{\\circ}", "90", True, "90"),
    ("Answer: 5\\%", "5", False, "5\\%"),  # percent signs are kept
    ("Answer: 1,000", "1000", True, "1000"),  # commas of an all-digit number go
    ("Answer: 1,000", "1,000", True, "1000"),  # ...in the ground truth too
    ("Answer: 1,000.5", "1000.5", False, "1,000.5"),  # not all digits: commas stay
    ("Answer: 3, 4", "34", True, "34"),  # a digit list collapses like a number
    ("Answer: 3 \\text{and} 4", "3,4", True, "34"),
    ("Answer: 10\\;000", "10000", True, "10000"),
    ("Answer: 10{,}000", "10000", True, "10000"),
    ("Answer: \\frac12", "\\frac{1}{2}", True, "\\frac{1}{2}"),  # shorthand repaired
    ("Answer: \\frac{1}{2}", "\\frac12", True, "\\frac{1}{2}"),
    ("Answer: \\dfrac{1}{2}", "\\frac{1}{2}", False, "\\dfrac{1}{2}"),
    ("Answer: 1/2", "\\frac{1}{2}", False, "1/2"),
    ("Answer: 0.5", "\\frac{1}{2}", False, "0.5"),  # no numeric equivalence
    ("Answer: \\frac{1}{2}.", "\\frac{1}{2}", False, "\\frac{1}{2}."),
    ("Answer: $\\frac{1}{2}.$", "\\frac{1}{2}", True, "\\frac{1}{2}"),
    ("Answer: \\sqrt2", "\\sqrt{2}", True, "\\sqrt{2}"),
    ("Answer: 3\\sqrt{2}", "3\\sqrt2", True, "3\\sqrt{2}"),
    ("Answer: \\text{(A)}", "(A)", True, "(A)"),
    ("Answer: \\textbf{B}", "B", True, "B"),
    ("Answer: \\text{Monday}", "Monday", True, "Monday"),
    ("Answer: \\mbox{Monday}", "Monday", True, "Monday"),
    ("Answer: \\overline{3}", "3", True, "3"),
    ("Answer: \\boxed{12}", "12", True, "12"),
    ("Answer: (1, 2)", "(1,2)", True, "(1,2)"),
    ("Answer: \\left( 1, 2 \\right)", "(1,2)", False, "\\left(1,2\\right)"),
    ("Answer: x^2 + 1", "x^2+1", True, "x^2+1"),
    ("Answer: 2 \\cdot 3", "2\\cdot3", True, "2\\cdot3"),
    ('Answer: "yes"', "yes", True, "yes"),
    ("Answer: -3", "-3", True, "-3"),
    ("Answer: \u22123", "-3", False, "\u22123"),  # a Unicode minus is not "-"
    ("Answer: \uff15", "5", False, "\uff15"),  # a full-width digit is not "5"
    # ground-truth normalisation
    ("Answer: 42", "\\boxed{42}", True, "42"),
    ("Answer: 42", "$42$", True, "42"),
    ("Answer: 1234", "1,234", True, "1234"),
    # \boxed{} fallback: no Answer line, last box in the last 100 characters, compared verbatim
    ("so the result is \\boxed{42}", "42", True, "42"),
    ("my answer is \\boxed{7}", "7", True, "7"),
    ("\\boxed{ 42 }", "42", False, " 42 "),
    ("\\boxed{\\frac12}", "\\frac{1}{2}", False, "\\frac12"),
    ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}", True, "\\frac{1}{2}"),
    ("\\boxed{1} then \\boxed{2}", "2", True, "2"),
    ("\\boxed{1} and \\boxed{2", "1", False, None),  # the last box is unclosed
    ("\\boxed{42}" + "x" * 90, "42", True, "42"),  # box starts exactly 100 characters from the end
    ("\\boxed{42}" + "x" * 91, "42", False, None),  # one character further: out of reach
    # empty and long outputs, the 300-character window
    ("", "5", False, None),
    ("I think it is 5", "5", False, None),
    ("Answer: 42\n" + "y" * 289, "42", True, "42"),  # exactly 300 characters
    ("Answer: 42\n" + "y" * 290, "42", False, None),  # "A" falls out of the window
    ("Answer: 42" + "x" * 300, "42", False, None),
    ("z" * 1_000_000 + "\nAnswer: 42", "42", True, "42"),
    ("Answer: 1\n" + "z" * 1_000_000, "1", False, None),
]


@pytest.mark.parametrize("solution, ground_truth, acc, pred", DEFAULT_MODE_CASES)
def test_default_mode_edge_cases(solution, ground_truth, acc, pred):
    result = compute_score(solution, ground_truth)
    assert result == {"score": 1.0 if acc else -1.0, "acc": acc, "pred": pred}


STRICT_BOX_CASES = [
    ("Answer: 42", "42", False, None),  # an Answer line does not count
    ("\\boxed{42}", "42", True, "42"),
    ("Answer: 41 \\boxed{42}", "42", True, "42"),
    ("\\boxed{42.0}", "42", False, "42.0"),  # verbatim comparison
    ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}", True, "\\frac{1}{2}"),
    ("\\boxed{42}" + "x" * 91, "42", False, None),
    ("", "42", False, None),
]


@pytest.mark.parametrize("solution, ground_truth, acc, pred", STRICT_BOX_CASES)
def test_strict_box_mode(solution, ground_truth, acc, pred):
    result = compute_score(solution, ground_truth, strict_box=True)
    assert result == {"score": 1.0 if acc else -1.0, "acc": acc, "pred": pred}


def test_at_least_sixty_scorer_edge_cases():
    assert len(DEFAULT_MODE_CASES) + len(STRICT_BOX_CASES) >= 60


def test_non_string_input_is_a_type_error():
    with pytest.raises(TypeError, match="str solution"):
        compute_score(None, "1")
    with pytest.raises(TypeError, match="str solution"):
        compute_score("Answer: 1", 1)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("\\boxed{1}", "1"),
        ("a \\boxed{x} b \\boxed{\\frac{1}{2}} c", "\\frac{1}{2}"),
        ("\\boxed{{}}", "{}"),
        ("\\boxed{", None),
        ("\\boxed{1} \\boxed{2", None),
        ("no box", None),
        ("\\boxed{a}}}", "a"),
    ],
)
def test_last_boxed_content(text, expected):
    assert last_boxed_content(text) == expected


def test_normalization_examples():
    assert normalize_final_answer("The answer is $\\frac{3}{4}$ dollars") == "\\frac{3}{4}"
    assert normalize_final_answer("a = \\boxed{\\text{10}}") == "10"
    assert normalize_final_answer("  12,345  ") == "12345"
    assert normalize_final_answer("\\sqrt3 + \\frac23") == "\\sqrt{3}+\\frac{2}{3}"


# The normalisation steps are written as linear scans. Each must give the same result as the
# regular expression that defines it; the alphabet is chosen so that the patterns actually fire.
_PIECES = [
    "$",
    "{",
    "}",
    "\n",
    "\\",
    "a",
    "1",
    ",",
    " ",
    "x",
    "frac",
    "sqrt",
    "\\text{",
    "\\textbf{",
    "\\overline{",
    "\\boxed{",
    "text{",
    "boxed{",
]
_pieced_text = st.lists(st.sampled_from(_PIECES), max_size=30).map("".join)


@settings(max_examples=300, deadline=None)
@given(_pieced_text)
def test_linear_scans_match_their_regular_expressions(text):
    assert keep_first_dollar_pair(text) == re.sub(r"(.*?)(\$)(.*?)(\$)(.*)", "$\\3$", text)
    for opener in ("\\text{", "\\textbf{", "\\overline{"):
        assert unwrap_to_first_brace(text, opener) == re.sub(re.escape(opener) + r"(.*?)(\})", "\\1", text)
    assert unwrap_boxed_to_last_brace(text) == re.sub(r"(\\boxed\{)(.*)(\})", "\\2", text)


# -- fuzz: never raises, never hangs ----------------------------------------------------------------

_any_char = st.characters(exclude_categories=())  # includes lone surrogates and control characters
_fragments = st.lists(
    st.sampled_from(
        ["Answer:", "answer :", "\\boxed{", "{", "}", "$", "=", "\n", "\\frac", "sqrt", "\\text{", ",", "1", " "]
    )
    | st.text(_any_char, max_size=5),
    max_size=40,
).map("".join)


def _cpu_ms(fn, *args, **kwargs):
    # Thread CPU time, not wall time: other processes on a shared machine do not inflate it. The garbage
    # collector is paused: a full collection of the test process's heap (torch is imported) can land in
    # any call and costs more than the scorer itself.
    gc.disable()
    try:
        start = time.thread_time()
        result = fn(*args, **kwargs)
        return result, (time.thread_time() - start) * 1000
    finally:
        gc.enable()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(
    head=st.text(_any_char, max_size=50),
    repeat=st.sampled_from([1, 1000, 100_000]),
    tail=_fragments,
    ground_truth=st.text(_any_char, max_size=200) | _fragments,
    strict_box=st.booleans(),
)
def test_fuzz_never_raises_and_returns_within_10ms(head, repeat, tail, ground_truth, strict_box):
    solution = head * repeat + tail  # up to megabytes long
    result, ms = _cpu_ms(compute_score, solution, ground_truth, strict_box=strict_box)
    assert ms < 10, f"{ms:.1f} ms for a {len(solution)}-character solution"
    assert result["score"] in (1.0, -1.0) and result["acc"] == (result["score"] == 1.0)
    assert result["pred"] is None or isinstance(result["pred"], str)


@pytest.mark.parametrize(
    "solution",
    [
        "{" * 2_000_000,
        "\\boxed{" * 300_000,
        "Answer:" * 300_000,
        "Answer: " + "$" * 1_000_000,
        "Answer: " + "\\text{" * 300_000,
        "Answer: " + "frac" * 500_000,
    ],
)
def test_adversarial_megabyte_solutions_return_within_10ms(solution):
    result, ms = _cpu_ms(compute_score, solution, "1")
    assert ms < 10 and result["acc"] is False


def test_megabyte_ground_truth_is_linear_not_quadratic():
    # Ground truths come from the dataset and are short; a pathological one still costs linear time
    # (the regular-expression form of the normalisation is quadratic on this input).
    ground_truth = "\\text{" * 200_000 + "$" * 200_000
    result, ms = _cpu_ms(compute_score, "Answer: 1", ground_truth)
    assert ms < 2000 and result["acc"] is False


# -- soft overlong punishment (Eq. 13) ------------------------------------------------------------


@pytest.mark.parametrize(
    "length, expected",
    [
        (0, 0.0),
        (16383, 0.0),
        (16384, 0.0),  # L_max - L_cache: last length without penalty
        (16385, -1 / 4096),  # first penalised length
        (18432, -0.5),  # middle of the buffer
        (20479, -4095 / 4096),
        (20480, -1.0),  # L_max
        (20481, -1.0),  # beyond L_max
        (10**9, -1.0),
    ],
)
def test_overlong_penalty_paper_values(length, expected):
    assert overlong_penalty(length, max_len=20480, buffer_len=4096) == pytest.approx(expected, abs=1e-12)


def test_overlong_penalty_factor_and_small_buffer():
    assert overlong_penalty(18432, 20480, 4096, factor=0.5) == pytest.approx(-0.25)
    assert overlong_penalty(30000, 20480, 4096, factor=0.5) == -0.5
    assert overlong_penalty(9, 10, 1) == 0.0 and overlong_penalty(10, 10, 1) == -1.0
    assert overlong_penalty(0, 10, 10) == 0.0 and overlong_penalty(5, 10, 10) == pytest.approx(-0.5)


@pytest.mark.parametrize(
    "args, error, message",
    [
        ((5, 10, 0), ValueError, "buffer_len must be > 0"),
        ((5, 10, -1), ValueError, "buffer_len must be > 0"),
        ((5, 10, 11), ValueError, "exceeds max_len"),
        ((-1, 10, 5), ValueError, "length must be >= 0"),
        ((5.0, 10, 5), TypeError, "length must be an int"),
        ((5, 10, True), TypeError, "buffer_len must be an int"),
    ],
)
def test_overlong_penalty_rejects_bad_arguments(args, error, message):
    with pytest.raises(error, match=message):
        overlong_penalty(*args)


def test_overlong_penalty_accepts_numpy_and_torch_integers():
    assert overlong_penalty(np.int64(18432), 20480, 4096) == pytest.approx(-0.5)
    assert overlong_penalty(torch.tensor(18432), torch.tensor(20480), 4096) == pytest.approx(-0.5)


def test_overlong_penalty_rejects_negative_factor():
    with pytest.raises(ValueError, match="factor"):
        overlong_penalty(5, 10, 5, factor=-1.0)


# -- overlong filtering --------------------------------------------------------------------------


def test_overlong_filter_zeroes_truncated_rows_only():
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0]], dtype=torch.float32)
    filtered = overlong_filter_mask(mask, ["stop", "length", "abort"])
    assert torch.equal(filtered, torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0], [1.0, 0.0, 0.0]]))
    assert mask[1].sum() == 3  # the input is not modified


def test_overlong_filter_keeps_bool_dtype():
    mask = torch.ones(2, 2, dtype=torch.bool)
    filtered = overlong_filter_mask(mask, ["length", "stop"])
    assert filtered.dtype == torch.bool and filtered.tolist() == [[False, False], [True, True]]


def test_overlong_filter_rejects_bad_input():
    with pytest.raises(ValueError, match="one finish reason per row"):
        overlong_filter_mask(torch.ones(2, 3), ["stop"])
    with pytest.raises(ValueError, match="one finish reason per row"):
        overlong_filter_mask(torch.ones(1, 3), "length")
    with pytest.raises(ValueError, match=r"\[B, T\]"):
        overlong_filter_mask(torch.ones(3), ["stop"] * 3)
    with pytest.raises(TypeError, match="strings"):
        overlong_filter_mask(torch.ones(1, 3), [None])
