"""Rollout-training mismatch metrics and truncated importance weights on hand-made batches."""

from __future__ import annotations

import math

import pytest
import torch

from rlhf.algo.rollout_correction import mismatch_metrics, truncated_is_weights
from rlhf.rollout.batch import RolloutBatch

OLD = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, -1.5, -2.5], [0.0, 0.0, 0.0]])
ROLLOUT = torch.tensor([[-1.5, -1.0, 9.0], [-0.5, -2.5, -2.0], [7.0, 7.0, 7.0]])
MASK = torch.tensor([[1, 1, 0], [1, 1, 1], [0, 0, 0]], dtype=torch.bool)  # row 2: empty


def test_mismatch_metrics():
    d = [0.5, -1.0, 0.0, 1.0, -0.5]  # old - rollout on the 5 response tokens
    got = mismatch_metrics(OLD, ROLLOUT, MASK)
    assert got["kl"] == pytest.approx(-sum(d) / 5)
    assert got["k3_kl"] == pytest.approx(sum(math.exp(x) - x - 1 for x in d) / 5)
    # mean NLL per response: trainer 1.5 and 1.5, rollout 1.25 and 5/3 (empty row left out)
    gaps = [1.5 - 1.25, 1.5 - 5 / 3]
    assert got["log_ppl_diff"] == pytest.approx(sum(gaps) / 2)
    assert got["log_ppl_abs_diff"] == pytest.approx((abs(gaps[0]) + abs(gaps[1])) / 2)
    assert got["training_ppl"] == pytest.approx(math.exp(1.5))
    assert got["rollout_ppl"] == pytest.approx((math.exp(1.25) + math.exp(5 / 3)) / 2)
    assert got["max_abs_diff"] == pytest.approx(1.0)  # not 9 or 7: masked tokens differ more


def test_token_weights_are_capped_ratios():
    weights, metrics = truncated_is_weights(OLD, ROLLOUT, MASK, "token", 2.0)
    expected = torch.tensor(
        [[math.exp(0.5), math.exp(-1.0), 0.0], [1.0, 2.0, math.exp(-0.5)], [0.0, 0.0, 0.0]]
    )
    torch.testing.assert_close(weights, expected)
    assert metrics["rollout_is_clip_frac"] == pytest.approx(1 / 5)  # e^1 > 2
    assert metrics["rollout_is_mean"] == pytest.approx(float(expected.sum()) / 5)


def test_sequence_weights_share_the_response_ratio():
    weights, metrics = truncated_is_weights(OLD, ROLLOUT, MASK, "sequence", 1.0)
    row0, row1 = math.exp(-0.5), min(math.exp(0.5), 1.0)
    expected = torch.tensor([[row0, row0, 0.0], [row1] * 3, [0.0, 0.0, 0.0]])
    torch.testing.assert_close(weights, expected)
    assert metrics["rollout_is_clip_frac"] == pytest.approx(1 / 2)  # of the 2 responses
    with pytest.raises(ValueError, match="'token' or 'sequence'"):
        truncated_is_weights(OLD, ROLLOUT, MASK, "tokens", 1.0)


def test_batch_keeps_engine_logprobs_through_select_concat_and_broadcast():
    batch = RolloutBatch(
        prompt_ids=[[1], [2], [3]],
        response_ids=[[4, 5], [6], [7, 8, 9]],
        scores_b=torch.tensor([0.0, 1.0, 0.5]),
        data_sources=["a"] * 3,
        uids=["u0", "u0", "u1"],
        rollout_logprobs=[[-1.0, -2.0], [-3.0], [-4.0, -5.0, -6.0]],
    )
    picked = batch.select([2, 0])
    assert picked.rollout_logprobs == [[-4.0, -5.0, -6.0], [-1.0, -2.0]]
    whole = RolloutBatch.concat([batch.select([0]), batch.select([1, 2])])
    assert whole.rollout_logprobs == batch.rollout_logprobs
    again = RolloutBatch.from_objects(batch.to_objects())
    torch.testing.assert_close(again.rollout_logprobs_bt(), batch.rollout_logprobs_bt())
    assert batch.rollout_logprobs_bt()[1].tolist() == [-3.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="log-prob count"):
        RolloutBatch([[1]], [[4, 5]], torch.zeros(1), ["a"], ["u"], [[-1.0]])
