"""Losses, gradients and whitening on 2 DP ranks x 2 micro-batches == the whole batch at once."""

from __future__ import annotations

import json

import pytest
import torch

from rlhf.algo import aggregate_loss, compute_gae, masked_whiten, policy_loss
from rlhf.config.choices import LOSS_AGG_MODES
from tests.distributed.workers.algo_dp_split import (
    GAMMA,
    LAM,
    WIDTH,
    make_batch,
    token_loss,
)
from tests.helpers import run_torchrun


def whole_batch(mode: str, name: str, b: dict) -> tuple[float, list, torch.Tensor]:
    """Loss, metrics and gradient of the whole mini-batch, without any global counts."""
    logp = b["logp"].clone().requires_grad_()
    metrics = []
    if name == "aggregate":
        loss = aggregate_loss(token_loss(logp), b["mask"], mode, norm_length=WIDTH)
    else:
        res = policy_loss(
            logp, b["old_logp"], b["adv"], b["mask"], 0.2, 0.1, 0.3, 3.0, mode, norm_length=WIDTH
        )
        loss, metrics = res.loss, [res.pg_clipfrac, res.pg_clipfrac_lower, res.ppo_kl]
    loss.backward()
    return loss.item(), [m.item() for m in metrics], logp.grad


@pytest.fixture(scope="module")
def split_result(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("algo_dp")
    run_torchrun("algo_dp_split.py", 2, ["--out-dir", str(out_dir)], timeout_s=300)
    return json.loads((out_dir / "result.json").read_text())


@pytest.mark.parametrize("name", ["aggregate", "policy"])
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_loss_and_grad_match_whole_batch(split_result, mode, name):
    loss, metrics, grad = whole_batch(mode, name, make_batch())
    got = split_result[f"{name}/{mode}"]
    assert got["loss"] == pytest.approx(loss, abs=1e-6)
    assert got["metrics"][: len(metrics)] == pytest.approx(metrics, abs=1e-6)
    torch.testing.assert_close(torch.tensor(got["grad"], dtype=grad.dtype), grad, atol=1e-6, rtol=0)
    assert grad.abs().sum() > 0  # the comparison is not vacuous


def test_whitening_over_the_group_matches_whole_batch(split_result):
    b = make_batch()
    expected = masked_whiten(b["values"], b["mask"])
    got = torch.tensor(split_result["whiten"], dtype=expected.dtype)
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)
    expected, _ = compute_gae(b["rewards"], b["values"], b["mask"], GAMMA, LAM)
    got = torch.tensor(split_result["gae"], dtype=expected.dtype)
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)
