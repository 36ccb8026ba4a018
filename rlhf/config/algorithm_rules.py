"""Rules of the algorithm settings: combinations that would silently train nothing, or
something other than what their keys name, are refused before anything starts; the one that
is legal but easy to set by accident (the KL both in the reward and as a loss) is said at
startup.

- GRPO and RLOO compare the samples drawn for one prompt: with `rollout.n=1` every advantage
  is 0 (refused; verl would train on the raw score instead, which is REINFORCE without a
  baseline: `adv_estimator=reinforce_plus_plus` is the estimator for one sample per prompt).
- GSPO (Zheng et al. 2025) is defined on the sequence-level ratio with the sequence mean of
  the loss and clip ranges of ~1e-4: the token-level defaults (token-mean, clip 0.2, which a
  geometric mean of token ratios practically never leaves) are refused, not kept silently.
- DAPO's dynamic sampling needs groups of several samples; its overlong buffer must fit in the
  response length.
- `trainer.critic_warmup` freezes the actor while the critic trains: it needs a critic.
"""

from __future__ import annotations

from rlhf.config.algorithm import (
    AlgorithmConfig,
    FilterGroupsConfig,
    RolloutCorrectionConfig,
)
from rlhf.config.choices import CRITIC_ESTIMATORS, GROUP_ESTIMATORS
from rlhf.config.loader import ConfigError
from rlhf.config.schema import ActorConfig, OverlongBufferConfig

AR = "actor_rollout_ref"


def kl_in_reward_on(use_kl_in_reward: bool | None, use_kl_loss: bool) -> bool:
    """`algorithm.use_kl_in_reward`; null: on unless the actor has a KL loss
    (`actor.use_kl_loss`)."""
    if use_kl_in_reward is None:
        return not use_kl_loss
    return use_kl_in_reward


def reference_on(use_kl_in_reward: bool | None, use_kl_loss: bool) -> bool:
    """Whether the run builds the frozen reference: for a KL in the reward or as a loss."""
    return kl_in_reward_on(use_kl_in_reward, use_kl_loss) or use_kl_loss


def kl_in_reward(algorithm: AlgorithmConfig, actor: ActorConfig) -> bool:
    """`kl_in_reward_on` of the algorithm and actor sections."""
    return kl_in_reward_on(algorithm.use_kl_in_reward, actor.use_kl_loss)


def uses_reference(algorithm: AlgorithmConfig, actor: ActorConfig) -> bool:
    """`reference_on` of the algorithm and actor sections."""
    return reference_on(algorithm.use_kl_in_reward, actor.use_kl_loss)


def require_off_policy_correction(
    correction: RolloutCorrectionConfig, setting: str, samples: str
) -> None:
    """`setting` trains on `samples` (of another policy than the one trained): refused
    without truncated importance sampling or bypass mode (`algorithm.rollout_correction`)."""
    if correction.rollout_is is None and not correction.bypass_mode:
        raise ConfigError(
            f"{setting} trains on {samples}: set algorithm.rollout_correction.rollout_is="
            "token (truncated importance sampling against their log-probs) or "
            "algorithm.rollout_correction.bypass_mode=true"
        )


def check_algorithm(algorithm: AlgorithmConfig, n: int, critic_warmup: int) -> None:
    """Refuse an estimator that would train nothing: a group estimator with `rollout.n` < 2,
    `trainer.critic_warmup` without a critic."""
    estimator = algorithm.adv_estimator
    if estimator in GROUP_ESTIMATORS and n < 2:
        raise ConfigError(
            f"algorithm.adv_estimator={estimator} compares the {AR}.rollout.n samples of each "
            f"prompt; with rollout.n={n} every advantage is 0 and nothing trains: set "
            "rollout.n >= 2 (GRPO runs use 4-16), or adv_estimator=reinforce_plus_plus for one "
            "sample per prompt"
        )
    if critic_warmup and estimator not in CRITIC_ESTIMATORS:
        raise ConfigError(
            f"trainer.critic_warmup={critic_warmup} trains only the critic for its "
            f"first steps, and adv_estimator={estimator} has no critic: nothing would train; "
            "set trainer.critic_warmup=0 (or adv_estimator=gae)"
        )


def check_gspo(actor: ActorConfig) -> None:
    """GSPO's sequence-level loss and clip ranges, not the token-level defaults."""
    if actor.policy_loss.loss_mode != "gspo":
        return
    if actor.loss_agg_mode != "seq-mean-token-mean":
        raise ConfigError(
            f"{AR}.actor.policy_loss.loss_mode=gspo is defined with the sequence mean of the "
            f"loss: set {AR}.actor.loss_agg_mode=seq-mean-token-mean (is {actor.loss_agg_mode})"
        )
    if actor.clip_ratio_low is None or actor.clip_ratio_high is None:
        raise ConfigError(
            f"{AR}.actor.policy_loss.loss_mode=gspo clips the sequence-level ratio, which stays "
            f"within ~1e-3 of 1, so clip_ratio={actor.clip_ratio} would never clip: set "
            f"{AR}.actor.clip_ratio_low and clip_ratio_high (the paper's: 3e-4 and 4e-4)"
        )


def check_dapo(
    overlong: OverlongBufferConfig,
    filter_groups: FilterGroupsConfig,
    max_response_length: int,
    n: int,
) -> None:
    """DAPO's overlong buffer within `data.max_response_length`; dynamic sampling
    (`algorithm.filter_groups`) on groups of several samples."""
    if overlong.enable and overlong.len >= max_response_length:
        raise ConfigError(
            f"reward.overlong_buffer.len ({overlong.len}) must be below "
            f"data.max_response_length ({max_response_length})"
        )
    if filter_groups.enable and n < 2:
        raise ConfigError(
            f"algorithm.filter_groups.enable needs {AR}.rollout.n >= 2 (is {n}): a group of "
            "one sample always scores the same and would always be dropped"
        )


def algorithm_notes(algorithm: AlgorithmConfig, actor: ActorConfig) -> list[str]:
    """Legal settings worth a line at startup."""
    if algorithm.use_kl_in_reward and actor.use_kl_loss:
        return [
            "the KL to the reference counts twice: in the reward (algorithm.use_kl_in_reward="
            f"true, kl_ctrl) and as a loss ({AR}.actor.use_kl_loss=true, kl_loss_coef); verl's "
            "GRPO uses only the loss: leave use_kl_in_reward unset (or false) for that"
        ]
    return []
