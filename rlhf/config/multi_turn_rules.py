"""Rules of `actor_rollout_ref.rollout.multi_turn`: the settings under which conversations
with tool calls cannot run are refused before anything starts.

- The tools come from `tool_config_path`, which must be set. Whether the file exists and
  loads (its classes import, their settings fit) is checked, as data files are, when the
  run starts: by
  `rlhf.rollout.multi_turn_config.load_configured_tools`, above the tools layer, which
  `rlhf-train` and `rlhf-doctor` call right after these rules.
- The prompt lists the tools and the tool results become messages, both rendered by the
  chat template: `data.apply_chat_template` must be on.
- Rollout routing replay (R3) takes the experts the engine routed in one /generate request,
  and a conversation is several requests (one per assistant turn).
"""

from __future__ import annotations

from rlhf.config.loader import ConfigError
from rlhf.config.rollout import MultiTurnConfig
from rlhf.config.schema import ActorConfig, DataConfig

AR = "actor_rollout_ref"
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
