"""KL between the policy and the reference: per-token estimators, rewards, controllers.

The true KL(pi || ref) over the vocabulary is too costly to compute per token, so it is
estimated from the log-probabilities of the *sampled* token (Schulman, "Approximating KL
divergence", 2020). Let d = ref_logp - logp (the log of ref/pi at the sampled token):

- `kl`         (k1): logp - ref_logp = -d. Unbiased, high variance, can be negative.
- `abs`            : |logp - ref_logp|.
- `mse`        (k2): 0.5 * (logp - ref_logp)^2. Low variance, biased, always >= 0.
- `low_var_kl` (k3): exp(d) - d - 1, clamped to [-10, 10]. Unbiased and >= 0; the clamp
  bounds the rare huge values when the two models disagree strongly.

`k1`, `k2`, `k3` are the same estimators under their other names. A trailing `+` (`kl+`,
`low_var_kl+`, ...) keeps the estimator's value but takes the gradient of k2 (a
straight-through estimate): k1 and k3 estimate the KL without bias, but their gradients do
not estimate the KL's gradient, while k2's does.

The KL enters PPO in one of two ways: as a penalty `-beta * kl_t` folded into the
token-level rewards (`algorithm.use_kl_in_reward`, with beta from a KL controller), or as
a loss term to the reference (`use_kl_loss`, see `rlhf.algo.losses.kl_loss`).

The adaptive controller follows Ziegler et al. 2019 ("Fine-Tuning Language Models from
Human Preferences"): beta grows when the measured KL exceeds the target and shrinks when
it is below, by at most 20% of `n_steps / horizon` per update.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from rlhf.algo.stats import _as_bool, response_ends
from rlhf.config.choices import KL_LOSS_TYPES

if TYPE_CHECKING:
    from rlhf.config.algorithm import KLControlConfig


# exp(d) - d - 1 > 10 already for d > 2.6: clamping d at 20 before exp leaves the clamped
# value unchanged but keeps exp finite, so the backward pass never sees inf * 0.
_LOW_VAR_D_MAX = 20.0
_LOW_VAR_CLAMP = 10.0


_ALIASES = {"k1": "kl", "k2": "mse", "k3": "low_var_kl"}


def _estimate(logp: Tensor, ref_logp: Tensor, kind: str) -> Tensor:
    kind = _ALIASES.get(kind, kind)
    if kind == "kl":
        return logp - ref_logp
    if kind == "abs":
        return (logp - ref_logp).abs()
    if kind == "mse":
        return 0.5 * (logp - ref_logp).square()
    if kind == "low_var_kl":
        d = (ref_logp - logp).clamp(max=_LOW_VAR_D_MAX)
        return (torch.exp(d) - d - 1).clamp(-_LOW_VAR_CLAMP, _LOW_VAR_CLAMP)
    raise ValueError(
        f"unknown KL estimator {kind!r} (kl_loss_type / kl_penalty): use one of {KL_LOSS_TYPES}"
    )


def kl_penalty(logp: Tensor, ref_logp: Tensor, kind: str) -> Tensor:
    """Element-wise KL estimate of `kind` (one of KL_LOSS_TYPES; see the module docstring)."""
    if not kind.endswith("+"):
        return _estimate(logp, ref_logp, kind)
    value = _estimate(logp, ref_logp, kind[:-1])
    k2 = 0.5 * (logp - ref_logp).square()  # forward: the estimate; backward: k2's gradient
    return k2 - k2.detach() + value.detach()


def _scatter_scores(scores_b: Tensor, ends_bt: Tensor) -> Tensor:
    """Scores placed on response ends; see `token_level_rewards` for the accepted layouts."""
    out = torch.zeros(ends_bt.shape, dtype=scores_b.dtype, device=scores_b.device)
    per_row = ends_bt.sum(dim=1)
    num_responses = int(per_row.sum())
    if scores_b.dim() != 1:
        raise ValueError(f"scores must be 1-D, got shape {tuple(scores_b.shape)}")
    if scores_b.numel() == num_responses:
        out[ends_bt] = scores_b
    elif scores_b.numel() == ends_bt.shape[0] and bool((per_row <= 1).all()):
        out[ends_bt] = scores_b[per_row == 1]
    else:
        raise ValueError(
            f"got {scores_b.numel()} scores for {num_responses} responses in "
            f"{ends_bt.shape[0]} rows: give one score per response (row-major order), or "
            "one per row when every row holds at most one response"
        )
    return out


def token_level_rewards(
    scores_b: Tensor,
    mask_bt: Tensor,
    kl_bt: Tensor | None = None,
    beta: float = 0.0,
    segment_ids_bt: Tensor | None = None,
) -> Tensor:
    """Rewards [B, T]: each response's score on its last token, minus beta * kl_t on every token.

    reward_t = score * [t is the last token of its response] - beta * kl_t * mask_t, and 0
    outside the mask. Responses are laid out as described in `rlhf.algo.stats` (maximal runs
    of the mask, cut where `segment_ids_bt` changes). `scores_b` holds one score per
    response in row-major order; a [B] tensor with one score per row is also accepted
    when every row holds at most one response (rows without response tokens drop theirs).
    """
    if kl_bt is None and beta != 0.0:
        raise ValueError("token_level_rewards: beta != 0 needs kl_bt (the per-token KL)")
    m = _as_bool(mask_bt)
    rewards = _scatter_scores(scores_b, response_ends(m, segment_ids_bt))
    if kl_bt is not None:
        if kl_bt.shape != m.shape:
            raise ValueError(f"kl_bt shape {tuple(kl_bt.shape)} != mask shape {tuple(m.shape)}")
        rewards = rewards - beta * torch.where(m, kl_bt, 0).to(rewards.dtype)
    return rewards


class FixedKLController:
    """A constant KL coefficient (`algorithm.kl_ctrl.type: fixed`)."""

    def __init__(self, kl_coef: float) -> None:
        if kl_coef < 0:
            raise ValueError(f"kl_coef must be >= 0, got {kl_coef}")
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op: the coefficient never changes."""

    def state_dict(self) -> dict[str, float]:
        return {"kl_coef": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["kl_coef"])


class AdaptiveKLController:
    """Ziegler et al. 2019 proportional controller (`algorithm.kl_ctrl.type: adaptive`).

    On `update(current_kl, n_steps)`:
        error = clip(current_kl / target_kl - 1, -0.2, 0.2)
        value = value * (1 + error * n_steps / horizon)
    where `n_steps` is the number of samples (or steps) the KL was measured over.
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int) -> None:
        if init_kl_coef < 0:
            raise ValueError(f"kl_coef must be >= 0, got {init_kl_coef}")
        if target_kl <= 0 or horizon <= 0:
            raise ValueError(f"target_kl and horizon must be > 0, got {target_kl}, {horizon}")
        self.value = float(init_kl_coef)
        self.target_kl = float(target_kl)
        self.horizon = horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        error = min(max(float(current_kl) / self.target_kl - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon

    def state_dict(self) -> dict[str, float]:
        return {"kl_coef": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["kl_coef"])


def build_kl_controller(cfg: KLControlConfig) -> FixedKLController | AdaptiveKLController:
    """The controller named by `algorithm.kl_ctrl.type`, starting at `kl_coef`."""
    if cfg.type == "fixed":
        return FixedKLController(cfg.kl_coef)
    if cfg.type == "adaptive":
        return AdaptiveKLController(cfg.kl_coef, cfg.target_kl, cfg.horizon)
    raise ValueError(f"algorithm.kl_ctrl.type must be 'fixed' or 'adaptive', got {cfg.type!r}")
