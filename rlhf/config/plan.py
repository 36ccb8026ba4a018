"""The resolved run plan: what a validated config means, worked out once.

`resolve(cfg, world_size)` turns the config tree into a frozen `RunPlan`: which models the
run builds, where the KL goes, each model's parallel layout and update, every pass's
micro-batching, how many prompts a step draws. Components read the plan (and their own
config section), not the whole tree, so that no derived fact is worked out twice.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from rlhf.config.budgets import MicroBatching, TokenBudgets, token_budgets
from rlhf.config.schema import ActorConfig, CriticConfig, RLHFConfig
from rlhf.config.validate import (
    ParallelLayout,
    distributed_optimizer_on,
    kl_in_reward,
    prompt_sampler_batch,
    section_layout,
    stored_groups_per_step,
    uses_critic,
    uses_reference,
    virtual_pipeline_size,
)

KLPlacement = Literal["reward", "loss", "both", "none"]


@dataclass(frozen=True)
class UpdatePlan:
    """How one trained model is updated every step: `mini_batch_samples` samples (prompts x
    `rollout.n`) per optimizer step, `epochs` passes, `micro_batching` per GPU,
    `optimizer_steps` over the whole run (the LR schedule's horizon), `distributed_optimizer`
    (Adam state sharded over DP x SP)."""

    role: Literal["actor", "critic"]
    mini_batch_samples: int
    epochs: int
    micro_batching: MicroBatching
    optimizer_steps_per_step: int
    distributed_optimizer: bool
    vp_size: int

    def optimizer_steps(self, total_steps: int) -> int:
        """Optimizer steps of a run of `total_steps` steps."""
        return total_steps * self.epochs * self.optimizer_steps_per_step


@dataclass(frozen=True)
class RunPlan:
    """A validated config, resolved for a world of `layout.world_size` ranks.

    critic: None for critic-free estimators (only GAE needs values); reference: whether the
    frozen reference is built (a KL in the reward or as a loss); kl: where the KL to the
    reference goes; budgets: each pass's micro-batching; prompts_per_step: what the prompt
    sampler draws (the groups not taken from stored rollouts); stored_groups_per_step:
    those taken from `data.rollout_files`.
    """

    layout: ParallelLayout
    actor: UpdatePlan
    critic: UpdatePlan | None
    critic_layout: ParallelLayout | None
    reference: bool
    kl: KLPlacement
    budgets: TokenBudgets
    samples_per_prompt: int
    prompts_per_step: int
    stored_groups_per_step: int

    @property
    def kl_in_reward(self) -> bool:
        return self.kl in ("reward", "both")

    @property
    def kl_loss(self) -> bool:
        return self.kl in ("loss", "both")

    @property
    def models(self) -> tuple[str, ...]:
        """The Megatron models the run builds: actor, and ref / critic when used."""
        return ("actor",) + ("ref",) * self.reference + ("critic",) * (self.critic is not None)


def _update(
    role: Literal["actor", "critic"],
    section: ActorConfig | CriticConfig,
    layout: ParallelLayout,
    micro_batching: MicroBatching,
    samples_per_prompt: int,
    train_batch_size: int,
) -> UpdatePlan:
    mini = section.ppo_mini_batch_size
    return UpdatePlan(
        role,
        mini * samples_per_prompt,
        section.ppo_epochs,
        micro_batching,
        max(1, train_batch_size // mini),
        distributed_optimizer_on(section.megatron, layout.dp_size * layout.sp_size),
        virtual_pipeline_size(section.megatron),
    )


def resolve(cfg: RLHFConfig, world_size: int) -> RunPlan:
    """The plan of a config that passed `validate_config` for `world_size` ranks."""
    aro, data = cfg.actor_rollout_ref, cfg.data
    budgets = token_budgets(aro, cfg.critic, data)
    batch = (aro.rollout.n, data.train_batch_size)
    layout = section_layout(aro.actor, "actor_rollout_ref.actor", world_size)
    actor = _update("actor", aro.actor, layout, budgets.actor, *batch)
    critic = critic_layout = None
    if uses_critic(cfg.algorithm):
        critic_layout = section_layout(cfg.critic, "critic", world_size)
        critic = _update("critic", cfg.critic, critic_layout, budgets.critic, *batch)
    in_reward, as_loss = kl_in_reward(cfg.algorithm, aro.actor), aro.actor.use_kl_loss
    places: dict[tuple[bool, bool], KLPlacement] = {
        (True, True): "both",
        (True, False): "reward",
        (False, True): "loss",
        (False, False): "none",
    }
    return RunPlan(
        layout,
        actor,
        critic,
        critic_layout,
        uses_reference(cfg.algorithm, cfg.actor_rollout_ref.actor),
        places[(in_reward, as_loss)],
        budgets,
        cfg.actor_rollout_ref.rollout.n,
        prompt_sampler_batch(cfg.data),
        stored_groups_per_step(cfg.data),
    )
