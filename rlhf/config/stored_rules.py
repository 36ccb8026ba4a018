"""Rules of `data.rollout_files` (training from stored rollouts): the settings under which
stored samples cannot be trained on are refused before anything starts.

- `data.stored_fraction` x `data.train_batch_size` prompt groups of each step come from the
  files, exactly: the product must be a whole number >= 1.
- Stored samples come from another (older) policy: the loss must correct for it, with
  truncated importance sampling against their log-probs
  (`algorithm.rollout_correction.rollout_is`) or bypass mode.
- They are taken as they are: dynamic sampling (which generates more rounds) and routing
  replay R3 (which needs the engine's routes; stored rows have none) do not apply, and they
  are read by the synchronous strategy only (`trainer.rollout_mode=sync`).
"""

from __future__ import annotations

from rlhf.config.algorithm import AlgorithmConfig
from rlhf.config.algorithm_rules import require_off_policy_correction
from rlhf.config.loader import ConfigError
from rlhf.config.schema import ActorConfig, DataConfig, TrainerConfig


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
