"""The reward-model quickstart's data (`make quickstart-rm`), generated locally.

Preference pairs over the arithmetic problems (rlhf/quickstart/arithmetic.py), in TRL's
explicit-prompt layout: the prompt's chat messages, a chosen reply `#### <correct answer>`
and a rejected reply `#### <a wrong answer>`, drawn with a seed disjoint from the PPO
prompts'. A reward model that learns them scores correctness, which the PPO run then
optimises without ever seeing a ground truth: its training rows say
`reward_model.style=model` (scored by the trained reward model), its validation rows keep
the rule (`style=rule`), so validation measures real correctness.
"""

from __future__ import annotations

import random
from pathlib import Path

from rlhf.data.parquet import write_rows
from rlhf.quickstart.arithmetic import make_problems

PAIR_SEED = 777  # neither the PPO prompts' (0) nor the warm start's (12345)


def make_preference_pairs(num: int, seed: int = PAIR_SEED) -> list[dict]:
    """`num` pairs {prompt, chosen, rejected}, identical for the same seed.

    The rejected answer is the correct answer of another problem of the draw (never this
    one's): wrong answers then follow the same distribution as right ones, so that a reward
    model cannot score well by preferring likely-looking numbers and must read the problem."""
    rng = random.Random(seed)
    problems = make_problems(num, seed)
    truths = [int(row["reward_model"]["ground_truth"]) for row in problems]
    pairs = []
    for row, truth in zip(problems, truths):
        wrong = truth
        while wrong == truth:
            wrong = rng.choice(truths)
        pairs.append(
            {
                "prompt": row["prompt"],
                "chosen": [{"role": "assistant", "content": f"#### {truth}"}],
                "rejected": [{"role": "assistant", "content": f"#### {wrong}"}],
            }
        )
    return pairs


def write_reward_quickstart_data(
    out_dir: str | Path,
    num_pairs: int = 2048,
    num_val_pairs: int = 256,
    num_train: int = 256,
    num_val: int = 64,
) -> dict[str, tuple[Path, int]]:
    """In `out_dir`: `pairs_train.parquet` and `pairs_val.parquet` (the reward model's), and
    the PPO run's `train.parquet` (the quickstart's prompts as style=model rows) and
    `val.parquet` (style=rule rows). Returns name -> (path, rows)."""
    out = Path(out_dir)
    pairs = make_preference_pairs(num_pairs + num_val_pairs)
    prompts = make_problems(num_train + num_val, seed=0)  # the quickstart's prompts
    by_model = [
        {**row, "reward_model": {**row["reward_model"], "style": "model"}}
        for row in prompts[:num_train]
    ]
    files = {
        "pairs_train": pairs[:num_pairs],
        "pairs_val": pairs[num_pairs:],
        "train": by_model,
        "val": prompts[num_train:],
    }
    return {
        name: (write_rows(rows, out / f"{name}.parquet"), len(rows)) for name, rows in files.items()
    }
