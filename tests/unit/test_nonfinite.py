"""NaN/inf checks (`rlhf.engine.nonfinite`, `rlhf.reward.scorer`): which values are caught and
what the one-line errors name. Whole runs with an absurd learning rate are in
tests/e2e/test_reliability.py."""

from __future__ import annotations

import math

import pytest
import torch

from rlhf.engine.nonfinite import NonFiniteError, check_scores, nonfinite_tensors
from rlhf.reward.scorer import NonFiniteReward, RewardInput, RewardScorer
from rlhf.rollout.batch import RolloutBatch

pytestmark = pytest.mark.reliability


def batch_with_scores(scores: list[float]) -> RolloutBatch:
    n = len(scores)
    return RolloutBatch(
        prompt_ids=[[1, 2]] * n,
        response_ids=[[3]] * n,
        scores_b=torch.tensor(scores),
        data_sources=["gsm8k"] * n,
        uids=[f"p{i}" for i in range(n)],
        reward_styles=["rule", "model", "model"][:n],
    )


def test_scores_name_the_first_bad_sample():
    check_scores(batch_with_scores([0.0, 1.0, 0.5]))
    with pytest.raises(
        NonFiniteError,
        match=r"sample 1 \(prompt p1, data_source 'gsm8k', "
        r"reward_model.style model\) is nan; 2 of 3",
    ):
        check_scores(batch_with_scores([0.0, math.nan, math.inf]))


def test_tensors_are_checked_on_response_tokens_only():
    mask = torch.tensor([[True, False], [True, True]])
    values = torch.tensor([[0.0, math.nan], [1.0, 2.0]])  # NaN beyond a response: ignored
    advantages = torch.tensor([[0.0, 0.0], [math.inf, 2.0]])
    named = {"values": values, "advantages": advantages, "returns": None}
    assert nonfinite_tensors(named, mask) == ["advantages"]


def test_a_reward_function_returning_nan_is_an_error_naming_the_response():
    scorer = RewardScorer(lambda data_source, solution_str, ground_truth, extra_info: math.nan)
    item = RewardInput("gsm8k", "#### 12 apples", "12")
    with pytest.raises(
        NonFiniteReward,
        match=r"returned nan for data_source 'gsm8k', response '#### 12 apples', "
        r"ground truth '12'",
    ):
        scorer([item])


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, None])
def test_tensors_finite_reads_one_verdict_from_the_device(bad, monkeypatch):
    """A gradient check before every optimizer step: a NaN or inf anywhere in any tensor
    makes it False, and the host waits for the device once (it read one flag per parameter:
    hundreds of host syncs per update on a GPU)."""
    from rlhf.engine.nonfinite import tensors_finite

    tensors = [torch.randn(4, 5) for _ in range(30)] + [torch.zeros(0)]
    tensors.append(torch.randn(7).to(torch.bfloat16))
    if bad is not None:
        tensors[17][2, 3] = bad
    reads, inside = [], []
    for name in ("item", "__bool__", "tolist"):
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, _name=name):
            if inside:  # a torch-function mode (the CPU compatibility layer) calls it again
                return _original(self, *args)
            reads.append(_name)
            inside.append(_name)
            try:
                return _original(self, *args)
            finally:
                inside.pop()

        monkeypatch.setattr(torch.Tensor, name, counted)
    assert tensors_finite(tensors, torch.device("cpu")) is (bad is None)
    assert len(reads) == 1
