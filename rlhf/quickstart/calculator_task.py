"""The tool-use quickstart's task: multiplication problems that a calculator call solves.

`make quickstart-tools` trains a tiny model to call the calculator (rlhf/tools/calculator.py)
in a multi-turn rollout. Each problem multiplies two one-digit numbers; the prompt, rendered
by the chat template with the calculator's schema (`CALCULATOR_SCHEMA`), asks for the final
number after `####`, and the rule reward of the quickstart's data source scores it. The
tiny model cannot multiply well by itself; a call such as
`<tool_call>{"name": "calculator", "arguments": {"expression": "7 * 8"}}</tool_call>` makes
the answer a copy of the tool's result.

The rows carry no `tools_kwargs` (the calculator keeps no per-sample state, and Parquet cannot
store an empty struct) and `need_tools_kwargs: false`. The tool config file that lists the
calculator with this schema is written next to the data (`write_tool_config`).

The tools model's tokenizer is built in rlhf/quickstart/tools_tokenizer.py.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

import yaml

from rlhf.quickstart.arithmetic import DATA_SOURCE, INSTRUCTION, ITEMS, NAMES
from rlhf.tools.calculator import Calculator, format_number
from rlhf.tools.parser import CLOSE, OPEN

TOOL_NAME = "calculator"
CALCULATOR_SCHEMA = {
    "type": "function",
    "function": {
        "name": TOOL_NAME,
        "description": "Evaluate arithmetic",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string"}},
            "required": ["expression"],
        },
    },
}
TOOL_CONFIG = {
    "tools": [
        {
            "class_name": "rlhf.tools.calculator.Calculator",
            "config": {},
            "tool_schema": CALCULATOR_SCHEMA,
        }
    ]
}
TOOL_CONFIG_FILE = "calculator_tool.yaml"
MIN_FACTOR, MAX_FACTOR = 2, 9


@dataclass(frozen=True)
class MultiplicationProblem:
    """`name` has `a` bags of `b` `item`; the answer is a * b."""

    name: str
    item: str
    a: int
    b: int

    @property
    def answer(self) -> int:
        return self.a * self.b

    @property
    def expression(self) -> str:
        """What a calculator call on this problem evaluates."""
        return f"{self.a} * {self.b}"

    def messages(self) -> list[dict[str, str]]:
        question = f"{self.name} has {self.a} bags of {self.b} {self.item}. How many {self.item}?"
        return [{"role": "user", "content": f"{question} {INSTRUCTION}"}]

    def row(self, index: int) -> dict:
        """The problem in verl's prompt schema (the quickstart's data source and rule)."""
        return {
            "data_source": DATA_SOURCE,
            "prompt": self.messages(),
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(self.answer)},
            "extra_info": {"index": index, "need_tools_kwargs": False},
        }


def draw_problems(num: int, seed: int) -> list[MultiplicationProblem]:
    """`num` problems, identical for the same seed."""
    rng = random.Random(seed)
    return [
        MultiplicationProblem(
            rng.choice(NAMES),
            rng.choice(ITEMS),
            rng.randint(MIN_FACTOR, MAX_FACTOR),
            rng.randint(MIN_FACTOR, MAX_FACTOR),
        )
        for _ in range(num)
    ]


def make_multiplication_problems(num: int, seed: int) -> list[dict]:
    """`num` problem rows, identical for the same seed."""
    return [problem.row(i) for i, problem in enumerate(draw_problems(num, seed))]


def possible_answers() -> list[int]:
    """Every product of two factors of the task, ascending."""
    factors = range(MIN_FACTOR, MAX_FACTOR + 1)
    return sorted({a * b for a in factors for b in factors})


def call_text(expression: str) -> str:
    """A Hermes calculator call on `expression`, as the tools model writes it."""
    call = {"name": TOOL_NAME, "arguments": {"expression": expression}}
    return f"{OPEN}{json.dumps(call)}{CLOSE}"


def answer_text(answer: int | str) -> str:
    """A final answer as the rule reward reads it."""
    return f"#### {answer}"


def write_tool_config(out_dir: str | Path) -> Path:
    """The tool config file (verl's layout, rlhf/tools/base.py) listing the calculator."""
    path = Path(out_dir) / TOOL_CONFIG_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(TOOL_CONFIG, sort_keys=False))
    return path


def calculator_result(expression: str) -> str:
    """The text the calculator answers a call on `expression` with."""
    return format_number(Calculator(CALCULATOR_SCHEMA, {}).evaluate(expression))


def tool_conversation(problem: MultiplicationProblem) -> list[dict[str, str]]:
    """The problem's messages followed by a call, its result and the answer copied from it."""
    result = calculator_result(problem.expression)
    return [
        *problem.messages(),
        {"role": "assistant", "content": call_text(problem.expression)},
        {"role": "tool", "content": result},
        {"role": "assistant", "content": answer_text(result)},
    ]
