"""Everything a run checks before it starts a server or builds a model, in one place.

`preflight(cfg, world_size, local_world_size)` runs before the process groups exist: every
model directory (family, safetensors shapes, tokenizer size, the experts' split, routing
replay, Megatron overrides), the config's rules for this world and model
(`rlhf.config.validate_config`), the resolved plan (`rlhf.config.plan`), the tokenizer, the
tools, the prompt files (rows scorable, style=model rows with a scorer), a probe of the
reward function, the stored rollouts and the memory plan. Only the rules that need a model,
the world, the data or a checkpoint live here; the config's own rules live in
`rlhf.config`. The checkpoint directory (writable, room for the checkpoints) and a resume
(below) are checked by the trainer as soon as the process groups exist, still before any
server starts.

A resume compares the run's config with the one its checkpoint was written under. Each
checkpoint holds its run's resolved config (`config.yaml`). A change is one of:

- layout or operations (parallel sizes, micro-batch budgets, offload, recompute, the servers
  and the weight sync, logging, checkpoint cadence, run length, timeouts): checkpoints
  reshard, so the run goes on and the changes are said in one line;
- what is trained (model, data, reward, losses, optimizer, sampling, algorithm): continuing
  would silently mix two experiments, so the resume is refused naming every such key with
  both values, unless `trainer.resume_accept_changes` lists the key or its section;
- a change no acceptance makes work: the prompt order cannot continue over another number
  of prompts or another batch size, and a critic the checkpoint does not hold cannot resume.

The run's `config.yaml` is written only after that check.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml

from rlhf.checkpoint.manager import COMPLETE_MARKER
from rlhf.checkpoint.state import TRAINER_STATE_FILE
from rlhf.config import validate_config
from rlhf.config.loader import ConfigError, all_keys, dump_yaml
from rlhf.config.plan import RunPlan, resolve
from rlhf.config.reward_training import RewardModelRunConfig, validate_reward_training
from rlhf.config.schema import (
    ActorConfig,
    DataConfig,
    MegatronParallelConfig,
    ModelConfig,
    RewardConfig,
    RLHFConfig,
)
from rlhf.config.validate import (
    ParallelLayout,
    distributed_optimizer_on,
    prompt_sampler_batch,
    trained_megatron,
    uses_critic,
)
from rlhf.data.images import ImageProcessor
from rlhf.data.prompts import PromptDataset, load_tokenizer, prompt_dataset_from_config
from rlhf.data.rollout_files import StoredSample
from rlhf.memory.planner import PlanInputs
from rlhf.memory.report import startup_report, verdict
from rlhf.models.families import ModelArch, check_transformer_overrides
from rlhf.models.lora import megatron_targets
from rlhf.models.model_dir import check_model_dir, check_servable_policy, check_tokenizer_fits
from rlhf.models.moe_arch import MoERouter, expert_split_problem
from rlhf.reward import ground_truth_checker
from rlhf.reward.scorer import probe_reward_function
from rlhf.rollout.multi_turn_config import load_configured_tools, tool_schemas
from rlhf.trainer.rollouts import load_stored_groups

log = logging.getLogger(__name__)

CHECKPOINT_CONFIG = "config.yaml"
AR = "actor_rollout_ref"
MODEL_KEY = f"{AR}.model.path"
_MISSING = object()

# Keys that change how a run is laid out or operated, not what it trains.
_FREE_SECTIONS = ("trainer.", "global_profiler.", f"{AR}.rollout.val_kwargs.")
_FREE_LEAVES = {
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "virtual_pipeline_model_parallel_size",
    "sequence_parallel",
    "use_distributed_optimizer",
    "recompute_granularity",
    "recompute_method",
    "recompute_num_layers",
    "param_offload",
    "grad_offload",
    "optimizer_offload",
    "ulysses_sequence_parallel_size",
    "ppo_micro_batch_size_per_gpu",
    "ppo_max_token_len_per_gpu",
    "log_prob_micro_batch_size_per_gpu",
    "log_prob_max_token_len_per_gpu",
    "use_dynamic_bsz",
    "log_prob_use_dynamic_bsz",
}
_FREE_ROLLOUT = {  # and its tensor_model_parallel_size, a layout leaf
    "gpu_memory_utilization",
    "free_cache_engine",
    "server_startup_timeout_s",
    "num_servers",
    "server_urls",
    "use_router",
    "max_concurrent_requests",
    "request_timeout_s",
    "request_retries",
    "retry_backoff_s",
    "max_server_restarts",
    "weight_sync_transport",
    "update_weights_bucket_megabytes",
    "weight_sync_snapshot",
    "weight_sync_master_address",
    "logprob_diff_threshold",
    "engine_kwargs.sglang",
}
_FREE_KEYS = {
    "data.val_files",
    "data.use_sequence_packing",
    "reward.request_timeout_s",
    "reward.request_retries",
    "reward.num_workers",
    "reward.timeout_s",
    *(f"{AR}.rollout.{leaf}" for leaf in _FREE_ROLLOUT),
}


def is_free(key: str) -> bool:
    """Whether changing `key` between a checkpoint and its resume keeps one experiment."""
    if key in _FREE_KEYS or key.startswith(_FREE_SECTIONS):
        return True
    return key.rpartition(".")[2] in _FREE_LEAVES


def _lookup(tree: Any, key: str) -> Any:
    for part in key.split("."):
        if not isinstance(tree, dict) or part not in tree:
            return _MISSING
        tree = tree[part]
    return tree


def changed_keys(old: dict, new: dict) -> dict[str, tuple[Any, Any]]:
    """Every schema key whose value differs, as (old, new); keys one side lacks (added or
    removed by a later version) are not compared."""
    changes = {}
    for key in all_keys():
        before, after = _lookup(old, key), _lookup(new, key)
        if before is not _MISSING and after is not _MISSING and before != after:
            changes[key] = (before, after)
    return changes


def _within(key: str, entry: str) -> bool:
    """Whether `key` is the config key `entry` or lies in the section `entry`."""
    return key == entry or key.startswith(entry + ".")


def _accepted(key: str, accepted: list[str]) -> bool:
    return any(_within(key, entry) for entry in accepted)


def _check_accept_list(accepted: list[str]) -> None:
    keys = all_keys()
    for entry in accepted:
        if not any(_within(key, entry) for key in keys):
            raise ConfigError(
                f"trainer.resume_accept_changes: '{entry}' is neither a config key nor a section"
            )


def _shown(changes: dict[str, tuple[Any, Any]]) -> str:
    return ", ".join(f"{k} ({old!r} -> {new!r})" for k, (old, new) in changes.items())


def check_resume(
    cfg: RLHFConfig, checkpoint: Path, num_prompts: int, world_size: int, optimizer_group: int
) -> None:
    """Refuse (ConfigError, one line) a resume from `checkpoint` that would mix runs or cannot
    load; say the layout and operations that changed. `num_prompts`: this run's training
    prompts; `optimizer_group`: the ranks its optimizer state is sharded over (DP x SP)."""
    accepted = cfg.trainer.resume_accept_changes
    _check_accept_list(accepted)
    critic = cfg.algorithm.adv_estimator if uses_critic(cfg.algorithm) else None
    _check_structure(checkpoint, critic, num_prompts, prompt_sampler_batch(cfg.data))
    _check_world_size(checkpoint, world_size)
    _check_optimizer_format(
        trained_megatron(cfg.actor_rollout_ref, cfg.critic, cfg.algorithm),
        checkpoint,
        optimizer_group,
    )
    path = checkpoint / CHECKPOINT_CONFIG
    if not path.is_file():
        log.warning("%s has no %s (an older checkpoint): settings not compared", checkpoint, path)
        return
    old = yaml.safe_load(path.read_text()) or {}
    changes = changed_keys(old, yaml.safe_load(dump_yaml(cfg)))
    mixing = {k: v for k, v in changes.items() if not is_free(k) and not _accepted(k, accepted)}
    if mixing:
        raise ConfigError(
            f"resume from {checkpoint}: {len(mixing)} setting(s) differ from the checkpoint's "
            f"and would mix two runs: {_shown(mixing)}; start fresh (trainer.resume_mode="
            "disable, or another trainer.default_local_dir) or accept them with "
            f"trainer.resume_accept_changes=[{','.join(mixing)}]"
        )
    if changes:
        log.info("resuming from %s with changed settings: %s", checkpoint, _shown(changes))


def _check_structure(
    checkpoint: Path, critic: str | None, num_prompts: int, prompts_per_step: int
) -> None:
    """The changes no acceptance makes work (`critic`: the estimator that trains one, None
    without a critic)."""
    fresh = "start fresh (trainer.resume_mode=disable, or another trainer.default_local_dir)"
    if critic is not None and not (checkpoint / "critic").is_dir():
        raise ConfigError(
            f"resume from {checkpoint}: algorithm.adv_estimator={critic} "
            f"trains a critic and the checkpoint holds none (it was written without one): {fresh}"
        )
    state_file = checkpoint / TRAINER_STATE_FILE
    if not state_file.is_file():
        return  # the checkpoint's own check reports it
    sampler = json.loads(state_file.read_text()).get("sampler", {})
    for key, mine, name in (
        ("num_prompts", num_prompts, "training prompts (data.train_files)"),
        (
            "batch_size",
            prompts_per_step,
            "prompts per step (data.train_batch_size, less data.rollout_files' groups)",
        ),
    ):
        if key in sampler and sampler[key] != mine:
            raise ConfigError(
                f"resume from {checkpoint}: the checkpoint's prompt order is over {sampler[key]} "
                f"{name} and this run has {mine}; the order cannot continue: {fresh}"
            )


def _check_optimizer_format(
    trained: dict[str, MegatronParallelConfig], checkpoint: Path, optimizer_group: int
) -> None:
    """The distributed optimizer's state (sharded files) and the plain one's (inside the
    model checkpoint) do not load into each other: a 1-rank checkpoint resumed on several
    data-parallel ranks, where the distributed optimizer is on by default, is one case."""
    for role, megatron in trained.items():
        saved = (checkpoint / role / "optimizer").is_dir()
        if not (checkpoint / role).is_dir() or saved == distributed_optimizer_on(
            megatron, optimizer_group
        ):
            continue
        section = f"{AR}.actor" if role == "actor" else "critic"
        raise ConfigError(
            f"resume from {checkpoint}: the {role}'s optimizer state was saved "
            f"{'with' if saved else 'without'} the distributed optimizer and this run "
            f"({optimizer_group} data-parallel rank(s)) would {'not ' if saved else ''}use it: "
            f"set {section}.megatron.use_distributed_optimizer={str(saved).lower()}, as the "
            "saving run had it"
        )


def _check_world_size(checkpoint: Path, world_size: int) -> None:
    """Every rank restores its own RNG streams (exact resume), so a checkpoint resumes on as
    many processes as wrote it; its models and optimizer reshard (rlhf-convert for a new
    run at another size)."""
    marker = checkpoint / COMPLETE_MARKER
    saved = json.loads(marker.read_text()).get("world_size") if marker.is_file() else None
    if saved is not None and saved != world_size:
        raise ConfigError(
            f"resume from {checkpoint}: written by {saved} process(es), and this run has "
            f"{world_size}; each rank restores its own random streams, so a run resumes on as "
            f"many processes as wrote it (start it with {saved}, or start fresh from the "
            "checkpoint's weights: rlhf-convert mcore-to-hf, then model.path)"
        )


# ---- models and data -------------------------------------------------------------


def load_policy_arch(cfg: RLHFConfig) -> ModelArch:
    """The policy's architecture (`actor_rollout_ref.model.path`), once every model directory
    of the run has passed `check_model_dir`: this runs before any server starts, so a model
    the trainer cannot load fails in one line instead of after SGLang has loaded it."""
    aro = cfg.actor_rollout_ref
    dirs = {MODEL_KEY: aro.model.path}  # config key -> HF directory of each model loaded
    if uses_critic(cfg.algorithm):
        dirs["critic.model.path"] = cfg.critic.model.path
    if cfg.reward.model_path:
        dirs["reward.model_path"] = cfg.reward.model_path
    arches = {key: check_model_dir(path, key) for key, path in dirs.items()}
    for key, arch in arches.items():
        if arch.vision is not None and key != MODEL_KEY:
            raise ConfigError(
                f"{key}={dirs[key]}: {arch.family} is a vision-language model; only the "
                "policy may be one (a critic or reward model that reads images is not built: "
                "use algorithm.adv_estimator=grpo, or a text critic/reward model)"
            )
    vision_family = arches[MODEL_KEY].family if arches[MODEL_KEY].vision else None
    if aro.actor.freeze_vision_tower and not vision_family:
        raise ConfigError(
            f"{AR}.actor.freeze_vision_tower=true: {arches[MODEL_KEY].family} is a text model "
            "(it has no vision tower)"
        )
    if vision_family and aro.rollout.multi_turn.enable:
        raise ConfigError(
            f"{AR}.rollout.multi_turn.enable=true: multi-turn rollouts of a vision-language "
            f"policy ({vision_family}) are not supported; set it to false"
        )
    if vision_family and cfg.trainer.rollout_mode == "async":
        raise ConfigError(
            f"trainer.rollout_mode=async: asynchronous rollouts of a vision-language policy "
            f"({vision_family}) are not supported; use trainer.rollout_mode=sync"
        )
    check_lora(aro.model, arches[MODEL_KEY], aro.actor.megatron)
    check_experts(arches[MODEL_KEY], aro.actor.megatron, f"{AR}.actor")
    if uses_critic(cfg.algorithm):
        check_lora(cfg.critic.model, arches["critic.model.path"], cfg.critic.megatron, "critic")
        check_experts(arches["critic.model.path"], cfg.critic.megatron, "critic")
    bypass = cfg.algorithm.rollout_correction.bypass_mode
    check_router_replay(aro.actor, bypass, arches[MODEL_KEY])
    check_servable_policy(arches[MODEL_KEY], aro.model.path, MODEL_KEY)
    return arches[MODEL_KEY]


def check_lora(
    model: ModelConfig, arch: ModelArch, megatron: MegatronParallelConfig, role: str = AR
) -> None:
    """LoRA's keys (`role`.model) name layers this model has, on a model LoRA is built for;
    adapted routed experts run one GEMM each and reach the servers merged."""
    if not model.lora_rank:
        return
    try:
        targets = megatron_targets(model.target_modules)
    except ValueError as e:
        raise ConfigError(f"{role}.model.{e}") from e
    experts = arch.moe is not None and bool(set(targets) & {"linear_fc1", "linear_fc2"})
    grouped = megatron.override_transformer_config.get("moe_grouped_gemm")
    if experts and grouped:
        section = f"{AR}.actor" if role == AR else role  # where the role's megatron is
        raise ConfigError(
            f"{role}.model.target_modules={model.target_modules} adapts the experts of "
            f"{arch.family}, which Transformer Engine's grouped GEMM holds as one module: "
            f"set {section}.megatron.override_transformer_config.moe_grouped_gemm=false "
            "(one GEMM per expert) or adapt the attention alone"
        )
    if experts and role == AR and not model.lora_merge:
        raise ConfigError(
            f"{AR}.model.target_modules={model.target_modules} adapts the experts of "
            f"{arch.family}, whose adapters SGLang serves only with its Triton kernels: set "
            f"{AR}.model.lora_merge=true (the merged weights are synced) or adapt the "
            "attention alone: target_modules=[q_proj,k_proj,v_proj,o_proj]"
        )
    unsupported = (
        "multi-latent attention" if arch.mla is not None else None,
        "a vision-language model" if arch.vision is not None else None,
    )
    found = next((u for u in unsupported if u), None)
    if found:
        raise ConfigError(
            f"{role}.model.lora_rank={model.lora_rank}: LoRA on {found} "
            f"({arch.family}) is not built yet; decoders with plain attention (llama, qwen2, "
            "qwen3, and the attention of qwen2_moe / qwen3_moe / glm4_moe) take it"
        )


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


def check_router_replay(actor: ActorConfig, bypass_mode: bool, arch: ModelArch) -> None:
    """`actor.router_replay.mode`: R2 and R3 need experts and no activation recompute
    (`rlhf.engine.route_replay`); R2 the old-log-prob pass it records from. R3 works with
    `bypass_mode` (the engine's log-probs, computed on the routes the updates replay)."""
    mode = actor.router_replay.mode
    key = f"{AR}.actor.router_replay.mode={mode}"
    if mode == "disabled":
        return
    if arch.moe is None:
        raise ConfigError(f"{key}: {arch.family} has no experts to route")
    if mode == "R2" and bypass_mode:
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


def check_megatron_overrides(trained: dict[str, MegatronParallelConfig]) -> None:
    """Every `megatron.override_transformer_config` field of the trained models (by role,
    `rlhf.config.validate.trained_megatron`) is one of Megatron's TransformerConfig that the
    model and this system's keys leave free (before any server starts)."""
    for role, megatron in trained.items():
        prefix = f"{AR}.actor" if role == "actor" else role
        key = f"{prefix}.megatron.override_transformer_config"
        try:
            check_transformer_overrides(megatron.override_transformer_config, key)
        except ValueError as e:
            raise ConfigError(str(e)) from None


def check_model_rows_have_a_scorer(reward: RewardConfig, datasets: dict[str, Any]) -> None:
    """Fail at startup, not mid-run, when data has style=model rows and nothing scores them.

    `datasets`: config key -> PromptDataset (e.g. {"data.train_files": train})."""
    if reward.model_path or reward.url:
        return
    for key, data in datasets.items():
        rows = [i for i, p in enumerate(data.prompts) if p.row.style == "model"]
        if rows:
            raise ConfigError(
                f"{key}: {len(rows)} prompts have reward_model.style=model (the first is prompt "
                f"{rows[0]}) but neither reward.model_path nor reward.url is set to score them"
            )


# ---- the preflight ------------------------------------------------------------------


@dataclass(frozen=True)
class Preflight:
    """What a run checked before it started, and goes on with: the policy's architecture,
    the parallel layout and plan, the tokenizer, the tools of multi-turn rollouts ({}
    without), the prompt files and the stored rollouts' groups (`data.rollout_files`)."""

    arch: ModelArch
    layout: ParallelLayout
    plan: RunPlan
    tokenizer: Any
    processor: ImageProcessor | None  # a vision-language policy's (`rlhf.data.images`)
    tools: dict
    train_data: PromptDataset
    val_data: PromptDataset | None
    stored: list[list[StoredSample]] | None


def preflight(
    cfg: RLHFConfig,
    world_size: int,
    local_world_size: int = 1,
    device: str = "cpu",
    is_main: bool = True,
) -> Preflight:
    """Every check that needs a model, the world or the data, before the process groups
    exist and before any server starts, in one line each (`rlhf.errors`); `device`: the
    device type the run trains on (the memory plan's), logged by the `is_main` process."""
    arch = load_policy_arch(cfg)  # every model directory checked, once
    layout = validate_config(cfg, world_size, arch, local_world_size)
    check_megatron_overrides(trained_megatron(cfg.actor_rollout_ref, cfg.critic, cfg.algorithm))
    path = cfg.actor_rollout_ref.model.path
    tokenizer = load_tokenizer(path)
    check_tokenizer_fits(tokenizer, arch, path, MODEL_KEY)
    tools = load_configured_tools(cfg.actor_rollout_ref.rollout.multi_turn)
    processor = ImageProcessor(path) if arch.vision is not None else None
    encoding = (tokenizer, tools, processor)
    train = _prompts(cfg.data, cfg.reward, *encoding, "train")
    val = _prompts(cfg.data, cfg.reward, *encoding, "val") if cfg.data.val_files else None
    datasets = {"data.train_files": train, "data.val_files": val}
    present = {k: v for k, v in datasets.items() if v is not None}
    check_model_rows_have_a_scorer(cfg.reward, present)
    rows = (p.row for p in train.prompts if p.row.style == "rule")
    if (first_rule_row := next(rows, None)) is not None:
        probe_reward_function(cfg.reward, first_rule_row)
    n = cfg.actor_rollout_ref.rollout.n
    image_token = arch.vision.image_token_id if arch.vision else None
    stored = load_stored_groups(cfg.data, cfg.reward, n, arch.vocab_size, image_token)
    if is_main:  # the planner's per-GPU table (rlhf.memory), before the models are built
        memory, report = startup_report(PlanInputs.from_config(cfg, arch, world_size, device))
        log.info("memory per GPU (GiB), by role and kind:\n%s", report)
        if memory.fits is False:
            log.warning("the memory planner expects this config not to fit: %s", verdict(memory))
    plan = resolve(cfg, world_size)
    return Preflight(arch, layout, plan, tokenizer, processor, tools, train, val, stored)


def _prompts(
    data: DataConfig,
    reward: RewardConfig,
    tokenizer: Any,
    tools: dict,
    processor: ImageProcessor | None,
    split: Literal["train", "val"],
) -> PromptDataset:
    """`data.{split}_files`, their rule rows checked scorable (they fail here, not mid-run),
    every row the reward model's under `reward.model_scores_every_row`; with multi-turn
    rollouts each prompt lists the tools (`rollout.multi_turn.tool_config_path`); a
    vision-language policy's `processor` takes rows with images."""
    scorable = ground_truth_checker(reward)
    prompts = prompt_dataset_from_config(
        data,
        tokenizer,
        split,
        check_ground_truth=scorable,
        tools=tool_schemas(tools),
        processor=processor,
    )
    return prompts.scored_by_model() if reward.model_scores_every_row else prompts


# ---- rlhf-train-rm ------------------------------------------------------------------


def preflight_reward_model(
    cfg: RewardModelRunConfig, world_size: int
) -> tuple[ModelArch, ParallelLayout]:
    """`rlhf-train-rm`'s checks before its process groups: the model directory, the experts'
    split, the Megatron overrides, then the run's rules (`validate_reward_training`)."""
    arch = check_model_dir(cfg.model.path, "model.path")
    check_experts(arch, cfg.model.megatron, "model")
    check_megatron_overrides({"model": cfg.model.megatron})
    return arch, validate_reward_training(cfg, world_size, arch)


def check_pairs_fill_a_batch(batch_size: int, num_pairs: int) -> None:
    """A reward model's step takes `data.train_batch_size` preference pairs."""
    if batch_size > num_pairs:
        raise ConfigError(
            f"data.train_batch_size={batch_size} is more than the {num_pairs} training pairs"
        )


def check_pair_order(checkpoint: Path, saved: dict, order: dict) -> None:
    """A reward model's resume continues the pairs' order only when what decides it (the
    pairs, `data.train_batch_size`, `data.seed`: `order`) is the checkpoint's (`saved`)."""
    changed = [
        f"{key} {saved.get(key)} -> {value}"
        for key, value in order.items()
        if saved.get(key) != value
    ]
    if changed:
        raise ConfigError(
            f"resuming from {checkpoint}: the training pairs' order would differ "
            f"({', '.join(changed)}); use the same data, data.train_batch_size and "
            "data.seed, or trainer.resume_mode=disable"
        )
