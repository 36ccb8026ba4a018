"""A resume compares the run's config with the one its checkpoint was written under.

Each checkpoint holds its run's resolved config (`config.yaml`). A change is one of:

- layout or operations (parallel sizes, micro-batch budgets, offload, recompute, the servers
  and the weight sync, logging, checkpoint cadence, run length, timeouts): checkpoints
  reshard, so the run goes on and the changes are said in one line;
- what is trained (model, data, reward, losses, optimizer, sampling, algorithm): continuing
  would silently mix two experiments, so the resume is refused naming every such key with
  both values, unless `trainer.resume_accept_changes` lists the key or its section;
- a change no acceptance makes work: the prompt order cannot continue over another number
  of prompts or another batch size, and a critic the checkpoint does not hold cannot resume.

All of it runs before any server starts; the run's `config.yaml` is written only after it.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import yaml

from rlhf.checkpoint.manager import COMPLETE_MARKER
from rlhf.checkpoint.state import TRAINER_STATE_FILE
from rlhf.config.loader import ConfigError, all_keys, dump_yaml
from rlhf.config.schema import RLHFConfig
from rlhf.config.stored_rules import prompt_sampler_batch
from rlhf.config.validate import distributed_optimizer_on, trained_megatron, uses_critic

log = logging.getLogger(__name__)

CHECKPOINT_CONFIG = "config.yaml"
AR = "actor_rollout_ref"
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
    _check_structure(cfg, checkpoint, num_prompts)
    _check_world_size(checkpoint, world_size)
    _check_optimizer_format(cfg, checkpoint, optimizer_group)
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


def _check_structure(cfg: RLHFConfig, checkpoint: Path, num_prompts: int) -> None:
    """The changes no acceptance makes work."""
    fresh = "start fresh (trainer.resume_mode=disable, or another trainer.default_local_dir)"
    if uses_critic(cfg) and not (checkpoint / "critic").is_dir():
        raise ConfigError(
            f"resume from {checkpoint}: algorithm.adv_estimator={cfg.algorithm.adv_estimator} "
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
            prompt_sampler_batch(cfg),
            "prompts per step (data.train_batch_size, less data.rollout_files' groups)",
        ),
    ):
        if key in sampler and sampler[key] != mine:
            raise ConfigError(
                f"resume from {checkpoint}: the checkpoint's prompt order is over {sampler[key]} "
                f"{name} and this run has {mine}; the order cannot continue: {fresh}"
            )


def _check_optimizer_format(cfg: RLHFConfig, checkpoint: Path, optimizer_group: int) -> None:
    """The distributed optimizer's state (sharded files) and the plain one's (inside the
    model checkpoint) do not load into each other: a 1-rank checkpoint resumed on several
    data-parallel ranks, where the distributed optimizer is on by default, is one case."""
    for role, megatron in trained_megatron(cfg).items():
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
