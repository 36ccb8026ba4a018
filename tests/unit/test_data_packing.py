"""Token-budget micro-batches and THD packing: invariants, exact round trip, DP balance."""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlhf.data.packed import PackedBatch, pack_sequences, scatter_sequences
from rlhf.data.packing import balanced_partition, plan_fixed_micro_batches, plan_micro_batches

# The inverse of the packing (cut a packed tensor back per sequence), used only to check it.


def pack_like(values: Sequence[torch.Tensor], packed: PackedBatch, pad_value=0) -> torch.Tensor:
    """Pack per-token tensors ([L_i, ...], same lengths as the packed sequences) alike: [T, ...]."""
    lengths = [int(v.shape[0]) for v in values]
    if lengths != packed.seq_lens:
        raise ValueError(f"lengths {lengths} do not match the packed sequences {packed.seq_lens}")
    return scatter_sequences(values, packed.cu_seqlens_padded, packed.num_tokens, pad_value)


def unpack(values: torch.Tensor, packed: PackedBatch) -> list[torch.Tensor]:
    """Per-sequence views [L_i, ...] of a packed per-token tensor [T, ...] or [1, T, ...]."""
    total = packed.num_tokens
    if values.dim() >= 2 and values.shape[0] == 1 and values.shape[1] == total:
        values = values[0]
    if values.shape[0] != total:
        raise ValueError(f"packed tensor has {values.shape[0]} tokens, the batch has {total}")
    starts = packed.cu_seqlens_padded[:-1].tolist()
    return [values[s : s + n] for s, n in zip(starts, packed.seq_lens)]


def restore_order(
    batches: Sequence[PackedBatch], outputs: Sequence[torch.Tensor], num_sequences: int
) -> list[torch.Tensor]:
    """Per-sequence outputs of several micro-batches, back in the step's sequence order."""
    result: list[torch.Tensor | None] = [None] * num_sequences
    for packed, output in zip(batches, outputs):
        for index, value in zip(packed.indices, unpack(output, packed)):
            if result[index] is not None:
                raise ValueError(f"sequence {index} appears in more than one micro-batch")
            result[index] = value
    found = [v for v in result if v is not None]
    if len(found) != num_sequences:
        missing = [i for i, v in enumerate(result) if v is None]
        raise ValueError(f"no micro-batch holds sequences {missing[:10]}")
    return found


REPO = Path(__file__).resolve().parents[2]


def benchmark_lengths(num: int, seed: int) -> list[int]:
    spec = importlib.util.spec_from_file_location("bench_packing", REPO / "benchmarks/packing.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.gsm8k_like_lengths(num, seed)


def test_packed_layout_by_hand():
    seqs = [torch.tensor([1, 2, 3]), torch.tensor([4, 5, 6, 7, 8]), torch.tensor([9, 10])]
    packed = pack_sequences(seqs, pad_to_multiple_of=4, pad_value=-1, indices=[5, 0, 2])
    assert packed.tokens.tolist() == [1, 2, 3, -1, 4, 5, 6, 7, 8, -1, -1, -1, 9, 10, -1, -1]
    assert packed.position_ids.tolist() == [0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3]
    assert packed.cu_seqlens.tolist() == [0, 3, 8, 10]
    assert packed.cu_seqlens_padded.tolist() == [0, 4, 12, 16]
    assert packed.cu_seqlens.dtype == torch.int32 and packed.max_seqlen == 8
    assert (packed.seq_lens, packed.num_tokens, packed.indices) == ([3, 5, 2], 16, [5, 0, 2])
    params = packed.packed_seq_params()
    assert params.qkv_format == "thd" and params.max_seqlen_q == 8
    assert params.cu_seqlens_q_padded.tolist() == [0, 4, 12, 16]


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 40), min_size=1, max_size=8),
    multiple=st.integers(1, 8),
    seed=st.integers(0, 1000),
)
def test_unpack_is_the_exact_inverse(lengths, multiple, seed):
    gen = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(0, 1000, (n,), generator=gen) for n in lengths]
    feats = [torch.randn(n, 3, generator=gen) for n in lengths]
    packed = pack_sequences(seqs, pad_to_multiple_of=multiple)
    assert packed.num_tokens == sum(-(-n // multiple) * multiple for n in lengths)
    for got, want in zip(unpack(packed.tokens, packed), seqs):
        assert torch.equal(got, want)
    packed_feats = pack_like(feats, packed, pad_value=float("nan"))
    for got, want in zip(unpack(packed_feats[None], packed), feats):  # [1, T, 3] as from a model
        assert torch.equal(got, want)


def test_restore_order_across_micro_batches():
    lengths = [7, 3, 12, 5, 9, 1, 4, 8]
    seqs = [torch.arange(n) + 100 * i for i, n in enumerate(lengths)]
    plan = plan_micro_batches(lengths, max_tokens_per_micro_batch=16, dp_size=1)
    micro = plan.for_rank(0)[0]
    batches = [pack_sequences([seqs[i] for i in mb], indices=mb) for mb in micro]
    outputs = [b.tokens * 2 for b in batches]  # any per-token model output
    restored = restore_order(batches, outputs, len(seqs))
    assert all(torch.equal(r, s * 2) for r, s in zip(restored, seqs))
    with pytest.raises(ValueError, match="no micro-batch holds sequences"):
        restore_order(batches[:-1], outputs[:-1], len(seqs))


def check_plan(plan, lengths, budget, dp, mini, multiple):
    """Every invariant of a plan, computed independently of the planner."""
    padded = [-(-n // multiple) * multiple for n in lengths]
    seen = []
    assert len(plan.assignments) == len(lengths) // mini
    for m, mini_batch in enumerate(plan.assignments):
        assert len(mini_batch) == dp
        counts = {len(rank) for rank in mini_batch}
        assert len(counts) == 1, "every rank runs the same number of micro-batches"
        for rank in mini_batch:
            assert sum(len(mb) for mb in rank) == mini // dp
            for mb in rank:
                assert mb, "no empty micro-batch"
                assert sum(padded[i] for i in mb) <= budget
                assert all(m * mini <= i < (m + 1) * mini for i in mb), "crossed a mini-batch"
                seen.extend(mb)
    assert sorted(seen) == list(range(len(lengths))), "every sequence exactly once"


@settings(max_examples=80, deadline=None)
@given(
    data=st.data(),
    dp=st.sampled_from([1, 2, 3, 4]),
    minis=st.integers(1, 3),
    per_rank=st.integers(1, 6),
    multiple=st.sampled_from([1, 2, 4]),
)
def test_plan_invariants(data, dp, minis, per_rank, multiple):
    mini = dp * per_rank
    lengths = data.draw(st.lists(st.integers(1, 300), min_size=mini * minis, max_size=mini * minis))
    budget = data.draw(st.integers(-(-max(lengths) // multiple) * multiple, 1200))
    plan = plan_micro_batches(
        lengths,
        max_tokens_per_micro_batch=budget,
        dp_size=dp,
        mini_batch_size=mini,
        pad_to_multiple_of=multiple,
    )
    check_plan(plan, lengths, budget, dp, mini, multiple)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize(("dp", "mini", "budget"), [(8, 256, 4096), (4, 128, 3072), (2, 64, 2048)])
def test_dp_imbalance_on_benchmark_distribution(seed, dp, mini, budget):
    lengths = benchmark_lengths(4 * mini, seed)
    plan = plan_micro_batches(
        lengths, max_tokens_per_micro_batch=budget, dp_size=dp, mini_batch_size=mini
    )
    check_plan(plan, lengths, budget, dp, mini, 1)
    for mini_batch in plan.assignments:
        per_rank = [sum(lengths[i] for mb in rank for i in mb) for rank in mini_batch]
        mean = sum(per_rank) / dp
        assert max(per_rank) / mean - 1 <= 0.05, per_rank
    assert plan.imbalance() <= 0.05


def test_balanced_partition_equal_sizes_and_sums():
    parts = balanced_partition([10, 9, 8, 7, 6, 5, 4, 3], 2)
    assert sorted(len(p) for p in parts) == [4, 4]
    assert sorted(i for p in parts for i in p) == list(range(8))
    sums = [sum([10, 9, 8, 7, 6, 5, 4, 3][i] for i in p) for p in parts]
    assert sums == [26, 26]  # 10+7+6+3 = 9+8+5+4 (found by hand)
    with pytest.raises(ValueError, match="cannot be split evenly into 3 parts"):
        balanced_partition([1, 2, 3, 4], 3)


def test_sequence_over_budget_is_a_clear_error():
    with pytest.raises(ValueError) as err:
        plan_micro_batches([10, 65, 3, 4], max_tokens_per_micro_batch=64, dp_size=2)
    assert "sequence 1 has 65 tokens, more than the micro-batch budget of 64 tokens" in str(
        err.value
    )
    assert "ppo_max_token_len_per_gpu" in str(err.value)
    with pytest.raises(ValueError, match=r"sequence 0 has 64 tokens \(63 padded to a multiple"):
        plan_micro_batches([63, 1], max_tokens_per_micro_batch=63, pad_to_multiple_of=8)


def test_batch_shape_errors():
    with pytest.raises(ValueError, match="mini-batches of 4 sequences, each divisible by"):
        plan_micro_batches([1] * 8, max_tokens_per_micro_batch=8, dp_size=3, mini_batch_size=4)
    with pytest.raises(ValueError, match="sequence 2 has length 0"):
        plan_micro_batches([1, 2, 0, 3], max_tokens_per_micro_batch=8)
    with pytest.raises(ValueError, match="cannot pack an empty micro-batch"):
        pack_sequences([])


def test_fixed_micro_batches_by_hand():
    """verl's use_dynamic_bsz=false: in order, `micro_batch_size` sequences each; each DP
    rank takes its contiguous share of the mini-batch; fillers only for the PP multiple."""
    lengths = [5, 6, 7, 8, 9, 10, 11, 12]
    plan = plan_fixed_micro_batches(lengths, micro_batch_size=3, dp_size=2, count_multiple=2)
    assert plan.assignments == [[[[0, 1, 2], [3]], [[4, 5, 6], [7]]]]
    assert plan.max_tokens == 9 + 10 + 11
    plan = plan_fixed_micro_batches(lengths, micro_batch_size=2, mini_batch_size=4)
    assert plan.assignments == [[[[0, 1], [2, 3]]], [[[4, 5], [6, 7]]]]
    filler = plan_fixed_micro_batches(lengths[:2], micro_batch_size=2, count_multiple=2)
    assert filler.assignments == [[[[0, 1], []]]]
    with pytest.raises(ValueError, match="data-parallel size 3"):
        plan_fixed_micro_batches(lengths, micro_batch_size=2, dp_size=3)
