"""GSM8K-style rule reward: the final number of a response against the ground truth.

Two ways to find the response's answer:
- strict: the number right after the last `####` that is followed by one (the format the
  prompt asks for); a response without one has no answer.
- flexible: the last number anywhere in the response.

Numbers are compared after normalisation ($ and thousands commas removed, `12.50` = `12.5`,
`7.0` = `7`, `-0` = `0`), so `$1,200.00` matches a ground truth of `1200`. Score: no answer
0, an answer that is wrong `format_score`, a correct one `correct_score`.
"""

from __future__ import annotations

import numbers
import re
from decimal import Decimal, InvalidOperation
from typing import Any

from rlhf.config.choices import GSM8KMethod

# A number not glued to a preceding word or digit ("3-5" is 3 and 5, not 3 and -5): optional
# minus and $ (either order), digits with optional thousands commas, optional decimals.
_NUMBER = r"(?:-\s?\$?|\$\s?-?)?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?"
_ANY_NUMBER = re.compile(r"(?<![\w.])" + _NUMBER)
_HASH_NUMBER = re.compile(r"####\s*(" + _NUMBER + ")")


def normalize_number(text: str) -> str | None:
    """Canonical text of a number (`-1,000.50` -> `-1000.5`); None if `text` is not one."""
    cleaned = re.sub(r"[\s$,]", "", str(text)).rstrip(".")
    try:
        value = Decimal(cleaned)
    except InvalidOperation:
        return None
    if not value.is_finite():
        return None
    if value == value.to_integral_value():
        return str(int(value))
    return format(value.normalize(), "f")


def ground_truth_problem(ground_truth: Any) -> str | None:
    """Why this rule cannot score `ground_truth` (None: it can). The rule compares numbers, so
    a word or a list would match no answer and every response would silently score 0."""
    if isinstance(ground_truth, bool) or not isinstance(ground_truth, str | numbers.Real):
        kind = f"a {type(ground_truth).__name__}, not a number"
    elif normalize_number(str(ground_truth)) is None:
        kind = "not a number"
    else:
        return None
    return (
        f"{kind}; the gsm8k rule compares numbers ('42', '-3.5', '1,200'), "
        "so every answer would score 0"
    )


def extract_answer(solution: str, method: GSM8KMethod = "strict") -> str | None:
    """The response's final answer as written (not normalised), or None."""
    if method == "strict":
        matches = _HASH_NUMBER.findall(solution)
    elif method == "flexible":
        matches = _ANY_NUMBER.findall(solution)
    else:
        raise ValueError(f"reward.gsm8k_method must be strict or flexible, got {method!r}")
    return matches[-1] if matches else None


def compute_score(
    solution: str,
    ground_truth: str | int | float,
    *,
    method: GSM8KMethod = "strict",
    format_score: float = 0.0,
    correct_score: float = 1.0,
) -> float:
    """0 without an answer, `format_score` if wrong, `correct_score` if right."""
    answer = extract_answer(solution, method)
    if answer is None:
        return 0.0
    truth = normalize_number(str(ground_truth))
    if truth is None:
        truth = str(ground_truth).strip()
    return correct_score if normalize_number(answer) == truth else format_score
