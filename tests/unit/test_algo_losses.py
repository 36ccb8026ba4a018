"""Loss aggregation and the PPO losses, against hand computations and batching invariance."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlhf.algo.losses import (
    BatchCounts,
    aggregate_loss,
    entropy_loss,
    global_batch_counts,
    gspo_policy_loss,
    kl_loss,
    policy_loss,
    value_loss,
)
from rlhf.config.choices import LOSS_AGG_MODES

# Row 0 keeps 1, 2, 3 (sum 6, mean 2); row 1 keeps 4 (sum 4, mean 4): 4 tokens, 2 sequences.
LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 9.0, 9.0]])
MASK = torch.tensor([[1, 1, 1], [1, 0, 0]])


@pytest.mark.parametrize(
    ("mode", "local", "global_"),
    [
        ("token-mean", 10 / 4, 10 / 8),  # global: 8 tokens
        ("seq-mean-token-sum", (6 + 4) / 2, 10 / 4),  # global: 4 sequences
        ("seq-mean-token-mean", (2 + 4) / 2, 6 / 4),
        ("seq-mean-token-sum-norm", 10 / (2 * 5), 10 / (4 * 5)),  # norm_length 5
    ],
)
def test_aggregate_loss(mode, local, global_):
    out = aggregate_loss(LOSS, MASK, mode, norm_length=5)
    assert out.item() == pytest.approx(local)
    out = aggregate_loss(LOSS, MASK, mode, global_num_tokens=8, global_num_seqs=4, norm_length=5)
    assert out.item() == pytest.approx(global_)


def test_aggregate_loss_edge_cases():
    # seq-mean-token-sum-norm without a norm_length: the width 3 -> 10 / (2 * 3)
    out = aggregate_loss(LOSS, MASK, "seq-mean-token-sum-norm")
    assert out.item() == pytest.approx(10 / 6)
    with pytest.raises(ValueError, match="needs norm_length"):
        aggregate_loss(LOSS, MASK, "seq-mean-token-sum-norm", global_num_seqs=4)
    with pytest.raises(ValueError, match="norm_length must be > 0"):
        aggregate_loss(LOSS, MASK, "seq-mean-token-sum-norm", norm_length=0)
    # an empty row is no sequence: 3 / 1
    out = aggregate_loss(LOSS, torch.tensor([[1, 1, 0], [0, 0, 0]]), "seq-mean-token-sum")
    assert out.item() == 3.0
    # nothing at all: 0 / max(0, 1) for every mode, and an empty micro-batch still backwards
    for mode in LOSS_AGG_MODES:
        x = LOSS.clone().requires_grad_()
        out = aggregate_loss(x, torch.zeros(2, 3), mode)
        out.backward()
        assert out.item() == 0.0 and x.grad.abs().sum() == 0.0


def test_aggregate_loss_packed():
    loss = torch.tensor([[1.0, 3.0, 0.0, 6.0]])
    mask = torch.tensor([[1, 1, 0, 1]])  # responses {1, 3} (mean 2) and {6}
    assert aggregate_loss(loss, mask, "seq-mean-token-mean").item() == 4.0  # (2 + 6) / 2
    assert aggregate_loss(loss, mask, "seq-mean-token-sum").item() == 5.0  # 10 / 2
    # touching responses split by segment ids: {1}, {3}, {6} -> (1 + 3 + 6) / 3
    seg = torch.tensor([[0, 1, 1, 2]])
    out = aggregate_loss(loss, mask, "seq-mean-token-mean", segment_ids_bt=seg)
    assert out.item() == pytest.approx(10 / 3)


def test_unknown_agg_mode():
    with pytest.raises(ValueError, match="loss_agg_mode") as info:
        aggregate_loss(LOSS, MASK, "seq-mean")
    assert all(mode in str(info.value) for mode in LOSS_AGG_MODES)


def test_global_batch_counts():
    masks = [torch.tensor([[1, 1, 0], [0, 0, 0]]), torch.tensor([[1, 1, 1], [1, 0, 0]])]
    # tokens 2 + 4, sequences 1 + 2 (the empty row counts for nothing)
    assert global_batch_counts(masks) == BatchCounts(num_tokens=6, num_seqs=3)
    seg = [None, torch.tensor([[0, 1, 1], [2, 2, 2]])]  # splits the first row of mask 2
    assert global_batch_counts(masks, segment_ids_bt=seg) == BatchCounts(6, 4)
    with pytest.raises(ValueError, match="segment_ids_bt"):
        global_batch_counts(masks, segment_ids_bt=[None])


# Tokens with log-ratio log(r): old_logp = 0, logp = log r; the 6th token is masked out.
RATIOS = [1.5, 0.5, 1.5, 0.5, 4.0, 1.0]
ADV = torch.tensor([[1.0, 1.0, -1.0, -1.0, -2.0, 1e30]])
PG_MASK = torch.tensor([[1, 1, 1, 1, 1, 0]])


def pg_inputs():
    logp = torch.tensor([[math.log(r) for r in RATIOS]], requires_grad=True)
    return logp, torch.zeros(1, 6)


def test_policy_loss_clip_and_dual_clip():
    logp, old = pg_inputs()
    out = policy_loss(logp, old, ADV, PG_MASK, clip_ratio=0.2, clip_ratio_c=3.0)
    # t0 A=1  r=1.5: max(-1.5, -1.2) = -1.2  (clipped)
    # t1 A=1  r=0.5: max(-0.5, -0.8) = -0.5
    # t2 A=-1 r=1.5: max(1.5, 1.2) = 1.5     (below the dual cap 3)
    # t3 A=-1 r=0.5: max(0.5, 0.8) = 0.8     (clipped)
    # t4 A=-2 r=4:   max(8, 2.4) = 8 -> min(8, 2 * 3) = 6 (dual clip)
    assert out.loss.item() == pytest.approx((-1.2 - 0.5 + 1.5 + 0.8 + 6) / 5)  # 1.32
    assert out.pg_clipfrac.item() == pytest.approx(2 / 5)
    assert out.pg_clipfrac_lower.item() == pytest.approx(1 / 5)
    # mean(old - logp) = -(2 ln 1.5 + 2 ln 0.5 + ln 4) / 5 = -2 ln 1.5 / 5
    assert out.ppo_kl.item() == pytest.approx(-2 * math.log(1.5) / 5)
    out.loss.backward()
    # only unclipped branches carry a gradient, -A * r / 5: t1: -0.5 / 5, t2: 1.5 / 5
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, -0.1, 0.3, 0.0, 0.0, 0.0]]))


def test_policy_loss_asymmetric_and_no_dual_clip():
    logp, old = pg_inputs()
    out = policy_loss(logp, old, ADV, PG_MASK, clip_ratio_high=0.28, clip_ratio_c=None)
    # t0: max(-1.5, -1.28) = -1.28; t4 keeps 8 without the dual clip
    assert out.loss.item() == pytest.approx((-1.28 - 0.5 + 1.5 + 0.8 + 8) / 5)
    assert out.pg_clipfrac_lower.item() == 0.0
    # clip_ratio_low 0.6: t3 A=-1 r=0.5: max(0.5, 0.5) = 0.5, no longer clipped
    out = policy_loss(logp, old, ADV, PG_MASK, clip_ratio_low=0.6)
    assert out.loss.item() == pytest.approx((-1.2 - 0.5 + 1.5 + 0.5 + 6) / 5)
    assert out.pg_clipfrac.item() == pytest.approx(1 / 5)


def test_policy_loss_global_counts_scale_metrics():
    logp, old = pg_inputs()
    out = policy_loss(logp, old, ADV, PG_MASK, global_num_tokens=10)
    assert out.loss.item() == pytest.approx(6.6 / 10)
    assert out.pg_clipfrac.item() == pytest.approx(2 / 10)  # summable over micro-batches


def test_policy_loss_errors():
    logp, old = pg_inputs()
    with pytest.raises(ValueError, match="clip_ratio_c must be > 1"):
        policy_loss(logp, old, ADV, PG_MASK, clip_ratio_c=1.0)
    with pytest.raises(ValueError, match="clip_ratio_low"):
        policy_loss(logp, old, ADV, PG_MASK, clip_ratio_low=1.0)
    with pytest.raises(ValueError, match="loss_agg_mode"):
        policy_loss(logp, old, ADV, PG_MASK, loss_agg_mode="sum")


def test_policy_loss_at_ratio_one_is_the_policy_gradient():
    gen = torch.Generator().manual_seed(0)
    old = torch.randn(3, 4, generator=gen)
    adv = torch.randn(3, 4, generator=gen)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]])
    logp = old.clone().requires_grad_()
    out = policy_loss(logp, old, adv, mask)
    assert out.pg_clipfrac.item() == 0.0
    assert out.pg_clipfrac_lower.item() == 0.0
    assert out.ppo_kl.item() == 0.0
    out.loss.backward()
    torch.testing.assert_close(logp.grad, -adv * mask / 7)  # 7 response tokens


def gspo_case(logp_shift: float):
    """Two responses (2 and 3 tokens) of a [2, 3] batch; logp = old + shift on response 0."""
    old = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, -1.5, -2.5]])
    logp = old.clone()
    logp[0, :2] += logp_shift
    logp[1] += torch.tensor([0.1, -0.1, 0.3])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.bool)
    adv = torch.tensor([[1.0, 1.0, 0.0], [-0.5, -0.5, -0.5]])
    return logp.requires_grad_(True), old, adv, mask


def test_gspo_uses_the_sequence_ratio_and_its_gradient():
    logp, old, adv, mask = gspo_case(0.01)
    out = gspo_policy_loss(logp, old, adv, mask, 0.2, 0.2, "seq-mean-token-mean")
    s0, s1 = math.exp(0.01), math.exp((0.1 - 0.1 + 0.3) / 3)  # geometric means of the ratios
    assert float(out.loss) == pytest.approx((-1.0 * s0 + 0.5 * s1) / 2, rel=1e-6)
    out.loss.backward()
    # d/dlogp_t = -A_i * s_i / (|y_i| * N_seq) on every token of response i, 0 elsewhere
    expected = torch.tensor([[-s0 / 4, -s0 / 4, 0.0], [0.5 * s1 / 6] * 3])
    torch.testing.assert_close(logp.grad, expected)
    assert float(out.pg_clipfrac) == 0.0


def test_gspo_clips_whole_responses():
    logp, old, adv, mask = gspo_case(0.5)  # s0 = e^0.5 > 1 + 0.2 with A > 0: clipped
    out = gspo_policy_loss(logp, old, adv, mask, 0.2, 0.2, "seq-mean-token-mean")
    out.loss.backward()
    assert torch.equal(logp.grad[0], torch.zeros(3))  # no gradient through the clip
    assert logp.grad[1].abs().min() > 0
    assert float(out.pg_clipfrac) == pytest.approx(2 / 5)  # response 0's 2 of 5 tokens
    s1 = math.exp(0.1)
    assert float(out.loss) == pytest.approx((-1.0 * 1.2 + 0.5 * s1) / 2, rel=1e-6)


def test_value_loss():
    values = torch.tensor([[1.0, 2.0, 0.0, 0.0]])
    old = torch.tensor([[0.8, 1.0, 0.0, 1.0]])
    returns = torch.tensor([[1.5, 0.0, 1.0, -1.0]])
    mask = torch.ones(1, 4)
    out = value_loss(values, old, returns, mask, cliprange_value=0.5)
    # t0: V - V_old = 0.2 (inside):  0.5 * (1 - 1.5)^2 = 0.125
    # t1: V_clip = 1.5: 0.5 * max((2 - 0)^2, (1.5 - 0)^2) = 2
    # t2: V = V_old: 0.5 * (0 - 1)^2 = 0.5
    # t3: V_clip = 0.5: 0.5 * max((0 + 1)^2, (0.5 + 1)^2) = 1.125 (clipped term wins)
    assert out.loss.item() == pytest.approx((0.125 + 2 + 0.5 + 1.125) / 4)
    assert out.vf_clipfrac.item() == pytest.approx(1 / 4)
    out = value_loss(values, old, returns, mask, cliprange_value=None)
    assert out.loss.item() == pytest.approx((0.125 + 2 + 0.5 + 0.5) / 4)
    assert out.vf_clipfrac.item() == 0.0
    with pytest.raises(ValueError, match="cliprange_value"):
        value_loss(values, old, returns, mask, cliprange_value=-1.0)


def test_entropy_loss():
    assert entropy_loss(LOSS, MASK).item() == pytest.approx(2.5)  # 10 / 4
    out = entropy_loss(LOSS, MASK, "seq-mean-token-mean", global_num_seqs=4)
    assert out.item() == pytest.approx(1.5)  # (2 + 4) / 4


def test_kl_loss():
    logp = torch.tensor([[-1.0, -2.0, 50.0]])
    ref = torch.tensor([[-1.5, -1.0, -50.0]])
    mask = torch.tensor([[1, 1, 0]])
    assert kl_loss(logp, ref, mask, "kl").item() == pytest.approx(-0.25)  # (0.5 - 1) / 2
    # (exp(-0.5) + 0.5 - 1 + exp(1) - 2) / 2 = (0.1065307 + 0.7182818) / 2
    assert kl_loss(logp, ref, mask).item() == pytest.approx(0.4124062)
    with pytest.raises(ValueError, match="kl_loss_type"):
        kl_loss(logp, ref, mask, "forward")


def random_batch(seed, batch, width):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, width + 1, (batch,), generator=gen)
    mask = torch.arange(width)[None, :] < lengths[:, None]
    logp = -torch.rand(batch, width, generator=gen, dtype=torch.float64) * 3
    old = logp + 0.3 * torch.randn(batch, width, generator=gen, dtype=torch.float64)
    adv = torch.randn(batch, width, generator=gen, dtype=torch.float64)
    return logp, old, adv, mask


def all_losses(logp, old, adv, mask, mode, **counts):
    """Every loss of this module on one (micro-)batch, summed into one scalar per loss."""
    vals = logp * 0.7
    return [
        aggregate_loss(logp.square(), mask, mode, **counts),
        policy_loss(logp, old, adv, mask, 0.2, 0.1, 0.3, 3.0, mode, **counts).loss,
        value_loss(vals, old, adv, mask, 0.1, mode, **counts).loss,
        entropy_loss(-logp, mask, mode, **counts),
        kl_loss(logp, old, mask, "low_var_kl", mode, **counts),
    ]


def losses_and_grads(logp, *args, mode, **counts):
    out = []
    for loss in all_losses(logp, *args, mode=mode, **counts):
        (grad,) = torch.autograd.grad(loss, logp)
        out.append((loss.detach(), grad))
    return out


@settings(max_examples=50, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    batch=st.integers(1, 6),
    width=st.integers(1, 5),
    data=st.data(),
)
def test_micro_batches_sum_to_the_whole_batch(seed, batch, width, data):
    logp, old, adv, mask = random_batch(seed, batch, width)
    order = data.draw(st.permutations(range(batch)))
    cuts = sorted(data.draw(st.sets(st.integers(1, batch - 1))) if batch > 1 else [])
    groups = [order[a:b] for a, b in zip([0, *cuts], [*cuts, batch])]
    # each micro-batch trimmed to its own longest response, as dynamic padding does
    micro = [(rows, max(1, int(mask[rows].sum(1).max()))) for rows in groups]
    counts = global_batch_counts([mask[rows, :w] for rows, w in micro])
    for mode in LOSS_AGG_MODES:
        whole = losses_and_grads(
            logp.clone().requires_grad_(), old, adv, mask, mode=mode, norm_length=width
        )
        split = [(0.0, torch.zeros_like(logp)) for _ in whole]
        for rows, w in micro:
            parts = losses_and_grads(
                logp[rows, :w].clone().requires_grad_(),
                old[rows, :w],
                adv[rows, :w],
                mask[rows, :w],
                mode=mode,
                global_num_tokens=counts.num_tokens,
                global_num_seqs=counts.num_seqs,
                norm_length=width,
            )
            for i, (loss, grad) in enumerate(parts):
                split[i][1][rows, :w] += grad
                split[i] = (split[i][0] + loss, split[i][1])
        for i, ((l1, g1), (l2, g2)) in enumerate(zip(whole, split)):
            torch.testing.assert_close(l1, l2, msg=f"{mode} loss {i}")
            torch.testing.assert_close(g1, g2, msg=f"{mode} grad {i}")


@settings(max_examples=50, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    batch=st.integers(1, 4),
    width=st.integers(1, 5),
    # finite junk whose square (the first loss above squares log-probs) stays finite
    junk=st.floats(-1e6, 1e6, width=32),
    mode=st.sampled_from(LOSS_AGG_MODES),
)
def test_masked_positions_never_matter(seed, batch, width, junk, mode):
    logp, old, adv, mask = (
        t.float() if t.is_floating_point() else t for t in random_batch(seed, batch, width)
    )
    noisy = [torch.where(mask, t, junk) for t in (logp, old, adv)]
    a = losses_and_grads(logp.clone().requires_grad_(), old, adv, mask, mode=mode)
    b = losses_and_grads(noisy[0].clone().requires_grad_(), *noisy[1:], mask, mode=mode)
    for (l1, g1), (l2, g2) in zip(a, b):
        assert torch.equal(l1, l2) and torch.equal(g1, g2)
    pa = policy_loss(logp, old, adv, mask, loss_agg_mode=mode)
    pb = policy_loss(*noisy, mask, loss_agg_mode=mode)
    for name in ("pg_clipfrac", "pg_clipfrac_lower", "ppo_kl"):
        assert torch.equal(getattr(pa, name), getattr(pb, name)), name
