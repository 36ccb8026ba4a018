"""Token-budget micro-batches, balanced across data-parallel ranks.

Fixed-size micro-batches of padded sequences spend much of their compute on padding when
lengths are long-tailed (RLHF responses are). Here each step's sequences are planned by
token count instead:

1. Sequences are cut into mini-batches in order (one optimizer step each); nothing below
   crosses a mini-batch boundary.
2. Each mini-batch is split across DP ranks with the same number of sequences per rank and
   nearly equal token sums, by the balanced Karmarkar-Karp differencing method: sort by
   length, seed one partial partition per run of `dp_size` sequences, then repeatedly merge
   the two partial partitions whose loads differ most, heaviest part with lightest part.
3. On every rank the sequences are packed into micro-batches of at most
   `max_tokens_per_micro_batch` tokens. All ranks use the same count k, the largest count
   first-fit-decreasing needs on any rank (Megatron's schedule runs the same number of
   micro-batches everywhere); each rank fills its k micro-batches least-loaded-first. As
   every rank holds the same number of sequences and k never exceeds it, no micro-batch is
   empty. Megatron's interleaved pipeline needs k to be a multiple of PP
   (`count_multiple`): k is rounded up, and only when a rank holds fewer sequences than
   that are the remaining micro-batches empty (a row of padding, no samples).

Lengths are padded to `pad_to_multiple_of` (2 x the context-parallel size for Megatron's
load-balanced context parallelism) before planning; a sequence over the budget is an error.
The packed (THD) tensors for one micro-batch are built by `rlhf.data.packed`.
`plan_fixed_micro_batches` is verl's other mode (`use_dynamic_bsz=false`): a fixed number of
sequences per micro-batch, in order.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

from rlhf.utils import round_up

BUDGET_KEY = "actor_rollout_ref.actor.ppo_max_token_len_per_gpu"


@dataclass(frozen=True)
class MicroBatchPlan:
    """Which sequences every DP rank processes, per mini-batch and micro-batch.

    `assignments[mini][rank][micro]` lists indices into the step's sequences. Within a
    mini-batch every rank has the same number of micro-batches, none over `max_tokens`
    (counted with `lengths`, the padded lengths) and none empty unless the count had to
    reach a multiple of `count_multiple` with fewer sequences.
    """

    assignments: list[list[list[list[int]]]]
    lengths: list[int]
    max_tokens: int
    dp_size: int

    def for_rank(self, rank: int) -> list[list[list[int]]]:
        """This rank's micro-batches per mini-batch: [mini][micro] -> sequence indices."""
        return [mini[rank] for mini in self.assignments]

    def rank_tokens(self) -> list[list[int]]:
        """Padded tokens per rank in each mini-batch: [mini][rank]."""
        return [
            [sum(self.lengths[i] for micro in rank for i in micro) for rank in mini]
            for mini in self.assignments
        ]

    def imbalance(self) -> float:
        """Worst mini-batch's max/mean - 1 of per-rank tokens (0 = perfectly balanced)."""
        worst = 0.0
        for tokens in self.rank_tokens():
            mean = sum(tokens) / len(tokens)
            worst = max(worst, max(tokens) / mean - 1 if mean else 0.0)
        return worst

    def num_micro_batches(self) -> list[int]:
        """Micro-batches per rank in each mini-batch (the same on every rank)."""
        return [len(mini[0]) for mini in self.assignments]


def balanced_partition(weights: Sequence[int], parts: int) -> list[list[int]]:
    """Indices of `weights` split into `parts` groups of equal size with near-equal sums."""
    if parts < 1 or len(weights) % parts:
        raise ValueError(f"{len(weights)} items cannot be split evenly into {parts} parts")
    order = sorted(range(len(weights)), key=lambda i: (-weights[i], i))
    heap: list[tuple[int, int, list[tuple[int, list[int]]]]] = []
    for tie, start in enumerate(range(0, len(order), parts)):
        sets = [(weights[i], [i]) for i in order[start : start + parts]]
        heapq.heappush(heap, (-(sets[0][0] - sets[-1][0]), tie, sets))
    tie = len(heap)
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        a = sorted(a, key=lambda s: -s[0])
        b = sorted(b, key=lambda s: s[0])
        merged = sorted(
            ((sa + sb, ma + mb) for (sa, ma), (sb, mb) in zip(a, b)), key=lambda s: -s[0]
        )
        heapq.heappush(heap, (-(merged[0][0] - merged[-1][0]), tie, merged))
        tie += 1
    return [sorted(members) for _, members in heap[0][2]] if heap else [[] for _ in range(parts)]


def first_fit_bins(items: Sequence[int], lengths: Sequence[int], capacity: int) -> int:
    """Bins first-fit-decreasing needs for `items` under `capacity`."""
    loads: list[int] = []
    for i in sorted(items, key=lambda i: -lengths[i]):
        slot = next((b for b, load in enumerate(loads) if load + lengths[i] <= capacity), None)
        if slot is None:
            loads.append(lengths[i])
        else:
            loads[slot] += lengths[i]
    return len(loads)


def _place(
    ordered: Sequence[int], lengths: Sequence[int], num_bins: int, capacity: int, balance: bool
) -> list[list[int]] | None:
    """Items into `num_bins` bins: least-loaded bin (`balance`) or first that fits."""
    bins: list[list[int]] = [[] for _ in range(num_bins)]
    loads = [0] * num_bins
    for i in ordered:
        slot: int | None
        if balance:
            least = min(range(num_bins), key=lambda b: loads[b])
            slot = least if loads[least] + lengths[i] <= capacity else None
        else:
            slot = next((b for b in range(num_bins) if loads[b] + lengths[i] <= capacity), None)
        if slot is None:
            return None
        bins[slot].append(i)
        loads[slot] += lengths[i]
    return bins


def fill_bins(
    items: Sequence[int], lengths: Sequence[int], num_bins: int, capacity: int
) -> list[list[int]] | None:
    """`items` in exactly `num_bins` non-empty bins under `capacity`; None if impossible.

    Least-loaded bin first (balances the micro-batches); if that overflows, first-fit
    (which succeeds whenever first-fit-decreasing needs at most `num_bins`); then each empty
    bin takes the smallest item of the bin holding the most items.
    """
    ordered = sorted(items, key=lambda i: (-lengths[i], i))
    bins = _place(ordered, lengths, num_bins, capacity, balance=True)
    bins = bins or _place(ordered, lengths, num_bins, capacity, balance=False)
    if bins is None:
        return None
    for empty in [b for b in bins if not b]:
        donor = max(bins, key=len)
        if len(donor) < 2:
            return None
        empty.append(donor.pop())  # the donor's smallest item (bins were filled largest first)
    return [sorted(b) for b in bins]


def _check_budget(lengths: Sequence[int], raw: Sequence[int], budget: int, multiple: int):
    for i, (padded, length) in enumerate(zip(lengths, raw)):
        if length <= 0:
            raise ValueError(f"sequence {i} has length {length}; every sequence needs a token")
        if padded > budget:
            pad = f" ({length} padded to a multiple of {multiple})" if padded != length else ""
            raise ValueError(
                f"sequence {i} has {padded} tokens{pad}, more than the micro-batch budget of "
                f"{budget} tokens ({BUDGET_KEY}); raise the budget to at least {padded}"
            )


def plan_micro_batches(
    lengths: Sequence[int],
    *,
    max_tokens_per_micro_batch: int,
    dp_size: int = 1,
    mini_batch_size: int | None = None,
    pad_to_multiple_of: int = 1,
    count_multiple: int = 1,
) -> MicroBatchPlan:
    """Plan a step's sequences (prompt + response lengths, in order) as described above.

    `mini_batch_size` counts sequences (default: all in one mini-batch); it must divide the
    number of sequences and be divisible by `dp_size`. `count_multiple`: what the number of
    micro-batches per rank must be a multiple of.
    """
    if min(max_tokens_per_micro_batch, dp_size, pad_to_multiple_of, count_multiple) < 1:
        raise ValueError(
            "max_tokens_per_micro_batch, dp_size, pad_to_multiple_of and count_multiple must "
            "be >= 1"
        )
    total, mini = _mini_batch_split(len(lengths), mini_batch_size, dp_size)
    padded = [round_up(int(n), pad_to_multiple_of) for n in lengths]
    _check_budget(padded, lengths, max_tokens_per_micro_batch, pad_to_multiple_of)
    assignments = []
    for start in range(0, total, mini):
        weights = padded[start : start + mini]
        ranks = [[start + i for i in part] for part in balanced_partition(weights, dp_size)]
        # k <= sequences per rank (first-fit never needs more bins than items), so every
        # rank can fill k non-empty micro-batches.
        count = max(first_fit_bins(r, padded, max_tokens_per_micro_batch) for r in ranks)
        count = round_up(count, count_multiple)
        nonempty = min(count, mini // dp_size)
        bins = [fill_bins(r, padded, nonempty, max_tokens_per_micro_batch) for r in ranks]
        filled = [b + [[] for _ in range(count - nonempty)] for b in bins if b is not None]
        if len(filled) != len(bins):  # impossible by the argument above
            raise RuntimeError(f"could not pack mini-batch at {start} into {count} micro-batches")
        assignments.append(filled)
    return MicroBatchPlan(assignments, padded, max_tokens_per_micro_batch, dp_size)


def _mini_batch_split(total: int, mini_batch_size: int | None, dp_size: int) -> tuple[int, int]:
    mini = mini_batch_size or total
    if total == 0 or total % mini or mini % dp_size:
        raise ValueError(
            f"{total} sequences must split into mini-batches of {mini} sequences, each divisible "
            f"by the data-parallel size {dp_size}"
        )
    return total, mini


def plan_fixed_micro_batches(
    lengths: Sequence[int],
    *,
    micro_batch_size: int,
    dp_size: int = 1,
    mini_batch_size: int | None = None,
    pad_to_multiple_of: int = 1,
    count_multiple: int = 1,
) -> MicroBatchPlan:
    """verl's fixed micro-batches (`use_dynamic_bsz=false`), with no token budget and no
    balancing: each mini-batch split over the DP ranks in order (rank r takes the r-th
    contiguous share) and each share cut, in order, into micro-batches of `micro_batch_size`
    sequences (the last may hold fewer). A mode to compare with, or debug against, the
    token-budget plan. `max_tokens` is the largest micro-batch's padded token count."""
    if min(micro_batch_size, dp_size, pad_to_multiple_of, count_multiple) < 1:
        raise ValueError("micro_batch_size, dp_size, pad_to_multiple_of and count_multiple >= 1")
    total, mini = _mini_batch_split(len(lengths), mini_batch_size, dp_size)
    padded = [round_up(int(n), pad_to_multiple_of) for n in lengths]
    per_rank = mini // dp_size
    assignments = []
    for start in range(0, total, mini):
        ranks = []
        for first in range(start, start + mini, per_rank):
            micro = [
                list(range(i, min(i + micro_batch_size, first + per_rank)))
                for i in range(first, first + per_rank, micro_batch_size)
            ]
            ranks.append(
                micro + [[] for _ in range(round_up(len(micro), count_multiple) - len(micro))]
            )
        assignments.append(ranks)
    largest = max(sum(padded[i] for i in m) for mb in assignments for r in mb for m in r)
    return MicroBatchPlan(assignments, padded, largest, dp_size)
