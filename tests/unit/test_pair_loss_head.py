"""The reward model's training head (`PairLossHead`) against a hand computation.

A micro-batch of a larger batch of preference pairs: it holds pairs 2 and 3 of four (so a
pair's index is not its position in the micro-batch), each pair with its own margin, and
one pair whose rejected side scores higher. Each side's score is the value at its last
token, found here from the packed row's layout (samples back to back); the loss is
-log sigmoid(r_chosen - r_rejected - margin) summed over the micro-batch's pairs and
divided by the batch's pair count, as `bradley_terry_loss` documents; its gradient reaches
only the scored positions, -/+ sigmoid(-(gap - margin)) / pairs.
"""

from __future__ import annotations

import math

import pytest
import torch

from rlhf.data.preference import TokenizedPair
from rlhf.engine.heads import PairLossHead
from rlhf.engine.micro_batch import build_micro_batch
from rlhf.trainer.reward_training import pair_batch

PAIRS = [
    TokenizedPair([1, 2], [3], [4, 5], 0.0),
    TokenizedPair([6], [7, 8], [9], 0.25),
    TokenizedPair([10, 11, 12], [13, 14], [15], 1.0),  # pair 2: first in the micro-batch
    TokenizedPair([16], [17], [18, 19, 20], 2.5),
]
MICRO = [4, 5, 6, 7]  # samples of pairs 2 and 3 (2p: chosen, 2p + 1: rejected)
# the score of each sample of MICRO at its last token: pair 2 right, pair 3 wrong
SCORES = {4: 0.75, 5: -0.5, 6: -0.25, 7: 0.5}


def neg_log_sigmoid(x: float) -> float:
    return math.log1p(math.exp(-x))


def sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def test_pair_loss_head_matches_the_hand_computed_bradley_terry_loss():
    batch = pair_batch(PAIRS)
    mb = build_micro_batch(batch, MICRO)
    # where each sample's last token sits in the packed row (samples back to back)
    lengths = [len(batch.prompt_ids[i]) + len(batch.response_ids[i]) for i in MICRO]
    last = {i: sum(lengths[: k + 1]) - 1 for k, i in enumerate(MICRO)}
    values = torch.full((1, sum(lengths), 1), 9.0)  # 9: anywhere but a last token
    for i, position in last.items():
        values[0, position, 0] = SCORES[i]
    values.requires_grad_(True)
    margins = torch.tensor([p.margin for p in PAIRS])

    loss, metrics = PairLossHead(margins, len(PAIRS))(values, mb)

    count = len(PAIRS)  # normalised by the batch's pairs, not the micro-batch's
    gaps = {p: SCORES[2 * p] - SCORES[2 * p + 1] for p in (2, 3)}  # 1.25, -0.75
    shifted = {p: gaps[p] - PAIRS[p].margin for p in (2, 3)}  # 0.25, -3.25
    expected = {
        "rm/loss": sum(neg_log_sigmoid(x) for x in shifted.values()) / count,
        "rm/accuracy": 1 / count,
        "rm/gap_mean": sum(gaps.values()) / count,
        "rm/chosen_mean": (SCORES[4] + SCORES[6]) / count,
        "rm/rejected_mean": (SCORES[5] + SCORES[7]) / count,
    }
    assert float(loss) == pytest.approx(expected["rm/loss"], rel=1e-6)
    assert sorted(metrics) == sorted(expected)
    for name, value in expected.items():
        assert float(metrics[name]) == pytest.approx(value, rel=1e-6, abs=1e-7), name

    loss.backward()
    assert values.grad is not None
    grad = torch.zeros_like(values)
    for p in (2, 3):
        pull = sigmoid(-shifted[p]) / count
        grad[0, last[2 * p], 0] = -pull
        grad[0, last[2 * p + 1], 0] = pull
    torch.testing.assert_close(values.grad, grad, rtol=1e-6, atol=1e-7)
