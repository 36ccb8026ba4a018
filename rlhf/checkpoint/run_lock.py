"""One run per directory: an exclusive lock on the run directory for the life of the run.

Two jobs writing the same `trainer.default_local_dir` corrupt each other (one deletes the
other's in-progress `.tmp_global_step_N` as stale; both append the same metrics). The main
rank of `rlhf-train` takes `flock(LOCK_EX)` on `<run dir>/.rlhf_run.lock` before it starts
anything and holds it until the process exits. The kernel releases the lock when the holder
exits in any way (a crash or SIGKILL too), so a lock is never stale; the file itself stays
and says who held it last (pid, host, start time), which the second job's error names.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import time
from pathlib import Path

from rlhf.errors import UserError

LOCK_NAME = ".rlhf_run.lock"


class RunDirBusy(RuntimeError, UserError):
    """Another live process holds the run directory."""


class RunDirUnusable(RuntimeError, UserError):
    """The run directory cannot be created or written (read-only, a file, no permission)."""


class RunDirLock:
    """`RunDirLock(run_dir).acquire()`; released by `release()` or the process's exit."""

    def __init__(self, run_dir: str | Path):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_NAME
        self.fd: int | None = None

    def acquire(self) -> RunDirLock:
        """Create the run directory if needed and lock it; `RunDirBusy` naming the holder, or
        `RunDirUnusable` naming the directory when it cannot be used."""
        if self.run_dir.exists() and not self.run_dir.is_dir():
            raise RunDirUnusable(f"run directory {self.run_dir} is a file")
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise RunDirUnusable(
                f"run directory {self.run_dir} cannot be written ({e.strerror}); set "
                "trainer.default_local_dir to a writable directory"
            ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise RunDirBusy(
                f"run directory {self.run_dir} is in use by {self.holder()}; wait for that run "
                "to end or stop it, or set trainer.default_local_dir to another directory"
            ) from None
        holder = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps(holder).encode())
        os.fsync(fd)
        self.fd = fd
        return self

    def holder(self) -> str:
        """Who wrote the lock file last, in words."""
        try:
            info = json.loads(self.path.read_text())
            since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info["since"]))
            return f"pid {info['pid']} on {info['host']} (since {since})"
        except (OSError, ValueError, KeyError):
            return "another process"

    def release(self) -> None:
        if self.fd is not None:
            with contextlib.suppress(OSError):
                fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None
