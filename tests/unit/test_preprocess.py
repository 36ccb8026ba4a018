"""rlhf-preprocess: GSM8K conversion (jsonl and Parquet layouts), quickstart data, check."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlhf.cli.preprocess import main
from rlhf.data.gsm8k import DATA_SOURCE, INSTRUCTION, extract_ground_truth, preprocess_gsm8k
from rlhf.data.parquet import read_prompt_rows

# Original-format records (our own text): question, and a worked answer ending in "#### N".
RECORDS = {
    "train": [
        {"question": "Tom buys 3 pens at $2 each. What does he pay?", "answer": "3*2=6\n#### 6"},
        {"question": "A farm has 1,200 hens and sells 5.", "answer": "1200-5=1195\n#### 1,195"},
        {"question": "It was 4 degrees, then fell by 9.", "answer": "4-9=-5\n#### -5"},
    ],
    "test": [{"question": "Half of 7?", "answer": "7/2 = 3.5\n#### 3.5"}],
}


def write_jsonl(path, records):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def test_ground_truth_extraction():
    assert extract_ground_truth("a #### 1,195") == "1195"
    assert extract_ground_truth("x #### 2 #### -5 ") == "-5"
    assert extract_ground_truth("no marker") is None and extract_ground_truth("#### ") is None


def test_gsm8k_jsonl_release_to_schema(tmp_path):
    for split, records in RECORDS.items():
        write_jsonl(tmp_path / "grade_school_math" / "data" / f"{split}.jsonl", records)
    written = preprocess_gsm8k(tmp_path / "grade_school_math", tmp_path / "out")
    assert {s: n for s, (_, n) in written.items()} == {"train": 3, "test": 1}
    rows = read_prompt_rows(str(tmp_path / "out" / "train.parquet"))
    assert [r.ground_truth for r in rows] == ["6", "1195", "-5"]
    first = rows[0]
    assert first.data_source == DATA_SOURCE == "openai/gsm8k" and first.ability == "math"
    assert first.prompt == [
        {"role": "user", "content": f"{RECORDS['train'][0]['question']} {INSTRUCTION}"}
    ]
    assert first.extra_info == {
        "split": "train",
        "index": 0,
        "question": RECORDS["train"][0]["question"],
        "answer": RECORDS["train"][0]["answer"],
    }
    (test_row,) = read_prompt_rows(str(tmp_path / "out" / "test.parquet"))
    assert test_row.ground_truth == "3.5" and test_row.extra_info["split"] == "test"


def test_gsm8k_hf_parquet_layout_and_single_file(tmp_path):
    main_dir = tmp_path / "gsm8k" / "main"
    main_dir.mkdir(parents=True)
    for split, records in RECORDS.items():
        pq.write_table(pa.Table.from_pylist(records), main_dir / f"{split}-00000-of-00001.parquet")
    written = preprocess_gsm8k(main_dir, tmp_path / "out")
    assert sorted(written) == ["test", "train"]
    single = preprocess_gsm8k(main_dir / "test-00000-of-00001.parquet", tmp_path / "single")
    assert list(single) == ["test"] and single["test"][1] == 1
    socratic = tmp_path / "gsm8k" / "socratic"
    socratic.mkdir()
    pq.write_table(pa.Table.from_pylist(RECORDS["train"]), socratic / "train-0.parquet")
    with pytest.raises(ValueError, match="train files in several folders"):
        preprocess_gsm8k(tmp_path / "gsm8k", tmp_path / "out2")


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (
            '{"question": "q", "answer": "no final line"}\n',
            "line 1: 'answer': answer has no '#### N'",
        ),
        ('{"question": "q", "answer": "#### 1"}\n{"answer": "#### 2"}\n', "line 2: 'question' is"),
        ('{"question": "q", "answer": "#### 1"}\n{not json\n', "line 2: not valid JSON"),
    ],
)
def test_gsm8k_input_errors_name_file_and_line(tmp_path, content, message):
    path = tmp_path / "train.jsonl"
    path.write_text(content)
    with pytest.raises(ValueError, match=message) as err:
        preprocess_gsm8k(path, tmp_path / "out")
    assert str(path) in str(err.value)


def test_cli_gsm8k_and_input_errors(tmp_path, capsys):
    write_jsonl(tmp_path / "in" / "train.jsonl", RECORDS["train"])
    assert main(["gsm8k", "--input", str(tmp_path / "in"), "--local_dir", str(tmp_path / "o")]) == 0
    assert f"wrote train: {tmp_path / 'o' / 'train.parquet'} (3 rows)" in capsys.readouterr().out
    assert main(["gsm8k", "--input", str(tmp_path / "nope"), "--local_dir", str(tmp_path)]) == 2
    assert "rlhf-preprocess: error: --input:" in capsys.readouterr().err
    (tmp_path / "odd.jsonl").write_text("{}")
    assert main(["gsm8k", "--input", str(tmp_path / "odd.jsonl"), "--local_dir", "x"]) == 2
    assert "cannot tell the split" in capsys.readouterr().err


def test_cli_quickstart_then_check_passes(tmp_path, capsys):
    out = tmp_path / "qs"
    assert main(["quickstart", "--local_dir", str(out), "--num_train", "9", "--num_val", "2"]) == 0
    capsys.readouterr()
    assert main(["check", str(out / "*.parquet")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines == [
        f"{out / 'train.parquet'}: 9 rows; data sources: arithmetic (9)",
        f"{out / 'val.parquet'}: 2 rows; data sources: arithmetic (2)",
    ]


def test_cli_check_prints_every_problem_and_fails(tmp_path, capsys):
    good = tmp_path / "good.parquet"
    main(["quickstart", "--local_dir", str(tmp_path), "--num_train", "2", "--num_val", "1"])
    (tmp_path / "train.parquet").rename(good)
    rows = read_prompt_rows(str(good))
    bad_rows = [
        {"data_source": "gsm8k", "prompt": None, "reward_model": r.reward_model} for r in rows
    ]
    bad = tmp_path / "bad.parquet"
    pq.write_table(pa.Table.from_pylist(bad_rows), bad)
    (tmp_path / "text.parquet").write_text("hello")
    capsys.readouterr()
    code = main(["check", str(good), str(bad), str(tmp_path / "text.parquet"), "/no/such.parquet"])
    out, err = capsys.readouterr()
    assert code == 1
    assert out == f"{good}: 2 rows; data sources: arithmetic (2)\n"
    assert f"{bad}: row 0, column 'prompt': null prompt" in err
    assert f"{bad}: row 1, column 'prompt': null prompt" in err
    assert f"{tmp_path / 'text.parquet'}: not a Parquet file" in err
    assert "/no/such.parquet: file not found: '/no/such.parquet'" in err
    assert err.strip().endswith("4 problem(s) in 3 of 4 file(s)")
