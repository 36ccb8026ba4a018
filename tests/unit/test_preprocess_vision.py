"""rlhf-preprocess for vision-language sets: Geometry3K's Parquet release (our own records in
its layout: `images` as HF datasets writes them, `problem` with an `<image>` placeholder,
`answer`) -> verl's geo3k rows, read back with their pictures; the vision quickstart's
pictures; `check --images`; geo3k's score as verl's (0.9 x right + 0.1 x format)."""

from __future__ import annotations

import io

import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image

from rlhf.cli.preprocess import main
from rlhf.config.schema import RewardConfig
from rlhf.data.geo3k import DATA_SOURCE, INSTRUCTION
from rlhf.data.parquet import read_prompt_rows
from rlhf.reward import RewardInput, RewardScorer


def png(colour) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (30, 20), colour).save(buffer, format="PNG")
    return buffer.getvalue()


RELEASE = {
    "train": [
        {
            "images": [{"bytes": png((1, 2, 3)), "path": "a.png"}],
            "problem": "<image>Find x.",
            "answer": "3",
        },
        {
            "images": [{"bytes": png((9, 9, 9)), "path": "b.png"}],
            "problem": "<image>Find y.",
            "answer": "\\frac{1}{2}",
        },
    ],
    "test": [
        {
            "images": [{"bytes": png((5, 5, 5)), "path": "c.png"}],
            "problem": "<image>Find z.",
            "answer": "7",
        }
    ],
}


def write_release(root):
    (root / "data").mkdir(parents=True)
    for split, records in RELEASE.items():
        pq.write_table(
            pa.Table.from_pylist(records), root / "data" / f"{split}-00000-of-00001.parquet"
        )


def test_geo3k_release_becomes_verl_rows_with_their_pictures(tmp_path, capsys):
    write_release(tmp_path / "geometry3k")
    out = tmp_path / "geo3k"
    assert main(["geo3k", "--input", str(tmp_path / "geometry3k"), "--local_dir", str(out)]) == 0
    train = read_prompt_rows(str(out / "train.parquet"), takes_images=True)
    assert [r.data_source for r in train] == [DATA_SOURCE] * 2
    assert train[0].prompt == [{"role": "user", "content": f"<image>Find x. {INSTRUCTION}"}]
    assert train[0].images == (png((1, 2, 3)),) and train[1].ground_truth == "\\frac{1}{2}"
    capsys.readouterr()
    assert main(["check", "--images", str(out / "test.parquet")]) == 0
    assert capsys.readouterr().out.strip().endswith(f"1 rows; data sources: {DATA_SOURCE} (1)")
    assert main(["check", str(out / "test.parquet")]) == 1  # a text policy's check


def test_a_broken_picture_stops_the_conversion_naming_its_row(tmp_path, capsys):
    records = [
        {**RELEASE["train"][0]},
        {**RELEASE["train"][1], "images": [{"bytes": b"no", "path": None}]},
    ]
    (tmp_path / "in").mkdir()
    pq.write_table(pa.Table.from_pylist(records), tmp_path / "in" / "train-0.parquet")
    assert main(["geo3k", "--input", str(tmp_path / "in"), "--local_dir", str(tmp_path / "o")]) == 2
    assert (
        "train-0.parquet: row 1, column 'images': image 0: not an image" in capsys.readouterr().err
    )
    assert not (tmp_path / "o").exists()


def test_geo3k_is_scored_as_verl_scores_it():
    scorer = RewardScorer.from_config(RewardConfig())
    answers = [
        ("<think>x = 3</think> so \\boxed{3}", 1.0),  # right and in form
        ("\\boxed{3}", 0.9),  # right, no <think>
        ("<think>hm</think> \\boxed{4}", 0.1),  # wrong, in form
        ("no answer", 0.0),
    ]
    inputs = [RewardInput(DATA_SOURCE, text, "3", {}) for text, _ in answers]
    assert scorer(inputs) == [score for _, score in answers]


def test_vision_quickstart_pictures_pass_the_image_check(tmp_path, capsys):
    out = tmp_path / "vlm"
    assert (
        main(["quickstart-vlm", "--local_dir", str(out), "--num_train", "6", "--num_val", "2"]) == 0
    )
    rows = read_prompt_rows(str(out / "train.parquet"), takes_images=True)
    assert all(len(r.images) == 1 and r.ground_truth in ("1", "2", "3") for r in rows)
