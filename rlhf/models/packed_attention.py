"""Causal attention within each sample of a packed row, for the local (non-TE) layer spec.

A packed micro-batch puts many samples back to back in one row of T tokens. Megatron's local
`DotProductAttention` can only mask: it computes all T x T scores and discards those across
samples, so a row's attention costs T^2 instead of the sum of its samples' squares, and keeps a
T x T softmax for the backward. `PackedDotProductAttention` is the local spec's core attention:
given `PackedSeqParams` with `qkv_format="sbhd"` and the samples' boundaries (`cu_seqlens_q`),
it lays the row's samples out as a right-padded batch and runs one causal
`scaled_dot_product_attention` over it (one call per layer, not one per sample); without
them (a plain causal batch, e.g. `rlhf-convert verify`) it is Megatron's own attention.
Positions are not restarted per sample: RoPE scores depend only on the distance between two
tokens. With Transformer Engine the THD path does the same in one fused kernel.

Multi-latent attention (DeepSeek-V3) has keys wider than its values (`k_channels`,
`v_channels`), which Megatron's local core attention does not take: this one does, and
`PackedMLASelfAttention` keeps a packed row's [s, b, ...] shape, where Megatron's MLA takes
any packed parameters for the THD layout (it drops the batch dimension).
"""

from __future__ import annotations

import functools
import itertools

import torch
import torch.nn.functional as F
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.multi_latent_attention import MLASelfAttention
from torch import Tensor
from torch._subclasses.fake_tensor import FakeTensor


def sample_boundaries(packed_seq_params) -> list[int] | None:
    """[0, end_1, ..., T] of a "sbhd" packed row, or None for an unpacked batch."""
    if packed_seq_params is None or packed_seq_params.qkv_format != "sbhd":
        return None
    return [int(x) for x in packed_seq_params.cu_seqlens_q.tolist()]


class PackedDotProductAttention(DotProductAttention):
    """Megatron's local core attention, computed per sample on packed rows (see the module);
    `k_channels` / `v_channels`: a head's key and value widths (MLA's; None: kv_channels)."""

    def __init__(self, *args, k_channels=None, v_channels=None, **kwargs):
        super().__init__(*args, **kwargs)
        if v_channels is not None:  # MLA: the context is heads x the value width
            self.hidden_size_per_partition = self.num_attention_heads_per_partition * v_channels

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask,
        attn_mask_type=None,
        attention_bias=None,
        packed_seq_params=None,
    ):
        bounds = sample_boundaries(packed_seq_params)
        if bounds is None:
            return super().forward(
                query, key, value, attention_mask, attn_mask_type, attention_bias, packed_seq_params
            )
        # [s, b, heads, d] -> [b, heads, s, d]; grouped KV heads stay grouped (SDPA's GQA)
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))
        scale = self.softmax_scale
        if self.config.apply_query_key_layer_scaling:
            scale *= self.layer_number  # Megatron divides it out of the scale, then back in
        dropout = self.config.attention_dropout if self.training else 0.0
        s, b = query.shape[0], query.shape[1]
        assert b == 1, "a packed micro-batch is one row"
        context = padded_causal_attention(q[0], k[0], v[0], bounds, scale, dropout)
        return context.reshape(s, b, self.hidden_size_per_partition)


def padded_causal_attention(
    q: Tensor, k: Tensor, v: Tensor, bounds: list[int], scale: float, dropout: float
) -> Tensor:
    """Causal attention within each sample of one packed row ([heads, s, d] each, keys and
    values with as many heads as the queries or a divisor of it (grouped-query attention);
    sample i is positions bounds[i]:bounds[i+1]) as ONE `scaled_dot_product_attention` call:
    the samples laid out right-padded as a [n, heads, longest, d] batch. Causal masking alone
    is exact there: a real query sees only keys at or before it, all of its own sample's,
    and the padded queries' outputs are dropped. Each token's row of heads moves into and
    out of the padded grid by one `index_select` along the tokens (a padding slot reads an
    appended zero row), which keeps only its index for the backward. Returns [s, heads, d]."""
    # the memory simulation's fake tensors are not kept past their mode: built anew there
    grid = _grid.__wrapped__ if isinstance(q, FakeTensor) else _grid
    count, longest, slots, fill = grid(tuple(bounds), q.device)

    def padded(x: Tensor) -> Tensor:  # [heads, s, d] -> [n, heads, longest, d]
        rows_of_heads = x[:, bounds[0] : bounds[-1]].transpose(0, 1)
        padding = rows_of_heads.new_zeros(1, x.shape[0], x.shape[2])
        grid = torch.cat([rows_of_heads, padding]).index_select(0, fill)
        return grid.view(count, longest, x.shape[0], x.shape[2]).transpose(1, 2)

    out = F.scaled_dot_product_attention(
        padded(q),
        padded(k),
        padded(v),
        is_causal=True,
        scale=scale,
        dropout_p=dropout,
        enable_gqa=k.shape[0] != q.shape[0],
    )
    return out.transpose(1, 2).reshape(count * longest, q.shape[0], -1).index_select(0, slots)


@functools.lru_cache(maxsize=4)  # every layer of a micro-batch has the same samples
def _grid(bounds: tuple[int, ...], device: torch.device) -> tuple[int, int, Tensor, Tensor]:
    """The padded grid of a packed row's samples: (samples, longest, each token's slot in
    the flattened grid, each slot's token or the appended zero row), on `device`."""
    lengths = torch.tensor([b - a for a, b in itertools.pairwise(bounds)])
    count, longest, tokens = len(lengths), int(lengths.max()), bounds[-1] - bounds[0]
    rows = torch.repeat_interleave(torch.arange(count), lengths)
    starts = torch.repeat_interleave(torch.tensor(bounds[:-1]), lengths)
    slots = rows * longest + torch.arange(tokens) + bounds[0] - starts
    fill = torch.full((count * longest,), tokens).index_copy(0, slots, torch.arange(tokens))
    return count, longest, slots.to(device), fill.to(device)


class PackedMLASelfAttention(MLASelfAttention):
    """Megatron's MLA self-attention for packed rows in the "sbhd" layout: the projections
    and the rotary embedding see the row as the [s, b, h] tensor it is (positions along
    the row), and the core attention gets the samples' boundaries."""

    def get_query_key_value_tensors(
        self,
        hidden_states,
        key_value_states=None,
        position_ids=None,
        packed_seq_params=None,
        *args,
        **kwargs,
    ):
        if sample_boundaries(packed_seq_params) is not None:
            packed_seq_params = None
        return super().get_query_key_value_tensors(
            hidden_states, key_value_states, position_ids, packed_seq_params, *args, **kwargs
        )
