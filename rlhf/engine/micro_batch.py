"""Micro-batching, in one place: a step's batch -> packed micro-batches -> per-sample outputs.

Every pass of the step goes through here: the forward-only passes (old and reference
log-probs, values, reward-model scores, the weight-sync probe) with
`MicroBatchPlanner.per_sample`, the updates with `MicroBatchPlanner.plan` (one list of
micro-batches per mini-batch) and `mini_batch_counts`. Which samples a DP rank takes and how
they are grouped is the balanced token-budget plan of `rlhf.data.packing`.

A micro-batch packs its samples (prompt + response each) back to back in one row of T
tokens, so no compute goes to padding. Attention must not cross samples:

- with the local (CPU) spec, `PackedSeqParams` in the "sbhd" format give the samples'
  boundaries and the core attention runs on each sample's slice
  (`rlhf.models.packed_attention`), so a row costs the sum of its samples' squares; under
  Ulysses SP a block-diagonal causal mask [1, 1, T, T] does it instead. Positions are not
  restarted per sample: RoPE scores depend only on the distance between two tokens, so a
  sample shifted along the row attends exactly as it would alone (tested against
  per-sample forwards);
- with Transformer Engine (GPU), Megatron's THD path takes `PackedSeqParams` (cu_seqlens)
  built by `rlhf.data.packed`.

The logits (or values) at row position t belong to the next token, so response token j of a
sample starting at offset o with prompt length P is scored at position o + P - 1 + j;
`gather_index` [n, R] holds these positions for the n samples of the micro-batch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor
from torch.distributed import ProcessGroup

from rlhf.algo.losses import BatchCounts, global_batch_counts
from rlhf.config.budgets import MicroBatching
from rlhf.data.images import ImageInputs
from rlhf.data.packing import plan_fixed_micro_batches, plan_micro_batches
from rlhf.distributed.collectives import sum_over_dp_and_pp
from rlhf.distributed.context import ParallelContext
from rlhf.models.vision_arch import VisionArch, image_token_mask, mrope_positions
from rlhf.parallel.ulysses import SequenceShard, combine_positions, held_positions
from rlhf.rollout.batch import RolloutBatch
from rlhf.utils import round_up

CU_SEQLENS_FIELDS = ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded")


@dataclass
class MicroBatch:
    """Inputs of one packed forward.

    tokens, position_ids: [1, T]; attention_mask: [1, 1, T, T] bool, True = masked (local
    spec under Ulysses SP) or None (`packed_seq_params` set: THD, or "sbhd" sample
    bounds); labels: [1, T] the next token of each position (meaningless at sample ends,
    which are never gathered); gather_index: [n, R] row positions of each sample's policy
    tokens (its response tokens but tool messages; 0 where masked, see
    `rlhf.rollout.batch`); mask: [n, R]; rows: gather_index[mask], the positions of the
    unmasked tokens in order (built on the host, so no device sync finds them; whole-row
    positions under Ulysses SP too); sample_ids: the n samples, indices into the step's
    batch; routes: [T, layers x top-k] int16, the experts the rollout engine routed
    each position's token to (-1: none, i.e. padding and each sample's last token), when
    the batch has them (rollout routing replay, `rlhf.engine.route_replay`); images: the
    samples' images in row order, for a vision-language model (position_ids are then its
    multimodal positions [3, 1, T], see `mrope_row`).
    """

    tokens: Tensor
    position_ids: Tensor
    attention_mask: Tensor | None
    packed_seq_params: Any  # Megatron's PackedSeqParams (THD), or None
    labels: Tensor
    gather_index: Tensor
    mask: Tensor
    rows: Tensor
    sample_ids: list[int]
    row_len: int = 0  # T, the whole row (tokens hold only this rank's slice under SP)
    padding_mask: Tensor | None = None  # [1, T] True = padding: no sample's token (MoE routing)
    local_positions: Tensor | None = None  # Ulysses: the row positions this SP rank holds
    sp_group: ProcessGroup | None = None
    routes: Tensor | None = None  # (host memory; Ulysses: this SP rank's positions only)
    images: ImageInputs | None = None
    image_mask: Tensor | None = None  # [1, T] True at the images' tokens (`mrope_row`)

    def model_inputs(self) -> dict[str, Tensor]:
        """The model's keyword inputs beyond tokens, positions and masks (the images)."""
        if self.images is None:
            return {}
        images = self.images
        assert self.image_mask is not None, "a micro-batch with images marks their tokens"
        return {
            "pixel_values": images.pixel_values,
            "image_grid_thw": images.grid_thw,
            "image_mask": self.image_mask,
        }

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.shape[1])

    def gather(self, per_position: Tensor, shift: int = 0) -> Tensor:
        """[1, T, ...] per-position values -> [n, R, ...] per response token (0 when masked).

        Response token t is read at the position before it (whose output predicts it);
        `shift=1` reads it at its own position (a reward model's score of the sequence up to
        and including t).

        Under Ulysses SP the values of this rank's slice are first combined into the whole
        row over the SP group (differentiably: each rank's gradient reaches its own slice).
        """
        if self.local_positions is not None:
            per_position = combine_positions(
                per_position, self.local_positions, self.row_len, self.sp_group
            )
        flat = per_position[0]
        index = self.gather_index + shift if shift else self.gather_index
        picked = flat[index.reshape(-1)].reshape(*self.gather_index.shape, *flat.shape[1:])
        mask = self.mask.reshape(*self.mask.shape, *([1] * (picked.dim() - 2)))
        return torch.where(mask, picked, torch.zeros((), dtype=picked.dtype))

    def unmask(self, values: Tensor) -> Tensor:
        """[n, R]: `values` [mask.sum()] of the unmasked tokens in row order, 0 elsewhere
        (differentiably)."""
        blank = torch.zeros(self.mask.shape, dtype=values.dtype, device=values.device)
        return blank.masked_scatter(self.mask, values)

    def select(self, batch_tensor: Tensor) -> Tensor:
        """Rows of a [B, R] step tensor for this micro-batch's samples: [n, R], on its device."""
        return batch_tensor[self.sample_ids].to(self.tokens.device)

    def to(self, device: torch.device) -> MicroBatch:
        """The same micro-batch with its tensors on `device`."""
        if self.tokens.device == device:
            return self
        params = self.packed_seq_params
        if params is not None:
            params = dataclasses.replace(
                params,
                **{k: getattr(params, k).to(device) for k in CU_SEQLENS_FIELDS},
            )
        mask = None if self.attention_mask is None else self.attention_mask.to(device)
        local = None if self.local_positions is None else self.local_positions.to(device)
        padding = None if self.padding_mask is None else self.padding_mask.to(device)
        images = self.images
        if images is not None:
            images = ImageInputs(images.pixel_values.to(device), images.grid_thw.to(device))
        image_mask = None if self.image_mask is None else self.image_mask.to(device)
        return dataclasses.replace(
            self,
            images=images,
            image_mask=image_mask,
            local_positions=local,
            padding_mask=padding,
            tokens=self.tokens.to(device),
            position_ids=self.position_ids.to(device),
            attention_mask=mask,
            packed_seq_params=params,
            labels=self.labels.to(device),
            gather_index=self.gather_index.to(device),
            rows=self.rows.to(device),
            mask=self.mask.to(device),
        )


def sample_bounds_params(bounds: list[int]):
    """`PackedSeqParams` ("sbhd") marking where each sample of a packed row starts and ends.

    Positions run along the whole row, so the max_seqlen fields (which size Megatron's RoPE
    table) are the row's length."""
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = torch.tensor(bounds, dtype=torch.int32)
    return PackedSeqParams(
        qkv_format="sbhd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        cu_seqlens_q_padded=cu,
        cu_seqlens_kv_padded=cu,
        max_seqlen_q=bounds[-1],
        max_seqlen_kv=bounds[-1],
    )


def block_causal_mask(lengths: list[int]) -> Tensor:
    """[1, 1, T, T] True where attention is not allowed (other samples, or the future)."""
    segment = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    total = int(segment.numel())
    causal = torch.ones(total, total, dtype=torch.bool).tril()
    allowed = causal & (segment[:, None] == segment[None, :])
    return (~allowed)[None, None]


def _row_layout(lengths: list[int], multiple: int, thd: bool) -> tuple[list[int], int]:
    """Start of each sample in the row, and the row length (padded for SP)."""
    padded = [round_up(n, multiple) for n in lengths] if thd else lengths
    starts = [sum(padded[:i]) for i in range(len(padded))]
    return starts, round_up(sum(padded), 1 if thd else multiple)


def row_multiple(sp_size: int, tp_split: int) -> int:
    """What a packed row's length must be a multiple of: 2 x SP under Ulysses (each rank's
    zig-zag halves), times TP under Megatron's sequence parallelism (`tp_split`: each
    rank's slice split again over the TP ranks)."""
    return (2 * sp_size if sp_size > 1 else 1) * tp_split


def mrope_row(
    batch: RolloutBatch, sample_ids: list[int], starts: list[int], row_len: int, vision: VisionArch
) -> tuple[Tensor, Tensor]:
    """[3, row_len] a vision-language model's positions: each sample's own multimodal
    positions (from 0, as transformers gives them for the sample alone) from its start in
    the row, 0 on padding, which no sample attends to; and [row_len] True at the tokens of
    the samples' images (`image_token_mask`: not an image token the policy generated)."""
    positions = torch.zeros(3, row_len, dtype=torch.long)
    mask = torch.zeros(row_len, dtype=torch.bool)
    for i, start in zip(sample_ids, starts):
        sequence = batch.prompt_ids[i] + batch.response_ids[i]
        images = batch.images[i] if batch.images is not None else None
        grids = [] if images is None else images.grids
        end = start + len(sequence)
        marked = image_token_mask(sequence, len(grids), vision.image_token_id)
        positions[:, start:end] = mrope_positions(sequence, grids, vision, marked)
        mask[start:end] = torch.tensor(marked, dtype=torch.bool)
    return positions, mask


def row_images(batch: RolloutBatch, sample_ids: list[int]) -> ImageInputs | None:
    """The images of `sample_ids` in order (None when they have none)."""
    if batch.images is None:
        return None
    return ImageInputs.concat([x for i in sample_ids if (x := batch.images[i]) is not None])


def _policy_positions(
    batch: RolloutBatch, sample_ids: list[int], starts: list[int]
) -> tuple[Tensor, Tensor]:
    """[n, R] the row positions whose outputs score each sample's policy tokens, and [n, R]
    which exist."""
    width = batch.response_width
    index_rows, mask_rows = [], []
    for i, start in zip(sample_ids, starts):  # lists, one tensor each: no torch call a sample
        first = start + len(batch.prompt_ids[i]) - 1  # predicts the first response token
        policy = batch.policy_positions(i)
        index_rows.append([first + t for t in policy] + [0] * (width - len(policy)))
        mask_rows.append([True] * len(policy) + [False] * (width - len(policy)))
    shape = (len(sample_ids), width)
    gather_index = torch.tensor(index_rows, dtype=torch.long).reshape(shape)
    return gather_index, torch.tensor(mask_rows, dtype=torch.bool).reshape(shape)


def _row_tokens(
    sequences: list[list[int]], real: list[int], starts: list[int], row_len: int
) -> tuple[Tensor, Tensor]:
    """[row_len] the row's tokens (each sequence from its start, 0 elsewhere) and True where
    no sample's real token is; built as lists, one tensor each (no torch call a sample)."""
    row: list[int] = [0] * row_len
    unused = [True] * row_len
    for start, sequence, n in zip(starts, sequences, real):
        row[start : start + len(sequence)] = sequence
        unused[start : start + n] = [False] * n
    return torch.tensor(row, dtype=torch.long), torch.tensor(unused, dtype=torch.bool)


def build_micro_batch(
    batch: RolloutBatch,
    sample_ids: list[int],
    thd: bool = False,
    sp: SequenceShard | None = None,
    tp_split: int = 1,
    padded: bool = False,
    vision: VisionArch | None = None,
) -> MicroBatch:
    """Pack `sample_ids` of `batch` into one row (mask-based, or THD when `thd`); `padded`:
    each sample followed by padding to the longest sample's length, attended to only by the
    padding after it (causal), never gathered (verl's padded batches, computed).

    Under Ulysses SP (`sp.size` > 1) the row is padded to a multiple of 2 x SP (THD: every
    sample) and the tokens keep only this rank's zig-zag slice; masks stay whole-row. Under
    Megatron's sequence parallelism (`tp_split` = TP) the multiple is TP times larger; without
    Ulysses the padding trails the last sample, which attends only to itself causally.
    No `sample_ids` (an interleaved pipeline's filler): one row of padding, nothing gathered.
    `vision`: the model is vision-language (`mrope_row` positions, the samples' images).
    """
    sp_size = 1 if sp is None else sp.size
    ulysses = sp_size > 1
    multiple = row_multiple(sp_size, tp_split)
    sequences = [batch.prompt_ids[i] + batch.response_ids[i] for i in sample_ids]
    if not sequences:
        sequences = [[0] * multiple]
    real = [len(seq) for seq in sequences]  # before `padded` fills them up
    if padded:
        longest = max(real)
        sequences = [seq + [0] * (longest - len(seq)) for seq in sequences]
    lengths = [len(seq) for seq in sequences]
    starts, row_len = _row_layout(lengths, multiple, thd)
    tokens, padding_mask = _row_tokens(sequences, real, starts if sample_ids else [], row_len)
    gather_index, mask = _policy_positions(batch, list(sample_ids), starts)
    labels = torch.roll(tokens, -1)
    params, mask_4d, cu_padded = None, None, None
    if thd:
        from rlhf.data.packed import pack_sequences

        packed = pack_sequences(
            [torch.tensor(q) for q in sequences], pad_to_multiple_of=multiple, indices=sample_ids
        )
        positions, params, cu_padded = (
            packed.position_ids,
            packed.packed_seq_params(),
            packed.cu_seqlens_padded,
        )
    elif not ulysses:
        positions, params = torch.arange(row_len), sample_bounds_params([*starts, row_len])
    else:
        positions = torch.arange(row_len)
        padding = row_len - sum(lengths)
        mask_4d = block_causal_mask(lengths + ([padding] if padding else []))
    image_mask = None
    if vision is not None:  # (Ulysses SP with images is refused at startup)
        positions, image_mask = mrope_row(batch, list(sample_ids), starts, row_len, vision)
    mb = MicroBatch(
        tokens=tokens[None],
        position_ids=positions[None] if vision is None else positions[:, None],
        attention_mask=mask_4d,
        packed_seq_params=params,
        labels=labels[None],
        gather_index=gather_index,
        mask=mask,
        rows=gather_index[mask],
        sample_ids=list(sample_ids),
        row_len=row_len,
        padding_mask=padding_mask[None] if sample_ids else None,  # a filler: no tokens at all
        routes=row_routes(batch.routed_experts, sample_ids, starts, row_len),
        images=row_images(batch, list(sample_ids)),
        image_mask=None if image_mask is None else image_mask[None],
    )
    if not ulysses:
        return mb
    assert sp is not None
    return _slice_for_rank(mb, sp, cu_padded)


def row_routes(
    routed_experts: list[Tensor] | None, sample_ids: list[int], starts: list[int], row_len: int
) -> Tensor | None:
    """[row_len, layers x top-k] int16: each sample's routed experts from its start in the
    row on (all its tokens but the last), -1 elsewhere; None without routes or samples."""
    if routed_experts is None or not sample_ids:
        return None
    widths = {int(routed_experts[i].shape[1]) for i in sample_ids}
    assert len(widths) == 1, f"samples {sample_ids} have routes of widths {widths}"
    routes = torch.full((row_len, widths.pop()), -1, dtype=torch.int16)
    for i, start in zip(sample_ids, starts):
        routes[start : start + len(routed_experts[i])] = routed_experts[i]
    return routes


def _slice_for_rank(mb: MicroBatch, sp: SequenceShard, cu_padded: Tensor | None) -> MicroBatch:
    local = held_positions(mb.row_len, sp.size, sp.rank, cu_padded)
    return dataclasses.replace(
        mb,
        routes=None if mb.routes is None else mb.routes[local],
        tokens=mb.tokens[:, local],
        position_ids=mb.position_ids[:, local],
        labels=mb.labels[:, local],
        padding_mask=None if mb.padding_mask is None else mb.padding_mask[:, local],
        local_positions=local,
        sp_group=sp.group,
    )


@dataclass(frozen=True)
class MicroBatchPlanner:
    """Cuts a step's samples into this rank's packed micro-batches.

    `thd`: pack with Transformer Engine's THD layout (cu_seqlens) instead of masks;
    `interleaved`: the models run Megatron's interleaved pipeline.
    """

    ctx: ParallelContext
    thd: bool
    interleaved: bool = False
    padded: bool = False  # data.use_sequence_packing=false
    vision: VisionArch | None = None  # a vision-language model's (images, mRoPE positions)

    def plan(
        self,
        batch: RolloutBatch,
        budget: int | MicroBatching,
        mini_batch_size: int | None = None,
    ) -> list[list[MicroBatch]]:
        """This rank's micro-batches per mini-batch (`mini_batch_size` samples; None: one).

        `budget`: tokens per micro-batch per rank (an int, or a `MicroBatching` without
        `samples`): token-budget micro-batches balanced over the DP ranks by
        `rlhf.data.packing`; a `MicroBatching` with `samples`: that many samples each, in
        order. Under the interleaved pipeline their count is a multiple of PP (Megatron's
        schedule runs them in groups of PP). `padded`: each sample padded to the longest of
        its micro-batch.
        """
        sp = SequenceShard.of(self.ctx)
        count_multiple = self.ctx.pp_size if self.interleaved else 1
        lengths, dp, multiple = batch.sequence_lengths, self.ctx.dp_size, self.row_multiple
        if isinstance(budget, MicroBatching) and budget.samples is not None:
            micro = plan_fixed_micro_batches(
                lengths,
                micro_batch_size=budget.samples,
                dp_size=dp,
                mini_batch_size=mini_batch_size,
                pad_to_multiple_of=multiple,
                count_multiple=count_multiple,
            )
        else:
            tokens = budget.tokens if isinstance(budget, MicroBatching) else budget
            micro = plan_micro_batches(
                lengths,
                max_tokens_per_micro_batch=tokens * sp.size,  # a row spreads over the SP ranks
                dp_size=dp,
                mini_batch_size=mini_batch_size,
                pad_to_multiple_of=multiple,
                count_multiple=count_multiple,
            )
        return [
            [self.micro_batch(batch, ids) for ids in mini]
            for mini in micro.for_rank(self.ctx.dp_rank)
        ]

    def micro_batch(self, batch: RolloutBatch, sample_ids: list[int]) -> MicroBatch:
        """`sample_ids` of `batch` packed into one micro-batch on this rank's device."""
        sp = SequenceShard.of(self.ctx)
        tp_split = self._tp_split()
        mb = build_micro_batch(batch, sample_ids, self.thd, sp, tp_split, self.padded, self.vision)
        return mb.to(self.ctx.device)

    def plan_units(
        self, batch: RolloutBatch, budget: int, units: list[list[int]]
    ) -> list[MicroBatch]:
        """This rank's micro-batches of one mini-batch whose `units` (lists of sample ids, e.g.
        the two sides of a preference pair) are never split between micro-batches or ranks:
        token-budget micro-batches of whole units, balanced over the DP ranks (the number of
        units a multiple of the DP size)."""
        multiple, lengths = self.row_multiple, batch.sequence_lengths
        unit_lengths = [sum(round_up(lengths[i], multiple) for i in unit) for unit in units]
        micro = plan_micro_batches(
            unit_lengths,
            max_tokens_per_micro_batch=budget * self.ctx.sp_size,
            dp_size=self.ctx.dp_size,
            count_multiple=self.ctx.pp_size if self.interleaved else 1,
        )
        (mini,) = micro.for_rank(self.ctx.dp_rank)
        return [self.micro_batch(batch, [i for u in bin_ for i in units[u]]) for bin_ in mini]

    def _tp_split(self) -> int:
        return self.ctx.tp_size if self.ctx.sequence_parallel else 1

    @property
    def row_multiple(self) -> int:
        """What every sample's length is padded to a multiple of (`row_multiple`)."""
        return row_multiple(self.ctx.sp_size, self._tp_split())

    def per_sample(
        self,
        model: ForwardModel,
        batch: RolloutBatch,
        budget: int | MicroBatching,
        head: Any,
        keys: Sequence[str],
        width: int | None = None,
        mini_batch_size: int | None = None,
    ) -> list[Tensor]:
        """[B, width] tensors `keys` (width: the response width by default) from one
        forward-only pass of `model` with `head` over the whole batch, identical on every
        rank (each rank computes its DP share of the samples). `mini_batch_size`: plan the
        micro-batches as an update of that many samples per step would (routing replay)."""
        minis = self.plan(batch, budget, mini_batch_size)
        micro_batches = [mb for mini in minis for mb in mini]
        outputs = model.forward(micro_batches, head)
        shape = (batch.size, batch.response_width if width is None else width)
        return [gather_per_sample(outputs, micro_batches, k, shape, self.ctx) for k in keys]

    def mini_batch_counts(self, micro_batches: list[MicroBatch]) -> BatchCounts:
        """Response tokens / responses of a whole mini-batch (this rank's micro-batches, all
        DP ranks): what its losses are normalised by."""
        group = self.ctx.dp_group if self.ctx.dp_size > 1 else None
        return global_batch_counts([mb.mask for mb in micro_batches], group)


class ForwardModel(Protocol):
    """A model whose forward-only pass runs a head over micro-batches (`MegatronModel`)."""

    def forward(self, micro_batches: list[MicroBatch], head: Any) -> list[dict]: ...


def gather_per_sample(
    outputs: list[dict],
    micro_batches: list[MicroBatch],
    key: str,
    shape: tuple[int, int],
    ctx: ParallelContext,
) -> Tensor:
    """[B, R] step tensor from the per-micro-batch [n, R] outputs `key` of every rank."""
    result = torch.zeros(shape, dtype=torch.float32, device=ctx.device)
    for mb, out in zip(micro_batches, outputs):
        result[mb.sample_ids] = out[key].float().to(ctx.device)
    return sum_over_dp_and_pp(result, ctx).cpu()
