"""`actor_rollout_ref.rollout.multi_turn`: its keys, their rules, verl's keys it has no setting
for, the tool config file loaded through the config, and the settings the rollout gets."""

from __future__ import annotations

import dataclasses

import pytest

from rlhf.cli import train
from rlhf.cli.doctor import run_checks
from rlhf.cli.doctor_checks import FAIL
from rlhf.config import ConfigError, load_config, validate_config
from rlhf.config.validate import config_notes
from rlhf.rollout.multi_turn import MultiTurnSettings
from rlhf.rollout.multi_turn_config import (
    ToolConfigError,
    load_configured_tools,
    multi_turn_settings,
    tool_schemas,
)
from rlhf.tools.calculator import Calculator

QUICKSTART = "configs/quickstart_cpu.yaml"
MT = "actor_rollout_ref.rollout.multi_turn"
# verl's layout, as its gsm8k tool config writes it (config.type included)
TOOL_CONFIG = """
tools:
  - class_name: rlhf.tools.calculator.Calculator
    config:
      type: native
      max_length: 40
    tool_schema:
      type: function
      function:
        name: calculator
        description: Evaluate an arithmetic expression
        parameters:
          type: object
          properties:
            expression: {type: string, description: "e.g. 3 * (4 + 5)"}
          required: [expression]
"""


@pytest.fixture
def tool_config(tmp_path):
    path = tmp_path / "tools.yaml"
    path.write_text(TOOL_CONFIG)
    return path


def multi_turn(cfg):
    return cfg.actor_rollout_ref.rollout.multi_turn


def test_keys_default_as_documented_and_parse():
    defaults = multi_turn(load_config(QUICKSTART))
    assert dataclasses.asdict(defaults) == {
        "enable": False,
        "tool_config_path": None,
        "format": "hermes",
        "max_assistant_turns": 5,
        "max_user_turns": 5,
        "max_parallel_calls": 1,
        "max_tool_response_length": 256,
        "tool_response_truncate_side": "middle",
        "tool_timeout_s": 60.0,
    }
    given = {
        "enable": "true",
        "tool_config_path": "/tools.yaml",
        "format": "hermes",
        "max_assistant_turns": "7",
        "max_user_turns": "6",
        "max_parallel_calls": "3",
        "max_tool_response_length": "1000",
        "tool_response_truncate_side": "left",
        "tool_timeout_s": "2.5",
    }
    parsed = multi_turn(load_config(QUICKSTART, [f"{MT}.{k}={v}" for k, v in given.items()]))
    assert dataclasses.asdict(parsed) == {
        "enable": True,
        "tool_config_path": "/tools.yaml",
        "format": "hermes",
        "max_assistant_turns": 7,
        "max_user_turns": 6,
        "max_parallel_calls": 3,
        "max_tool_response_length": 1000,
        "tool_response_truncate_side": "left",
        "tool_timeout_s": 2.5,
    }


@pytest.mark.parametrize(
    ("override", "said"),
    [
        ("max_assistant_turns=0", "max_assistant_turns: must be > 0, got 0"),
        ("max_user_turns=0", "max_user_turns: must be > 0, got 0"),
        ("max_parallel_calls=0", "max_parallel_calls: must be > 0, got 0"),
        ("max_tool_response_length=0", "max_tool_response_length: must be > 0, got 0"),
        ("tool_timeout_s=0", "tool_timeout_s: must be > 0, got 0.0"),
        (
            "tool_response_truncate_side=both",
            "tool_response_truncate_side: expected one of 'left', 'right', 'middle', got 'both'",
        ),
        ("format=llama3_json", "format: expected one of 'hermes', got 'llama3_json'"),
    ],
)
def test_each_key_refuses_values_out_of_range(override, said):
    with pytest.raises(ConfigError) as err:
        load_config(QUICKSTART, [f"{MT}.{override}"])
    assert str(err.value) == f"{MT}.{said}"


def rule_error(overrides) -> str:
    with pytest.raises(ConfigError) as err:
        validate_config(load_config(QUICKSTART, overrides))
    assert "\n" not in str(err.value)
    return str(err.value)


def test_enable_needs_a_tool_config_that_exists(tmp_path):
    said = rule_error([f"{MT}.enable=true"])
    assert said.startswith(f"{MT}.enable=true needs {MT}.tool_config_path: a YAML file")
    missing = tmp_path / "nowhere.yaml"
    cfg = load_config(QUICKSTART, [f"{MT}.enable=true", f"{MT}.tool_config_path={missing}"])
    validate_config(cfg)  # like data files, checked when the run loads it
    with pytest.raises(ToolConfigError) as err:
        load_configured_tools(cfg.actor_rollout_ref.rollout.multi_turn)
    assert str(err.value) == f"{MT}.tool_config_path: tool config {missing} does not exist"


def test_enable_needs_the_chat_template(tool_config):
    enabled = [f"{MT}.enable=true", f"{MT}.tool_config_path={tool_config}"]
    said = rule_error([*enabled, "data.apply_chat_template=false"])
    assert said.startswith(f"{MT}.enable=true needs data.apply_chat_template=true: the chat")


def test_enable_refuses_rollout_routing_replay(tool_config):
    enabled = [f"{MT}.enable=true", f"{MT}.tool_config_path={tool_config}"]
    said = rule_error([*enabled, "actor_rollout_ref.actor.router_replay.mode=R3"])
    assert said.startswith(f"{MT}.enable=true with actor_rollout_ref.actor.router_replay.mode=R3")
    assert "a conversation is several" in said
    r2 = [*enabled, "actor_rollout_ref.actor.router_replay.mode=R2"]
    validate_config(load_config(QUICKSTART, r2))  # R2 replays the trainer's own routes


def test_a_valid_multi_turn_config_passes_and_gives_the_rollout_its_settings(tool_config):
    cfg = load_config(
        QUICKSTART,
        [
            f"{MT}.enable=true",
            f"{MT}.tool_config_path={tool_config}",
            f"{MT}.max_assistant_turns=3",
            f"{MT}.max_user_turns=2",
            f"{MT}.max_parallel_calls=4",
            f"{MT}.max_tool_response_length=99",
            f"{MT}.tool_response_truncate_side=right",
            f"{MT}.tool_timeout_s=7",
            "data.max_response_length=77",
        ],
    )
    validate_config(cfg)
    assert config_notes(cfg) == []
    assert multi_turn_settings(
        cfg.actor_rollout_ref.rollout.multi_turn, cfg.data.max_response_length
    ) == MultiTurnSettings(
        max_response_length=77,
        max_assistant_turns=3,
        max_user_turns=2,
        max_parallel_calls=4,
        max_tool_response_length=99,
        tool_timeout_s=7.0,
        tool_response_truncate_side="right",
        format="hermes",
    )
    tools = load_configured_tools(cfg.actor_rollout_ref.rollout.multi_turn)
    assert list(tools) == ["calculator"] and isinstance(tools["calculator"], Calculator)
    assert tools["calculator"].max_length == 40  # the tool's settings, verl's `type` taken off
    schemas = tool_schemas(tools)
    assert schemas is not None and schemas[0]["function"]["name"] == "calculator"
    assert schemas[0]["function"]["parameters"]["required"] == ["expression"]


def test_off_there_are_no_settings_no_tools_and_set_keys_are_named_as_ignored():
    cfg = load_config(QUICKSTART, [f"{MT}.max_user_turns=3", f"{MT}.tool_config_path=/x.yaml"])
    validate_config(cfg)
    assert (
        multi_turn_settings(cfg.actor_rollout_ref.rollout.multi_turn, cfg.data.max_response_length)
        is None
    )
    assert (
        load_configured_tools(cfg.actor_rollout_ref.rollout.multi_turn) == {}
        and tool_schemas({}) is None
    )
    assert config_notes(cfg) == [
        f"{MT}.tool_config_path, {MT}.max_user_turns ignored: {MT}.enable=false"
    ]


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ("tools: []", "expected a non-empty list under 'tools'"),
        (
            TOOL_CONFIG.replace("rlhf.tools.calculator.Calculator", "rlhf.tools.nothing.Tool"),
            "tools[0]: cannot import rlhf.tools.nothing.Tool",
        ),
        (
            TOOL_CONFIG.replace("max_length: 40", "max_lenght: 40"),
            "tools[0]: rlhf.tools.calculator.Calculator: unknown setting(s) ['max_lenght']",
        ),
        (
            TOOL_CONFIG.replace("type: native", "type: mcp"),
            "tools[0]: config.type='mcp': only native tools",
        ),
    ],
)
def test_a_tool_config_that_does_not_load_is_a_one_line_config_error(
    tool_config, capsys, text, said
):
    tool_config.write_text(text)
    overrides = [f"{MT}.enable=true", f"{MT}.tool_config_path={tool_config}"]
    with pytest.raises(ToolConfigError) as err:
        load_configured_tools(
            (load_config(QUICKSTART, overrides)).actor_rollout_ref.rollout.multi_turn
        )
    assert str(err.value).startswith(f"{MT}.tool_config_path: tool config {tool_config}")
    assert said in str(err.value)
    # rlhf-train says it in one line before anything starts, rlhf-doctor as its config check
    assert train.main(["--config", QUICKSTART, *overrides, "--print-config"]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line == f"rlhf-train: config error: {err.value}"
    none = tool_config.parent / "none"  # no requirements to compare packages with
    checks = run_checks(load_config(QUICKSTART, overrides), None, {"MASTER_PORT": "0"}, none)
    check = next(c for c in checks if c.name == "config")
    assert (check.status, check.detail) == (FAIL, str(err.value))


@pytest.mark.parametrize(
    ("override", "said"),
    [
        ("tokenization_sanity_check_mode=strict", "is never tokenized again"),
        ("use_inference_chat_template=true", "never rendered again"),
        ("interaction_config_path=/interaction.yaml", "verl's interactions"),
        ("function_tool_path=/tools.py", "@function_tool files are not read"),
        ("num_repeat_rollouts=4", "responses per prompt are rollout.n here"),
    ],
)
def test_verls_multi_turn_keys_without_a_setting_here_are_refused(override, said):
    with pytest.raises(ConfigError) as err:
        load_config(QUICKSTART, [f"+{MT}.{override}"])
    message = str(err.value)
    assert message.startswith(f"{MT}.{override}: ") and said in message
    assert message.endswith("; drop the key")


def test_verls_multi_turn_keys_in_their_off_position_are_accepted():
    cfg = load_config(
        QUICKSTART,
        [
            f"+{MT}.tokenization_sanity_check_mode=disable",
            f"+{MT}.use_inference_chat_template=false",
            f"+{MT}.interaction_config_path=null",
            f"+{MT}.function_tool_path=null",
            f"+{MT}.num_repeat_rollouts=null",
        ],
    )
    assert multi_turn(cfg) == multi_turn(load_config(QUICKSTART))
