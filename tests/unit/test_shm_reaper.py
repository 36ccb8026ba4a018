"""The CPU tensor transport's shared memory ends with the trainer (rlhf.weight_sync.shm_reaper):
against a server that stays (an external one), the trainer's torch_shm_manager and its
/dev/shm files went on after every run.

Real processes: an "owner" allocates a shared staging buffer as the transport does and
serializes a handle to it; a "server" opens the handle as SGLang does (connecting to the
owner's shm manager) and stays alive; the owner is killed with SIGKILL.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

OWNER = """
import io, sys, time, torch
from multiprocessing.reduction import ForkingPickler
from rlhf.weight_sync import shm_reaper
torch.multiprocessing.set_sharing_strategy("file_system")
storage = torch.UntypedStorage._new_shared(4096)
staging = torch.empty(0, dtype=torch.uint8).set_(storage).fill_(7)
if sys.argv[2] == "reap":
    shm_reaper.reap_at_exit()
buffer = io.BytesIO()
ForkingPickler(buffer).dump(staging)
open(sys.argv[1], "wb").write(buffer.getvalue())
print("ready", flush=True)
time.sleep(600)
"""
SERVER = """
import pickle, sys, time, torch
torch.multiprocessing.set_sharing_strategy("file_system")
weights = pickle.loads(open(sys.argv[1], "rb").read())
print("loaded", int(weights.sum()), flush=True)
time.sleep(float(sys.argv[2]))  # loading the bucket
del weights  # SGLang lets go of the bucket; its connection to the manager stays
print("released", flush=True)
time.sleep(600)
"""


def start(code: str, *args: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    proc.stdout.readline()  # ready / loaded
    return proc


def managers_of(pid: int) -> set[int]:
    return {c.pid for c in psutil.Process(pid).children() if c.name() == "torch_shm_manager"}


def files_of(pid: int) -> list[Path]:
    return sorted(Path("/dev/shm").glob(f"torch_{pid}_*"))


def wait_until(condition, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return False


def gone(pid: int) -> bool:
    return not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


@pytest.mark.parametrize("holding_s", [0.0, 3.0])
def test_the_manager_and_files_end_with_the_owner_while_the_server_stays(tmp_path, holding_s):
    """holding_s 3: the server still maps the bucket when the owner dies; stopping the
    manager then would abort the server when it lets go (seen: 'Broken pipe', SIGABRT), so
    the reaper waits for it."""
    handle = tmp_path / "handle.pkl"
    owner = start(OWNER, str(handle), "reap")
    (manager,) = managers_of(owner.pid)
    assert files_of(owner.pid)
    server = start(SERVER, str(handle), str(holding_s))
    try:
        owner.kill()
        owner.wait()
        if holding_s:
            time.sleep(1.0)
            assert not gone(manager), "the manager was stopped under a server holding a file"
        assert wait_until(lambda: gone(manager) and not files_of(owner.pid))
        assert server.poll() is None  # the server lives on, and let go without aborting
        if holding_s:
            assert server.stdout is not None and server.stdout.readline() == "released\n"
    finally:
        server.kill()
        server.wait()


def test_without_the_reaper_the_manager_outlives_its_owner(tmp_path):
    """What the reaper is for (and what this test would miss if the setup were wrong)."""
    handle = tmp_path / "handle.pkl"
    owner = start(OWNER, str(handle), "no-reap")
    (manager,) = managers_of(owner.pid)
    server = start(SERVER, str(handle), "0")
    try:
        owner.kill()
        owner.wait()
        time.sleep(2.0)
        assert not gone(manager) and files_of(owner.pid)
    finally:
        server.kill()
        server.wait()
        wait_until(lambda: gone(manager))
        for path in files_of(owner.pid):
            path.unlink(missing_ok=True)
