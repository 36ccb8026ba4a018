"""Multi-turn conversations with the calculator on a real SGLang CPU server, token in, token
out (rlhf.rollout.multi_turn).

The tiny random model would not call a tool by itself, so each turn is constrained by a
regular expression (SGLang's `regex` sampling parameter): the first turn must write a
calculator call on two digits, the second a final answer. Everything else is real: SGLang
samples the tokens and returns their ids and log-probs, the calculator runs, and the tool
message is rendered by the tokenizer's chat template. The ids of the conversation are
checked against SGLang's returned output ids and a tool message written out by hand from the
quickstart template, the mask and log-probs per token, and the ids each request sent.
"""

from __future__ import annotations

import asyncio
import re

import pytest
from transformers import AutoTokenizer

from rlhf.rollout.client import GenerateClient, generate_payload
from rlhf.rollout.multi_turn import MultiTurnRollout, MultiTurnSettings
from rlhf.tools.calculator import Calculator
from tests.unit.test_tools import CALCULATOR_SCHEMA

CALL = (
    r'<tool_call>\{"name": "calculator", "arguments": '
    r'\{"expression": "[1-9] \+ [1-9]"\}\}</tool_call>'
)
ANSWER = r"The answer is [0-9]+\."
GARBAGE = r"<tool_call>\{oops\}</tool_call>"


def converse(
    server, tokenizer, turns: list[str], max_response_length=256, temperature=1.0, tool=None
):
    """One conversation whose i-th turn is constrained to the regex `turns[i]`; returns
    (conversation, [(input ids, generation)] of each request)."""
    settings = MultiTurnSettings(
        max_response_length=max_response_length, max_assistant_turns=4, tool_timeout_s=2
    )
    tool = tool or Calculator(CALCULATOR_SCHEMA, {})
    rollout = MultiTurnRollout({"calculator": tool}, tokenizer, settings)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 3 + 4? Use the calculator."}],
        add_generation_prompt=True,
        tokenize=False,
    )
    prompt = tokenizer.encode(text, add_special_tokens=False)
    sent = []

    async def run():
        async with GenerateClient([server.url]).session() as request:

            async def generate(ids, params):
                regex = turns[len(sent)]
                result = await request(0, generate_payload(ids, {**params, "n": 1, "regex": regex}))
                sent.append((list(ids), result.generations[0]))
                return result.generations[0]

            return await rollout.converse(generate, prompt, {"temperature": temperature}, {})

    return prompt, asyncio.run(run()), sent


def tool_message_ids(tokenizer, text: str) -> list[int]:
    """The quickstart template's tool message after an assistant turn, written out here."""
    rendered = f"\n<|im_start|>tool\n{text}<|im_end|>\n<|im_start|>assistant\n"
    return tokenizer.encode(rendered, add_special_tokens=False)


@pytest.fixture(scope="module")
def tokenizer(tiny_qwen2_dir):
    return AutoTokenizer.from_pretrained(tiny_qwen2_dir)


def test_a_tool_call_and_an_answer_are_the_engines_ids_plus_the_tool_message(
    sglang_server, tokenizer
):
    prompt, conv, sent = converse(sglang_server, tokenizer, [CALL, ANSWER])
    (ids1, first), (ids2, second) = sent
    call_text = tokenizer.decode(first.output_ids, skip_special_tokens=True)
    a, b = map(int, re.findall(r"([1-9]) \+ ([1-9])", call_text)[0])
    tool_ids = tool_message_ids(tokenizer, str(a + b))
    assert ids1 == prompt
    assert ids2 == prompt + first.output_ids + tool_ids  # token in: nothing re-tokenised
    assert conv.response_ids == first.output_ids + tool_ids + second.output_ids
    assert conv.response_mask == [1] * len(first.output_ids) + [0] * len(tool_ids) + [1] * len(
        second.output_ids
    )
    assert conv.logprobs == first.logprobs + [0.0] * len(tool_ids) + second.logprobs
    (record,) = conv.tool_calls
    assert (record.name, record.arguments, record.result) == (
        "calculator",
        {"expression": f"{a} + {b}"},
        str(a + b),
    )
    assert record.error is None and (conv.turns, conv.finish_reason) == (2, "stop")
    assert first.output_ids[-1] == tokenizer.eos_token_id  # each turn ends its own message


def test_a_garbage_call_is_answered_with_the_error_and_the_conversation_goes_on(
    sglang_server, tokenizer
):
    _, conv, sent = converse(sglang_server, tokenizer, [GARBAGE, CALL, ANSWER])
    assert len(sent) == 3 and conv.finish_reason == "stop"
    bad, good = conv.tool_calls
    assert bad.error == "error" and "not valid JSON" in bad.result
    assert good.error is None and re.fullmatch(r"[1-9] \+ [1-9]", good.arguments["expression"])
    message = tool_message_ids(tokenizer, bad.result)
    start = len(sent[0][1].output_ids)
    assert conv.response_ids[start : start + len(message)] == message
    assert conv.response_mask[start : start + len(message)] == [0] * len(message)


def test_the_budget_counts_the_tool_tokens(sglang_server, tokenizer):
    """A budget that holds the call but not the call and its result ends the conversation
    after the first turn, without the tool message. Greedy, so that both conversations
    write the same call in the same tokens (a regex admits several tokenisations)."""
    _, full, _ = converse(sglang_server, tokenizer, [CALL, ANSWER], temperature=0.0)
    first_len = full.response_mask.index(0)
    tool_len = full.response_mask[first_len:].index(1)
    _, cut, sent = converse(sglang_server, tokenizer, [CALL, ANSWER], first_len + tool_len - 1, 0.0)
    assert sent[0][1].output_ids == full.response_ids[:first_len]
    assert len(sent) == 1 and cut.finish_reason == "length"
    assert len(cut.response_ids) == len(sent[0][1].output_ids) and set(cut.response_mask) == {1}


class Hanging(Calculator):
    async def execute(self, state, arguments):
        await asyncio.sleep(3600)


class Raising(Calculator):
    async def execute(self, state, arguments):
        raise RuntimeError("the tool's own bug")


class Garbage(Calculator):
    async def execute(self, state, arguments):
        return {"not": "a ToolResult"}


@pytest.mark.parametrize(
    ("tool", "kind", "message"),
    [
        (Hanging, "timeout", "did not answer within 2 s"),
        (Raising, "error", "RuntimeError: the tool's own bug"),
        (Garbage, "error", "returned dict, not text"),
    ],
)
def test_a_tool_that_hangs_raises_or_returns_garbage_is_an_error_the_policy_reads(
    sglang_server, tokenizer, tool, kind, message
):
    _, conv, sent = converse(
        sglang_server, tokenizer, [CALL, ANSWER], tool=tool(CALCULATOR_SCHEMA, {})
    )
    (record,) = conv.tool_calls
    assert record.error == kind and message in record.result
    assert len(sent) == 2 and conv.finish_reason == "stop"  # the conversation went on
    tool_ids = tool_message_ids(tokenizer, record.result)
    start = len(sent[0][1].output_ids)
    assert conv.response_ids[start : start + len(tool_ids)] == tool_ids
