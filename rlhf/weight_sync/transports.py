"""Three ways to move HF-named buckets into SGLang servers (run on the sender rank only).

- `tensor`: `update_weights_from_tensor` with one flattened bucket per call; tensors travel
  as shared-memory handles (CUDA IPC on GPU, the file_system sharing strategy on CPU), so
  the server must share this machine.
- `distributed`: a process group per server with the sender as rank 0
  (`init_weights_update_group`); each bucket is one broadcast of a flat uint8 buffer while
  `update_weights_from_distributed` tells the server what to expect. gloo on CPU, nccl on GPU.
- `disk`: each bucket becomes a safetensors shard of a checkpoint directory, then
  `update_weights_from_disk` loads it (shared storage, any placement).

All follow `Transport`; the `WeightSyncer` wraps each sync in begin/end_weight_update.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Protocol

import torch
from torch.distributed import ProcessGroup

from rlhf.rollout import sglang_api
from rlhf.utils import free_port
from rlhf.weight_sync.gather import Bucket

log = logging.getLogger(__name__)


class Transport(Protocol):
    """One way of loading buckets into servers: `begin`, `send` each bucket, `finish`."""

    def begin(self, version: int) -> None:
        """Prepare to send the weights of `version`."""
        ...

    def send(self, bucket: Bucket, last: bool, version: int) -> None:
        """Deliver one bucket (`last`: the servers flush their KV cache and take `version`)."""
        ...

    def finish(self, version: int) -> None:
        """After the last bucket."""
        ...

    def close(self) -> None:
        """Release what the transport holds (process groups); idempotent."""
        ...


def _flattened(bucket: Bucket):
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    return FlattenedTensorBucket(named_tensors=bucket)


class TensorTransport:
    """update_weights_from_tensor with flattened buckets (same-machine servers)."""

    def __init__(self, server_urls: list[str], server_tp_size: int):
        self.server_urls = server_urls
        self.server_tp_size = server_tp_size

    def begin(self, version: int) -> None:
        if not torch.cuda.is_available():
            torch.multiprocessing.set_sharing_strategy("file_system")

    def send(self, bucket: Bucket, last: bool, version: int) -> None:
        from sglang.srt.utils import MultiprocessingSerializer

        flat = _flattened(bucket)
        payload = {"flattened_tensor": flat.get_flattened_tensor(), "metadata": flat.get_metadata()}
        blob = MultiprocessingSerializer.serialize(payload, output_str=True)
        for url in self.server_urls:
            blobs = [blob] * self.server_tp_size
            sglang_api.update_weights_from_tensor(url, blobs, last, version if last else None)

    def finish(self, version: int) -> None:
        pass

    def close(self) -> None:
        pass


class DistributedTransport:
    """Broadcast buckets over one custom process group per server."""

    def __init__(self, server_urls: list[str], server_tp_size: int, master_address: str):
        self.server_urls = server_urls
        self.server_tp_size = server_tp_size
        self.master_address = master_address
        self.backend = "nccl" if torch.cuda.is_available() else "gloo"
        self.groups: dict[str, ProcessGroup] = {}

    def _group_name(self, index: int) -> str:
        return f"rlhf_weight_sync_{index}"

    def begin(self, version: int) -> None:
        if self.groups:
            return
        from sglang.srt.utils.common import init_custom_process_group

        for i, url in enumerate(self.server_urls):
            port, name = free_port(), self._group_name(i)
            request = {
                "master_address": self.master_address,
                "master_port": port,
                "rank_offset": 1,
                "world_size": 1 + self.server_tp_size,
                "group_name": name,
                "backend": self.backend,
            }
            with ThreadPoolExecutor(1) as pool:
                joined = pool.submit(sglang_api.init_weights_update_group, url, request)
                self.groups[url] = init_custom_process_group(
                    backend=self.backend,
                    init_method=f"tcp://{self.master_address}:{port}",
                    world_size=1 + self.server_tp_size,
                    rank=0,
                    group_name=name,
                )
                joined.result()

    def send(self, bucket: Bucket, last: bool, version: int) -> None:
        flat = _flattened(bucket).get_flattened_tensor()
        if self.backend == "nccl":
            flat = flat.cuda()
        names = [n for n, _ in bucket]
        dtypes = [str(t.dtype).removeprefix("torch.") for _, t in bucket]
        shapes = [list(t.shape) for _, t in bucket]
        for i, url in enumerate(self.server_urls):
            with ThreadPoolExecutor(1) as pool:
                done = pool.submit(
                    sglang_api.update_weights_from_distributed, url, names, dtypes, shapes,
                    self._group_name(i), last, version if last else None,
                )  # fmt: skip
                torch.distributed.broadcast(flat, src=0, group=self.groups[url])
                done.result()

    def finish(self, version: int) -> None:
        pass

    def close(self) -> None:
        """Destroy every server's process group here, and ask the server to do the same."""
        for i, url in enumerate(self.server_urls):
            group = self.groups.pop(url, None)
            if group is None:
                continue
            try:
                sglang_api.destroy_weights_update_group(url, self._group_name(i))
            except sglang_api.SGLangAPIError as e:  # a dead server has no group left
                log.warning("weight-sync group of %s not destroyed there: %s", url, e)
            torch.distributed.destroy_process_group(group)


class DiskTransport:
    """Write an HF checkpoint directory per version, then update_weights_from_disk."""

    def __init__(
        self, server_urls: list[str], out_root: Path, hf_side_files_dir: Path, keep: int = 1
    ):
        self.server_urls = server_urls
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

    def send(self, bucket: Bucket, last: bool, version: int) -> None:
        from safetensors.torch import save_file

        partial = self._dir(version).with_suffix(".partial")
        file = f"model-{len(set(self._weight_map.values())) + 1:05d}.safetensors"
        save_file(dict(bucket), partial / file, metadata={"format": "pt"})
        self._weight_map.update(dict.fromkeys((n for n, _ in bucket), file))

    def finish(self, version: int) -> None:
        partial, final = self._dir(version).with_suffix(".partial"), self._dir(version)
        index = {"metadata": {}, "weight_map": self._weight_map}
        (partial / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(partial, final)
        for url in self.server_urls:
            self.load_into(url, version)
        for old in sorted(self.out_root.glob("v*"))[: -self.keep]:
            shutil.rmtree(old, ignore_errors=True)

    def load_into(self, url: str, version: int) -> None:
        """update_weights_from_disk of a version written earlier."""
        sglang_api.update_weights_from_disk(url, str(self._dir(version).resolve()), version)

    def close(self) -> None:
        pass
