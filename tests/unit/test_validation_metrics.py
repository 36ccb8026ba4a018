"""Validation metrics (mean@N, best@N, maj@N per data source), checked against hand counts,
and the answers responses vote with."""

from __future__ import annotations

import pytest

from rlhf.config import load_config
from rlhf.reward.registry import RuleSettings, answer_extractor, register_rule
from rlhf.reward.validation import (
    ValSample,
    majority_score,
    per_source_table,
    val_samples,
    validation_metrics,
)


def samples(source: str, uid: str, items: list[tuple[float, str | None]]) -> list[ValSample]:
    return [ValSample(source, uid, score, answer) for score, answer in items]


def test_hand_counted_mean_best_and_majority():
    # prompt a: right once ("5"), "6" twice (wrong), once no answer -> majority "6" scores 0
    # prompt b: "3" twice (right), "4" twice (wrong): a tie, "3" came first -> 1
    batch = samples("openai/gsm8k", "a", [(1, "5"), (0, "6"), (0, "6"), (0, None)])
    batch += samples("openai/gsm8k", "b", [(1, "3"), (0, "4"), (1, "3"), (0, "4")])
    metrics = validation_metrics(batch)
    prefix = "val-core/openai/gsm8k/reward/"
    assert metrics[prefix + "mean@4"] == pytest.approx(3 / 8)
    assert metrics[prefix + "best@4"] == pytest.approx(1.0)
    assert metrics[prefix + "maj@4"] == pytest.approx(0.5)
    assert metrics["val/test_score/openai/gsm8k"] == pytest.approx(3 / 8)
    assert metrics["val/test_score/all"] == pytest.approx(3 / 8)
    table = per_source_table(metrics)
    assert table == {"openai/gsm8k": {"mean@4": 3 / 8, "best@4": 1.0, "maj@4": 0.5}}


def test_majority_edge_cases():
    # no answer at all: the mean of the responses
    assert majority_score(samples("s", "u", [(0.2, None), (0.4, None)])) == pytest.approx(0.3)
    # a model reward can score the same answer differently: the group's mean
    assert majority_score(samples("s", "u", [(0.2, "7"), (0.9, "1"), (0.6, "7")])) == 0.4
    # the answer given first wins a tie, wherever its later votes are
    assert majority_score(samples("s", "u", [(0, "2"), (1, "9"), (1, "9"), (0, "2")])) == 0


def test_sources_are_separate_and_n1_reports_only_the_mean():
    batch = samples("math", "a", [(1, "1/2"), (1, "1/2")]) + samples("math", "b", [(0, "2")] * 2)
    batch += samples("no_rule", "c", [(0.5, None), (1.5, None)])
    metrics = validation_metrics(batch)
    assert metrics["val-core/math/reward/maj@2"] == 0.5
    assert metrics["val-core/no_rule/reward/best@2"] == 1.5
    assert "val-core/no_rule/reward/maj@2" not in metrics  # no answer extractor: no vote
    assert metrics["val/test_score/all"] == pytest.approx((1 + 1 + 0 + 0 + 0.5 + 1.5) / 6)
    single = validation_metrics(samples("math", "a", [(1, "1")]) + samples("math", "b", [(0, "")]))
    assert single == {
        "val-core/math/reward/mean@1": 0.5,
        "val/test_score/math": 0.5,
        "val/test_score/all": 0.5,
    }


def test_responses_vote_with_normalised_answers():
    reward = load_config(None).reward
    texts = ["so #### 1,200.00", "#### 1200", "#### 12", "no answer"]
    got = val_samples(["gsm8k"] * 4, ["u"] * 4, [1, 1, 0, 0], texts, reward)
    assert [s.answer for s in got] == ["1200", "1200", "12", None]
    math_texts = ["\\boxed{\\frac{1}{2}}", "\\boxed{0.5}", "\\boxed{\\dfrac12}", "\\boxed{x=3}"]
    got = val_samples(["math"] * 4, ["u"] * 4, [1, 1, 1, 0], math_texts, reward)
    assert [s.answer for s in got] == ["1/2", "1/2", "1/2", "3"]
    flexible = load_config(None, ["reward.gsm8k_method=flexible"]).reward
    (one,) = val_samples(["gsm8k"], ["u"], [0], ["it is 41 or 42"], flexible)
    assert one.answer == "42"


def test_registered_rule_votes_only_with_an_answer_function():
    register_rule("votes_test", lambda solution, truth, settings: 0.0)
    assert answer_extractor("votes_test") is None
    register_rule("votes_test", lambda s, t, settings: 0.0, lambda text, settings: text[-1:])
    assert answer_extractor("votes_test")("abc", RuleSettings()) == "c"
