"""What a PPO step computes from its rollouts before the updates, as one typed record, and
the stage that computes it: token rewards (score - beta x KL), advantages and returns, and
the rollout-correction weights."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from rlhf.algo import compute_advantages, kl_penalty, masked_mean, token_level_rewards
from rlhf.algo.rollout_correction import mismatch_metrics, truncated_is_weights
from rlhf.config.algorithm import AlgorithmConfig, RolloutCorrectionConfig
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
        loss (`algorithm.rollout_correction.rollout_is`; None when off);
    reward_kl: the KL to the reference, the mean over responses of each response's mean
        per-token KL as in verl (what the KL controller and the early stop read; None
        without a reference).
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
    reward_kl: float | None = None


def build_experience(
    batch: RolloutBatch,
    old: tuple[Tensor, Tensor | None],
    ref_logprobs_bt: Tensor | None,
    values_bt: Tensor | None,
    algo: AlgorithmConfig,
    beta: float,
) -> tuple[Experience, dict[str, float]]:
    """Token rewards (score - beta * KL), advantages, returns; the step's KL and reward metrics.

    `old` is the actor's (log-probs, entropies), or the engine's log-probs and None
    (`rollout_correction.bypass_mode`: no mismatch to measure). With a reference, the KL
    reported (and fed to the controller) is the mean over responses of each response's mean
    per-token KL, as in verl; `beta`: the KL controller's coefficient when the KL is in the
    reward (`rlhf.config.algorithm_rules.kl_in_reward`), else 0.
    """
    old_logprobs_bt, old_entropy_bt = old
    mask = batch.mask_bt()
    metrics: dict[str, float] = {}
    kl_bt = torch.zeros_like(old_logprobs_bt)
    reward_kl = None
    if ref_logprobs_bt is not None:
        kl = kl_penalty(old_logprobs_bt, ref_logprobs_bt, algo.kl_penalty)
        kl_bt = torch.where(mask, kl, 0)
        lengths = mask.sum(dim=1).clamp(min=1)
        reward_kl = float((kl_bt.sum(dim=1) / lengths).mean())
        metrics["actor/reward_kl_penalty"] = reward_kl
        metrics["actor/reward_kl_penalty_coeff"] = beta
    rewards = token_level_rewards(batch.scores_b, mask, kl_bt, beta)
    out = compute_advantages(
        algo.adv_estimator,
        rewards,
        mask,
        values_bt=values_bt,
        uids=batch.uids,
        gamma=algo.gamma,
        lam=algo.lam,
        norm_by_std=algo.norm_adv_by_std_in_grpo,
    )
    weights, metrics_is = None, dict[str, float]()
    if not algo.rollout_correction.bypass_mode:
        weights, metrics_is = rollout_correction(batch, old_logprobs_bt, algo.rollout_correction)
    experience = Experience(
        batch,
        old_logprobs_bt,
        old_entropy_bt,
        ref_logprobs_bt,
        values_bt,
        rewards,
        out.advantages_bt,
        out.returns_bt,
        weights,
        reward_kl,
    )
    metrics |= metrics_is
    metrics |= {
        "critic/score/mean": float(batch.scores_b.mean()),
        "critic/rewards/mean": float(rewards.sum(dim=1).mean()),
        "critic/advantages/mean": float(masked_mean(out.advantages_bt, mask)),
    }
    if out.returns_bt is not None:
        metrics["critic/returns/mean"] = float(masked_mean(out.returns_bt, mask))
    if values_bt is not None:
        metrics["critic/values/mean"] = float(masked_mean(values_bt, mask))
    return experience, metrics


def rollout_correction(
    batch: RolloutBatch, old_logprobs_bt: Tensor, settings: RolloutCorrectionConfig
) -> tuple[Tensor | None, dict[str, float]]:
    """Truncated importance weights (when `settings.rollout_is`) and the mismatch metrics
    `rollout_corr/*` of a batch that carries the engine's log-probs."""
    rollout_bt = batch.rollout_logprobs_bt()
    if rollout_bt is None:
        return None, {}
    mask = batch.mask_bt()
    metrics = mismatch_metrics(old_logprobs_bt, rollout_bt, mask)
    weights = None
    if settings.rollout_is is not None:
        weights, is_metrics = truncated_is_weights(
            old_logprobs_bt, rollout_bt, mask, settings.rollout_is, settings.rollout_is_threshold
        )
        metrics |= is_metrics
    return weights, {f"rollout_corr/{k}": v for k, v in metrics.items()}
