"""Masked statistics, optionally reduced over a process group, and the response layout.

Every PPO quantity is a statistic over *response tokens only*: prompt and padding positions
carry whatever the model happened to produce there (possibly huge or garbage logits), so
they are removed with `torch.where` before any arithmetic, never by multiplying with the
mask (`inf * 0` is `nan`, and even a finite huge value squared can overflow). A masked
position therefore never influences a result, neither its value nor its gradient.

With `group` given, sums and counts are all-reduced over that process group before the
division, so a data-parallel run whitens advantages with the statistics of the *whole*
batch and gets the same numbers for any DP size. Such group reductions are not
differentiable (they serve statistics of detached tensors, such as advantage whitening);
passing a tensor that requires grad together with a group is an error.

The response layout: `mask_bt` is 1 on response tokens. A *response* is a maximal run of
consecutive 1s in a row, additionally cut wherever the optional `segment_ids_bt` changes
between two adjacent tokens. Right-padded batches hold one run per row; packed rows hold
several responses, separated by prompt/padding tokens (mask 0) or, when two responses
touch, by a change of segment id.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor


def _as_bool(mask: Tensor) -> Tensor:
    return mask if mask.dtype == torch.bool else mask != 0


def _check_shapes(values: Tensor, mask: Tensor) -> None:
    if values.shape != mask.shape:
        raise ValueError(
            f"values and mask must have the same shape, got {tuple(values.shape)} and "
            f"{tuple(mask.shape)}"
        )


def _all_reduce_sum(t: Tensor, group: dist.ProcessGroup | None) -> Tensor:
    """Sum `t` over `group` (a no-op without one); refuses tensors that need a gradient."""
    if group is None:
        return t
    if torch.is_grad_enabled() and t.requires_grad:
        raise ValueError(
            "statistics reduced over a process group are not differentiable; pass "
            "values.detach() (or call under torch.no_grad()) when giving group="
        )
    total = t.clone()
    dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
    return total


def masked_sum(
    values: Tensor,
    mask: Tensor,
    dim: int | None = None,
    group: dist.ProcessGroup | None = None,
) -> Tensor:
    """Sum of `values` where `mask` is set: over everything, or along `dim` (then no group)."""
    _check_shapes(values, mask)
    kept = torch.where(_as_bool(mask), values, 0)
    if dim is not None:
        if group is not None:
            raise ValueError("masked_sum: give either dim= (a local reduction) or group=")
        return kept.sum(dim)
    return _all_reduce_sum(kept.sum(), group)


def masked_mean(
    values: Tensor,
    mask: Tensor,
    dim: int | None = None,
    group: dist.ProcessGroup | None = None,
) -> Tensor:
    """sum(values * mask) / sum(mask); an empty selection has mean 0 (the count is clamped to 1).

    With `group`, the sum and the count are all-reduced together before dividing.
    """
    _check_shapes(values, mask)
    m = _as_bool(mask)
    kept = torch.where(m, values, 0)
    if dim is not None:
        if group is not None:
            raise ValueError("masked_mean: give either dim= (a local reduction) or group=")
        return kept.sum(dim) / m.sum(dim).clamp(min=1).to(values.dtype)
    total, count = _all_reduce_sum(torch.stack([kept.sum(), m.sum().to(values.dtype)]), group)
    return total / count.clamp(min=1)


def _mean_var(
    values: Tensor, mask: Tensor, unbiased: bool, group: dist.ProcessGroup | None
) -> tuple[Tensor, Tensor]:
    m = _as_bool(mask)
    mean = masked_mean(values, m, group=group)
    centered = torch.where(m, torch.where(m, values, 0) - mean, 0)
    stats = torch.stack([centered.square().sum(), m.sum().to(values.dtype)])
    sq_sum, count = _all_reduce_sum(stats, group)
    denom = count - 1 if unbiased else count
    return mean, sq_sum / denom.clamp(min=1)


def masked_var(
    values: Tensor,
    mask: Tensor,
    unbiased: bool = True,
    group: dist.ProcessGroup | None = None,
) -> Tensor:
    """Variance sum((x - mean)^2) / (n - 1) over masked elements (`/ n` if not `unbiased`).

    The mean is the (group-wide) masked mean; the denominator is clamped to 1, so fewer
    than two elements (one for the biased form) give variance 0.
    """
    _check_shapes(values, mask)
    return _mean_var(values, mask, unbiased, group)[1]


def masked_whiten(
    values: Tensor,
    mask: Tensor,
    shift_mean: bool = True,
    unbiased: bool = True,
    eps: float = 1e-8,
    group: dist.ProcessGroup | None = None,
) -> Tensor:
    """(x - mean) / sqrt(var + eps) on masked elements, 0 elsewhere.

    `mean` and `var` are `masked_mean` and `masked_var(unbiased)` (over `group` if given).
    With `shift_mean=False` the mean is added back: only the scale is normalised.
    """
    _check_shapes(values, mask)
    m = _as_bool(mask)
    mean, var = _mean_var(values, m, unbiased, group)
    whitened = (torch.where(m, values, 0) - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(m, whitened, 0)


def _same_segment_as_next(segment_ids_bt: Tensor | None, like: Tensor) -> Tensor:
    """[B, T-1]: token t and t+1 belong to the same segment (always true without ids)."""
    if segment_ids_bt is None:
        return torch.ones_like(like[:, 1:])
    if segment_ids_bt.shape != like.shape:
        raise ValueError(
            f"segment_ids_bt must have the mask's shape {tuple(like.shape)}, got "
            f"{tuple(segment_ids_bt.shape)}"
        )
    return segment_ids_bt[:, 1:] == segment_ids_bt[:, :-1]


def response_starts(mask_bt: Tensor, segment_ids_bt: Tensor | None = None) -> Tensor:
    """Bool [B, T]: the first token of each response (see the module docstring)."""
    m = _as_bool(mask_bt)
    joined = m[:, :-1] & m[:, 1:] & _same_segment_as_next(segment_ids_bt, m)
    continues_prev = torch.cat([torch.zeros_like(m[:, :1]), joined], dim=1)
    return m & ~continues_prev


def response_ends(mask_bt: Tensor, segment_ids_bt: Tensor | None = None) -> Tensor:
    """Bool [B, T]: the last token of each response (see the module docstring)."""
    m = _as_bool(mask_bt)
    joined = m[:, :-1] & m[:, 1:] & _same_segment_as_next(segment_ids_bt, m)
    continues_next = torch.cat([joined, torch.zeros_like(m[:, :1])], dim=1)
    return m & ~continues_next


def response_ids(mask_bt: Tensor, segment_ids_bt: Tensor | None = None) -> Tensor:
    """Long [B, T]: index of the response each token belongs to, -1 outside the mask.

    Responses are numbered 0, 1, ... in row-major order of their first token, so the
    number of responses is `response_ids(...).max() + 1`.
    """
    m = _as_bool(mask_bt)
    starts = response_starts(m, segment_ids_bt)
    ids = starts.flatten().long().cumsum(0).view_as(m) - 1
    return torch.where(m, ids, -1)
