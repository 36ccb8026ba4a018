"""A GPU with no memory behind it: run the real code at real shapes and count live bytes.

The memory simulation (`rlhf.trainer.memory_simulation`) runs one rank of a training step
at the shipped configs' shapes (a 7B shard, a 30B mixture of experts) on a machine without
a GPU and without the memory those shapes need. Inside `simulated_device()`:

- torch's `FakeTensorMode` makes every tensor a fake one: shapes, dtypes and devices, no
  data; ops run their meta kernels. Fake tensors on the CPU are host memory (the model as
  built before `.to(device)`, the offloader's pinned copies); the GPU is stood in for by the
  meta device (`StandInDevice`: what asks for "cuda", `torch.cuda.current_device()`,
  `.cuda()`, gets "meta"; on CUDA, fake tensors' backward needs a CUDA context). Megatron's
  CPU compatibility layer stays underneath (`rlhf.distributed.cpu_compat`).
- `LiveBytes`, a dispatch mode over the fake one, sees every tensor an op returns and keeps
  a weak reference to each storage on the stand-in device with its size, until the storage
  is freed (or resized: the offloader empties storages with `resize_(0)`), and the peak of
  their sum. Host bytes are not counted.
- Small integer tensors carry their real values (`rlhf.memory.known_values`), so that the
  step takes the same path as a real one (sample boundaries, group sizes, expert counts).

The fake tensor mode is set up so that `Module.to()` works on fake parameters (its
converter's memo, which holds a weak reference to every fake tensor, is a plain dict
cleared after each op; `torch.utils.swap_tensors` refuses a tensor with a weak reference)
and its op cache is off (it too keeps weak references); the moved parameters keep their
Python attributes (Megatron's `allreduce`, `tensor_model_parallel`, ...), which the swap
of a fake parameter would drop. Torch's own attention picks the
math kernel on the meta device, which keeps each sample's T x T scores for the backward;
`StandInDevice` picks the fused CPU kernel the real local-spec run uses (its output and
log-sum-exp are kept), as Transformer Engine's fused attention does on a GPU.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensorMode,
)
from torch.multiprocessing.reductions import StorageWeakRef
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from rlhf.distributed.cpu_compat import is_cuda_device, stacked_modes
from rlhf.memory import known_values

STAND_IN = torch.device("meta")
aten = torch.ops.aten
INDEX_OPS = (aten.index.Tensor, aten.index_put_.default, aten.index_put.default)


class StandInDevice(TorchFunctionMode):
    """What asks for the GPU gets the meta device (entered over the CPU compatibility mode,
    which then sees no CUDA request), and two torch paths that differ on it are taken as on
    a real device (see the module docstring)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if "device" in kwargs and is_cuda_device(kwargs["device"]):
            kwargs["device"] = STAND_IN
        if func is torch.Tensor.cuda:
            return args[0].to(STAND_IN)
        if func is torch.Tensor.to and len(args) > 1 and is_cuda_device(args[1]):
            args = (args[0], STAND_IN, *args[2:])
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            return func(*args).replace("torch.meta.", "torch.cuda.")
        if func is F.scaled_dot_product_attention and _fused_attention(args, kwargs):
            return _flash_attention(*args, **kwargs)
        if func is torch.tensor and _holds_tensors(args[0]):
            return _stacked(args[0], **kwargs)
        return func(*args, **kwargs)


def _fused_attention(args: tuple, kwargs: dict) -> bool:
    return args[0].device == STAND_IN and kwargs.get("attn_mask") is None and len(args) == 3


def _flash_attention(
    q, k, v, dropout_p: float = 0.0, is_causal: bool = False, scale=None, enable_gqa=False
):
    """The fused CPU kernel the real run on the local spec takes (output, log-sum-exp); it
    takes grouped key and value heads as they are (`enable_gqa`), without repeating them."""
    fused = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    return fused(q, k, v, dropout_p, is_causal, scale=scale)[0]


def _holds_tensors(data: object) -> bool:
    if isinstance(data, torch.Tensor):
        return True
    return isinstance(data, list | tuple) and any(_holds_tensors(x) for x in data)


def _stacked(data: Any, device=None, dtype=None, **kwargs) -> torch.Tensor:
    """`torch.tensor` of (nested lists of) tensors: read on the host as torch does it (it
    reads each element with Python dispatch off, which a fake tensor cannot answer)."""

    def stack(x: Any) -> torch.Tensor:
        if isinstance(x, list | tuple):
            return torch.stack([stack(e) for e in x])
        return torch.as_tensor(x).reshape(()).to("cpu")

    stacked = stack(data)
    return stacked.to(device=device or "cpu", dtype=dtype or stacked.dtype)


class _Memo(dict):
    """The fake converter's memo without weak references (cleared after every op)."""


def fake_tensor_mode() -> tuple[FakeTensorMode, _Memo]:
    """Fake tensors that `Module.to()` can move (see the module docstring), and the memo
    to clear after each op."""
    mode, memo = FakeTensorMode(allow_non_fake_inputs=True), _Memo()
    mode.cache_enabled = False
    setattr(mode.fake_tensor_converter.meta_converter, "tensor_memo", memo)  # noqa: B010
    return mode, memo


class LiveBytes(TorchDispatchMode):
    """Bytes of the live storages on the stand-in device, and their peak.

    `peak` is the most bytes alive at once since `reset_peak()`; `refresh()` returns what
    is alive now (freed storages are found by their weak references, every size read
    anew). Enter it over a fake tensor mode (`simulated_device`)."""

    def __init__(self, memo: dict | None = None, device: torch.device = STAND_IN) -> None:
        super().__init__()
        self.device_type = device.type
        self.memo = memo
        self.storages: dict[int, tuple[StorageWeakRef, int]] = {}
        self.live = 0
        self.peak = 0
        self._resize = torch.UntypedStorage.resize_

    def __enter__(self):
        counter, resize = self, self._resize

        def resized(storage, size):
            out = resize(storage, size)
            counter._sized(storage._cdata, int(size))
            return out

        torch.UntypedStorage.resize_ = resized  # type: ignore[method-assign]
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self._resize  # type: ignore[method-assign]
        return super().__exit__(*exc)

    def reset_peak(self) -> int:
        """Start a new peak from what is live now (returned)."""
        self.peak = self.refresh()
        return self.peak

    def refresh(self) -> int:
        """Live bytes, every storage's size read anew."""
        self._sweep()
        for key, (ref, _) in list(self.storages.items()):
            storage = torch.UntypedStorage._new_with_weak_ptr(ref.cdata)
            self.storages[key] = (ref, storage.nbytes())
        self.live = sum(n for _, n in self.storages.values())
        return self.live

    def _sweep(self) -> None:
        for key in [k for k, (ref, _) in self.storages.items() if ref.expired()]:
            self.live -= self.storages.pop(key)[1]

    def _sized(self, key: int, nbytes: int) -> None:
        record = self.storages.get(key)
        if record is None or record[1] == nbytes:
            return
        self.live += nbytes - record[1]
        self.storages[key] = (record[0], nbytes)
        self._new_peak()

    def _new_peak(self) -> None:
        """`live` counts freed storages until a sweep finds them: only a count above the
        peak needs one (sweeping at every allocation costs as much as the step)."""
        if self.live > self.peak:
            self._sweep()
            self.peak = max(self.peak, self.live)

    def _note(self, out: object) -> None:
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor) or t.device.type != self.device_type:
                continue
            storage = t.untyped_storage()
            key, nbytes = storage._cdata, storage.nbytes()
            record = self.storages.get(key)
            if record is None:
                self.storages[key] = (StorageWeakRef(storage), nbytes)
                self.live += nbytes
            elif record[1] != nbytes:
                self.live += nbytes - record[1]
                self.storages[key] = (record[0], nbytes)
        self._new_peak()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is aten._local_scalar_dense.default:
            return known_values.scalar(args[0])
        if func.namespace == "c10d" and func._schema.name.endswith("coalesced_"):
            from torch.distributed._meta_registrations import create_fakework

            return create_fakework(args, return_first_arg=False)  # no fake kernel of its own
        out: object
        if func is aten.nonzero.default:
            out = known_values.nonzero(args[0])
        else:
            if func in INDEX_OPS:
                args = known_values.bool_indices(args)
            try:
                out = func(*args, **kwargs)
            except (DynamicOutputShapeException, DataDependentOutputException):
                out = known_values.by_value(func, args, kwargs)
            known_values.propagate(func, args, kwargs, out)
        if self.memo is not None:
            self.memo.clear()
        self._note(out)
        return out


@contextmanager
def _swaps_keep_attributes() -> Iterator[None]:
    """`Module.to()` swaps a fake parameter with its moved copy (`torch.utils.swap_tensors`,
    which swaps the Python objects' `__dict__` too): the parameter would lose Megatron's
    attributes (`allreduce=False` puts a routed expert's gradient in DDP's expert buffer,
    sharded over expert-DP, not DP). Inside, a swapped tensor keeps its own attributes, as a
    real parameter moved by `param.data = ...` does."""
    swap = torch.utils.swap_tensors

    def swap_keeping(t1: torch.Tensor, t2: torch.Tensor) -> None:
        attributes = dict(t1.__dict__)
        swap(t1, t2)
        for name, value in attributes.items():  # the fake tensor's own (its device) are new
            t1.__dict__.setdefault(name, value)

    torch.utils.swap_tensors = swap_keeping
    try:
        yield
    finally:
        torch.utils.swap_tensors = swap


@contextmanager
def simulated_device() -> Iterator[LiveBytes]:
    """Fake tensors, the meta device standing in for the GPU, and the live-bytes counter."""
    mode, memo = fake_tensor_mode()
    counter = LiveBytes(memo)
    with mode, counter, stacked_modes(StandInDevice()), _swaps_keep_attributes():
        yield counter
