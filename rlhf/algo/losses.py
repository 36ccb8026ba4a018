"""PPO losses and their aggregation, normalised so that batching never changes the result.

A mini-batch is processed as micro-batches (gradient accumulation) on several
data-parallel ranks. If each micro-batch averaged over its *own* tokens, the update would
depend on how the mini-batch happened to be cut. Instead every micro-batch divides its
*sum* by a count of the whole mini-batch (`global_num_tokens`, `global_num_seqs`, from
`global_batch_counts`), so summing the micro-batch losses (and the DP gradients) gives
exactly the loss (and gradient) of the whole mini-batch. Without global counts the local
ones are used: the tensor given is then the whole batch.

`loss_agg_mode` (response tokens only; a "sequence" is a response as defined in
`rlhf.algo.stats`, i.e. a non-empty row of a right-padded batch; N_tok, N_seq are the
global token and sequence counts, L = `norm_length`):
- `token-mean`:              sum_t loss_t / N_tok
- `seq-mean-token-sum`:      sum_s (sum_{t in s} loss_t) / N_seq
- `seq-mean-token-mean`:     sum_s (mean_{t in s} loss_t) / N_seq
- `seq-mean-token-sum-norm`: sum_t loss_t / (N_seq * L)   (Dr. GRPO: a fixed horizon L,
  normally the maximum response length, instead of each sequence's own length)

The per-token metrics (clip fractions, ppo_kl) are normalised by N_tok the same way, so
they too sum over micro-batches to the mini-batch value. All metrics are detached.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from rlhf.algo.kl import kl_penalty
from rlhf.algo.stats import _as_bool, response_ids, response_starts
from rlhf.config.choices import LOSS_AGG_MODES

# exp() of a log-ratio beyond +-20 is irrelevant to a clipped objective but can overflow.
_LOG_RATIO_CLAMP = 20.0


@dataclass(frozen=True)
class BatchCounts:
    """Response tokens and sequences of a whole mini-batch (all micro-batches, all ranks)."""

    num_tokens: int
    num_seqs: int


def global_batch_counts(
    masks_bt: Sequence[Tensor],
    group: dist.ProcessGroup | None = None,
    segment_ids_bt: Sequence[Tensor | None] | None = None,
) -> BatchCounts:
    """Counts over the micro-batch masks of this rank, summed over `group` if given."""
    segs = list(segment_ids_bt) if segment_ids_bt is not None else [None] * len(masks_bt)
    if len(segs) != len(masks_bt):
        raise ValueError(f"got {len(segs)} segment_ids_bt for {len(masks_bt)} masks")
    device = masks_bt[0].device if masks_bt else torch.device("cpu")
    counts = torch.zeros(2, dtype=torch.int64, device=device)
    for mask, seg in zip(masks_bt, segs):
        m = _as_bool(mask)
        counts[0] += m.sum()
        counts[1] += response_starts(m, seg).sum()
    if group is not None:
        dist.all_reduce(counts, op=dist.ReduceOp.SUM, group=group)
    return BatchCounts(num_tokens=int(counts[0]), num_seqs=int(counts[1]))


def _denominator(count: int | Tensor, like: Tensor) -> Tensor:
    return torch.as_tensor(count, dtype=like.dtype, device=like.device).clamp(min=1)


def aggregate_loss(
    loss_bt: Tensor,
    mask_bt: Tensor,
    mode: str,
    global_num_tokens: int | None = None,
    global_num_seqs: int | None = None,
    norm_length: int | None = None,
    segment_ids_bt: Tensor | None = None,
) -> Tensor:
    """Reduce a per-token loss to a scalar by `mode` (formulas in the module docstring).

    A zero count divides by 1 (the sum is then 0). `norm_length` defaults to this tensor's
    width only for whole-batch use; with global counts it must be given, so that every
    micro-batch divides by the same constant.
    """
    if mode not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss_agg_mode {mode!r}: use one of {LOSS_AGG_MODES}")
    m = _as_bool(mask_bt)
    total = torch.where(m, loss_bt, 0).sum()
    if mode == "token-mean":
        n_tok = m.sum() if global_num_tokens is None else global_num_tokens
        return total / _denominator(n_tok, total)
    n_seq: int | Tensor = (
        response_starts(m, segment_ids_bt).sum() if global_num_seqs is None else global_num_seqs
    )
    if mode == "seq-mean-token-sum":
        return total / _denominator(n_seq, total)
    if mode == "seq-mean-token-mean":
        return _sum_of_seq_means(loss_bt, m, total, segment_ids_bt) / _denominator(n_seq, total)
    if norm_length is None:
        if global_num_tokens is not None or global_num_seqs is not None:
            raise ValueError(
                "loss_agg_mode 'seq-mean-token-sum-norm' with global counts needs norm_length "
                "(e.g. data.max_response_length), the same for every micro-batch"
            )
        norm_length = loss_bt.shape[-1]
    if norm_length <= 0:
        raise ValueError(f"norm_length must be > 0, got {norm_length}")
    return total / (_denominator(n_seq, total) * norm_length)


def _sum_of_seq_means(
    loss_bt: Tensor, m: Tensor, total: Tensor, segment_ids_bt: Tensor | None
) -> Tensor:
    ids = response_ids(m, segment_ids_bt)[m]
    if not ids.numel():
        return total  # 0, but attached to the graph: an empty micro-batch can still backward
    n = int(ids.max()) + 1
    sums = torch.zeros(n, dtype=loss_bt.dtype, device=loss_bt.device).index_add(0, ids, loss_bt[m])
    return (sums / torch.bincount(ids, minlength=n).to(loss_bt.dtype)).sum()


def _token_fraction(
    values_bt: Tensor, m: Tensor, global_num_tokens: int | None, dtype: torch.dtype
) -> Tensor:
    """Detached sum over response tokens / N_tok (summable over micro-batches)."""
    values = torch.where(m, values_bt.detach().to(dtype), 0)
    n_tok = m.sum() if global_num_tokens is None else global_num_tokens
    return values.sum() / _denominator(n_tok, values)


def clip_range(
    clip_ratio: float, clip_ratio_low: float | None, clip_ratio_high: float | None
) -> tuple[float, float]:
    """(eps_low, eps_high): `clip_ratio_low` / `clip_ratio_high`, each `clip_ratio` when unset
    (verl's defaults; DAPO's clip-higher sets the high one)."""
    low = clip_ratio if clip_ratio_low is None else clip_ratio_low
    high = clip_ratio if clip_ratio_high is None else clip_ratio_high
    return low, high


def _check_clip_range(low: float, high: float) -> None:
    if not (0.0 <= low < 1.0 and high >= 0.0):
        raise ValueError(
            f"clip_ratio_low must be in [0, 1) and clip_ratio_high >= 0, got {low}, {high}"
        )


@dataclass(frozen=True)
class PolicyLossOutput:
    """Clipped-surrogate loss (differentiable) and detached per-token metrics."""

    loss: Tensor
    pg_clipfrac: Tensor
    pg_clipfrac_lower: Tensor
    ppo_kl: Tensor


def policy_loss(
    logp_bt: Tensor,
    old_logp_bt: Tensor,
    advantages_bt: Tensor,
    mask_bt: Tensor,
    clip_ratio: float = 0.2,
    clip_ratio_low: float | None = None,
    clip_ratio_high: float | None = None,
    clip_ratio_c: float | None = 3.0,
    loss_agg_mode: str = "token-mean",
    *,
    global_num_tokens: int | None = None,
    global_num_seqs: int | None = None,
    norm_length: int | None = None,
    segment_ids_bt: Tensor | None = None,
    weights_bt: Tensor | None = None,
) -> PolicyLossOutput:
    """PPO clipped surrogate with asymmetric and dual clipping, aggregated by `loss_agg_mode`.

    With r_t = exp(clamp(logp_t - old_logp_t, -20, 20)), eps_low/high defaulting to
    `clip_ratio`:
        pg_t = max(-A_t * r_t, -A_t * clip(r_t, 1 - eps_low, 1 + eps_high))
        pg_t = min(pg_t, -A_t * clip_ratio_c)   only where A_t < 0 (dual clip, Ye et al.
                                                2020; disabled with clip_ratio_c=None)
    pg_clipfrac: tokens where the clipped branch is strictly larger; pg_clipfrac_lower:
    tokens where the dual clip is active; ppo_kl: sum(old_logp - logp) (k1); all / N_tok.
    `weights_bt` (detached, e.g. truncated importance weights) multiplies pg_t.
    """
    low, high = clip_range(clip_ratio, clip_ratio_low, clip_ratio_high)
    _check_clip_range(low, high)
    if clip_ratio_c is not None and clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c must be > 1 (or None to disable), got {clip_ratio_c}")
    m = _as_bool(mask_bt)
    logp, old_logp, adv = (torch.where(m, t, 0) for t in (logp_bt, old_logp_bt, advantages_bt))
    log_ratio = (logp - old_logp).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    pg_unclipped = -adv * ratio
    pg_clipped = -adv * ratio.clamp(1.0 - low, 1.0 + high)
    pg_bt = torch.maximum(pg_unclipped, pg_clipped)
    dual_bt = torch.zeros_like(m)
    if clip_ratio_c is not None:
        pg_dual = -adv * clip_ratio_c
        dual_bt = (adv < 0) & (pg_bt > pg_dual)
        pg_bt = torch.where(dual_bt, pg_dual, pg_bt)
    if weights_bt is not None:
        pg_bt = pg_bt * weights_bt.detach()
    loss = aggregate_loss(
        pg_bt, m, loss_agg_mode, global_num_tokens, global_num_seqs, norm_length, segment_ids_bt
    )
    return PolicyLossOutput(
        loss=loss,
        pg_clipfrac=_token_fraction(pg_clipped > pg_unclipped, m, global_num_tokens, loss.dtype),
        pg_clipfrac_lower=_token_fraction(dual_bt, m, global_num_tokens, loss.dtype),
        ppo_kl=_token_fraction(old_logp - logp, m, global_num_tokens, loss.dtype),
    )


def gspo_policy_loss(
    logp_bt: Tensor,
    old_logp_bt: Tensor,
    advantages_bt: Tensor,
    mask_bt: Tensor,
    clip_ratio_low: float,
    clip_ratio_high: float,
    loss_agg_mode: str = "seq-mean-token-mean",
    *,
    global_num_tokens: int | None = None,
    global_num_seqs: int | None = None,
    norm_length: int | None = None,
    segment_ids_bt: Tensor | None = None,
    weights_bt: Tensor | None = None,
) -> PolicyLossOutput:
    """GSPO (Zheng et al. 2025): the clipped surrogate on a sequence-level ratio.

    s_i = exp(mean_{t in i}(logp_t - old_logp_t)) is the geometric mean of the token ratios
    of response i. Token t carries s_{i,t} = sg[s_i] * pi_t / sg[pi_t]: its value is s_i, its
    gradient s_i * grad(logp_t). Then, as in `policy_loss` without dual clip,
        pg_t = max(-A_t * s_{i,t}, -A_t * clip(s_{i,t}, 1 - low, 1 + high)),
    so whole responses are clipped together; the paper's ranges are ~1e-4 (3e-4, 4e-4).
    pg_clipfrac counts tokens of clipped responses; ppo_kl is the token-level k1 as in PPO;
    `weights_bt` multiplies pg_t as in `policy_loss`.
    """
    _check_clip_range(clip_ratio_low, clip_ratio_high)
    m = _as_bool(mask_bt)
    logp, old_logp, adv = (torch.where(m, t, 0) for t in (logp_bt, old_logp_bt, advantages_bt))
    log_ratio = torch.where(m, logp - old_logp, 0)
    ids = response_ids(m, segment_ids_bt)
    n = int(ids.max()) + 1 if m.any() else 0
    sums = torch.zeros(n, dtype=log_ratio.dtype, device=log_ratio.device)
    sums = sums.index_add(0, ids[m], log_ratio[m].detach())
    lengths = torch.bincount(ids[m], minlength=n).to(log_ratio.dtype).clamp(min=1)
    seq_log_ratio = torch.zeros_like(log_ratio)
    seq_log_ratio[m] = (sums / lengths)[ids[m]]
    log_s = (seq_log_ratio + logp - logp.detach()).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    ratio = torch.exp(log_s)
    pg_unclipped = -adv * ratio
    pg_clipped = -adv * ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    pg_bt = torch.maximum(pg_unclipped, pg_clipped)
    if weights_bt is not None:
        pg_bt = pg_bt * weights_bt.detach()
    loss = aggregate_loss(
        pg_bt, m, loss_agg_mode, global_num_tokens, global_num_seqs, norm_length, segment_ids_bt
    )
    return PolicyLossOutput(
        loss=loss,
        pg_clipfrac=_token_fraction(pg_clipped > pg_unclipped, m, global_num_tokens, loss.dtype),
        pg_clipfrac_lower=_token_fraction(torch.zeros_like(m), m, global_num_tokens, loss.dtype),
        ppo_kl=_token_fraction(old_logp - logp, m, global_num_tokens, loss.dtype),
    )


@dataclass(frozen=True)
class ValueLossOutput:
    """Clipped value loss (differentiable) and the detached fraction of clipped tokens."""

    loss: Tensor
    vf_clipfrac: Tensor


def value_loss(
    values_bt: Tensor,
    old_values_bt: Tensor,
    returns_bt: Tensor,
    mask_bt: Tensor,
    cliprange_value: float | None,
    loss_agg_mode: str = "token-mean",
    *,
    global_num_tokens: int | None = None,
    global_num_seqs: int | None = None,
    norm_length: int | None = None,
    segment_ids_bt: Tensor | None = None,
) -> ValueLossOutput:
    """0.5 * max((V - R)^2, (V_clip - R)^2), V_clip = V_old + clip(V - V_old, -c, c).

    c = `cliprange_value` (None: no clipping, 0.5 * (V - R)^2). vf_clipfrac: tokens where
    the clipped term is strictly larger, / N_tok.
    """
    if cliprange_value is not None and cliprange_value < 0:
        raise ValueError(f"cliprange_value must be >= 0 (or None), got {cliprange_value}")
    m = _as_bool(mask_bt)
    v, v_old, ret = (torch.where(m, t, 0) for t in (values_bt, old_values_bt, returns_bt))
    err_bt = (v - ret).square()
    if cliprange_value is None:
        clipped_err_bt = err_bt
    else:
        v_clip = v_old + (v - v_old).clamp(-cliprange_value, cliprange_value)
        clipped_err_bt = (v_clip - ret).square()
    loss = aggregate_loss(
        0.5 * torch.maximum(err_bt, clipped_err_bt),
        m,
        loss_agg_mode,
        global_num_tokens,
        global_num_seqs,
        norm_length,
        segment_ids_bt,
    )
    clipfrac = _token_fraction(clipped_err_bt > err_bt, m, global_num_tokens, loss.dtype)
    return ValueLossOutput(loss, clipfrac)


def entropy_loss(
    entropy_bt: Tensor,
    mask_bt: Tensor,
    loss_agg_mode: str = "token-mean",
    *,
    global_num_tokens: int | None = None,
    global_num_seqs: int | None = None,
    norm_length: int | None = None,
    segment_ids_bt: Tensor | None = None,
) -> Tensor:
    """Aggregated entropy; the caller adds `-entropy_coeff * entropy_loss(...)` to the loss."""
    return aggregate_loss(
        entropy_bt,
        mask_bt,
        loss_agg_mode,
        global_num_tokens,
        global_num_seqs,
        norm_length,
        segment_ids_bt,
    )


def kl_loss(
    logp_bt: Tensor,
    ref_logp_bt: Tensor,
    mask_bt: Tensor,
    kind: str = "low_var_kl",
    loss_agg_mode: str = "token-mean",
    *,
    global_num_tokens: int | None = None,
    global_num_seqs: int | None = None,
    norm_length: int | None = None,
    segment_ids_bt: Tensor | None = None,
) -> Tensor:
    """Aggregated `kl_penalty(logp, ref_logp, kind)` (`kl_loss_type`; scaled by `kl_loss_coef`
    in the caller)."""
    m = _as_bool(mask_bt)
    kl_bt = kl_penalty(torch.where(m, logp_bt, 0), torch.where(m, ref_logp_bt, 0), kind)
    return aggregate_loss(
        kl_bt, m, loss_agg_mode, global_num_tokens, global_num_seqs, norm_length, segment_ids_bt
    )
