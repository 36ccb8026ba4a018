"""Ulysses bookkeeping by hand: zig-zag slices, the gather order, KV-head repeats."""

from __future__ import annotations

import pytest
import torch

from rlhf.parallel.ulysses import gathered_order, kv_repeats, zigzag_positions


def test_zigzag_slices_by_hand():
    # 8 tokens, SP=2: chunks of 2; rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2
    assert zigzag_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert zigzag_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    everything = torch.cat([zigzag_positions(12, 3, r) for r in range(3)])
    assert sorted(everything.tolist()) == list(range(12))


def test_gathered_order_restores_natural_order():
    held = torch.cat([zigzag_positions(8, 2, r) for r in range(2)])  # [0,1,6,7,2,3,4,5]
    assert held[gathered_order(8, 2)].tolist() == list(range(8))


def test_length_must_be_a_multiple_of_twice_sp():
    with pytest.raises(ValueError, match="multiple of 2 x SP = 4"):
        zigzag_positions(6, 2, 0)


@pytest.mark.parametrize(
    ("q_heads", "kv_heads", "sp", "repeats"),
    [(8, 8, 2, 1), (8, 2, 2, 1), (8, 1, 2, 2), (8, 2, 4, 2), (12, 3, 2, 2), (8, 2, 8, 4)],
)
def test_kv_repeats(q_heads, kv_heads, sp, repeats):
    assert kv_repeats(q_heads, kv_heads, sp) == repeats


def test_kv_repeats_rejects_impossible_splits():
    # query heads per TP rank must split over SP (KV heads always can, by repetition)
    with pytest.raises(ValueError, match="query heads per TP rank must be a multiple"):
        kv_repeats(6, 2, 4)
