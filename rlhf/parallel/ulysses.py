"""Ulysses sequence parallelism for Megatron-Core attention, on the context-parallel group.

Each of the SP ranks of Megatron's context-parallel (CP) group holds a slice of every
sequence. Everything outside attention is per-token, so only attention needs the whole
sequence: `UlyssesAttention` (plugged in as the layer spec's `core_attention`) trades the
sequence slices for head slices with one all-to-all, runs ordinary full-sequence attention
on H/SP heads, and trades back with a second all-to-all.

Layout. Megatron's RoPE, once CP > 1, gives each rank the positions of a *zig-zag* split:
the sequence is cut into 2 x SP chunks and rank r holds chunks r and 2 x SP - 1 - r (which
balances causal-attention work). The data path slices inputs the same way
(`zigzag_positions`), so RoPE and tokens agree; after the first all-to-all the chunks are put
back in natural order, so the inner attention sees an ordinary sequence and any mask that
describes the whole (padded) row, e.g. the block-diagonal mask of packed samples that
straddle rank boundaries, is exact.

GQA. Heads are split across SP after TP. When a rank's KV heads cannot be split evenly
(fewer than SP, or not a multiple), each KV head is repeated just enough (`kv_repeats`) for
the split to keep every query head with its own KV head.

Because SP is Megatron's CP group, DDP already reduces gradients over DP x CP.
"""

from __future__ import annotations

import copy
import itertools
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core.transformer.module import MegatronModule
from torch import Tensor
from torch.distributed import ProcessGroup
from torch.distributed.nn.functional import all_to_all_single

from rlhf.distributed.context import ParallelContext


@dataclass(frozen=True)
class SequenceShard:
    """This rank's place in the Ulysses (context-parallel) group."""

    group: ProcessGroup | None
    rank: int
    size: int

    @classmethod
    def of(cls, ctx: ParallelContext) -> SequenceShard:
        return cls(ctx.sp_group, ctx.sp_rank, ctx.sp_size)


def zigzag_positions(seq_len: int, sp_size: int, sp_rank: int) -> Tensor:
    """Positions (of a row of `seq_len`, a multiple of 2 x SP) held by `sp_rank`, in order."""
    if seq_len % (2 * sp_size):
        raise ValueError(f"sequence length {seq_len} is not a multiple of 2 x SP = {2 * sp_size}")
    chunk = seq_len // (2 * sp_size)
    chunks = (sp_rank, 2 * sp_size - 1 - sp_rank)
    return torch.cat([torch.arange(c * chunk, (c + 1) * chunk) for c in chunks])


def held_positions(
    seq_len: int, sp_size: int, sp_rank: int, cu_seqlens_padded: Tensor | None = None
) -> Tensor:
    """Row positions `sp_rank` holds: a zig-zag split of the whole row, or, for THD packed
    rows (`cu_seqlens_padded`, each sequence padded to 2 x SP), of every sequence (the
    split Megatron's RoPE assumes for packed sequences under context parallelism)."""
    if cu_seqlens_padded is None:
        return zigzag_positions(seq_len, sp_size, sp_rank)
    pieces = [
        start + zigzag_positions(end - start, sp_size, sp_rank)
        for start, end in itertools.pairwise(cu_seqlens_padded.tolist())
    ]
    return torch.cat(pieces)


def gathered_order(seq_len: int, sp_size: int, cu_seqlens_padded: Tensor | None = None) -> Tensor:
    """For the sequence gathered in rank order, the index of each natural position in it."""
    held = [held_positions(seq_len, sp_size, r, cu_seqlens_padded) for r in range(sp_size)]
    return torch.argsort(torch.cat(held))


def kv_repeats(num_q_heads: int, num_kv_heads: int, sp_size: int) -> int:
    """Copies of each KV head so that Q and KV heads both split evenly over SP ranks."""
    if num_q_heads % sp_size:
        raise ValueError(
            f"{num_q_heads} query heads per TP rank cannot be split over {sp_size} Ulysses "
            "ranks: query heads per TP rank must be a multiple of the SP size"
        )
    # KV heads divide the query heads (GQA), and so does SP, hence so does lcm(KV, SP).
    return sp_size // math.gcd(num_kv_heads, sp_size)


def _seq_to_head(x: Tensor, group, order: Tensor) -> Tensor:
    """[s/SP, b, h, d] (a zig-zag slice) -> [s, b, h/SP, d] (natural order), differentiable."""
    sp = dist.get_world_size(group)
    s_local, b, h, d = x.shape
    send = x.reshape(s_local, b, sp, h // sp, d).permute(2, 0, 1, 3, 4).contiguous()
    recv = all_to_all_single(torch.empty_like(send), send, group=group)
    gathered = recv.reshape(sp * s_local, b, h // sp, d)
    return gathered.index_select(0, order.to(x.device))


def _head_to_seq(x: Tensor, group, order: Tensor) -> Tensor:
    """[s, b, h/SP, d] (natural order) -> [s/SP, b, h, d] (this rank's zig-zag slice)."""
    sp = dist.get_world_size(group)
    s, b, h_local, d = x.shape
    in_rank_order = torch.empty_like(x).index_copy(0, order.to(x.device), x)
    send = in_rank_order.reshape(sp, s // sp, b, h_local, d).contiguous()
    recv = all_to_all_single(torch.empty_like(send), send, group=group)
    return recv.permute(1, 2, 0, 3, 4).reshape(s // sp, b, sp * h_local, d)


class UlyssesAttention(MegatronModule):
    """`core_attention` that runs `inner` (Megatron's or TE's) on H/SP heads of the full sequence.

    Built by Megatron's `SelfAttention` with the usual core-attention arguments; `inner` is
    the attention class the spec would otherwise have used. `inner` is built from a copy of
    the config with CP = 1 and the head counts one SP rank sees after the exchange.
    """

    def __init__(self, config, layer_number, attn_mask_type, attention_type, inner, **kwargs):
        super().__init__(config=config)
        self.sp_group = kwargs["pg_collection"].cp  # Megatron's Attention always passes it
        sp = dist.get_world_size(self.sp_group)
        tp = config.tensor_model_parallel_size
        q_heads, kv_heads = config.num_attention_heads // tp, config.num_query_groups // tp
        self.repeats = kv_repeats(q_heads, kv_heads, sp)
        inner_config = copy.copy(config)
        inner_config.context_parallel_size = 1
        inner_config.num_attention_heads = config.num_attention_heads // sp
        inner_config.num_query_groups = config.num_query_groups * self.repeats // sp
        kwargs.pop("cp_comm_type", None)
        self.inner = inner(inner_config, layer_number, attn_mask_type, attention_type, **kwargs)
        self.exchanged_bytes = 0

    def forward(
        self,
        query,
        key,
        value,
        attention_mask,
        attn_mask_type=None,
        attention_bias=None,
        packed_seq_params=None,
    ):
        sp = dist.get_world_size(self.sp_group)
        cu_padded = None if packed_seq_params is None else packed_seq_params.cu_seqlens_q_padded
        order = gathered_order(query.shape[0] * sp, sp, cu_padded)
        if self.repeats > 1:
            key = key.repeat_interleave(self.repeats, dim=2)
            value = value.repeat_interleave(self.repeats, dim=2)
        q, k, v = (_seq_to_head(t, self.sp_group, order) for t in (query, key, value))
        # what this rank hands to the all-to-alls in this forward (benchmarks/ulysses.py)
        self.exchanged_bytes = sum(t.numel() * t.element_size() for t in (query, key, value))
        extra = {} if packed_seq_params is None else {"packed_seq_params": packed_seq_params}
        if attention_bias is not None:
            extra["attention_bias"] = attention_bias
        context = self.inner(q, k, v, attention_mask, attn_mask_type=attn_mask_type, **extra)
        s, b = context.shape[:2]
        context = context.reshape(s, b, q.shape[2], q.shape[3])
        self.exchanged_bytes += context.numel() * context.element_size()
        return _head_to_seq(context, self.sp_group, order).reshape(s // sp, b, -1)


class _SumToAll(torch.autograd.Function):
    """All-reduce (sum) whose backward is the identity.

    Every SP rank computes the same loss from the combined tensor, so the gradient of each
    rank's own contribution is exactly the incoming gradient (an all-reduce in backward would
    count it SP times).
    """

    @staticmethod
    def forward(ctx, x, group):
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def combine_positions(local: Tensor, positions: Tensor, seq_len: int, group) -> Tensor:
    """Per-position values of this rank's slice [b, s/SP, ...] -> the whole row [b, s, ...]."""
    full = local.new_zeros(local.shape[0], seq_len, *local.shape[2:])
    full = full.index_copy(1, positions.to(local.device), local)
    return _SumToAll.apply(full, group)
