"""The MATH answer table through the rule rewards (math-verify), and its timeouts off the
main thread."""

from __future__ import annotations

import threading

import pytest

from rlhf.reward import RuleSettings, compute_score, math
from tests.unit.math_answer_cases import CASES

FORMAT = 0.25
# the boxed rule (a wrong answer: format_score) and the Answer-line rule (verl's math_dapo: -1)
WRONG = {"HuggingFaceH4/MATH-500": FORMAT, "math_dapo": -1.0, "aime_2024": -1.0}


def test_the_table_is_big_and_has_true_negatives():
    assert len(CASES) >= 40
    assert sum(not equal for _, _, equal, _ in CASES) >= 15


@pytest.mark.parametrize(("answer", "truth", "equal", "kind"), CASES, ids=[c[3] for c in CASES])
def test_math_answer_table(answer, truth, equal, kind):
    response = f"We simplify step by step, so the answer is $\\boxed{{{answer}}}$."
    for source, wrong in WRONG.items():
        score = compute_score(source, response, truth, settings=_settings())
        assert score == (1.0 if equal else wrong), source
    # the ground truth as the dataset may store it (boxed) changes nothing
    boxed_truth = math.compute_score(response, f"\\boxed{{{truth}}}", format_score=FORMAT)
    assert boxed_truth == (1.0 if equal else FORMAT)


def _settings() -> RuleSettings:
    return RuleSettings(format_score=FORMAT)


@pytest.mark.parametrize("source", ["HuggingFaceH4/MATH-500", "math_dapo"])
def test_no_answer_scores_zero_under_the_boxed_rule_and_minus_one_under_dapo(source):
    score = compute_score(source, "I do not know.", "4", settings=_settings())
    assert score == (0.0 if source == "HuggingFaceH4/MATH-500" else -1.0)


def test_equivalence_off_the_main_thread_has_no_signal_timeout():
    """math-verify's signal timeout raises off the main thread; the rule turns it off there."""
    results: list[object] = []

    def score() -> None:
        try:
            results.append(math.compute_score(r"\boxed{\dfrac{2}{4}}", "0.5"))
        except Exception as e:  # what would surface without the thread check
            results.append(e)

    worker = threading.Thread(target=score)
    worker.start()
    worker.join(timeout=60)
    assert results == [1.0]
    assert math._timeout_s() == math.TIMEOUT_S  # the main thread keeps the library's bound


def test_majority_answers_are_canonical():
    canonical = math.canonical_answer
    assert canonical(r"\frac{1}{2}") == canonical("0.5") == canonical(r"\dfrac12") == "1/2"
    assert canonical("x = 3") == canonical("3") == "3"
    assert canonical("1,000") == canonical("1000") == "1000"
    assert canonical(r"\{3, 1, 2\}") == canonical(r"\{1, 2, 3\}")
    assert canonical(r"\text{even}") != canonical(r"\text{odd}")
