"""What a PPO step computes from its rollouts before the updates, as one typed record."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from rlhf.rollout.batch import RolloutBatch


@dataclass(frozen=True)
class Experience:
    """The step's samples and the per-token tensors the losses read.

    Every tensor is [B, R] fp32 on the CPU (B samples, R = the longest response), zero
    beyond each response (`batch.mask_bt()`), identical on every rank:

    old_logprobs_bt / old_entropy_bt: the actor's log-probs of the response tokens and its
        entropies before the update (at the rollout temperature); under
        `algorithm.rollout_correction.bypass_mode` the engine's log-probs and no entropies;
    ref_logprobs_bt: the frozen reference's log-probs (None without a reference);
    values_bt: the critic's values before the update (None without a critic);
    token_rewards_bt: score at the last token minus the KL penalty (beta x KL) per token;
    advantages_bt, returns_bt: from `algorithm.adv_estimator` (returns: the critic's
        regression targets, None for estimators without a critic);
    rollout_is_weights_bt: truncated importance weights pi_old / pi_rollout on the policy
        loss (`algorithm.rollout_correction.rollout_is`; None when off).
    """

    batch: RolloutBatch
    old_logprobs_bt: Tensor
    old_entropy_bt: Tensor | None
    ref_logprobs_bt: Tensor | None
    values_bt: Tensor | None
    token_rewards_bt: Tensor
    advantages_bt: Tensor
    returns_bt: Tensor | None
    rollout_is_weights_bt: Tensor | None = None
