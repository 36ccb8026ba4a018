"""Every cross-field rule of a run config, in one place.

`validate_config` applies them all: parallel sizes against the world size, batch-size
divisibility, shared layouts, colocated multi-node placement, server URLs, the multi-turn
tool settings (`rlhf.config.multi_turn_rules`), and, when the model's architecture is
given, its attention and KV heads against the TP and Ulysses sizes and its layers against
the PP size and the recompute settings. Single keys (types, allowed values, ranges) are
checked earlier by the loader. Each violation is a `ConfigError` naming every key involved
and the numbers it saw. Each rule takes only the config sections it reads; `validate_config`
and `config_notes` are the entry points that take the whole tree.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from rlhf.config.algorithm import AlgorithmConfig, KLControlConfig, RolloutCorrectionConfig
from rlhf.config.algorithm_rules import (
    algorithm_notes,
    check_algorithm,
    check_dapo,
    check_gspo,
    kl_in_reward,
    uses_reference,
)
from rlhf.config.async_rules import check_rollout_mode
from rlhf.config.budgets import check_micro_batching
from rlhf.config.choices import CRITIC_ESTIMATORS
from rlhf.config.loader import ConfigError
from rlhf.config.multi_turn_rules import MULTI_TURN, check_multi_turn
from rlhf.config.placement import server_gpus, weight_sync_address_problem
from rlhf.config.rollout import MultiTurnConfig, RolloutConfig
from rlhf.config.schema import (
    ActorConfig,
    ActorRolloutRefConfig,
    CriticConfig,
    DataConfig,
    EarlyStopConfig,
    MegatronParallelConfig,
    ModelConfig,
    ProfilerConfig,
    RefConfig,
    RewardConfig,
    RLHFConfig,
    TrainerConfig,
)
from rlhf.config.stored_rules import check_stored_rollouts

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
    """Ulysses splits each TP rank's query heads over the SP ranks."""
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
