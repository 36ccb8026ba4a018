"""The batched decode attention installed in SGLang's CPU servers equals SGLang's own
per-request loop (`TorchNativeAttnBackend._run_sdpa_forward_decode`, and
`_run_sdpa_forward_extend` where every request adds one token), called here on the same
cache, slots and lengths."""

from __future__ import annotations

import pytest
import torch

from rlhf.config.schema import RolloutConfig
from rlhf.rollout import batched_attention
from rlhf.rollout.sglang_server import build_server_args
from tests.helpers import python_output

native = pytest.importorskip("sglang.srt.layers.attention.torch_native_backend")
LOOP = native.TorchNativeAttnBackend._run_sdpa_forward_decode
EXTEND_LOOP = native.TorchNativeAttnBackend._run_sdpa_forward_extend


def _batch(seed, heads=4, kv_heads=2, cache_dtype=torch.float32):
    """Six requests of lengths 1-23 whose tokens sit in scattered cache slots."""
    gen = torch.Generator().manual_seed(seed)
    lens = torch.tensor([5, 1, 23, 9, 17, 2])
    slots = torch.randperm(200, generator=gen)[: int(lens.sum())] + 1
    table = torch.randint(0, 201, (10, 32), generator=gen, dtype=torch.int32)
    rows = torch.tensor([7, 0, 3, 9, 4, 1])
    for row, chunk in zip(rows.tolist(), slots.split(lens.tolist()), strict=True):
        table[row, : len(chunk)] = chunk.int()
    k_cache = torch.randn(201, kv_heads, 8, generator=gen).to(cache_dtype)
    v_cache = torch.randn(201, kv_heads, 8, generator=gen).to(cache_dtype)
    query = torch.randn(len(lens), heads, 8, generator=gen)
    return query, k_cache, v_cache, table, rows, lens


@pytest.mark.parametrize(
    ("heads", "kv_heads", "cache_dtype"),
    [(4, 2, torch.float32), (4, 4, torch.float32), (4, 1, torch.bfloat16)],
)
def test_one_call_equals_sglangs_loop(heads, kv_heads, cache_dtype):
    query, k_cache, v_cache, table, rows, lens = _batch(0, heads, kv_heads, cache_dtype)
    args = (k_cache, v_cache, table, rows, lens, None)
    kwargs = {"scaling": 0.3, "enable_gqa": heads != kv_heads, "causal": False}
    assert_equals_loop(batched_attention.batched_decode, LOOP, query, args, kwargs)


def assert_equals_loop(hook, loop, query, args, kwargs) -> None:
    """`hook` (an AROUND hook of `loop`) writes into its output what `loop` computes."""
    expected = loop(None, query, torch.empty_like(query), *args, **kwargs)
    out = torch.full_like(query, float("nan"))
    assert hook(loop, None, query, out, *args, **kwargs) is out
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 2), (4, 4)])
def test_a_prefill_of_one_token_a_request_equals_sglangs_loop(heads, kv_heads):
    """The samples of an n > 1 request after their prompt's prefill: each adds one token to
    its cached prefix (its keys and values already in the cache, as SGLang writes them
    before attending)."""
    query, k_cache, v_cache, table, rows, lens = _batch(2, heads, kv_heads)
    new = torch.ones_like(lens)
    args = (k_cache, v_cache, table, rows, lens, lens - new, new, None)
    kwargs = {"scaling": 0.3, "enable_gqa": heads != kv_heads, "causal": True}
    assert_equals_loop(batched_attention.one_token_extend, EXTEND_LOOP, query, args, kwargs)


def test_a_prefill_of_several_tokens_a_request_goes_to_sglangs_loop():
    query, k_cache, v_cache, table, rows, lens = _batch(3)
    new = torch.tensor([2, 1, 5, 1, 3, 1])  # 13 query rows for 6 requests
    query = torch.randn(int(new.sum()), *query.shape[1:])
    calls = []

    def loop(*args, **kwargs):
        calls.append(len(args[1]))
        return EXTEND_LOOP(*args, **kwargs)

    args = (query, torch.empty_like(query), k_cache, v_cache, table, rows, lens, lens - new, new)
    batched_attention.one_token_extend(loop, None, *args, None, enable_gqa=True, causal=True)
    assert calls == [13]


def test_a_sliding_window_goes_to_sglangs_loop():
    query, k_cache, v_cache, table, rows, lens = _batch(1)
    calls = []

    def loop(*args, **kwargs):
        calls.append(kwargs["sliding_window_size"])
        return LOOP(*args, **kwargs)

    args = (query, torch.empty_like(query), k_cache, v_cache, table, rows, lens, None)
    kwargs = {"enable_gqa": True, "sliding_window_size": 4}
    out = batched_attention.batched_decode(loop, native.TorchNativeAttnBackend, *args, **kwargs)
    assert calls == [4]
    torch.testing.assert_close(out, LOOP(native.TorchNativeAttnBackend, *args, **kwargs))


INSTALLED = """
import os, torch
from rlhf.rollout import batched_attention, sglang_plugin
calls = []
attend = batched_attention.attend
batched_attention.attend = lambda *a, **k: calls.append(1) or attend(*a, **k)
sglang_plugin.register()
from sglang.srt.plugins.hook_registry import HookRegistry
HookRegistry.apply_hooks()
from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
q = torch.randn(2, 2, 4)
cache = torch.randn(9, 2, 4)
table = torch.arange(18, dtype=torch.int32).reshape(2, 9) % 9
TorchNativeAttnBackend._run_sdpa_forward_decode(
    None, q, torch.empty_like(q), cache, cache, table, torch.tensor([0, 1]),
    torch.tensor([3, 5]), None, scaling=None, enable_gqa=False, causal=False,
    is_cross_attn=False, sliding_window_size=None)
TorchNativeAttnBackend._run_sdpa_forward_extend(
    None, q, torch.empty_like(q), cache, cache, table, torch.tensor([0, 1]),
    torch.tensor([3, 5]), torch.tensor([2, 4]), torch.tensor([1, 1]), None, scaling=None,
    enable_gqa=False, causal=True, is_cross_attn=False, sliding_window_size=None)
print("batched calls", len(calls))
"""


def test_the_plugin_installs_it_in_a_cpu_servers_process():
    """What SGLang's processes do at start (`load_plugins` then `apply_hooks`), in a fresh
    interpreter with the launcher's environment: the backend's decode, and a prefill of one
    token a request, go through here."""
    launch = build_server_args(RolloutConfig(), "model", port=1, device="cpu")
    assert "batched calls 2" in python_output(INSTALLED, launch.env)
