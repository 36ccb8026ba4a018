"""An SGLang general plugin for the servers this project launches; ten jobs.

1. The torch.distributed stores SGLang's processes host listen on their given host only,
   not on every interface. SGLang's scheduler joins its process group with
   `init_process_group("tcp://127.0.0.1:PORT")`, and torch's store for it listens on every
   interface whatever host it is given (`rlhf.distributed.stores.bound_store` says why): an
   unauthenticated port, next to the HTTP server that the API key guards. Rank 0 of a
   tcp:// rendezvous then hosts its store on a socket bound to the URL's host and port
   (127.0.0.1 for a one-node server; the address SGLang is given otherwise).
2. On the CPU engine (`SGLANG_USE_CPU_ENGINE=1`): torch versions of the Triton kernels that
   SGLang 0.5.23 calls on the CPU without a CPU path of its own. Qwen2-MoE's shared-expert
   gate (`sigmoid(x . w) * shared_output`, added to the routed experts' output) runs a
   Triton kernel unless its layer uses Intel AMX, so on other CPUs every forward failed
   with "0 active drivers". The replacement goes in through SGLang's own `HookRegistry`.
3. Without CUDA: SGLang's host buffer for the routed experts
   (`--enable-return-routed-experts`, rollout routing replay) is allocated by
   `ALLOC_MEMORY_FUNCS[device]`, which has no "cpu" entry and falls back to registering
   the memory with CUDA ("Found no NVIDIA driver" at startup); "cpu" gets an unpinned
   allocation here (`cpu_host_alloc`).
4. On the CPU engine: requests with a `sampling_seed` are sampled with it
   (`rlhf.rollout.seeded_sampling`: SGLang's own seeded Gumbel-max sampler, which it runs
   only under `--enable-deterministic-inference`, a mode that refuses the CPU backends).
5. On the CPU engine: multi-latent attention (DeepSeek-V3) as absorbed MLA. SGLang's
   DeepSeek model picks, per batch, plain multi-head attention for a prefill without a
   cached prefix (keys and values expanded per head) and absorbed MLA otherwise (queries
   against the cached latent); the backend `torch_native` has no handler of its own, gets
   the Triton backend's choice, and then reads its keys from the latent cache in either
   case, so a prefill failed on the key width. Here every batch on `torch_native` is
   absorbed MLA, which is what that backend computes (one latent key and value shared by
   all heads).
6. Without CUDA, on a server with LoRA adapters (`RLHF_SGLANG_UNPINNED_LORA=1`, set with
   `--enable-lora` on the CPU): SGLang's LoRA layers and adapters pin their host tensors
   (`pin_memory`), which needs a CUDA driver ("Found no NVIDIA driver" as the first
   adapter loads); they stay unpinned here (there is no GPU to copy them to).
7. On the CPU engine: a decode batch's attention is one SDPA call per layer
   (`rlhf.rollout.batched_attention`) instead of `torch_native`'s loop over the requests,
   and so is a prefill in which every request adds one token (the samples of an `n > 1`
   request after their prompt's prefill).
8. On the CPU engine: the server's scheduler and detokenizer processes are forked from
   its first process instead of spawned (`multiprocessing`'s start method set back to
   "fork" after SGLang's `_set_envs_and_config` sets "spawn"). A spawned process imports
   SGLang and torch again, about 6 s of the server's 15 s start here, and holds its own
   copy of every module (~0.4 GB each); a forked one starts from the first process's
   imports and shares those pages. Nothing CUDA exists in these processes to make fork
   unsafe, and the first process has run no torch thread pool when it forks.
9. Megatron-Core is not importable in the servers' processes. SGLang's debug dumper,
   which its model runner imports, imports Megatron-Core whenever it is installed (to
   report Megatron's parallel ranks when SGLang runs inside a Megatron trainer); this
   project's servers run beside the trainer, never inside it, and the import cost each
   server's scheduler about 1 s of its start.
10. Every process of a server freezes the objects alive when it loads its plugins
   (`gc.freeze`: the ones its imports created), and a CPU server's first process again
   before it forks the others. Its scheduler runs `gc.collect()` as it sizes the KV cache
   and on each `/flush_cache`, and each scanned every one of them (0.44 s of the CPU
   server's start here); frozen, later collections skip them.

SGLang loads the general plugins registered under the `sglang.srt.plugins` entry point at
the start of each of its processes (`load_plugins()`: the scheduler, the detokenizer, the
engine). This one, registered in setup.py, acts only where the launcher set
`RLHF_SGLANG_BOUND_STORES=1` (the servers `rlhf.rollout.sglang_server` starts).
"""

from __future__ import annotations

import gc
import importlib
import os
import sys
import types

import torch

from rlhf.rollout import batched_attention
from rlhf.rollout.keyed_launch import BOUND_STORES_ENV, UNPINNED_LORA_ENV

GATE_KERNEL = "sglang.kernels.ops.elementwise.elementwise._launch_fused_gate_sigmoid_mul"
ENGINE_SETUP = "sglang.srt.entrypoints.engine._set_envs_and_config"


def register() -> None:
    """SGLang's hook (idempotent)."""
    if os.environ.get(BOUND_STORES_ENV) != "1":
        return
    gc.freeze()  # job 10
    _bind_stores()
    sys.modules.setdefault("megatron", None)  # type: ignore[arg-type]  # job 9: import fails
    if os.environ.get("SGLANG_USE_CPU_ENGINE") == "1":
        from sglang.srt.plugins.hook_registry import HookRegistry, HookType

        HookRegistry.register(GATE_KERNEL, gate_sigmoid_mul, HookType.REPLACE)
        _seeded_sampling(HookRegistry, HookType)
        HookRegistry.register(MLA_DISPATCH, absorbed_latent_attention, HookType.AROUND)
        decode = batched_attention.batched_decode
        HookRegistry.register(batched_attention.TARGET, decode, HookType.AROUND)
        extend = batched_attention.one_token_extend
        HookRegistry.register(batched_attention.EXTEND_TARGET, extend, HookType.AROUND)
        HookRegistry.register(ENGINE_SETUP, forked_processes, HookType.AFTER)
    if not torch.cuda.is_available():
        from sglang.srt.mem_cache.pool_host.common import ALLOC_MEMORY_FUNCS

        ALLOC_MEMORY_FUNCS["cpu"] = cpu_host_alloc
        if os.environ.get(UNPINNED_LORA_ENV) == "1":
            _unpinned_lora()


class _UnpinnedTorch(types.ModuleType):
    """`torch` for SGLang's LoRA modules: its factories' `pin_memory=True` left out."""

    def __getattr__(self, name: str):
        value = getattr(torch, name)
        if name not in ("tensor", "zeros", "ones", "empty", "arange"):
            return value
        return lambda *args, pin_memory=False, **kwargs: value(*args, **kwargs)


PINNING_MODULES = ("sglang.srt.lora.layers", "sglang.srt.lora.backend.torch_backend")


def _unpinned_lora() -> None:
    """Job 6: no pinning in SGLang's LoRA code (layers, the torch_native backend, adapters)
    on a machine without CUDA."""
    for name in PINNING_MODULES:
        module = importlib.import_module(name)
        if not isinstance(vars(module)["torch"], _UnpinnedTorch):
            setattr(module, "torch", _UnpinnedTorch("torch"))  # noqa: B010 (a module global)
    torch.Tensor.pin_memory = _unpinned  # type: ignore[method-assign,assignment]


def _unpinned(tensor: torch.Tensor, device=None) -> torch.Tensor:
    return tensor


MLA_DISPATCH = "sglang.srt.models.deepseek_v2.DeepseekV2AttentionMLA.dispatch_attn_forward_method"


def absorbed_latent_attention(original, attention, forward_batch):
    """Absorbed MLA for every batch on the `torch_native` backend (job 5)."""
    method = original(attention, forward_batch)
    if attention.current_attention_backend != "torch_native":
        return method
    from sglang.srt.models.deepseek_common.attention_forward_methods.forward_methods import (
        AttnForwardMethod,
    )

    return AttnForwardMethod.MLA


SAMPLER = "sglang.srt.layers.sampler."
BATCH_INFO = "sglang.srt.sampling.sampling_batch_info.SamplingBatchInfo."


def _seeded_sampling(registry, hook_type) -> None:
    """Requests' `sampling_seed` honoured on the CPU engine (`rlhf.rollout.seeded_sampling`)."""
    from rlhf.rollout import seeded_sampling as seeded

    registry.register(SAMPLER + "multinomial_with_seed", seeded.seeded_argmax, hook_type.REPLACE)
    registry.register(
        SAMPLER + "top_k_top_p_min_p_sampling_from_probs_torch",
        seeded.seeded_top_k_top_p,
        hook_type.AROUND,
    )
    registry.register(
        BATCH_INFO + "adjusted_from_schedule_batch", seeded.add_request_seeds, hook_type.REPLACE
    )


def cpu_host_alloc(dims, dtype, device, pin_memory, allocator, registration_granularity_bytes=None):
    """SGLang's host-buffer allocation (`ALLOC_MEMORY_FUNCS` signature) without pinning or
    CUDA registration: there is no GPU to copy to."""
    return allocator.allocate(dims, dtype=dtype, device=device)


def _bind_stores() -> None:
    """Wrap torch's tcp:// store creation in this process."""
    rendezvous = importlib.import_module("torch.distributed.rendezvous")
    create = rendezvous._create_c10d_store
    if getattr(create, "binds_its_host", False):
        return

    def create_store(hostname, port, rank, world_size, timeout, use_libuv=True):
        if rank != 0 or rendezvous._agent_store_serves(hostname, port):
            return create(hostname, port, rank, world_size, timeout, use_libuv)
        from rlhf.distributed.stores import bound_store

        return bound_store(hostname, world_size, timeout, port=port, use_libuv=use_libuv)

    create_store.binds_its_host = True  # type: ignore[attr-defined]
    setattr(rendezvous, "_create_c10d_store", create_store)  # noqa: B010 (a module global)


def gate_sigmoid_mul(
    hidden_states: torch.Tensor,
    gate_weight: torch.Tensor,
    shared_output: torch.Tensor,
    output: torch.Tensor,
    *,
    do_add: bool,
) -> None:
    """What SGLang's Triton kernel computes, in fp32 as it does: `output` = sigmoid(hidden
    [tokens, h] . gate_weight [h]) x shared_output [tokens, h] (+ `output` when `do_add`)."""
    gate_t1 = torch.sigmoid(hidden_states.float() @ gate_weight.float()).unsqueeze(1)
    result = gate_t1 * shared_output.float()
    if do_add:
        result += output.float()
    output.copy_(result)


def forked_processes(result, *args, **kwargs):
    """After SGLang's process setup chose "spawn" for its subprocesses: "fork" (job 8), and
    what the process holds frozen (job 10: a forked process does not load its plugins
    again, and the imports since it did are most of its objects)."""
    import multiprocessing

    multiprocessing.set_start_method("fork", force=True)
    gc.freeze()
    return result
