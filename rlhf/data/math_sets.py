"""MATH-500, DAPO-Math-17k and AIME (their public files, offline) -> prompt Parquet in our schema.

The files as their releases ship them (column names matched case-insensitively):
- MATH-500 (HuggingFaceH4/MATH-500): `test.jsonl` with problem, solution, answer, subject,
  level, unique_id.
- DAPO-Math-17k: BytedTsinghua-SIA's Parquet, already in verl's schema (data_source
  `math_dapo`, a chat prompt that asks for an `Answer:` line, reward_model.ground_truth), or
  open-r1's "Processed" variant (prompt: the problem text, solution: the answer).
- AIME: Maxwell-Jia/AIME_2024 (ID, Problem, Solution, Answer), opencompass's AIME2025
  jsonl (question, answer), math-ai/aime24 (problem, a solution ending in a boxed answer)
  and aime25 (problem, answer), or BytedTsinghua-SIA/AIME-2024 in verl's schema.

A plain record's problem is `problem` or `question`; its answer `answer`, else the last
`\\boxed{}` of `solution` (the caller passes that extractor in: rewards sit above this
layer). Its prompt is the problem and verl's instruction to box the final answer. A record
already in verl's schema keeps its prompt and ground truth (DAPO's prompt asks for the
`Answer:` line, which the math_dapo/aime rule reads as well as boxes). Every record is
converted before anything is written; the first bad one stops the run naming its file,
line or row, and column.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from rlhf.data.gsm8k import read_records
from rlhf.data.parquet import write_rows

INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."
SUFFIXES = (".jsonl", ".json", ".parquet")

AnswerOf = Callable[[str], "str | None"]
"""solution text -> its final (boxed) answer, or None."""


@dataclass(frozen=True)
class MathSet:
    """What one `rlhf-preprocess` command writes: rows of `data_source` to `<split>.parquet`;
    `solution_is_answer`: a `solution` column holds the bare answer (DAPO's Processed), not
    a worked solution ending in a boxed one."""

    data_source: str
    split: str
    solution_is_answer: bool = False


MATH_SETS = {
    "math500": MathSet("HuggingFaceH4/MATH-500", "test"),
    "dapo-math": MathSet("math_dapo", "train", solution_is_answer=True),
    "aime": MathSet("aime", "test"),
}


class RecordError(ValueError):
    """A record that cannot become a row; `column` names the culprit."""

    def __init__(self, column: str, message: str):
        super().__init__(message)
        self.column = column


def _get(record: dict[str, Any], *names: str) -> tuple[str, Any]:
    """(the record's own name, value) of the first of `names` it has (any case)."""
    by_lower = {str(k).lower(): k for k in record}
    for name in names:
        if name in by_lower:
            return by_lower[name], record[by_lower[name]]
    return names[0], None


def _text(value: Any) -> str:
    """An answer or id as text (AIME's answers are integers in some releases)."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return "" if value is None else str(value).strip()


def _messages(prompt: Any) -> list[dict[str, str]] | None:
    """A verl-schema prompt as role/content messages, or None if it is not one."""
    if not isinstance(prompt, list) or not prompt:
        return None
    if not all(isinstance(m, dict) and isinstance(m.get("content"), str) for m in prompt):
        return None
    return [{"role": str(m.get("role") or "user"), "content": m["content"]} for m in prompt]


def _verl_fields(record: dict[str, Any]) -> tuple[list[dict[str, str]], str, str] | None:
    """(prompt, ground truth, id) of a record already in verl's schema; None otherwise."""
    messages = _messages(record.get("prompt"))
    reward_model = record.get("reward_model")
    if messages is None or not isinstance(reward_model, dict):
        return None
    truth = _text(reward_model.get("ground_truth"))
    if not truth:
        raise RecordError("reward_model", "ground_truth is missing or empty")
    extra = record.get("extra_info")
    return messages, truth, _text(extra.get("index")) if isinstance(extra, dict) else ""


def _plain_fields(
    record: dict[str, Any], math_set: MathSet, answer_of: AnswerOf
) -> tuple[list[dict[str, str]], str, str]:
    """(prompt, ground truth, id) of a plain problem/answer record."""
    column, problem = _get(record, "problem", "question", "prompt")
    if not isinstance(problem, str) or not problem.strip():
        raise RecordError(column, "no problem text (a problem, question or prompt column)")
    answer_column, answer = _get(record, "answer", "solution")
    truth = _text(answer)
    if answer_column.lower() == "solution" and not math_set.solution_is_answer:
        truth = _text(answer_of(answer)) if isinstance(answer, str) else ""
    if not truth:
        raise RecordError(answer_column, "no answer (an 'answer' column or a boxed solution)")
    prompt = [{"role": "user", "content": f"{problem.strip()} {INSTRUCTION}"}]
    return prompt, truth, _text(_get(record, "unique_id", "id")[1])


def to_schema_row(
    record: dict[str, Any], math_set: MathSet, index: int, answer_of: AnswerOf
) -> dict[str, Any]:
    """One record as a row of our prompt schema; a RecordError names what is wrong."""
    fields = _verl_fields(record)
    prompt, truth, record_id = fields or _plain_fields(record, math_set, answer_of)
    return {
        "data_source": math_set.data_source,
        "prompt": prompt,
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": truth},
        "extra_info": {
            "split": math_set.split,
            "index": index,
            "id": record_id,
            "subject": _text(_get(record, "subject", "type")[1]),
            "level": _text(_get(record, "level")[1]),
        },
    }


def convert_files(
    files: list[Path], math_set: MathSet, answer_of: AnswerOf
) -> list[dict[str, Any]]:
    """Schema rows for every record of `files`; errors name the file, line/row and column."""
    rows: list[dict[str, Any]] = []
    for path in files:
        for where, record in read_records(path):
            try:
                rows.append(to_schema_row(record, math_set, len(rows), answer_of))
            except RecordError as e:
                raise ValueError(f"{path}: {where}: '{e.column}': {e}") from None
    return rows


def _input_files(inputs: list[str]) -> list[Path]:
    files = []
    for name in inputs:
        path = Path(name).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"--input: {path} is not a file")
        if path.suffix not in SUFFIXES:
            raise ValueError(f"--input: {path}: expected a .jsonl or .parquet file")
        files.append(path)
    return files


def preprocess_math(
    command: str,
    inputs: list[str],
    local_dir: str | Path,
    answer_of: AnswerOf,
    data_source: str | None = None,
) -> dict[str, tuple[Path, int]]:
    """Write `<local_dir>/<split>.parquet` for `command` (a MATH_SETS key) from the `inputs`
    files; `data_source` replaces the set's name. Returns {split: (path, rows)}."""
    math_set = MATH_SETS[command]
    if data_source:
        math_set = replace(math_set, data_source=data_source)
    files = _input_files(inputs)
    rows = convert_files(files, math_set, answer_of)
    if not rows:
        raise ValueError(f"--input: no records in {', '.join(map(str, files))}")
    path = write_rows(rows, Path(local_dir) / f"{math_set.split}.parquet")
    return {math_set.split: (path, len(rows))}
