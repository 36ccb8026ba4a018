"""One weight sync: every rank walks the model, the sender pushes buckets to every server.

    syncer = WeightSyncer(transport, server_urls, arch, topology, bucket_bytes)
    stats = syncer.sync(model, version=step)      # on every rank of the training job

The servers get `begin_weight_update` ... `end_weight_update` around the buckets (SGLang
0.5.23 refuses tensor/distributed updates outside such a window), the KV cache is flushed
with the last bucket, and the servers report `version` as their weight version.

A server that dies and is restarted comes back with the *initial* weights. With a
`snapshot` (a `DiskTransport` that talks to no server) the sender also keeps the last
synced weights on disk, and `resync_server(url)` loads them into the restarted server
without involving the other ranks; the disk transport is its own snapshot.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch.distributed as dist

from rlhf.models.families import ModelArch
from rlhf.weight_sync.gather import SyncTopology, iter_buckets
from rlhf.weight_sync.http import get, post
from rlhf.weight_sync.probe import check_parity, logprob_diff_max, probe_tokens
from rlhf.weight_sync.transports import DiskTransport

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SyncStats:
    """What one sync moved (counted on the sender; zeros elsewhere)."""

    seconds: float
    num_bytes: int
    num_tensors: int
    num_buckets: int
    max_bucket_bytes: int
    logprob_diff_max: float | None = None  # the parity probe, when run


class WeightSyncer:
    def __init__(
        self,
        transport,
        server_urls: list[str],
        arch: ModelArch,
        topology: SyncTopology,
        bucket_bytes: int,
        snapshot: DiskTransport | None = None,
        probe: bool = True,
        probe_threshold: float | None = None,
    ):
        self.transport = transport
        self.server_urls = server_urls
        self.arch = arch
        self.topology = topology
        self.bucket_bytes = bucket_bytes
        self.snapshot = transport if isinstance(transport, DiskTransport) else snapshot
        self.version: int | None = None
        self.probe = probe
        self.probe_threshold = probe_threshold

    def sync(self, model, version: int) -> SyncStats:
        start = time.perf_counter()
        sender = self.topology.is_sender
        writers = [self.transport] + (
            [self.snapshot] if self.snapshot not in (None, self.transport) else []
        )
        if sender:
            for url in self.server_urls:
                post(url, "begin_weight_update")
            for writer in writers:
                writer.open(version)
        num_bytes = num_tensors = num_buckets = max_bucket = 0
        pending = None  # hold one bucket back so the last one is known when sent
        for bucket in iter_buckets(model, self.arch, self.topology, self.bucket_bytes):
            if pending is not None:
                for writer in writers:
                    writer.send(pending, False, version)
            pending = bucket
            size = sum(t.numel() * t.element_size() for _, t in bucket)
            num_bytes, num_tensors = num_bytes + size, num_tensors + len(bucket)
            num_buckets, max_bucket = num_buckets + 1, max(max_bucket, size)
        if sender:
            for writer in writers:
                writer.send(pending, True, version)
                writer.close(version)
            for url in self.server_urls:
                post(url, "end_weight_update")
        self.version = version
        if dist.is_initialized():
            dist.barrier()
        seconds = time.perf_counter() - start
        diff = self._probe(model) if self.probe else None
        return SyncStats(seconds, num_bytes, num_tensors, num_buckets, max_bucket, diff)

    def _probe(self, model) -> float:
        """rollout/logprob_diff_max over every server; raises above the threshold."""
        tokens = probe_tokens(self.arch.vocab_size)
        diff = max(
            logprob_diff_max(model, self.arch, self.topology, url, tokens)
            for url in self.server_urls
        )
        log.debug("weight sync v%s: rollout/logprob_diff_max = %.3e", self.version, diff)
        check_parity(diff, self.probe_threshold)
        return diff

    def resync_server(self, url: str) -> None:
        """Load the last synced weights into a restarted server (sender rank only)."""
        if self.version is None:
            return  # nothing synced yet: the restarted server's initial weights are current
        if self.snapshot is None:
            raise RuntimeError(
                f"SGLang server {url} restarted with its initial weights and cannot be re-synced: "
                "enable actor_rollout_ref.rollout.weight_sync_snapshot or use the disk transport"
            )
        post(url, "begin_weight_update")
        self.snapshot.load_into(url, self.version)
        post(url, "end_weight_update")


def server_weight_version(url: str) -> str | None:
    """The weight version a server reports (`/model_info`)."""
    return get(url, "model_info").get("weight_version")
