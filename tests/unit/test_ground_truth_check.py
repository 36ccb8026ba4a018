"""Unscorable rule rows are data errors: found by `rlhf-preprocess check` and at training load.

A gsm8k ground truth of `['4']` or `"five"` used to score every answer 0, and an unknown
data_source failed only at reward time; now both name file, row and column before a run.
"""

from __future__ import annotations

import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlhf.cli.preprocess import main
from rlhf.config import load_config
from rlhf.data.parquet import DataError, read_prompt_rows
from rlhf.data.prompts import prompt_dataset_from_config
from rlhf.quickstart.tokenizer import build_tiny_tokenizer
from rlhf.reward import registry
from rlhf.reward.registry import check_ground_truth, compute_score, ground_truth_checker

pytestmark = pytest.mark.reliability

PROBLEM_LINE = re.compile(r"^(.+): row (\d+), column '(\w+)': (.+)$")


def row(data_source: str, ground_truth, style: str = "rule") -> dict:
    return {
        "data_source": data_source,
        "prompt": [{"role": "user", "content": "What is 2 + 2?"}],
        "reward_model": {"style": style, "ground_truth": ground_truth},
    }


def write(path, rows: list[dict]) -> str:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


@pytest.fixture
def bad_files(tmp_path):
    """Two files (a Parquet column has one type, so list ground truths get their own) and the
    (file, row, column) of every problem they hold; the style=model rows are not checked."""
    lists = write(
        tmp_path / "lists.parquet",
        [row("judge", ["a"], "model"), row("gsm8k", ["4"]), row("judge", None, "model")],
    )
    strings = write(
        tmp_path / "strings.parquet",
        [
            row("gsm8k", "1,200"),
            row("gsm8k", "five"),
            row("gsm8kk", "4"),
            row("math", "\\frac{1}{2}"),
            row("math", " "),
            row("judge/helpfulness", "anything", "model"),
        ],
    )
    expected = {
        (lists, 1, "reward_model"),
        (strings, 1, "reward_model"),
        (strings, 2, "data_source"),
        (strings, 4, "reward_model"),
    }
    return lists, strings, expected


def config(tmp_path, train_files: str, *overrides: str):
    return load_config(
        "configs/quickstart_cpu.yaml",
        [f"data.train_files={train_files}", "data.max_prompt_length=512", *overrides],
    )


def custom_fn_file(tmp_path) -> str:
    path = tmp_path / "my_reward.py"
    path.write_text(
        "def score(data_source, solution_str, ground_truth, extra_info):\n    return 0.0\n"
    )
    return f"{path}:score"


def test_check_cli_names_file_row_and_column_of_each_bad_row(bad_files, capsys):
    lists, strings, expected = bad_files
    assert main(["check", lists, strings]) == 1
    out, err = capsys.readouterr()
    assert out == ""
    lines = err.strip().splitlines()
    matches = [PROBLEM_LINE.match(line) for line in lines[:-1]]
    assert all(matches), lines
    found = {(m.group(1), int(m.group(2)), m.group(3)): m.group(4) for m in matches if m}
    assert set(found) == expected
    assert found[(lists, 1, "reward_model")].startswith("ground_truth ['4'] of data_source")
    assert "a list, not a number" in found[(lists, 1, "reward_model")]
    assert "'five' of data_source 'gsm8k': not a number" in found[(strings, 1, "reward_model")]
    unknown = found[(strings, 2, "data_source")]
    assert "data_source 'gsm8kk' (did you mean 'gsm8k'?)" in unknown
    assert all(source in unknown for source in registry.known_sources())
    assert "empty" in found[(strings, 4, "reward_model")]
    assert lines[-1] == "4 problem(s) in 2 of 2 file(s)"


def test_training_loader_raises_data_error_naming_the_bad_rows(tmp_path, bad_files):
    lists, strings, expected = bad_files
    cfg = config(tmp_path, strings)
    check = ground_truth_checker(cfg.reward)
    with pytest.raises(DataError) as err:
        read_prompt_rows([lists, strings], check_ground_truth=check)
    assert {(p.file, p.row, p.column) for p in err.value.problems} == expected
    assert f"{strings}: row 2, column 'data_source': no rule reward" in str(err.value)
    with pytest.raises(DataError) as err:
        prompt_dataset_from_config(
            cfg.data, build_tiny_tokenizer(), "train", check_ground_truth=check
        )
    assert {(p.row, p.column) for p in err.value.problems} == {
        (r, c) for f, r, c in expected if f == strings
    }


def test_skip_bad_rows_keeps_exactly_the_scorable_ones(bad_files):
    _, strings, _ = bad_files
    kept = read_prompt_rows(strings, bad_rows="skip", check_ground_truth=check_ground_truth)
    assert [r.row for r in kept] == [0, 3, 5]


def test_valid_files_pass_both_paths(tmp_path, capsys):
    text = write(
        tmp_path / "text.parquet",
        [row("gsm8k", "1,200"), row("openai/gsm8k", "$-3.50"), row("math", "\\sqrt{2}")],
    )
    numbers = write(tmp_path / "numbers.parquet", [row("arithmetic", 4), row("gsm8k", 12)])
    floats = write(tmp_path / "floats.parquet", [row("gsm8k", 2.5), row("math", 0.5)])
    assert main(["check", text, numbers, floats]) == 0
    assert capsys.readouterr().out.splitlines() == [
        f"{text}: 3 rows; data sources: gsm8k (1), math (1), openai/gsm8k (1)",
        f"{numbers}: 2 rows; data sources: arithmetic (1), gsm8k (1)",
        f"{floats}: 2 rows; data sources: gsm8k (1), math (1)",
    ]
    rows = read_prompt_rows([text, numbers, floats], check_ground_truth=check_ground_truth)
    assert [(r.file, r.row) for r in rows][:3] == [(text, 0), (text, 1), (text, 2)]
    assert len(rows) == 7


def test_custom_fn_accepts_any_source_and_ground_truth(tmp_path, bad_files, capsys):
    lists, strings, _ = bad_files
    spec = custom_fn_file(tmp_path)
    cfg = config(tmp_path, strings, f"reward.custom_fn={spec}")
    check = ground_truth_checker(cfg.reward)
    assert check is None
    rows = read_prompt_rows([lists, strings], check_ground_truth=check)
    assert [(r.file, r.row) for r in rows] == [(lists, i) for i in range(3)] + [
        (strings, i) for i in range(6)
    ]
    assert (rows[1].ground_truth, rows[4].ground_truth) == (["4"], "five")
    assert rows[5].data_source == "gsm8kk"
    assert len(prompt_dataset_from_config(cfg.data, build_tiny_tokenizer(), "train")) == 6
    assert main(["check", lists, strings, "--custom_fn", spec]) == 0
    assert f"{strings}: 6 rows;" in capsys.readouterr().out
    assert main(["check", strings, "--custom_fn", f"{tmp_path}/nope.py:score"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("rlhf-preprocess: error: reward.custom_fn: file not found")
    assert len(err.splitlines()) == 1


@pytest.mark.parametrize(
    ("data_source", "ground_truth"),
    [
        ("gsm8k", "1,200"),
        ("openai/gsm8k", 7),
        ("arithmetic", -2.5),
        ("gsm8k", "$1,200.00"),
        ("gsm8k", " 42 "),
    ],
)
def test_accepted_gsm8k_ground_truths_can_score_one(data_source, ground_truth):
    """The check uses the rule's own normalisation: what it accepts, a right answer matches."""
    assert check_ground_truth(data_source, ground_truth) is None
    answer = str(ground_truth).strip().lstrip("$")  # "#### $5" has no answer, as in verl
    assert compute_score(data_source, f"#### {answer}", ground_truth) == 1.0


@pytest.mark.parametrize(
    ("data_source", "ground_truth", "says"),
    [
        ("gsm8k", "five", "not a number"),
        ("gsm8k", ["4"], "a list, not a number"),
        ("gsm8k", True, "a bool, not a number"),
        ("gsm8k", "nan", "not a number"),
        ("arithmetic", {"answer": 4}, "a dict, not a number"),
        ("math", "", "empty"),
        ("math", ["x"], "a list; the math rule needs"),
        ("math", False, "a bool; the math rule needs"),
    ],
)
def test_rejected_ground_truths_say_why(data_source, ground_truth, says):
    column, message = check_ground_truth(data_source, ground_truth) or ("", "")
    assert column == "reward_model"
    assert message.startswith(f"ground_truth {ground_truth!r} of data_source {data_source!r}: ")
    assert says in message


def test_math_accepts_latex_and_numbers():
    for truth in ("\\frac{1}{2}", "x = 5", 3, 0.25):
        assert check_ground_truth("math", truth) is None


def test_unknown_source_suggests_the_nearest_and_matches_reward_time_error():
    column, message = check_ground_truth("openai/gsm8K", "4") or ("", "")
    assert column == "data_source"
    assert "(did you mean 'openai/gsm8k'?)" in message
    with pytest.raises(ValueError) as err:
        compute_score("openai/gsm8K", "#### 4", "4")
    assert str(err.value) == message
    _, far = check_ground_truth("my/dataset", "4") or ("", "")
    assert "did you mean" not in far and "reward.custom_fn" in far


def test_registered_rule_declares_its_own_check(monkeypatch):
    monkeypatch.setattr(registry, "_RULES", dict(registry._RULES))
    monkeypatch.setattr(registry, "_TRUTH_CHECKS", dict(registry._TRUTH_CHECKS))
    monkeypatch.setattr(registry, "_ANSWERS", dict(registry._ANSWERS))
    rule = lambda solution, truth, settings: 0.0  # noqa: E731
    registry.register_rule("letters", rule, check=lambda t: None if t in "abcd" else "not a-d")
    assert check_ground_truth("letters", "b") is None
    assert check_ground_truth("letters", "z") == (
        "reward_model",
        "ground_truth 'z' of data_source 'letters': not a-d",
    )
    registry.register_rule("letters", rule)  # no check: the rule takes any ground truth
    assert check_ground_truth("letters", "z") is None
    registry.register_rule("gsm8k", rule)  # re-registering replaces the old check too
    assert check_ground_truth("gsm8k", "five") is None
