"""`CheckpointManager.writing` on 2 gloo ranks: one directory with both ranks' files; resume."""

from __future__ import annotations

import json

from rlhf.checkpoint import COMPLETE_MARKER, POINTER_FILE, CheckpointManager
from tests.helpers import run_torchrun


def test_two_ranks_write_one_checkpoint(tmp_path):
    run_torchrun("checkpoint_writing.py", 2, ["--root", str(tmp_path)], timeout_s=300)
    manager = CheckpointManager(tmp_path, keep_last=2)
    assert manager.complete_steps() == [2, 3]  # step 1 pruned by keep_last=2
    final = manager.path_for(3)
    for rank in (0, 1):
        assert (final / f"shard_rank{rank}.txt").read_text() == f"step 3 rank {rank}"
        assert (final / "rng" / f"rank_{rank}.pt").is_file()
    assert json.loads((final / COMPLETE_MARKER).read_text())["world_size"] == 2
    assert (tmp_path / POINTER_FILE).read_text().strip() == "3"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    for rank in (0, 1):
        report = json.loads((tmp_path / f"report_rank{rank}.json").read_text())
        assert report["latest"] == str(final)
        assert report["state"] == {"global_step": 3}
        assert report["rng_restored"]
