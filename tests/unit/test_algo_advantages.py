"""Advantage estimators against hand computations and independent reference loops."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlhf.algo.advantages import (
    compute_advantages,
    compute_gae,
    compute_grpo_advantages,
    compute_reinforce_plus_plus_advantages,
    compute_rloo_advantages,
)
from rlhf.algo.stats import masked_whiten
from rlhf.config.choices import ADV_ESTIMATORS


def close(actual, expected):
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=actual.dtype))


def test_gae_right_padded():
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 5.0]])
    values = torch.tensor([[0.5, 0.6, 0.7], [1.0, 1.0, 99.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    adv, ret = compute_gae(rewards, values, mask, gamma=0.9, lam=0.8, whiten=False)
    # gamma * lam = 0.72. Row 0:
    #   t2: delta = 1 - 0.7 = 0.3                          A = 0.3
    #   t1: delta = 0.9 * 0.7 - 0.6 = 0.03                 A = 0.03 + 0.72 * 0.3 = 0.246
    #   t0: delta = 0.9 * 0.6 - 0.5 = 0.04                 A = 0.04 + 0.72 * 0.246 = 0.21712
    # Row 1 ends at t1 (the value 99 and reward 5 past the end are ignored):
    #   t1: delta = 2 + 0 - 1 = 1                          A = 1
    #   t0: delta = 0.9 * 1 - 1 = -0.1                     A = -0.1 + 0.72 * 1 = 0.62
    close(adv, [[0.21712, 0.246, 0.3], [0.62, 1.0, 0.0]])
    close(ret, [[0.71712, 0.846, 1.0], [1.62, 2.0, 0.0]])  # A + V, 0 outside the mask
    whitened, ret_w = compute_gae(rewards, values, mask, gamma=0.9, lam=0.8)
    torch.testing.assert_close(whitened, masked_whiten(adv, mask))  # default: whitened
    torch.testing.assert_close(ret_w, ret)  # returns come from the unwhitened advantages


def test_gae_packed_by_gaps_and_by_segment_ids():
    # Response 1: r = [0, 1], V = [0.5, 0.5] -> t1: A = 0.5; t0: 0.45 - 0.5 + 0.72 * 0.5 = 0.31
    # Response 2: r = [0, 2], V = [1, 1]     -> t1: A = 1;   t0: 0.9 - 1 + 0.72 * 1 = 0.62
    mask = torch.tensor([[1, 1, 0, 1, 1]])
    rewards = torch.tensor([[0.0, 1.0, 5.0, 0.0, 2.0]])
    values = torch.tensor([[0.5, 0.5, 7.0, 1.0, 1.0]])
    adv, _ = compute_gae(rewards, values, mask, 0.9, 0.8, whiten=False)
    close(adv, [[0.31, 0.5, 0.0, 0.62, 1.0]])
    # The same two responses touching, told apart only by their segment ids.
    mask = torch.ones(1, 4)
    rewards = torch.tensor([[0.0, 1.0, 0.0, 2.0]])
    values = torch.tensor([[0.5, 0.5, 1.0, 1.0]])
    seg = torch.tensor([[3, 3, 4, 4]])
    adv, _ = compute_gae(rewards, values, mask, 0.9, 0.8, segment_ids_bt=seg, whiten=False)
    close(adv, [[0.31, 0.5, 0.62, 1.0]])
    # Without the ids it is one response: t1: 1 + 0.9 - 0.5 + 0.72 * 0.62 = 1.8464,
    # t0: 0.45 - 0.5 + 0.72 * 1.8464 = 1.279408
    adv, _ = compute_gae(rewards, values, mask, 0.9, 0.8, whiten=False)
    close(adv, [[1.279408, 1.8464, 0.62, 1.0]])


def test_gae_bad_discount():
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="gamma must be in"):
        compute_gae(x, x, x, gamma=1.5, lam=0.9)
    with pytest.raises(ValueError, match="lam must be in"):
        compute_gae(x, x, x, gamma=1.0, lam=-0.1)


# Group "a" = {1, 0, 5}: mean 2, deviations -1, -2, 3, unbiased std sqrt(14 / 2) = sqrt(7).
# Group "b" = {7} alone.
SCORES = torch.tensor([1.0, 0.0, 7.0, 5.0])
UIDS = ["a", "a", "b", "a"]
MASK = torch.tensor([[1, 1], [1, 0], [1, 1], [0, 0]])


def test_grpo():
    adv = compute_grpo_advantages(SCORES, UIDS, MASK, eps=0.0)
    s7 = math.sqrt(7)
    # broadcast over each row's response tokens; the single-sample group gets 0
    close(adv, [[-1 / s7, -1 / s7], [-2 / s7, 0.0], [0.0, 0.0], [0.0, 0.0]])
    adv = compute_grpo_advantages(SCORES, UIDS, MASK, norm_by_std=False)
    close(adv, [[-1.0, -1.0], [-2.0, 0.0], [0.0, 0.0], [0.0, 0.0]])
    # uids as a tensor name the same groups
    torch.testing.assert_close(
        compute_grpo_advantages(SCORES, torch.tensor([4, 4, 9, 4]), MASK, norm_by_std=False), adv
    )


def test_rloo():
    adv = compute_rloo_advantages(SCORES, UIDS, torch.ones(4, 1))
    # a: 1 - (0 + 5) / 2 = -1.5; 0 - (1 + 5) / 2 = -3; 5 - (1 + 0) / 2 = 4.5; b alone: 0
    close(adv, [[-1.5], [-3.0], [0.0], [4.5]])


def test_uids_length_error():
    with pytest.raises(ValueError, match="one uid per sample"):
        compute_rloo_advantages(SCORES, ["a", "b"], MASK)


def test_reinforce_plus_plus():
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    adv, ret = compute_reinforce_plus_plus_advantages(rewards, mask, gamma=0.5)
    # reward-to-go with gamma 0.5: row 0: 0.25, 0.5, 1; row 1: 1, 2 (the 9 is masked out)
    close(ret, [[0.25, 0.5, 1.0], [1.0, 2.0, 0.0]])
    # mean 4.75 / 5 = 0.95; deviations -0.7 -0.45 0.05 0.05 1.05; sq sum 1.8; var 1.8 / 4 = 0.45
    sd = math.sqrt(0.45)
    close(adv, [[-0.7 / sd, -0.45 / sd, 0.05 / sd], [0.05 / sd, 1.05 / sd, 0.0]])


def test_dispatch():
    rewards = torch.tensor([[0.0, 1.0], [0.0, 0.0], [3.0, 4.0], [0.0, 5.0]])  # row sums = SCORES
    full = torch.ones(4, 2)
    out = compute_advantages("grpo", rewards, full, uids=UIDS)
    torch.testing.assert_close(out.advantages_bt, compute_grpo_advantages(SCORES, UIDS, full))
    assert out.returns_bt is None
    out = compute_advantages("rloo", rewards, full, uids=UIDS)
    torch.testing.assert_close(out.advantages_bt, compute_rloo_advantages(SCORES, UIDS, full))
    values = torch.full((4, 2), 0.5)
    out = compute_advantages("gae", rewards, MASK, values_bt=values, gamma=0.9, lam=0.8)
    expected = compute_gae(rewards, values, MASK, 0.9, 0.8)
    torch.testing.assert_close((out.advantages_bt, out.returns_bt), expected)
    out = compute_advantages("reinforce_plus_plus", rewards, MASK, gamma=0.9)
    expected = compute_reinforce_plus_plus_advantages(rewards, MASK, 0.9)
    torch.testing.assert_close((out.advantages_bt, out.returns_bt), expected)


def test_dispatch_errors():
    x = torch.zeros(2, 2)
    with pytest.raises(ValueError, match="adv_estimator") as info:
        compute_advantages("ppo", x, x)
    assert all(name in str(info.value) for name in ADV_ESTIMATORS)
    with pytest.raises(ValueError, match="values_bt"):
        compute_advantages("gae", x, x)
    with pytest.raises(ValueError, match="uids"):
        compute_advantages("grpo", x, x)


def random_right_padded(seed, batch, width):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, width + 1, (batch,), generator=gen)
    mask = torch.arange(width)[None, :] < lengths[:, None]
    rewards = torch.randn(batch, width, generator=gen, dtype=torch.float64)
    values = torch.randn(batch, width, generator=gen, dtype=torch.float64)
    return rewards, values, mask, lengths.tolist()


SHAPES = dict(seed=st.integers(0, 2**31 - 1), batch=st.integers(1, 4), width=st.integers(1, 7))


@settings(max_examples=50, deadline=None)
@given(**SHAPES)
def test_gae_without_discount_is_reward_to_go_minus_value(seed, batch, width):
    rewards, values, mask, lengths = random_right_padded(seed, batch, width)
    adv, ret = compute_gae(rewards, values, mask, gamma=1.0, lam=1.0, whiten=False)
    for b, n in enumerate(lengths):
        for t in range(width):
            to_go = sum(rewards[b, k].item() for k in range(t, n)) if t < n else 0.0
            expected = to_go - values[b, t].item() if t < n else 0.0
            assert adv[b, t].item() == pytest.approx(expected, abs=1e-12)
            assert ret[b, t].item() == pytest.approx(to_go, abs=1e-12)


def gae_reference(rewards, values, gamma, lam):
    """Textbook GAE of one whole response (plain Python lists)."""
    n, adv, last = len(rewards), [0.0] * len(rewards), 0.0
    for t in reversed(range(n)):
        next_v = values[t + 1] if t + 1 < n else 0.0
        last = rewards[t] + gamma * next_v - values[t] + gamma * lam * last
        adv[t] = last
    return adv


@settings(max_examples=50, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    layout=st.lists(st.tuples(st.integers(1, 4), st.integers(0, 2)), min_size=1, max_size=4),
    gamma=st.floats(0.0, 1.0),
    lam=st.floats(0.0, 1.0),
)
def test_packed_gae_equals_separate_responses(seed, layout, gamma, lam):
    """Responses of (length, gap before the next) packed in one row; gap 0 = touching."""
    gen = torch.Generator().manual_seed(seed)
    width = sum(n + g for n, g in layout)
    rewards = torch.randn(1, width, generator=gen, dtype=torch.float64)
    values = torch.randn(1, width, generator=gen, dtype=torch.float64)
    mask = torch.zeros(1, width, dtype=torch.bool)
    seg = torch.full((1, width), -1)
    spans, pos = [], 0
    for i, (n, g) in enumerate(layout):
        mask[0, pos : pos + n], seg[0, pos : pos + n] = True, i
        spans.append((pos, n))
        pos += n + g
    adv, ret = compute_gae(rewards, values, mask, gamma, lam, segment_ids_bt=seg, whiten=False)
    expected = torch.zeros(1, width, dtype=torch.float64)
    for start, n in spans:
        r, v = rewards[0, start : start + n].tolist(), values[0, start : start + n].tolist()
        expected[0, start : start + n] = torch.tensor(
            gae_reference(r, v, gamma, lam), dtype=torch.float64
        )
    torch.testing.assert_close(adv, expected, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(ret, torch.where(mask, expected + values, 0))


@settings(max_examples=50, deadline=None)
@given(**SHAPES, junk=st.floats(width=32, allow_nan=False, allow_infinity=False))
def test_masked_positions_never_matter(seed, batch, width, junk):
    rewards, values, mask, _ = random_right_padded(seed, batch, width)
    rewards, values = rewards.float(), values.float()
    noisy_r, noisy_v = torch.where(mask, rewards, junk), torch.where(mask, values, -junk)
    uids = list(range(batch // 2)) * 2 + [99] * (batch % 2)
    for name in ADV_ESTIMATORS:
        kw = dict(values_bt=values, uids=uids, gamma=0.9, lam=0.95)
        a = compute_advantages(name, rewards, mask, **kw)
        b = compute_advantages(name, noisy_r, mask, **{**kw, "values_bt": noisy_v})
        assert torch.equal(a.advantages_bt, b.advantages_bt), name
        assert (a.returns_bt is None) or torch.equal(a.returns_bt, b.returns_bt), name
