"""Colocated servers release their memory before any rank of their node goes on
(rlhf.rollout.policy_servers): only the servers' owner asks them to, and the other ranks
reloaded their models while their GPU's server still held its ~50 GiB (issue 51, item 3)."""

from __future__ import annotations

import json

from tests.helpers import run_torchrun


def test_no_rank_goes_on_before_every_server_released(tmp_path):
    out = tmp_path / "release.json"
    run_torchrun("server_release.py", 2, ["--out", str(out)], timeout_s=300)
    ranks = json.loads(out.read_text())
    done = max(r["released_at"] for r in ranks)  # rank 0's last release
    assert done > 0
    assert all(r["left"] >= done for r in ranks), ranks
