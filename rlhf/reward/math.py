"""MATH-style rule reward: a response's final answer against the ground truth, by math-verify.

The final answer is the last `\\boxed{...}` of the response; for DAPO-Math and AIME sources
(`answer_line=True`) also a line `Answer: ...` (the form DAPO-Math's prompts ask for), and
then whichever of the two comes last. Equivalence is decided by the `math-verify` library
(`math_verify.parse` + `math_verify.verify`): both sides become SymPy objects, so `0.5` =
`\\dfrac12`, `2\\sqrt3` = `\\sqrt{12}`, `\\{1,2\\}` = `\\{2,1\\}`, `1,000` = `1000`,
`x = 3` = `3`, `90^\\circ` = `90`, `5\\text{ cm}` = `5`, intervals keep their brackets, and
`0.33` is not `\\frac13`. Hand-written normalisation missed most of such cases
(`tests/unit/math_answer_cases.py` has the table).

math-verify bounds its parsing and comparison with `signal.alarm`, which works only in a
process's main thread (elsewhere the library raises). There the timeout is 5 s per parse or
comparison; in any other thread it is off (the library's own `None`), and the caller bounds
the call: rule rewards run in the generating process's main thread, or in worker processes
(`reward.num_workers` > 1) whose calls are killed after `reward.timeout_s`.

Score: no final answer 0, a wrong one `format_score`, a correct one `correct_score`.
"""

from __future__ import annotations

import functools
import numbers
import re
import threading
from typing import Any

TIMEOUT_S = 5  # math-verify's per-parse / per-comparison bound, main thread only

_BOX_COMMANDS = ("\\boxed", "\\fbox")
_ANSWER_LINE = re.compile(r"answer\s*:[ \t]*([^\n]*)", re.IGNORECASE)


def _boxed_at(text: str) -> tuple[int, str | None]:
    """(where the last `\\boxed` starts, its contents); (-1, None) without one. Contents are
    None when the box cannot be read (unbalanced braces)."""
    start, command = max((text.rfind(c), c) for c in _BOX_COMMANDS)
    if start < 0:
        return -1, None
    i = start + len(command)
    if text[i : i + 1] == " ":  # `\boxed 5`: up to the next space or $
        match = re.match(r"\s+([^\s$]+)", text[i:])
        return start, match.group(1) if match else None
    if text[i : i + 1] != "{":
        return start, None
    depth = 0
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return start, text[i + 1 : j]
    return start, None


def last_boxed(text: str) -> str | None:
    """Contents of the last `\\boxed{...}` (braces balanced) or `\\boxed x`; None if none."""
    return _boxed_at(text)[1]


def _answer_line_at(text: str) -> tuple[int, str | None]:
    """(where the last `Answer:` starts, what follows it on its line, `$` and a final period
    removed); (-1, None) without one."""
    matches = list(_ANSWER_LINE.finditer(text))
    if not matches:
        return -1, None
    value = matches[-1].group(1).strip().rstrip(".").strip().strip("$").strip()
    inner = last_boxed(value)  # "Answer: \boxed{5}"
    return matches[-1].start(), inner if inner is not None else (value or None)


def final_answer(text: str, answer_line: bool = False) -> str | None:
    """The response's final answer as written: the last `\\boxed{}`, or with `answer_line`
    the last `Answer: ...` line when that comes later; None when it gives none."""
    box_at, boxed = _boxed_at(text)
    if not answer_line:
        return boxed
    line_at, line = _answer_line_at(text)
    return line if line_at > box_at else boxed


def _timeout_s() -> int | None:
    """math-verify's timeout here: its signal alarm only works in the main thread."""
    return TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


@functools.lru_cache(maxsize=8192)
def _parsed(answer: str, timeout_s: int | None) -> tuple[Any, ...]:
    """math-verify's reading of one answer (SymPy objects, then the text it came from)."""
    from math_verify import LatexExtractionConfig, parse

    config = [LatexExtractionConfig()]
    return tuple(parse(f"\\boxed{{{answer}}}", config, parsing_timeout=timeout_s))


def is_equivalent(answer: str, ground_truth: str) -> bool:
    """Whether math-verify finds the answer equal to the ground truth (both LaTeX)."""
    from math_verify import verify

    timeout_s = _timeout_s()
    gold, pred = _parsed(ground_truth, timeout_s), _parsed(answer, timeout_s)
    if not gold or not pred:
        return False
    return bool(verify(list(gold), list(pred), timeout_seconds=timeout_s))


def canonical_answer(answer: str) -> str:
    """A string per answer, for majority votes: math-verify's SymPy reading (`0.5`,
    `\\dfrac12` and `\\frac{1}{2}` all give `1/2`; `x = 3` gives `3`), else the text. What
    SymPy leaves unevaluated votes apart (`\\sqrt{12}` is not `2\\sqrt{3}` here): nothing
    is simplified, which could take unbounded time."""
    parsed = _parsed(answer, _timeout_s())
    if not parsed or isinstance(parsed[0], str):
        return answer.strip()
    value = parsed[0]
    if getattr(value, "is_Relational", False) and getattr(value.lhs, "is_Symbol", False):
        value = value.rhs  # "x = 3" and "3" vote together
    return str(value)


def ground_truth_problem(ground_truth: Any) -> str | None:
    """Why this rule cannot score `ground_truth` (None: it can): it needs LaTeX text or a
    number; an empty string or a list would be compared as text and score nonsense."""
    if isinstance(ground_truth, str):
        return None if ground_truth.strip() else "empty; the math rule needs the answer's LaTeX"
    if isinstance(ground_truth, numbers.Real) and not isinstance(ground_truth, bool):
        return None
    return f"a {type(ground_truth).__name__}; the math rule needs a LaTeX string or a number"


def compute_score(
    solution: str,
    ground_truth: str,
    *,
    answer_line: bool = False,
    format_score: float = 0.0,
    correct_score: float = 1.0,
) -> float:
    """0 without a final answer, `format_score` if wrong, `correct_score` if right."""
    answer = final_answer(solution, answer_line)
    if answer is None:
        return 0.0
    truth = str(ground_truth)
    truth = last_boxed(truth) or truth
    return correct_score if is_equivalent(answer, truth) else format_score
