"""One run per directory (`rlhf.checkpoint.run_lock`): a second `rlhf-train` on a directory
whose lock a live process holds exits 2 naming the holder, before it starts anything; the lock
dies with its holder, however it exits."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from rlhf.checkpoint.run_lock import LOCK_NAME, RunDirBusy, RunDirLock, RunDirUnusable
from tests.helpers import REPO

pytestmark = pytest.mark.reliability

HOLD = (
    "import sys, time; from rlhf.checkpoint.run_lock import RunDirLock; "
    "RunDirLock(sys.argv[1]).acquire(); print('held', flush=True); time.sleep(600)"
)


def test_second_job_exits_2_naming_the_holder(tmp_path):
    run_dir = tmp_path / "run"
    lock = RunDirLock(run_dir).acquire()
    try:
        cmd = [
            sys.executable,
            "-m",
            "rlhf.cli.train",
            "--config",
            str(REPO / "configs" / "quickstart_cpu.yaml"),
            f"trainer.default_local_dir={run_dir}",
        ]
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    finally:
        lock.release()
    assert proc.returncode == 2
    (line,) = [x for x in proc.stderr.splitlines() if x.startswith("rlhf-train:")]
    assert f"pid {os.getpid()}" in line and str(run_dir) in line
    assert "started SGLang" not in proc.stderr and not (run_dir / "checkpoints").exists()


def test_lock_dies_with_its_holder(tmp_path):
    run_dir = tmp_path / "run"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(run_dir)], cwd=REPO, stdout=subprocess.PIPE, text=True
    )
    assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
    with pytest.raises(RunDirBusy, match=f"pid {holder.pid} on"):
        RunDirLock(run_dir).acquire()
    os.kill(holder.pid, signal.SIGKILL)  # no cleanup runs
    holder.wait()
    deadline = time.monotonic() + 10
    while True:
        try:
            RunDirLock(run_dir).acquire().release()
            break
        except RunDirBusy:
            assert time.monotonic() < deadline
            time.sleep(0.1)
    assert (run_dir / LOCK_NAME).is_file()


def test_run_dir_that_is_a_file(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(RunDirUnusable, match="is a file"):
        RunDirLock(tmp_path / "file").acquire()
