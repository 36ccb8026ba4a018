"""MATH-style rule reward: the last `\\boxed{...}` of a response against the ground truth.

Answers are LaTeX, so both sides are normalised before comparing: spacing commands,
`\\left`/`\\right`, `$`, `\\text{}` wrappers, degree signs and a trailing period are dropped,
`\\dfrac`/`\\tfrac` become `\\frac`, `\\frac12` becomes `\\frac{1}{2}`, and a leading `x =`
is removed. Plain numbers and simple fractions also compare by value (`0.5` = `\\frac{1}{2}`).
Score: no boxed answer 0, a wrong one `format_score`, a correct one `correct_score`.
"""

from __future__ import annotations

import numbers
import re
from fractions import Fraction
from typing import Any

_BOX_COMMANDS = ("\\boxed", "\\fbox")
_DROP = ("\\left", "\\right", "\\!", "\\,", "\\;", "\\:", "\\ ", "$", "^\\circ", "^{\\circ}")


def last_boxed(text: str) -> str | None:
    """Contents of the last `\\boxed{...}` (braces balanced) or `\\boxed x`; None if none."""
    start, command = max((text.rfind(c), c) for c in _BOX_COMMANDS)
    if start < 0:
        return None
    i = start + len(command)
    if text[i : i + 1] == " ":  # `\boxed 5`: up to the next space or $
        match = re.match(r"\s+([^\s$]+)", text[i:])
        return match.group(1) if match else None
    if text[i : i + 1] != "{":
        return None
    depth = 0
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1 : j]
    return None  # unbalanced braces: no usable answer


def _unwrap(text: str, command: str) -> str:
    return re.sub(re.escape(command) + r"\{([^{}]*)\}", r"\1", text)


def normalize_latex(answer: str) -> str:
    """A canonical form of a LaTeX answer for string comparison."""
    text = str(answer).strip()
    for command in ("\\text", "\\textbf", "\\mathrm", "\\mbox"):
        text = _unwrap(text, command)
    for token in _DROP:
        text = text.replace(token, "")
    text = text.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac").replace("\\%", "%")
    text = re.sub(r"\\frac(\d)(\d)", r"\\frac{\1}{\2}", text)
    text = re.sub(r"\s+", "", text).rstrip(".")
    text = re.sub(r"^[a-zA-Z]\w{0,2}=(?!=)", "", text)  # "x=5" -> "5"
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", text):
        text = text.replace(",", "")
    return text


def as_number(text: str) -> Fraction | None:
    """Value of a normalised integer, decimal, `a/b` or `\\frac{a}{b}`; None otherwise."""
    match = re.fullmatch(r"(-?)\\frac\{(-?\d+)\}\{(-?\d+)\}", text) or re.fullmatch(
        r"(-?)(\d+)/(\d+)", text
    )
    try:
        if match:
            value = Fraction(int(match.group(2)), int(match.group(3)))
            return -value if match.group(1) else value
        if re.fullmatch(r"-?(\d+\.?\d*|\.\d+)", text):
            return Fraction(text)
    except ZeroDivisionError:
        return None
    return None


def is_equivalent(answer: str, ground_truth: str) -> bool:
    a, b = normalize_latex(answer), normalize_latex(ground_truth)
    if a == b:
        return True
    x, y = as_number(a), as_number(b)
    return x is not None and x == y


def ground_truth_problem(ground_truth: Any) -> str | None:
    """Why this rule cannot score `ground_truth` (None: it can): it needs LaTeX text or a
    number; an empty string or a list would be compared as text and score nonsense."""
    if isinstance(ground_truth, str):
        return None if ground_truth.strip() else "empty; the math rule needs the answer's LaTeX"
    if isinstance(ground_truth, numbers.Real) and not isinstance(ground_truth, bool):
        return None
    return f"a {type(ground_truth).__name__}; the math rule needs a LaTeX string or a number"


def compute_score(
    solution: str, ground_truth: str, *, format_score: float = 0.0, correct_score: float = 1.0
) -> float:
    """0 without a boxed answer, `format_score` if wrong, `correct_score` if right."""
    answer = last_boxed(solution)
    if answer is None:
        return 0.0
    truth = last_boxed(str(ground_truth)) or str(ground_truth)
    return correct_score if is_equivalent(answer, truth) else format_score
