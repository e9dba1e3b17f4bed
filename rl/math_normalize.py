"""Minerva-style answer normalisation and `\\boxed{}` extraction for the rule-based math reward.

`normalize_final_answer` turns a final-answer string into a canonical form so that two answers can be
compared with plain string equality ("$\\frac{1}{2}$ dollars" and "\\frac12" both become "\\frac{1}{2}").
The rules, in order:

  1. keep the text after the last "=";
  2. literal substitutions (`SUBSTITUTIONS`: drop "an ", "a ", "\\$", spaces; "\\text{and}" -> ",", ...);
  3. remove unit words and LaTeX noise (`REMOVED_EXPRESSIONS`: "square", "dollars", "^\\circ", ...);
  4. on a line holding two "$", keep only "$<text between the first two $>$";
  5. unwrap "\\text{x}", "\\textbf{x}", "\\overline{x}" (up to the first "}" on the line) and
     "\\boxed{x}" (up to the last "}" on the line);
  6. repair shorthand: "\\fracab" -> "\\frac{a}{b}", "\\sqrta" -> "\\sqrt{a}";
  7. drop every "$"; remove the commas of an all-digit number ("1,000" -> "1000"); strip.

Steps 4-5 are usually written as regular expressions with lazy/greedy wildcards. Those backtrack
quadratically (or worse) on adversarial input, and a reward function must never hang, so each step
is implemented here as a single left-to-right scan with the same result as the regular expression
(tests/test_rl_reward.py checks the equivalence on generated strings). Every function in this module
runs in time linear in the length of its input.
"""

from __future__ import annotations

import re

# Literal replacements, applied in this order (order matters: "an " before "a ", "\\text{m}" last).
SUBSTITUTIONS: tuple[tuple[str, str], ...] = (
    ("an ", ""),
    ("a ", ""),
    (".$", "$"),
    ("\\$", ""),
    ("\\ ", ""),
    (" ", ""),
    ("mbox", "text"),
    (",\\text{and}", ","),
    ("\\text{and}", ","),
    ("\\text{m}", "\\text{}"),
)

# Deleted wherever they occur, in this order ("\\text{}^2" must go before "\\text{}").
_UNIT_WORDS = tuple(
    "square ways integers dollars mph inches hours km units \\ldots sue points feet minutes digits cents degrees "
    "cm gm pounds meters meals edges students childrentickets multiples".split()
)
_LATEX_NOISE = (
    "\\text{s}",
    "\\text{.}",
    "\\text{\ns}",
    "\\text{}^2",
    "\\text{}^3",
    "\\text{\n}",
    "\\text{}",
    "\\mathrm{th}",
    "^\\circ",
    "^{\\circ}",
    "\\;",
    ",\\!",
    "{,}",
    '"',
    "\\dots",
)
REMOVED_EXPRESSIONS: tuple[str, ...] = _UNIT_WORDS + _LATEX_NOISE

_BOXED = "\\boxed{"
# Step 6's patterns match a fixed number of characters: no backtracking, linear as they are.
_FRAC_SHORTHAND = re.compile(r"frac([^{])(.)")
_SQRT_SHORTHAND = re.compile(r"sqrt([^{])")


def normalize_final_answer(final_answer: str) -> str:
    """Canonical form of a final answer (Minerva rules, see the module docstring)."""
    text = final_answer.split("=")[-1]
    for before, after in SUBSTITUTIONS:
        text = text.replace(before, after)
    for expression in REMOVED_EXPRESSIONS:
        text = text.replace(expression, "")
    text = keep_first_dollar_pair(text)
    for opener in ("\\text{", "\\textbf{", "\\overline{"):
        text = unwrap_to_first_brace(text, opener)
    text = unwrap_boxed_to_last_brace(text)
    text = _FRAC_SHORTHAND.sub(r"frac{\1}{\2}", text)
    text = _SQRT_SHORTHAND.sub(r"sqrt{\1}", text)
    text = text.replace("$", "")
    if text.replace(",", "").isdigit():
        text = text.replace(",", "")
    return text.strip()


def keep_first_dollar_pair(text: str) -> str:
    """Each line holding at least two "$" becomes "$" + (text between its first two "$") + "$".

    Same result as `re.sub(r"(.*?)(\\$)(.*?)(\\$)(.*)", "$\\3$", text)`: "." stops at newlines, so the
    pattern can only match a whole line, starting at its first character.
    """
    lines = text.split("\n")
    for k, line in enumerate(lines):
        first = line.find("$")
        second = line.find("$", first + 1) if first >= 0 else -1
        if second >= 0:
            lines[k] = "$" + line[first + 1 : second] + "$"
    return "\n".join(lines)


def unwrap_to_first_brace(text: str, opener: str) -> str:
    """Replace each `opener` + x + "}" by x, where "}" is the first one after the opener on its line.

    Same result as `re.sub(re.escape(opener) + r"(.*?)\\}", r"\\1", text)` for an opener without "}"
    or newline in it, but linear: when an opener finds no "}" before the end of its line, no later
    opener on that line can either, so the rest of the line is skipped instead of rescanned.
    """
    pieces, pos, line_end = [], 0, -1
    while (start := text.find(opener, pos)) >= 0:
        if line_end < start:
            line_end = text.find("\n", start)
            line_end = len(text) if line_end < 0 else line_end
        inner = start + len(opener)
        close = text.find("}", inner, line_end)
        if close < 0:
            pieces.append(text[pos:line_end])
            pos = line_end
            continue
        pieces.append(text[pos:start])
        pieces.append(text[inner:close])
        pos = close + 1
    pieces.append(text[pos:])
    return "".join(pieces)


def unwrap_boxed_to_last_brace(text: str) -> str:
    """On each line, "\\boxed{" + x + "}" is replaced by x, from the first "\\boxed{" to the last "}".

    Same result as `re.sub(r"(\\\\boxed\\{)(.*)(\\})", "\\2", text)`: the greedy wildcard runs to the
    last "}" of the line, so at most one replacement per line is possible.
    """
    lines = text.split("\n")
    for k, line in enumerate(lines):
        start = line.find(_BOXED)
        if start >= 0:
            close = line.rfind("}")
            if close >= start + len(_BOXED):
                lines[k] = line[:start] + line[start + len(_BOXED) : close] + line[close + 1 :]
    return "\n".join(lines)


def last_boxed_content(text: str) -> str | None:
    """Content of the last "\\boxed{...}" in `text`, braces balanced; None when absent or unclosed.

    Only the last "\\boxed{" is considered: if it is never closed the result is None even when an
    earlier box is complete (the behaviour of the reference scorer).
    """
    start = text.rfind(_BOXED)
    if start < 0:
        return None
    depth = 0
    for i in range(start + len(_BOXED) - 1, len(text)):
        char = text[i]
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return text[start + len(_BOXED) : i]
    return None
