"""Which reward function scores a row: rule rewards by `data_source`, or the user's own.

Every row names its `data_source`; the registry maps it to a rule (gsm8k `####`; MATH's last
`\\boxed{}`, DAPO-Math's and AIME's `\\boxed{}` or `Answer:` line, both compared by
math-verify; any name starting with `aime` is scored as AIME, as verl does), so one run can
mix datasets. `reward.custom_fn=path/to/file.py:function`
replaces the rules with a user function: that file is imported and executed as ordinary
Python with the trainer's permissions, so only point it at code you trust. All reward
functions are called as `fn(data_source=, solution_str=, ground_truth=, extra_info=)` and
return a number.

Each rule also says which ground truths it can score (`check_ground_truth`): a gsm8k rule
given `['4']` or `"five"` would score every answer 0 without an error, so the data is checked
against the rules when it is loaded (`rlhf-preprocess check`, training startup) instead.
"""

from __future__ import annotations

import difflib
import hashlib
import importlib.util
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlhf.config.choices import GSM8KMethod
from rlhf.reward import gsm8k, math

if TYPE_CHECKING:  # pyarrow stays out of reward worker processes
    from rlhf.data.parquet import GroundTruthCheck

RewardFn = Callable[..., float]


@dataclass(frozen=True)
class RuleSettings:
    """Settings shared by the rule rewards (`reward.*`)."""

    gsm8k_method: GSM8KMethod = "strict"
    format_score: float = 0.0
    correct_score: float = 1.0

    @classmethod
    def of(cls, reward_cfg: Any) -> RuleSettings:
        """From the `reward` config section."""
        return cls(reward_cfg.gsm8k_method, reward_cfg.format_score, reward_cfg.correct_score)


def _gsm8k_rule(solution: str, ground_truth: Any, settings: RuleSettings) -> float:
    return gsm8k.compute_score(
        solution,
        ground_truth,
        method=settings.gsm8k_method,
        format_score=settings.format_score,
        correct_score=settings.correct_score,
    )


def _math_rule(solution: str, ground_truth: Any, settings: RuleSettings) -> float:
    return math.compute_score(
        solution,
        str(ground_truth),
        format_score=settings.format_score,
        correct_score=settings.correct_score,
    )


GEO3K_FORMAT = re.compile(r"<think>.*</think>.*\\boxed\{.*\}.*", re.DOTALL)
GEO3K_FORMAT_WEIGHT = 0.1  # verl's geo3k score: 0.9 x right answer + 0.1 x format


def _geo3k_rule(solution: str, ground_truth: Any, settings: RuleSettings) -> float:
    """verl's geo3k score: the last boxed answer right, and the <think> ... boxed form."""
    right = _math_rule(solution, ground_truth, settings) == settings.correct_score
    formatted = GEO3K_FORMAT.fullmatch(solution) is not None
    w = GEO3K_FORMAT_WEIGHT
    return (1 - w) * settings.correct_score * right + w * formatted


DAPO_WRONG_SCORE = -1.0  # verl's math_dapo: a wrong or missing answer, whatever its form


def _answer_line_rule(solution: str, ground_truth: Any, settings: RuleSettings) -> float:
    if math.final_answer(solution, answer_line=True) is None:
        return DAPO_WRONG_SCORE
    return math.compute_score(
        solution,
        str(ground_truth),
        answer_line=True,
        format_score=DAPO_WRONG_SCORE,
        correct_score=settings.correct_score,
    )


RuleFn = Callable[[str, Any, RuleSettings], float]
_RULES: dict[str, RuleFn] = {
    "openai/gsm8k": _gsm8k_rule,
    "gsm8k": _gsm8k_rule,
    "arithmetic": _gsm8k_rule,  # the quickstart problems (rlhf/data/arithmetic.py)
    "shapes": _gsm8k_rule,  # the vision quickstart's (rlhf/quickstart/shapes_task.py)
    "hiyouga/geometry3k": _geo3k_rule,  # verl's geo3k example (rlhf-preprocess geo3k)
    # verl's MATH names: the last \boxed{} answer
    "lighteval/MATH": _math_rule,
    "DigitalLearningGmbH/MATH-lighteval": _math_rule,
    "HuggingFaceH4/MATH-500": _math_rule,
    # verl's math_dapo names (and any "aime..." name, see `_rule_name`): the last \boxed{}
    # or `Answer: ...` line, whichever comes last
    "math": _answer_line_rule,
    "math_dapo": _answer_line_rule,
    "math_dapo_reasoning": _answer_line_rule,
    "BytedTsinghua-SIA/DAPO-Math-17k": _answer_line_rule,
    "aime": _answer_line_rule,
}


def _gsm8k_answer(solution: str, settings: RuleSettings) -> str | None:
    answer = gsm8k.extract_answer(solution, settings.gsm8k_method)
    if answer is None:
        return None
    return gsm8k.normalize_number(answer) or answer.strip()


def _math_answer(solution: str, settings: RuleSettings) -> str | None:
    answer = math.final_answer(solution)
    return None if answer is None else math.canonical_answer(answer)


def _answer_line_answer(solution: str, settings: RuleSettings) -> str | None:
    answer = math.final_answer(solution, answer_line=True)
    return None if answer is None else math.canonical_answer(answer)


AnswerFn = Callable[[str, RuleSettings], "str | None"]
# What each built-in rule extracts as its answer and accepts as a ground truth; a new
# built-in rule needs an entry here (a KeyError at import otherwise).
_RULE_ANSWERS: dict[RuleFn, AnswerFn] = {
    _gsm8k_rule: _gsm8k_answer,
    _math_rule: _math_answer,
    _geo3k_rule: _math_answer,
    _answer_line_rule: _answer_line_answer,
}
_ANSWERS: dict[str, AnswerFn] = {source: _RULE_ANSWERS[rule] for source, rule in _RULES.items()}

TruthCheck = Callable[[Any], "str | None"]
_RULE_CHECKS: dict[RuleFn, TruthCheck] = {
    _gsm8k_rule: gsm8k.ground_truth_problem,
    _math_rule: math.ground_truth_problem,
    _geo3k_rule: math.ground_truth_problem,
    _answer_line_rule: math.ground_truth_problem,
}
_TRUTH_CHECKS: dict[str, TruthCheck] = {s: _RULE_CHECKS[rule] for s, rule in _RULES.items()}


def _rule_name(data_source: str) -> str:
    """The entry that scores `data_source`: its own, else "aime" for a name starting with
    "aime" (verl scores every such source with its math_dapo rule: aime24, aime2025, ...)."""
    if data_source not in _RULES and data_source.startswith("aime"):
        return "aime"
    return data_source


def register_rule(
    data_source: str,
    rule: RuleFn,
    answer: AnswerFn | None = None,
    check: TruthCheck | None = None,
) -> None:
    """Score rows of `data_source` with `rule(solution, ground_truth, settings)`; `answer`
    (solution, settings) -> the response's final answer in a canonical form (None: it gave
    none) lets validation take majority votes (maj@N) on that source; `check(ground_truth)`
    -> why the rule cannot score it (None: it can) lets the data loader reject such rows
    (without one, any non-null ground truth is accepted)."""
    _RULES[data_source] = rule
    _ANSWERS.pop(data_source, None)
    _TRUTH_CHECKS.pop(data_source, None)
    if answer is not None:
        _ANSWERS[data_source] = answer
    if check is not None:
        _TRUTH_CHECKS[data_source] = check


def answer_extractor(data_source: str) -> AnswerFn | None:
    """The canonical-answer function of `data_source` (equal strings = the same answer), or
    None when the source has none (no majority vote)."""
    return _ANSWERS.get(_rule_name(data_source))


def known_sources() -> list[str]:
    return sorted(_RULES)


def _unknown_source(data_source: str) -> str:
    near = difflib.get_close_matches(data_source, known_sources(), n=1, cutoff=0.6)
    hint = f" (did you mean {near[0]!r}?)" if near else ""
    return (
        f"no rule reward for data_source {data_source!r}{hint}; known: "
        f"{', '.join(known_sources())} (or set reward.custom_fn=path/to/file.py:function)"
    )


def check_ground_truth(data_source: str, ground_truth: Any) -> tuple[str, str] | None:
    """(column, what is wrong) when no rule can score `ground_truth` for `data_source`, else
    None. Called on every rule row when data is loaded, so a row that would fail or silently
    score 0 at reward time is reported at startup with its file and row."""
    if _rule_name(data_source) not in _RULES:
        return "data_source", _unknown_source(data_source)
    check = _TRUTH_CHECKS.get(_rule_name(data_source))
    problem = check(ground_truth) if check is not None else None
    if problem is None:
        return None
    shown = repr(ground_truth)
    shown = shown if len(shown) <= 60 else shown[:57] + "..."
    return "reward_model", f"ground_truth {shown} of data_source {data_source!r}: {problem}"


def ground_truth_checker(reward_cfg: Any) -> GroundTruthCheck | None:
    """The check the `reward` config section implies for loaded rule rows: the rules' own, or
    none with `reward.custom_fn` (the user's function scores every data source and decides
    which ground truths it accepts) or `reward.model_scores_every_row` (no rule scores)."""
    if reward_cfg.custom_fn or reward_cfg.model_scores_every_row:
        return None
    return check_ground_truth


def compute_score(
    data_source: str,
    solution_str: str,
    ground_truth: Any,
    extra_info: dict | None = None,
    *,
    settings: RuleSettings = RuleSettings(),
) -> float:
    """The rule reward of one response; unknown `data_source` is a ValueError."""
    rule = _RULES.get(_rule_name(data_source))
    if rule is None:
        raise ValueError(_unknown_source(data_source))
    return float(rule(solution_str, ground_truth, settings))


def load_custom_fn(spec: str) -> RewardFn:
    """The function named by 'path/to/file.py:function' (imports, i.e. runs, that file)."""
    path_text, sep, name = spec.rpartition(":")
    if not sep or not path_text or not name.isidentifier():
        raise ValueError(
            f"reward.custom_fn={spec!r} must look like 'path/to/file.py:function_name'"
        )
    path = Path(path_text).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"reward.custom_fn: file not found: {path}")
    digest = hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:12]
    module_name = f"rlhf_custom_reward_{digest}"
    module_spec = importlib.util.spec_from_file_location(module_name, path)
    if module_spec is None or module_spec.loader is None:
        raise ValueError(f"reward.custom_fn: {path} cannot be imported as a Python file")
    module = importlib.util.module_from_spec(module_spec)
    try:
        module_spec.loader.exec_module(module)
    except Exception as e:  # the user's code may raise anything; say where it came from
        raise ValueError(f"reward.custom_fn: importing {path} failed: {e!r}") from e
    fn = getattr(module, name, None)
    if not callable(fn):
        defined = sorted(k for k, v in vars(module).items() if callable(v) and k[0] != "_")
        raise ValueError(
            f"reward.custom_fn: {path} has no function {name!r} "
            f"(it defines: {', '.join(defined) or 'none'})"
        )
    return _checked(fn, spec)


def _checked(fn: Callable[..., Any], spec: str) -> RewardFn:
    """Call `fn` by keyword; accept a number or a dict with 'score'."""

    def call(data_source: str, solution_str: str, ground_truth: Any, extra_info=None) -> float:
        result = fn(
            data_source=data_source,
            solution_str=solution_str,
            ground_truth=ground_truth,
            extra_info=extra_info or {},
        )
        if isinstance(result, dict) and "score" in result:
            result = result["score"]
        if isinstance(result, bool) or not isinstance(result, int | float):
            raise ValueError(f"reward.custom_fn {spec} returned {result!r}; expected a number")
        return float(result)

    return call


def build_reward_fn(reward_cfg: Any) -> RewardFn:
    """The reward function the `reward` config section asks for (custom, else the rules)."""
    if reward_cfg.custom_fn:
        return load_custom_fn(reward_cfg.custom_fn)
    settings = RuleSettings.of(reward_cfg)

    def rules(data_source: str, solution_str: str, ground_truth: Any, extra_info=None) -> float:
        return compute_score(data_source, solution_str, ground_truth, extra_info, settings=settings)

    return rules
