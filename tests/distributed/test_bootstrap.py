"""Bootstrap under torchrun and as a plain process: backend, groups, seeding, teardown."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch

from tests.helpers import REPO, WORKERS, run_torchrun


def reports(out_dir, world_size):
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(world_size)]


def test_two_ranks_tp2(tmp_path):
    run_torchrun("bootstrap_probe.py", 2, ["--tp", "2", "--out-dir", str(tmp_path)], torchrun=True)
    r0, r1 = reports(tmp_path, 2)
    expected_backend = "nccl" if torch.cuda.is_available() else "gloo"
    for r in (r0, r1):
        assert r["world_size"] == 2 and r["backend"] == expected_backend
        assert (r["tp_size"], r["dp_size"]) == (2, 1)
        assert r["rank_sum"] == 1.0  # all_reduce reached both ranks
        assert r["megatron_agrees"]  # the context holds what Megatron's parallel state says
        assert not r["torch_dist_initialized_after_teardown"]
        assert not r["model_parallel_initialized_after_teardown"]
    assert {r0["tp_rank"], r1["tp_rank"]} == {0, 1}
    # Replicated regions draw the same numbers on every rank, TP-sharded regions differ.
    assert r0["default_draw"] == r1["default_draw"]
    assert r0["tp_draw"] != r1["tp_draw"]


def test_two_ranks_dp2(tmp_path):
    run_torchrun("bootstrap_probe.py", 2, ["--out-dir", str(tmp_path)], torchrun=True)
    r0, r1 = reports(tmp_path, 2)
    assert (r0["tp_size"], r0["dp_size"]) == (1, 2)
    assert r0["tp_draw"] == r1["tp_draw"]  # same TP rank 0 in both DP replicas


def test_plain_process_without_torchrun(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PYTHONPATH"] = str(REPO)
    subprocess.run(
        [sys.executable, str(WORKERS / "bootstrap_probe.py"), "--out-dir", str(tmp_path)],
        env=env,
        check=True,
        capture_output=True,
        timeout=300,
    )
    (r0,) = reports(tmp_path, 1)
    assert (r0["rank"], r0["world_size"], r0["tp_size"], r0["dp_size"]) == (0, 1, 1, 1)
    assert not r0["torch_dist_initialized_after_teardown"]
