"""Adapter-only weight sync: a LoRA policy's servers get its adapters, not its weights.

    syncer = AdapterSyncer(server_urls, arch, topology, spec, model_path, delivery)
    stats = syncer.sync(model, version)   # on every rank of the training job
    syncer.reload(url)                    # a restarted server gets the last adapters

The servers keep the base model they loaded from model.path (the actor's frozen weights)
and serve the policy as that base plus the LoRA adapter named `ADAPTER`, which every
request names (`lora_path`). A sync gathers the adapters' PEFT-named factors to the
sender (`rlhf.weight_sync.gather.iter_buckets(adapters=True)`: the TP-split factor of
each layer all-gathered, later pipeline stages sent to the first), then each server
unloads the adapter it holds and loads the new one (SGLang 0.5.23 refuses to load a name
it holds) and labels its weights `version`. Syncs run while no request of ours is in
flight (the trainer's own order, or `SGLangEngine.paused`), so no request finds the name
missing. How the tensors travel (`delivery`, from the weight-sync transport):

- "tensor" (servers on this machine): one flattened bucket in host shared memory, a
  handle per server TP rank (`load_lora_adapter_from_tensors`); the server copies it to
  its device. The adapters are small (Qwen2.5-7B, rank 64, every linear layer: 0.3 GB in
  bf16), so the host copy replaces the CUDA IPC a full sync needs.
- "distributed" (servers elsewhere, no shared storage): the same bucket by value inside
  the request, once per server TP rank.
- "disk" (shared storage): a PEFT adapter directory under `<run_dir>/weights/`, loaded
  with `load_lora_adapter`.

The sender keeps the last adapters (on the CPU), so a restarted server is given them
without a snapshot on disk.
"""

from __future__ import annotations

import base64
import json
import os
import pickle
import shutil
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from rlhf import sglang_api
from rlhf.models.families import ModelArch
from rlhf.models.lora import LoraSpec, peft_config
from rlhf.weight_sync.gather import CPU, Bucket, SyncTopology, iter_buckets
from rlhf.weight_sync.syncer import Phases, SyncStats, Targets
from rlhf.weight_sync.transports import flat_payload, serialize_handle, shared_bytes

ADAPTER = "policy"  # the adapter's name on the servers (every request's lora_path)
DELIVERIES = ("tensor", "distributed", "disk")
WHOLE = 1 << 62  # one bucket: an adapter is loaded in one call


class AdapterSyncer:
    """The adapter-only counterpart of `WeightSyncer` (same calls, same `SyncStats`)."""

    def __init__(
        self,
        server_urls: list[str],
        arch: ModelArch,
        topology: SyncTopology,
        spec: LoraSpec,
        model_path: str | Path,
        delivery: str,
        *,
        server_tp_size: int = 1,
        out_root: str | Path | None = None,
    ):
        """`delivery`: how the tensors travel (module docstring); `out_root`: where the
        "disk" delivery writes its adapter directories."""
        assert delivery in DELIVERIES, delivery
        self.server_urls, self.arch, self.topology = server_urls, arch, topology
        self.config = peft_config(spec, str(model_path))
        self.delivery, self.server_tp_size = delivery, server_tp_size
        self.out_root = Path(out_root) if out_root is not None else None
        self.version: int | None = None  # the last version synced
        self.tensors: Bucket = []  # its adapters, on the CPU (the sender)
        self.holding: set[str] = set()  # servers holding an adapter named ADAPTER
        self._shared: torch.Tensor | None = None  # "tensor": the bucket's shared memory

    def sync(self, model: nn.Module, version: int) -> SyncStats:
        """Send `model`'s adapters to every server as `version` (all ranks call)."""
        start, phases = time.perf_counter(), Phases()
        tensors: Bucket = []
        buckets = iter_buckets(model, self.arch, self.topology, WHOLE, adapters=True)
        for bucket in phases.iterate("gather", buckets):
            tensors += [(name, t.detach().to(CPU, copy=True)) for name, t in bucket]
        targets = Targets([], version, True, self.holding.discard)
        if self.topology.is_sender:
            self.tensors = tensors
            with phases("pack"):
                packed = self._pack(version)
            targets.live = list(self.server_urls)
            with phases("deliver"):
                targets.each(self._load, packed, version)
        self.version = version
        if dist.is_initialized():
            dist.barrier()
        num_bytes = sum(t.numel() * t.element_size() for _, t in tensors)
        seconds = time.perf_counter() - start
        buckets_sent = 1 if tensors else 0
        return SyncStats(
            seconds,
            num_bytes,
            len(tensors),
            buckets_sent,
            num_bytes,
            dict(phases.seconds),
            targets.lost,
        )

    def _pack(self, version: int) -> str | dict[str, object] | None:
        """The adapters as `_load` sends them: a directory ("disk"), the flattened bucket
        in shared memory ("tensor"), or its by-value serialization ("distributed")."""
        if self.delivery == "disk":
            return self._write(version)
        if self.delivery == "tensor":
            return flat_payload(self.tensors, self._shared_buffer)
        payload = flat_payload(self.tensors, lambda n: torch.empty(n, dtype=torch.uint8))
        return base64.b64encode(pickle.dumps(payload)).decode()

    def _shared_buffer(self, num_bytes: int) -> torch.Tensor:
        """The shared-memory buffer kept across syncs (each server has copied the last
        adapters out of it when its load returned), grown when too small."""
        if self._shared is None or self._shared.numel() < num_bytes:
            self._shared = shared_bytes(num_bytes)
        return self._shared[:num_bytes]

    def _load(self, url: str, packed, version: int) -> None:
        """`url` serves the adapters of `version` as `ADAPTER`."""
        if url in self.holding:
            sglang_api.unload_lora_adapter(url, ADAPTER)
            self.holding.discard(url)
        else:  # a server this syncer has not loaded yet may hold an earlier run's adapter
            _unload_if_held(url)
        if self.delivery == "disk":
            sglang_api.load_lora_adapter(url, ADAPTER, packed)
        else:
            each = (
                [packed] * self.server_tp_size
                if isinstance(packed, str)  # by value: every TP rank reads its own copy
                else [serialize_handle(packed) for _ in range(self.server_tp_size)]
            )
            sglang_api.load_lora_adapter_from_tensors(url, ADAPTER, self.config, each)
        self.holding.add(url)
        sglang_api.update_weight_version(url, str(version))

    def _write(self, version: int) -> str:
        """The adapters as a PEFT directory `<out_root>/lora_v<version>` (the one before
        it removed); its path."""
        from safetensors.torch import save_file

        assert self.out_root is not None
        final = self.out_root / f"lora_v{version:06d}"
        partial = final.with_suffix(".partial")
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        save_file(
            {n: t.clone() for n, t in self.tensors}, str(partial / "adapter_model.safetensors")
        )
        (partial / "adapter_config.json").write_text(json.dumps(self.config, indent=2) + "\n")
        shutil.rmtree(final, ignore_errors=True)
        os.replace(partial, final)
        for old in sorted(self.out_root.glob("lora_v*"))[:-2]:  # a server may still read v-1
            shutil.rmtree(old, ignore_errors=True)
        return str(final.resolve())

    def reload(self, url: str) -> None:
        """Give a restarted server the last synced adapters (sender rank only)."""
        self.holding.discard(url)  # the new process holds none
        if self.version is None:
            return  # nothing synced yet: the first sync gives it the adapters
        self._load(url, self._pack(self.version), self.version)

    def close(self) -> None:
        self._shared = None


def _unload_if_held(url: str) -> None:
    """Unload `ADAPTER` from `url`; a server that holds none answers so, which is fine."""
    try:
        sglang_api.unload_lora_adapter(url, ADAPTER)
    except sglang_api.SGLangAPIError as e:
        if e.unreachable:
            raise
