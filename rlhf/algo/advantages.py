"""Advantage estimators: GAE (with a critic) and the critic-free GRPO, RLOO, REINFORCE++.

All of them are statistics of a finished rollout and never need a gradient, so they run
under `torch.no_grad()`. Tensors are [batch, response_len] with `mask_bt` = 1 on response
tokens; outputs are 0 outside the mask.

Packed rows: GAE and REINFORCE++ scan each *response* separately, where a response is a
maximal run of the mask, further cut where the optional `segment_ids_bt` changes (see
`rlhf.algo.stats`). Right-padded rows are the special case of one run per row. Each
response is an episode that terminates at its last token: the value after it counts as 0
and nothing flows back across a boundary into the previous response.

GRPO and RLOO compare whole-sequence scores within the group of samples drawn for the
same prompt (`uids`); they assume one response per row.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from rlhf.algo.stats import _as_bool, masked_whiten, response_ends
from rlhf.config.choices import ADV_ESTIMATORS


def _check_unit_interval(**kwargs: float) -> None:
    for name, v in kwargs.items():
        if not 0.0 <= v <= 1.0:
            raise ValueError(f"{name} must be in [0, 1], got {v}")


def _continues(mask_bt: Tensor, segment_ids_bt: Tensor | None, dtype: torch.dtype) -> Tensor:
    """1.0 where token t+1 belongs to the same response as token t, else 0."""
    m = _as_bool(mask_bt)
    return (m & ~response_ends(m, segment_ids_bt)).to(dtype)


def _reverse_scan(x_bt: Tensor, cont_bt: Tensor, coef: float) -> Tensor:
    """out_t = x_t + coef * cont_t * out_{t+1}, scanned from the right (out_T = 0)."""
    out = torch.zeros_like(x_bt)
    carry = torch.zeros_like(x_bt[:, 0])
    for t in range(x_bt.shape[1] - 1, -1, -1):
        carry = x_bt[:, t] + coef * cont_bt[:, t] * carry
        out[:, t] = carry
    return out


@torch.no_grad()
def compute_gae(
    rewards_bt: Tensor,
    values_bt: Tensor,
    mask_bt: Tensor,
    gamma: float,
    lam: float,
    segment_ids_bt: Tensor | None = None,
    whiten: bool = True,
    group: dist.ProcessGroup | None = None,
) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016); returns (advantages, returns).

    Per response, with c_t = 1 if token t+1 is in the same response, else 0:
        delta_t = r_t + gamma * c_t * V_{t+1} - V_t
        A_t     = delta_t + gamma * lam * c_t * A_{t+1}
        R_t     = A_t + V_t                      (the value targets, from unwhitened A)
    If `whiten`, the advantages are then `masked_whiten`ed over the batch (and `group`).
    """
    _check_unit_interval(gamma=gamma, lam=lam)
    m = _as_bool(mask_bt)
    rewards = torch.where(m, rewards_bt, 0)
    values = torch.where(m, values_bt, 0)
    cont = _continues(m, segment_ids_bt, values.dtype)
    next_values = torch.cat([values[:, 1:], torch.zeros_like(values[:, :1])], dim=1)
    deltas = torch.where(m, rewards + gamma * cont * next_values - values, 0)
    advantages = _reverse_scan(deltas, cont, gamma * lam)
    returns = torch.where(m, advantages + values, 0)
    if whiten:
        advantages = masked_whiten(advantages, m, group=group)
    return advantages, returns


def _group_index(uids: Sequence[str | int] | Tensor, batch: int) -> Tensor:
    """Long [B]: 0-based id of each sample's prompt group."""
    if isinstance(uids, Tensor):
        index = torch.unique(uids.flatten(), return_inverse=True)[1]
    else:
        first_seen: dict[str | int, int] = {}
        index = torch.tensor([first_seen.setdefault(u, len(first_seen)) for u in uids])
    if index.numel() != batch:
        raise ValueError(f"got {index.numel()} uids for {batch} scores: give one uid per sample")
    return index.long()


def _group_stats(scores_b: Tensor, index: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per sample: its group's size, score sum and unbiased std (0 for a group of one)."""
    index = index.to(scores_b.device)
    n_groups = int(index.max()) + 1 if index.numel() else 0
    counts = torch.bincount(index, minlength=n_groups).to(scores_b.dtype)
    sums = torch.zeros(n_groups, dtype=scores_b.dtype, device=scores_b.device)
    sums.index_add_(0, index, scores_b)
    centered = scores_b - (sums / counts)[index]
    sq = torch.zeros_like(sums).index_add_(0, index, centered.square())
    std = torch.sqrt(sq / (counts - 1).clamp(min=1))
    return counts[index], sums[index], std[index]


@torch.no_grad()
def compute_grpo_advantages(
    scores_b: Tensor,
    uids: Sequence[str | int] | Tensor,
    mask_bt: Tensor,
    norm_by_std: bool = True,
    eps: float = 1e-6,
) -> Tensor:
    """GRPO (Shao et al. 2024): A_i = (s_i - mean_g) / (std_g + eps) on every response token.

    mean_g and std_g (unbiased, n - 1) are over the samples sharing sample i's uid; without
    `norm_by_std`, A_i = s_i - mean_g (Dr. GRPO). A group of one sample has std 0 and gets
    advantage 0: it carries no comparison. `eps` > 0 also keeps a group of identical scores
    finite (all its advantages are then 0).
    """
    index = _group_index(uids, scores_b.shape[0])
    counts, sums, std = _group_stats(scores_b, index)
    adv = scores_b - sums / counts
    if norm_by_std:
        adv = adv / (std + eps)
    adv = torch.where(counts > 1, adv, 0)
    return torch.where(_as_bool(mask_bt), adv[:, None], 0)


@torch.no_grad()
def compute_rloo_advantages(
    scores_b: Tensor, uids: Sequence[str | int] | Tensor, mask_bt: Tensor
) -> Tensor:
    """RLOO (Ahmadian et al. 2024): A_i = s_i - (sum_g - s_i) / (n_g - 1) on every token.

    The baseline is the mean score of the *other* samples of the same prompt. A group of
    one sample has no other sample, so its advantage is 0.
    """
    index = _group_index(uids, scores_b.shape[0])
    counts, sums, _ = _group_stats(scores_b, index)
    baseline = (sums - scores_b) / (counts - 1).clamp(min=1)
    adv = torch.where(counts > 1, scores_b - baseline, 0)
    return torch.where(_as_bool(mask_bt), adv[:, None], 0)


@torch.no_grad()
def compute_reinforce_plus_plus_advantages(
    rewards_bt: Tensor,
    mask_bt: Tensor,
    gamma: float,
    segment_ids_bt: Tensor | None = None,
    group: dist.ProcessGroup | None = None,
) -> tuple[Tensor, Tensor]:
    """REINFORCE++ (Hu 2025); returns (advantages, returns).

    returns G_t = r_t + gamma * c_t * G_{t+1} is the discounted reward-to-go within each
    response (c_t as in `compute_gae`); advantages = masked_whiten(G) over the batch (and
    `group`): the batch mean is the baseline.
    """
    _check_unit_interval(gamma=gamma)
    m = _as_bool(mask_bt)
    rewards = torch.where(m, rewards_bt, 0)
    returns = _reverse_scan(rewards, _continues(m, segment_ids_bt, rewards.dtype), gamma)
    return masked_whiten(returns, m, group=group), returns


@dataclass(frozen=True)
class AdvantageOutput:
    """Advantages [B, T]; returns [B, T] are the value targets (None without a critic)."""

    advantages_bt: Tensor
    returns_bt: Tensor | None


def compute_advantages(
    estimator: str,
    rewards_bt: Tensor,
    mask_bt: Tensor,
    *,
    values_bt: Tensor | None = None,
    uids: Sequence[str | int] | Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    norm_by_std: bool = True,
    segment_ids_bt: Tensor | None = None,
    group: dist.ProcessGroup | None = None,
) -> AdvantageOutput:
    """Dispatch on `algorithm.adv_estimator` (one of ADV_ESTIMATORS).

    GRPO and RLOO score each row by the sum of its token rewards; REINFORCE++ returns its
    reward-to-go as `returns_bt`, GRPO and RLOO return None there.
    """
    if estimator not in ADV_ESTIMATORS:
        raise ValueError(
            f"unknown algorithm.adv_estimator {estimator!r}: use one of {ADV_ESTIMATORS}"
        )
    if estimator == "gae":
        if values_bt is None:
            raise ValueError("adv_estimator 'gae' needs values_bt from the critic")
        adv, ret = compute_gae(
            rewards_bt, values_bt, mask_bt, gamma, lam, segment_ids_bt, group=group
        )
        return AdvantageOutput(adv, ret)
    if estimator == "reinforce_plus_plus":
        adv, ret = compute_reinforce_plus_plus_advantages(
            rewards_bt, mask_bt, gamma, segment_ids_bt, group
        )
        return AdvantageOutput(adv, ret)
    if uids is None:
        raise ValueError(f"adv_estimator {estimator!r} needs uids (the prompt of each sample)")
    scores_b = torch.where(_as_bool(mask_bt), rewards_bt, 0).sum(dim=1)
    if estimator == "grpo":
        return AdvantageOutput(compute_grpo_advantages(scores_b, uids, mask_bt, norm_by_std), None)
    return AdvantageOutput(compute_rloo_advantages(scores_b, uids, mask_bt), None)
