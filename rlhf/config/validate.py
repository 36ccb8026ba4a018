"""Every cross-field rule of a run config, in one place.

`validate_config` applies them all: parallel sizes against the world size, batch-size
divisibility, shared layouts, colocated multi-node placement, server URLs, micro-batching,
the algorithm's settings (combinations that would train nothing or something else; where
the KL goes), `trainer.rollout_mode`, multi-turn tools, stored rollouts, and, when the
model's architecture is given, its attention and KV heads against the TP and Ulysses sizes
and its layers against the PP size and the recompute settings. Single keys (types, allowed
values, ranges) are checked earlier by the loader. Each violation is a `ConfigError` naming
every key involved and the numbers it saw. Each rule takes only the config sections it
reads; `validate_config` and `config_notes` are the entry points that take the whole tree.
The rules that need a model directory, the world, the data or a checkpoint run in
`rlhf.trainer.preflight`."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from rlhf.config.algorithm import (
    AlgorithmConfig,
    FilterGroupsConfig,
    KLControlConfig,
    RolloutCorrectionConfig,
)
from rlhf.config.budgets import setting_or
from rlhf.config.choices import CRITIC_ESTIMATORS, GROUP_ESTIMATORS
from rlhf.config.loader import ConfigError
from rlhf.config.placement import server_gpus, weight_sync_address_problem
from rlhf.config.rollout import AsyncRolloutConfig, MultiTurnConfig, RolloutConfig
from rlhf.config.schema import (
    ActorConfig,
    ActorRolloutRefConfig,
    CriticConfig,
    DataConfig,
    EarlyStopConfig,
    MegatronParallelConfig,
    ModelConfig,
    OverlongBufferConfig,
    ProfilerConfig,
    RefConfig,
    RewardConfig,
    RLHFConfig,
    TrainerConfig,
)

AR = "actor_rollout_ref"


@dataclass(frozen=True)
class ParallelLayout:
    """Sizes of Megatron's process groups for one model: world = tp x sp x pp x dp.

    `sp_size` is Ulysses sequence parallelism, run on Megatron's context-parallel group.
    """

    world_size: int
    tp_size: int = 1
    pp_size: int = 1
    sp_size: int = 1
    sequence_parallel: bool = False  # Megatron's, over the TP group
    vp_size: int = 1  # virtual-pipeline chunks per PP stage (interleaved schedule when > 1)
    ep_size: int = 1  # experts split over EP ranks (mixture-of-experts layers)
    etp_size: int | None = None  # each expert's MLP over expert-TP ranks (None: TP)

    @property
    def dp_size(self) -> int:
        return self.world_size // (self.tp_size * self.pp_size * self.sp_size)

    def describe(self) -> str:
        split = " (sequence parallel)" if self.sequence_parallel else ""
        chunks = f" (VP {self.vp_size})" if self.vp_size > 1 else ""
        experts = (
            f"; experts EP {self.ep_size} x expert-TP {self.etp_size}" if self.ep_size > 1 else ""
        )
        return (
            f"TP {self.tp_size}{split} x PP {self.pp_size}{chunks} x SP {self.sp_size} x "
            f"DP {self.dp_size}{experts}"
        )


class ModelShape(Protocol):
    """What the rules need of a model's architecture (`rlhf.models.families.ModelArch`)."""

    @property
    def num_layers(self) -> int: ...

    @property
    def num_attention_heads(self) -> int: ...

    @property
    def num_query_groups(self) -> int: ...


def checked_world_size(trainer: Any, world_size: int | None) -> int:
    """The run's world size, `trainer.nnodes x trainer.n_gpus_per_node` of a config's trainer
    section, checked against the launched one (`world_size`, when known)."""
    planned = trainer.nnodes * trainer.n_gpus_per_node
    if world_size is not None and world_size != planned:
        raise ConfigError(
            f"trainer.nnodes ({trainer.nnodes}) x trainer.n_gpus_per_node "
            f"({trainer.n_gpus_per_node}) = {planned} does not match the {world_size} "
            "processes launched (WORLD_SIZE)"
        )
    return planned


def check_launch(trainer: Any, world_size: int | None, local_world_size: int | None) -> None:
    """`trainer.nnodes x trainer.n_gpus_per_node` of a config's trainer section against the
    processes launched: `world_size` in all, `local_world_size` on this node (torchrun's
    WORLD_SIZE and LOCAL_WORLD_SIZE; 1 and 1 for a process no launcher started); None: not
    known, not checked. verl's scripts set both keys and launch through Ray, which starts
    what they say; here the launcher does (launch/torchrun.sh reads the keys too)."""
    nnodes, per_node = trainer.nnodes, trainer.n_gpus_per_node
    if world_size is None or local_world_size is None:
        return
    if per_node != local_world_size or nnodes * per_node != world_size:
        raise ConfigError(
            f"trainer.nnodes x trainer.n_gpus_per_node is {nnodes} x {per_node} processes, "
            f"but {world_size} run, {local_world_size} on this node (torchrun's WORLD_SIZE and "
            "LOCAL_WORLD_SIZE; 1 and 1 when no launcher started rlhf-train): launch it with "
            "launch/torchrun.sh, which starts what the keys say, or set them to the launch"
        )


def section_layout(section: Any, prefix: str, world_size: int) -> ParallelLayout:
    """The parallel layout of a trained model's section (its `megatron` and
    `ulysses_sequence_parallel_size` keys, under `prefix`), checked against the world size."""
    tp = section.megatron.tensor_model_parallel_size
    pp = section.megatron.pipeline_model_parallel_size
    sp = section.ulysses_sequence_parallel_size
    if world_size % (tp * pp * sp):
        raise ConfigError(
            f"{prefix}.megatron.tensor_model_parallel_size ({tp}) x "
            f"{prefix}.megatron.pipeline_model_parallel_size ({pp}) x "
            f"{prefix}.ulysses_sequence_parallel_size ({sp}) = {tp * pp * sp} does not divide the "
            f"world size {world_size} (trainer.nnodes x trainer.n_gpus_per_node)"
        )
    split = sequence_parallel_on(section.megatron.sequence_parallel, tp)
    vp = virtual_pipeline_size(section.megatron)
    if vp > 1 and pp == 1:
        raise ConfigError(
            f"{prefix}.megatron.virtual_pipeline_model_parallel_size={vp} needs "
            f"{prefix}.megatron.pipeline_model_parallel_size > 1 (it splits each pipeline "
            "stage into chunks)"
        )
    ep, etp = _expert_sizes(section.megatron, prefix, world_size, pp)
    return ParallelLayout(world_size, tp, pp, sp, split, vp, ep, etp)


def _expert_sizes(
    megatron: MegatronParallelConfig, prefix: str, world_size: int, pp: int
) -> tuple[int, int | None]:
    """EP and expert-TP: Megatron lays the experts out as expert-TP x EP x expert-DP x PP
    over the same ranks, so expert-TP x EP x PP must divide the world size."""
    ep = megatron.expert_model_parallel_size
    etp = megatron.expert_tensor_parallel_size
    experts = (etp or megatron.tensor_model_parallel_size) * ep * pp
    if world_size % experts:
        raise ConfigError(
            f"{prefix}.megatron.expert_tensor_parallel_size ({etp or 'null: TP'}) x "
            f"{prefix}.megatron.expert_model_parallel_size ({ep}) x "
            f"{prefix}.megatron.pipeline_model_parallel_size ({pp}) = {experts} does not divide "
            f"the world size {world_size} (trainer.nnodes x trainer.n_gpus_per_node)"
        )
    return ep, etp


def virtual_pipeline_size(megatron: MegatronParallelConfig) -> int:
    """Chunks per pipeline stage (`megatron.virtual_pipeline_model_parallel_size`; 1: none)."""
    return megatron.virtual_pipeline_model_parallel_size or 1


def sequence_parallel_on(setting: bool | None, tp_size: int) -> bool:
    """`megatron.sequence_parallel` at TP `tp_size`; null: on when TP > 1 (it needs TP > 1)."""
    return tp_size > 1 and setting is not False


def _check_batches(
    prefix: str,
    section: ActorConfig | CriticConfig,
    data: DataConfig,
    n: int,
    layout: ParallelLayout,
) -> None:
    """A step's samples (`data.train_batch_size` x `rollout.n`) split into whole mini-batches
    of `section` (at `prefix`), and each into whole micro-batches of every DP rank."""
    step_samples = data.train_batch_size * n
    mini_samples = section.ppo_mini_batch_size * n
    if step_samples % mini_samples:
        raise ConfigError(
            f"data.train_batch_size ({data.train_batch_size}) x {AR}.rollout.n ({n}) = "
            f"{step_samples} samples is not divisible by {prefix}.ppo_mini_batch_size "
            f"({section.ppo_mini_batch_size}) x {AR}.rollout.n = {mini_samples} samples"
        )
    micro = section.ppo_micro_batch_size_per_gpu
    if mini_samples % (layout.dp_size * micro):
        raise ConfigError(
            f"{prefix}.ppo_mini_batch_size ({section.ppo_mini_batch_size}) x {AR}.rollout.n ({n}) "
            f"= {mini_samples} samples is not divisible by data-parallel size {layout.dp_size} x "
            f"{prefix}.ppo_micro_batch_size_per_gpu ({micro}); data-parallel size = world size "
            f"{layout.world_size} / ({prefix}.megatron.tensor_model_parallel_size x "
            f"{prefix}.megatron.pipeline_model_parallel_size x "
            f"{prefix}.ulysses_sequence_parallel_size)"
        )


def _check_ref_layout(ref: RefConfig, actor: ParallelLayout) -> None:
    ref_sp = ref.ulysses_sequence_parallel_size
    if ref_sp is not None and ref_sp != actor.sp_size:
        raise ConfigError(
            f"{AR}.ref.ulysses_sequence_parallel_size={ref_sp} differs from "
            f"{AR}.actor.ulysses_sequence_parallel_size={actor.sp_size}: the "
            "reference shares the actor's parallel layout (leave it null)"
        )


def _check_critic_layout(actor: ParallelLayout, critic: ParallelLayout) -> None:
    if critic != actor:
        raise ConfigError(
            f"critic.megatron / critic.ulysses_sequence_parallel_size give {critic}, "
            f"the actor's give {actor}: actor, critic and reference share one Megatron "
            "parallel layout; set the critic's sizes like the actor's"
        )


def _check_rollout_placement(rollout: RolloutConfig, trainer: TrainerConfig) -> None:
    """Server URLs look like URLs that servers on other hosts can sync weights from; servers
    launched on GPUs get disjoint GPUs of their node (`rlhf.config.placement`). Servers
    launched on several nodes take any layout: where a node does not hold whole replicas
    (PP across nodes, say), every rank takes part in its node's sync
    (`rlhf.weight_sync.gather.whole_replicas_per_node`)."""
    bad = [u for u in rollout.server_urls or [] if not u.startswith(("http://", "https://"))]
    if bad:
        raise ConfigError(f"{AR}.rollout.server_urls: {bad} are not URLs like http://host:port")
    if problem := weight_sync_address_problem(
        rollout.server_urls, rollout.weight_sync_transport, rollout.weight_sync_master_address
    ):
        raise ConfigError(problem)
    if not rollout.server_urls and trainer.device != "cpu":
        server_gpus(
            rollout.num_servers, rollout.tensor_model_parallel_size, trainer.n_gpus_per_node
        )


def check_recompute(m: MegatronParallelConfig, key: str, shape: ModelShape | None) -> None:
    """Recompute keys (of `m`, at dotted `key`) that Megatron would ignore or reject are
    refused with their names."""
    if m.recompute_granularity != "full":
        given = [k for k in ("recompute_method", "recompute_num_layers") if getattr(m, k)]
        if given:
            raise ConfigError(
                f"{key}.{' and '.join(given)} set with {key}.recompute_granularity="
                f"{m.recompute_granularity}: they choose the layers of full recompute only "
                "(selective recompute always recomputes the core attention of every layer)"
            )
    if shape is None or m.recompute_num_layers is None:
        return
    chunks = m.pipeline_model_parallel_size * virtual_pipeline_size(m)
    per_chunk = shape.num_layers // chunks
    if m.recompute_num_layers > per_chunk:
        raise ConfigError(
            f"{key}.recompute_num_layers={m.recompute_num_layers} exceeds the {per_chunk} "
            f"layers of a pipeline stage's chunk ({shape.num_layers} layers / "
            f"pipeline_model_parallel_size x virtual_pipeline_model_parallel_size {chunks})"
        )


def model_split_problem(shape: ModelShape, tp: int, pp: int, vp: int = 1) -> tuple[str, str] | None:
    """("tp", "pp" or "vp", what does not divide) when Megatron cannot split `shape` over TP
    ranks (query heads, KV heads), PP stages and their VP chunks (layers); None when it can.
    Also used by `rlhf.models.families.check_parallel_sizes` (the CLIs that take --tp/--pp)."""
    for key, count in (
        ("num_attention_heads", shape.num_attention_heads),
        ("num_key_value_heads", shape.num_query_groups),
    ):
        if count % tp:
            return "tp", f"{key} ({count}) must be divisible by the tensor parallel size ({tp})"
    if shape.num_layers % pp:
        return "pp", (
            f"num_hidden_layers ({shape.num_layers}) must be divisible by the pipeline "
            f"parallel size ({pp})"
        )
    if vp > 1 and (pp == 1 or shape.num_layers % (pp * vp)):
        return "vp", (
            f"num_hidden_layers ({shape.num_layers}) must be divisible by the pipeline "
            f"parallel size ({pp}) x the virtual pipeline size ({vp}), with PP > 1"
        )
    return None


def check_model_split(
    layout: ParallelLayout, shape: ModelShape, prefix: str = f"{AR}.actor"
) -> None:
    """A model that does not divide is refused here, before any server starts, rather than
    by Megatron after."""
    problem = model_split_problem(shape, layout.tp_size, layout.pp_size, layout.vp_size)
    if problem is not None:
        which, what = problem
        key = {
            "tp": f"tensor_model_parallel_size={layout.tp_size}",
            "pp": f"pipeline_model_parallel_size={layout.pp_size}",
            "vp": f"virtual_pipeline_model_parallel_size={layout.vp_size}",
        }[which]
        raise ConfigError(f"{prefix}.megatron.{key}: the model's {what}")


def check_heads(layout: ParallelLayout, heads: ModelShape, prefix: str = f"{AR}.actor") -> None:
    """Ulysses splits each TP rank's query heads over the SP ranks (not multi-latent
    attention's, whose keys and values are wider apart than its wrapper takes)."""
    if layout.sp_size > 1 and getattr(heads, "mla", None) is not None:
        raise ConfigError(
            f"{prefix}.ulysses_sequence_parallel_size={layout.sp_size}: Ulysses sequence "
            "parallelism is not supported for multi-latent attention (deepseek_v3); split "
            "long rows with megatron.tensor_model_parallel_size and sequence_parallel instead"
        )
    if layout.sp_size > 1 and getattr(heads, "vision", None) is not None:
        raise ConfigError(
            f"{prefix}.ulysses_sequence_parallel_size={layout.sp_size}: Ulysses sequence "
            "parallelism is not supported for a vision-language model (its images enter the "
            "whole row before it is split); use megatron.tensor_model_parallel_size and "
            "sequence_parallel instead"
        )
    per_tp_rank = heads.num_attention_heads // layout.tp_size
    if layout.sp_size > 1 and per_tp_rank % layout.sp_size:
        raise ConfigError(
            f"{prefix}.ulysses_sequence_parallel_size={layout.sp_size} with "
            f"{prefix}.megatron.tensor_model_parallel_size={layout.tp_size} and "
            f"{heads.num_attention_heads} attention heads: {per_tp_rank} query heads per TP "
            f"rank cannot be split over {layout.sp_size} Ulysses ranks (query heads per TP rank "
            "must be a multiple of the SP size)"
        )


def distributed_optimizer_on(megatron: MegatronParallelConfig, optimizer_group: int) -> bool:
    """`megatron.use_distributed_optimizer`; null: on when the optimizer's data-parallel group
    (DP x Ulysses SP, the ranks Megatron shards the optimizer state over) has several ranks."""
    if megatron.use_distributed_optimizer is None:
        return optimizer_group > 1
    return megatron.use_distributed_optimizer


def uses_critic(algorithm: AlgorithmConfig) -> bool:
    """Whether the run builds, trains and checkpoints a critic (only GAE needs values)."""
    return algorithm.adv_estimator in CRITIC_ESTIMATORS


def trained_megatron(
    aro: ActorRolloutRefConfig, critic: CriticConfig, algorithm: AlgorithmConfig
) -> dict[str, MegatronParallelConfig]:
    """The Megatron settings of each model the run trains and checkpoints, by role."""
    trained = {"actor": aro.actor.megatron}
    if uses_critic(algorithm):
        trained["critic"] = critic.megatron
    return trained


def _changed(value: Any, default: Any, prefix: str) -> list[str]:
    """Dotted keys under `prefix` where `value` (a config section) differs from `default`."""
    if not dataclasses.is_dataclass(value):
        return [] if value == default else [prefix]
    return [
        key
        for f in dataclasses.fields(value)
        for key in _changed(getattr(value, f.name), getattr(default, f.name), f"{prefix}.{f.name}")
    ]


def config_notes(cfg: RLHFConfig) -> list[str]:
    """One line per group of keys set away from their defaults that this run does not use,
    and per legal setting worth a word (`algorithm_notes`)."""
    notes = []
    critic_default = CriticConfig(model=ModelConfig(path=cfg.actor_rollout_ref.model.path))
    if not uses_critic(cfg.algorithm) and (keys := _changed(cfg.critic, critic_default, "critic")):
        estimator = cfg.algorithm.adv_estimator
        notes.append(f"{', '.join(keys)} ignored: adv_estimator={estimator} trains no critic")
    kl_ctrl = _changed(cfg.algorithm.kl_ctrl, KLControlConfig(), "algorithm.kl_ctrl")
    if not kl_in_reward(cfg.algorithm, cfg.actor_rollout_ref.actor) and kl_ctrl:
        notes.append(f"{', '.join(kl_ctrl)} ignored: algorithm.use_kl_in_reward=false")
    ref_keys = _changed(cfg.actor_rollout_ref.ref, RefConfig(), f"{AR}.ref")
    if not uses_reference(cfg.algorithm, cfg.actor_rollout_ref.actor) and ref_keys:
        notes.append(f"{', '.join(ref_keys)} ignored: no reference model (no KL in reward or loss)")
    multi_turn = cfg.actor_rollout_ref.rollout.multi_turn
    tool_keys = _changed(multi_turn, MultiTurnConfig(), MULTI_TURN)
    if not multi_turn.enable and tool_keys:
        notes.append(f"{', '.join(tool_keys)} ignored: {MULTI_TURN}.enable=false")
    return notes + algorithm_notes(cfg.algorithm, cfg.actor_rollout_ref.actor)


def _check_reward(reward: RewardConfig, correction: RolloutCorrectionConfig) -> None:
    if reward.url and reward.model_path:
        raise ConfigError(
            f"reward.url ({reward.url}) and reward.model_path ({reward.model_path}) both score "
            "the reward_model.style=model rows: set one of them"
        )
    if reward.model_scores_every_row and not (reward.url or reward.model_path):
        raise ConfigError(
            "reward.model_scores_every_row=true needs a reward model: set reward.model_path "
            "(an HF *ForSequenceClassification directory) or reward.url"
        )
    if reward.model_scores_every_row and reward.custom_fn:
        raise ConfigError(
            f"reward.custom_fn={reward.custom_fn} would score no row: "
            "reward.model_scores_every_row=true has the reward model score every row; set one"
        )
    if reward.url and not reward.url.startswith(("http://", "https://")):
        raise ConfigError(f"reward.url: {reward.url!r} is not a URL like http://host:port/path")
    if correction.bypass_mode and correction.rollout_is is not None:
        raise ConfigError(
            "algorithm.rollout_correction.bypass_mode takes the engine's log-probs as the old "
            f"ones, so rollout_is={correction.rollout_is} would weight by 1: set one of them"
        )


def _check_engine_kwargs(rollout: RolloutConfig) -> None:
    if rollout.engine_kwargs.sglang:
        from rlhf.config.engine_args import server_argv

        server_argv(rollout.engine_kwargs.sglang)


def _check_profiler(profiler: ProfilerConfig) -> None:
    for i, step in enumerate(profiler.steps or []):
        if step < 1:
            raise ConfigError(f"global_profiler.steps[{i}]: steps count from 1, got {step}")


def _check_policy_path(model: ModelConfig) -> None:
    if not model.path:
        raise ConfigError(f"{AR}.model.path: required (an HF model directory)")


def _check_critic_lora(model: ModelConfig) -> None:
    if model.lora_merge:
        raise ConfigError(
            "critic.model.lora_merge=true: the critic's weights go to no server, so there is "
            "nothing to merge them for; drop the key"
        )


def _check_early_stop(early_stop: EarlyStopConfig, reference: bool) -> None:
    """The KL patience watches the KL to the reference: it needs one (`reference`)."""
    if early_stop.kl_patience and not reference:
        raise ConfigError(
            f"trainer.early_stop.kl_patience={early_stop.kl_patience} watches the KL "
            f"to the reference, which this run does not compute: set "
            f"algorithm.use_kl_in_reward=true or {AR}.actor.use_kl_loss=true, or kl_patience=0"
        )


_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def _check_model_paths(paths: dict[str, str | None]) -> None:
    """A model path (by its dotted key) that is no local directory but reads as a Hugging
    Face Hub id (verl downloads those) is refused here, before anything starts, with the way
    to get it."""
    for key, path in paths.items():
        if path and _HUB_ID.fullmatch(path) and not Path(path).exists():
            raise ConfigError(
                f"{key}={path} is a Hugging Face Hub id, not a local directory: this system "
                f"reads models from disk; download it first (hf download {path} --local-dir "
                f"DIR) and set {key}=DIR"
            )


def validate_config(
    cfg: RLHFConfig,
    world_size: int | None = None,
    shape: ModelShape | None = None,
    local_world_size: int | None = None,
) -> ParallelLayout:
    """Check every cross-field rule; return the parallel layout all three models share.

    `world_size` is the number of launched processes when known (torchrun); otherwise the
    planned `trainer.nnodes x trainer.n_gpus_per_node` is used. `shape` (the policy's
    architecture) enables the rules on attention heads and layers. `local_world_size`, the
    processes launched on this node, checks `trainer.n_gpus_per_node` (`check_launch`).
    """
    aro, algorithm, data, trainer = cfg.actor_rollout_ref, cfg.algorithm, cfg.data, cfg.trainer
    n = aro.rollout.n
    check_algorithm(algorithm, n, trainer.critic_warmup)
    check_gspo(aro.actor)
    check_dapo(cfg.reward.overlong_buffer, algorithm.filter_groups, data.max_response_length, n)
    critic_on = uses_critic(cfg.algorithm)
    paths: dict[str, str | None] = {f"{AR}.model.path": aro.model.path}
    if critic_on:
        paths["critic.model.path"] = cfg.critic.model.path
    paths["reward.model_path"] = cfg.reward.model_path
    _check_model_paths(paths)
    check_launch(trainer, world_size, local_world_size)
    world = checked_world_size(trainer, world_size)
    actor = section_layout(aro.actor, f"{AR}.actor", world)
    _check_batches(f"{AR}.actor", aro.actor, data, n, actor)
    check_recompute(aro.actor.megatron, f"{AR}.actor.megatron", shape)
    _check_ref_layout(aro.ref, actor)
    if critic_on:
        critic = section_layout(cfg.critic, "critic", world)
        _check_batches("critic", cfg.critic, data, n, critic)
        check_recompute(cfg.critic.megatron, "critic.megatron", shape)
        _check_critic_layout(actor, critic)
    _check_rollout_placement(aro.rollout, trainer)
    if shape is not None:
        check_model_split(actor, shape)
        check_heads(actor, shape)
    _check_profiler(cfg.global_profiler)
    _check_policy_path(aro.model)
    _check_critic_lora(cfg.critic.model)
    _check_reward(cfg.reward, algorithm.rollout_correction)
    _check_engine_kwargs(aro.rollout)
    check_multi_turn(aro.rollout.multi_turn, data, aro.actor)
    check_rollout_mode(trainer, aro, algorithm.rollout_correction)
    check_stored_rollouts(data, trainer, algorithm, aro.actor)
    check_micro_batching(aro, cfg.critic)
    _check_early_stop(
        trainer.early_stop, uses_reference(cfg.algorithm, cfg.actor_rollout_ref.actor)
    )
    return actor


def kl_in_reward_on(use_kl_in_reward: bool | None, use_kl_loss: bool) -> bool:
    """`algorithm.use_kl_in_reward`; null: on unless the actor has a KL loss
    (`actor.use_kl_loss`)."""
    if use_kl_in_reward is None:
        return not use_kl_loss
    return use_kl_in_reward


def reference_on(use_kl_in_reward: bool | None, use_kl_loss: bool) -> bool:
    """Whether the run builds the frozen reference: for a KL in the reward or as a loss."""
    return kl_in_reward_on(use_kl_in_reward, use_kl_loss) or use_kl_loss


def kl_in_reward(algorithm: AlgorithmConfig, actor: ActorConfig) -> bool:
    """`kl_in_reward_on` of the algorithm and actor sections."""
    return kl_in_reward_on(algorithm.use_kl_in_reward, actor.use_kl_loss)


def uses_reference(algorithm: AlgorithmConfig, actor: ActorConfig) -> bool:
    """`reference_on` of the algorithm and actor sections."""
    return reference_on(algorithm.use_kl_in_reward, actor.use_kl_loss)


def require_off_policy_correction(
    correction: RolloutCorrectionConfig, setting: str, samples: str
) -> None:
    """`setting` trains on `samples` (of another policy than the one trained): refused
    without truncated importance sampling or bypass mode (`algorithm.rollout_correction`)."""
    if correction.rollout_is is None and not correction.bypass_mode:
        raise ConfigError(
            f"{setting} trains on {samples}: set algorithm.rollout_correction.rollout_is="
            "token (truncated importance sampling against their log-probs) or "
            "algorithm.rollout_correction.bypass_mode=true"
        )


def check_algorithm(algorithm: AlgorithmConfig, n: int, critic_warmup: int) -> None:
    """Refuse an estimator that would train nothing: a group estimator with `rollout.n` < 2,
    `trainer.critic_warmup` without a critic."""
    estimator = algorithm.adv_estimator
    if estimator in GROUP_ESTIMATORS and n < 2:
        raise ConfigError(
            f"algorithm.adv_estimator={estimator} compares the {AR}.rollout.n samples of each "
            f"prompt; with rollout.n={n} every advantage is 0 and nothing trains: set "
            "rollout.n >= 2 (GRPO runs use 4-16), or adv_estimator=reinforce_plus_plus for one "
            "sample per prompt"
        )
    if critic_warmup and estimator not in CRITIC_ESTIMATORS:
        raise ConfigError(
            f"trainer.critic_warmup={critic_warmup} trains only the critic for its "
            f"first steps, and adv_estimator={estimator} has no critic: nothing would train; "
            "set trainer.critic_warmup=0 (or adv_estimator=gae)"
        )


def check_gspo(actor: ActorConfig) -> None:
    """GSPO's sequence-level loss and clip ranges, not the token-level defaults."""
    if actor.policy_loss.loss_mode != "gspo":
        return
    if actor.loss_agg_mode != "seq-mean-token-mean":
        raise ConfigError(
            f"{AR}.actor.policy_loss.loss_mode=gspo is defined with the sequence mean of the "
            f"loss: set {AR}.actor.loss_agg_mode=seq-mean-token-mean (is {actor.loss_agg_mode})"
        )
    if actor.clip_ratio_low is None or actor.clip_ratio_high is None:
        raise ConfigError(
            f"{AR}.actor.policy_loss.loss_mode=gspo clips the sequence-level ratio, which stays "
            f"within ~1e-3 of 1, so clip_ratio={actor.clip_ratio} would never clip: set "
            f"{AR}.actor.clip_ratio_low and clip_ratio_high (the paper's: 3e-4 and 4e-4)"
        )


def check_dapo(
    overlong: OverlongBufferConfig,
    filter_groups: FilterGroupsConfig,
    max_response_length: int,
    n: int,
) -> None:
    """DAPO's overlong buffer within `data.max_response_length`; dynamic sampling
    (`algorithm.filter_groups`) on groups of several samples."""
    if overlong.enable and overlong.len >= max_response_length:
        raise ConfigError(
            f"reward.overlong_buffer.len ({overlong.len}) must be below "
            f"data.max_response_length ({max_response_length})"
        )
    if filter_groups.enable and n < 2:
        raise ConfigError(
            f"algorithm.filter_groups.enable needs {AR}.rollout.n >= 2 (is {n}): a group of "
            "one sample always scores the same and would always be dropped"
        )


def algorithm_notes(algorithm: AlgorithmConfig, actor: ActorConfig) -> list[str]:
    """Legal settings worth a line at startup."""
    if algorithm.use_kl_in_reward and actor.use_kl_loss:
        return [
            "the KL to the reference counts twice: in the reward (algorithm.use_kl_in_reward="
            f"true, kl_ctrl) and as a loss ({AR}.actor.use_kl_loss=true, kl_loss_coef); verl's "
            "GRPO uses only the loss: leave use_kl_in_reward unset (or false) for that"
        ]
    return []


def check_rollout_mode(
    trainer: TrainerConfig, aro: ActorRolloutRefConfig, correction: RolloutCorrectionConfig
) -> None:
    """Refuse a rollout mode that cannot run as configured (nothing to check for sync)."""
    mode = trainer.rollout_mode
    if mode != "async" and trainer.async_rollout != AsyncRolloutConfig():
        raise ConfigError(
            f"trainer.async_rollout is set but trainer.rollout_mode={mode}: it applies to "
            "rollout_mode=async only (one_step_off is one step ahead with no pause)"
        )
    if mode == "sync":
        return
    if not aro.rollout.server_urls:
        raise ConfigError(
            f"trainer.rollout_mode={mode} overlaps generation with training, which needs "
            f"disaggregated servers ({AR}.rollout.server_urls, see launch/sglang_servers.sh); "
            "servers the job launches share the trainer's devices"
        )
    require_off_policy_correction(
        correction, f"trainer.rollout_mode={mode}", "samples of older policy versions"
    )
    if mode != "async":
        return
    if aro.rollout.multi_turn.enable:
        raise ConfigError(
            f"trainer.rollout_mode=async with {AR}.rollout.multi_turn.enable=true: a "
            "conversation cut by a weight update is not continued yet; use one_step_off"
        )
    if aro.actor.router_replay.mode == "R3":
        raise ConfigError(
            f"trainer.rollout_mode=async with {AR}.actor.router_replay.mode=R3: the routes "
            "of a sample cut by a weight update come from two requests; use one_step_off, "
            "or router_replay.mode=R2"
        )


MULTI_TURN = f"{AR}.rollout.multi_turn"


def check_tool_config_path(multi_turn: MultiTurnConfig) -> None:
    """Multi-turn on names the file of its tools."""
    if multi_turn.enable and not multi_turn.tool_config_path:
        raise ConfigError(
            f"{MULTI_TURN}.enable=true needs {MULTI_TURN}.tool_config_path: a YAML file "
            "listing the tools (tools: [{class_name, config, tool_schema}], rlhf/tools/base.py)"
        )


def check_multi_turn(multi_turn: MultiTurnConfig, data: DataConfig, actor: ActorConfig) -> None:
    """Refuse a multi-turn setting that cannot run (nothing to check when it is off)."""
    if not multi_turn.enable:
        return
    check_tool_config_path(multi_turn)
    if not data.apply_chat_template:
        raise ConfigError(
            f"{MULTI_TURN}.enable=true needs data.apply_chat_template=true: the chat template "
            "lists the tools in the prompt and renders their results as tool messages"
        )
    if actor.router_replay.mode == "R3":
        raise ConfigError(
            f"{MULTI_TURN}.enable=true with {AR}.actor.router_replay.mode=R3: the engine "
            "returns the experts it routed in one /generate request and a conversation is "
            "several (one per assistant turn); set router_replay.mode=R2 or disabled"
        )


def stored_groups_per_step(data: DataConfig) -> int:
    """Prompt groups per step taken from `data.rollout_files` (0 without them)."""
    if not data.rollout_files:
        return 0
    return round(data.stored_fraction * data.train_batch_size)


def prompt_sampler_batch(data: DataConfig) -> int:
    """Prompts the prompt sampler draws per step: those not taken from stored rollouts
    (all of them when every group is stored: that sampler then never draws)."""
    return data.train_batch_size - stored_groups_per_step(data) or data.train_batch_size


def check_stored_rollouts(
    data: DataConfig, trainer: TrainerConfig, algorithm: AlgorithmConfig, actor: ActorConfig
) -> None:
    """Refuse a stored-rollout setting that cannot run (nothing to check without files)."""
    if not data.rollout_files:
        if data.stored_fraction != 1.0:
            raise ConfigError(
                f"data.stored_fraction={data.stored_fraction} without data.rollout_files: "
                "it is the share of each batch taken from stored rollouts"
            )
        return
    groups = data.stored_fraction * data.train_batch_size
    if abs(groups - round(groups)) > 1e-9 or round(groups) < 1:
        raise ConfigError(
            f"data.stored_fraction={data.stored_fraction} x data.train_batch_size="
            f"{data.train_batch_size} = {groups:g} stored prompt groups per step: it must be "
            "a whole number >= 1"
        )
    require_off_policy_correction(
        algorithm.rollout_correction, "data.rollout_files", "samples of another policy"
    )
    refused = {
        "trainer.rollout_mode": trainer.rollout_mode != "sync",
        "algorithm.filter_groups.enable": algorithm.filter_groups.enable,
        "actor_rollout_ref.actor.router_replay.mode=R3": actor.router_replay.mode == "R3",
    }
    for key, on in refused.items():
        if on:
            raise ConfigError(
                f"data.rollout_files with {key}: stored samples are trained as they are, by "
                "the synchronous strategy (no generation rounds ahead or extra, no routes)"
            )


def check_micro_batching(aro: ActorRolloutRefConfig, critic: CriticConfig) -> None:
    """A token budget set for a pass that cuts fixed micro-batches would be ignored: refused."""
    passes = [
        (f"{AR}.actor", aro.actor, "use_dynamic_bsz", "ppo_max_token_len_per_gpu"),
        ("critic", critic, "use_dynamic_bsz", "ppo_max_token_len_per_gpu"),
        (f"{AR}.ref", aro.ref, "log_prob_use_dynamic_bsz", "log_prob_max_token_len_per_gpu"),
        (
            f"{AR}.rollout",
            aro.rollout,
            "log_prob_use_dynamic_bsz",
            "log_prob_max_token_len_per_gpu",
        ),
    ]
    for prefix, section, switch, budget_key in passes:
        budget = getattr(section, budget_key)
        if (
            not setting_or(getattr(section, switch), aro.actor.use_dynamic_bsz)
            and budget is not None
        ):
            raise ConfigError(
                f"{prefix}.{budget_key}={budget} is a token budget, which the fixed "
                f"micro-batches of {prefix}.{switch}=false do not use: drop it, or set "
                f"{switch}=true"
            )
