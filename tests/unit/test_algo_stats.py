"""Masked statistics and the response layout, against hand computations."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from rlhf.algo.stats import (
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
    response_ends,
    response_ids,
    response_starts,
)

# Kept elements: 1, 3 (row 0) and 5 (row 1); 99, -7 and 8 are masked out.
VALUES = torch.tensor([[1.0, 3.0, 99.0], [5.0, -7.0, 8.0]])
MASK = torch.tensor([[1, 1, 0], [1, 0, 0]])


@pytest.fixture
def world1():
    """A one-process gloo group: group statistics must equal the local ones."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def test_masked_sum():
    assert masked_sum(VALUES, MASK).item() == 9.0  # 1 + 3 + 5
    assert masked_sum(VALUES, MASK, dim=1).tolist() == [4.0, 5.0]  # 1 + 3; 5
    assert masked_sum(VALUES, MASK.float()).item() == 9.0  # float masks work the same


def test_masked_mean():
    assert masked_mean(VALUES, MASK).item() == 3.0  # 9 / 3
    assert masked_mean(VALUES, MASK, dim=1).tolist() == [2.0, 5.0]  # 4 / 2; 5 / 1
    empty = torch.zeros_like(MASK)
    assert masked_mean(VALUES, empty).item() == 0.0  # 0 / max(0, 1)
    assert masked_mean(VALUES, empty, dim=1).tolist() == [0.0, 0.0]


def test_masked_var():
    # deviations from 3: -2, 0, 2 -> squares sum to 8
    assert masked_var(VALUES, MASK).item() == pytest.approx(4.0)  # 8 / (3 - 1)
    assert masked_var(VALUES, MASK, unbiased=False).item() == pytest.approx(8 / 3)
    single = torch.tensor([[1, 0, 0], [0, 0, 0]])
    assert masked_var(VALUES, single).item() == 0.0  # 0 / max(1 - 1, 1)


def test_masked_whiten():
    # (x - 3) / sqrt(4): -1, 0, 1; masked positions are 0
    out = masked_whiten(VALUES, MASK, eps=0.0)
    torch.testing.assert_close(out, torch.tensor([[-1.0, 0.0, 0.0], [1.0, 0.0, 0.0]]))
    # shift_mean=False adds the mean 3 back on kept positions
    out = masked_whiten(VALUES, MASK, shift_mean=False, eps=0.0)
    torch.testing.assert_close(out, torch.tensor([[2.0, 3.0, 0.0], [4.0, 0.0, 0.0]]))
    # biased variance 8/3: (x - 3) / sqrt(8/3) = -1.2247, 0, 1.2247
    out = masked_whiten(VALUES, MASK, unbiased=False, eps=0.0)
    torch.testing.assert_close(out[:, 0], torch.tensor([-1.2247449, 1.2247449]))


def test_shape_and_dim_group_errors(world1):
    with pytest.raises(ValueError, match="same shape"):
        masked_mean(VALUES, MASK[:, :2])
    with pytest.raises(ValueError, match="either dim"):
        masked_sum(VALUES, MASK, dim=1, group=world1)
    with pytest.raises(ValueError, match="either dim"):
        masked_mean(VALUES, MASK, dim=1, group=world1)


def test_group_of_one_matches_local(world1):
    assert masked_sum(VALUES, MASK, group=world1).item() == 9.0
    assert masked_mean(VALUES, MASK, group=world1).item() == 3.0
    assert masked_var(VALUES, MASK, group=world1).item() == pytest.approx(4.0)
    torch.testing.assert_close(
        masked_whiten(VALUES, MASK, group=world1), masked_whiten(VALUES, MASK)
    )


def test_group_refuses_grad(world1):
    x = VALUES.clone().requires_grad_()
    with pytest.raises(ValueError, match="detach"):
        masked_whiten(x, MASK, group=world1)
    with torch.no_grad():
        masked_whiten(x, MASK, group=world1)  # fine without autograd


def test_local_stats_are_differentiable():
    x = VALUES.clone().requires_grad_()
    masked_mean(x, MASK).backward()
    # d/dx (x00 + x01 + x10) / 3
    torch.testing.assert_close(x.grad, MASK.float() / 3)


def test_response_layout():
    # Row 0: runs [0, 1] and [3, 5]; the segment id splits the second run into [3, 4], [5].
    mask = torch.tensor([[1, 1, 0, 1, 1, 1, 0], [0, 1, 1, 1, 0, 0, 0]])
    seg = torch.tensor([[0, 0, 0, 1, 1, 2, 2], [0, 0, 0, 0, 0, 0, 0]])
    idx = lambda b: b.nonzero().tolist()  # noqa: E731
    assert idx(response_starts(mask)) == [[0, 0], [0, 3], [1, 1]]
    assert idx(response_ends(mask)) == [[0, 1], [0, 5], [1, 3]]
    assert idx(response_starts(mask, seg)) == [[0, 0], [0, 3], [0, 5], [1, 1]]
    assert idx(response_ends(mask, seg)) == [[0, 1], [0, 4], [0, 5], [1, 3]]
    assert response_ids(mask).tolist() == [[0, 0, -1, 1, 1, 1, -1], [-1, 2, 2, 2, -1, -1, -1]]
    assert response_ids(mask, seg).tolist() == [
        [0, 0, -1, 1, 1, 2, -1],
        [-1, 3, 3, 3, -1, -1, -1],
    ]
    with pytest.raises(ValueError, match="segment_ids_bt"):
        response_ends(mask, seg[:, :3])


def test_response_layout_does_not_join_rows():
    # Row 0 ends on a response token and row 1 starts on one: two responses, not one.
    mask = torch.tensor([[0, 1], [1, 0]])
    assert response_ids(mask).tolist() == [[-1, 0], [1, -1]]


@settings(max_examples=50, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    batch=st.integers(1, 4),
    width=st.integers(1, 6),
    junk=st.floats(width=32, allow_nan=False, allow_infinity=False),
)
def test_masked_positions_never_matter(seed, batch, width, junk):
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(batch, width, generator=gen)
    mask = torch.rand(batch, width, generator=gen) < 0.6
    perturbed = torch.where(mask, values, junk)
    for fn in (masked_sum, masked_mean, masked_var, masked_whiten):
        x1, x2 = values.clone().requires_grad_(), perturbed.clone().requires_grad_()
        out1, out2 = fn(x1, mask), fn(x2, mask)
        assert torch.equal(out1, out2), fn.__name__
        out1.sum().backward()
        out2.sum().backward()
        assert torch.equal(x1.grad, x2.grad), fn.__name__
    assert torch.equal(masked_mean(values, mask, dim=1), masked_mean(perturbed, mask, dim=1))


@settings(max_examples=50, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), batch=st.integers(1, 4), width=st.integers(2, 6))
def test_whiten_has_zero_mean_unit_variance(seed, batch, width):
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(batch, width, generator=gen, dtype=torch.float64) * 5 + 2
    mask = torch.ones(batch, width, dtype=torch.bool)
    mask[0, 2:] = torch.rand(width - 2, generator=gen) < 0.5  # at least 2 kept elements
    out = masked_whiten(values, mask, eps=0.0)
    assert abs(masked_mean(out, mask).item()) < 1e-9
    assert abs(masked_var(out, mask).item() - 1.0) < 1e-9
