"""The `algorithm` section: advantages, the KL in the reward, and corrections of the batch."""

from __future__ import annotations

from dataclasses import dataclass

from rlhf.config.choices import (
    AdvEstimator,
    FilterGroupsMetric,
    KLControlType,
    KLEstimator,
    RolloutISLevel,
)
from rlhf.config.fields import doc


@dataclass
class KLControlConfig:
    """Coefficient of the KL penalty in the reward (Ziegler et al. 2019)."""

    type: KLControlType = doc("fixed", "fixed coefficient or adaptive controller")
    kl_coef: float = doc(0.001, "initial (or fixed) KL coefficient beta", ge=0)
    target_kl: float = doc(0.1, "adaptive: KL the controller steers towards", gt=0)
    horizon: int = doc(10000, "adaptive: steps over which the error is corrected", gt=0)


@dataclass
class RolloutCorrectionConfig:
    """Correction for the engine sampling from slightly different log-probs than the trainer's."""

    rollout_is: RolloutISLevel | None = doc(
        None,
        "weight the policy loss by min(pi_old / pi_rollout, rollout_is_threshold) per token or "
        "per response (truncated importance sampling; null: off, mismatch metrics still logged)",
    )
    rollout_is_threshold: float = doc(2.0, "cap of the importance weights", gt=0)
    bypass_mode: bool = doc(
        False,
        "use the engine's log-probs of the sampled tokens as the old log-probs and skip the "
        "actor's forward before the updates (fp32 on CPU they agree with the trainer's within "
        "1e-7; in bf16 the PPO ratio is then taken against the sampling policy itself)",
    )


@dataclass
class FilterGroupsConfig:
    """DAPO's dynamic sampling: only prompt groups whose samples score differently train."""

    enable: bool = doc(False, "drop groups whose samples all score the same, generate more")
    metric: FilterGroupsMetric = doc(
        "score",
        "what must differ within a group: score (the reward functions' score) or seq_reward "
        "(the score after overlong shaping, what the advantages see)",
    )
    max_num_gen_batches: int = doc(
        0, "most generation rounds per step before failing (0: no limit)", ge=0
    )


@dataclass
class AlgorithmConfig:
    """PPO algorithm settings."""

    adv_estimator: AdvEstimator = doc(
        "gae", "advantage estimator; only gae uses (and builds) the critic"
    )
    norm_adv_by_std_in_grpo: bool = doc(
        True, "grpo: divide by the group's score std (false: Dr. GRPO, mean-centred only)"
    )
    gamma: float = doc(1.0, "discount", ge=0, le=1)
    lam: float = doc(1.0, "GAE lambda", ge=0, le=1)
    use_kl_in_reward: bool | None = doc(
        False,
        "subtract kl_coef x KL(actor || ref) from the rewards (kl_ctrl sets kl_coef); null: on "
        "unless actor.use_kl_loss is",
    )
    kl_penalty: KLEstimator = doc("kl", "per-token KL estimator used in the reward")
    kl_ctrl: KLControlConfig = doc(KLControlConfig, "KL penalty controller")
    rollout_correction: RolloutCorrectionConfig = doc(
        RolloutCorrectionConfig, "rollout-training mismatch correction"
    )
    filter_groups: FilterGroupsConfig = doc(FilterGroupsConfig, "dynamic sampling (DAPO)")
