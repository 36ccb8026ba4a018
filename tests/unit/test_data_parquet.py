"""Prompt Parquet: file specs (path, list, glob, URI) and one test per validation message."""

from __future__ import annotations

import io
import logging
import uuid

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from rlhf.data.parquet import DataError, read_prompt_rows, write_rows
from rlhf.quickstart.data import write_quickstart_data


def row(**changes):
    base = {
        "data_source": "arithmetic",
        "prompt": [{"role": "user", "content": "What is 2 + 2?"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": "4"},
        "extra_info": {"index": 0},
    }
    return {**base, **changes}


def write(path, rows_or_table):
    table = rows_or_table
    if isinstance(rows_or_table, list):
        table = pa.Table.from_pylist(rows_or_table)
    pq.write_table(table, path)
    return str(path)


def test_valid_rows_round_trip_with_sources_and_extra_info(tmp_path):
    train, val = write_quickstart_data(tmp_path, num_train=12, num_val=4, seed=3)
    rows = read_prompt_rows(str(train))
    assert len(rows) == 12 and len(read_prompt_rows(str(val))) == 4
    first = rows[0]
    assert first.data_source == "arithmetic" and first.style == "rule"
    assert first.prompt[0]["role"] == "user" and first.prompt[0]["content"].endswith("####.")
    assert first.extra_info == {"index": 0, "split": "train"}
    assert (first.file, first.row) == (str(train), 0)
    assert int(first.ground_truth) >= 0


def test_string_prompt_and_custom_prompt_key(tmp_path):
    path = write(tmp_path / "a.parquet", [{**row(question="Add 1 and 2."), "prompt": None}])
    (only,) = read_prompt_rows(path, prompt_key="question")
    assert only.prompt == "Add 1 and 2."


IMAGE = {"path": "cat.png", "bytes": b"\x89PNG"}


def test_rows_with_images_or_videos_are_refused_for_a_text_policy(tmp_path):
    """verl's vision-language rows (`images`, `videos`) would train a text model on their
    text alone; a row without any (null, or an empty list) is a text row;
    `data.bad_rows=skip` keeps the text rows of a mixed set."""
    rows = [
        {**row(), "images": [IMAGE, IMAGE], "videos": None},
        {**row(), "images": [], "videos": None},
        {**row(), "images": None, "videos": [{"path": "clip.mp4", "bytes": b"\x00"}]},
        {**row(), "images": None, "videos": []},
    ]
    path = write(tmp_path / "vlm.parquet", rows)
    with pytest.raises(DataError) as err:
        read_prompt_rows(path)
    found = [(p.row, p.column) for p in err.value.problems]
    assert found == [(0, "images"), (2, "videos")]
    assert (
        f"{path}: row 0, column 'images': carries 2 images; the policy is a text model (a "
        "vision-language one, qwen2_5_vl, takes images): drop the column or these rows"
    ) in str(err.value)
    assert [r.row for r in read_prompt_rows(path, bad_rows="skip")] == [1, 3]


def png(color: tuple[int, int, int], size=(20, 10)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, color).save(buffer, format="PNG")
    return buffer.getvalue()


def test_a_vision_language_policy_reads_images_as_verl_writes_them(tmp_path):
    """Bytes, HF datasets' {bytes, path} struct, a path beside the Parquet file and an
    absolute one each give the image's file; `<image>` placeholders count the images."""
    (tmp_path / "red.png").write_bytes(png((255, 0, 0)))
    two = [{"role": "user", "content": "<image> then <image>: which is red?"}]
    structs = [
        {**row(prompt=two), "images": [{"bytes": png((0, 0, 255)), "path": None}] * 2},
        {**row(prompt=two), "images": [{"bytes": None, "path": "red.png"}] * 2},
        {**row(), "images": None},  # a text row of the same set
    ]
    first, second, text = read_prompt_rows(
        write(tmp_path / "a.parquet", structs), takes_images=True
    )
    assert len(first.images) == 2 and text.images == ()
    assert Image.open(io.BytesIO(first.images[0])).getpixel((0, 0)) == (0, 0, 255)
    assert second.images == (png((255, 0, 0)),) * 2
    paths = [{**row(prompt=two), "images": ["red.png", str(tmp_path / "red.png")]}]
    (by_path,) = read_prompt_rows(write(tmp_path / "b.parquet", paths), takes_images=True)
    assert by_path.images == second.images
    as_bytes = [{**row(prompt=two), "images": [png((255, 0, 0))] * 2}]
    (raw,) = read_prompt_rows(write(tmp_path / "c.parquet", as_bytes), takes_images=True)
    assert raw.images == second.images


@pytest.mark.parametrize(
    "images, prompt, message",
    [
        ([{"bytes": b"\x89PNG", "path": None}], "<image> ?", "image 0: not an image"),
        (["missing.png"], "<image> ?", "image 0: no image file at"),
        ([png((1, 2, 3))], "no placeholder", "1 images but the prompt has 0 <image> placeholders"),
        ([], "<image> ?", "0 images but the prompt has 1 <image> placeholders"),
    ],
)
def test_bad_images_are_named_by_file_row_and_column(tmp_path, images, prompt, message):
    message_list = [{"role": "user", "content": prompt}]
    rows = [{**row(), "images": None}, {**row(prompt=message_list), "images": images}]
    path = write(tmp_path / "bad.parquet", rows)
    with pytest.raises(DataError) as err:
        read_prompt_rows(path, takes_images=True)
    assert f"{path}: row 1, column 'images': {message}" in str(err.value)


def test_videos_are_refused_for_a_vision_language_policy_too(tmp_path):
    clip = [{"path": "clip.mp4", "bytes": b"\x00"}]
    path = write(tmp_path / "v.parquet", [{**row(), "images": None, "videos": clip}])
    with pytest.raises(DataError, match="row 0, column 'videos': carries 1 video; videos are not"):
        read_prompt_rows(path, takes_images=True)


def test_optional_columns_may_be_absent(tmp_path):
    rows = [{k: v for k, v in row().items() if k not in ("ability", "extra_info")}]
    (only,) = read_prompt_rows(write(tmp_path / "a.parquet", rows))
    assert only.ability == "" and only.extra_info == {}


def test_tools_kwargs_reach_the_row_by_tool_name(tmp_path):
    """Parquet gives every row each tool name some row uses (null where the row has none):
    a row's `tools_kwargs` are its own; one that needs them and has only nulls is refused."""
    rows = [
        row(extra_info={"need_tools_kwargs": True, "tools_kwargs": {"calculator": {"x": 1}}}),
        row(extra_info={"need_tools_kwargs": True, "tools_kwargs": {"sandbox": {"y": 2}}}),
        row(extra_info={"need_tools_kwargs": False}),
        row(extra_info={"need_tools_kwargs": True, "tools_kwargs": {}}),
    ]
    path = write(tmp_path / "tools.parquet", rows[:3])
    first, second, third = read_prompt_rows(path)
    assert first.extra_info["tools_kwargs"] == {"calculator": {"x": 1}, "sandbox": None}
    assert first.tools_kwargs == {"calculator": {"x": 1}}
    assert (second.tools_kwargs, third.tools_kwargs) == ({"sandbox": {"y": 2}}, {})
    path = write(tmp_path / "tools.parquet", [rows[0], rows[3]])  # row 1: all names null
    with pytest.raises(DataError) as err:
        read_prompt_rows(path)
    assert [(p.row, p.column) for p in err.value.problems] == [(1, "extra_info")]


def test_list_glob_and_file_uri_keep_order(tmp_path):
    for name in ("b", "a", "c"):
        write(tmp_path / f"{name}.parquet", [row(data_source=name)])
    by_glob = read_prompt_rows(str(tmp_path / "*.parquet"))
    assert [r.data_source for r in by_glob] == ["a", "b", "c"]
    listed = read_prompt_rows([str(tmp_path / "c.parquet"), f"file://{tmp_path}/a.parquet"])
    assert [r.data_source for r in listed] == ["c", "a"]


def test_fsspec_uri_with_glob():
    fsspec = pytest.importorskip("fsspec")
    fs, root = fsspec.filesystem("memory"), f"/rlhf-test-{uuid.uuid4().hex}"
    try:
        for name in ("x", "y"):
            with fs.open(f"{root}/{name}.parquet", "wb") as f:
                pq.write_table(pa.Table.from_pylist([row(data_source=name)]), f)
        rows = read_prompt_rows(f"memory://{root}/*.parquet")
        assert [r.data_source for r in rows] == ["x", "y"]
        assert rows[0].file == f"memory://{root}/x.parquet"
    finally:
        fs.rm(root, recursive=True)


@pytest.mark.parametrize(
    ("spec", "error", "message"),
    [
        (None, ValueError, "data.train_files is not set"),
        ([], ValueError, "data.train_files is an empty list"),
        ("{tmp}/missing.parquet", FileNotFoundError, "data.train_files: file not found"),
        ("{tmp}/*.nothing", FileNotFoundError, "no file matches the glob"),
        ("{tmp}", ValueError, "is a directory; give a file or a glob such as"),
        ("nosuchfs://bucket/a.parquet", ValueError, "cannot open 'nosuchfs://bucket/a.parquet'"),
    ],
)
def test_file_spec_errors_name_the_key(tmp_path, spec, error, message):
    if isinstance(spec, str):
        spec = spec.format(tmp=tmp_path)
    with pytest.raises(error, match=message.replace("(", r"\(").replace("*", r"\*")):
        read_prompt_rows(spec)


def _table_with(column, array):
    rows = [row(), row()]
    table = pa.Table.from_pylist(rows)
    return table.set_column(table.schema.get_field_index(column), column, array)


CASES = {
    "missing column": (
        [{k: v for k, v in row().items() if k != "reward_model"}],
        "column 'reward_model': missing column (the file has: data_source, prompt, ability",
    ),
    "null prompt": ([row(), row(prompt=None)], "row 1, column 'prompt': null prompt"),
    "blank string prompt": ([row(prompt="  ")], "row 0, column 'prompt': empty prompt"),
    "no messages": ([row(prompt=[]), row()], "row 0, column 'prompt': empty prompt (no messages)"),
    "message without content": (
        [row(prompt=[{"role": "user", "content": None}])],
        "row 0, column 'prompt': message 0 has no content",
    ),
    "unknown chat role": (
        [row(), row(prompt=[{"role": "robot", "content": "2 + 2?"}])],
        "row 1, column 'prompt': message 0 has role 'robot'; chat roles are ('system', 'user',",
    ),
    "all contents empty": (
        [row(prompt=[{"role": "user", "content": ""}])],
        "row 0, column 'prompt': empty prompt (every message has empty content)",
    ),
    "prompt of wrong type": (
        _table_with("prompt", pa.array([1, 2])),
        "column 'prompt': wrong type int64; expected a string or a list of {role, content}",
    ),
    "reward_model of wrong type": (
        _table_with("reward_model", pa.array(["4", "5"])),
        "column 'reward_model': wrong type string; expected a struct {style, ground_truth}",
    ),
    "data_source of wrong type": (
        _table_with("data_source", pa.array([1.5, 2.5])),
        "column 'data_source': wrong type double; expected a string",
    ),
    "null data_source": ([row(data_source=None)], "row 0, column 'data_source': null data_source"),
    "empty data_source": ([row(data_source="")], "row 0, column 'data_source': empty data_source"),
    "unknown style": (
        [row(reward_model={"style": "human", "ground_truth": "4"})],
        "row 0, column 'reward_model': style must be 'rule' or 'model', got 'human'",
    ),
    "rule without ground truth": (
        [row(reward_model={"style": "rule", "ground_truth": None})],
        "row 0, column 'reward_model': null ground_truth (style 'rule' needs one)",
    ),
    "null reward_model": (
        [row(), row(reward_model=None)],
        "row 1, column 'reward_model': null reward_model",
    ),
    "tools needed, none given": (
        [row(), row(extra_info={"index": 1, "need_tools_kwargs": True})],
        "row 1, column 'extra_info': need_tools_kwargs is true but the row has no tools_kwargs",
    ),
    "tools_kwargs not by tool name": (
        [row(extra_info={"need_tools_kwargs": True, "tools_kwargs": {"calculator": "4"}})],
        "row 0, column 'extra_info': tools_kwargs must map each tool's name to a mapping of "
        "its arguments, got {'calculator': '4'}",
    ),
    "need_tools_kwargs not a boolean": (
        [row(extra_info={"need_tools_kwargs": "yes"})],
        "row 0, column 'extra_info': need_tools_kwargs must be true or false, got 'yes'",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_each_validation_error_names_file_row_and_column(tmp_path, case):
    content, message = CASES[case]
    path = write(tmp_path / "bad.parquet", content)
    with pytest.raises(DataError) as err:
        read_prompt_rows(path)
    assert f"{path}: {message}" in str(err.value)


def test_empty_file_no_rows_and_not_parquet(tmp_path):
    empty = tmp_path / "empty.parquet"
    empty.write_bytes(b"")
    no_rows = write(tmp_path / "none.parquet", pa.Table.from_pylist([row()]).slice(0, 0))
    text = tmp_path / "notes.parquet"
    text.write_text("question,answer\n1,2\n")
    expected = {
        str(empty): "file is empty (0 bytes)",
        no_rows: "file has no rows",
        str(text): "not a Parquet file (",
    }
    for path, message in expected.items():
        with pytest.raises(DataError, match=r"invalid prompt data") as err:
            read_prompt_rows(path)
        assert f"{path}: {message}" in str(err.value)


def test_every_problem_is_reported(tmp_path):
    rows = [row(prompt=None), row(), row(data_source=None, prompt=[])]
    path = write(tmp_path / "bad.parquet", rows)
    with pytest.raises(DataError) as err:
        read_prompt_rows(path)
    found = [(p.row, p.column) for p in err.value.problems]
    assert found == [(0, "prompt"), (2, "data_source"), (2, "prompt")]


def test_bad_rows_skip_logs_count_and_first_rows(tmp_path, caplog):
    rows = [row(prompt=None), row(), row(data_source=""), row(), row()]
    path = write(tmp_path / "mixed.parquet", rows)
    with caplog.at_level(logging.WARNING, logger="rlhf.data.parquet"):
        kept = read_prompt_rows(path, bad_rows="skip")
    assert [r.row for r in kept] == [1, 3, 4]
    assert "skipped 2 invalid rows (data.bad_rows=skip)" in caplog.text
    assert f"{path}: row 0, column 'prompt': null prompt" in caplog.text


def test_bad_rows_skip_still_fails_on_file_problems(tmp_path):
    good = write(tmp_path / "good.parquet", [row()])
    broken = tmp_path / "broken.parquet"
    broken.write_text("not parquet")
    with pytest.raises(DataError, match=r"broken\.parquet: not a Parquet file"):
        read_prompt_rows([good, str(broken)], bad_rows="skip")
    with pytest.raises(ValueError, match="no valid rows left"):
        read_prompt_rows(write(tmp_path / "all_bad.parquet", [row(prompt=None)]), bad_rows="skip")


def test_write_rows_is_atomic_and_readable(tmp_path):
    out = write_rows([row(), row(data_source="gsm8k")], tmp_path / "sub" / "rows.parquet")
    assert [p.name for p in out.parent.iterdir()] == ["rows.parquet"]
    assert [r.data_source for r in read_prompt_rows(str(out))] == ["arithmetic", "gsm8k"]
