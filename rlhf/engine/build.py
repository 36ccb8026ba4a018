"""Build what a PPO run trains with, once: the Megatron models, their losses and update specs."""

from __future__ import annotations

import dataclasses
import logging

import torch

from rlhf.config.plan import UpdatePlan, resolve
from rlhf.config.schema import (
    ActorConfig,
    ActorRolloutRefConfig,
    CriticConfig,
    MegatronParallelConfig,
    RLHFConfig,
)
from rlhf.config.validate import (
    sequence_parallel_on,
    virtual_pipeline_size,
)
from rlhf.distributed.context import ParallelContext
from rlhf.engine.engine import (
    BaseModel,
    MegatronModel,
    OptimizerSettings,
    PPOEngine,
    TrainableMegatronModel,
    UpdateSpec,
)
from rlhf.engine.heads import LogprobHead, PolicyLoss, ValueLoss
from rlhf.engine.micro_batch import MicroBatchPlanner
from rlhf.engine.route_replay import RolloutRouteReplay, RouteReplay
from rlhf.models.builder import build_chunks, load_hf_weights, value_model_from_hf
from rlhf.models.chunks import ModelChunks
from rlhf.models.families import NO_RECOMPUTE, ModelArch, Recompute
from rlhf.models.gpt import transformer_engine_usable
from rlhf.models.hf_io import HFCheckpointReader
from rlhf.models.logprobs import VocabShard
from rlhf.models.lora import VALUE_HEAD, add_lora, lora_spec
from rlhf.models.mapping import Placement
from rlhf.models.model_dir import read_model_arch
from rlhf.models.moe_arch import MoERouter
from rlhf.models.vision import freeze_vision_tower
from rlhf.utils import torch_dtype

log = logging.getLogger(__name__)
AR = "actor_rollout_ref"


def use_thd(ctx: ParallelContext) -> bool:
    """Packed THD attention needs Transformer Engine (GPU); the local spec takes masks."""
    return ctx.device.type == "cuda" and transformer_engine_usable()


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


def _trained(
    section: ActorConfig | CriticConfig,
    update: UpdatePlan,
    module,
    ctx: ParallelContext,
    total_steps: int,
) -> TrainableMegatronModel:
    """`module` with DDP, its optimizer and LR schedule over a run of `total_steps` steps,
    offloaded between uses as its `megatron.*_offload` say."""
    steps = update.optimizer_steps(total_steps)
    settings = OptimizerSettings(
        section.optim, section.grad_clip, steps, update.distributed_optimizer
    )
    model = TrainableMegatronModel(module, ctx, settings)
    model.offload_between_uses(offload_kinds(section.megatron), update.role)
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


def _critic(
    section: CriticConfig,
    update: UpdatePlan,
    ctx: ParallelContext,
    total_steps: int,
    norm_length: int,
    on_nonfinite: str,
) -> tuple[TrainableMegatronModel, UpdateSpec]:
    """The critic and its update spec (`norm_length`: the loss's token normaliser)."""
    read_model_arch(section.model.path, "critic.model.path")
    module, _ = value_model_from_hf(
        section.model.path,
        Placement.of(ctx),
        vp_size=update.vp_size,
        seed=section.megatron.seed,
        params_dtype=torch_dtype(section.megatron.dtype),
        sp=ctx.sp_size,
        recompute=Recompute.of(section.megatron),
        overrides=section.megatron.override_transformer_config,
        sequence_parallel=ctx.sequence_parallel,
        router=MoERouter.of(section.megatron),
    )
    lora = lora_spec(section.model)
    if lora is not None:  # adapters on the trunk; the new value head trains whole
        add_lora(module, lora, module.config, ctx.tp_rank, section.megatron.seed, VALUE_HEAD)
    critic = _trained(section, update, module.to(ctx.device), ctx, total_steps)
    spec = UpdateSpec(
        "critic",
        critic,
        update.micro_batching,
        update.mini_batch_samples,
        update.epochs,
        ValueLoss(section, norm_length),
        on_nonfinite=on_nonfinite,
    )
    return critic, spec


def _reference(
    aro: ActorRolloutRefConfig, arch: ModelArch, ctx: ParallelContext, router: MoERouter
) -> MegatronModel:
    """The frozen reference, laid out and routed as the actor (R3: on the engine's routes)."""
    rollout_routes = aro.actor.router_replay.mode == "R3"
    module = build_policy(
        arch,
        aro.model.path,
        ctx,
        torch_dtype(aro.actor.megatron.dtype),
        vp_size=virtual_pipeline_size(aro.actor.megatron),
        overrides=aro.actor.megatron.override_transformer_config,
        router=dataclasses.replace(router, replay=rollout_routes),
    )
    ref = MegatronModel.frozen(module, ctx, "ref", offload=aro.ref.param_offload)
    if rollout_routes:
        ref.route_replay = RolloutRouteReplay(ref.module, ctx)
    return ref


def build_engine(
    cfg: RLHFConfig, arch: ModelArch, ctx: ParallelContext, total_steps: int
) -> PPOEngine:
    """Actor, and when the config needs them reference and critic, on this rank, loaded from
    the HF checkpoints, with their update specs for a run of `total_steps` steps."""
    aro, plan = cfg.actor_rollout_ref, resolve(cfg, ctx.world_size)
    wanted = sequence_parallel_on(aro.actor.megatron.sequence_parallel, ctx.tp_size)
    if ctx.sequence_parallel != wanted:
        raise ValueError(
            f"the process groups were set up with sequence_parallel={ctx.sequence_parallel} "
            f"but actor_rollout_ref.actor.megatron.sequence_parallel asks for {wanted} at "
            f"TP {ctx.tp_size}: pass the config's layout to init_parallel"
        )
    policy_dtype = torch_dtype(aro.actor.megatron.dtype)
    vp_size = plan.actor.vp_size
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
    if aro.actor.freeze_vision_tower:
        freeze_vision_tower(actor_module)
    lora = lora_spec(aro.model)
    if lora is not None:  # only the adapters train; the reference is the base model
        add_lora(actor_module, lora, actor_module.config, ctx.tp_rank, aro.actor.megatron.seed)
    actor = _trained(aro.actor, plan.actor, actor_module, ctx, total_steps)
    if mode == "R2":  # the update replays the old-log-prob pass's routes
        actor.route_replay = RouteReplay(actor.module)
    elif mode == "R3":  # every pass replays the engine's routes
        actor.route_replay = RolloutRouteReplay(actor.module, ctx)
    ref: MegatronModel | None = None
    if plan.reference:
        ref = BaseModel(actor) if lora is not None else _reference(aro, arch, ctx, router)
    norm, on_nonfinite = cfg.data.max_response_length, cfg.trainer.on_nonfinite
    critic = critic_update = None
    if plan.critic is not None:
        args = (ctx, total_steps, norm, on_nonfinite)
        critic, critic_update = _critic(cfg.critic, plan.critic, *args)
    vocab = VocabShard.of(ctx, actor_module.padded_vocab_size, arch.vocab_size)
    temperature = aro.rollout.temperature if aro.rollout.temperature > 0 else 1.0
    actor_update = UpdateSpec(
        "actor",
        actor,
        plan.actor.micro_batching,
        plan.actor.mini_batch_samples,
        plan.actor.epochs,
        PolicyLoss(vocab, temperature, aro.actor, norm),
        kl_bound=cfg.trainer.early_stop.ppo_kl_bound,
        on_nonfinite=on_nonfinite,
    )
    padded = not cfg.data.use_sequence_packing
    planner = MicroBatchPlanner(
        ctx, use_thd(ctx), interleaved=vp_size > 1, padded=padded, vision=arch.vision
    )
    return PPOEngine(
        actor,
        ref,
        critic,
        actor_update,
        critic_update,
        planner,
        plan.budgets,
        LogprobHead(vocab, temperature),
        LogprobHead(vocab, 1.0),
    )
