"""Rollout-training mismatch: its size, and truncated importance sampling (TIS) against it.

The engine that samples (SGLang: its kernels, its precision) and the trainer (Megatron)
compute the same policy's log-probs with different numerics, so responses come from
pi_rollout while PPO's ratio assumes they came from pi_old. Per token,
w = pi_old / pi_rollout = exp(old - rollout) reweights the loss towards pi_old; capping w at
C (truncated IS, Yao et al. 2025) bounds its variance. At sequence level the weight is the
product over the response's tokens, exp(sum_t (old_t - rollout_t)).

Inputs are [B, R] log-probs of the sampled tokens with a response mask; every output is a
statistic of finished rollouts, so nothing here carries a gradient.
"""

from __future__ import annotations

import torch
from torch import Tensor

from rlhf.algo.stats import _as_bool

_LOG_CLAMP = 20.0  # exp(20) ~ 5e8: far beyond any cap, and finite


@torch.no_grad()
def mismatch_metrics(old_bt: Tensor, rollout_bt: Tensor, mask_bt: Tensor) -> dict[str, float]:
    """How far the rollout's log-probs are from the trainer's, over the whole batch.

    kl: mean over tokens of rollout - old (k1 estimate of KL(pi_rollout || pi_old), the
    samples being drawn from pi_rollout); k3_kl: mean of exp(d) - d - 1 with d = old -
    rollout (non-negative, lower variance); log_ppl_diff / log_ppl_abs_diff: mean over
    responses of (mean token NLL under the trainer - under the rollout) and of its absolute
    value; training_ppl / rollout_ppl: mean over responses of exp(mean token NLL);
    max_abs_diff: the largest |old - rollout| of a token.
    """
    m = _as_bool(mask_bt)
    d = torch.where(m, old_bt - rollout_bt, 0).double()
    n_tok = m.sum().clamp(min=1)
    lengths = m.sum(dim=1)
    rows = lengths > 0
    lengths = lengths.clamp(min=1).double()
    train_nll = -torch.where(m, old_bt, 0).double().sum(dim=1) / lengths
    rollout_nll = -torch.where(m, rollout_bt, 0).double().sum(dim=1) / lengths
    gap = (train_nll - rollout_nll)[rows]
    return {
        "kl": float(-d.sum() / n_tok),
        "k3_kl": float(torch.where(m, torch.exp(d.clamp(max=_LOG_CLAMP)) - d - 1, 0).sum() / n_tok),
        "log_ppl_diff": float(gap.mean()) if gap.numel() else 0.0,
        "log_ppl_abs_diff": float(gap.abs().mean()) if gap.numel() else 0.0,
        "training_ppl": float(torch.exp(train_nll[rows]).mean()) if gap.numel() else 0.0,
        "rollout_ppl": float(torch.exp(rollout_nll[rows]).mean()) if gap.numel() else 0.0,
        "max_abs_diff": float(d.abs().max()) if d.numel() else 0.0,
    }


@torch.no_grad()
def truncated_is_weights(
    old_bt: Tensor, rollout_bt: Tensor, mask_bt: Tensor, level: str, threshold: float
) -> tuple[Tensor, dict[str, float]]:
    """Per-token weights min(pi_old / pi_rollout, threshold) ([B, R], 0 outside the mask).

    `level` "token" uses each token's own ratio; "sequence" gives every token of a response
    the ratio of the whole response. Metrics: rollout_is_mean (mean weight over tokens or
    responses) and rollout_is_clip_frac (share of them whose ratio exceeded `threshold`).
    """
    if threshold <= 0:
        raise ValueError(f"rollout_is_threshold must be > 0, got {threshold}")
    m = _as_bool(mask_bt)
    d = torch.where(m, old_bt - rollout_bt, 0)
    if level == "token":
        ratio = torch.exp(d.clamp(max=_LOG_CLAMP))
        counted = m
    elif level == "sequence":
        per_response = torch.exp(d.sum(dim=1).clamp(max=_LOG_CLAMP))
        ratio = per_response[:, None].expand_as(d)
        counted = m & (torch.arange(m.shape[1], device=m.device)[None, :] == 0)  # one per row
    else:
        raise ValueError(f"rollout_is must be 'token' or 'sequence', got {level!r}")
    weights = torch.where(m, ratio.clamp(max=threshold), 0)
    n = counted.sum().clamp(min=1)
    metrics = {
        "rollout_is_mean": float(torch.where(counted, weights, 0).sum() / n),
        "rollout_is_clip_frac": float((counted & (ratio > threshold)).sum() / n),
    }
    return weights, metrics
