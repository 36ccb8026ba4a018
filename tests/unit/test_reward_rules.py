"""Rule rewards (gsm8k, math), the data_source registry, custom functions and the scorer."""

from __future__ import annotations

import pytest

from rlhf.config import load_config
from rlhf.reward import (
    build_reward_fn,
    compute_score,
    gsm8k,
    load_custom_fn,
    math,
)

FORMAT, CORRECT = 0.1, 1.0

# (response, ground truth, strict score, flexible score); 0 = no answer, 0.1 = wrong, 1 = right
GSM8K_CASES = [
    ("She pays 3*2=6 dollars.\n#### 6", "6", CORRECT, CORRECT),
    ("#### 72", "72", CORRECT, CORRECT),
    ("####72", "72", CORRECT, CORRECT),
    ("The total is 1,195 hens.\n#### 1,195", "1195", CORRECT, CORRECT),
    ("#### 1195", "1,195", CORRECT, CORRECT),
    ("#### 1,000,000", "1000000", CORRECT, CORRECT),
    ("#### $18", "18", CORRECT, CORRECT),
    ("#### $1,234.00", "1234", CORRECT, CORRECT),
    ("#### -5", "-5", CORRECT, CORRECT),
    ("It fell 9 degrees to -5.\n#### -5", "5", FORMAT, FORMAT),
    ("#### -$5", "-5", CORRECT, CORRECT),
    ("#### 3.5", "3.5", CORRECT, CORRECT),
    ("#### 3.50", "3.5", CORRECT, CORRECT),
    ("#### 7.0", "7", CORRECT, CORRECT),
    ("#### 7", "7.00", CORRECT, CORRECT),
    ("#### 42.", "42", CORRECT, CORRECT),
    ("#### 0.25", "0.5", FORMAT, FORMAT),
    ("#### 007", "7", CORRECT, CORRECT),
    ("#### -0", "0", CORRECT, CORRECT),
    ("#### 5\nWait, recount.\n#### 7", "7", CORRECT, CORRECT),  # several ####: the last counts
    ("#### 7\nNo, it is\n#### 5", "7", FORMAT, FORMAT),
    ("#### 8 apples, 3 left", "8", CORRECT, FORMAT),  # flexible takes the last number
    ("The answer is 12.", "12", 0.0, CORRECT),  # missing ####
    ("The answer is 12.", "13", 0.0, FORMAT),
    ("I do not know.", "12", 0.0, 0.0),  # no number at all
    ("", "3", 0.0, 0.0),
    ("#### ", "3", 0.0, 0.0),
    ("#### twelve", "12", 0.0, 0.0),
    ("pages 3-5 so #### 5", "5", CORRECT, CORRECT),
    ("pages 3-5", "-5", 0.0, FORMAT),  # a hyphen between numbers is not a minus sign
    ("x = -3", "-3", 0.0, CORRECT),
    ("#### 12 \n", "12", CORRECT, CORRECT),
    ("Total: 2,5 items #### 25", "25", CORRECT, CORRECT),
]


@pytest.mark.parametrize(("response", "truth", "strict", "flexible"), GSM8K_CASES)
def test_gsm8k_table(response, truth, strict, flexible):
    for method, expected in (("strict", strict), ("flexible", flexible)):
        score = gsm8k.compute_score(
            response, truth, method=method, format_score=FORMAT, correct_score=CORRECT
        )
        assert score == expected, f"{method} mode"


def test_gsm8k_table_is_big_enough_and_defaults():
    assert len(GSM8K_CASES) >= 25
    assert gsm8k.compute_score("#### 3", "4") == 0.0  # default format score
    assert gsm8k.compute_score("#### 4", 4) == 1.0  # a numeric ground truth works too
    with pytest.raises(ValueError, match="strict or flexible"):
        gsm8k.compute_score("#### 4", "4", method="loose")


MATH_CASES = [
    (r"So the answer is $\boxed{\frac{1}{2}}$.", "0.5", CORRECT),
    (r"\boxed{\dfrac12}", r"\frac{1}{2}", CORRECT),
    (r"\boxed{x = 5}", "5", CORRECT),
    (r"\boxed{90^\circ}", "90", CORRECT),
    (r"\boxed{\text{(B)}}", "(B)", CORRECT),
    (r"\boxed{1,000}", "1000", CORRECT),
    (r"\boxed{\left( 1, 2 \right)}", "(1,2)", CORRECT),
    (r"\boxed{-\frac{3}{4}}", "-0.75", CORRECT),
    (r"\boxed{3} first, then \boxed{4}", "4", CORRECT),
    (r"\fbox{5}", "5", CORRECT),
    (r"\boxed 7$", "7", CORRECT),
    (r"\boxed{\sqrt{2}}", r"\boxed{\sqrt2}", FORMAT),
    (r"\boxed{5}", "6", FORMAT),
    (r"\boxed{2", "2", 0.0),  # unbalanced
    ("The answer is 4.", "4", 0.0),
]


@pytest.mark.parametrize(("response", "truth", "expected"), MATH_CASES)
def test_math_boxed_table(response, truth, expected):
    assert math.compute_score(response, truth, format_score=FORMAT) == expected


def test_registry_routes_by_data_source():
    assert compute_score("openai/gsm8k", "#### 3", "3") == 1.0
    assert compute_score("arithmetic", "so #### 9", "9") == 1.0
    assert compute_score("lighteval/MATH", r"\boxed{9}", "9") == 1.0
    assert compute_score("gsm8k", r"\boxed{9}", "9") == 0.0  # gsm8k rule ignores boxes
    with pytest.raises(ValueError) as err:
        compute_score("my/dataset", "x", "1")
    assert "no rule reward for data_source 'my/dataset'; known: DigitalLearningGmbH" in str(
        err.value
    )
    assert "openai/gsm8k" in str(err.value) and "reward.custom_fn" in str(err.value)


def test_reward_config_settings_reach_the_rules():
    cfg = load_config(
        None,
        ["reward.format_score=0.2", "reward.correct_score=2", "reward.gsm8k_method=flexible"],
    )
    fn = build_reward_fn(cfg.reward)
    assert fn(data_source="gsm8k", solution_str="it is 5", ground_truth="5") == 2.0
    assert fn(data_source="gsm8k", solution_str="it is 4", ground_truth="5") == 0.2


CUSTOM = """
def score(data_source, solution_str, ground_truth, extra_info):
    return len(solution_str) + extra_info.get("bonus", 0)

def as_dict(data_source, solution_str, ground_truth, extra_info):
    return {"score": 0.5, "acc": True}

def not_a_number(**kwargs):
    return "high"
"""


def test_custom_fn_from_file(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text(CUSTOM)
    cfg = load_config(None, [f"reward.custom_fn={path}:score"])
    fn = build_reward_fn(cfg.reward)
    assert (
        fn(data_source="any", solution_str="abcd", ground_truth=None, extra_info={"bonus": 1}) == 5
    )
    assert load_custom_fn(f"{path}:as_dict")("d", "s", "g") == 0.5
    with pytest.raises(ValueError, match="returned 'high'; expected a number"):
        load_custom_fn(f"{path}:not_a_number")("d", "s", "g")


def test_custom_fn_errors(tmp_path):
    path = tmp_path / "r.py"
    path.write_text(CUSTOM)
    with pytest.raises(FileNotFoundError, match=r"reward\.custom_fn: file not found"):
        load_custom_fn(f"{tmp_path}/missing.py:score")
    with pytest.raises(ValueError, match=r"has no function 'scor' \(it defines: as_dict, not_a_"):
        load_custom_fn(f"{path}:scor")
    with pytest.raises(ValueError, match=r"must look like 'path/to/file\.py:function_name'"):
        load_custom_fn(str(path))
    broken = tmp_path / "broken.py"
    broken.write_text("raise RuntimeError('boom')\n")
    with pytest.raises(ValueError, match=r"importing .*broken.py failed: RuntimeError\('boom'\)"):
        load_custom_fn(f"{broken}:score")
