"""Where checkpoints live and how one becomes visible: crash-safe, with or without torch.dist.

A run that is killed at any instant must resume from the last checkpoint that was fully written.
So every step is written into a hidden temp dir, made durable (fsync), marked `COMPLETE`, and
only then renamed to `global_step_<N>`; the pointer file is replaced atomically afterwards.
Readers trust a directory only if it carries the marker, and its files still have the sizes
the marker recorded (`damage`): a truncated or missing file makes the resume fall back to the
previous complete checkpoint, saying so in one line. Layout (verl's names):

    root/latest_checkpointed_iteration.txt   N of the newest checkpoint
    root/global_step_<N>/COMPLETE            {"step", "time", "world_size", "files"}
    root/.tmp_global_step_<N>/               being written; removed when a manager starts
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch.distributed as dist

from rlhf.checkpoint.storage import CheckpointStorageError, write_failure
from rlhf.utils import atomic_output, fsync_dir

log = logging.getLogger(__name__)

POINTER_FILE = "latest_checkpointed_iteration.txt"
COMPLETE_MARKER = "COMPLETE"
STEP_PREFIX = "global_step_"
TMP_PREFIX = ".tmp_" + STEP_PREFIX  # being written
OLD_PREFIX = ".old_" + STEP_PREFIX  # a same-step checkpoint being replaced
TRASH_PREFIX = ".trash_" + STEP_PREFIX  # being pruned
_STEP_RE = re.compile(rf"^{STEP_PREFIX}(\d+)$")


def fsync_tree(path: Path) -> None:
    """fsync every file under `path`, then every directory, deepest first."""
    for dirpath, _, filenames in os.walk(path, topdown=False):
        for name in filenames:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(dirpath))


def write_durable(path: Path, data: bytes) -> None:
    """Write `data` to `path` atomically and durably (`rlhf.utils.atomic_output`)."""
    with atomic_output(path) as tmp:
        tmp.write_bytes(data)


def is_complete(path: Path) -> bool:
    """True if `path` is a checkpoint directory that was finished (it carries the marker)."""
    return (Path(path) / COMPLETE_MARKER).is_file()


def file_sizes(path: Path) -> dict[str, int]:
    """Bytes of every file under a checkpoint directory (but its marker), by relative path."""
    return {
        str(f.relative_to(path)): f.stat().st_size
        for f in sorted(path.rglob("*"))
        if f.is_file() and f.name != COMPLETE_MARKER
    }


def damage(path: Path) -> str | None:
    """What is wrong with a complete checkpoint's files against the sizes its marker recorded
    (None: intact, or written before sizes were recorded)."""
    try:
        marker = json.loads((path / COMPLETE_MARKER).read_text())
    except (OSError, ValueError):
        return f"its {COMPLETE_MARKER} marker is unreadable"
    for name, size in marker.get("files", {}).items():
        file = path / name
        if not file.is_file():
            return f"{file} is missing"
        if file.stat().st_size != size:
            return f"{file} has {file.stat().st_size} bytes, {size} were written"
    return None


def step_of(path: Path | str) -> int:
    """The step N of a `global_step_<N>` directory."""
    match = _STEP_RE.match(Path(path).name)
    if match is None:
        raise ValueError(f"{path} is not a checkpoint directory (expected {STEP_PREFIX}<N>)")
    return int(match.group(1))


def complete_steps_in(root: Path) -> list[int]:
    """Steps of the complete `global_step_*` directories under `root`, ascending."""
    if not root.is_dir():
        return []
    steps = [step_of(p) for p in root.iterdir() if _STEP_RE.match(p.name) and is_complete(p)]
    return sorted(steps)


def read_pointer(root: Path) -> int | None:
    """The step in `root`'s pointer file; None (with a warning if corrupt) when unusable."""
    pointer = root / POINTER_FILE
    if not pointer.is_file():
        return None
    text = pointer.read_text().strip()
    if not text.isdigit():
        log.warning("ignoring corrupt checkpoint pointer %s (content %r)", pointer, text[:40])
        return None
    return int(text)


def _unfinished(root: Path) -> list[str]:
    """Names of temp dirs and `global_step_*` dirs without the marker under `root`."""
    if not root.is_dir():
        return []
    return sorted(
        p.name
        for p in root.iterdir()
        if p.name.startswith(TMP_PREFIX) or (_STEP_RE.match(p.name) and not is_complete(p))
    )


def find_latest(root: Path) -> Path | None:
    """The pointer's checkpoint if complete and intact, else the highest complete, intact one
    (each damaged one said in a warning), else None."""
    steps = complete_steps_in(root)[::-1]
    step = read_pointer(root)
    if step is not None:
        if step in steps:
            steps.remove(step)
            steps.insert(0, step)
        else:
            path = root / f"{STEP_PREFIX}{step}"
            log.warning(
                "checkpoint pointer names step %d but %s is missing or incomplete", step, path
            )
    unfinished = _unfinished(root)
    if unfinished:
        log.warning("ignoring unfinished checkpoints in %s: %s", root, ", ".join(unfinished))
    for candidate in steps:
        path = root / f"{STEP_PREFIX}{candidate}"
        problem = damage(path)
        if problem is None:
            return path
        log.warning("checkpoint %s is damaged (%s); falling back to an earlier one", path, problem)
    return None


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _distributed() else 0


def _barrier() -> None:
    if _distributed():
        dist.barrier()


class CheckpointManager:
    """Writes `global_step_<N>` directories under `root` and finds the one to resume from.

    Args:
        root: directory holding all checkpoints of a run (created if missing).
        keep_last: keep this many newest complete checkpoints; None keeps all.
    """

    def __init__(self, root: Path | str, keep_last: int | None = None) -> None:
        if keep_last is not None and keep_last < 1:
            raise ValueError(f"keep_last must be >= 1 or None, got {keep_last}")
        self.root = Path(root)
        self.keep_last = keep_last
        if _rank() == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            self._clean_stale()

    def path_for(self, step: int) -> Path:
        """The final directory of `step` (whether or not it exists)."""
        return self.root / f"{STEP_PREFIX}{step}"

    def step_of(self, path: Path | str) -> int:
        """The step N of a `global_step_<N>` directory."""
        return step_of(path)

    def complete_steps(self) -> list[int]:
        """Steps with a complete checkpoint, ascending."""
        return complete_steps_in(self.root)

    def latest(self) -> Path | None:
        """The checkpoint to resume from: the pointer's, else the highest complete one."""
        return find_latest(self.root)

    def resolve_resume(self, mode: str) -> Path | None:
        """'disable' -> None; 'auto' -> latest() or None; else a checkpoint dir or a root dir."""
        if mode == "disable":
            return None
        if mode == "auto":
            return self.latest()
        path = Path(mode).expanduser()
        if path.is_dir() and is_complete(path):
            problem = damage(path)
            if problem is not None:
                raise FileNotFoundError(
                    f"resume_mode={mode!r}: the checkpoint is damaged: {problem}"
                )
            return path
        if path.is_dir() and not _STEP_RE.match(path.name):
            found = find_latest(path)
            if found is not None:
                return found
        raise FileNotFoundError(self._not_found_message(mode, path))

    def _not_found_message(self, mode: str, path: Path) -> str:
        if not path.exists():
            what = f"{path} does not exist"
        elif _STEP_RE.match(path.name):
            what = f"{path} has no {COMPLETE_MARKER} marker (it was not fully written)"
        else:
            what = f"{path} holds no complete {STEP_PREFIX}<N> directory"
        roots = dict.fromkeys([self.root, path if path.is_dir() else path.parent])
        available = "; ".join(f"{r}: steps {complete_steps_in(r)}" for r in roots)
        return (
            f"resume_mode={mode!r} is neither 'auto', 'disable' nor a usable checkpoint: {what}. "
            f"Complete checkpoints found in {available}"
        )

    @contextmanager
    def writing(self, step: int) -> Iterator[Path]:
        """Yield a temp dir for all ranks to write `step` into; publish it when the body ends.

        Collective under torch.distributed: every rank must enter and leave it. If the body
        raises, nothing is published and earlier checkpoints and the pointer stay as they were;
        a full disk or a read-only directory is raised as `CheckpointStorageError` saying so.
        """
        tmp = self.begin(step)
        try:
            yield tmp
        except BaseException as e:
            self.abandon(step, tmp, e)
            raise
        self.publish(step, tmp)

    def begin(self, step: int) -> Path:
        """The empty temp dir `step` is written into (collective)."""
        tmp = self.root / f"{TMP_PREFIX}{step}"
        if _rank() == 0:
            with self._storage_errors(step):  # a directory turned read-only since startup
                self.root.mkdir(parents=True, exist_ok=True)
                shutil.rmtree(tmp, ignore_errors=True)
                tmp.mkdir()
        _barrier()
        return tmp

    def abandon(self, step: int, tmp: Path, error: BaseException) -> None:
        """After writing `step` failed with `error`: nothing is published; a full or read-only
        disk is raised as `CheckpointStorageError` (other errors are left to the caller)."""
        # before the cleanup frees the space; an interrupt is not the storage's fault
        # (torch's CheckpointException is a BaseException, so it is checked too)
        interrupted = isinstance(error, KeyboardInterrupt | SystemExit | GeneratorExit)
        problem = None if interrupted else write_failure(self.root, error)
        # Under torch.distributed other ranks may still be writing; the next manager cleans.
        if not _distributed():
            shutil.rmtree(tmp, ignore_errors=True)
        if problem is not None:
            raise CheckpointStorageError(f"step {step}: {problem}") from error

    def publish(self, step: int, tmp: Path) -> None:
        """Make the fully written `tmp` the checkpoint of `step` and the latest (collective)."""
        _barrier()
        if _rank() == 0:
            with self._storage_errors(step):
                self._publish(tmp, step)
                self._prune(step)
        _barrier()

    @contextmanager
    def _storage_errors(self, step: int) -> Iterator[None]:
        """A full or read-only disk met outside the writers' body, said as such."""
        try:
            yield
        except OSError as e:
            problem = write_failure(self.root, e)
            if problem is None:
                raise
            raise CheckpointStorageError(f"step {step}: {problem}") from e

    def _publish(self, tmp: Path, step: int) -> None:
        fsync_tree(tmp)
        world_size = dist.get_world_size() if _distributed() else 1
        marker = {
            "step": step,
            "time": time.time(),
            "world_size": world_size,
            "files": file_sizes(tmp),
        }
        write_durable(tmp / COMPLETE_MARKER, json.dumps(marker).encode())
        final = self.path_for(step)
        old = self.root / f"{OLD_PREFIX}{step}"
        if final.exists():  # e.g. the same step again after resuming from an earlier one
            shutil.rmtree(old, ignore_errors=True)
            os.rename(final, old)
        os.rename(tmp, final)
        fsync_dir(self.root)
        shutil.rmtree(old, ignore_errors=True)
        write_durable(self.root / POINTER_FILE, f"{step}\n".encode())
        log.info("saved checkpoint %s", final)

    def _prune(self, step: int) -> None:
        """Remove complete checkpoints older than `step` beyond keep_last; never `step` itself."""
        steps = self.complete_steps()
        newer = [s for s in steps if s > step]
        if newer:
            log.warning(
                "checkpoints %s are newer than step %d (an earlier run?); kept", newer, step
            )
        if self.keep_last is None:
            return
        older = [s for s in steps if s < step]
        for s in older[: max(0, len(older) - (self.keep_last - 1))]:
            trash = self.root / f"{TRASH_PREFIX}{s}"
            os.rename(self.path_for(s), trash)  # a half-deleted dir must never look complete
            shutil.rmtree(trash)
            log.info("pruned checkpoint step %d (keep_last=%d)", s, self.keep_last)

    def _clean_stale(self) -> None:
        """Remove what a killed writer left; restore a checkpoint caught mid-replacement."""
        for p in self.root.iterdir():
            if p.name.startswith(OLD_PREFIX):
                final = self.root / p.name.removeprefix(".old_")
                if not final.exists() and is_complete(p):
                    os.rename(p, final)
                    log.warning("restored %s, interrupted while being replaced", final)
                    continue
            if p.name.startswith((TMP_PREFIX, OLD_PREFIX, TRASH_PREFIX)):
                log.warning("removing stale checkpoint directory %s", p)
                shutil.rmtree(p, ignore_errors=True)
