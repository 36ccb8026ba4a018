"""Run Megatron-Core 0.16.1 on a machine without CUDA. The only module that patches it.

Megatron-Core assumes CUDA in four ways (see shared facts/megatron-core-cpu.md); each has
a CPU answer here, installed by `apply_cpu_compat()` in a process that runs on the CPU (the
bootstrap calls it for `trainer.device=cpu`, also on a machine with GPUs, which such a
process then leaves alone):

1. `torch.cuda.current_device()` used as a device -> returns 0, and device index 0 /
   "cuda" is mapped to the CPU by (4).
2. `torch.cuda.synchronize()` (pipeline p2p) -> a no-op: CPU ops are synchronous. For the
   same reason CUDA streams (`torch.cuda.Stream`, `current_stream`, `stream(...)`: the MoE
   all-to-all token dispatcher copies its split sizes to the host on a side stream) become
   `HostStream`, one in-order queue whose waits and events are no-ops; that copy
   (`maybe_move_tensor_to_cpu`) turns split sizes into NumPy arrays only for GPU tensors,
   so on the CPU `host_split_sizes` does it (`all_to_all_single` takes no tensor sizes).
3. Megatron's CUDA RNG tracker (`CudaRNGStatesTracker.add/fork`,
   `_get_cuda_rng_state`, `_set_cuda_rng_state`) -> the CPU default generator, so
   `model_parallel_cuda_manual_seed` and dropout inside `fork()` are reproducible.
4. Hard-coded `device="cuda"` tensors, `.cuda()` and `Tensor.type()` checks against
   `torch.cuda.*Tensor` -> a process-wide `TorchFunctionMode` (`CudaToCpuMode`) that moves
   such tensors to the CPU and reports CPU tensors under their CUDA type name. torch runs a
   function the mode handles with the mode off, and the autograd engine runs inside
   `torch.autograd.backward`, so each custom autograd Function's backward (where Megatron's
   sequence-parallel gathers allocate on `torch.cuda.current_device()`) enters the mode
   again.

Gloo has no all-gather or reduce-scatter of unequal parts, which Megatron's tensor-parallel
mappings use when the MoE dispatcher moves tokens between expert-TP ranks (each holds a
different number): `uneven_gather` and `uneven_reduce_scatter` do those two with gloo's
`all_to_all_single`, which takes unequal splits; the even cases stay Megatron's own.

The memory simulation (`rlhf.memory.fake_device`) stands the meta device in for the GPU:
its function mode goes over the CPU mode (`stacked_modes`), in custom Functions' backwards
too, so that what asks for CUDA gets the meta device before this layer would map it here.

Besides CUDA, Megatron-Core 0.16.1's MoE router assumes Transformer Engine:
`moe_utils.RouterGatingLinearFunction` tests `te_general_gemm is not None`, a name defined
only when TE imports (a NameError without it); it is set to None here, which selects the
router's own torch.mm path. Its multi-latent attention (DeepSeek-V3) imports TE's layers
from Megatron's TE extension, which without TE hands out mock stand-ins instead of failing,
so that module believes TE present (`HAVE_TE`) and tests `isinstance(..., TELinear)` against
a mock (a TypeError when building the layer); its `HAVE_TE` is set to the extension's.

Megatron-Core decorates its fusable functions with `jit_fuser`, which is `torch.compile`
on torch >= 2.2: wrapping them as its modules import imports TorchDynamo and Inductor,
1.0-1.3 s of the 2.1-2.5 s Megatron-Core's import took here (0.5 s of a trainer's start
before its servers launch: transformers' tokenizer imports TorchDynamo anyway). The CPU
path calls none of them (bias-dropout and activation fusion are off), so a CPU run leaves
`jit_fuser` a plain decorator (`plain_megatron_fusers`), set as `megatron.core.jit` is
imported, before any module decorates with it.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable, Iterator

import torch
from torch.overrides import TorchFunctionMode

_APPLIED = False
_JIT = "megatron.core.jit"
_MODE: TorchFunctionMode | None = None
_STACKED: list[TorchFunctionMode] = []  # `stacked_modes`: over `_MODE`, backwards included

_CUDA_TYPE_NAMES = {
    "torch.FloatTensor": "torch.cuda.FloatTensor",
    "torch.HalfTensor": "torch.cuda.HalfTensor",
    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor",
    "torch.DoubleTensor": "torch.cuda.DoubleTensor",
    "torch.IntTensor": "torch.cuda.IntTensor",
    "torch.LongTensor": "torch.cuda.LongTensor",
    "torch.ByteTensor": "torch.cuda.ByteTensor",
    "torch.BoolTensor": "torch.cuda.BoolTensor",
}


def is_cuda_device(device: object) -> bool:
    """True for a device spec that means a GPU: "cuda", "cuda:N", torch.device("cuda"), N."""
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.split(":")[0] == "cuda"
    return isinstance(device, int) and not isinstance(device, bool)


def _to_cpu_device(value: object) -> object:
    return torch.device("cpu") if is_cuda_device(value) else value


class CudaToCpuMode(TorchFunctionMode):
    """Redirects CUDA device requests to the CPU and answers CUDA type-name checks."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if "device" in kwargs:
            kwargs["device"] = _to_cpu_device(kwargs["device"])
        if kwargs.get("pin_memory"):  # pinned host memory needs a CUDA driver
            kwargs["pin_memory"] = False
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type:
            return self._tensor_type(func, args, kwargs)
        if func is torch.Tensor.to and len(args) > 1 and is_cuda_device(args[1]):
            args = (args[0], torch.device("cpu"), *args[2:])
        return func(*args, **kwargs)

    @staticmethod
    def _tensor_type(func, args, kwargs):
        if len(args) == 1 and not kwargs:
            name = func(*args)
            return _CUDA_TYPE_NAMES.get(name, name)
        if len(args) > 1 and isinstance(args[1], str):
            args = (args[0], args[1].replace("torch.cuda.", "torch."), *args[2:])
        return func(*args, **kwargs)


def _cpu_get_rng_state(*args, **kwargs) -> torch.Tensor:
    return torch.get_rng_state()


def _cpu_set_rng_state(new_state: torch.Tensor, *args, **kwargs) -> None:
    torch.set_rng_state(new_state)


def _cpu_tracker_add(self, name: str, seed: int) -> None:
    """`CudaRNGStatesTracker.add` on the CPU generator: same bookkeeping, same errors."""
    self._is_initialized = True
    if seed in self.seeds_:
        raise Exception(f"seed {seed} already exists")
    self.seeds_.add(seed)
    if name in self.states_:
        raise Exception(f"rng state {name} already exists")
    orig = torch.get_rng_state()
    torch.manual_seed(seed)
    self.states_[name] = torch.get_rng_state()
    torch.set_rng_state(orig)


class HostEvent:
    """A CUDA event stand-in on the CPU: everything recorded has already happened."""

    def synchronize(self) -> None:
        pass

    def wait(self, stream: object = None) -> None:
        pass

    def query(self) -> bool:
        return True


class HostStream:
    """A CUDA stream stand-in on the CPU: CPU ops run in order, so there is nothing to wait
    for; every "stream" is the same queue."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, stream: object) -> None:
        pass

    def wait_event(self, event: object) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def record_event(self, event: HostEvent | None = None) -> HostEvent:
        return event or HostEvent()


_HOST_STREAM = HostStream()


def _host_stream(device: object = None) -> HostStream:
    return _HOST_STREAM


def _no_stream_switch(stream: object = None) -> contextlib.nullcontext:
    return contextlib.nullcontext()


def host_split_sizes(tensor: object, as_numpy: bool = False, record_stream: bool = False):
    """The MoE token dispatcher's `maybe_move_tensor_to_cpu` for tensors already on the
    host: NumPy arrays where it asks for them, as its GPU path returns."""
    if as_numpy and isinstance(tensor, torch.Tensor):
        return tensor.numpy()
    return tensor


# Megatron's own, for the even cases (set by apply_cpu_compat)
_GATHER: Callable[..., torch.Tensor]
_REDUCE_SCATTER: Callable[..., torch.Tensor]


def uneven_gather(input_, group, output_split_sizes=None, use_global_buffer=False):
    """Megatron's `_gather_along_first_dim`; parts of unequal sizes by an all-to-all that
    sends every rank this rank's part."""
    if output_split_sizes is None or group.size() == 1:
        return _GATHER(input_, group, output_split_sizes, use_global_buffer)
    import torch.distributed as dist

    world = group.size()
    output = input_.new_empty((sum(output_split_sizes), *input_.shape[1:]))
    sent = torch.cat([input_.contiguous()] * world)
    dist.all_to_all_single(
        output, sent, list(output_split_sizes), [input_.shape[0]] * world, group=group
    )
    return output


def uneven_reduce_scatter(input_, group, input_split_sizes=None, use_global_buffer=False):
    """Megatron's `_reduce_scatter_along_first_dim`; parts of unequal sizes by an all-to-all
    that brings each rank every rank's copy of its part, summed in rank order."""
    if input_split_sizes is None or group.size() == 1:
        return _REDUCE_SCATTER(input_, group, input_split_sizes, use_global_buffer)
    import torch.distributed as dist

    world, mine = group.size(), input_split_sizes[group.rank()]
    received = input_.new_empty((world * mine, *input_.shape[1:]))
    dist.all_to_all_single(
        received, input_.contiguous(), [mine] * world, list(input_split_sizes), group=group
    )
    return received.view(world, mine, *input_.shape[1:]).sum(dim=0)


class RopeTables:
    """Megatron-Core 0.16.1's unfused rotary embedding (`rope_utils._apply_rotary_pos_emb_bshd`,
    what a CPU run takes: the fused one is Transformer Engine's) computes `cos` and `sin` of
    the frequency table for the query and the key of every layer, and concatenates each
    result with an empty pass-through slice. Within one forward of a decoder (`kept`, around
    `TransformerBlock.forward`) the table is one tensor, so there its scaled cos and sin are
    computed once per table, dtype and scale, and dropped as the forward ends (nothing stays
    alive between passes; a training pass's layers share them for their backward where each
    saved its own pair). A rotation over the whole head returns without the copy. The same
    operations on the same values: bitwise the same result. Interleaved, multi-latent and
    partial rotations run Megatron's own."""

    def __init__(self, original: Callable):
        self.original = original
        self.tables: dict[tuple, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self.depth = 0

    @contextlib.contextmanager
    def kept(self) -> Iterator[None]:
        """Inside: each table's cos and sin computed once (a decoder's forward)."""
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1
            if not self.depth:
                self.tables.clear()

    def cos_sin(self, freqs: torch.Tensor, dtype: torch.dtype, mscale: float):
        key = (id(freqs), dtype, mscale)  # the table is held below: its id is not reused
        held = self.tables.get(key)
        if held is None:
            cos = (torch.cos(freqs) * mscale).to(dtype)
            held = (freqs, cos, (torch.sin(freqs) * mscale).to(dtype))
            if self.depth:
                self.tables[key] = held
        return held[1], held[2]

    def __call__(
        self,
        t: torch.Tensor,
        freqs: torch.Tensor,
        rotary_interleaved: bool = False,
        multi_latent_attention: bool = False,
        mscale: float = 1.0,
    ) -> torch.Tensor:
        if rotary_interleaved or multi_latent_attention or t.shape[-1] != freqs.shape[-1]:
            return self.original(t, freqs, rotary_interleaved, multi_latent_attention, mscale)
        cos, sin = self.cos_sin(freqs, t.dtype, mscale)
        first, second = torch.chunk(t, 2, dim=-1)
        return (t * cos) + (torch.cat((-second, first), dim=-1) * sin)

    def per_forward(self, forward: Callable) -> Callable:
        """`forward` (a decoder's) with the tables kept inside."""

        @functools.wraps(forward)
        def run(*args, **kwargs):
            with self.kept():
                return forward(*args, **kwargs)

        return run


def is_applied() -> bool:
    return _APPLIED


def apply_cpu_compat() -> bool:
    """Install the CPU answers for this whole process (idempotent); returns True.

    Also on a machine with GPUs: Megatron would otherwise put CPU-initialised state (the
    rotary frequencies, grad buffers) on GPU 0 next to a model on the CPU.
    """
    global _APPLIED, _MODE, _GATHER, _REDUCE_SCATTER
    if _APPLIED:
        return True
    from megatron.core.extensions import transformer_engine as te_extension
    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.tensor_parallel import mappings
    from megatron.core.tensor_parallel import random as mcore_random
    from megatron.core.transformer import multi_latent_attention
    from megatron.core.transformer.moe import moe_utils, token_dispatcher
    from megatron.core.transformer.transformer_block import TransformerBlock

    torch.cuda.current_device = lambda: 0
    torch.cuda.synchronize = lambda device=None: None
    torch.cuda.Stream = HostStream  # type: ignore[misc, assignment]
    torch.cuda.current_stream = _host_stream  # type: ignore[assignment]
    torch.cuda.stream = _no_stream_switch  # type: ignore[assignment]
    mcore_random._get_cuda_rng_state = _cpu_get_rng_state
    mcore_random._set_cuda_rng_state = _cpu_set_rng_state
    mcore_random.CudaRNGStatesTracker.add = _cpu_tracker_add
    if not hasattr(moe_utils, "te_general_gemm"):  # no Transformer Engine
        moe_utils.te_general_gemm = None
    multi_latent_attention.HAVE_TE = te_extension.HAVE_TE
    token_dispatcher.maybe_move_tensor_to_cpu = host_split_sizes
    _GATHER, _REDUCE_SCATTER = (
        mappings._gather_along_first_dim,
        mappings._reduce_scatter_along_first_dim,
    )
    mappings._gather_along_first_dim = uneven_gather
    mappings._reduce_scatter_along_first_dim = uneven_reduce_scatter
    rope = RopeTables(rope_utils._apply_rotary_pos_emb_bshd)
    rope_utils._apply_rotary_pos_emb_bshd = rope
    TransformerBlock.forward = rope.per_forward(TransformerBlock.forward)
    _MODE = CudaToCpuMode()
    _MODE.__enter__()
    _backward_functions_in_mode(_MODE)
    _APPLIED = True
    return True


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """Inside: CUDA device requests reach torch as they are (the CPU mode is off), for code
    that only decides about CUDA devices on fake or meta tensors (tests of GPU decisions in
    a process where a CPU model ran before). Nothing else of the layer changes."""
    if not _APPLIED or _STACKED:
        yield
        return
    from torch.overrides import _get_current_function_mode, _pop_mode_temporarily

    assert _get_current_function_mode() is _MODE, "the CPU mode is not the innermost mode"
    with _pop_mode_temporarily():
        yield


@contextlib.contextmanager
def stacked_modes(*modes: TorchFunctionMode):
    """Inside: `modes` entered over the CPU mode, in order, and entered again with it in
    every custom autograd Function's backward (the memory simulation's stand-in for the GPU,
    `rlhf.memory.fake_device`, which maps what the CPU mode would see as CUDA first)."""
    apply_cpu_compat()
    with contextlib.ExitStack() as stack:
        for mode in modes:
            stack.enter_context(mode)
        _STACKED.extend(modes)
        try:
            yield
        finally:
            del _STACKED[len(_STACKED) - len(modes) :]


def _backward_functions_in_mode(mode: TorchFunctionMode) -> None:
    from torch.autograd.function import BackwardCFunction

    run_backward = BackwardCFunction.apply

    def apply(self, *args):
        with mode, contextlib.ExitStack() as stack:
            for stacked in _STACKED:
                stack.enter_context(stacked)
            return run_backward(self, *args)

    BackwardCFunction.apply = apply  # type: ignore[method-assign]


class _PlainFusers(importlib.abc.MetaPathFinder):
    """Finds `megatron.core.jit` as Python would, then disables its `jit_fuser` as soon as
    the module has run (see the module docstring)."""

    def find_spec(self, name, path, target=None):
        if name != _JIT:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module) -> None:
            run(module)
            module.disable_jit_fuser()

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def plain_megatron_fusers() -> bool:
    """Megatron-Core's `jit_fuser` a plain decorator in this process, for a run on the CPU;
    call before anything imports Megatron-Core. False when it has been imported already
    (its functions are decorated by then), and then nothing changes."""
    if _JIT in sys.modules:
        return False
    if not any(isinstance(finder, _PlainFusers) for finder in sys.meta_path):
        sys.meta_path.insert(0, _PlainFusers())
    return True
