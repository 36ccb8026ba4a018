"""One weight sync: every rank walks the model, the sender pushes buckets to every server.

    syncer = WeightSyncer(transport, server_urls, arch, topology, bucket_bytes)
    stats = syncer.sync(model, version=step)      # on every rank of the training job
    diff = syncer.compare_probe(actor_logprobs)   # rollout/logprob_diff_max, every rank
    syncer.close()                                # at the end of the run

The servers get `begin_weight_update` ... `end_weight_update` around the buckets (SGLang
0.5.23 refuses tensor/distributed updates outside such a window), the KV cache is flushed
with the last bucket, and the servers report `version` as their weight version.

A server that dies and is restarted comes back with the *initial* weights. With a
`snapshot` (a `DiskTransport` that talks to no server) the sender also keeps the last
synced weights on disk, and `resync_server(url)` loads them into the restarted server
without involving the other ranks; the disk transport is its own snapshot.

A server that stops answering during a sync (or the probe) is left out of the rest of it,
so the other servers and the other ranks finish the sync as usual; then the sender has it
restarted (`restart_server`, the rollout engine's recovery, bounded by
`rollout.max_server_restarts`) and loads the snapshot into it.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from rlhf.models.families import ModelArch
from rlhf.rollout import sglang_api
from rlhf.rollout.server_group import ServerLost
from rlhf.weight_sync.gather import Bucket, SyncTopology, iter_buckets
from rlhf.weight_sync.probe import check_parity, logprob_diff_max, probe_tokens
from rlhf.weight_sync.transports import DiskTransport, Transport

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class SyncStats:
    """What one sync moved (counted on the sender; zeros elsewhere)."""

    seconds: float
    num_bytes: int
    num_tensors: int
    num_buckets: int
    max_bucket_bytes: int
    # seconds by phase: gather (TP/PP gathers, HF layout, bucketing), pack (flatten and
    # serialize, or write the disk shard), snapshot (the restart snapshot's shard), deliver
    # (the servers receive and load the buckets; begin/end of the update window included)
    phase_s: dict[str, float] = field(default_factory=dict)


class WeightSyncer:
    """Owns the transport (and the restart snapshot) of one set of servers."""

    def __init__(
        self,
        transport: Transport,
        server_urls: list[str],
        arch: ModelArch,
        topology: SyncTopology,
        bucket_bytes: int,
        snapshot: DiskTransport | None = None,
        probe_threshold: float | None = None,
    ):
        self.transport = transport
        self.server_urls = server_urls
        self.arch = arch
        self.topology = topology
        self.bucket_bytes = bucket_bytes
        self.snapshot = transport if isinstance(transport, DiskTransport) else snapshot
        self.version: int | None = None
        self.probe_threshold = probe_threshold
        self.probe_tokens = probe_tokens(arch.vocab_size)
        # url -> None: restarts a lost server (the rollout engine's recovery); set by the
        # trainer on the rank that owns the servers, which is the sender
        self.restart_server: Callable[[str], None] | None = None

    def _writers(self) -> list[Transport]:
        writers: list[Transport] = [self.transport]
        if self.snapshot is not None and self.snapshot is not self.transport:
            writers.append(self.snapshot)
        return writers

    def sync(self, model: nn.Module, version: int) -> SyncStats:
        """Send `model`'s weights to every server as `version` (all ranks call)."""
        start, phases = time.perf_counter(), Phases()
        sender, writers = self.topology.is_sender, self._writers()
        targets = _Targets(list(self.server_urls) if sender else [], self.transport, version)
        if sender:
            with phases("deliver"):
                targets.each(sglang_api.begin_weight_update)
            for writer in writers:
                writer.begin(version)
        num_bytes = num_tensors = num_buckets = max_bucket = 0
        pending = None  # hold one bucket back so the last one is known when sent
        for bucket in phases.iterate(
            "gather", iter_buckets(model, self.arch, self.topology, self.bucket_bytes)
        ):
            if pending is not None:
                self._send(pending, False, version, targets, phases)
            pending = bucket
            size = sum(t.numel() * t.element_size() for _, t in bucket)
            num_bytes, num_tensors = num_bytes + size, num_tensors + len(bucket)
            num_buckets, max_bucket = num_buckets + 1, max(max_bucket, size)
        if sender:
            assert pending is not None, "a model has at least one parameter"
            self._send(pending, True, version, targets, phases)
            with phases("deliver"):
                targets.each(sglang_api.end_weight_update)
        self.version = version
        for url in targets.lost:
            self.recover_server(url)
        if dist.is_initialized():
            dist.barrier()
        seconds = time.perf_counter() - start
        return SyncStats(
            seconds, num_bytes, num_tensors, num_buckets, max_bucket, dict(phases.seconds)
        )

    def _send(
        self, bucket: Bucket, last: bool, version: int, targets: _Targets, phases: Phases
    ) -> None:
        """Pack `bucket` for every writer (the snapshot too), deliver it to the live servers."""
        with phases("pack"):
            packed = self.transport.pack(bucket, last, version)
        if self.snapshot is not None and self.snapshot is not self.transport:
            with phases("snapshot"):
                self.snapshot.pack(bucket, last, version)
        with phases("deliver"):
            targets.each(self.transport.deliver, packed, last, version)

    def recover_server(self, url: str) -> None:
        """Have the lost server at `url` restarted, then make it hold the synced version
        (sender rank only). Raises when it cannot be restarted."""
        if self.restart_server is None:
            raise ServerLost(f"SGLang server {url} was lost and nobody can restart it")
        self.restart_server(url)  # a restarted server is re-synced by the restart hook
        if sglang_api.weight_version(url) != str(self.version):
            # alive (it answered too late), with this sync's update window still open
            with contextlib.suppress(sglang_api.SGLangAPIError):
                sglang_api.end_weight_update(url)
            self.resync_server(url)
        log.warning("SGLang server %s holds the weights of version %s again", url, self.version)

    def compare_probe(self, actor_logprobs: torch.Tensor, device: torch.device) -> float:
        """rollout/logprob_diff_max of `actor_logprobs` (the actor's log-probs of
        `probe_tokens[1:]`) against every server; raises above the threshold. All ranks call."""
        diff = logprob_diff_max(
            actor_logprobs,
            self._server_logprobs,
            self.server_urls,
            self.topology.is_sender,
            device,
        )
        log.debug("weight sync v%s: rollout/logprob_diff_max = %.3e", self.version, diff)
        check_parity(diff, self.probe_threshold)
        return diff

    def _server_logprobs(self, url: str) -> list[float]:
        """The server's log-probs of the probe; a lost server is recovered and asked again."""
        try:
            return sglang_api.prompt_logprobs(url, self.probe_tokens)
        except sglang_api.SGLangAPIError as e:
            if not e.unreachable:
                raise
            log.warning("SGLang server %s lost during the log-prob probe: %s", url, e)
        self.recover_server(url)
        return sglang_api.prompt_logprobs(url, self.probe_tokens)

    def resync_server(self, url: str) -> None:
        """Load the last synced weights into a restarted server (sender rank only)."""
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


class _Targets:
    """The servers a sync still delivers to; one that stops answering is moved to `lost`
    (and its transport state forgotten) instead of failing the sync for everyone."""

    def __init__(self, urls: list[str], transport: Transport, version: int):
        self.live, self.lost = urls, list[str]()
        self.transport, self.version = transport, version

    def each(self, call: Callable[..., None], *args: Any) -> None:
        """`call(url, *args)` for every live server."""
        for url in list(self.live):
            try:
                call(url, *args)
            except sglang_api.SGLangAPIError as e:
                if not e.unreachable:
                    raise  # the server answered with a failure: not a lost server
                log.warning(
                    "SGLang server %s lost during weight sync v%d (%s); it is restarted and "
                    "re-synced after this sync",
                    url,
                    self.version,
                    e,
                )
                self.live.remove(url)
                self.lost.append(url)
                self.transport.forget(url)


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
