"""Quickstart prompt files: the seeded arithmetic problems written as train/val Parquet.

The CPU quickstart and the tests need prompt data without any dataset download; these files
go through exactly the same reader and checks as real data. The tool-use quickstart's files
hold multiplication problems (rlhf/quickstart/calculator_task.py) and, next to them, the tool
config file that lists the calculator.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from rlhf.data.parquet import write_rows
from rlhf.quickstart.arithmetic import make_problems
from rlhf.quickstart.calculator_task import make_multiplication_problems, write_tool_config


def write_quickstart_data(
    out_dir: str | Path,
    num_train: int = 256,
    num_val: int = 64,
    seed: int = 0,
    make_rows: Callable[[int, int], list[dict]] = make_problems,
) -> tuple[Path, Path]:
    """Write `train.parquet` and `val.parquet` (disjoint rows of one seeded draw of
    `make_rows(num, seed)`, default the arithmetic problems) to `out_dir`."""
    if num_train < 1 or num_val < 1:
        raise ValueError(f"num_train ({num_train}) and num_val ({num_val}) must be >= 1")
    rows = make_rows(num_train + num_val, seed)
    for row in rows[num_train:]:
        row["extra_info"] = {**row["extra_info"], "split": "val"}
    for row in rows[:num_train]:
        row["extra_info"] = {**row["extra_info"], "split": "train"}
    out = Path(out_dir)
    train = write_rows(rows[:num_train], out / "train.parquet")
    val = write_rows(rows[num_train:], out / "val.parquet")
    return train, val


def write_tools_quickstart_data(
    out_dir: str | Path, num_train: int = 256, num_val: int = 64, seed: int = 0
) -> tuple[Path, Path, Path]:
    """The tool-use quickstart's `train.parquet`, `val.parquet` (multiplication problems) and
    tool config file, in `out_dir`."""
    train, val = write_quickstart_data(
        out_dir, num_train, num_val, seed, make_rows=make_multiplication_problems
    )
    return train, val, write_tool_config(out_dir)
