"""How each model's passes cut a step's samples into micro-batches, as the config sets it."""

from __future__ import annotations

from dataclasses import dataclass

from rlhf.config.schema import ActorRolloutRefConfig, CriticConfig, DataConfig

AR = "actor_rollout_ref"


@dataclass(frozen=True)
class MicroBatching:
    """One pass's micro-batches: packed to at most `tokens` per micro-batch (per GPU) and
    balanced over the DP ranks; or, with `samples` (verl's `use_dynamic_bsz=false`), that many
    samples per micro-batch in order, `tokens` then being the most they can hold."""

    tokens: int
    samples: int | None = None


@dataclass(frozen=True)
class TokenBudgets:
    """Micro-batching of each model's passes (per GPU)."""

    actor: MicroBatching
    critic: MicroBatching
    ref: MicroBatching
    old_log_prob: MicroBatching  # the actor's forward-only pass (verl: rollout.log_prob_*)


def default_token_budget(micro_batch_size: int, max_prompt: int, max_response: int) -> int:
    """The budget a fixed micro-batch of the longest sequences would use."""
    return micro_batch_size * (max_prompt + max_response)


def setting_or(value: bool | None, default: bool) -> bool:
    """A switch that defaults to another key's value when unset (null)."""
    return default if value is None else value


def _pass(dynamic: bool, tokens: int | None, samples: int, longest: tuple[int, int]):
    """`*_max_token_len_per_gpu` (`tokens`), or by default `samples` x the longest sequence;
    without `dynamic`, `samples` per micro-batch."""
    if not dynamic:
        return MicroBatching(default_token_budget(samples, *longest), samples)
    return MicroBatching(tokens or default_token_budget(samples, *longest))


def token_budgets(
    aro: ActorRolloutRefConfig, critic: CriticConfig, data: DataConfig
) -> TokenBudgets:
    """Each pass's micro-batching (`MicroBatching`), from its role's keys."""
    longest = (data.max_prompt_length, data.max_response_length)
    actor, ref, rollout = aro.actor, aro.ref, aro.rollout
    update = _pass(
        actor.use_dynamic_bsz,
        actor.ppo_max_token_len_per_gpu,
        actor.ppo_micro_batch_size_per_gpu,
        longest,
    )
    forward = update  # the old-log-prob forward: the update's unless its keys say otherwise
    forward_dynamic = setting_or(rollout.log_prob_use_dynamic_bsz, actor.use_dynamic_bsz)
    own = rollout.log_prob_max_token_len_per_gpu or rollout.log_prob_micro_batch_size_per_gpu
    samples = rollout.log_prob_micro_batch_size_per_gpu or actor.ppo_micro_batch_size_per_gpu
    if own or forward_dynamic != actor.use_dynamic_bsz:
        forward = _pass(forward_dynamic, rollout.log_prob_max_token_len_per_gpu, samples, longest)
    reference = forward  # the same forward of the same model shape, unless its keys say so
    ref_dynamic = setting_or(ref.log_prob_use_dynamic_bsz, forward_dynamic)
    if ref.log_prob_max_token_len_per_gpu or ref.log_prob_micro_batch_size_per_gpu:
        samples = ref.log_prob_micro_batch_size_per_gpu or samples
        reference = _pass(ref_dynamic, ref.log_prob_max_token_len_per_gpu, samples, longest)
    elif ref_dynamic != forward_dynamic:
        reference = _pass(ref_dynamic, None, samples, longest)
    return TokenBudgets(
        actor=update,
        critic=_pass(
            critic.use_dynamic_bsz,
            critic.ppo_max_token_len_per_gpu,
            critic.ppo_micro_batch_size_per_gpu,
            longest,
        ),
        ref=reference,
        old_log_prob=forward,
    )
