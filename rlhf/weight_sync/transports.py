"""Three ways to move HF-named buckets into SGLang servers (run on the sender rank only).

- `tensor`: `update_weights_from_tensor` with one flattened bucket per call; tensors travel
  as shared-memory handles (CUDA IPC on GPU, each server TP rank's from the trainer rank on
  its own GPU; the file_system sharing strategy on CPU), so the server must share this
  machine.
- `distributed`: a process group per server with the sender as rank 0
  (`init_weights_update_group`); each bucket is one broadcast of a flat uint8 buffer while
  `update_weights_from_distributed` tells the server what to expect. gloo on CPU, nccl on GPU.
- `disk`: each bucket becomes a safetensors shard of a checkpoint directory, then
  `update_weights_from_disk` loads it (shared storage, any placement).

All follow `Transport`; the `WeightSyncer` wraps each sync in begin/end_weight_update and
delivers every packed bucket to each server. Buffers a process group carries live on the
device of its backend (`rlhf.distributed.context.rank_device`).
"""

from __future__ import annotations

import base64
import io
import json
import logging
import os
import shutil
from collections import deque
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch.distributed import PrefixStore, ProcessGroup, TCPStore

from rlhf import sglang_api
from rlhf.distributed.context import backend_for
from rlhf.distributed.stores import bound_store
from rlhf.weight_sync import shm_reaper
from rlhf.weight_sync.gather import CPU, Bucket
from rlhf.weight_sync.handle_plan import HandlePlan

log = logging.getLogger(__name__)
# a server joins its weight-sync group in seconds; one that never does (its join request
# failed) must not keep the sender waiting for torch's default half hour
STORE_TIMEOUT = timedelta(minutes=5)
STAGING_ALIGN = 64  # bytes; a cache line, and a multiple of every dtype's size


class Transport(Protocol):
    """One way of loading buckets into servers.

    Per sync: `begin` (on the sender), then for every bucket `pack` it once (flatten,
    serialize, write a file; on every rank that holds the bucket) and `deliver` the packed
    bucket to each server (on the sender), then `after_sync` (every rank). Per-server steps are
    separate so that a server lost in the middle of a sync can be left out (`forget`) while
    the others get every bucket; the syncer restarts and re-syncs it afterwards.
    `concurrent_deliveries`: the syncer delivers a bucket to all servers at once (from
    threads) rather than one after another. `deliver_while_packing`: a bucket's delivery
    may run while the next bucket is gathered and packed (`pack` never writes into the
    memory of the bucket before it)."""

    concurrent_deliveries: bool
    deliver_while_packing: bool

    def begin(self, version: int) -> None:
        """Prepare to send the weights of `version`."""
        ...

    def pack(self, bucket: Bucket, last: bool, version: int) -> Any:
        """The bucket in the form `deliver` sends (`last`: the final bucket of `version`)."""
        ...

    def deliver(self, url: str, packed: Any, last: bool, version: int) -> None:
        """Load one packed bucket into the server at `url` (`last`: it flushes its KV cache
        and takes `version`)."""
        ...

    def after_sync(self) -> None:
        """On every rank after a sync (every server has loaded every bucket): let go of
        what packing kept for the servers."""
        ...

    def forget(self, url: str) -> None:
        """Drop what is held for `url` (its server died or was restarted: the new process
        holds nothing of the old one's); it is set up anew on next use."""
        ...

    def close(self) -> None:
        """Release what the transport holds (process groups); idempotent."""
        ...


def _flattened(bucket: Bucket):
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    return FlattenedTensorBucket(named_tensors=bucket)


@dataclass(frozen=True)
class PackedHandles:
    """A bucket's handles, `handles[server][TP rank]` (on the sender)."""

    handles: list[list[str]]


class TensorTransport:
    """update_weights_from_tensor with flattened buckets (same-machine servers).

    Each server TP rank gets a handle to a bucket packed on its own device, by the rank
    `plan` names (`rlhf.weight_sync.handle_plan`): on GPU the trainer rank on that TP
    rank's GPU packs the bucket into a new tensor there (a CUDA IPC handle); on the CPU the
    sender packs every one into host shared memory (torch's file_system sharing strategy).
    `pack` runs on every rank that holds the bucket (with a spread plan: every rank, and
    the handles are gathered to the sender in the plan's gloo group); `deliver` on the
    sender. Deliveries to several servers run at once (HTTP calls handing each its
    handles).

    On the CPU every bucket is copied once into a staging buffer in shared memory kept
    across buckets and syncs (flattening into new memory and moving that into a new shm
    file costs two copies into freshly zeroed pages); the GPU packs into new device tensors
    (each source keeps its last ones, and `after_sync` lets them go and returns what the
    servers released to the allocator: `torch.cuda.ipc_collect`). Both use the same
    aligned layout (`pack`).

    A bucket is delivered while the next one is gathered and packed, so buffers take
    turns: on the sender, two (it packs bucket k + 1 before it waits for the delivery of k,
    after that of k - 1); on another source, three (it packs bucket k + 1 as soon as the
    sender has packed k, while k - 1 may still be loading).

    Each receiver (server TP rank) gets a handle serialized for it alone: torch counts the
    users of a shared-memory file (and of a CUDA IPC block), every serialization adds one
    and every receiver takes one off, so one handle read by two receivers removes the file
    while it is still in use (the third receiver, or the next sync, then fails to open it).
    A server killed before it read its handle leaves the count one high: that file then
    stays until the run ends, when the reaper (rlhf.weight_sync.shm_reaper) removes what
    the run created (on GPU, that block stays allocated until the trainer ends)."""

    concurrent_deliveries = True
    deliver_while_packing = True

    def __init__(self, server_urls: list[str], plan: HandlePlan):
        self.server_index = {url: i for i, url in enumerate(server_urls)}
        self.plan = plan
        self._mine = plan.mine()
        depth = 2 if plan.rank == plan.sender else 3
        # CPU: uint8 staging buffers in shared memory, used in turn; GPU: the packed tensors
        self._staging: list[torch.Tensor | None] = [None] * depth
        self._recent: deque[torch.Tensor] = deque(maxlen=depth)
        self._turn = 0

    def begin(self, version: int) -> None:
        pass

    def pack(self, bucket: Bucket, last: bool, version: int) -> PackedHandles | None:
        """This rank's handles of `bucket`, gathered to the sender (None elsewhere)."""
        handles: dict[tuple[int, int], str] = {}
        if self._mine:
            assert self.plan.device is not None
            payload = self.payload(bucket, self.plan.device)
            handles = {key: serialize_handle(payload) for key in self._mine}
        if self.plan.group is not None:
            handles = _gather_handles(handles, self.plan)
        if self.plan.rank != self.plan.sender:
            return None
        return PackedHandles(
            [[handles[s, r] for r in range(len(row))] for s, row in enumerate(self.plan.sources)]
        )

    def payload(self, bucket: Bucket, device: torch.device) -> dict[str, Any]:
        """`flat_payload` of `bucket` on `device`: in this transport's next shared-memory
        staging buffer on the CPU, in a new tensor (kept until `after_sync`) on a GPU."""
        if device.type == "cpu":
            return flat_payload(bucket, self._staging_buffer)

        def allocate(num_bytes: int) -> torch.Tensor:
            self._recent.append(torch.empty(num_bytes, dtype=torch.uint8, device=device))
            return self._recent[-1]

        return flat_payload(bucket, allocate)

    def _staging_buffer(self, num_bytes: int) -> torch.Tensor:
        """The first `num_bytes` of the next shared-memory staging buffer (the one used
        longest ago), grown when too small."""
        turn, self._turn = self._turn, (self._turn + 1) % len(self._staging)
        staging = self._staging[turn]
        if staging is None or staging.numel() < num_bytes:
            self._staging[turn] = None  # the old file goes when its last receiver lets it go
            staging = self._staging[turn] = shared_bytes(num_bytes)
        return staging[:num_bytes]

    def deliver(self, url: str, packed: PackedHandles, last: bool, version: int) -> None:
        sglang_api.update_weights_from_tensor(
            url, packed.handles[self.server_index[url]], last, version if last else None
        )

    def after_sync(self) -> None:
        """Every server loaded every bucket: let the packed GPU tensors go and return the
        blocks the servers released (CUDA only: the CPU's staging buffers stay)."""
        self._recent.clear()
        if self.plan.device is not None and self.plan.device.type == "cuda":
            torch.cuda.ipc_collect()

    def forget(self, url: str) -> None:
        pass

    def close(self) -> None:
        self._staging = [None] * len(self._staging)
        self._recent.clear()


def flat_payload(bucket: Bucket, allocate: Callable[[int], torch.Tensor]) -> dict[str, Any]:
    """SGLang's FlattenedTensorBucket payload of `bucket` (the flat uint8 tensor and its
    metadata) in the buffer `allocate(num_bytes)` gives, every tensor starting at a multiple
    of `STAGING_ALIGN` bytes (the server views its bytes as the tensor's dtype, which needs
    an aligned start).

    Each tensor's metadata is a `SimpleNamespace` with the fields of SGLang's
    `FlattenedTensorMetadata`: the server reads them by name into its own class, and its
    unpickler admits the namespace. So the trainer does not import SGLang for a sync (2.6 s
    and 270 MB of a process's memory here)."""
    spans, end = [], 0
    for _, tensor in bucket:
        start = -(-end // STAGING_ALIGN) * STAGING_ALIGN
        end = start + tensor.numel() * tensor.element_size()
        spans.append((start, end))
    flat = allocate(end)
    metadata = []
    for (name, tensor), (start, stop) in zip(bucket, spans, strict=True):
        flat[start:stop].view(tensor.dtype).view(tensor.shape).copy_(tensor)
        metadata.append(
            SimpleNamespace(
                name=name,
                shape=tensor.shape,
                dtype=tensor.dtype,
                start_idx=start,
                end_idx=stop,
                numel=stop - start,
            )
        )
    return {"flattened_tensor": flat, "metadata": metadata}


def shared_bytes(num_bytes: int) -> torch.Tensor:
    """A new uint8 buffer in host shared memory (its files removed when this process ends:
    `shm_reaper`)."""
    storage = torch.UntypedStorage._new_shared(num_bytes)
    shm_reaper.reap_at_exit()  # its shm manager and files end with this process
    return torch.empty(0, dtype=torch.uint8).set_(storage)


def serialize_handle(payload: dict[str, Any]) -> str:
    """One receiver's handle to `payload`, as SGLang's `MultiprocessingSerializer` writes
    it (base64 of a `ForkingPickler` pickle). CUDA handles name their GPU by UUID (SGLang's
    reductions; the receiver maps it to its own index), CPU tensors go by shared-memory file
    (a file descriptor cannot travel over HTTP), which needs only torch's reductions."""
    if payload["flattened_tensor"].device.type == "cuda":
        from sglang.srt.utils import MultiprocessingSerializer
        from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

        monkey_patch_torch_reductions()
        return MultiprocessingSerializer.serialize(payload, output_str=True)
    torch.multiprocessing.set_sharing_strategy("file_system")
    buffer = io.BytesIO()
    ForkingPickler(buffer).dump(payload)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def _gather_handles(
    mine: dict[tuple[int, int], str], plan: HandlePlan
) -> dict[tuple[int, int], str]:
    """Every source's handles on the sender (empty elsewhere)."""
    on_sender = plan.rank == plan.sender
    everyone: list | None = [None] * len(plan.ranks) if on_sender else None
    dist.gather_object(mine, everyone, dst=plan.sender, group=plan.group)
    return {key: handle for part in everyone or [] for key, handle in part.items()}


@dataclass(frozen=True)
class _FlatBucket:
    """A bucket as one flat uint8 buffer plus what the server needs to cut it up."""

    flat: torch.Tensor
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]


def _completion(work: dist.Work) -> Future[None]:
    """A `concurrent.futures` future of a collective started with `async_op=True`: done when
    the collective is, with its error if it failed (gloo: its group's timeout)."""
    completion: Future[None] = Future()

    def settle(done: torch.futures.Future) -> None:
        try:
            done.wait()
        except Exception as e:  # handed to the waiter, whatever it is
            completion.set_exception(e)
        else:
            completion.set_result(None)

    work.get_future().add_done_callback(settle)
    return completion


class DistributedTransport:
    """Broadcast buckets over one custom process group per server (opened on first use).

    Deliveries run one server after another: each is a collective on that server's group
    from this process, and overlapping collectives of several groups from threads is not
    something this project has tested (NCCL or gloo)."""

    concurrent_deliveries = False
    deliver_while_packing = False  # its broadcast stays in order with the model's gathers

    def __init__(
        self,
        server_urls: list[str],
        server_tp_size: int,
        master_address: str,
        device: torch.device = CPU,
    ):
        """`device`: where the sender's buckets are broadcast from (its GPU: nccl, else
        gloo; the servers join with the same backend)."""
        self.group_names = {url: f"rlhf_weight_sync_{i}" for i, url in enumerate(server_urls)}
        self.server_tp_size = server_tp_size
        self.master_address = master_address
        self.device = device
        self.backend = backend_for(device)
        self.groups: dict[str, ProcessGroup] = {}
        self.stores: dict[str, TCPStore] = {}

    def begin(self, version: int) -> None:
        pass

    def _join(self, url: str) -> ProcessGroup:
        """Open the sender's end of `url`'s group while the server joins it."""
        from sglang.srt.utils.common import init_custom_process_group

        name, world_size = self.group_names[url], 1 + self.server_tp_size
        # listening on master_address only (a tcp:// init_method listens on every interface)
        store = bound_store(self.master_address, world_size, STORE_TIMEOUT)
        request = {
            "master_address": self.master_address,
            "master_port": store.port,
            "rank_offset": 1,
            "world_size": world_size,
            "group_name": name,
            "backend": self.backend,
        }
        with ThreadPoolExecutor(1) as pool:
            joined = pool.submit(sglang_api.init_weights_update_group, url, request)
            group = init_custom_process_group(
                backend=self.backend,
                store=PrefixStore(name, store),  # the server's side keys by the group's name
                world_size=world_size,
                rank=0,
                group_name=name,
                timeout=STORE_TIMEOUT,
            )
            joined.result()
        self.stores[url] = store
        return group

    def pack(self, bucket: Bucket, last: bool, version: int) -> _FlatBucket:
        flat = _flattened(bucket).get_flattened_tensor().to(self.device)
        names = [n for n, _ in bucket]
        dtypes = [str(t.dtype).removeprefix("torch.") for _, t in bucket]
        return _FlatBucket(flat, names, dtypes, [list(t.shape) for _, t in bucket])

    def deliver(self, url: str, packed: _FlatBucket, last: bool, version: int) -> None:
        """Broadcast `packed` while the server's `update_weights_from_distributed` takes it.
        A server that answers that call with an error before it joins the broadcast (no
        update window, a group it does not hold, a bucket it cannot lay out) fails the
        delivery with its answer at once: the broadcast, which it will never join, is left
        pending (its group is not used again: the sync fails), where waiting for it held
        the sync for the group's timeout and then took the server for lost."""
        if url not in self.groups:
            self.groups[url] = self._join(url)
        with ThreadPoolExecutor(1) as pool:
            answer = pool.submit(
                sglang_api.update_weights_from_distributed,
                url,
                packed.names,
                packed.dtypes,
                packed.shapes,
                self.group_names[url],
                last,
                version if last else None,
            )
            work = torch.distributed.broadcast(packed.flat, 0, self.groups[url], async_op=True)
            assert work is not None, "the sender is rank 0 of every server's group"
            sent = _completion(work)
            wait([sent, answer], return_when=FIRST_COMPLETED)
            if not sent.done() and answer.exception() is not None:
                answer.result()  # the server's answer, raised: it never took the bucket
            try:
                sent.result()
            except RuntimeError as e:  # the collective's peer (the server) went away
                raise sglang_api.SGLangAPIError(
                    f"{url}: weight broadcast failed: {e}", url, unreachable=True
                ) from e
            answer.result()

    def after_sync(self) -> None:
        pass

    def forget(self, url: str) -> None:
        """Destroy `url`'s group here: its server died or was restarted (the new process
        holds no group; it joins a new one under the same name on next use)."""
        group = self.groups.pop(url, None)
        self.stores.pop(url, None)
        if group is not None:
            torch.distributed.destroy_process_group(group)

    def close(self) -> None:
        """Destroy every server's process group, there and here."""
        for url in list(self.groups):
            try:
                sglang_api.destroy_weights_update_group(url, self.group_names[url])
            except sglang_api.SGLangAPIError as e:  # a dead server has no group left
                log.warning("weight-sync group of %s not destroyed there: %s", url, e)
            self.forget(url)


class DiskTransport:
    """Write an HF checkpoint directory per version, then update_weights_from_disk.

    With no servers to deliver to it is the restart snapshot of another transport. Servers
    read the written files at once (concurrent deliveries)."""

    concurrent_deliveries = True
    deliver_while_packing = False

    def __init__(self, out_root: Path, hf_side_files_dir: Path, keep: int = 1):
        self.out_root = Path(out_root)
        self.side_files = Path(hf_side_files_dir)
        self.keep = keep
        self._weight_map: dict[str, str] = {}

    def _dir(self, version: int) -> Path:
        return self.out_root / f"v{version:06d}"

    def begin(self, version: int) -> None:
        from rlhf.models.convert import copy_hf_side_files

        partial = self._dir(version).with_suffix(".partial")
        shutil.rmtree(partial, ignore_errors=True)
        copy_hf_side_files(self.side_files, partial)
        self._weight_map = {}

    def pack(self, bucket: Bucket, last: bool, version: int) -> None:
        """Write the bucket as one safetensors shard; the last one publishes the directory."""
        from safetensors.torch import save_file

        partial = self._dir(version).with_suffix(".partial")
        file = f"model-{len(set(self._weight_map.values())) + 1:05d}.safetensors"
        save_file(dict(bucket), partial / file, metadata={"format": "pt"})
        self._weight_map.update(dict.fromkeys((n for n, _ in bucket), file))
        if last:
            self._publish(version)

    def _publish(self, version: int) -> None:
        partial, final = self._dir(version).with_suffix(".partial"), self._dir(version)
        index = {"metadata": {}, "weight_map": self._weight_map}
        (partial / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(partial, final)
        for old in sorted(self.out_root.glob("v*"))[: -self.keep]:
            shutil.rmtree(old, ignore_errors=True)

    def deliver(self, url: str, packed: None, last: bool, version: int) -> None:
        if last:
            self.load_into(url, version)

    def after_sync(self) -> None:
        pass

    def load_into(self, url: str, version: int) -> None:
        """update_weights_from_disk of a version written earlier."""
        sglang_api.update_weights_from_disk(url, str(self._dir(version).resolve()), version)

    def forget(self, url: str) -> None:
        pass

    def close(self) -> None:
        pass
