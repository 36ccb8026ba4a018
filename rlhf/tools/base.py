"""The tool interface of multi-turn rollouts, and the tool config file that lists the tools.

A tool is called by the policy in the middle of a response (`rlhf.rollout.multi_turn`). Per
sample, the rollout creates the tool's state from the row's `extra_info.tools_kwargs[name]`
(the ground truth, a file set, ...), executes calls with the JSON arguments the policy wrote,
and releases the state when the conversation ends. What a call returns is text for the
policy to read (rendered as a tool message) and an optional step reward.

A call never raises into the rollout: arguments that do not fit the schema, an exception in
the tool, a timeout or a result that is not text become a `ToolResult` whose `error` says
which (`error` / `timeout`) and whose text tells the policy what went wrong. A `create` that
raises or hangs makes every call of that tool in the sample answer with that error.

The config file (`actor_rollout_ref.rollout.multi_turn.tool_config_path`) uses verl's layout:

    tools:
      - class_name: rlhf.tools.calculator.Calculator
        config: {max_length: 200}          # the tool's own settings (verl's type: native
                                           # is accepted and means this; mcp is refused)
        tool_schema:                       # OpenAI function schema, shown to the policy
          type: function
          function:
            name: calculator
            description: ...
            parameters: {type: object, properties: {...}, required: [...]}
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlhf.config.yaml_file import read_yaml

ERROR, TIMEOUT = "error", "timeout"  # ToolResult.error kinds (metrics tool_calls/{errors,timeouts})
JSON_TYPES = {
    "string": (str,),
    "number": (int, float),
    "integer": (int,),
    "boolean": (bool,),
    "object": (dict,),
    "array": (list,),
    "null": (type(None),),
}


@dataclass(frozen=True)
class ToolResult:
    """What one call gives back: `text` for the policy, a step `reward`, and `error` (None, or
    ERROR / TIMEOUT) when the call failed, its text then being the message the policy reads."""

    text: str
    reward: float = 0.0
    error: str | None = None

    @classmethod
    def failed(cls, message: str, kind: str = ERROR) -> ToolResult:
        return cls(f"Error: {message}", 0.0, kind)


class Tool(ABC):
    """A tool: `schema` is its OpenAI function schema, `settings` its config mapping."""

    def __init__(self, schema: dict[str, Any], settings: dict[str, Any]):
        """`settings` are read by the subclass (each refuses unknown ones)."""
        self.schema = schema
        self.name: str = schema["function"]["name"]

    async def create(self, tools_kwargs: dict[str, Any]) -> Any:
        """Per-sample state from the row's `extra_info.tools_kwargs[name]`, the mapping under
        this tool's name as it is ({} when the row has none; verl's layout
        {"create_kwargs": {...}} arrives as that mapping). Default: a copy of it."""
        return dict(tools_kwargs)

    @abstractmethod
    async def execute(self, state: Any, arguments: dict[str, Any]) -> ToolResult:
        """Run one call with `arguments` (already checked against the schema)."""

    async def release(self, state: Any) -> None:  # noqa: B027 (optional to override)
        """Free the per-sample state (default: nothing to free)."""

    def check_arguments(self, arguments: Any) -> str | None:
        """Why `arguments` do not fit the schema (None: they do): an object with the required
        keys, no unknown ones, each of its declared JSON type."""
        if not isinstance(arguments, dict):
            return f"the arguments of {self.name} must be a JSON object, got {arguments!r}"[:300]
        params = self.schema["function"].get("parameters") or {}
        properties = params.get("properties") or {}
        missing = [k for k in params.get("required") or [] if k not in arguments]
        if missing:
            return f"{self.name} needs the argument(s) {', '.join(missing)}"
        for key, value in arguments.items():
            if key not in properties:
                return f"{self.name} has no argument {key!r} (it takes {', '.join(properties)})"
            expected = properties[key].get("type")
            if expected in JSON_TYPES and not _is_json_type(value, expected):
                return f"argument {key!r} of {self.name} must be a {expected}, got {value!r}"[:300]
        return None


def _is_json_type(value: Any, expected: str) -> bool:
    if isinstance(value, bool) and expected in ("number", "integer"):
        return False
    return isinstance(value, JSON_TYPES[expected])


def load_tools(path: str | Path) -> dict[str, Tool]:
    """The tools of a tool config file by name; any mistake in it is a ValueError naming the
    file and the entry."""
    path = Path(path)
    doc = read_yaml(path, "tool config")  # no aliases, no key twice (rlhf.config.yaml_file)
    entries = doc.get("tools") if isinstance(doc, dict) else None
    if not isinstance(entries, list) or not entries:
        raise ValueError(f"tool config {path}: expected a non-empty list under 'tools'")
    tools: dict[str, Tool] = {}
    for i, entry in enumerate(entries):
        tool = _build_tool(entry, f"tool config {path}, tools[{i}]")
        if tool.name in tools:
            raise ValueError(f"tool config {path}: two tools are named {tool.name!r}")
        tools[tool.name] = tool
    return tools


def _build_tool(entry: Any, where: str) -> Tool:
    if not isinstance(entry, dict) or set(entry) - {"class_name", "config", "tool_schema"}:
        raise ValueError(f"{where}: expected the keys class_name, config, tool_schema")
    class_name, schema = entry.get("class_name"), entry.get("tool_schema")
    if not isinstance(class_name, str) or "." not in class_name:
        raise ValueError(f"{where}: class_name must be 'module.Class', got {class_name!r}")
    if not isinstance(schema, dict):
        schema = {}
    function = schema.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise ValueError(f"{where}: tool_schema needs function.name (OpenAI function schema)")
    module_name, _, attr = class_name.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"{where}: cannot import {class_name} ({e})") from None
    if not (isinstance(cls, type) and issubclass(cls, Tool)):
        raise ValueError(f"{where}: {class_name} is not a rlhf.tools.base.Tool")
    settings = entry.get("config") or {}
    if not isinstance(settings, dict):
        raise ValueError(f"{where}: config must be a mapping, got {settings!r}")
    kind = settings.get("type", "native")  # verl's tool kind: a Python class, or MCP
    if kind != "native":
        raise ValueError(
            f"{where}: config.type={kind!r}: only native tools (classes of "
            "rlhf.tools.base.Tool) run here, not verl's MCP tools"
        )
    settings = {k: v for k, v in settings.items() if k != "type"}
    try:
        return cls(schema, settings)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: {class_name}: {e}") from None
