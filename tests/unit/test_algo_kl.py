"""KL estimators, token-level rewards and KL controllers, against hand computations."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlhf.algo.kl import (
    AdaptiveKLController,
    FixedKLController,
    build_kl_controller,
    kl_penalty,
    token_level_rewards,
)
from rlhf.config.algorithm import KLControlConfig
from rlhf.config.choices import KL_LOSS_TYPES

LOGP = torch.tensor([-1.0, -2.0, -0.5])
REF = torch.tensor([-1.5, -1.0, -0.5])  # logp - ref = 0.5, -1, 0; d = ref - logp = -0.5, 1, 0


@pytest.mark.parametrize(
    ("kind", "expected"),
    [
        ("kl", [0.5, -1.0, 0.0]),
        ("abs", [0.5, 1.0, 0.0]),
        ("mse", [0.125, 0.5, 0.0]),  # 0.5 * 0.25, 0.5 * 1, 0
        # exp(-0.5) + 0.5 - 1 = 0.1065307; exp(1) - 1 - 1 = 0.7182818; exp(0) - 0 - 1 = 0
        ("low_var_kl", [0.1065307, 0.7182818, 0.0]),
    ],
)
def test_kl_penalty(kind, expected):
    torch.testing.assert_close(kl_penalty(LOGP, REF, kind), torch.tensor(expected))


def test_low_var_kl_is_clamped_with_finite_gradient():
    logp = torch.tensor([0.0, 0.0, 0.0], requires_grad=True)
    ref = torch.tensor([100.0, -20.0, 2.0])
    # d = 100: exp(100) - 101 -> 10; d = -20: exp(-20) + 19 -> 10; d = 2: e^2 - 3 = 4.389056
    out = kl_penalty(logp, ref, "low_var_kl")
    torch.testing.assert_close(out, torch.tensor([10.0, 10.0, 4.389056]))
    out.sum().backward()
    # clamped entries have no gradient; d/dlogp (e^d - d - 1) = -(e^d - 1) = -6.389056 at d = 2
    torch.testing.assert_close(logp.grad, torch.tensor([0.0, 0.0, -6.389056]))


def test_kl_penalty_unknown_kind():
    with pytest.raises(ValueError, match="low_var_kl") as info:
        kl_penalty(LOGP, REF, "k4")
    assert all(k in str(info.value) for k in KL_LOSS_TYPES)


@pytest.mark.parametrize(("alias", "name"), [("k1", "kl"), ("k2", "mse"), ("k3", "low_var_kl")])
def test_kl_aliases(alias, name):
    torch.testing.assert_close(kl_penalty(LOGP, REF, alias), kl_penalty(LOGP, REF, name))


@pytest.mark.parametrize("kind", ["kl+", "k1+", "low_var_kl+", "k3+"])
def test_straight_through_variants_keep_the_value_and_take_k2_gradient(kind):
    """Value of the estimator before '+'; gradient of 0.5 (logp - ref)^2, i.e. logp - ref."""
    logp = LOGP.clone().requires_grad_(True)
    out = kl_penalty(logp, REF, kind)
    torch.testing.assert_close(out, kl_penalty(LOGP, REF, kind[:-1]))
    out.sum().backward()
    torch.testing.assert_close(logp.grad, LOGP - REF)


def test_token_level_rewards_right_padded():
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    scores = torch.tensor([1.0, 2.0])
    # score on the last response token of each row
    expected = torch.tensor([[0.0, 0.0, 1.0, 0.0], [0.0, 2.0, 0.0, 0.0]])
    torch.testing.assert_close(token_level_rewards(scores, mask), expected)
    kl = torch.tensor([[0.1, 0.2, 0.3, 9.0], [0.4, 0.5, 9.0, 9.0]])
    # -0.5 * kl on response tokens: -0.05, -0.1, 1 - 0.15; -0.2, 2 - 0.25; 9s are masked out
    expected = torch.tensor([[-0.05, -0.1, 0.85, 0.0], [-0.2, 1.75, 0.0, 0.0]])
    torch.testing.assert_close(token_level_rewards(scores, mask, kl, beta=0.5), expected)


def test_token_level_rewards_empty_row_drops_its_score():
    mask = torch.tensor([[1, 1, 0], [0, 0, 0], [1, 0, 0]])
    out = token_level_rewards(torch.tensor([1.0, 2.0, 3.0]), mask)
    torch.testing.assert_close(out, torch.tensor([[0.0, 1.0, 0.0], [0.0] * 3, [3.0, 0.0, 0.0]]))


def test_token_level_rewards_packed():
    mask = torch.tensor([[1, 1, 0, 1, 1]])
    # two runs: scores at their last tokens (cols 1 and 4)
    out = token_level_rewards(torch.tensor([1.0, 2.0]), mask)
    torch.testing.assert_close(out, torch.tensor([[0.0, 1.0, 0.0, 0.0, 2.0]]))
    # segment ids split the second run into cols [3] and [4]
    seg = torch.tensor([[0, 0, 0, 1, 2]])
    out = token_level_rewards(torch.tensor([1.0, 2.0, 3.0]), mask, segment_ids_bt=seg)
    torch.testing.assert_close(out, torch.tensor([[0.0, 1.0, 0.0, 2.0, 3.0]]))


def test_token_level_rewards_errors():
    mask = torch.tensor([[1, 1, 0, 1, 1], [1, 0, 0, 0, 0]])  # 3 responses in 2 rows
    with pytest.raises(ValueError, match="one score per response"):
        token_level_rewards(torch.tensor([1.0, 2.0]), mask)
    with pytest.raises(ValueError, match="needs kl_bt"):
        token_level_rewards(torch.tensor([1.0, 2.0, 3.0]), mask, beta=0.1)


def test_fixed_controller():
    ctrl = FixedKLController(0.1)
    ctrl.update(current_kl=5.0, n_steps=100)
    assert ctrl.value == 0.1
    other = FixedKLController(0.0)
    other.load_state_dict(ctrl.state_dict())
    assert other.value == 0.1


def test_adaptive_controller_steps():
    ctrl = AdaptiveKLController(init_kl_coef=0.1, target_kl=1.0, horizon=10)
    ctrl.update(current_kl=1.1, n_steps=1)  # error 0.1: 0.1 * (1 + 0.1 * 1 / 10) = 0.101
    assert ctrl.value == pytest.approx(0.101)
    ctrl.update(current_kl=5.0, n_steps=2)  # error 4 -> 0.2: 0.101 * (1 + 0.04) = 0.10504
    assert ctrl.value == pytest.approx(0.10504)
    ctrl.update(current_kl=0.0, n_steps=10)  # error -1 -> -0.2: 0.10504 * 0.8 = 0.084032
    assert ctrl.value == pytest.approx(0.084032)
    restored = AdaptiveKLController(init_kl_coef=0.5, target_kl=1.0, horizon=10)
    restored.load_state_dict(ctrl.state_dict())
    assert restored.value == ctrl.value


def test_controller_errors():
    with pytest.raises(ValueError, match="target_kl"):
        AdaptiveKLController(0.1, target_kl=0.0, horizon=10)
    with pytest.raises(ValueError, match="kl_coef"):
        FixedKLController(-1.0)


def test_build_kl_controller():
    fixed = build_kl_controller(KLControlConfig(type="fixed", kl_coef=0.05))
    assert isinstance(fixed, FixedKLController) and fixed.value == 0.05
    cfg = KLControlConfig(type="adaptive", kl_coef=0.2, target_kl=3.0, horizon=500)
    adaptive = build_kl_controller(cfg)
    assert isinstance(adaptive, AdaptiveKLController)
    assert (adaptive.value, adaptive.target_kl, adaptive.horizon) == (0.2, 3.0, 500)
    with pytest.raises(ValueError, match="'fixed' or 'adaptive'"):
        build_kl_controller(dataclasses.replace(cfg, type="pid"))


@settings(max_examples=50, deadline=None)
@given(
    init=st.floats(1e-4, 1.0),
    target=st.floats(1e-3, 10.0),
    horizon=st.integers(100, 100_000),
    steps=st.lists(st.tuples(st.floats(0.0, 50.0), st.integers(1, 64)), min_size=100, max_size=100),
)
def test_adaptive_controller_closed_form(init, target, horizon, steps):
    ctrl = AdaptiveKLController(init, target, horizon)
    for kl, n in steps:
        ctrl.update(kl, n)
    expected = init * math.prod(
        1 + min(max(kl / target - 1, -0.2), 0.2) * n / horizon for kl, n in steps
    )
    assert ctrl.value == pytest.approx(expected, rel=1e-12)


@settings(max_examples=50, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    junk=st.floats(width=32, allow_nan=False, allow_infinity=False),
)
def test_rewards_ignore_masked_kl(seed, junk):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 6, (3,), generator=gen)
    mask = torch.arange(5)[None, :] < lengths[:, None]
    kl = torch.randn(3, 5, generator=gen)
    scores = torch.randn(3, generator=gen)
    a = token_level_rewards(scores, mask, kl, beta=0.3)
    b = token_level_rewards(scores, mask, torch.where(mask, kl, junk), beta=0.3)
    assert torch.equal(a, b)
