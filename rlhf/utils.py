"""Small helpers every layer may use: ports, CPU threads, dtype names, integer rounding,
atomic file writes, the garbage collector during a process's start.

The bottom of the package: it imports nothing from `rlhf`, and torch only when a helper
needs it (a launcher imports it before torch: `rlhf.cli.train`).
"""

from __future__ import annotations

import dataclasses
import gc
import os
import random
import signal
import socket
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

if TYPE_CHECKING:
    import torch

T = TypeVar("T")

# Ports handed out by free_port: from here up to the kernel's ephemeral range.
PORT_RANGE_LOW = 30000
_port_rng = random.SystemRandom()  # unaffected by seeding: two seeded runs differ


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a config's dtype name (float32, bfloat16, float16)."""
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def field_values(instance: Any) -> dict[str, Any]:
    """A dataclass instance's fields by name, holding its values themselves: `asdict` copies
    every list element by element (a step's 32 rollout records took 4.7 ms to write with it,
    in a thread that then held the GIL against the trainer's next pass)."""
    return {f.name: getattr(instance, f.name) for f in dataclasses.fields(instance)}


def empty_device_cache() -> None:
    """Return the CUDA caching allocator's unused blocks to the driver, so that another
    process on the GPU (a colocated SGLang server) can allocate them; nothing on CPU."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def round_up(length: int, multiple: int) -> int:
    """`length` padded up to a multiple of `multiple`."""
    return -(-length // multiple) * multiple


def split_evenly(items: list[T], parts: int) -> list[list[T]]:
    """`items` in order, cut into `parts` contiguous pieces differing in size by at most one."""
    base, extra = divmod(len(items), parts)
    cuts = [0]
    for k in range(parts):
        cuts.append(cuts[-1] + base + (k < extra))
    return [items[cuts[k] : cuts[k + 1]] for k in range(parts)]


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("0.0.0.0", port))  # no SO_REUSEADDR: a port in TIME_WAIT counts as taken
        except OSError:
            return False
    return True


def free_port() -> int:
    """A TCP port that was free a moment ago, below the kernel's ephemeral port range.

    Callers hand the port to a process that binds it later, an SGLang server only after
    loading its model. A port from bind(0) lies in the ephemeral range, which the kernel also
    gives every outgoing connection and every gloo listener in the meantime; one of those
    took such a port once in CI, and the server's warm-up then talked to a socket that never
    answered. Below the range only explicit binds take ports.
    """
    high = _ephemeral_low() - 1
    if high - PORT_RANGE_LOW >= 1000:
        for _ in range(100):
            port = _port_rng.randint(PORT_RANGE_LOW, high)
            if _bindable(port):
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_ports(count: int) -> list[int]:
    """`count` distinct ports that were free a moment ago."""
    ports: list[int] = []
    while len(ports) < count:
        port = free_port()
        if port not in ports:
            ports.append(port)
    return ports


def cpu_threads(active_processes: int) -> int:
    """Threads for one of `active_processes` processes that compute at the same time on this
    node's cores; an explicit OMP_NUM_THREADS wins.

    The thread policy of CPU runs: the phases of a step are sequential (the trainer ranks wait
    while the SGLang servers generate, the servers sleep while the trainer trains), so each
    side gets all the cores, split only among its own processes: a trainer rank
    cores / local ranks, a server cores / servers on the node. Idle processes must not spin:
    servers run with SGLang's `--sleep-on-idle` (its scheduler otherwise busy-polls a core),
    and OpenMP's idle threads sleep after a short spin (`omp_spin_env`). Measured on 2 cores
    (benchmarks/ppo_vs_plain.py): one thread per process 3.1 s per step, this policy 1.9 s.
    """
    explicit = os.environ.get("OMP_NUM_THREADS")
    if explicit:
        return max(1, int(explicit))
    return max(1, (os.cpu_count() or 1) // max(1, active_processes))


# GNU OpenMP (torch's) lets a thread that has no work spin this many times before it sleeps
# (`GOMP_SPINCOUNT`, read as the library loads; 300,000 by default, ~6 ms here). A phase of
# one process then left its threads spinning on the cores the next phase's process needed:
# the trainer's after an update against the server loading the weights, the server's after
# a generation against the trainer's next pass. 50,000 (~1 ms) still spans the gaps between
# one pass's operations. Measured (2 cores, 15 steps, 3 interleaved rounds): step 0.835-0.890
# -> 0.814-0.854 s, the weight sync 0.054-0.061 -> 0.046-0.047 s; sleeping at once
# (OMP_WAIT_POLICY=PASSIVE) made every phase slower (step 0.98-1.04 s).
OMP_SPIN = {"GOMP_SPINCOUNT": "50000"}


def omp_spin_env() -> dict[str, str]:
    """`OMP_SPIN` for a CPU process's environment, before it loads torch; nothing where this
    process's environment sets it already (the user's value, or inherited)."""
    return {k: v for k, v in OMP_SPIN.items() if k not in os.environ}


# glibc's malloc hands a freed block above its mmap threshold (128 kB at first) back to the
# kernel, and trims the heap's free top above 128 kB: the next tensor of that size faults
# its pages in again, each zeroed by the kernel. A CPU step allocates and frees the same
# tensors every time (activations, gradients, logits), so it paid that in every pass:
# ~12k page faults and ~28 ms of kernel time in each ~0.22 s update of the quickstart's
# actor, against ~5k and ~10 ms in a plain transformers loop's update. Kept (blocks up to
# 32 MB from the heap, the heap never trimmed): ~0.5-0.9k faults and ~4-9 ms.
MALLOC_KEPT = {"mmap_threshold": 32 * 1024 * 1024, "trim_threshold": 2**31 - 1}
_MALLOPT = {"trim_threshold": -1, "mmap_threshold": -3}  # glibc's M_TRIM_ / M_MMAP_THRESHOLD


def malloc_kept_env() -> dict[str, str]:
    """`MALLOC_KEPT` as glibc's tunables, for a CPU process started with this environment;
    nothing where the environment sets `GLIBC_TUNABLES` already (the user's)."""
    if "GLIBC_TUNABLES" in os.environ:
        return {}
    return {"GLIBC_TUNABLES": ":".join(f"glibc.malloc.{k}={v}" for k, v in MALLOC_KEPT.items())}


def keep_freed_memory() -> bool:
    """`MALLOC_KEPT` in this running process (glibc's `mallopt`); False where the C library
    is not glibc, or `GLIBC_TUNABLES` is set (the user's, or this process started with
    `malloc_kept_env`)."""
    import ctypes
    import ctypes.util

    if "GLIBC_TUNABLES" in os.environ:
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    return all(mallopt(_MALLOPT[k], v) == 1 for k, v in MALLOC_KEPT.items())


@contextmanager
def collection_deferred() -> Iterator[Callable[[], None]]:
    """Inside: Python's cyclic garbage collector is off until `started()` (what this yields)
    is called, or the block ends; `started()` collects once, freezes every object still
    alive (`gc.freeze`: later collections never scan them), then turns the collector back
    on (if it was on). The one collection first keeps garbage out of the frozen objects (a
    cycle holding device memory would never be freed).

    For the start of a long-lived process: its imports and build create millions of objects
    that live as long as it does, and each automatic full collection scans them all again
    (here ~1 s of the trainer's start in 8 collections, ~1.5 s of a server's imports in
    10; the one collection ~0.4 s). Frozen, they also stay out of every later collection."""
    was_on = gc.isenabled()
    gc.disable()
    done = False

    def started() -> None:
        nonlocal done
        if not done:
            done = True
            gc.collect()
            gc.freeze()
            if was_on:
                gc.enable()

    try:
        yield started
    finally:
        started()


def share_cpu_cores(active_processes: int) -> int:
    """Give this process `cpu_threads(active_processes)` torch threads (see there)."""
    import torch

    threads = cpu_threads(active_processes)
    torch.set_num_threads(threads)
    return threads


def fsync_dir(path: str | os.PathLike) -> None:
    """Make a directory's entries (creations, renames) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@contextmanager
def atomic_output(path: str | os.PathLike) -> Iterator[Path]:
    """A temp path to write `path`'s new content to; renamed over `path` once the block ends.

    A writer that dies half-way (an error, a full disk, a kill) must leave neither a torn file
    at `path` nor any change to a file already there: readers see the old file or the whole
    new one. The temp file is hidden, unique per call and in `path`'s directory (a rename is
    atomic only within one file system); it is fsynced before the rename and the directory
    after, so a crash right after does not bring back the old file or an empty one. On an
    exception the temp file is removed and the exception propagates.
    """
    final = Path(path)
    final.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=final.parent, prefix=f".{final.name}.", suffix=".tmp")
    os.fchmod(fd, 0o666 & ~_umask())  # mkstemp makes it 0600; the result is an ordinary file
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        yield tmp
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(final.parent)


def exit_process(code: int) -> NoReturn:
    """End the process with `code` the way Python would, minus its final teardown.

    Python joins the non-daemon threads, runs the atexit handlers (trackers, logging, child
    processes, SGLang servers), flushes stdout and stderr, and then frees every module and
    object one by one: 3.6 s for a finished CPU trainer here (torch, Megatron-Core), which
    every run and every rank paid. That last part is skipped; nothing of a run is in it.
    """
    import atexit
    import contextlib
    import sys
    import threading

    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # closed, or a broken pipe
            stream.flush()
    os._exit(code)


def die_with_parent(parent: int, sig: int = signal.SIGKILL) -> None:
    """In a forked child: ask the kernel for signal `sig` (default SIGKILL) when the parent
    dies (Linux; the thread that forked, in fact: fork from the main thread), and exit if it
    already has."""
    import contextlib
    import ctypes

    pr_set_pdeathsig = 1
    with contextlib.suppress(AttributeError, OSError):  # not Linux: the child may outlive it
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, sig)
    if os.getppid() != parent:
        os._exit(1)
