"""The compute part of one PPO step, between a scored batch and the weight sync.

`PPOTrainer.train_step` wraps it with generation, weight sync and metrics; the trainer tests
run it directly on a synthetic batch, so both exercise the same sequence of stages.
"""

from __future__ import annotations

from rlhf.algo.kl import AdaptiveKLController, FixedKLController
from rlhf.config.schema import RLHFConfig
from rlhf.logging import Timer
from rlhf.rollout.batch import RolloutBatch
from rlhf.trainer.experience import Experience
from rlhf.trainer.setup import PPOModels
from rlhf.trainer.stages import build_experience, compute_logprobs, compute_values, run_updates


def train_on_batch(
    models: PPOModels, batch: RolloutBatch, cfg: RLHFConfig,
    kl_ctrl: FixedKLController | AdaptiveKLController, timer: Timer,
) -> tuple[Experience, dict[str, float]]:  # fmt: skip
    """Old log-probs, reference log-probs and values (when those models exist), advantages,
    then the critic's and the actor's updates; the experience and the step's metrics.

    The KL controller moves only when the KL is applied in the reward.
    """
    m = models
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
