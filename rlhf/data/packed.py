"""Packed (THD) micro-batches for Megatron's packed-sequence path.

A micro-batch of variable-length sequences becomes one row of concatenated tokens with
per-sequence positions and cumulative lengths, so attention never crosses sequences and no
compute is spent on padding beyond `pad_to_multiple_of` (2 x CP for context parallelism).
`rlhf.engine.micro_batch` builds its THD micro-batches with `pack_sequences`; the tests
hold the inverse (cut a packed tensor back per sequence) that proves the layout exact.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from rlhf.utils import round_up


@dataclass(frozen=True)
class PackedBatch:
    """n sequences packed into T tokens (T = sum of padded lengths).

    tokens: [T] the sequences back to back, each followed by its padding (`pad_value`).
    position_ids: [T] 0, 1, ... restarting at every sequence (padding continues counting).
    cu_seqlens: [n+1] int32 cumulative real lengths (Megatron's `cu_seqlens_q`).
    cu_seqlens_padded: [n+1] int32 offsets of the sequences in `tokens`.
    max_seqlen: the longest padded length. indices: which step sequences these are.
    Megatron takes `tokens[None]` / `position_ids[None]` ([1, T]) with `packed_seq_params()`.
    """

    tokens: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    cu_seqlens_padded: torch.Tensor
    max_seqlen: int
    indices: list[int]

    @property
    def seq_lens(self) -> list[int]:
        return (self.cu_seqlens[1:] - self.cu_seqlens[:-1]).tolist()

    @property
    def num_tokens(self) -> int:
        """Tokens processed, padding included (T)."""
        return int(self.cu_seqlens_padded[-1])

    def packed_seq_params(self):
        """Megatron-Core `PackedSeqParams` (THD) describing this batch."""
        from megatron.core.packed_seq_params import PackedSeqParams

        return PackedSeqParams(
            qkv_format="thd",
            cu_seqlens_q=self.cu_seqlens,
            cu_seqlens_kv=self.cu_seqlens,
            cu_seqlens_q_padded=self.cu_seqlens_padded,
            cu_seqlens_kv_padded=self.cu_seqlens_padded,
            max_seqlen_q=self.max_seqlen,
            max_seqlen_kv=self.max_seqlen,
        )


def _cumulative(lengths: Sequence[int], device: torch.device) -> torch.Tensor:
    out = torch.zeros(len(lengths) + 1, dtype=torch.int32, device=device)
    out[1:] = torch.tensor(lengths, dtype=torch.int64, device=device).cumsum(0).to(torch.int32)
    return out


def pack_sequences(
    seqs: Sequence[torch.Tensor],
    *,
    pad_to_multiple_of: int = 1,
    pad_value: int = 0,
    indices: Sequence[int] | None = None,
) -> PackedBatch:
    """Pack 1-D token tensors (variable lengths) into a `PackedBatch`."""
    if not seqs:
        raise ValueError("cannot pack an empty micro-batch")
    lengths = [int(s.shape[0]) for s in seqs]
    if min(lengths) == 0:
        raise ValueError(f"sequence {lengths.index(0)} of the micro-batch is empty")
    if pad_to_multiple_of < 1:
        raise ValueError(f"pad_to_multiple_of must be >= 1, got {pad_to_multiple_of}")
    padded = [round_up(n, pad_to_multiple_of) for n in lengths]
    device = seqs[0].device
    cu_padded = _cumulative(padded, device)
    tokens = scatter_sequences(seqs, cu_padded, int(cu_padded[-1]), pad_value)
    positions = torch.cat([torch.arange(p, device=device) for p in padded])
    return PackedBatch(
        tokens=tokens,
        position_ids=positions,
        cu_seqlens=_cumulative(lengths, device),
        cu_seqlens_padded=cu_padded,
        max_seqlen=max(padded),
        indices=list(indices) if indices is not None else list(range(len(seqs))),
    )


def scatter_sequences(values, cu_padded: torch.Tensor, total: int, pad_value) -> torch.Tensor:
    """[total, ...] tensor holding `values[i]` at offset `cu_padded[i]`, `pad_value` elsewhere."""
    first = values[0]
    out = torch.full((total, *first.shape[1:]), pad_value, dtype=first.dtype, device=first.device)
    for value, start in zip(values, cu_padded[:-1].tolist()):
        out[start : start + value.shape[0]] = value
    return out
