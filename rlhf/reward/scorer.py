"""Scores of a batch of responses where they are generated: rule rows, and model rows remotely.

A batch can mix rows whose `reward_model.style` is 'rule' (scored from the response text and
ground truth by the rule or custom function of their data_source) and 'model'. Rule rows are
scored here, one by one or, with `reward.num_workers` > 1, in a pool of processes (each
builds the reward function from the config, so custom functions need not be picklable).
Model rows go to `reward.url` when it is set; otherwise they come back as NaN, and the
trainer scores them with the reward model of `reward.model_path`
(`rlhf.trainer.reward_model`), which runs on every trainer rank.
"""

from __future__ import annotations

import math
import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from rlhf.reward.registry import RewardFn, build_reward_fn
from rlhf.reward.remote import RemoteReward

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


_WORKER_FN: RewardFn | None = None


def _init_worker(reward_cfg: Any) -> None:
    global _WORKER_FN
    _WORKER_FN = build_reward_fn(reward_cfg)


def _score_in_worker(item: RewardInput) -> float:
    assert _WORKER_FN is not None
    return _rule_score(_WORKER_FN, item)


class NonFiniteReward(FloatingPointError):
    """A reward function returned NaN or inf (the message names the sample)."""


def _rule_score(fn: RewardFn, item: RewardInput) -> float:
    score = float(fn(item.data_source, item.response_text, item.ground_truth, item.extra_info))
    if not math.isfinite(score):
        raise NonFiniteReward(
            f"the reward function of data_source {item.data_source!r} returned {score} for "
            f"the response {item.response_text[:80]!r} (ground truth {item.ground_truth!r})"
        )
    return score


class RewardScorer:
    """`scorer(inputs) -> scores`, one float per input in order (NaN: for the reward model)."""

    def __init__(
        self,
        rule_fn: RewardFn,
        remote: RemoteReward | None = None,
        pool: ProcessPoolExecutor | None = None,
    ):
        self.rule_fn, self.remote, self.pool = rule_fn, remote, pool

    @classmethod
    def from_config(cls, reward_cfg: Any) -> RewardScorer:
        remote = None
        if reward_cfg.url:
            remote = RemoteReward(
                reward_cfg.url, reward_cfg.request_timeout_s, reward_cfg.request_retries
            )
        pool = None
        if reward_cfg.num_workers > 1:
            pool = ProcessPoolExecutor(
                reward_cfg.num_workers,
                mp_context=multiprocessing.get_context("spawn"),
                initializer=_init_worker,
                initargs=(reward_cfg,),
            )
        return cls(build_reward_fn(reward_cfg), remote, pool)

    def __call__(self, inputs: list[RewardInput]) -> list[float]:
        bad = sorted({item.style for item in inputs} - set(STYLES))
        if bad:
            raise ValueError(f"reward_model.style must be rule or model, got {bad}")
        scores = [math.nan] * len(inputs)
        rules = [i for i, item in enumerate(inputs) if item.style == "rule"]
        rule_items = [inputs[i] for i in rules]
        if self.pool is not None:
            values = list(self.pool.map(_score_in_worker, rule_items, chunksize=8))
        else:
            values = [_rule_score(self.rule_fn, item) for item in rule_items]
        for i, value in zip(rules, values):
            scores[i] = value
        models = [i for i, item in enumerate(inputs) if item.style == "model"]
        if models and self.remote is not None:
            payload = [_remote_item(inputs[i]) for i in models]
            for i, value in zip(models, self.remote(payload)):
                scores[i] = value
        return scores

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(cancel_futures=True)


def _remote_item(item: RewardInput) -> dict[str, Any]:
    return {
        "data_source": item.data_source,
        "prompt": item.prompt_text,
        "response": item.response_text,
        "ground_truth": item.ground_truth,
        "extra_info": item.extra_info,
    }
