"""Packed micro-batches for the Megatron forward passes of the PPO stages.

A micro-batch packs its samples (prompt + response each) back to back in one row of T
tokens, so no compute goes to padding. Attention must not cross samples:

- with the local (CPU) spec, a block-diagonal causal mask [1, 1, T, T] does it. Positions
  are not restarted per sample: RoPE scores depend only on the distance between two tokens,
  so a sample shifted along the row attends exactly as it would alone (tested against
  per-sample forwards);
- with Transformer Engine (GPU), Megatron's THD path takes `PackedSeqParams` (cu_seqlens)
  built by `rlhf.data.packed`.

The logits (or values) at row position t belong to the next token, so response token j of a
sample starting at offset o with prompt length P is scored at position o + P - 1 + j;
`gather_index` [n, R] holds these positions for the n samples of the micro-batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from rlhf.trainer.batch import RolloutBatch


@dataclass
class MicroBatch:
    """Inputs of one packed forward.

    tokens, position_ids: [1, T]; attention_mask: [1, 1, T, T] bool, True = masked (local
    spec) or None (THD: `packed_seq_params` set); labels: [1, T] the next token of each
    position (meaningless at sample ends, which are never gathered); gather_index: [n, R]
    row positions of each sample's response tokens (0 where masked); mask: [n, R];
    sample_ids: the n samples, indices into the step's batch.
    """

    tokens: Tensor
    position_ids: Tensor
    attention_mask: Tensor | None
    packed_seq_params: object | None
    labels: Tensor
    gather_index: Tensor
    mask: Tensor
    sample_ids: list[int]

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.shape[1])

    def gather(self, per_position: Tensor) -> Tensor:
        """[1, T, ...] per-position values -> [n, R, ...] per response token (0 when masked)."""
        flat = per_position[0]
        picked = flat[self.gather_index.reshape(-1)].reshape(
            *self.gather_index.shape, *flat.shape[1:]
        )
        mask = self.mask.reshape(*self.mask.shape, *([1] * (picked.dim() - 2)))
        return torch.where(mask, picked, torch.zeros((), dtype=picked.dtype))

    def select(self, batch_tensor: Tensor) -> Tensor:
        """Rows of a [B, R] step tensor for this micro-batch's samples: [n, R]."""
        return batch_tensor[self.sample_ids]


def block_causal_mask(lengths: list[int]) -> Tensor:
    """[1, 1, T, T] True where attention is not allowed (other samples, or the future)."""
    segment = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    total = int(segment.numel())
    causal = torch.ones(total, total, dtype=torch.bool).tril()
    allowed = causal & (segment[:, None] == segment[None, :])
    return (~allowed)[None, None]


def build_micro_batch(batch: RolloutBatch, sample_ids: list[int], thd: bool = False) -> MicroBatch:
    """Pack `sample_ids` of `batch` into one row (mask-based, or THD when `thd`)."""
    width = batch.response_width
    sequences = [batch.prompt_ids[i] + batch.response_ids[i] for i in sample_ids]
    lengths = [len(s) for s in sequences]
    tokens = torch.tensor([t for s in sequences for t in s], dtype=torch.long)
    gather_index = torch.zeros(len(sample_ids), width, dtype=torch.long)
    mask = torch.zeros(len(sample_ids), width, dtype=torch.bool)
    offset = 0
    for row, i in enumerate(sample_ids):
        prompt, response = len(batch.prompt_ids[i]), len(batch.response_ids[i])
        start = offset + prompt - 1
        gather_index[row, :response] = torch.arange(start, start + response)
        mask[row, :response] = True
        offset += lengths[row]
    labels = torch.roll(tokens, -1)
    if thd:
        from rlhf.data.packed import pack_sequences

        packed = pack_sequences([torch.tensor(s) for s in sequences], indices=sample_ids)
        positions, mask_4d, params = packed.position_ids, None, packed.packed_seq_params()
    else:
        positions = torch.arange(tokens.numel())
        mask_4d, params = block_causal_mask(lengths), None
    return MicroBatch(
        tokens=tokens[None],
        position_ids=positions[None],
        attention_mask=mask_4d,
        packed_seq_params=params,
        labels=labels[None],
        gather_index=gather_index,
        mask=mask,
        sample_ids=list(sample_ids),
    )


def default_token_budget(micro_batch_size: int, max_prompt: int, max_response: int) -> int:
    """The budget a fixed micro-batch of the longest sequences would use."""
    return micro_batch_size * (max_prompt + max_response)
