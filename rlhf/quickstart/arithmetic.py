"""Seeded arithmetic word problems (our own wording) for the CPU quickstart and tests.

Each problem is a row in verl's prompt schema: `data_source`, `prompt` (chat messages),
`ability`, `reward_model` {style, ground_truth}, `extra_info`.
"""

from __future__ import annotations

import random

DATA_SOURCE = "arithmetic"
NAMES = ("Sam", "Ana", "Lee", "Kim", "Max", "Zoe", "Bob", "Eve")
ITEMS = ("apples", "pears", "coins", "books", "cards", "stamps", "marbles", "shells")
INSTRUCTION = "Give the final number after ####."


def make_problem(rng: random.Random, index: int, max_operand: int = 9) -> dict:
    """One problem: a person starts with some items and gains or loses some."""
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    a, b = rng.randint(1, max_operand), rng.randint(1, max_operand)
    if rng.random() < 0.5:
        question = f"{name} has {a} {item} and gets {b} more. How many {item} now?"
        answer = a + b
    else:
        a, b = max(a, b), min(a, b)
        question = f"{name} has {a} {item} and loses {b}. How many {item} are left?"
        answer = a - b
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": f"{question} {INSTRUCTION}"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": str(answer)},
        "extra_info": {"index": index},
    }


def make_problems(num: int, seed: int) -> list[dict]:
    """`num` problems, identical for the same seed."""
    rng = random.Random(seed)
    return [make_problem(rng, i) for i in range(num)]
