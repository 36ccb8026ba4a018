"""Tokens per packed micro-batch of each model's passes, as the config sets them."""

from __future__ import annotations

from dataclasses import dataclass

from rlhf.config.schema import RLHFConfig


@dataclass(frozen=True)
class TokenBudgets:
    """Tokens per packed micro-batch (per GPU) for each model's passes."""

    actor: int
    critic: int
    ref: int
    old_log_prob: int  # the actor's forward-only pass (verl: rollout.log_prob_*)


def default_token_budget(micro_batch_size: int, max_prompt: int, max_response: int) -> int:
    """The budget a fixed micro-batch of the longest sequences would use."""
    return micro_batch_size * (max_prompt + max_response)


def token_budgets(cfg: RLHFConfig) -> TokenBudgets:
    """`*_max_token_len_per_gpu`, or by default micro-batch size x the longest sequence."""
    longest = (cfg.data.max_prompt_length, cfg.data.max_response_length)
    actor, critic, ref = cfg.actor_rollout_ref.actor, cfg.critic, cfg.actor_rollout_ref.ref
    rollout = cfg.actor_rollout_ref.rollout
    update = actor.ppo_max_token_len_per_gpu or default_token_budget(
        actor.ppo_micro_batch_size_per_gpu, *longest
    )
    forward = rollout.log_prob_max_token_len_per_gpu or (
        default_token_budget(rollout.log_prob_micro_batch_size_per_gpu, *longest)
        if rollout.log_prob_micro_batch_size_per_gpu
        else update
    )
    return TokenBudgets(
        actor=update,
        critic=critic.ppo_max_token_len_per_gpu
        or default_token_budget(critic.ppo_micro_batch_size_per_gpu, *longest),
        ref=ref.log_prob_max_token_len_per_gpu
        or default_token_budget(ref.log_prob_micro_batch_size_per_gpu, *longest),
        old_log_prob=forward,
    )
