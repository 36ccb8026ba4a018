"""Tool calls in the text of one assistant turn, by the model family's format.

`hermes` (Qwen2.5, Qwen3, Hermes; SGLang's `hermes` / `qwen25` parsers): each call is a JSON
object {"name": ..., "arguments": {...}} between `<tool_call>` and `</tool_call>`. Unlike a
serving parser, which drops what it cannot read, every call the policy attempted is
returned: one that is not valid JSON (nested too deeply or holding an integer past Python's
digit limit included), lacks a name, has arguments that are not an object,
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
# what json.loads raises on text the policy wrote: bad JSON (JSONDecodeError, a ValueError),
# integers past Python's digit limit (ValueError), nesting past the recursion limit
UNREADABLE = (ValueError, RecursionError)
MAX_DEPTH = 32  # levels of lists and objects in a call's arguments
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
    except UNREADABLE as e:
        return ToolCall(None, None, f"the tool call is not valid JSON ({_reason(e)})")
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return ToolCall(None, None, 'a tool call must be {"name": ..., "arguments": {...}}')
    name, arguments = obj["name"], obj.get("arguments", {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except UNREADABLE as e:
            return ToolCall(
                name, None, f"the arguments of {name} are not valid JSON ({_reason(e)})"
            )
    if not isinstance(arguments, dict):
        return ToolCall(name, None, f"the arguments of {name} must be a JSON object")
    if _depth(arguments) > MAX_DEPTH:  # later copies and writes of the record recurse too
        return ToolCall(name, None, f"the arguments of {name} nest deeper than {MAX_DEPTH}")
    return ToolCall(name, arguments)


def _reason(error: Exception) -> str:
    if isinstance(error, json.JSONDecodeError):
        return error.msg
    if isinstance(error, RecursionError):
        return "nested too deeply"
    return str(error)[:200]


def _depth(value: Any) -> int:
    """Levels of nested lists and objects in `value` (iteratively: it may be deep)."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, dict | list):
            deepest = max(deepest, level + 1)
            if deepest > MAX_DEPTH:
                return deepest
            stack += [(v, level + 1) for v in (item.values() if isinstance(item, dict) else item)]
    return deepest
