"""Preprocessing outputs appear whole or not at all; a good file already there survives.

`rlhf-preprocess gsm8k|quickstart` write through `rlhf.data.parquet.write_rows`, which
writes a hidden temp file beside the output and renames it into place when complete
(`rlhf.utils.atomic_output`). The failures here are made to happen half-way.
"""

from __future__ import annotations

import json
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlhf.cli.preprocess import main
from rlhf.data.parquet import read_prompt_rows, write_rows
from rlhf.quickstart.data import write_quickstart_data
from rlhf.utils import atomic_output
from tests.helpers import small_filesystem

pytestmark = pytest.mark.reliability


def write_half_then_fail(original):
    """A pq.write_table that writes half the rows to the file, then fails as a full disk."""

    def write(table, where, **kwargs):
        original(table.slice(0, max(1, table.num_rows // 2)), where, **kwargs)
        raise OSError(28, "No space left on device")

    return write


def test_failed_write_leaves_no_file_and_no_temp(tmp_path, monkeypatch):
    monkeypatch.setattr(pq, "write_table", write_half_then_fail(pq.write_table))
    out = tmp_path / "out"
    with pytest.raises(OSError, match="No space left"):
        write_quickstart_data(out, num_train=8, num_val=2)
    assert list(out.iterdir()) == []


def test_failed_write_keeps_the_previous_good_file(tmp_path, monkeypatch):
    train, _ = write_quickstart_data(tmp_path, num_train=8, num_val=2, seed=1)
    good = train.read_bytes()
    monkeypatch.setattr(pq, "write_table", write_half_then_fail(pq.write_table))
    with pytest.raises(OSError, match="No space left"):
        write_quickstart_data(tmp_path, num_train=8, num_val=2, seed=2)
    assert train.read_bytes() == good
    assert len(read_prompt_rows(str(train))) == 8
    assert sorted(p.name for p in tmp_path.iterdir()) == ["train.parquet", "val.parquet"]


def test_rows_arrow_rejects_leave_the_old_file(tmp_path):
    path = write_rows([{"data_source": "a", "n": 1}], tmp_path / "x.parquet")
    good = path.read_bytes()
    with pytest.raises(pa.ArrowException, match="two"):  # a string where ints were
        write_rows([{"data_source": "a", "n": 1}, {"data_source": "b", "n": "two"}], path)
    assert path.read_bytes() == good
    assert [p.name for p in tmp_path.iterdir()] == ["x.parquet"]


def test_gsm8k_one_bad_split_leaves_every_previous_file(tmp_path, capsys):
    release = tmp_path / "release"
    release.mkdir()
    record = {"question": "Half of 8?", "answer": "8/2 = 4\n#### 4"}
    (release / "train.jsonl").write_text(json.dumps(record) + "\n")
    (release / "test.jsonl").write_text(json.dumps(record) + "\n")
    out = tmp_path / "out"
    assert main(["gsm8k", "--input", str(release), "--local_dir", str(out)]) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    # test (converted first) is good and new; train (converted last) has a bad record
    (release / "test.jsonl").write_text(json.dumps(record) + "\n" + json.dumps(record) + "\n")
    (release / "train.jsonl").write_text(json.dumps({"question": "Q?", "answer": "no number"}))
    assert main(["gsm8k", "--input", str(release), "--local_dir", str(out)]) == 2
    assert "train.jsonl: line 1" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_atomic_output_renames_only_a_finished_file(tmp_path):
    final = tmp_path / "f.txt"
    with atomic_output(final) as tmp:
        tmp.write_text("new")
        assert not final.exists() and tmp.parent == tmp_path and tmp.name.startswith(".f.txt.")
    assert final.read_text() == "new"
    umask = os.umask(0o022)
    os.umask(umask)
    assert final.stat().st_mode & 0o777 == 0o666 & ~umask  # as open() would make it
    with pytest.raises(KeyboardInterrupt), atomic_output(final) as tmp:
        tmp.write_text("half")
        raise KeyboardInterrupt
    assert final.read_text() == "new"
    assert [p.name for p in tmp_path.iterdir()] == ["f.txt"]


def test_a_really_full_disk_keeps_the_previous_file(tmp_path):
    """No fake here: a 64 KiB file system that the new, larger file does not fit in."""
    with small_filesystem(tmp_path / "disk", 64) as disk:
        train, _ = write_quickstart_data(disk, num_train=8, num_val=2, seed=1)
        before = {p.name: p.read_bytes() for p in disk.iterdir()}
        with pytest.raises(OSError):
            write_quickstart_data(disk, num_train=4000, num_val=2, seed=2)
        assert {p.name: p.read_bytes() for p in disk.iterdir()} == before
        assert len(read_prompt_rows(str(train))) == 8
