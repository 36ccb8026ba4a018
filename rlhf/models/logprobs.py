"""Per-token log-probabilities and entropy from vocabulary-parallel logits.

With tensor parallelism each rank holds logits for a contiguous slice of the (padded)
vocabulary. Gathering the full vocabulary would cost `b x s x V` per rank; instead the
softmax normaliser, the target logit and the expected logit are assembled from per-rank
partial sums with all-reduces over the TP group. Works on any leading shape, so packed
(THD) token streams need nothing special. Padding ids beyond the true vocabulary get
probability 0.

Forward (z = logits, m = max over all ranks, p = softmax(z)):

    log Z   = m + log sum_v exp(z_v - m)
    logp(t) = z_t - log Z
    H       = log Z - sum_v p_v z_v

Backward is written out, because each rank only sees its own slice of every sum:

    d logp(t) / d z_v = 1[v = t] - p_v
    d H / d z_v       = p_v (sum_u p_u z_u - z_v)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from rlhf.distributed.context import ParallelContext


def _all_reduce(tensor: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(tensor, op=op, group=group)
    return tensor


class _VocabParallelLogprobEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, vocab_start, vocab_size, group):
        local_vocab = logits.shape[-1]
        ids = torch.arange(vocab_start, vocab_start + local_vocab, device=logits.device)
        padding = ids >= vocab_size
        z = logits.float().masked_fill(padding, float("-inf"))
        max_logit = _all_reduce(z.max(dim=-1).values, group, dist.ReduceOp.MAX)
        shifted = (z - max_logit.unsqueeze(-1)).masked_fill(padding, 0.0)
        exp = torch.exp(z - max_logit.unsqueeze(-1))  # exactly 0 on padding
        normaliser = _all_reduce(exp.sum(dim=-1), group)
        probs = exp / normaliser.unsqueeze(-1)

        local_target = targets - vocab_start
        in_slice = (local_target >= 0) & (local_target < local_vocab)
        index = local_target.clamp(0, local_vocab - 1).unsqueeze(-1)
        picked = shifted.gather(-1, index).squeeze(-1) * in_slice
        log_normaliser = normaliser.log()
        logprobs = _all_reduce(picked, group) - log_normaliser
        expected = _all_reduce((probs * shifted).sum(dim=-1), group)
        entropy = log_normaliser - expected

        ctx.save_for_backward(probs, shifted, expected, index, in_slice)
        ctx.input_dtype = logits.dtype
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        probs, shifted, expected, index, in_slice = ctx.saved_tensors
        grad = torch.zeros_like(probs)
        if grad_logprobs is not None:
            onehot = torch.zeros_like(probs).scatter_(-1, index, in_slice.unsqueeze(-1).float())
            grad += grad_logprobs.unsqueeze(-1) * (onehot - probs)
        if grad_entropy is not None:
            grad += grad_entropy.unsqueeze(-1) * probs * (expected.unsqueeze(-1) - shifted)
        return grad.to(ctx.input_dtype), None, None, None, None


def vocab_parallel_logprobs_entropy(
    logits_local: torch.Tensor,
    targets: torch.Tensor,
    *,
    vocab_start: int,
    vocab_size: int,
    group=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of `targets` and the entropy of the next-token distribution.

    Args:
        logits_local: [..., V_local] logits of ids [vocab_start, vocab_start + V_local).
        targets: [...] token ids (< vocab_size).
        vocab_start: first vocabulary id held by this rank.
        vocab_size: true vocabulary size; ids >= it are padding.
        group: the tensor-parallel process group (None for a single rank).
    Returns:
        fp32 logprobs [...] and entropy [...], both differentiable w.r.t. `logits_local`.
    """
    return _VocabParallelLogprobEntropy.apply(logits_local, targets, vocab_start, vocab_size, group)


@dataclass(frozen=True)
class VocabShard:
    """This TP rank's slice of the padded vocabulary, ids [start, start + V_local), and the
    true vocabulary size (ids at or beyond it are padding)."""

    start: int
    vocab_size: int
    group: ProcessGroup | None = None

    @classmethod
    def of(cls, ctx: ParallelContext, padded_vocab_size: int, vocab_size: int) -> VocabShard:
        return cls(ctx.tp_rank * (padded_vocab_size // ctx.tp_size), vocab_size, ctx.tp_group)

    def logprobs_entropy(
        self, logits_local: torch.Tensor, targets: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`vocab_parallel_logprobs_entropy` of `targets` under this rank's logits."""
        return vocab_parallel_logprobs_entropy(
            logits_local,
            targets,
            vocab_start=self.start,
            vocab_size=self.vocab_size,
            group=self.group,
        )
