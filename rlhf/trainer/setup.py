"""Build what a PPO run trains with, once: the Megatron models, their losses and update specs."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch

from rlhf.config.budgets import MicroBatching, TokenBudgets, token_budgets
from rlhf.config.loader import ConfigError
from rlhf.config.schema import MegatronParallelConfig, RLHFConfig
from rlhf.config.validate import (
    distributed_optimizer_on,
    sequence_parallel_on,
    uses_critic,
    uses_reference,
    virtual_pipeline_size,
)
from rlhf.distributed.context import ParallelContext
from rlhf.models.builder import build_chunks, load_hf_weights, value_model_from_hf
from rlhf.models.chunks import ModelChunks
from rlhf.models.families import NO_RECOMPUTE, ModelArch, Recompute, check_transformer_overrides
from rlhf.models.gpt import transformer_engine_usable
from rlhf.models.hf_io import HFCheckpointReader
from rlhf.models.logprobs import VocabShard
from rlhf.models.mapping import Placement
from rlhf.models.model_dir import check_model_dir, check_servable_policy, read_model_arch
from rlhf.models.moe_arch import MoERouter, expert_split_problem
from rlhf.trainer.heads import LogprobHead, Loss, PolicyLoss, ValueLoss
from rlhf.trainer.megatron_model import MegatronModel, OptimizerSettings, TrainableMegatronModel
from rlhf.trainer.micro_batch import MicroBatchPlanner
from rlhf.trainer.reward_model import RewardModelScorer
from rlhf.trainer.route_replay import RolloutRouteReplay, RouteReplay
from rlhf.utils import DTYPES

log = logging.getLogger(__name__)
AR = "actor_rollout_ref"


@dataclass(frozen=True)
class UpdateSpec:
    """How one trained model is updated every step.

    role: 'actor' or 'critic' (the prefix of its grad_norm and lr metrics); token_budget:
    tokens per micro-batch; mini_batch_samples: samples per optimizer step; loss: what each
    mini-batch minimises (`PolicyLoss`, `ValueLoss`); kl_bound: end the step's epochs once
    a mini-batch's actor/ppo_kl exceeds it (None: never); on_nonfinite:
    `trainer.on_nonfinite` for a mini-batch whose gradients are not finite.
    """

    role: str
    model: TrainableMegatronModel
    token_budget: int | MicroBatching
    mini_batch_samples: int
    epochs: int
    loss: Loss
    kl_bound: float | None = None
    on_nonfinite: str = "stop"  # trainer.on_nonfinite (rlhf.trainer.nonfinite)


@dataclass(frozen=True)
class PPOModels:
    """This rank's shards of the models, and how the trained ones are updated.

    ref is None without a KL to the reference (in the reward or as a loss); critic and
    critic_update are None for critic-free estimators (`rlhf.config.validate`).
    logprob_head: the actor's and reference's log-probs at the rollout temperature;
    probe_head: the same at temperature 1 (SGLang's prompt log-probs are unscaled).
    reward_model: scores the reward_model.style=model rows (`reward.model_path`; None
    without one).
    """

    actor: TrainableMegatronModel
    ref: MegatronModel | None
    critic: TrainableMegatronModel | None
    actor_update: UpdateSpec
    critic_update: UpdateSpec | None
    planner: MicroBatchPlanner
    budgets: TokenBudgets
    logprob_head: LogprobHead
    probe_head: LogprobHead
    reward_model: RewardModelScorer | None


def model_dirs(cfg: RLHFConfig) -> dict[str, str]:
    """Config key -> HF directory of every model the run loads."""
    dirs = {"actor_rollout_ref.model.path": cfg.actor_rollout_ref.model.path}
    if uses_critic(cfg):
        dirs["critic.model.path"] = cfg.critic.model.path
    if cfg.reward.model_path:
        dirs["reward.model_path"] = cfg.reward.model_path
    return dirs


def load_policy_arch(cfg: RLHFConfig) -> ModelArch:
    """The policy's architecture (`actor_rollout_ref.model.path`), once every model directory
    of the run has passed `check_model_dir`: this runs before any server starts, so a model
    the trainer cannot load fails in one line instead of after SGLang has loaded it."""
    arches = {key: check_model_dir(path, key) for key, path in model_dirs(cfg).items()}
    check_experts(arches["actor_rollout_ref.model.path"], cfg.actor_rollout_ref.actor.megatron, AR)
    if uses_critic(cfg):
        check_experts(arches["critic.model.path"], cfg.critic.megatron, "critic")
    policy = "actor_rollout_ref.model.path"
    check_router_replay(cfg, arches[policy])
    check_servable_policy(arches[policy], cfg.actor_rollout_ref.model.path, policy)
    return arches[policy]


def check_experts(arch: ModelArch, megatron: MegatronParallelConfig, prefix: str) -> None:
    """The `megatron.expert_*` sizes split this model's experts, and the `megatron.moe_*`
    router settings are left alone for a model without experts."""
    tp = megatron.tensor_model_parallel_size
    ep, etp = megatron.expert_model_parallel_size, megatron.expert_tensor_parallel_size
    keys = f"{prefix}.megatron.expert_model_parallel_size={ep} / expert_tensor_parallel_size"
    problem = expert_split_problem(arch.moe, arch.family, tp, ep, etp or tp)
    if problem is not None:
        raise ConfigError(f"{keys}={etp}: {problem}")
    if arch.moe is None and MoERouter.of(megatron) != MoERouter():
        raise ConfigError(
            f"{prefix}.megatron.moe_*: router settings for {arch.family}, a model without "
            "experts; leave them at their defaults"
        )


def check_router_replay(cfg: RLHFConfig, arch: ModelArch) -> None:
    """`actor.router_replay.mode`: R2 and R3 need experts and no activation recompute
    (`rlhf.trainer.route_replay`); R2 the old-log-prob pass it records from. R3 works with
    `bypass_mode` (the engine's log-probs, computed on the routes the updates replay)."""
    actor = cfg.actor_rollout_ref.actor
    mode = actor.router_replay.mode
    key = f"{AR}.actor.router_replay.mode={mode}"
    if mode == "disabled":
        return
    if arch.moe is None:
        raise ConfigError(f"{key}: {arch.family} has no experts to route")
    if mode == "R2" and cfg.algorithm.rollout_correction.bypass_mode:
        raise ConfigError(
            f"{key}: algorithm.rollout_correction.bypass_mode skips the old-log-prob pass "
            "whose routes R2 replays"
        )
    if actor.megatron.recompute_granularity is not None:
        raise ConfigError(
            f"{key} with {AR}.actor.megatron.recompute_granularity="
            f"{actor.megatron.recompute_granularity}: Megatron's recompute routes again in "
            "the backward; not yet"
        )


def optimizer_steps(cfg: RLHFConfig, total_steps: int, mini_batch_size: int, epochs: int) -> int:
    """Optimizer steps of the whole run for one model (the LR schedule's horizon)."""
    return total_steps * epochs * max(1, cfg.data.train_batch_size // mini_batch_size)


def use_thd(ctx: ParallelContext) -> bool:
    """Packed THD attention needs Transformer Engine (GPU); the local spec takes masks."""
    return ctx.device.type == "cuda" and transformer_engine_usable()


def check_megatron_overrides(cfg: RLHFConfig) -> None:
    """Every `megatron.override_transformer_config` field of the trained models is one of
    Megatron's TransformerConfig that the model and this system's keys leave free (before any
    server starts)."""
    roles = {"actor_rollout_ref.actor": cfg.actor_rollout_ref.actor.megatron}
    if uses_critic(cfg):
        roles["critic"] = cfg.critic.megatron
    for prefix, megatron in roles.items():
        key = f"{prefix}.megatron.override_transformer_config"
        try:
            check_transformer_overrides(megatron.override_transformer_config, key)
        except ValueError as e:
            raise ConfigError(str(e)) from None


def build_policy(
    arch: ModelArch,
    model_path: str,
    ctx: ParallelContext,
    dtype: torch.dtype,
    recompute: Recompute = NO_RECOMPUTE,
    vp_size: int = 1,
    overrides: dict | None = None,
    router: MoERouter | None = None,
) -> ModelChunks:
    """This rank's chunks of the policy, loaded from the HF checkpoint; `overrides`: further
    TransformerConfig fields (`megatron.override_transformer_config`); `router`: the MoE
    router's training settings. Megatron's random initialisation is skipped: every
    parameter is loaded (a 7B shard took minutes of random numbers, one thread a rank)."""
    placement = Placement.of(ctx)
    chunks = build_chunks(
        arch,
        placement,
        vp_size=vp_size,
        params_dtype=dtype,
        sp=ctx.sp_size,
        initialize=False,
        recompute=recompute,
        sequence_parallel=ctx.sequence_parallel,
        overrides=overrides,
        router=router,
    )
    load_hf_weights(chunks, HFCheckpointReader(model_path), arch, placement)
    return chunks.to(ctx.device)


def _trained(cfg: RLHFConfig, role: str, module, ctx: ParallelContext, total_steps: int):
    section = cfg.actor_rollout_ref.actor if role == "actor" else cfg.critic
    steps = optimizer_steps(cfg, total_steps, section.ppo_mini_batch_size, section.ppo_epochs)
    distributed = distributed_optimizer_on(section.megatron, ctx.dp_sp_size)
    settings = OptimizerSettings(section.optim, section.grad_clip, steps, distributed)
    model = TrainableMegatronModel(module, ctx, settings)
    model.offload_between_uses(offload_kinds(section.megatron), role)
    return model


def offload_kinds(megatron: MegatronParallelConfig) -> tuple[str, ...]:
    """What a model keeps off the device between its phases (`megatron.*_offload`). On the
    CPU the same moves run (host to host), so that a GPU run's residency is tested there."""
    switches = {
        "params": megatron.param_offload,
        "grads": megatron.grad_offload,
        "optimizer": megatron.optimizer_offload,
    }
    return tuple(kind for kind, on in switches.items() if on)


def _critic(cfg: RLHFConfig, ctx: ParallelContext, total_steps: int, budget: MicroBatching):
    """The critic and its update spec, or (None, None) for critic-free estimators."""
    if not uses_critic(cfg):
        return None, None
    read_model_arch(cfg.critic.model.path, "critic.model.path")
    module, _ = value_model_from_hf(
        cfg.critic.model.path,
        Placement.of(ctx),
        vp_size=virtual_pipeline_size(cfg.critic.megatron),
        seed=cfg.critic.megatron.seed,
        params_dtype=DTYPES[cfg.critic.megatron.dtype],
        sp=ctx.sp_size,
        recompute=Recompute.of(cfg.critic.megatron),
        overrides=cfg.critic.megatron.override_transformer_config,
        sequence_parallel=ctx.sequence_parallel,
        router=MoERouter.of(cfg.critic.megatron),
    )
    critic = _trained(cfg, "critic", module.to(ctx.device), ctx, total_steps)
    n, norm = cfg.actor_rollout_ref.rollout.n, cfg.data.max_response_length
    update = UpdateSpec(
        "critic",
        critic,
        budget,
        cfg.critic.ppo_mini_batch_size * n,
        cfg.critic.ppo_epochs,
        ValueLoss(cfg.critic, norm),
        on_nonfinite=cfg.trainer.on_nonfinite,
    )
    return critic, update


def _reference(
    cfg: RLHFConfig, arch: ModelArch, ctx: ParallelContext, router: MoERouter
) -> MegatronModel:
    """The frozen reference, laid out and routed as the actor (R3: on the engine's routes)."""
    aro = cfg.actor_rollout_ref
    rollout_routes = aro.actor.router_replay.mode == "R3"
    module = build_policy(
        arch,
        aro.model.path,
        ctx,
        DTYPES[aro.actor.megatron.dtype],
        vp_size=virtual_pipeline_size(aro.actor.megatron),
        overrides=aro.actor.megatron.override_transformer_config,
        router=dataclasses.replace(router, replay=rollout_routes),
    )
    ref = MegatronModel.frozen(module, ctx, "ref", offload=aro.ref.param_offload)
    if rollout_routes:
        ref.route_replay = RolloutRouteReplay(ref.module, ctx)
    return ref


def build_ppo_models(
    cfg: RLHFConfig, arch: ModelArch, ctx: ParallelContext, total_steps: int
) -> PPOModels:
    """Actor, and when the config needs them reference and critic, on this rank, loaded from
    the HF checkpoints, with their update specs for a run of `total_steps` steps."""
    aro = cfg.actor_rollout_ref
    wanted = sequence_parallel_on(aro.actor.megatron.sequence_parallel, ctx.tp_size)
    if ctx.sequence_parallel != wanted:
        raise ValueError(
            f"the process groups were set up with sequence_parallel={ctx.sequence_parallel} "
            f"but actor_rollout_ref.actor.megatron.sequence_parallel asks for {wanted} at "
            f"TP {ctx.tp_size}: pass the config's layout to init_parallel"
        )
    policy_dtype = DTYPES[aro.actor.megatron.dtype]
    vp_size = virtual_pipeline_size(aro.actor.megatron)
    overrides = aro.actor.megatron.override_transformer_config
    router = MoERouter.of(aro.actor.megatron)  # the reference's too (same token dropping)
    mode = aro.actor.router_replay.mode
    replays = mode in ("R2", "R3")
    actor_module = build_policy(
        arch,
        aro.model.path,
        ctx,
        policy_dtype,
        Recompute.of(aro.actor.megatron),
        vp_size,
        overrides,
        dataclasses.replace(router, replay=replays),
    )
    actor = _trained(cfg, "actor", actor_module, ctx, total_steps)
    if mode == "R2":  # the update replays the old-log-prob pass's routes
        actor.route_replay = RouteReplay(actor.module)
    elif mode == "R3":  # every pass replays the engine's routes
        actor.route_replay = RolloutRouteReplay(actor.module, ctx)
    ref = _reference(cfg, arch, ctx, router) if uses_reference(cfg) else None
    budgets = token_budgets(cfg)
    critic, critic_update = _critic(cfg, ctx, total_steps, budgets.critic)
    vocab = VocabShard.of(ctx, actor_module.padded_vocab_size, arch.vocab_size)
    temperature = aro.rollout.temperature if aro.rollout.temperature > 0 else 1.0
    n, norm = aro.rollout.n, cfg.data.max_response_length
    actor_update = UpdateSpec(
        "actor",
        actor,
        budgets.actor,
        aro.actor.ppo_mini_batch_size * n,
        aro.actor.ppo_epochs,
        PolicyLoss(vocab, temperature, aro.actor, norm),
        kl_bound=cfg.trainer.early_stop.ppo_kl_bound,
        on_nonfinite=cfg.trainer.on_nonfinite,
    )
    padded = not cfg.data.use_sequence_packing
    planner = MicroBatchPlanner(ctx, use_thd(ctx), interleaved=vp_size > 1, padded=padded)
    reward_model = RewardModelScorer.from_config(cfg, ctx, planner, budgets.ref)
    return PPOModels(
        actor,
        ref,
        critic,
        actor_update,
        critic_update,
        planner,
        budgets,
        LogprobHead(vocab, temperature),
        LogprobHead(vocab, 1.0),
        reward_model,
    )
