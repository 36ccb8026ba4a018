"""One weight sync: every rank walks the model, the sender pushes buckets to every server.

    syncer = WeightSyncer(transport, server_urls, arch, topology, bucket_bytes)
    stats = syncer.sync(model, version=step)      # on every rank of the training job
    syncer.reload(url)                            # a restarted server gets the last version
    syncer.close()                                # at the end of the run

Gather and transport only: which servers to sync, when, and what to do about a lost one is
decided by their owner (`rlhf.rollout.policy_servers.PolicyServers`). The servers get
`begin_weight_update` ... `end_weight_update` around the buckets (SGLang 0.5.23 refuses
tensor/distributed updates outside such a window), the KV cache is flushed with the last
bucket, and the servers report `version` as their weight version.

A server that dies and is restarted comes back with the *initial* weights. With a
`snapshot` (`rlhf.weight_sync.snapshot`: a disk copy written in the background) the sender
also keeps the last synced weights on disk, and `reload(url)` loads them into the
restarted server without involving the other ranks; the disk transport is its own
snapshot.

A server that stops answering during a sync is left out of the rest of it, so the other
servers and the other ranks finish the sync as usual; `SyncStats.lost` names it.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch.distributed as dist
from torch import nn

from rlhf import sglang_api
from rlhf.models.families import ModelArch
from rlhf.sglang_api import ServerLost
from rlhf.weight_sync.gather import Bucket, SyncTopology, iter_buckets
from rlhf.weight_sync.snapshot import BackgroundSnapshot
from rlhf.weight_sync.transports import DiskTransport, Transport

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class SyncStats:
    """What one sync moved (counted where the buckets are: the sender, or every rank when
    they are spread; zeros elsewhere)."""

    seconds: float
    num_bytes: int
    num_tensors: int
    num_buckets: int
    max_bucket_bytes: int
    # seconds by phase: gather (TP/PP gathers, HF layout, bucketing), pack (flatten and
    # serialize, or write the disk shard), snapshot (the restart snapshot's shard), deliver
    # (the servers receive and load the buckets; begin/end of the update window included)
    phase_s: dict[str, float] = field(default_factory=dict)
    lost: list[str] = field(default_factory=list)  # servers that stopped answering (sender)


class WeightSyncer:
    """Owns the transport (and the restart snapshot) of one set of servers."""

    def __init__(
        self,
        transport: Transport,
        server_urls: list[str],
        arch: ModelArch,
        topology: SyncTopology,
        bucket_bytes: int,
        snapshot: BackgroundSnapshot | None = None,
    ):
        self.transport = transport
        self.server_urls = server_urls
        self.arch = arch
        self.topology = topology
        self.bucket_bytes = bucket_bytes
        self.snapshot = transport if isinstance(transport, DiskTransport) else snapshot
        self.version: int | None = None  # the last version synced

    def _writers(self) -> list[Transport]:
        writers: list[Transport] = [self.transport]
        if self.snapshot is not None and self.snapshot is not self.transport:
            writers.append(self.snapshot)
        return writers

    def sync(self, model: nn.Module, version: int) -> SyncStats:
        """Send `model`'s weights to every server as `version` (all ranks call)."""
        start, phases = time.perf_counter(), Phases()
        sender, writers = self.topology.is_sender, self._writers()
        # buckets reach the sender, or every rank when handles are spread (`everywhere`)
        urls = list(self.server_urls) if sender else []
        transport = self.transport
        targets = Targets(urls, version, transport.concurrent_deliveries, transport.forget)
        num_bytes = num_tensors = num_buckets = max_bucket = 0
        pending = None  # hold one bucket back so the last one is known when sent
        with Deliveries(self.transport.deliver_while_packing, phases) as deliveries:
            if sender:  # the update window opens while the first bucket is gathered
                deliveries.start(targets.each, sglang_api.begin_weight_update)
                for writer in writers:
                    writer.begin(version)
            for bucket in phases.iterate(
                "gather", iter_buckets(model, self.arch, self.topology, self.bucket_bytes)
            ):
                if pending is not None:
                    self._send(pending, False, version, targets, phases, deliveries)
                pending = bucket
                size = sum(t.numel() * t.element_size() for _, t in bucket)
                num_bytes, num_tensors = num_bytes + size, num_tensors + len(bucket)
                num_buckets, max_bucket = num_buckets + 1, max(max_bucket, size)
            assert pending is not None or not sender, "a model has at least one parameter"
            if pending is not None:
                self._send(pending, True, version, targets, phases, deliveries)
        if sender:
            with phases("deliver"):
                targets.each(sglang_api.end_weight_update)
        self.version = version
        if dist.is_initialized():
            dist.barrier()
        for writer in writers:  # every server has loaded every bucket
            writer.after_sync()
        seconds = time.perf_counter() - start
        return SyncStats(
            seconds,
            num_bytes,
            num_tensors,
            num_buckets,
            max_bucket,
            dict(phases.seconds),
            targets.lost,
        )

    def _send(
        self,
        bucket: Bucket,
        last: bool,
        version: int,
        targets: Targets,
        phases: Phases,
        deliveries: Deliveries,
    ) -> None:
        """Pack `bucket` for every writer (the snapshot too, on the sender), deliver it to
        the live servers (the sender's; in the background when the transport allows: see
        `Deliveries`)."""
        with phases("pack"):
            packed = self.transport.pack(bucket, last, version)
        if not self.topology.is_sender:
            return
        if self.snapshot is not None and self.snapshot is not self.transport:
            with phases("snapshot"):
                self.snapshot.pack(bucket, last, version)
        deliveries.start(targets.each, self.transport.deliver, packed, last, version)

    def reload(self, url: str) -> None:
        """Load the last synced weights into a restarted server (sender rank only)."""
        self.transport.forget(url)  # lost outside a sync (the probe, a rollout): still held
        if self.version is None:
            return  # nothing synced yet: the restarted server's initial weights are current
        if self.snapshot is None:
            raise ServerLost(
                f"SGLang server {url} restarted with its initial weights and cannot be re-synced: "
                "enable actor_rollout_ref.rollout.weight_sync_snapshot or use the disk transport"
            )
        sglang_api.begin_weight_update(url)
        self.snapshot.load_into(url, self.version)
        sglang_api.end_weight_update(url)

    def close(self) -> None:
        """Release the transports' resources (the distributed transport's process groups)."""
        for writer in self._writers():
            writer.close()


class Deliveries:
    """Runs each bucket's delivery, one at a time and in order: in a background thread
    when `overlapped` (the server loads bucket k while this rank gathers and packs bucket
    k + 1), else at once. `start` waits for the delivery before it; leaving the context
    waits for the last. "deliver" counts only the time spent waiting."""

    def __init__(self, overlapped: bool, phases: Phases):
        self.phases = phases
        self.pool = ThreadPoolExecutor(1) if overlapped else None
        self.running: Future | None = None

    def __enter__(self) -> Deliveries:
        return self

    def start(self, call: Callable[..., None], *args: Any) -> None:
        self.wait()
        if self.pool is None:
            with self.phases("deliver"):
                call(*args)
        else:
            self.running = self.pool.submit(call, *args)

    def wait(self) -> None:
        """The running delivery finished (its error, if any, raised here)."""
        running, self.running = self.running, None
        if running is not None:
            with self.phases("deliver"):
                running.result()

    def __exit__(self, kind, error, traceback) -> None:
        try:
            if error is None:
                self.wait()
        finally:
            if self.pool is not None:
                self.pool.shutdown(wait=True)


class Targets:
    """The servers a sync still delivers to; one that stops answering is moved to `lost`
    (and `forget(url)` called: the transport's state of it) instead of failing the sync
    for everyone."""

    def __init__(
        self, urls: list[str], version: int, concurrent: bool, forget: Callable[[str], None]
    ):
        self.live, self.lost = urls, list[str]()
        self.version, self.concurrent, self.forget = version, concurrent, forget

    def each(self, call: Callable[..., None], *args: Any) -> None:
        """`call(url, *args)` for every live server: all at once when the transport allows
        it (`concurrent`: their HTTP round trips and loads overlap), else one after
        another."""
        urls = list(self.live)
        if len(urls) > 1 and self.concurrent:
            with ThreadPoolExecutor(len(urls)) as pool:
                errors = list(pool.map(lambda url: _attempt(call, url, args), urls))
        else:
            errors = [_attempt(call, url, args) for url in urls]
        for url, error in zip(urls, errors, strict=True):
            if error is None:
                continue
            if not error.unreachable:
                raise error  # the server answered with a failure: not a lost server
            log.warning(
                "SGLang server %s lost during weight sync v%d (%s); its owner restarts "
                "and reloads it after this sync",
                url,
                self.version,
                error,
            )
            self.live.remove(url)
            self.lost.append(url)
            self.forget(url)


def _attempt(call: Callable[..., None], url: str, args: tuple) -> sglang_api.SGLangAPIError | None:
    """`call(url, *args)`; the SGLang API error it raised, if any."""
    try:
        call(url, *args)
    except sglang_api.SGLangAPIError as e:
        return e
    return None


class Phases:
    """Seconds spent per named phase, summed over a sync."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] += time.perf_counter() - start

    def iterate(self, name: str, items: Iterator[T]) -> Iterator[T]:
        """`items`, with the time spent producing each counted as `name`."""
        while True:
            with self(name):
                item = next(items, None)
            if item is None:
                return
            yield item
