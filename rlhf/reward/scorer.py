"""Scores for a batch of responses: rule or custom rows by function, model rows by model.

A batch can mix rows whose `reward_model.style` is 'rule' (scored from the response text
and ground truth) and 'model' (scored from the prompt+response tokens by a reward model);
`RewardScorer` routes each row and returns the scores in the batch's order.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from rlhf.reward.registry import RewardFn, build_reward_fn

ModelFn = Callable[[Sequence[Sequence[int]]], list[float] | None]


@dataclass(frozen=True)
class RewardInput:
    """One response to score. `token_ids` (prompt + response) are needed for style 'model'."""

    data_source: str
    response_text: str
    ground_truth: Any = None
    extra_info: dict[str, Any] = field(default_factory=dict)
    style: str = "rule"
    token_ids: Sequence[int] | None = None


class RewardScorer:
    """`scorer(inputs) -> scores`, one float per input, in order."""

    def __init__(self, rule_fn: RewardFn, model_fn: ModelFn | None = None):
        self.rule_fn, self.model_fn = rule_fn, model_fn

    @classmethod
    def from_config(cls, reward_cfg: Any, model_fn: ModelFn | None = None) -> RewardScorer:
        return cls(build_reward_fn(reward_cfg), model_fn)

    def __call__(self, inputs: Sequence[RewardInput]) -> list[float]:
        scores: list[float | None] = [None] * len(inputs)
        model_rows = []
        for i, item in enumerate(inputs):
            if item.style == "model":
                model_rows.append(i)
            elif item.style == "rule":
                scores[i] = float(
                    self.rule_fn(
                        data_source=item.data_source,
                        solution_str=item.response_text,
                        ground_truth=item.ground_truth,
                        extra_info=item.extra_info,
                    )
                )
            else:
                raise ValueError(f"reward_model.style must be rule or model, got {item.style!r}")
        if model_rows:
            for i, value in zip(model_rows, self._model_scores([inputs[i] for i in model_rows])):
                scores[i] = value
        done = [s for s in scores if s is not None]
        assert len(done) == len(scores), "every row is a rule or a model row"
        return done

    def _model_scores(self, items: Sequence[RewardInput]) -> list[float]:
        if self.model_fn is None:
            raise ValueError(
                "rows with reward_model.style=model need a reward model: set reward.model_path"
            )
        token_ids = [item.token_ids for item in items if item.token_ids is not None]
        if len(token_ids) != len(items):
            raise ValueError("reward_model.style=model rows need their token ids to be scored")
        values = self.model_fn(token_ids)
        if values is None:
            raise ValueError("the reward model returned no scores on this rank (not last stage)")
        return [float(v) for v in values]
