"""rlhf-preprocess math500 / dapo-math / aime on small files in the releases' formats (our own
problems), then `check` on the Parquet and the rule rewards on the ground truths."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlhf.cli.preprocess import main
from rlhf.data.math_sets import INSTRUCTION
from rlhf.data.parquet import read_prompt_rows
from rlhf.reward import compute_score

# HuggingFaceH4/MATH-500's test.jsonl: problem, solution, answer, subject, level, unique_id
MATH500 = [
    {
        "problem": "Convert the point $(0,3)$ to polar coordinates.",
        "solution": "The radius is 3 and the angle $\\frac{\\pi}{2}$, so $\\boxed{(3,"
        " \\frac{\\pi}{2})}$.",
        "answer": "\\left( 3, \\frac{\\pi}{2} \\right)",
        "subject": "Precalculus",
        "level": 2,
        "unique_id": "test/precalculus/1.json",
    },
    {
        "problem": "What is $\\frac{7}{3} \\cdot 2$?",
        "solution": "It is $\\boxed{\\frac{14}{3}}$.",
        "answer": "\\frac{14}{3}",
        "subject": "Prealgebra",
        "level": 1,
        "unique_id": "test/prealgebra/2.json",
    },
    {
        "problem": "Solve $2x + 1 > 5$.",
        "solution": "So $x \\in \\boxed{(2, \\infty)}$.",
        "answer": "(2,\\infty)",
        "subject": "Algebra",
        "level": 2,
        "unique_id": "test/algebra/3.json",
    },
]

# BytedTsinghua-SIA/DAPO-Math-17k: verl's schema, a prompt asking for an "Answer:" line
DAPO_PROMPT = (
    "Solve the problem. Put the answer on the last line as Answer: $Answer.\n\n{}\n\n"
    'Remember the line "Answer:".'
)
DAPO = [
    {
        "data_source": "math_dapo",
        "prompt": [
            {"content": DAPO_PROMPT.format("How many primes are below 20?"), "role": "user"}
        ],
        "ability": "MATH",
        "reward_model": {"ground_truth": "8", "style": "rule-lighteval/MATH_v2"},
        "extra_info": {"index": "0d3c-aa"},
    },
    {
        "data_source": "math_dapo",
        "prompt": [{"content": DAPO_PROMPT.format("What is 12 squared?"), "role": "user"}],
        "ability": "MATH",
        "reward_model": {"ground_truth": "144", "style": "rule-lighteval/MATH_v2"},
        "extra_info": {"index": "91fe-07"},
    },
]


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def write_parquet(path, records):
    pq.write_table(pa.Table.from_pylist(records), path)
    return str(path)


def convert(*args: str) -> list:
    """Run the CLI, check its Parquet like training would, and return the rows."""
    assert main(list(args)) == 0
    out = args[args.index("--local_dir") + 1]
    written = f"{out}/train.parquet" if args[0] == "dapo-math" else f"{out}/test.parquet"
    assert main(["check", written]) == 0
    return read_prompt_rows(written)


def assert_ground_truths_score(rows, response: str) -> None:
    """A response giving each row's ground truth (boxed or on an Answer line) scores 1; a
    wrong one does not."""
    for row in rows:
        answer = response.format(row.ground_truth)
        assert compute_score(row.data_source, answer, row.ground_truth) == 1.0, row
        wrong = compute_score(row.data_source, response.format("123456"), row.ground_truth)
        dapo = row.data_source == "math_dapo" or row.data_source.startswith("aime")
        assert wrong == (-1.0 if dapo else 0.0)  # verl's scores


def test_math500_jsonl(tmp_path, capsys):
    rows = convert(
        "math500",
        "--input",
        write_jsonl(tmp_path / "test.jsonl", MATH500),
        "--local_dir",
        f"{tmp_path}/o",
    )
    assert "wrote test:" in capsys.readouterr().out
    assert [r.ground_truth for r in rows] == [m["answer"] for m in MATH500]
    first = rows[0]
    assert first.data_source == "HuggingFaceH4/MATH-500" and first.style == "rule"
    assert first.prompt == [{"role": "user", "content": f"{MATH500[0]['problem']} {INSTRUCTION}"}]
    assert first.extra_info == {
        "split": "test",
        "index": 0,
        "id": "test/precalculus/1.json",
        "subject": "Precalculus",
        "level": "2",
    }
    assert_ground_truths_score(rows, "Thinking first... so the answer is $\\boxed{{{}}}$.")
    # the model's own words for the first answer (no \left/\right) score too
    assert compute_score(first.data_source, r"\boxed{(3, \frac{\pi}{2})}", first.ground_truth) == 1


def test_math500_parquet_and_answers_from_solutions(tmp_path):
    without_answer = [{k: v for k, v in m.items() if k != "answer"} for m in MATH500]
    rows = convert(
        "math500",
        "--input",
        write_parquet(tmp_path / "test.parquet", without_answer),
        "--local_dir",
        f"{tmp_path}/o",
    )
    assert [r.ground_truth for r in rows] == [
        "(3, \\frac{\\pi}{2})",
        "\\frac{14}{3}",
        "(2, \\infty)",
    ]
    assert_ground_truths_score(rows, "$\\boxed{{{}}}$")


def test_dapo_verl_schema_keeps_its_prompt(tmp_path):
    rows = convert(
        "dapo-math",
        "--input",
        write_parquet(tmp_path / "dapo-math-17k.parquet", DAPO),
        "--local_dir",
        f"{tmp_path}/o",
    )
    assert [(r.data_source, r.ground_truth, r.style) for r in rows] == [
        ("math_dapo", "8", "rule"),
        ("math_dapo", "144", "rule"),
    ]
    assert rows[1].prompt == DAPO[1]["prompt"] and rows[1].extra_info["id"] == "91fe-07"
    assert_ground_truths_score(rows, "Counting them all.\nAnswer: {}")
    assert_ground_truths_score(rows, "Counting them all: \\boxed{{{}}}")


def test_dapo_processed_variant(tmp_path):
    processed = [
        {"prompt": "How many primes are below 20?", "solution": "8", "data_source": "math_dapo"},
        {"prompt": "What is 12 squared?", "solution": "144", "data_source": "math_dapo"},
    ]
    rows = convert(
        "dapo-math",
        "--input",
        write_parquet(tmp_path / "p.parquet", processed),
        "--local_dir",
        f"{tmp_path}/o",
    )
    assert [r.ground_truth for r in rows] == ["8", "144"]
    assert rows[0].prompt[0]["content"] == f"How many primes are below 20? {INSTRUCTION}"
    assert_ground_truths_score(rows, "\\boxed{{{}}}")


def test_aime_releases_in_one_file_set(tmp_path):
    maxwell = [  # Maxwell-Jia/AIME_2024: ID, Problem, Solution, Answer (an integer)
        {"ID": "2024-I-1", "Problem": "Find 3 + 4 times 5.", "Solution": "It is 23.", "Answer": 23},
        {"ID": "2024-I-2", "Problem": "Find 2^5.", "Solution": "32", "Answer": 32},
    ]
    opencompass = [{"question": "Find 10 - 3.", "answer": "7"}]  # AIME2025 jsonl
    math_ai = [{"id": 60, "problem": "Find 6 * 7.", "solution": "So $\\boxed{042}$."}]  # aime24
    rows = convert(
        "aime",
        "--input",
        write_parquet(tmp_path / "aime_2024_problems.parquet", maxwell),
        write_jsonl(tmp_path / "aime2025-I.jsonl", opencompass),
        write_jsonl(tmp_path / "aime24.jsonl", math_ai),
        "--local_dir",
        f"{tmp_path}/o",
        "--data_source",
        "aime24",
    )
    assert [(r.ground_truth, r.extra_info["id"]) for r in rows] == [
        ("23", "2024-I-1"),
        ("32", "2024-I-2"),
        ("7", ""),
        ("042", "60"),
    ]
    assert {r.data_source for r in rows} == {"aime24"}
    assert [r.extra_info["index"] for r in rows] == [0, 1, 2, 3]
    assert_ground_truths_score(rows, "\\boxed{{{}}}")
    assert_ground_truths_score(rows, "Answer: {}")
    assert compute_score("aime24", "\\boxed{42}", "042") == 1.0  # AIME's three digits


@pytest.mark.parametrize(
    ("command", "records", "message"),
    [
        (
            "math500",
            [MATH500[0], {"problem": "Q", "solution": "no box"}],
            "line 2: 'solution': no answer",
        ),
        ("math500", [{"question": "", "answer": "1"}], "line 1: 'question': no problem text"),
        ("aime", [{"Problem": "Q", "Answer": None}], "line 1: 'Answer': no answer"),
        (
            "dapo-math",
            [{**DAPO[0], "reward_model": {"ground_truth": ""}}],
            "line 1: 'reward_model': ground_truth",
        ),
    ],
)
def test_bad_records_name_file_line_and_column(tmp_path, capsys, command, records, message):
    path = write_jsonl(tmp_path / "in.jsonl", records)
    assert main([command, "--input", path, "--local_dir", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"rlhf-preprocess: error: {path}: ") and message in err, err
    assert not (tmp_path / "o").exists()  # nothing written


def test_input_and_name_errors(tmp_path, capsys):
    assert main(["aime", "--input", str(tmp_path / "none.jsonl"), "--local_dir", "o"]) == 2
    assert "is not a file" in capsys.readouterr().err
    path = write_jsonl(tmp_path / "a.jsonl", [{"question": "Q", "answer": "1"}])
    assert main(["aime", "--input", path, "--local_dir", "o", "--data_source", "AIME"]) == 2
    assert "must start with 'aime'" in capsys.readouterr().err
    (tmp_path / "a.csv").write_text("x")
    assert main(["math500", "--input", str(tmp_path / "a.csv"), "--local_dir", "o"]) == 2
    assert "expected a .jsonl or .parquet file" in capsys.readouterr().err
