"""Rewards: rule rewards keyed by data_source, user functions, and reward models."""

from rlhf.reward.registry import (
    RuleSettings,
    build_reward_fn,
    check_ground_truth,
    compute_score,
    ground_truth_checker,
    known_sources,
    load_custom_fn,
    register_rule,
)
from rlhf.reward.scorer import RewardInput, RewardScorer

__all__ = [
    "RewardInput",
    "RewardScorer",
    "RuleSettings",
    "build_reward_fn",
    "check_ground_truth",
    "compute_score",
    "ground_truth_checker",
    "known_sources",
    "load_custom_fn",
    "register_rule",
]
