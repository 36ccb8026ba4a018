"""GSM8K-style rule reward: the final number of a response against the ground truth.

The answer is found as verl's gsm8k reward finds it, in the last 300 characters of the
response (verl reads no further back), so that a run scores what it would score there:
- strict: the last `#### ` (four hashes, one space) followed by a run of digits, `.` and `,`
  with an optional leading `-`; a response without one has no answer. `####72`,
  `#### $18` and `#### -$5` have none.
- flexible: the last such run (`-?[0-9.,]+`) anywhere; a run without a digit (`.`, `,`) is
  not a number (verl skips only `.` and would score `,` as a wrong answer).

Unlike verl, which compares strings, numbers are compared by value, after removing commas
and a trailing period (`1,200` = `1200`, `12.` = `12`, `3.50` = `3.5`, `7.0` = `7`, `-0` =
`0`): a score here is verl's or higher, higher only where the same number is written
differently. Score: no answer 0, a wrong one `format_score`, a correct one `correct_score`.
"""

from __future__ import annotations

import numbers
import re
from decimal import Decimal, InvalidOperation
from typing import Any

from rlhf.config.choices import GSM8KMethod

CLIP_CHARS = 300  # verl's window: only the end of a response is searched
_STRICT = re.compile(r"#### (-?[0-9.,]+)")
_FLEXIBLE = re.compile(r"-?[0-9.,]+")


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
    text = solution[-CLIP_CHARS:]
    if method == "strict":
        matches = _STRICT.findall(text)
    elif method == "flexible":
        matches = [m for m in _FLEXIBLE.findall(text) if any(c.isdigit() for c in m)]
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
