"""The CPU tensor transport's shared memory ends with the trainer, whatever the servers do.

On CPU, weights reach a server as files in /dev/shm (torch's file_system sharing strategy):
the first shared allocation starts a `torch_shm_manager` process that removes the files
once every process connected to it has gone. A server connects when it opens a handle and
never disconnects, so against an external server the manager, re-parented to PID 1, and
the run's files outlived every run (seven managers had piled up on one machine).

`reap_at_exit()` starts, once per process, a reaper: this file run by the bare interpreter
(standard library only), in its own session, reading the manager's PID from a pipe whose
other end only the trainer holds. When the trainer ends, however it ends (a return, an
exception, SIGKILL), the pipe closes and the reaper waits until no process maps the run's
files any more (a server still loading a bucket would abort if its manager vanished under
it: it tells the manager when it lets go of the file), then stops the manager and removes
the run's files `/dev/shm/torch_<trainer pid>_*`. A file still mapped after `WAIT_S` is
left, and so is its manager.
"""

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

SHM = Path("/dev/shm")
MANAGER = "torch_shm_manag"  # torch_shm_manager as /proc/PID/comm shows it (15 characters)
WAIT_S = 600.0  # for servers still holding a file when the trainer ended
_reaper: subprocess.Popen | None = None
_told: set[int] = set()


def mapped_files(directory: Path = SHM) -> set[Path]:
    """The files in `directory` that some live process (other than the shm manager) has
    mapped or open."""
    held: set[Path] = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if (proc / "comm").read_text().strip() == MANAGER:
                continue
            lines = (proc / "maps").read_text().splitlines()
            paths = [line.split(maxsplit=5)[-1] for line in lines]
            paths += [os.readlink(fd) for fd in (proc / "fd").iterdir()]
        except OSError:  # gone meanwhile, or not ours to read
            continue
        held.update(Path(text) for text in paths if text.startswith(f"{directory}/"))
    return held


def reap_at_exit() -> None:
    """Tell this process's reaper (started on the first call) about its shm managers; call
    after a shared allocation (the first one starts the manager)."""
    global _reaper
    import psutil

    managers = {c.pid for c in psutil.Process().children() if c.name().startswith(MANAGER)}
    if not managers - _told:
        return
    if _reaper is None:
        command = [sys.executable, "-I", "-S", __file__, str(os.getpid())]
        _reaper = subprocess.Popen(command, stdin=subprocess.PIPE, start_new_session=True)
    assert _reaper.stdin is not None
    for pid in sorted(managers - _told):
        _reaper.stdin.write(b"%d\n" % pid)
    _reaper.stdin.flush()
    _told.update(managers)


def _reap(owner: int, managers: list[int], wait_s: float) -> None:
    """After `owner` ended: wait until none of its files is mapped, stop `managers`,
    remove the files."""
    files = set(SHM.glob(f"torch_{owner}_*"))
    deadline = time.monotonic() + wait_s
    while files & mapped_files() and time.monotonic() < deadline:
        time.sleep(0.5)
    if files & mapped_files():
        return  # a server still holds one: its manager must stay
    for pid in managers:
        with contextlib.suppress(OSError):
            if Path(f"/proc/{pid}/comm").read_text().strip() == MANAGER:
                os.kill(pid, signal.SIGTERM)
    for path in SHM.glob(f"torch_{owner}_*"):
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # ^C reaches the trainer's group, not this
    owner = int(sys.argv[1])
    managers = [int(line) for line in sys.stdin.buffer]  # until the trainer's end closes it
    _reap(owner, managers, WAIT_S)


if __name__ == "__main__":
    main()
