"""Can the run's checkpoints be written? Checked before training, and said plainly when not.

A read-only or full checkpoint directory used to surface only at the first save, after the
training it was meant to keep (and a full disk as torch's `unexpected pos 704 vs 598`).
`probe_storage` writes and fsyncs a small file at startup (which also measures the write
rate a preemption checkpoint is planned with) and compares the free space with the planned
checkpoint size; `write_failure` turns a failed save into "no space left on device" or
"read-only" when that is what happened.
"""

from __future__ import annotations

import errno
import os
import time
from pathlib import Path

from rlhf.errors import UserError

MIB = 1024**2
PROBE_BYTES = 8 * MIB
# Less than this free after a failed write: the disk filled up (torch's checkpoint writer
# does not always pass the ENOSPC on).
NEARLY_FULL_BYTES = 4 * MIB
_FULL = (errno.ENOSPC, errno.EDQUOT)
_READ_ONLY = (errno.EROFS, errno.EACCES, errno.EPERM)


class CheckpointStorageError(RuntimeError, UserError):
    """The checkpoint directory cannot take a checkpoint (read-only, or too little space)."""


def available_bytes(path: Path) -> int:
    """Bytes this process may still write on `path`'s file system (root may use the
    blocks reserved for it)."""
    st = os.statvfs(path)
    blocks = st.f_bfree if os.geteuid() == 0 else st.f_bavail
    return blocks * st.f_frsize


def size_text(num_bytes: float) -> str:
    """Bytes in GiB, or MiB below one GiB."""
    if num_bytes >= 1024**3:
        return f"{num_bytes / 1024**3:.2f} GiB"
    return f"{num_bytes / MIB:.1f} MiB"


def probe_storage(root: Path, needed_bytes: int) -> float:
    """Check that `root` (created if missing) is writable and has `needed_bytes` free;
    returns the measured, fsynced write rate in bytes/s. Raises CheckpointStorageError."""
    probe = root / ".rlhf_write_probe"
    try:
        root.mkdir(parents=True, exist_ok=True)
        free = available_bytes(root)
        if free < needed_bytes:
            raise CheckpointStorageError(
                f"checkpoint directory {root} has {size_text(free)} free; a checkpoint of "
                f"this run takes about {size_text(needed_bytes)}: free space or point "
                "trainer.default_local_dir elsewhere"
            )
        size = max(1, min(PROBE_BYTES, needed_bytes))
        start = time.perf_counter()
        with open(probe, "wb") as f:
            f.write(os.urandom(size))
            f.flush()
            os.fsync(f.fileno())
        seconds = time.perf_counter() - start
        probe.unlink()
    except OSError as e:
        if probe.is_file():
            probe.unlink()
        raise CheckpointStorageError(_failed(root, e, "cannot write checkpoints")) from None
    return size / max(seconds, 1e-6)


def _failed(root: Path, error: OSError, what: str) -> str:
    if error.errno in _FULL:
        return f"{what}: no space left on device (ENOSPC) in {root}"
    if error.errno in _READ_ONLY:
        return f"{what}: {root} is read-only or not writable ({error.strerror})"
    return f"{what} in {root}: {error}"


def write_failure(root: Path, error: BaseException) -> str | None:
    """What a failed checkpoint write ran into, when it is the storage: a full disk or a
    read-only directory (also when the OSError is buried in a library's own error)."""
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in (*_FULL, *_READ_ONLY):
            return _failed(root, seen, "checkpoint not written")
        seen = seen.__cause__ or seen.__context__
    try:
        free = available_bytes(root)
    except OSError:
        return None
    if free < NEARLY_FULL_BYTES:
        return (
            f"checkpoint not written: no space left on device (ENOSPC) in {root} "
            f"({free // 1024} KiB free; the writer said: {error})"
        )
    return None
