"""Tools of multi-turn rollouts: the tool config file, argument checks, the calculator, and
the tool-call parser checked against SGLang's own Hermes parser."""

from __future__ import annotations

import asyncio
import json

import pytest

from rlhf.tools.base import ERROR, ToolResult, load_tools
from rlhf.tools.calculator import Calculator
from rlhf.tools.parser import ToolCall, parse_tool_calls

CALCULATOR_SCHEMA = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate arithmetic",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string"}},
            "required": ["expression"],
        },
    },
}
CONFIG = """
tools:
  - class_name: rlhf.tools.calculator.Calculator
    config: {max_length: 50}
    tool_schema:
      type: function
      function:
        name: calculator
        parameters:
          type: object
          properties: {expression: {type: string}}
          required: [expression]
  - class_name: rlhf.tools.sandbox.PythonSandbox
    config: {timeout_s: 2}
    tool_schema: {type: function, function: {name: python, parameters: {type: object}}}
"""


def calc(expression: str, **settings) -> ToolResult:
    tool = Calculator(CALCULATOR_SCHEMA, settings)
    return asyncio.run(tool.execute(None, {"expression": expression}))


@pytest.mark.parametrize(
    ("expression", "expected"),
    [
        ("3 + 4 * 2", "11"),
        ("(3 + 4) * 2", "14"),
        ("7 / 2", "3.5"),
        ("8 / 2", "4"),
        ("7 // 2", "3"),
        ("-7 % 3", "2"),
        ("2 ** 10", "1024"),
        ("-(2 - 5)", "3"),
        ("0.1 + 0.2", "0.3"),
        ("12345678901234567890 * 10", "123456789012345678900"),
    ],
)
def test_calculator_values_by_hand(expression, expected):
    assert calc(expression) == ToolResult(expected)


@pytest.mark.parametrize(
    ("expression", "message"),
    [
        ("__import__('os').system('ls')", "not Call"),
        ("x + 1", "the name 'x'"),
        ("'a' * 3", "the constant 'a'"),
        ("1 < 2", "not Compare"),
        ("2 ** 1000", "exponents are limited to 64"),
        ("(10 ** 60) * (10 ** 10)", "limited to 64 digits"),
        ("1 / 0", "division by zero"),
        ("(-8) ** 0.5", "not a real number"),
        ("1 +", "cannot parse"),
        ("1" * 60, "longer than 50 characters"),
        ("True + 1", "the constant True"),
    ],
)
def test_calculator_refuses_what_is_not_bounded_arithmetic(expression, message):
    result = calc(expression, max_length=50)
    assert result.error == ERROR and message in result.text, result


def test_arguments_are_checked_against_the_schema():
    tool = Calculator(CALCULATOR_SCHEMA, {})
    assert tool.check_arguments({"expression": "1"}) is None
    assert "needs the argument(s) expression" in tool.check_arguments({})
    assert "has no argument 'x'" in tool.check_arguments({"expression": "1", "x": 2})
    assert "must be a string" in tool.check_arguments({"expression": 1})
    assert "must be a JSON object" in tool.check_arguments(["1"])


def test_the_tool_config_builds_the_tools(tmp_path):
    path = tmp_path / "tools.yaml"
    path.write_text(CONFIG)
    tools = load_tools(path)
    assert sorted(tools) == ["calculator", "python"]
    assert isinstance(tools["calculator"], Calculator) and tools["calculator"].max_length == 50
    assert tools["python"].timeout_s == 2


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("tools: []", "non-empty list under 'tools'"),
        ("tools: [{class_name: os.path, tool_schema: {function: {name: a}}}]", "is not a"),
        ("tools: [{class_name: nope.Tool, tool_schema: {function: {name: a}}}]", "cannot import"),
        ("tools: [{class_name: rlhf.tools.calculator.Calculator}]", "needs function.name"),
        (
            "tools: [{class_name: rlhf.tools.calculator.Calculator, config: {digits: 3}, "
            "tool_schema: {function: {name: a}}}]",
            "unknown setting(s) ['digits']",
        ),
        ("tools: [{class_name: a.B, schema: 1}]", "expected the keys"),
    ],
)
def test_a_bad_tool_config_names_the_file_and_entry(tmp_path, text, message):
    path = tmp_path / "tools.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=r"tool config .*tools\.yaml") as info:
        load_tools(path)
    assert message in str(info.value)


WELL_FORMED = [
    'Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "3+4"}}\n'
    "</tool_call>",
    '<tool_call>{"name": "calculator", "arguments": {"expression": "1"}}</tool_call>\n'
    '<tool_call>{"name": "python", "arguments": {"code": "print(1)"}}</tool_call>',
    "No tools needed. The answer is 7.",
    '<tool_call>\n{"name": "calculator", "arguments": {}}\n</tool_call>',
]


@pytest.mark.parametrize("text", WELL_FORMED)
def test_well_formed_calls_parse_as_sglang_parses_them(text):
    from sglang.srt.entrypoints.openai.protocol import Function
    from sglang.srt.entrypoints.openai.protocol import Tool as SGLangTool
    from sglang.srt.function_call.hermes_detector import HermesDetector

    tools = [
        SGLangTool(type="function", function=Function(name=n, parameters={"type": "object"}))
        for n in ("calculator", "python")
    ]
    theirs = HermesDetector().detect_and_parse(text, tools).calls
    ours = parse_tool_calls(text)
    assert [(c.name, c.arguments) for c in ours] == [
        (c.name, json.loads(c.parameters)) for c in theirs
    ]
    assert all(c.error is None for c in ours)


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("<tool_call>{not json}</tool_call>", "not valid JSON"),
        ('<tool_call>{"arguments": {}}</tool_call>', 'must be {"name"'),
        ('<tool_call>{"name": "c", "arguments": [1]}</tool_call>', "must be a JSON object"),
        ('<tool_call>{"name": "c", "arguments": {"expression": "1"', "cut off"),
        # hostile output: json.loads raises RecursionError / ValueError, not JSONDecodeError
        ("<tool_call>" + "[" * 3000 + "</tool_call>", "nested too deeply"),
        ('<tool_call>{"name": "c", "arguments": "' + "[" * 3000 + '"}</tool_call>', "too deeply"),
        ('<tool_call>{"name": "c", "arguments": {"x": ' + "9" * 5000 + "}}</tool_call>", "digits"),
        (
            '<tool_call>{"name": "c", "arguments": {"x": ' + "[" * 40 + "]" * 40 + "}}</tool_call>",
            "nest deeper than 32",
        ),
    ],
)
def test_malformed_calls_come_back_with_the_reason(text, error):
    (call,) = parse_tool_calls(text)
    assert call.error is not None and error in call.error


def test_arguments_written_as_a_json_string_are_read():
    text = '<tool_call>{"name": "c", "arguments": "{\\"expression\\": \\"2*3\\"}"}</tool_call>'
    assert parse_tool_calls(text) == [ToolCall("c", {"expression": "2*3"})]
