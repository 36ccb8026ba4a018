"""Build what a PPO run holds: the three Megatron models, data, and (rank 0) the SGLang engine."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from rlhf.config import ConfigError
from rlhf.config.schema import RLHFConfig
from rlhf.distributed.bootstrap import DistEnv, ParallelGroups, current_placement
from rlhf.models.builder import build_model, load_hf_weights, value_model_from_hf
from rlhf.models.families import ModelArch, load_arch
from rlhf.models.gpt import transformer_engine_usable
from rlhf.models.hf_io import HFCheckpointReader
from rlhf.parallel.ulysses import kv_repeats
from rlhf.trainer.heads import VocabShard
from rlhf.trainer.megatron_model import MegatronModel, OptimizerSettings, TrainableMegatronModel
from rlhf.trainer.micro_batch import default_token_budget
from rlhf.utils import DTYPES

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TokenBudgets:
    """Tokens per packed micro-batch for each model's passes."""

    actor: int
    critic: int
    ref: int


def token_budgets(cfg: RLHFConfig) -> TokenBudgets:
    longest = (cfg.data.max_prompt_length, cfg.data.max_response_length)
    actor, critic, ref = cfg.actor_rollout_ref.actor, cfg.critic, cfg.actor_rollout_ref.ref
    return TokenBudgets(
        actor=actor.ppo_max_token_len_per_gpu
        or default_token_budget(actor.ppo_micro_batch_size_per_gpu, *longest),
        critic=critic.ppo_max_token_len_per_gpu
        or default_token_budget(critic.ppo_micro_batch_size_per_gpu, *longest),
        ref=ref.log_prob_max_token_len_per_gpu
        or default_token_budget(ref.log_prob_micro_batch_size_per_gpu, *longest),
    )


def check_model_dir(path: str, key: str) -> None:
    if not Path(path, "config.json").is_file():
        raise FileNotFoundError(
            f"{key}={path}: no config.json there (an HF model directory is expected; "
            "'make quickstart' builds a tiny one)"
        )


def optimizer_steps(cfg: RLHFConfig, total_steps: int, mini_batch_size: int, epochs: int) -> int:
    """Optimizer steps of the whole run for one model (the LR schedule's horizon)."""
    return total_steps * epochs * max(1, cfg.data.train_batch_size // mini_batch_size)


def build_policy(
    arch: ModelArch,
    model_path: str,
    device: torch.device,
    cp: int = 1,
    dtype: torch.dtype = torch.float32,
):
    placement = current_placement()
    model = build_model(arch, placement, params_dtype=dtype, cp=cp)
    load_hf_weights(model, HFCheckpointReader(model_path), arch, placement)
    return model.to(device)


def build_models(
    cfg: RLHFConfig, arch: ModelArch, groups: ParallelGroups, env: DistEnv, total: int
):
    """(actor, reference, critic) on this rank, all loaded from the HF checkpoints."""
    aro = cfg.actor_rollout_ref
    check_model_dir(aro.model.path, "actor_rollout_ref.model.path")
    check_model_dir(cfg.critic.model.path, "critic.model.path")
    actor_settings = OptimizerSettings(
        aro.actor.optim,
        aro.actor.grad_clip,
        optimizer_steps(cfg, total, aro.actor.ppo_mini_batch_size, aro.actor.ppo_epochs),
    )
    critic_settings = OptimizerSettings(
        cfg.critic.optim,
        cfg.critic.grad_clip,
        optimizer_steps(cfg, total, cfg.critic.ppo_mini_batch_size, cfg.critic.ppo_epochs),
    )
    policy_dtype = DTYPES[aro.actor.megatron.dtype]
    actor = TrainableMegatronModel(
        build_policy(arch, aro.model.path, env.device, groups.cp_size, policy_dtype),
        groups,
        actor_settings,
    )
    ref = MegatronModel.frozen(
        build_policy(arch, aro.model.path, env.device, groups.cp_size, policy_dtype),
        groups,
        offload=aro.actor.param_offload,
    )
    critic_module, _ = value_model_from_hf(
        cfg.critic.model.path,
        current_placement(),
        seed=cfg.critic.megatron.seed,
        params_dtype=DTYPES[cfg.critic.megatron.dtype],
        cp=groups.cp_size,
    )
    critic = TrainableMegatronModel(critic_module.to(env.device), groups, critic_settings)
    return actor, ref, critic


def vocab_shard(arch: ModelArch, actor_module, groups: ParallelGroups, temperature: float):
    local = actor_module.padded_vocab_size // groups.tp_size
    return VocabShard(
        start=groups.tp_rank * local,
        vocab_size=arch.vocab_size,
        group=groups.tp_group,
        temperature=temperature if temperature > 0 else 1.0,
    )


def use_thd(env: DistEnv) -> bool:
    """Packed THD attention needs Transformer Engine (GPU); the local spec takes masks."""
    return env.device.type == "cuda" and transformer_engine_usable()


def load_arch_of(cfg: RLHFConfig) -> ModelArch:
    """The policy's architecture, checked against the Ulysses and TP sizes."""
    check_model_dir(cfg.actor_rollout_ref.model.path, "actor_rollout_ref.model.path")
    arch = load_arch(cfg.actor_rollout_ref.model.path)
    actor = cfg.actor_rollout_ref.actor
    sp, tp = actor.ulysses_sequence_parallel_size, actor.megatron.tensor_model_parallel_size
    if sp > 1:
        try:
            kv_repeats(arch.num_attention_heads // tp, max(1, arch.num_query_groups // tp), sp)
        except ValueError as e:
            raise ConfigError(
                f"actor_rollout_ref.actor.ulysses_sequence_parallel_size={sp} with "
                f"actor_rollout_ref.actor.megatron.tensor_model_parallel_size={tp} and "
                f"{arch.num_attention_heads} attention heads: {e}"
            ) from None
    return arch
