"""`actor_rollout_ref.rollout.multi_turn` read into what multi-turn rollouts use: the
conversation settings (`MultiTurnSettings`), the configured tools, and their schemas for the
prompt's chat template (`rlhf.data.prompts`, `tools=`).

The config's own rules (`rlhf.config.validate`) cannot load the tool config file:
the config layer sits below the tools. `load_configured_tools` does, and turns any mistake
in the file into a `ToolConfigError` naming the key, the file and the entry; `rlhf-train` and
`rlhf-doctor` call it right after `validate_config`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rlhf.config.rollout import MultiTurnConfig
from rlhf.config.validate import MULTI_TURN, check_tool_config_path
from rlhf.errors import UserError
from rlhf.tools.base import Tool, load_tools

if TYPE_CHECKING:  # imported where used: torch comes with them (rlhf.cli.train loads tools
    from rlhf.rollout.multi_turn import MultiTurnRollout, MultiTurnSettings  # before torch)


class ToolConfigError(ValueError, UserError):
    """`rollout.multi_turn.tool_config_path` names a file that does not load (a config
    error to the user: the line says so)."""

    kind = "config error"


def multi_turn_settings(
    multi_turn: MultiTurnConfig, max_response_length: int
) -> MultiTurnSettings | None:
    """The conversation settings of `rollout.multi_turn`, with `data.max_response_length` as
    the budget of every appended token; None when multi-turn is off."""
    if not multi_turn.enable:
        return None
    from rlhf.rollout.multi_turn import MultiTurnSettings

    return MultiTurnSettings(
        max_response_length=max_response_length,
        max_assistant_turns=multi_turn.max_assistant_turns,
        max_user_turns=multi_turn.max_user_turns,
        max_parallel_calls=multi_turn.max_parallel_calls,
        max_tool_response_length=multi_turn.max_tool_response_length,
        tool_timeout_s=multi_turn.tool_timeout_s,
        tool_response_truncate_side=multi_turn.tool_response_truncate_side,
        format=multi_turn.format,
    )


def load_configured_tools(multi_turn: MultiTurnConfig) -> dict[str, Tool]:
    """The tools of `multi_turn.tool_config_path` by name, in the file's order ({} when
    multi-turn is off); a file that does not load is a one-line `ToolConfigError`."""
    if not multi_turn.enable:
        return {}
    check_tool_config_path(multi_turn)  # the config rule: rlhf-eval and rlhf-rollout run no other
    path = multi_turn.tool_config_path
    assert path is not None  # refused unset by check_tool_config_path
    try:
        return load_tools(path)
    except (OSError, ValueError) as e:  # load_tools names the file and the entry
        raise ToolConfigError(
            f"{MULTI_TURN}.tool_config_path: {' '.join(str(e).split())}"
        ) from None


def tool_schemas(tools: dict[str, Tool]) -> list[dict[str, Any]] | None:
    """The tools' OpenAI function schemas, as the chat template lists them in the prompt
    (`tools=`); None without tools (the prompt renders as it does without multi-turn)."""
    return [tool.schema for tool in tools.values()] or None


def multi_turn_rollout(
    multi_turn: MultiTurnConfig, max_response_length: int, tokenizer, tools: dict[str, Tool]
) -> MultiTurnRollout | None:
    """The conversations of `rollout.multi_turn` with `tools` (`load_configured_tools`),
    each response at most `max_response_length` tokens; None when multi-turn is off."""
    settings = multi_turn_settings(multi_turn, max_response_length)
    if settings is None:
        return None
    from rlhf.rollout.multi_turn import MultiTurnRollout

    return MultiTurnRollout(tools, tokenizer, settings)
