"""PPO math as pure tensor functions: masked statistics, KL, advantages, losses.

Nothing here knows about Megatron, SGLang or the trainer: inputs are [batch, response_len]
tensors with a response mask, so every formula can be tested against a hand computation.
"""

from rlhf.algo.advantages import (
    AdvantageOutput,
    compute_advantages,
    compute_gae,
    compute_grpo_advantages,
    compute_reinforce_plus_plus_advantages,
    compute_rloo_advantages,
)
from rlhf.algo.kl import (
    AdaptiveKLController,
    FixedKLController,
    build_kl_controller,
    kl_penalty,
    token_level_rewards,
)
from rlhf.algo.losses import (
    BatchCounts,
    PolicyLossOutput,
    ValueLossOutput,
    aggregate_loss,
    entropy_loss,
    global_batch_counts,
    gspo_policy_loss,
    kl_loss,
    policy_loss,
    value_loss,
)
from rlhf.algo.stats import (
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
    response_ends,
    response_ids,
    response_starts,
)

__all__ = [
    "AdaptiveKLController",
    "AdvantageOutput",
    "BatchCounts",
    "FixedKLController",
    "PolicyLossOutput",
    "ValueLossOutput",
    "aggregate_loss",
    "build_kl_controller",
    "compute_advantages",
    "compute_gae",
    "compute_grpo_advantages",
    "compute_reinforce_plus_plus_advantages",
    "compute_rloo_advantages",
    "entropy_loss",
    "global_batch_counts",
    "gspo_policy_loss",
    "kl_loss",
    "kl_penalty",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "policy_loss",
    "response_ends",
    "response_ids",
    "response_starts",
    "token_level_rewards",
    "value_loss",
]
