"""GSM8K (original files, offline) -> prompt Parquet in our schema.

Accepts what people actually have on disk: the GitHub release (`train.jsonl`, `test.jsonl`)
or the HF dataset's Parquet shards (`main/train-00000-of-00001.parquet`, ...), as a
directory or a single file. Each answer ends in `#### N`; N (commas removed) becomes the
rule reward's ground truth, and the question gets an instruction asking for that format.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from rlhf.data.parquet import write_rows

DATA_SOURCE = "openai/gsm8k"
INSTRUCTION = 'Reason step by step, then write the final answer as a number after "####".'
SPLITS = ("train", "test")
SUFFIXES = (".jsonl", ".parquet")


def extract_ground_truth(answer: str) -> str | None:
    """The number after the last `####` of a GSM8K answer, without commas; None if absent."""
    if "####" not in answer:
        return None
    value = answer.rsplit("####", 1)[1].strip().replace(",", "")
    return value or None


def _split_of(path: Path) -> str | None:
    return next((s for s in SPLITS if path.name.startswith(s)), None)


def find_split_files(input_path: str | Path) -> dict[str, list[Path]]:
    """{split: files} under a directory (recursively) or for one file, checked for ambiguity."""
    path = Path(input_path).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"--input: {path} does not exist")
    if path.is_file():
        split = _split_of(path)
        if split is None or path.suffix not in SUFFIXES:
            raise ValueError(
                f"--input: cannot tell the split of {path}: give a .jsonl or .parquet file whose "
                "name starts with 'train' or 'test', or the directory holding them"
            )
        return {split: [path]}
    found: dict[str, list[Path]] = {}
    for file in sorted(p for p in path.rglob("*") if p.suffix in SUFFIXES and p.is_file()):
        split = _split_of(file)
        if split:
            found.setdefault(split, []).append(file)
    if not found:
        raise FileNotFoundError(
            f"--input: no train*/test* .jsonl or .parquet files under {path} "
            "(expected the GSM8K release, e.g. train.jsonl and test.jsonl)"
        )
    for split, files in found.items():
        folders = sorted({str(f.parent) for f in files})
        if len(folders) > 1:
            raise ValueError(
                f"--input: {split} files in several folders ({', '.join(folders)}), e.g. the "
                "'main' and 'socratic' variants; pass the one folder to use"
            )
    return found


def read_records(path: Path) -> list[tuple[str, dict[str, Any]]]:
    """(location, record) pairs; location is 'line N' (jsonl, from 1) or 'row N' (Parquet)."""
    if path.suffix == ".parquet":
        try:
            table = pq.read_table(path)
        except (pa.ArrowInvalid, OSError) as e:
            raise ValueError(f"{path}: not a Parquet file ({str(e).splitlines()[0]})") from None
        return [(f"row {i}", r) for i, r in enumerate(table.to_pylist())]
    records = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: line {n}: not valid JSON ({e.msg})") from None
        if not isinstance(record, dict):
            raise ValueError(f"{path}: line {n}: expected a JSON object")
        records.append((f"line {n}", record))
    return records


def to_schema_row(question: str, answer: str, split: str, index: int) -> dict[str, Any]:
    """One GSM8K problem as a row of our prompt schema (the answer must contain `####`)."""
    truth = extract_ground_truth(answer)
    if truth is None:
        raise ValueError("answer has no '#### N' final line")
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": f"{question.strip()} {INSTRUCTION}"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": truth},
        "extra_info": {"split": split, "index": index, "question": question, "answer": answer},
    }


def convert_split(files: list[Path], split: str) -> list[dict[str, Any]]:
    """Schema rows for all records of one split; errors name the file and line/row."""
    rows: list[dict[str, Any]] = []
    for path in files:
        for where, record in read_records(path):
            question, answer = record.get("question"), record.get("answer")
            for name, value in (("question", question), ("answer", answer)):
                if not isinstance(value, str) or not value.strip():
                    raise ValueError(f"{path}: {where}: '{name}' is missing or empty")
            assert isinstance(question, str) and isinstance(answer, str)
            try:
                rows.append(to_schema_row(question, answer, split, len(rows)))
            except ValueError as e:
                raise ValueError(f"{path}: {where}: 'answer': {e}") from None
    return rows


def preprocess_gsm8k(input_path: str | Path, local_dir: str | Path) -> dict[str, tuple[Path, int]]:
    """Write `<local_dir>/<split>.parquet` for each split found; returns {split: (path, rows)}.

    Every split is converted before any is written, so a bad record in one split leaves the
    files of a previous run as they were instead of a new train beside an old test file.
    """
    splits = {}
    for split, files in sorted(find_split_files(input_path).items()):
        splits[split] = convert_split(files, split)
        if not splits[split]:
            raise ValueError(f"--input: the {split} files hold no records: {files}")
    out = Path(local_dir)
    return {s: (write_rows(rows, out / f"{s}.parquet"), len(rows)) for s, rows in splits.items()}
