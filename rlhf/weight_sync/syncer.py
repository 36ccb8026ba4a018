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
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from rlhf.models.families import ModelArch
from rlhf.rollout import sglang_api
from rlhf.weight_sync.gather import SyncTopology, iter_buckets
from rlhf.weight_sync.probe import check_parity, logprob_diff_max, probe_tokens
from rlhf.weight_sync.transports import DiskTransport, Transport

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SyncStats:
    """What one sync moved (counted on the sender; zeros elsewhere)."""

    seconds: float
    num_bytes: int
    num_tensors: int
    num_buckets: int
    max_bucket_bytes: int


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

    def _writers(self) -> list[Transport]:
        writers: list[Transport] = [self.transport]
        if self.snapshot is not None and self.snapshot is not self.transport:
            writers.append(self.snapshot)
        return writers

    def sync(self, model: nn.Module, version: int) -> SyncStats:
        """Send `model`'s weights to every server as `version` (all ranks call)."""
        start = time.perf_counter()
        sender, writers = self.topology.is_sender, self._writers()
        if sender:
            for url in self.server_urls:
                sglang_api.begin_weight_update(url)
            for writer in writers:
                writer.begin(version)
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
            assert pending is not None, "a model has at least one parameter"
            for writer in writers:
                writer.send(pending, True, version)
                writer.finish(version)
            for url in self.server_urls:
                sglang_api.end_weight_update(url)
        self.version = version
        if dist.is_initialized():
            dist.barrier()
        seconds = time.perf_counter() - start
        return SyncStats(seconds, num_bytes, num_tensors, num_buckets, max_bucket)

    def compare_probe(self, actor_logprobs: torch.Tensor, device: torch.device) -> float:
        """rollout/logprob_diff_max of `actor_logprobs` (the actor's log-probs of
        `probe_tokens[1:]`) against every server; raises above the threshold. All ranks call."""
        diff = logprob_diff_max(
            actor_logprobs, self.probe_tokens, self.server_urls, self.topology.is_sender, device
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
        sglang_api.begin_weight_update(url)
        self.snapshot.load_into(url, self.version)
        sglang_api.end_weight_update(url)

    def close(self) -> None:
        """Release the transports' resources (the distributed transport's process groups)."""
        for writer in self._writers():
            writer.close()
