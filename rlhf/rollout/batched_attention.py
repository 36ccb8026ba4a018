"""One attention call per layer for a batch on SGLang's CPU `torch_native` backend.

SGLang 0.5.23's `TorchNativeAttnBackend` attends one request at a time in a Python loop,
in a decode batch (`_run_sdpa_forward_decode`) and in a prefill (`_run_sdpa_forward_extend`):
per layer and request it slices the query, gathers the request's keys and values from the
cache and calls `scaled_dot_product_attention`, about ten torch ops each. On the CPU engine
those loops were the largest part of generation. Here the batch's cache slots are gathered
once per layer into a [requests, longest] index, padded with slot 0 (SGLang's padding
slot) and masked past each request's length, and one SDPA call attends every request. A
prefill puts each request's new tokens into a padded [requests, most new tokens] grid of
queries too, causally masked at their positions after the request's cached prefix.

The results equal the loops' up to float rounding (the padded keys get exactly zero
weight; the matrix products reduce over a longer, zero-padded row). Batches they do not
cover (an encoder, cross-attention, a sliding window, a non-causal prefill) go to SGLang's
loops. The SGLang plugin installs both on the CPU engine (`rlhf.rollout.sglang_plugin`).
"""

from __future__ import annotations

import torch
from torch.nn.functional import scaled_dot_product_attention

BACKEND = "sglang.srt.layers.attention.torch_native_backend.TorchNativeAttnBackend"
DECODE = f"{BACKEND}._run_sdpa_forward_decode"
EXTEND = f"{BACKEND}._run_sdpa_forward_extend"


def _covered(bound: dict) -> bool:
    """A batch of plain self-attention: no encoder, no cross-attention, no window."""
    window = bound.get("sliding_window_size")
    plain = bound.get("encoder_lens") is None and not bound.get("is_cross_attn")
    return plain and (window is None or window <= -1)


def batched_decode(original, backend, query, output, k_cache, v_cache, *args, **kwargs):
    """SGLang's decode attention (an AROUND hook: same signature and result, one SDPA)."""
    names = ("req_to_token", "req_pool_indices", "seq_lens", "encoder_lens")
    bound = dict(zip(names, args, strict=False)) | kwargs
    if not _covered(bound) or len(args) > 4:
        return original(backend, query, output, k_cache, v_cache, *args, **kwargs)
    return attend(
        query,
        output,
        (k_cache, v_cache),
        (bound["req_to_token"], bound["req_pool_indices"]),
        bound["seq_lens"],
        scale=bound.get("scaling"),
        gqa=bool(bound.get("enable_gqa", False)),
    )


def batched_extend(original, backend, query, output, k_cache, v_cache, *args, **kwargs):
    """SGLang's prefill attention (an AROUND hook: same signature and result, one SDPA)."""
    names = (
        "req_to_token",
        "req_pool_indices",
        "seq_lens",
        "extend_prefix_lens",
        "extend_seq_lens",
        "encoder_lens",
    )
    bound = dict(zip(names, args, strict=False)) | kwargs
    if not _covered(bound) or not bound.get("causal") or len(args) > 6:
        return original(backend, query, output, k_cache, v_cache, *args, **kwargs)
    return attend_new_tokens(
        query,
        output,
        (k_cache, v_cache),
        (bound["req_to_token"], bound["req_pool_indices"]),
        (bound["extend_prefix_lens"], bound["extend_seq_lens"]),
        scale=bound.get("scaling"),
        gqa=bool(bound.get("enable_gqa", False)),
    )


def attend(query, output, caches, rows, seq_lens, scale=None, gqa=False):
    """Attention of one new token per request over its cached tokens.

    query, output: [requests, heads, head_dim]; caches: the layer's key and value caches,
    [cache slots, kv heads, head_dim]; rows: SGLang's req_to_token table (each request's
    cache slots by position) and each request's row in it; seq_lens: each request's
    length, the new token included.
    """
    keys, values, valid = cached(caches, rows, seq_lens, query.dtype)
    attended = scaled_dot_product_attention(
        query.unsqueeze(2),
        keys,
        values,
        attn_mask=valid[:, None, None, :],
        scale=scale,
        enable_gqa=gqa,
    )
    output.copy_(attended.squeeze(2))
    return output


def attend_new_tokens(query, output, caches, rows, lens, scale=None, gqa=False):
    """Causal attention of each request's new tokens over its prefix and themselves, whose
    keys and values are already in the cache.

    query, output: [new tokens, heads, head_dim], request after request; caches, rows: as
    `attend`; lens: each request's cached prefix and new tokens.
    """
    prefix, new = (t.to(torch.long) for t in lens)
    most = int(new.max())
    step = torch.arange(most, device=query.device)
    fresh = step < new[:, None]  # [requests, most]: a real new token
    starts = torch.cumsum(new, 0) - new
    tokens = (starts[:, None] + step).masked_fill(~fresh, 0).flatten()
    keys, values, valid = cached(caches, rows, prefix + new, query.dtype)
    position = prefix[:, None] + step  # each query's position in its request
    seen = torch.arange(keys.shape[2], device=query.device) <= position[..., None]
    grid = query.index_select(0, tokens).view(*fresh.shape, *query.shape[1:]).transpose(1, 2)
    attended = scaled_dot_product_attention(
        grid,
        keys,
        values,
        attn_mask=(seen & valid[:, None, :])[:, None],
        scale=scale,
        enable_gqa=gqa,
    )
    flat = attended.transpose(1, 2).reshape(-1, *output.shape[1:])
    output.copy_(flat.index_select(0, fresh.flatten().nonzero().squeeze(1)))
    return output


def cached(caches, rows, seq_lens, dtype):
    """Each request's keys and values, [requests, kv heads, longest, head_dim] in `dtype`
    (slot 0 past a request's length), and [requests, longest] which positions it has."""
    table, requests = rows
    width = int(seq_lens.max())
    valid = torch.arange(width, device=seq_lens.device) < seq_lens[:, None]
    index = table[requests, :width].masked_fill(~valid, 0).long()
    keys, values = (gather(cache, index).transpose(1, 2) for cache in caches)
    if keys.dtype != dtype:
        keys, values = keys.to(dtype), values.to(dtype)
    return keys, values, valid


def gather(cache: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """`cache[index]` ([requests, longest, kv heads, head_dim]) as one `index_select` of
    the flattened index: on CPU, 4x faster than advanced indexing at a decode batch's size."""
    return cache.index_select(0, index.flatten()).view(*index.shape, *cache.shape[1:])
