"""Scores of a batch of responses where they are generated: rule rows, and model rows remotely.

A batch can mix rows whose `reward_model.style` is 'rule' (scored from the response text and
ground truth by the rule or custom function of their data_source) and 'model'. Rule rows are
scored here: the built-in rules in this process; a custom function, or any rules with
`reward.num_workers` > 1, in worker processes with a per-call timeout
(`rlhf.reward.workers`; each builds the function from the config, so it need not be
picklable).
Model rows go to `reward.url` when it is set; otherwise they come back as NaN, and the
trainer scores them with the reward model of `reward.model_path`
(`rlhf.engine.reward_model`), which runs on every trainer rank.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field
from typing import Any

from rlhf.reward.registry import RewardFn, build_reward_fn
from rlhf.reward.remote import RemoteReward
from rlhf.reward.workers import RewardWorkers, describe, raw_score

STYLES = ("rule", "model")


@dataclass(frozen=True)
class RewardInput:
    """One response to score (`prompt_text` is what a remote judge sees of the prompt)."""

    data_source: str
    response_text: str
    ground_truth: Any = None
    extra_info: dict[str, Any] = field(default_factory=dict)
    style: str = "rule"
    prompt_text: str = ""
    origin: str = ""  # where the prompt came from ("row 12 of train.parquet"), for messages


class NonFiniteReward(FloatingPointError):
    """A reward function returned NaN or inf (the message names the sample)."""


def finite_score(score: float, item: RewardInput) -> float:
    """`score`; a NaN or inf is raised naming the sample."""
    if not math.isfinite(score):
        raise NonFiniteReward(f"the reward function returned {score} for {describe(item)}")
    return score


class RewardScorer:
    """`scorer(inputs) -> scores`, one float per input in order (NaN: for the reward model)."""

    def __init__(
        self,
        rule_fn: RewardFn | None,
        remote: RemoteReward | None = None,
        workers: RewardWorkers | None = None,
    ):
        """`rule_fn` scores in this process; `workers` (custom functions, or several
        processes) instead of it."""
        self.rule_fn, self.remote, self.workers = rule_fn, remote, workers
        self.lock = threading.Lock()  # rounds generated ahead score from their own threads

    @classmethod
    def from_config(cls, reward_cfg: Any) -> RewardScorer:
        remote = None
        if reward_cfg.url:
            remote = RemoteReward(
                reward_cfg.url, reward_cfg.request_timeout_s, reward_cfg.request_retries
            )
        if reward_cfg.custom_fn or reward_cfg.num_workers > 1:
            workers = RewardWorkers(reward_cfg, reward_cfg.num_workers, reward_cfg.timeout_s)
            return cls(None, remote, workers)
        return cls(build_reward_fn(reward_cfg), remote)

    def __call__(self, inputs: list[RewardInput]) -> list[float]:
        with self.lock:
            return self._score(inputs)

    def _score(self, inputs: list[RewardInput]) -> list[float]:
        bad = sorted({item.style for item in inputs} - set(STYLES))
        if bad:
            raise ValueError(f"reward_model.style must be rule or model, got {bad}")
        scores = [math.nan] * len(inputs)
        rules = [i for i, item in enumerate(inputs) if item.style == "rule"]
        rule_items = [inputs[i] for i in rules]
        if self.workers is not None:
            values = self.workers(rule_items) if rule_items else []
        else:
            assert self.rule_fn is not None
            values = [raw_score(self.rule_fn, item) for item in rule_items]
        values = [finite_score(v, item) for v, item in zip(values, rule_items)]
        for i, value in zip(rules, values):
            scores[i] = value
        models = [i for i, item in enumerate(inputs) if item.style == "model"]
        if models and self.remote is not None:
            payload = [_remote_item(inputs[i]) for i in models]
            for i, value in zip(models, self.remote(payload)):
                scores[i] = value
        return scores

    def close(self) -> None:
        if self.workers is not None:
            self.workers.close()


def _remote_item(item: RewardInput) -> dict[str, Any]:
    return {
        "data_source": item.data_source,
        "prompt": item.prompt_text,
        "response": item.response_text,
        "ground_truth": item.ground_truth,
        "extra_info": item.extra_info,
    }


def probe_reward_function(reward_cfg: Any, row: Any) -> None:
    """Before any server starts: the custom function scores an empty response to `row` (a
    training prompt row), so that one that fails, returns a non-number or hangs on it stops
    the run now, in one line, not after the first generation."""
    if not reward_cfg.custom_fn:
        return
    scorer = RewardScorer.from_config(reward_cfg)
    origin = f"{row.origin}, an empty response (the startup check)"
    item = RewardInput(row.data_source, "", row.ground_truth, row.extra_info, origin=origin)
    try:
        scorer([item])
    finally:
        scorer.close()
