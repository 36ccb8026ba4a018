"""Stored rollouts: one Parquet row per generated sample, what a run writes for each step
(`rollouts/step_N.parquet`) and what training from stored samples reads (issue 33).

A stored sample is what the trainer needs to learn from it without generating: the token ids
(never text: a decode and re-encode need not give the same ids), the behaviour policy's
log-prob of every response token (for importance correction against the policy that
sampled it), and either its score or what the reward function needs to score it. Schema:

| column | type | required |
|---|---|---|
| `uid` | string: the prompt group (GRPO/RLOO compare the samples sharing it) | yes |
| `prompt_ids` | list of int | yes, not empty |
| `response_ids` | list of int | yes |
| `rollout_logprobs` | list of float, one per response token, each <= 0 | yes |
| `response_mask` | list of 0/1, one per response token (1: the policy's token) | no (null: all) |
| `data_source` | string, selects the reward function | yes |
| `reward_style` | 'rule' or 'model' | no ('rule') |
| `ground_truth` | string: JSON of the prompt row's `reward_model.ground_truth` | no |
| `extra_info` | string: JSON of the prompt row's `extra_info` | no ('{}') |
| `score` | double: the reward the run gave it (null: not scored yet) | no |
| `policy_version` | int: the weight version that sampled it | no |
| `step` | int: the step that generated it | no |
| `prompt_index` | int: its prompt's row in the prompt files | no |

Every file is checked whole when it is read, and each problem names file, row and column
(`rlhf.data.parquet.Problem`), as prompt files are. With `vocab_size`, token ids must be
below it (a file written with another tokenizer is caught here, not as garbage training).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from rlhf.data.files import DataFile
from rlhf.data.parquet import DataError, Problem
from rlhf.utils import atomic_output

REQUIRED = ("uid", "prompt_ids", "response_ids", "rollout_logprobs", "data_source")
SCHEMA = pa.schema(
    [
        ("uid", pa.string()),
        ("prompt_ids", pa.list_(pa.int64())),
        ("response_ids", pa.list_(pa.int64())),
        ("rollout_logprobs", pa.list_(pa.float64())),
        ("response_mask", pa.list_(pa.int8())),
        ("data_source", pa.string()),
        ("reward_style", pa.string()),
        ("ground_truth", pa.string()),
        ("extra_info", pa.string()),
        ("score", pa.float64()),
        ("policy_version", pa.int64()),
        ("step", pa.int64()),
        ("prompt_index", pa.int64()),
    ]
)


@dataclass(frozen=True)
class StoredSample:
    """One stored sample (the schema above; `ground_truth` and `extra_info` decoded)."""

    uid: str
    prompt_ids: list[int]
    response_ids: list[int]
    rollout_logprobs: list[float]
    data_source: str
    response_mask: list[int] | None = None
    reward_style: str = "rule"
    ground_truth: Any = None
    extra_info: dict[str, Any] = field(default_factory=dict)
    score: float | None = None
    policy_version: int | None = None
    step: int | None = None
    prompt_index: int | None = None

    def to_row(self) -> dict[str, Any]:
        """The Parquet row (JSON-encoded `ground_truth` and `extra_info`)."""
        row = asdict(self)
        truth = self.ground_truth
        row["ground_truth"] = None if truth is None else json.dumps(truth, default=str)
        row["extra_info"] = json.dumps(self.extra_info, default=str)
        return row


def write_rollout_file(samples: Sequence[StoredSample], path: str | os.PathLike) -> Path:
    """Write `samples` to `path` atomically (a failed write leaves no file, an existing
    file untouched)."""
    path = Path(path)
    table = pa.Table.from_pylist([s.to_row() for s in samples], schema=SCHEMA)
    with atomic_output(path) as tmp:
        pq.write_table(table, tmp)
    return path


def read_rollout_files(
    paths: Sequence[str | os.PathLike | DataFile],
    vocab_size: int | None = None,
    max_lengths: tuple[int, int] | None = None,
) -> list[StoredSample]:
    """Every sample of `paths` (local paths, or files `rlhf.data.files.resolve_files`
    resolved: local or remote), in order; raises `DataError` listing every problem.
    `max_lengths`: (prompt, response) token limits the samples must keep to."""
    samples: list[StoredSample] = []
    problems: list[Problem] = []
    for path in paths:
        data_file = path if isinstance(path, DataFile) else DataFile(str(path), str(path))
        file = data_file.name
        try:
            table = pq.read_table(data_file.path, filesystem=data_file.filesystem)
        except (OSError, pa.ArrowInvalid) as e:
            problems.append(Problem(file, None, None, f"not a readable Parquet file ({e})"))
            continue
        missing = [c for c in REQUIRED if c not in table.column_names]
        if missing:
            problems.append(Problem(file, None, None, f"missing columns {missing}"))
            continue
        for row, values in enumerate(table.to_pylist()):
            found = row_problems(values, vocab_size, max_lengths)
            problems += [Problem(file, row, column, message) for column, message in found]
            if not found:
                samples.append(stored_sample(values))
    if problems:
        raise DataError(problems)
    return samples


def stored_sample(values: dict[str, Any]) -> StoredSample:
    """A checked row as a `StoredSample`."""
    truth = values.get("ground_truth")
    return StoredSample(
        uid=values["uid"],
        prompt_ids=values["prompt_ids"],
        response_ids=values["response_ids"],
        rollout_logprobs=values["rollout_logprobs"],
        data_source=values["data_source"],
        response_mask=values.get("response_mask"),
        reward_style=values.get("reward_style") or "rule",
        ground_truth=None if truth is None else json.loads(truth),
        extra_info=json.loads(values.get("extra_info") or "{}"),
        score=values.get("score"),
        policy_version=values.get("policy_version"),
        step=values.get("step"),
        prompt_index=values.get("prompt_index"),
    )


def row_problems(
    values: dict[str, Any], vocab_size: int | None, max_lengths: tuple[int, int] | None = None
) -> list[tuple[str, str]]:
    """(column, what is wrong) for one row."""
    found = [(c, "is null") for c in REQUIRED if values.get(c) is None]
    if found:
        return found
    prompt, response = values["prompt_ids"], values["response_ids"]
    if not prompt:
        found.append(("prompt_ids", "is empty"))
    for column in ("prompt_ids", "response_ids"):
        ids = values[column]
        if vocab_size is not None and any(not 0 <= t < vocab_size for t in ids):
            found.append((column, f"has token ids outside the vocabulary [0, {vocab_size})"))
    names = (("prompt_ids", "max_prompt_length"), ("response_ids", "max_response_length"))
    for (column, key), limit in zip(names, max_lengths or ()):
        if len(values[column]) > limit:
            found.append((column, f"{len(values[column])} tokens, over data.{key}={limit}"))
    logprobs = values["rollout_logprobs"]
    if len(logprobs) != len(response):
        found.append(
            ("rollout_logprobs", f"{len(logprobs)} values for {len(response)} response tokens")
        )
    elif any(not (math.isfinite(x) and x <= 0) for x in logprobs):
        found.append(("rollout_logprobs", "has a value that is not a finite log-prob (<= 0)"))
    mask = values.get("response_mask")
    if mask is not None and (len(mask) != len(response) or not set(mask) <= {0, 1}):
        found.append(("response_mask", "is not one 0/1 per response token"))
    if (values.get("reward_style") or "rule") not in ("rule", "model"):
        found.append(("reward_style", f"is {values['reward_style']!r}, not 'rule' or 'model'"))
    score = values.get("score")
    if score is not None and not math.isfinite(score):
        found.append(("score", f"is {score}"))
    for column in ("ground_truth", "extra_info"):
        if values.get(column) is not None:
            try:
                json.loads(values[column])
            except ValueError:
                found.append((column, "is not JSON"))
    return found
