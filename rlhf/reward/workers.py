"""Reward functions in worker processes: a per-call timeout, and failures that name the sample.

A custom reward function (`reward.custom_fn`) is code the run does not control: it may raise
on some rows, return something that is not a number, or never return. It therefore runs in
`reward.num_workers` spawned processes (at least one), each building the function from the
config, one response at a time, each call bounded by `reward.timeout_s`. A raise, a
non-number, a timeout or a worker that dies becomes a
`RewardFunctionError`: one line naming the sample (its row and file, data source, the start of
the response and the ground truth) and what went wrong. A worker that timed out is killed
with SIGKILL (the function may ignore anything gentler) and replaced. Workers ignore SIGINT
and SIGTERM, which a scheduler sends to every process of a job: the trainer decides when the
run ends and stops them then; a trainer killed outright leaves them at their next read (EOF).
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing
import multiprocessing.connection
import signal
import time
from dataclasses import dataclass
from typing import Any

from rlhf.errors import ExternalError

OK, FAILED = "ok", "failed"


class RewardFunctionError(RuntimeError, ExternalError):
    """The reward function failed on a sample (the message names it)."""

    kind = "reward failed"


def describe(item: Any) -> str:
    """A sample, as a failure names it."""
    where = f"{item.origin}, " if item.origin else ""
    return (
        f"{where}data_source {item.data_source!r}, response {item.response_text[:80]!r}, "
        f"ground truth {item.ground_truth!r}"
    )


def raw_score(fn: Any, item: Any) -> float:
    """`fn`'s score of `item` (a `RewardInput`), unchecked."""
    return float(fn(item.data_source, item.response_text, item.ground_truth, item.extra_info))


def _serve(conn: multiprocessing.connection.Connection, reward_cfg: Any) -> None:
    """A worker: build the function, then score the items it is sent until None or EOF."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    from rlhf.reward.registry import build_reward_fn

    try:
        fn = build_reward_fn(reward_cfg)
    except Exception as e:  # the user's file may raise anything while it is imported
        conn.send((FAILED, f"{type(e).__name__}: {e}"))
        return
    conn.send((OK, None))
    while True:
        try:
            item = conn.recv()
        except EOFError:
            return
        if item is None:
            return
        try:
            conn.send((OK, raw_score(fn, item)))
        except Exception as e:
            conn.send((FAILED, f"{type(e).__name__}: {e}"))


@dataclass
class _Worker:
    process: Any
    conn: multiprocessing.connection.Connection
    index: int = -1  # the item it is scoring (-1: idle)
    deadline: float = 0.0


class RewardWorkers:
    """`workers(items) -> scores` in `count` processes, each call within `timeout_s`."""

    def __init__(self, reward_cfg: Any, count: int, timeout_s: float):
        self.reward_cfg, self.count, self.timeout_s = reward_cfg, count, timeout_s
        self.context = multiprocessing.get_context("spawn")
        self.workers: list[_Worker] = []
        atexit.register(self.close)  # before multiprocessing joins its children at exit

    def _start(self) -> _Worker:
        parent, child = self.context.Pipe()
        # not daemonic: a user's function may start processes of its own (a sandbox, a
        # verifier with a process-based timeout); a worker ends at EOF when its trainer dies
        process = self.context.Process(target=_serve, args=(child, self.reward_cfg))
        process.start()
        child.close()
        worker = _Worker(process, parent)
        if not parent.poll(max(self.timeout_s, 120.0)):  # imports, then the user's file
            self._kill(worker)
            raise RewardFunctionError("the reward worker did not start (reward.custom_fn)")
        try:
            status, detail = parent.recv()
        except EOFError:
            status, detail = FAILED, f"the worker exited (code {process.exitcode})"
        if status != OK:
            self._kill(worker)
            raise RewardFunctionError(f"the reward function could not be built: {detail}")
        return worker

    def __call__(self, items: list[Any]) -> list[float]:
        while len(self.workers) < min(self.count, max(len(items), 1)):
            self.workers.append(self._start())
        busy: list[_Worker] = []
        try:
            return self._score(items, busy)
        except RewardFunctionError:
            for worker in busy:  # their answers would be read as the next call's
                if worker in self.workers:
                    self._replace(worker)
            raise

    def _score(self, items: list[Any], busy: list[_Worker]) -> list[float]:
        scores: list[float] = [0.0] * len(items)
        pending = list(range(len(items)))[::-1]
        while pending or busy:
            for worker in self.workers:
                if worker.index < 0 and pending:
                    worker.index = pending.pop()
                    worker.deadline = time.monotonic() + self.timeout_s
                    worker.conn.send(items[worker.index])
                    busy.append(worker)
            wait_s = max(0.0, min(w.deadline for w in busy) - time.monotonic())
            ready = multiprocessing.connection.wait([w.conn for w in busy], timeout=wait_s)
            for worker in list(busy):
                if worker.conn in ready:
                    scores[worker.index] = self._receive(worker, items[worker.index])
                elif time.monotonic() >= worker.deadline:
                    self._replace(worker)
                    raise RewardFunctionError(
                        f"the reward function did not return within {self.timeout_s:g} s "
                        f"(reward.timeout_s) on {describe(items[worker.index])}"
                    )
                else:
                    continue
                worker.index = -1
                busy.remove(worker)
        return scores

    def _receive(self, worker: _Worker, item: Any) -> float:
        try:
            status, value = worker.conn.recv()
        except EOFError:
            worker.process.join(timeout=10)  # reaped, so that its exit code is known
            code = worker.process.exitcode
            self._replace(worker)
            raise RewardFunctionError(
                f"the reward worker died (exit code {code}) on {describe(item)}"
            ) from None
        if status != OK:
            raise RewardFunctionError(f"the reward function failed on {describe(item)}: {value}")
        return value

    def _replace(self, worker: _Worker) -> None:
        self._kill(worker)
        self.workers.remove(worker)

    @staticmethod
    def _kill(worker: _Worker) -> None:
        worker.process.kill()
        worker.process.join(timeout=10)
        worker.conn.close()

    def close(self) -> None:
        for worker in self.workers:
            with contextlib.suppress(OSError):  # already gone
                worker.conn.send(None)
            worker.process.join(timeout=5)
            if worker.process.is_alive():
                worker.process.kill()
        self.workers = []
