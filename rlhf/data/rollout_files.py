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
(`rlhf.data.parquet.Problem`), as prompt files are: every value must be of its column's
type (token ids integers, log-probs and scores numbers; a column of the wrong type is named
at its first row, with how many more rows have it). With `vocab_size`, token ids must be
below it (a file written with another tokenizer is caught here, not as garbage training).

A uid names one prompt's group across all the files read together: rows that share a uid
but not their `prompt_ids` are refused (naming both), never merged into one group; a group
may span files. A training run (`RolloutChecks`) also requires every group to have
`actor_rollout_ref.rollout.n` samples and every unscored row to be scorable by its reward
(a data source the reward function knows, a model row only with a reward model).
A row that carries images or videos (`images`/`videos` columns, as prompt files may) is
refused: its token ids hold image placeholders this text-only trainer has no pixels for.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from rlhf.data.files import DataFile
from rlhf.data.parquet import DataError, GroundTruthCheck, Problem, media_problems
from rlhf.utils import atomic_output, field_values

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
        row = field_values(self)
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


IMAGE_PROMPT = (
    "holds image tokens, but stored rollouts keep no pictures (rollouts/step_N.jsonl names "
    "each one's prompt row): train on its prompts instead"
)


@dataclass(frozen=True)
class RolloutChecks:
    """What the reading run requires of stored samples beyond the schema (None: unchecked).

    vocab_size: token ids must be below it; max_lengths: (prompt, response) token limits;
    group_size: samples every uid must have (`actor_rollout_ref.rollout.n`); scorable: the
    reward's check of an unscored rule row's data source and ground truth
    (`rlhf.reward.check_ground_truth`); model_scorer: whether a reward model scores
    unscored `reward_style: model` rows; image_token_id: a vision-language policy's image
    token, which a stored prompt must not hold (its pictures are not stored with it)."""

    vocab_size: int | None = None
    max_lengths: tuple[int, int] | None = None
    group_size: int | None = None
    scorable: GroundTruthCheck | None = None
    model_scorer: bool = True
    image_token_id: int | None = None


def read_rollout_files(
    paths: Sequence[str | os.PathLike | DataFile],
    vocab_size: int | None = None,
    max_lengths: tuple[int, int] | None = None,
    checks: RolloutChecks | None = None,
) -> list[StoredSample]:
    """Every sample of `paths` (local paths, or files `rlhf.data.files.resolve_files`
    resolved: local or remote), in order; raises `DataError` listing every problem.
    `max_lengths`: (prompt, response) token limits the samples must keep to; `checks`
    (which then gives the limits and the vocabulary too): what the run requires."""
    checks = checks or RolloutChecks(vocab_size, max_lengths)
    located: list[tuple[StoredSample, str, int]] = []
    problems: list[Problem] = []
    for path in paths:
        data_file = path if isinstance(path, DataFile) else DataFile(str(path), str(path))
        file_samples, file_problems = read_one_file(data_file, checks)
        located += file_samples
        problems += file_problems
    problems += group_problems(located, checks.group_size)
    if problems:
        raise DataError(problems, "stored rollouts")
    return [sample for sample, _, _ in located]


def read_one_file(
    data_file: DataFile, checks: RolloutChecks
) -> tuple[list[tuple[StoredSample, str, int]], list[Problem]]:
    """The samples of one file with their (file, row), and its problems; a problem of a
    column's type is named at its first row (with how many more rows have it)."""
    file = data_file.name
    try:
        table = pq.read_table(data_file.path, filesystem=data_file.filesystem)
    except (OSError, pa.ArrowInvalid) as e:
        return [], [Problem(file, None, None, f"not a readable Parquet file ({e})")]
    missing = [c for c in REQUIRED if c not in table.column_names]
    if missing:
        return [], [Problem(file, None, None, f"missing columns {missing}")]
    samples: list[tuple[StoredSample, str, int]] = []
    problems: list[Problem] = []
    typed: dict[str, tuple[Problem, int]] = {}  # column -> (first row's problem, rows)
    for row, values in enumerate(table.to_pylist()):
        bad_types = type_problems(values)
        for column, message in bad_types:
            first, rows = typed.get(column, (Problem(file, row, column, message), 0))
            typed[column] = (first, rows + 1)
        bad = {column for column, _ in bad_types}
        clean = {k: None if k in bad else v for k, v in values.items()}
        found = row_problems(clean, checks.vocab_size, checks.max_lengths)
        found = [(column, message) for column, message in found if column not in bad]
        found += media_problems(values, "stored rollouts are text-only")  # another tool's file
        if checks.image_token_id is not None and checks.image_token_id in (
            clean["prompt_ids"] or []
        ):
            found.append(("prompt_ids", IMAGE_PROMPT))
        if not bad and not found:
            found = score_problems(values, checks)
        problems += [Problem(file, row, column, message) for column, message in found]
        if not bad and not found:
            samples.append((stored_sample(values), file, row))
    for first, rows in typed.values():
        more = f" (and {rows - 1} more rows)" if rows > 1 else ""
        problems.append(dataclasses.replace(first, message=first.message + more))
    problems.sort(key=lambda p: -1 if p.row is None else p.row)
    return samples, problems


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _is_str(x: Any) -> bool:
    return isinstance(x, str)


STRING, NUMBER, INTEGER = (_is_str, "a string"), (_is_number, "a number"), (_is_int, "an integer")
SCALARS = {
    **dict.fromkeys(("uid", "data_source", "reward_style", "ground_truth", "extra_info"), STRING),
    "score": NUMBER,
    **dict.fromkeys(("policy_version", "step", "prompt_index"), INTEGER),
}
LISTS = {
    "prompt_ids": (_is_int, "an integer token id"),
    "response_ids": (_is_int, "an integer token id"),
    "rollout_logprobs": NUMBER,
    "response_mask": (_is_int, "0 or 1"),
}


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def type_problems(values: dict[str, Any]) -> list[tuple[str, str]]:
    """(column, what is wrong) for each value of one row that is not of its column's type
    (a string where a number belongs, a float token id, a null inside a list)."""
    found = []
    for column, (ok, what) in SCALARS.items():
        value = values.get(column)
        if value is not None and not ok(value):
            found.append((column, f"is {_shown(value)}, not {what}"))
    for column, (ok, what) in LISTS.items():
        value = values.get(column)
        if value is None:
            continue
        if not isinstance(value, list):
            found.append((column, f"is {_shown(value)}, not a list"))
        elif bad := [x for x in value if not ok(x)]:
            found.append((column, f"has {_shown(bad[0])}, not {what}"))
    return found


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
        outside = [t for t in values[column] if vocab_size is not None and not 0 <= t < vocab_size]
        if outside:
            found.append(
                (column, f"has token id {outside[0]}, outside the vocabulary [0, {vocab_size})")
            )
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
                decoded = json.loads(values[column])
            except ValueError:
                found.append((column, "is not JSON"))
                continue
            if column == "extra_info" and not isinstance(decoded, dict):
                found.append((column, "is not a JSON object"))
    return found


def score_problems(values: dict[str, Any], checks: RolloutChecks) -> list[tuple[str, str]]:
    """(column, why) when the run cannot score an unscored row: a rule row's data source
    or ground truth the reward function cannot score, a model row without a reward model."""
    if values.get("score") is not None:
        return []
    if (values.get("reward_style") or "rule") == "model":
        if checks.model_scorer:
            return []
        return [("score", "is null on a reward_style 'model' row and reward.model_path is unset")]
    if checks.scorable is None:
        return []
    truth = values.get("ground_truth")
    found = checks.scorable(values["data_source"], None if truth is None else json.loads(truth))
    if found is None:
        return []
    column, message = found
    return [(column if column == "data_source" else "ground_truth", message)]


def group_problems(
    located: Sequence[tuple[StoredSample, str, int]], group_size: int | None
) -> list[Problem]:
    """Problems of the prompt groups across all files: a uid shared by different prompts
    (which would be trained as one group), named at its first row of another prompt; with
    `group_size`, a group of another size, named at its first row."""
    groups: dict[str, list[tuple[StoredSample, str, int]]] = {}
    for item in located:
        groups.setdefault(item[0].uid, []).append(item)
    problems = []
    for uid, members in groups.items():
        head, file, row = members[0]
        other = next((m for m in members if m[0].prompt_ids != head.prompt_ids), None)
        if other is not None:
            problems.append(
                Problem(
                    other[1],
                    other[2],
                    "uid",
                    f"{uid!r} is also the uid of another prompt ({file}, row {row}): a uid "
                    "names one prompt's group, give each prompt its own",
                )
            )
        elif group_size is not None and len(members) != group_size:
            where = list(dict.fromkeys(f for _, f, _ in members))
            spread = f" in {len(where)} files ({', '.join(where)})" if len(where) > 1 else ""
            problems.append(
                Problem(
                    file,
                    row,
                    "uid",
                    f"group {uid!r} has {len(members)} samples{spread}, not "
                    f"actor_rollout_ref.rollout.n={group_size}: a step's prompt groups have n "
                    "samples each (GRPO and RLOO compare them; mini-batches count n a prompt)",
                )
            )
    return problems
