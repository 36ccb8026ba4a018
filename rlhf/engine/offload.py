"""Offload a model's parameters, gradient buffers and optimizer state to CPU between its uses.

Megatron's DDP keeps parameters (with the distributed optimizer) and gradients in flat
buffers that many tensors view (`param.main_grad`, bucket views, the optimizer's shards), so
moving a tensor with `.to()` would leave those views behind. Instead each underlying
*storage* is copied to (pinned) CPU memory and resized to zero bytes; reloading resizes it
back and copies the bytes in. Every tensor and view keeps its identity, shape and offsets,
and the round trip is bit-exact. Gradient buffers are not copied: DDP zeroes them before
every backward, so they are freed and come back zeroed (no host memory for them). On GPU
this returns the memory to the caching allocator (the trainer then empties the cache). On
CPU the same moves run, so that every decision of a GPU run is taken, and tested, on the
CPU too; but a storage already in host memory has its bytes set aside rather than copied
(its data pointer moved to a storage held here, and moved back when reloaded; gradients
are then zeroed): it is empty in between as on a GPU, without the copies, which cost a
CPU weight sync 10 ms a step on the quickstart's shape.

`ModelOffloader.on_device(kinds)` brings back what a phase needs: a forward-only pass
(old log-probs, reference, values, the weight-sync probe) the parameters alone, an update
everything. `ModelOffloader.weights_only()` is the colocated weight sync's view of the
actor: only its parameters on the device, its gradients and optimizer state off it for the
duration even when they otherwise stay resident, so that SGLang's weights and KV cache fit
next to it. Every move is recorded in the device ledger (`rlhf.memory.ledger`), on the CPU
as on a GPU.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from rlhf.memory.ledger import ledger
from rlhf.utils import empty_device_cache

KINDS = ("params", "grads", "optimizer")
SYNC_ASIDE = ("grads", "optimizer")  # what a weight sync does not need on the device
DISCARDED = frozenset({"grads"})  # zeroed before every use: freed without a copy


@dataclass
class _Held:
    storage: torch.UntypedStorage
    device: torch.device
    nbytes: int
    copy: torch.Tensor | None = None  # the bytes on the CPU while offloaded
    aside: torch.UntypedStorage | None = None  # a host storage's own bytes while offloaded


def storage_key(storage: torch.UntypedStorage) -> int:
    """The identity of a storage (its StorageImpl): the same for every tensor and storage
    object over it, also for storages without data (the fake tensors of the memory
    simulation, whose data pointers are all null)."""
    return storage._cdata


def _byte_view(storage: torch.UntypedStorage, device: torch.device) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage)


@dataclass
class StorageOffloader:
    """Offloads and reloads the storages behind a set of tensors (each storage once)."""

    held: list[_Held] = field(default_factory=list)
    offloaded: bool = False
    keep_bytes: bool = True  # False: freed without a copy, zeroed when reloaded

    @classmethod
    def of(cls, tensors: Iterable[torch.Tensor], keep_bytes: bool = True) -> StorageOffloader:
        seen: dict[int, _Held] = {}
        for tensor in tensors:
            storage = tensor.untyped_storage()
            key = storage_key(storage)
            if key not in seen and storage.nbytes() > 0:
                seen[key] = _Held(storage, tensor.device, storage.nbytes())
        return cls(list(seen.values()), keep_bytes=keep_bytes)

    @property
    def nbytes(self) -> int:
        return sum(h.nbytes for h in self.held)

    def offload(self) -> None:
        if self.offloaded:
            return
        pin = torch.cuda.is_available()
        for h in self.held:
            if h.storage.device.type == "cpu":  # the bytes stay where they are, set aside
                h.aside = torch.UntypedStorage(0)
                h.storage._swap_data_ptr_(h.aside)  # type: ignore[attr-defined]
                continue
            if self.keep_bytes:
                h.copy = torch.empty(h.nbytes, dtype=torch.uint8, pin_memory=pin)
                h.copy.copy_(_byte_view(h.storage, h.device))
            h.storage.resize_(0)
        self.offloaded = True

    def reload(self) -> None:
        if not self.offloaded:
            return
        for h in self.held:
            if h.aside is not None:  # a host storage's own bytes, back in place
                h.storage._swap_data_ptr_(h.aside)  # type: ignore[attr-defined]
                h.aside = None
            else:
                h.storage.resize_(h.nbytes)
            if h.copy is not None:
                _byte_view(h.storage, h.device).copy_(h.copy, non_blocking=True)
            elif not self.keep_bytes:
                _byte_view(h.storage, h.device).zero_()
            h.copy = None
        if any(h.device.type == "cuda" for h in self.held):
            torch.cuda.synchronize()
        self.offloaded = False


def model_tensors(model, kind: str) -> Iterator[torch.Tensor]:
    """The tensors of a TrainableMegatronModel (or a frozen module) that `kind` covers: DDP
    keeps the experts of a mixture-of-experts model in buffers of their own."""
    buffers = [
        b for ddp in getattr(model, "ddps", ()) for b in ddp.buffers + ddp.expert_parallel_buffers
    ]
    if kind == "params":
        held = [b.param_data for b in buffers if b.param_data is not None]
        yield from held or model.module.parameters()
    elif kind == "grads":
        yield from (b.grad_data for b in buffers)
    elif kind == "optimizer":
        params = {storage_key(p.untyped_storage()) for p in model.module.parameters()}
        for part in getattr(model.optimizer, "chained_optimizers", [model.optimizer]):
            inner = part.optimizer
            for group in inner.param_groups:
                for param in group["params"]:
                    if storage_key(param.untyped_storage()) not in params:
                        yield param  # fp32 master weights held apart from the model
                    for value in inner.state.get(param, {}).values():
                        if torch.is_tensor(value):
                            yield value
    else:
        raise ValueError(f"unknown offload kind {kind!r}; one of {KINDS}")


class ModelOffloader:
    """The chosen kinds of one model (`owner` in the device ledger), offloaded between its
    phases: `on_device(kinds)` brings back what a phase needs (a forward pass: the
    parameters only), re-entrant per kind."""

    def __init__(self, model, kinds: Iterable[str], owner: str = "model") -> None:
        self.model, self.owner = model, owner
        self.kinds = tuple(kinds)
        self._parts: dict[str, StorageOffloader] = {}
        self._depth = dict.fromkeys(KINDS, 0)
        self._sizes: dict[str, int] = {}  # `note_resident`'s: each kind's once non-zero
        self.has = ("params",) + (SYNC_ASIDE if getattr(model, "ddps", None) else ())

    def note_resident(self) -> None:
        """Record in the device ledger what of the model is on the device now, with its
        size. Adam's state appears at the first optimizer step; once a kind's size is
        non-zero the tensors behind it never change, so it is kept (walking them again
        after every pass took ~1 ms of each forward-only pass of the quickstart's actor)."""
        for kind in self.has:
            if kind not in self._parts:
                if not self._sizes.get(kind):
                    tensors = model_tensors(self.model, kind)
                    self._sizes[kind] = StorageOffloader.of(tensors).nbytes
                ledger().came(self.owner, kind, self._sizes[kind])

    def offload(self, kinds: Iterable[str] | None = None) -> None:
        """Move the kinds' storages (default: the chosen kinds) to CPU, then, if any moved,
        empty the allocator's cache (not otherwise: with nothing to offload, each pass
        would hand its activations' blocks back to the driver, and the next allocate them
        from it again). The storages are found anew each time: Adam's state exists only
        after the first optimizer step."""
        moved = False
        for kind in self.kinds if kinds is None else kinds:
            if kind not in self._parts:
                tensors = model_tensors(self.model, kind)
                part = StorageOffloader.of(tensors, keep_bytes=kind not in DISCARDED)
                part.offload()
                self._parts[kind] = part
                ledger().left(self.owner, kind)
                moved = True
        if moved:
            empty_device_cache()

    def reload(self, kinds: Iterable[str] | None = None) -> None:
        """Back on the device: the given kinds (default: all offloaded ones)."""
        for kind in list(self._parts) if kinds is None else kinds:
            part = self._parts.pop(kind, None)
            if part is not None:
                part.reload()
                ledger().came(self.owner, kind, part.nbytes)

    @contextmanager
    def on_device(self, kinds: Iterable[str] = KINDS) -> Iterator[None]:
        """The offloaded ones of `kinds` (default: all) on the device inside; each goes
        back when the last context that asked for it ends."""
        wanted = [kind for kind in kinds if kind in self.kinds]
        for kind in wanted:
            if self._depth[kind] == 0:
                self.reload([kind])
            self._depth[kind] += 1
        try:
            yield
        finally:
            for kind in wanted:
                self._depth[kind] -= 1
            if not any(self._depth.values()):
                self.note_resident()
            self.offload([kind for kind in wanted if self._depth[kind] == 0])

    @contextmanager
    def weights_only(self, aside: tuple[str, ...] = SYNC_ASIDE) -> Iterator[None]:
        """Only the parameters on the device inside: the `aside` kinds leave it for the
        duration (with the allocator's cache emptied), also those that otherwise stay
        resident; afterwards everything is where it was."""
        if any(self._depth.values()):
            raise RuntimeError("weights_only() inside on_device(): the state is in use")
        resident = tuple(kind for kind in aside if kind not in self.kinds)
        self.offload(resident)
        try:
            with self.on_device(("params",)):
                yield
        finally:
            self.reload(resident)
