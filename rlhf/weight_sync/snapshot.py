"""The restart snapshot, written in the background: the sync hands over a host copy of each
bucket and goes on.

A restarted server comes back with its initial weights; `WeightSyncer.reload` loads the
last synced version into it from a snapshot on disk (a `DiskTransport` that talks to no
server). Written inside the sync, that was a full HF checkpoint on the critical path of
every step (15 GB at 7B, 61 GB at 30B-A3B). Here a writer thread writes the shards: the
sync's cost is one device-to-host copy per bucket, and at most `MAX_PENDING` buckets wait
in host memory (the sync waits for the writer beyond that). `wait()` (before a reload, and
at the next sync's start) returns once everything handed over is written, and raises what
the writer failed with.
"""

from __future__ import annotations

import queue
import threading
from typing import Any

from rlhf.weight_sync.gather import Bucket
from rlhf.weight_sync.transports import DiskTransport

MAX_PENDING = 2  # buckets in host memory waiting for the writer


class BackgroundSnapshot:
    """A `DiskTransport` snapshot whose writes run in a thread (the syncer's `snapshot`)."""

    concurrent_deliveries = True
    deliver_while_packing = False

    def __init__(self, disk: DiskTransport):
        self.disk = disk
        self._work: queue.Queue = queue.Queue(maxsize=MAX_PENDING)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._write, name="weight-snapshot", daemon=True)
        self._thread.start()

    def begin(self, version: int) -> None:
        self.wait()
        self._work.put((self.disk.begin, (version,)))

    def pack(self, bucket: Bucket, last: bool, version: int) -> None:
        """Hand a host copy of `bucket` to the writer (the bucket's memory is reused by the
        next one as soon as this returns)."""
        copied = [(name, tensor.detach().to("cpu", copy=True)) for name, tensor in bucket]
        self._work.put((self.disk.pack, (copied, last, version)))

    def deliver(self, url: str, packed: Any, last: bool, version: int) -> None:
        pass  # a snapshot talks to no server until `load_into`

    def after_sync(self) -> None:
        pass

    def wait(self) -> None:
        """Everything handed over is written; the writer's error, if any, raised here."""
        self._work.join()
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(f"the weight sync's restart snapshot failed: {error}") from error

    def load_into(self, url: str, version: int) -> None:
        self.wait()
        self.disk.load_into(url, version)

    def forget(self, url: str) -> None:
        pass

    def close(self) -> None:
        if self._thread.is_alive():
            self._work.put(None)
            self._thread.join()

    def _write(self) -> None:
        while (item := self._work.get()) is not None:
            call, args = item
            try:
                if self._error is None:  # after a failure the version is lost anyway
                    call(*args)
            except BaseException as e:
                self._error = e
            finally:
                self._work.task_done()
        self._work.task_done()
