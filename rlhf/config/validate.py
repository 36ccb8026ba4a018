"""Cross-field rules: parallel sizes against the world size, batch-size divisibility.

Each violation is a `ConfigError` naming every key involved and the numbers it saw.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlhf.config.loader import ConfigError
from rlhf.config.schema import RLHFConfig

AR = "actor_rollout_ref"


@dataclass(frozen=True)
class ParallelDims:
    """Sizes of Megatron's process groups for one model: world = tp x cp x pp x dp."""

    world_size: int
    tp: int = 1
    pp: int = 1
    cp: int = 1

    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.pp * self.cp)


def _world_size(cfg: RLHFConfig, world_size: int | None) -> int:
    planned = cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node
    if world_size is not None and world_size != planned:
        raise ConfigError(
            f"trainer.nnodes ({cfg.trainer.nnodes}) x trainer.n_gpus_per_node "
            f"({cfg.trainer.n_gpus_per_node}) = {planned} does not match the {world_size} "
            "processes launched (WORLD_SIZE)"
        )
    return planned


def _role_section(role: str, cfg: RLHFConfig):
    """The trained model's config section ('actor' or 'critic') and its dotted prefix."""
    if role == "actor":
        return cfg.actor_rollout_ref.actor, f"{AR}.actor"
    return cfg.critic, "critic"


def parallel_dims(role: str, cfg: RLHFConfig, world_size: int) -> ParallelDims:
    """The parallel layout of `role` ('actor' or 'critic'), checked against the world size."""
    section, prefix = _role_section(role, cfg)
    tp = section.megatron.tensor_model_parallel_size
    pp = section.megatron.pipeline_model_parallel_size
    cp = section.ulysses_sequence_parallel_size
    if world_size % (tp * pp * cp):
        raise ConfigError(
            f"{prefix}.megatron.tensor_model_parallel_size ({tp}) x "
            f"{prefix}.megatron.pipeline_model_parallel_size ({pp}) x "
            f"{prefix}.ulysses_sequence_parallel_size ({cp}) = {tp * pp * cp} does not divide the "
            f"world size {world_size} (trainer.nnodes x trainer.n_gpus_per_node)"
        )
    return ParallelDims(world_size=world_size, tp=tp, pp=pp, cp=cp)


def _check_batches(role: str, cfg: RLHFConfig, dims: ParallelDims) -> None:
    section, prefix = _role_section(role, cfg)
    n = cfg.actor_rollout_ref.rollout.n
    step_samples = cfg.data.train_batch_size * n
    mini_samples = section.ppo_mini_batch_size * n
    if step_samples % mini_samples:
        raise ConfigError(
            f"data.train_batch_size ({cfg.data.train_batch_size}) x {AR}.rollout.n ({n}) = "
            f"{step_samples} samples is not divisible by {prefix}.ppo_mini_batch_size "
            f"({section.ppo_mini_batch_size}) x {AR}.rollout.n = {mini_samples} samples"
        )
    micro = section.ppo_micro_batch_size_per_gpu
    if mini_samples % (dims.dp * micro):
        raise ConfigError(
            f"{prefix}.ppo_mini_batch_size ({section.ppo_mini_batch_size}) x {AR}.rollout.n ({n}) "
            f"= {mini_samples} samples is not divisible by data-parallel size {dims.dp} x "
            f"{prefix}.ppo_micro_batch_size_per_gpu ({micro}); data-parallel size = world size "
            f"{dims.world_size} / ({prefix}.megatron.tensor_model_parallel_size x "
            f"{prefix}.megatron.pipeline_model_parallel_size x "
            f"{prefix}.ulysses_sequence_parallel_size)"
        )


def validate_config(cfg: RLHFConfig, world_size: int | None = None) -> dict[str, ParallelDims]:
    """Check every cross-field rule; return the actor's and critic's parallel layouts.

    `world_size` is the number of launched processes when known (torchrun); otherwise the
    planned `trainer.nnodes x trainer.n_gpus_per_node` is used.
    """
    world = _world_size(cfg, world_size)
    dims = {role: parallel_dims(role, cfg, world) for role in ("actor", "critic")}
    for role, role_dims in dims.items():
        _check_batches(role, cfg, role_dims)
    ref_sp = cfg.actor_rollout_ref.ref.ulysses_sequence_parallel_size
    if ref_sp is not None and ref_sp != dims["actor"].cp:
        raise ConfigError(
            f"actor_rollout_ref.ref.ulysses_sequence_parallel_size={ref_sp} differs from "
            f"actor_rollout_ref.actor.ulysses_sequence_parallel_size={dims['actor'].cp}: the "
            "reference shares the actor's parallel layout (leave it null)"
        )
    if dims["critic"] != dims["actor"]:
        raise ConfigError(
            f"critic.megatron / critic.ulysses_sequence_parallel_size give {dims['critic']}, "
            f"the actor's give {dims['actor']}: actor, critic and reference share one Megatron "
            "parallel layout; set the critic's sizes like the actor's"
        )
    for i, step in enumerate(cfg.global_profiler.steps or []):
        if step < 1:
            raise ConfigError(f"global_profiler.steps[{i}]: steps count from 1, got {step}")
    if not cfg.actor_rollout_ref.model.path:
        raise ConfigError(f"{AR}.model.path: required (an HF model directory)")
    return dims
