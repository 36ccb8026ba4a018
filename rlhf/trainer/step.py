"""The compute part of one PPO step, between a scored batch and the weight sync.

`PPOTrainer.train_step` wraps it with generation, weight sync and metrics; the trainer tests
run it directly on a synthetic batch, so both exercise the same sequence of stages.
"""

from __future__ import annotations

import math

from torch import Tensor

from rlhf.algo.kl import AdaptiveKLController, FixedKLController
from rlhf.config.schema import RLHFConfig
from rlhf.logging import Timer
from rlhf.rollout.batch import RolloutBatch
from rlhf.trainer.experience import Experience
from rlhf.trainer.nonfinite import NonFiniteError, nonfinite_marks, nonfinite_tensors
from rlhf.trainer.setup import PPOModels
from rlhf.trainer.stages import build_experience, compute_logprobs, compute_values, run_updates


def rollout_logprobs(batch: RolloutBatch) -> tuple[Tensor, None]:
    """`algorithm.rollout_correction.bypass_mode`: the engine's log-probs as the old ones (no
    entropies)."""
    logprobs_bt = batch.rollout_logprobs_bt()
    if logprobs_bt is None:
        raise ValueError(
            "algorithm.rollout_correction.bypass_mode needs the engine's log-probs of the "
            "sampled tokens, and this batch has none"
        )
    return logprobs_bt, None


def nonfinite_experience(exp: Experience) -> list[str]:
    """Which of the step's per-token tensors have a NaN/inf on a response token."""
    named = {
        "old_log_prob": exp.old_logprobs_bt,
        "ref_log_prob": exp.ref_logprobs_bt,
        "values": exp.values_bt,
        "advantages": exp.advantages_bt,
        "returns": exp.returns_bt,
    }
    return nonfinite_tensors(named, exp.batch.mask_bt())


def train_on_batch(
    models: PPOModels,
    batch: RolloutBatch,
    cfg: RLHFConfig,
    kl_ctrl: FixedKLController | AdaptiveKLController,
    timer: Timer,
) -> tuple[Experience, dict[str, float]]:
    """Old log-probs (the engine's under `rollout_correction.bypass_mode`), reference
    log-probs and values (when those models exist), advantages, then the critic's and the
    actor's updates; the experience and the step's metrics.

    The KL controller moves only when the KL is applied in the reward.
    """
    m = models
    old: tuple[Tensor, Tensor | None]
    if cfg.algorithm.rollout_correction.bypass_mode:
        old = rollout_logprobs(batch)
    else:
        with timer.stage("old_log_prob"):
            old = compute_logprobs(m.actor, batch, m.planner, m.budgets.actor, m.logprob_head)
    ref = values = None
    if m.ref is not None:
        with timer.stage("ref"):
            ref, _ = compute_logprobs(m.ref, batch, m.planner, m.budgets.ref, m.logprob_head)
    if m.critic is not None:
        with timer.stage("values"):
            values = compute_values(m.critic, batch, m.planner, m.budgets.critic)
    with timer.stage("adv"):
        exp, metrics = build_experience(batch, old, ref, values, cfg.algorithm, kl_ctrl.value)
    bad = nonfinite_experience(exp)
    if bad:  # identical on every rank: all skip or all stop
        if cfg.trainer.on_nonfinite == "stop":
            raise NonFiniteError(
                f"not finite before the updates: {', '.join(bad)} (trainer.on_nonfinite=stop)"
            )
        finite = {k: v for k, v in metrics.items() if math.isfinite(v)}
        return exp, finite | {"training/skipped_step": 1.0} | nonfinite_marks(bad)
    if cfg.algorithm.use_kl_in_reward:
        kl_ctrl.update(metrics["actor/reward_kl_penalty"], batch.size)
    if m.critic_update is not None:
        with timer.stage("update_critic"):
            metrics |= run_updates(m.critic_update, exp, m.planner)
    with timer.stage("update_actor"):
        metrics |= run_updates(m.actor_update, exp, m.planner)
    if cfg.actor_rollout_ref.actor.use_kl_loss:
        metrics["actor/kl_coef"] = cfg.actor_rollout_ref.actor.kl_loss_coef
    return exp, metrics
