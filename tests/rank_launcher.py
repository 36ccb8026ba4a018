"""Worker scripts on N gloo ranks, as torchrun starts them, without paying the imports each time.

A torchrun launch costs ~8 s on 2 cores before a worker does anything: torchrun imports torch,
then every rank imports torch, Megatron-Core and transformers again; the distributed tests
launch about fifty workers. Here the ranks are forked from one multiprocessing fork server
that imported those once per pytest session. Each rank gets torchrun's environment (RANK,
LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT) and runs the script as
`__main__`, so the worker initialises its gloo process group through the same env:// path
as under torchrun. As torchrun does, a rank that fails stops the others.

What torchrun itself does (its rendezvous, its signal handling) is tested where it matters:
tests/distributed/test_bootstrap.py and every multi-process `rlhf-train` run use real torchrun.
"""

from __future__ import annotations

import atexit
import faulthandler
import multiprocessing
import os
import runpy
import signal
import sys
import time
from pathlib import Path

# Imported once in the fork server; a rank forked from it finds them in sys.modules.
PRELOAD = ["torch", "torch.distributed", "megatron.core", "transformers", "rlhf.engine.build"]
_context: multiprocessing.context.ForkServerContext | None = None


def _forkserver() -> multiprocessing.context.ForkServerContext:
    global _context
    if _context is None:
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload(PRELOAD)
    return _context


def _run_rank(script: str, args: list[str], env: dict[str, str], log_path: str) -> None:
    """In the forked rank: torchrun's environment, output to the log, the script as __main__."""
    os.environ.update(env)
    fd = os.open(log_path, os.O_WRONLY | os.O_APPEND)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 (lives as the rank does)
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the timeout asks where it hangs
    sys.argv = [script, *args]
    sys.path[:0] = [str(Path(script).parent), *env.get("PYTHONPATH", "").split(os.pathsep)]
    try:
        runpy.run_path(script, run_name="__main__")
    finally:  # a forked process ends with os._exit: run what the worker registered, as at exit
        atexit._run_exitfuncs()


def launch_ranks(
    script: Path,
    nproc: int,
    args: list[str],
    env: dict[str, str],
    log_path: Path,
    master_port: int,
    timeout_s: float,
) -> int:
    """Run `script` on `nproc` ranks; their exit code (the first non-zero one, or 0).

    Every rank appends to `log_path`. A rank that fails (or the timeout) ends the others:
    SIGTERM, then SIGKILL after 10 s. At the timeout each live rank first writes its threads'
    Python stacks to the log (faulthandler on SIGUSR1), so a hang says where it hangs.
    """
    context = _forkserver()
    base = {
        **env,
        "WORLD_SIZE": str(nproc),
        "LOCAL_WORLD_SIZE": str(nproc),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(master_port),
    }
    ranks = []
    for rank in range(nproc):
        rank_env = {**base, "RANK": str(rank), "LOCAL_RANK": str(rank)}
        process = context.Process(
            target=_run_rank, args=(str(script), args, rank_env, str(log_path)), daemon=False
        )
        process.start()
        ranks.append(process)
    deadline = time.monotonic() + timeout_s
    failed = 0
    while any(p.is_alive() for p in ranks) and not failed and time.monotonic() < deadline:
        time.sleep(0.05)
        failed = next((p.exitcode for p in ranks if p.exitcode), 0)
    if any(p.is_alive() for p in ranks):
        if not failed:
            _dump_stacks(ranks)
        _stop(ranks)
        if not failed:
            raise TimeoutError(f"{script.name} on {nproc} ranks did not finish in {timeout_s} s")
    return failed or next((p.exitcode for p in ranks if p.exitcode), 0)


def _dump_stacks(ranks: list[multiprocessing.process.BaseProcess]) -> None:
    for process in ranks:
        if process.is_alive() and process.pid is not None:
            os.kill(process.pid, signal.SIGUSR1)
    time.sleep(2)


def _stop(ranks: list[multiprocessing.process.BaseProcess]) -> None:
    for process in ranks:
        if process.is_alive():
            process.terminate()
    deadline = time.monotonic() + 10
    for process in ranks:
        process.join(max(0.0, deadline - time.monotonic()))
        if process.is_alive():
            process.kill()
            process.join()
