"""The reward model's loss on preference pairs (Bradley-Terry), for training reward models
from chosen/rejected pairs (issue 33).

Under the Bradley-Terry model the probability that the chosen response is preferred is
sigmoid(r_chosen - r_rejected); the loss is its negative log-likelihood, averaged over pairs:

    loss = mean(-log sigmoid(r_chosen - r_rejected - margin))

`margin` (per pair, >= 0; Llama 2's reward models) asks for a gap of at least that much
between pairs rated far apart. Metrics: the loss, accuracy (share of pairs whose chosen
response scores higher; ties count as wrong), the mean gap, and the mean scores.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def bradley_terry_loss(
    chosen: Tensor, rejected: Tensor, margin: Tensor | None = None
) -> tuple[Tensor, dict[str, float]]:
    """Loss (a scalar, differentiable) and metrics of [P] chosen and rejected scores."""
    if chosen.shape != rejected.shape or chosen.dim() != 1 or not chosen.numel():
        raise ValueError(
            f"expected two [P] score vectors, P > 0; got {tuple(chosen.shape)} and "
            f"{tuple(rejected.shape)}"
        )
    gap = chosen.float() - rejected.float()
    shifted = gap if margin is None else gap - margin.float()
    loss = -F.logsigmoid(shifted).mean()
    with torch.no_grad():
        metrics = {
            "rm/loss": float(loss),
            "rm/accuracy": float((gap > 0).float().mean()),
            "rm/gap_mean": float(gap.mean()),
            "rm/chosen_mean": float(chosen.float().mean()),
            "rm/rejected_mean": float(rejected.float().mean()),
        }
    return loss, metrics
