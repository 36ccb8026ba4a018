"""Rules of `trainer.rollout_mode` (one_step_off, async): the settings under which generation
cannot overlap training are refused before anything starts.

- Overlap needs servers that do not share the trainer's devices: disaggregated servers
  (`rollout.server_urls`, started by `launch/sglang_servers.sh`). Servers the job launches
  are colocated: on GPU they sleep while the trainer trains, so nothing could overlap.
- A sample may be older than the policy being trained, so the loss must correct for it:
  truncated importance sampling against the engine's log-probs
  (`algorithm.rollout_correction.rollout_is`) or bypass mode (the PPO ratio is then taken
  against the sampling policy itself).
- `trainer.async_rollout` sets rollout_mode=async and nothing else: changed under another
  mode it is refused (one_step_off is staleness 1 without a pause by definition).
- Under async, weight updates cut samples mid-generation. A multi-turn conversation is
  several requests with tool calls between them, and routed experts (R3) come per request:
  neither is continued across a cut yet, so both are refused.
"""

from __future__ import annotations

from rlhf.config.algorithm import RolloutCorrectionConfig
from rlhf.config.algorithm_rules import require_off_policy_correction
from rlhf.config.loader import ConfigError
from rlhf.config.rollout import AsyncRolloutConfig
from rlhf.config.schema import ActorRolloutRefConfig, TrainerConfig

AR = "actor_rollout_ref"


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
