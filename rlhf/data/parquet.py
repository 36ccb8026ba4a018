"""Prompt Parquet files in verl's schema: reading, validation that names file/row/column, writing.

A bad row found mid-run (a null prompt at row 91,000) would waste the run that reaches it, so
every file is checked completely when it is loaded and each problem says where it is. The
same checks back `rlhf-preprocess check`. Schema (one row per prompt):

| column | type | required |
|---|---|---|
| `data_source` | string, selects the reward function | yes |
| `prompt` (`data.prompt_key`) | list of {role, content} messages, or a string | yes |
| `reward_model` | {style: 'rule' or 'model', ground_truth} | yes |
| `ability` | string | no ('' when absent) |
| `extra_info` | struct, passed to reward functions | no ({} when absent) |
| `images` | the row's images (`rlhf.data.images`), for a vision-language policy only | no |
| `videos` | must be null or empty: a row that carries any is refused | no |

Multi-turn rows (`actor_rollout_ref.rollout.multi_turn`) may carry, in `extra_info`,
`tools_kwargs`: {tool name: mapping}, each mapping handed as it is to that tool's `create`
(`rlhf.tools.base.Tool`) for the sample's state, e.g. {"calculator": {"create_kwargs":
{...}}} in verl's layout; a null entry means none (Parquet fills the names other rows use
with null). `need_tools_kwargs: true` says the row cannot go without them: such a row with
no `tools_kwargs` is a problem, as is a `tools_kwargs` that is not such a mapping.

A text model given a row with images (verl's `images` column of a vision-language set)
would train on its prompt's text alone, its `<image>` placeholders and all, without a
word: such a row is a problem unless the policy takes images (`takes_images`; each image
is then read and checked, `rlhf.data.images`). Videos are refused for every model, and
stored rollouts and preference pairs are text-only (`media_problems`). A set that mixes
them trains on its text rows only with `data.bad_rows=skip`, and says how many it skipped.

Row numbers count from 0, as in pyarrow and pandas. File-level problems (not Parquet, empty,
a missing or wrongly typed column) are always errors; `bad_rows="skip"` skips only bad rows.

A row can be well-formed and still unscorable: a data source no reward function knows, or a
ground truth its rule cannot compare (`['4']` for gsm8k scores every answer 0). The reward
registry sits above this layer, so callers pass its check in (`check_ground_truth`, from
`rlhf.reward.ground_truth_checker`); it runs on every `style: rule` row.
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from rlhf.config.choices import BadRows
from rlhf.data.files import DataFile, resolve_files
from rlhf.data.images import row_images
from rlhf.errors import UserError
from rlhf.utils import atomic_output

log = logging.getLogger(__name__)

REWARD_STYLES = ("rule", "model")
MEDIA_COLUMNS = ("images", "videos")  # verl's data.image_key / data.video_key defaults
MAX_PROBLEMS_IN_MESSAGE = 20

GroundTruthCheck = Callable[[str, Any], "tuple[str, str] | None"]
"""(data_source, ground_truth) -> (column, what is wrong), or None when the row can be scored."""


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a data file; `row`/`column` are None when not row/column-specific."""

    file: str
    row: int | None
    column: str | None
    message: str

    def __str__(self) -> str:
        where = [f"row {self.row}"] if self.row is not None else []
        where += [f"column '{self.column}'"] if self.column is not None else []
        return f"{self.file}: {', '.join(where) + ': ' if where else ''}{self.message}"


class DataError(ValueError, UserError):
    """Invalid data; `problems` lists every problem found, `what` names the data ("prompt
    data", "preference data", "stored rollouts") in the message."""

    def __init__(self, problems: Sequence[Problem], what: str = "prompt data"):
        self.problems = list(problems)
        lines = [str(p) for p in self.problems[:MAX_PROBLEMS_IN_MESSAGE]]
        if len(self.problems) > MAX_PROBLEMS_IN_MESSAGE:
            lines.append(f"... and {len(self.problems) - MAX_PROBLEMS_IN_MESSAGE} more")
        super().__init__(f"invalid {what}:\n  " + "\n  ".join(lines))


@dataclass(frozen=True)
class PromptRow:
    """One validated prompt row, and where it came from."""

    data_source: str
    prompt: str | list[dict[str, str]]
    reward_model: dict[str, Any]
    ability: str = ""
    extra_info: dict[str, Any] = field(default_factory=dict)
    file: str = ""
    row: int = -1
    images: tuple[bytes, ...] = ()  # encoded image files, in the prompt's placeholder order

    @property
    def style(self) -> str:
        return self.reward_model["style"]

    @property
    def ground_truth(self) -> Any:
        return self.reward_model.get("ground_truth")

    @property
    def tools_kwargs(self) -> dict[str, dict[str, Any]]:
        """`extra_info.tools_kwargs` by tool name, null entries left out ({} when none)."""
        return _tools_kwargs(self.extra_info.get("tools_kwargs"))

    @property
    def origin(self) -> str:
        """Where it came from, for messages ("row 12 of train.parquet"; "" when unknown)."""
        return f"row {self.row} of {self.file}" if self.file else ""

    def scored_by_model(self) -> PromptRow:
        """The row with reward_model.style 'model' (`reward.model_scores_every_row`)."""
        return replace(self, reward_model={**self.reward_model, "style": "model"})


@dataclass
class FileReport:
    """What one file holds: valid rows per data source, and its problems."""

    file: str
    num_rows: int = 0
    data_sources: Counter = field(default_factory=Counter)
    problems: list[Problem] = field(default_factory=list)


def _is_str(tp: pa.DataType) -> bool:
    return pa.types.is_string(tp) or pa.types.is_large_string(tp) or pa.types.is_null(tp)


def _is_messages(tp: pa.DataType) -> bool:
    if not (pa.types.is_list(tp) or pa.types.is_large_list(tp)):
        return False
    item = tp.value_type
    return pa.types.is_struct(item) and {"role", "content"} <= {f.name for f in item}


def _column_problems(schema: pa.Schema, prompt_key: str) -> list[tuple[str, str]]:
    """(column, message) for every missing or wrongly typed column."""
    expected = {
        "data_source": (_is_str, "a string"),
        prompt_key: (
            lambda t: _is_str(t) or _is_messages(t),
            "a string or a list of {role, content} messages",
        ),
        "reward_model": (
            lambda t: pa.types.is_struct(t) and {"style", "ground_truth"} <= {f.name for f in t},
            "a struct {style, ground_truth}",
        ),
        "ability": (_is_str, "a string"),
        "extra_info": (
            lambda t: pa.types.is_struct(t) or pa.types.is_map(t) or pa.types.is_null(t),
            "a struct (dict)",
        ),
    }
    problems = []
    for column, (ok, what) in expected.items():
        if column not in schema.names:
            if column in ("ability", "extra_info"):
                continue
            problems.append((column, f"missing column (the file has: {', '.join(schema.names)})"))
        elif not ok(schema.field(column).type):
            problems.append((column, f"wrong type {schema.field(column).type}; expected {what}"))
    return problems


# What chat templates render (OpenAI's roles; `tool` for tool results).
CHAT_ROLES = ("system", "user", "assistant", "tool")


def _prompt_problem(prompt: Any) -> str | None:
    if prompt is None:
        return "null prompt"
    if isinstance(prompt, str):
        return "empty prompt" if not prompt.strip() else None
    if not prompt:
        return "empty prompt (no messages)"
    for i, message in enumerate(prompt):
        if message is None:
            return f"message {i} is null"
        for part in ("role", "content"):
            if not isinstance(message.get(part), str):
                return f"message {i} has no {part}"
        if message["role"] not in CHAT_ROLES:
            return f"message {i} has role {message['role']!r}; chat roles are {CHAT_ROLES}"
    if not any(m["content"].strip() for m in prompt):
        return "empty prompt (every message has empty content)"
    return None


def _mapping(value: Any) -> Any:
    """A Parquet map arrives as (key, value) pairs: as a dict; anything else as it is."""
    if isinstance(value, list) and all(isinstance(p, tuple) and len(p) == 2 for p in value):
        return dict(value)
    return value


def _tools_kwargs(value: Any) -> dict[str, dict[str, Any]]:
    """`extra_info.tools_kwargs` (checked by `_tools_kwargs_problem`) without null entries."""
    entries = _mapping(value) or {}
    return {name: _mapping(kw) for name, kw in entries.items() if kw is not None}


def _tools_kwargs_problem(extra: Any) -> str | None:
    """What is wrong with a row's `extra_info.tools_kwargs` / `need_tools_kwargs`, if any."""
    extra = _mapping(extra)
    if not isinstance(extra, dict):
        return None
    need, value = extra.get("need_tools_kwargs"), extra.get("tools_kwargs")
    if need not in (None, True, False):
        return f"need_tools_kwargs must be true or false, got {need!r}"
    entries = _mapping(value)
    if entries is not None and not (
        isinstance(entries, dict)
        and all(v is None or isinstance(_mapping(v), dict) for v in entries.values())
    ):
        shown = repr(value)[:100]
        return f"tools_kwargs must map each tool's name to a mapping of its arguments, got {shown}"
    if need and not _tools_kwargs(entries):
        return "need_tools_kwargs is true but the row has no tools_kwargs (tool name -> arguments)"
    return None


def _carries(value: Any) -> bool:
    return not (value is None or (isinstance(value, list | dict | str | bytes) and not value))


def media_problems(
    values: dict[str, Any], why: str = "this data is text-only"
) -> list[tuple[str, str]]:
    """(column, message) for each of a row's image and video columns that carries some, a
    row that cannot take them (`why`, see the module)."""
    found = []
    for column in MEDIA_COLUMNS:
        value = values.get(column)
        if not _carries(value):
            continue
        n = len(value) if isinstance(value, list) else None
        count = column if n is None else f"{n} {column if n > 1 else column[:-1]}"
        found.append((column, f"carries {count}; {why}: drop the column or these rows"))
    return found


TEXT_POLICY = "the policy is a text model (a vision-language one, qwen2_5_vl, takes images)"


def _prompt_media(
    values: dict[str, Any], prompt_key: str, takes_images: bool, folder: Path | None
) -> tuple[tuple[bytes, ...], list[tuple[str, str]]]:
    """A prompt row's images and the problems of its media columns (see the module)."""
    if not takes_images:
        return (), media_problems(values, TEXT_POLICY)
    found = media_problems({"videos": values.get("videos")}, "videos are not supported")
    images, problem = row_images(values.get("images"), values[prompt_key], folder)
    return images, found + ([("images", problem)] if problem else [])


def _row_problems(
    values: dict[str, Any], prompt_key: str, check: GroundTruthCheck | None = None
) -> list[tuple[str, str]]:
    """The problems of a row's text columns (its media: `_prompt_media`)."""
    problems = []
    source = values["data_source"]
    if source is None or not source.strip():
        what = "null" if source is None else "empty"
        problems.append(("data_source", f"{what} data_source"))
    message = _prompt_problem(values[prompt_key])
    if message:
        problems.append((prompt_key, message))
    reward = values["reward_model"]
    if reward is None:
        problems.append(("reward_model", "null reward_model"))
    elif reward.get("style") not in REWARD_STYLES:
        style = reward.get("style")
        problems.append(("reward_model", f"style must be 'rule' or 'model', got {style!r}"))
    elif reward["style"] == "rule" and reward.get("ground_truth") is None:
        problems.append(("reward_model", "null ground_truth (style 'rule' needs one)"))
    elif reward["style"] == "rule" and check is not None and source and source.strip():
        found = check(source, reward["ground_truth"])
        problems += [found] if found else []
    tools = _tools_kwargs_problem(values.get("extra_info"))
    if tools:
        problems.append(("extra_info", tools))
    return problems


def _make_row(
    values: dict[str, Any], prompt_key: str, file: str, row: int, images: tuple[bytes, ...]
) -> PromptRow:
    extra = values.get("extra_info") or {}
    if isinstance(extra, list):  # a Parquet map arrives as (key, value) pairs
        extra = dict(extra)
    return PromptRow(
        data_source=values["data_source"],
        prompt=values[prompt_key],
        reward_model=dict(values["reward_model"]),
        ability=values.get("ability") or "",
        extra_info=extra,
        file=file,
        row=row,
        images=images,
    )


def _read_table(data_file: DataFile, report: FileReport) -> pa.Table | None:
    def fail(message: str) -> None:
        report.problems.append(Problem(data_file.name, None, None, message))

    try:
        if data_file.size() == 0:
            fail("file is empty (0 bytes)")
            return None
        table = pq.read_table(data_file.path, filesystem=data_file.filesystem)
    except (pa.ArrowInvalid, OSError) as e:
        fail(f"not a Parquet file ({str(e).splitlines()[0]})")
        return None
    if table.num_rows == 0:
        fail("file has no rows")
        return None
    return table


def read_file(
    data_file: DataFile,
    prompt_key: str = "prompt",
    check_ground_truth: GroundTruthCheck | None = None,
    takes_images: bool = False,
) -> tuple[list[PromptRow], FileReport]:
    """Every valid row of one file, and the file's report (with every problem found);
    `takes_images`: the policy is a vision-language model (see the module)."""
    report = FileReport(data_file.name)
    table = _read_table(data_file, report)
    if table is None:
        return [], report
    for column, message in _column_problems(table.schema, prompt_key):
        report.problems.append(Problem(data_file.name, None, column, message))
    if report.problems:
        return [], report
    rows = []
    folder = Path(data_file.path).parent if data_file.filesystem is None else None
    for i, values in enumerate(table.to_pylist()):
        found = _row_problems(values, prompt_key, check_ground_truth)
        images, media = _prompt_media(values, prompt_key, takes_images, folder)
        found += media
        report.problems.extend(Problem(data_file.name, i, c, m) for c, m in found)
        if not found:
            rows.append(_make_row(values, prompt_key, data_file.name, i, images))
            report.data_sources[values["data_source"]] += 1
    report.num_rows = len(rows)
    return rows, report


def check_files(
    spec: str | Sequence[str],
    prompt_key: str = "prompt",
    key: str = "data.train_files",
    check_ground_truth: GroundTruthCheck | None = None,
    takes_images: bool = False,
) -> list[FileReport]:
    """A report per file named by `spec` (path, list, glob or URI)."""
    return [
        read_file(f, prompt_key, check_ground_truth, takes_images)[1]
        for f in resolve_files(spec, key)
    ]


def read_prompt_rows(
    spec: str | Sequence[str] | None,
    *,
    prompt_key: str = "prompt",
    bad_rows: BadRows = "error",
    key: str = "data.train_files",
    check_ground_truth: GroundTruthCheck | None = None,
    takes_images: bool = False,
) -> list[PromptRow]:
    """Valid rows of every file named by `spec`; raises `DataError` listing every problem.

    With `bad_rows="skip"` bad rows are dropped (count and the first few logged); problems
    with a whole file still raise. `key` is the config key named in messages;
    `check_ground_truth` (None: not checked) judges each rule row's source and ground truth;
    `takes_images`: the policy is a vision-language model (see the module).
    """
    rows: list[PromptRow] = []
    fatal: list[Problem] = []
    skipped: list[Problem] = []
    for data_file in resolve_files(spec, key):
        file_rows, report = read_file(data_file, prompt_key, check_ground_truth, takes_images)
        rows.extend(file_rows)
        for problem in report.problems:
            (fatal if problem.row is None or bad_rows == "error" else skipped).append(problem)
    if fatal:
        raise DataError(fatal)
    if skipped:
        bad = len({(p.file, p.row) for p in skipped})
        first = "; ".join(str(p) for p in skipped[:5])
        log.warning("%s: skipped %d invalid rows (data.bad_rows=skip); first: %s", key, bad, first)
    if not rows:
        left = Problem(key, None, None, f"no valid rows left ({len(skipped)} problems skipped)")
        raise DataError([left, *skipped])
    return rows


def write_rows(rows: Sequence[dict[str, Any]], path: str | os.PathLike) -> Path:
    """Write schema rows (dicts) to a Parquet file atomically: a write that fails leaves no
    file at `path` and a file already there untouched (`rlhf.utils.atomic_output`)."""
    path = Path(path)
    table = pa.Table.from_pylist(list(rows))
    with atomic_output(path) as tmp:
        pq.write_table(table, tmp)
    return path
