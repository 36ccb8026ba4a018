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
    chosen: Tensor,
    rejected: Tensor,
    margin: Tensor | None = None,
    num_pairs: int | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Loss (a scalar, differentiable) and metrics (detached scalars) of [P] chosen and
    rejected scores.

    `num_pairs`: what the sums are divided by (default P). A micro-batch of a larger batch
    passes the batch's pair count, so that the losses and metrics of its micro-batches (and
    data-parallel ranks) add up to the batch's means."""
    if chosen.shape != rejected.shape or chosen.dim() != 1:
        raise ValueError(
            f"expected two [P] score vectors; got {tuple(chosen.shape)} and {tuple(rejected.shape)}"
        )
    count = chosen.numel() if num_pairs is None else num_pairs
    if count < 1:
        raise ValueError(f"the loss needs at least one pair (num_pairs={num_pairs})")
    gap = chosen.float() - rejected.float()
    shifted = gap if margin is None else gap - margin.float().to(gap.device)
    loss = -F.logsigmoid(shifted).sum() / count
    with torch.no_grad():
        metrics = {
            "rm/loss": loss.detach(),
            "rm/accuracy": (gap > 0).float().sum() / count,
            "rm/gap_mean": gap.sum() / count,
            "rm/chosen_mean": chosen.detach().float().sum() / count,
            "rm/rejected_mean": rejected.detach().float().sum() / count,
        }
    return loss, metrics
