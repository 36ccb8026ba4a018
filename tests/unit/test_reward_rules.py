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

# verl's gsm8k reward, read from its source (verl/utils/reward_score/gsm8k.py) and applied by
# hand: in the last 300 characters, strict takes the last `#### (-?[0-9.,]+)` with commas
# removed, flexible the last `-?[0-9.,]+` run that is not "." (commas kept); the answer must
# equal the ground truth as a string. Scores (strict, flexible): 0 no answer, F wrong, C right.
# Ours: None where it scores as verl; else (strict, flexible) and why (we compare by value).
C, F = CORRECT, FORMAT
GSM8K_VS_VERL = [
    ("She pays 3*2=6 dollars.\n#### 6", "6", (C, C), None),
    ("#### 72", "72", (C, C), None),
    ("####72", "72", (0, C), None),  # strict needs "#### " with its space
    ("####  5", "5", (0, C), None),  # two spaces: not strict's form either
    ("## 5", "5", (0, C), None),
    ("#### 12 \n", "12", (C, C), None),
    ("#### 1,195", "1195", (C, F), (C, C)),  # flexible keeps the comma: "1,195" != "1195"
    ("#### 1,000,000", "1000000", (C, F), (C, C)),
    ("#### 1,2,3", "123", (C, F), (C, C)),  # strict drops every comma, as verl does
    ("Total: 2,5 items #### 25", "25", (C, C), None),
    ("#### $18", "18", (0, C), None),  # "$" is not in strict's character class
    ("#### -$5", "-5", (0, F), None),  # flexible finds only "5"
    ("#### -5", "-5", (C, C), None),
    ("It fell 9 degrees to -5.\n#### -5", "5", (F, F), None),
    ("#### -3.25", "-3.25", (C, C), None),
    ("pages 3-5", "-5", (0, C), None),  # verl's runs read the hyphen as a minus sign
    ("pages 3-5 so #### 5", "5", (C, C), None),
    ("x = -3", "-3", (0, C), None),
    ("#### 3.5", "3.5", (C, C), None),
    ("#### 3.50", "3.5", (F, F), (C, C)),  # the same number written differently
    ("#### 7.0", "7", (F, F), (C, C)),
    ("#### 007", "7", (F, F), (C, C)),
    ("#### -0", "0", (F, F), (C, C)),
    ("#### .5", "0.5", (F, F), (C, C)),
    ("#### 0.25", "0.5", (F, F), None),
    ("#### 1.5.2", "1.5", (F, F), None),  # not a number: wrong, not missing
    ("#### 42.", "42", (F, F), (C, C)),  # trailing period: "42." != "42"
    ("The answer is 12.", "12", (0, F), (0, C)),
    ("The answer is 12.", "13", (0, F), None),
    ("The answer is -7.", "-7", (0, F), (0, C)),
    ("#### 10\n\nThat is $10.", "10", (C, F), (C, C)),  # flexible: "10."
    ("#### 5\nWait, recount.\n#### 7", "7", (C, C), None),  # the last #### counts
    ("#### 7\nNo, it is\n#### 5", "7", (F, F), None),
    ("#### 8 apples, 3 left", "8", (C, F), None),  # flexible takes the last number
    ("#### 5\n" + "x" * 300, "5", (0, 0), None),  # outside the last 300 characters
    ("x" * 400 + "\n#### 5", "5", (C, C), None),
    ("I do not know.", "12", (0, F), (0, 0)),  # verl's flexible answer is "."; ours none
    ("Well, no idea", "12", (0, F), (0, 0)),  # verl's is ","
    ("", "3", (0, 0), None),
    ("#### ", "3", (0, 0), None),
    ("#### twelve", "12", (0, 0), None),
]


@pytest.mark.parametrize(("response", "truth", "verl", "ours"), GSM8K_VS_VERL)
def test_gsm8k_scores_as_verl_but_by_value(response, truth, verl, ours):
    expected = verl if ours is None else ours
    for method, want in zip(("strict", "flexible"), expected):
        score = gsm8k.compute_score(
            response, truth, method=method, format_score=FORMAT, correct_score=CORRECT
        )
        assert score == want, f"{method} mode"


def test_gsm8k_differs_from_verl_only_upwards_or_on_punctuation():
    """Where we differ from verl, we score higher (a value verl misses by its string
    comparison), or 0 where verl's flexible answer is bare punctuation."""
    assert len(GSM8K_VS_VERL) >= 30
    for response, _, verl, ours in GSM8K_VS_VERL:
        for v, o in zip(verl, ours or verl):
            assert o >= v or (v == FORMAT and o == 0 and not any(c.isdigit() for c in response))


def test_gsm8k_defaults():
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
    (r"\boxed{\sqrt{2}}", r"\boxed{\sqrt2}", CORRECT),
    (r"\boxed{5}", "6", FORMAT),
    (r"\boxed{2", "2", 0.0),  # unbalanced
    ("The answer is 4.", "4", 0.0),
]


@pytest.mark.parametrize(("response", "truth", "expected"), MATH_CASES)
def test_math_boxed_table(response, truth, expected):
    assert math.compute_score(response, truth, format_score=FORMAT) == expected


# DAPO-Math / AIME: an `Answer:` line as DAPO's prompts ask, or a box; the later one counts
ANSWER_LINE_CASES = [
    ("Some work.\nAnswer: 34", "34", CORRECT),
    ("answer:34", "34", CORRECT),
    ("Answer: $\\frac{1}{2}$.", "0.5", CORRECT),
    ("Answer: \\boxed{7}", "7", CORRECT),
    ("Answer: 3\nAnswer: 5", "5", CORRECT),
    ("Answer: 3\nso \\boxed{5}", "5", CORRECT),  # the box comes later
    ("\\boxed{3} then\nAnswer: 5", "3", FORMAT),  # the line comes later
    ("Answer: 35", "34", FORMAT),
    ("Answer:", "34", 0.0),
    ("The result is 34.", "34", 0.0),
]


@pytest.mark.parametrize(("response", "truth", "expected"), ANSWER_LINE_CASES)
def test_answer_line_table(response, truth, expected):
    score = math.compute_score(response, truth, answer_line=True, format_score=FORMAT)
    assert score == expected
    if "\\boxed" not in response:  # the MATH rule reads boxes only
        assert math.compute_score(response, truth, format_score=FORMAT) == 0.0


def test_registry_routes_by_data_source():
    assert compute_score("openai/gsm8k", "#### 3", "3") == 1.0
    assert compute_score("arithmetic", "so #### 9", "9") == 1.0
    assert compute_score("lighteval/MATH", r"\boxed{9}", "9") == 1.0
    assert compute_score("gsm8k", r"\boxed{9}", "9") == 0.0  # gsm8k rule ignores boxes
    assert compute_score("HuggingFaceH4/MATH-500", "Answer: 9", "9") == 0.0  # boxes only
    for source in ("math_dapo", "math", "aime", "aime24", "aime_2025"):  # verl: "aime*"
        assert compute_score(source, "Answer: 9", "9") == 1.0, source
    with pytest.raises(ValueError, match="no rule reward for data_source 'AIME24'"):
        compute_score("AIME24", "Answer: 9", "9")  # verl's prefix is lower case
    with pytest.raises(ValueError) as err:
        compute_score("my/dataset", "x", "1")
    assert "data_source 'my/dataset'; known: BytedTsinghua-SIA/DAPO-Math-17k, Digital" in str(
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
