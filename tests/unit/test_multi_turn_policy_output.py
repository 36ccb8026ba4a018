"""Nothing a policy writes, and nothing a tool does, ends a multi-turn rollout
(rlhf.rollout.multi_turn): each becomes a tool error the policy reads, the conversation goes
on, and what is recorded of a result is what the policy read.

The engine is scripted (each turn's text is fixed, its ids the tokenizer's): these tests are
about the loop around the engine; tests/e2e/test_multi_turn_rollout.py runs it on SGLang.
"""

from __future__ import annotations

import asyncio
import json

import pytest
from transformers import AutoTokenizer

from rlhf.rollout.client import Generation
from rlhf.rollout.multi_turn import MultiTurnRollout, MultiTurnSettings
from rlhf.tools.base import ERROR, TIMEOUT, Tool, ToolResult
from tests.unit.test_tools import CALCULATOR_SCHEMA

ANSWER = "The answer is 7."


def call(expression: str) -> str:
    body = {"name": "calculator", "arguments": {"expression": expression}}
    return f"<tool_call>{json.dumps(body)}</tool_call>"


class Echo(Tool):
    """Answers with its argument repeated `times` (from the row) times."""

    async def create(self, tools_kwargs):
        if tools_kwargs.get("explode"):
            raise KeyError("the row's tools_kwargs lack 'files'")
        if tools_kwargs.get("hang"):
            await asyncio.sleep(3600)
        return {"times": tools_kwargs.get("times", 1), "released": False}

    async def execute(self, state, arguments):
        return ToolResult(arguments["expression"] * state["times"])

    async def release(self, state):
        if state.get("times") == 0:
            raise RuntimeError("release failed")


@pytest.fixture(scope="module")
def tokenizer(tiny_qwen2_dir):
    return AutoTokenizer.from_pretrained(tiny_qwen2_dir)


def converse(tokenizer, turns: list[str], tools_kwargs=None, **settings):
    """One conversation whose assistant turns write `turns` in order; returns it and the
    texts of the tool messages the policy was given (decoded from the ids appended)."""
    rollout = MultiTurnRollout(
        {"calculator": Echo(CALCULATOR_SCHEMA, {})},
        tokenizer,
        MultiTurnSettings(max_response_length=16384, tool_timeout_s=1, **settings),
    )
    replies = iter(turns)

    async def generate(ids, params):
        output = tokenizer.encode(next(replies), add_special_tokens=False)
        output.append(tokenizer.eos_token_id)
        return Generation(output, [-0.5] * len(output), "stop")

    prompt = tokenizer.encode("q", add_special_tokens=False)
    conv = asyncio.run(rollout.converse(generate, prompt, {}, tools_kwargs or {}))
    tool_ids = [i for i, m in zip(conv.response_ids, conv.response_mask) if m == 0]
    return conv, tokenizer.decode(tool_ids)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("<tool_call>" + "[" * 3000 + "</tool_call>", "nested too deeply"),
        (
            '<tool_call>{"name": "calculator", "arguments": {"expression": ' + "7" * 5000 + "}}"
            "</tool_call>",
            "4300 digits",
        ),
    ],
)
def test_hostile_tool_calls_are_errors_the_policy_reads(tokenizer, text, message):
    conv, read = converse(tokenizer, [text, ANSWER])
    (record,) = conv.tool_calls
    assert record.error == ERROR and message in record.result and message in read
    assert conv.turns == 2 and conv.finish_reason == "stop"


@pytest.mark.parametrize(
    ("kwargs", "kind", "message"),
    [
        ({"explode": True}, ERROR, "calculator could not start: KeyError"),
        ({"hang": True}, TIMEOUT, "calculator did not start within 1 s"),
    ],
)
def test_a_tool_that_cannot_start_answers_every_call_with_why(tokenizer, kwargs, kind, message):
    conv, read = converse(tokenizer, [call("1"), call("2"), ANSWER], {"calculator": kwargs})
    assert [r.error for r in conv.tool_calls] == [kind, kind]
    assert all(message in r.result for r in conv.tool_calls) and message in read
    assert conv.turns == 3 and conv.finish_reason == "stop"


def test_a_release_that_raises_keeps_the_conversation(tokenizer):
    conv, _ = converse(tokenizer, [call("5"), ANSWER], {"calculator": {"times": 0}})
    assert conv.finish_reason == "stop" and conv.tool_calls[0].error is None


def test_a_huge_result_is_stored_as_the_policy_read_it_with_its_size(tokenizer):
    """20 MB results made a 377 MB rollouts file: the record holds the text the policy read
    (cut to max_tool_response_length characters) and the whole result's length."""
    conv, read = converse(
        tokenizer,
        [call("ab"), ANSWER],
        {"calculator": {"times": 10**6}},
        max_tool_response_length=100,
    )
    (record,) = conv.tool_calls
    assert record.result_chars == 2 * 10**6 and record.error is None
    assert len(record.result) == 100 + len("...(truncated)...")
    assert record.result.startswith("ab" * 25) and record.result in read
