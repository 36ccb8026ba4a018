"""Geometry3K (hiyouga/geometry3k, its Parquet release, offline) -> prompt Parquet with images.

The release's rows hold `images` (a list of {bytes, path}: the diagram), `problem` (the
question, with an `<image>` placeholder where the diagram goes) and `answer`. Each becomes a
row in verl's layout for its geo3k example: data_source `hiyouga/geometry3k`, the problem
followed by verl's instruction to think inside <think> tags and box the answer, the images
as they are, the answer as the rule's ground truth (scored as verl scores geo3k:
`rlhf.reward.registry`). Every row is checked (`rlhf.data.parquet`, images decoded) before
anything is written; the first bad record stops the run naming its file and row.
"""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq

from rlhf.data.images import IMAGE_PLACEHOLDER, row_images
from rlhf.data.parquet import write_rows

DATA_SOURCE = "hiyouga/geometry3k"
INSTRUCTION = (
    "You FIRST think about the reasoning process as an internal monologue and then provide "
    "the final answer. The reasoning process MUST BE enclosed within <think> </think> tags. "
    "The final answer MUST BE put in \\boxed{}."
)
SPLITS = ("train", "validation", "test")


def geo3k_row(record: dict, split: str, index: int, where: str) -> dict:
    """One release record as a prompt row (ValueError naming `where` when it cannot be)."""
    problem, answer, images = record.get("problem"), record.get("answer"), record.get("images")
    if not isinstance(problem, str) or not problem.strip():
        raise ValueError(f"{where}, column 'problem': missing or empty")
    if answer is None or not str(answer).strip():
        raise ValueError(f"{where}, column 'answer': missing or empty")
    if not images:
        raise ValueError(f"{where}, column 'images': no image")
    if IMAGE_PLACEHOLDER not in problem:  # the release puts one; keep a row usable anyway
        problem = IMAGE_PLACEHOLDER * len(images) + problem
    _, wrong = row_images(images, problem, None)
    if wrong:
        raise ValueError(f"{where}, column 'images': {wrong}")
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": f"{problem} {INSTRUCTION}"}],
        "images": images,
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": str(answer)},
        "extra_info": {"split": split, "index": index, "answer": str(answer), "question": problem},
    }


def split_of(path: Path) -> str:
    """The split a release file holds, from its name (`train-00000-of-00001.parquet`)."""
    for split in SPLITS:
        if path.name.startswith(split):
            return split
    raise ValueError(f"{path}: not a train, validation or test file of the release")


def preprocess_geo3k(inputs: list[str], local_dir: str) -> dict[str, tuple[Path, int]]:
    """The release's files (or the folder holding them) -> `<split>.parquet` in `local_dir`;
    {split: (written file, rows)}."""
    files = []
    for item in inputs:
        path = Path(item)
        files += sorted(path.rglob("*.parquet")) if path.is_dir() else [path]
    if not files:
        raise ValueError(f"no Parquet files in {', '.join(inputs)}")
    rows: dict[str, list[dict]] = {}
    for path in files:
        split = split_of(path)
        for i, record in enumerate(pq.read_table(path).to_pylist()):
            index = len(rows.setdefault(split, []))
            rows[split].append(geo3k_row(record, split, index, f"{path}: row {i}"))
    out = Path(local_dir)
    return {s: (write_rows(r, out / f"{s}.parquet"), len(r)) for s, r in rows.items()}
