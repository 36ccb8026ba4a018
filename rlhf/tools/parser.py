"""Tool calls in the text of one assistant turn, by the model family's format.

`hermes` (Qwen2.5, Qwen3, Hermes; SGLang's `hermes` / `qwen25` parsers): each call is a JSON
object {"name": ..., "arguments": {...}} between `<tool_call>` and `</tool_call>`. Unlike a
serving parser, which drops what it cannot read, every call the policy attempted is
returned: one that is not valid JSON, lacks a name, has arguments that are not an object,
or was cut off by the length limit comes back with `error` set, so that the policy reads
what was wrong as the tool's answer (and the run counts it). Tested against SGLang's
`HermesDetector` on well-formed calls (tests/unit/test_tool_parser.py).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from rlhf.config.choices import TOOL_CALL_FORMATS

FORMATS = TOOL_CALL_FORMATS  # multi_turn.format's choices
OPEN, CLOSE = "<tool_call>", "</tool_call>"
CALL = re.compile(re.escape(OPEN) + r"(.*?)(" + re.escape(CLOSE) + r"|$)", re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    """One attempted call: `name` and `arguments` when readable; `error` says why not."""

    name: str | None
    arguments: dict[str, Any] | None
    error: str | None = None


def parse_tool_calls(text: str, fmt: str = "hermes") -> list[ToolCall]:
    """The calls in `text`, in order (an empty list: the turn called no tool)."""
    if fmt not in FORMATS:
        raise ValueError(f"tool-call format {fmt!r} is not supported (supported: {FORMATS})")
    return [_call(body, closed=bool(end)) for body, end in CALL.findall(text)]


def _call(body: str, closed: bool) -> ToolCall:
    if not closed:
        return ToolCall(None, None, f"the tool call was cut off before {CLOSE}")
    try:
        obj = json.loads(body.strip())
    except json.JSONDecodeError as e:
        return ToolCall(None, None, f"the tool call is not valid JSON ({e.msg})")
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return ToolCall(None, None, 'a tool call must be {"name": ..., "arguments": {...}}')
    name, arguments = obj["name"], obj.get("arguments", {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return ToolCall(name, None, f"the arguments of {name} are not valid JSON")
    if not isinstance(arguments, dict):
        return ToolCall(name, None, f"the arguments of {name} must be a JSON object")
    return ToolCall(name, arguments)
