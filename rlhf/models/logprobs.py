"""Per-token log-probabilities and entropy from vocabulary-parallel logits, in token chunks.

With tensor parallelism each rank holds logits for a contiguous slice of the (padded)
vocabulary. Gathering the full vocabulary would cost `b x s x V` per rank; instead the
softmax normaliser, the target logit and the expected logit are assembled from per-rank
partial sums with all-reduces over the TP group. Works on any leading shape, so packed
(THD) token streams need nothing special. Padding ids beyond the true vocabulary get
probability 0.

Forward (z = logits / temperature, m = max over all ranks, p = softmax(z)):

    log Z   = m + log sum_v exp(z_v - m)
    logp(t) = z_t - log Z
    H       = log Z - sum_v p_v z_v

Backward is written out, because each rank only sees its own slice of every sum:

    d logp(t) / d z_v = 1[v = t] - p_v
    d H / d z_v       = p_v (sum_u p_u z_u - z_v)

Memory: the T x V' logits are never copied whole. Both passes walk the tokens in chunks of
`chunk_tokens` (default: CHUNK_BYTES of fp32 logits) and hold two fp32 chunk-sized tensors
at a time; the forward keeps, per token, only m, log sum exp(z - m) and the expected logit,
and the backward recomputes each chunk's probabilities from the saved logits and writes
that chunk of the gradient. A training pass therefore holds the logits and their gradient
in the model dtype (4 bytes per logit in bf16) plus two chunks, where computing the fp32
softmax whole held five fp32 copies. `rows` computes only some positions (the trainer's:
those that score a response token): each chunk of them is gathered into its fp32 copy in
pieces (a sixteenth of a chunk in the model dtype on the way), and the other positions get
a zero gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from rlhf.distributed.context import ParallelContext

CHUNK_BYTES = 256 * 2**20  # fp32 logits of one chunk of tokens
GATHER_PIECES = 16  # a chunk of index rows is gathered in this many pieces


def _all_reduce(tensor: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(tensor, op=op, group=group)
    return tensor


def default_chunk_tokens(local_vocab: int) -> int:
    """Tokens per chunk: CHUNK_BYTES of fp32 logits (one rank's vocabulary slice)."""
    return max(1, CHUNK_BYTES // (4 * local_vocab))


@dataclass(frozen=True)
class _Slice:
    """What every chunk needs to know about this rank's vocabulary slice."""

    start: int
    real: int  # ids [start, start + real) are true vocabulary, the rest of the slice padding
    temperature: float
    group: ProcessGroup | None

    def scaled(self, flat: torch.Tensor, rows: slice | torch.Tensor) -> torch.Tensor:
        """A fresh fp32 copy of `flat[rows]` / temperature, -inf on the padding ids. Index
        rows are gathered in GATHER_PIECES pieces: no copy of the whole chunk in the model
        dtype on the way."""
        if isinstance(rows, slice):
            z = flat[rows].to(torch.float32, copy=True)
        else:
            z = torch.empty((rows.numel(), flat.shape[-1]), device=flat.device)
            step = max(1, -(-rows.numel() // GATHER_PIECES))
            for begin in range(0, rows.numel(), step):
                z[begin : begin + step] = flat[rows[begin : begin + step]]
        if self.temperature != 1.0:
            z.div_(self.temperature)
        z[:, self.real :] = float("-inf")
        return z

    def picked(self, z: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """z at each target held by this rank, 0 where another rank holds it."""
        local = targets - self.start
        held = (local >= 0) & (local < z.shape[-1])
        index = local.clamp(0, z.shape[-1] - 1)[:, None]
        return z.gather(-1, index)[:, 0] * held


def _forward_chunk(z, targets, where: _Slice):
    """(max, log sum exp(z - max), log-prob of the target, expected z - max) of a chunk's
    scaled logits `z` (`_Slice.scaled`, overwritten)."""
    max_z = _all_reduce(z.max(dim=-1).values, where.group, dist.ReduceOp.MAX)
    z.sub_(max_z[:, None])
    exp = torch.exp(z)  # exactly 0 on padding
    z[:, where.real :] = 0.0  # so that 0 * z stays 0 there
    normaliser = exp.sum(dim=-1)
    weighted = exp.mul_(z).sum(dim=-1)  # sum_v exp(z_v - m) (z_v - m)
    sums = torch.stack([normaliser, where.picked(z, targets), weighted])
    normaliser, target, weighted = _all_reduce(sums, where.group)
    log_normaliser = normaliser.log()
    return max_z, log_normaliser, target - log_normaliser, weighted / normaliser


def _backward_chunk(z, targets, saved, grad_logp, grad_entropy, where: _Slice):
    """d(grad_logp . logp + grad_entropy . H) / d logits of a chunk, in fp32, written over
    its scaled logits `z` (`_Slice.scaled`)."""
    max_z, log_normaliser, expected = saved
    z.sub_(max_z[:, None])
    probs = z.sub(log_normaliser[:, None]).exp_()
    z[:, where.real :] = 0.0
    # grad = p * (g_H * (E - z) - g_logp) + g_logp * onehot(target), over temperature
    z.neg_().add_(expected[:, None]).mul_(grad_entropy[:, None]).sub_(grad_logp[:, None])
    z.mul_(probs)
    local = targets - where.start
    held = (local >= 0) & (local < z.shape[-1])
    index = local.clamp(0, z.shape[-1] - 1)[:, None]  # no host sync (nonzero would)
    z.scatter_add_(-1, index, (grad_logp * held)[:, None])
    if where.temperature != 1.0:
        z.div_(where.temperature)
    return z


def _spans(rows: torch.Tensor | None, count: int, chunk_tokens: int):
    """(this chunk's rows of the flat logits, its slice of the computed tokens), in order:
    consecutive slices of all `count` rows, or of the row indices `rows`."""
    for begin in range(0, count, chunk_tokens):
        done = slice(begin, begin + chunk_tokens)
        yield (done if rows is None else rows[done]), done


def _put(grad: torch.Tensor, rows: slice | torch.Tensor, chunk: torch.Tensor) -> None:
    """Write a chunk's fp32 gradient into the model-dtype `grad` (an index copy wants one
    dtype; a slice casts as it copies)."""
    grad[rows] = chunk if isinstance(rows, slice) else chunk.to(grad.dtype)


class _VocabParallelLogprobEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, rows, where: _Slice, chunk_tokens: int):
        flat = logits.reshape(-1, logits.shape[-1])
        flat_targets = targets.reshape(-1) if rows is None else targets.reshape(-1)[rows]
        stats = [torch.empty(flat_targets.shape[0], device=logits.device) for _ in range(4)]
        for source, done in _spans(rows, flat_targets.shape[0], chunk_tokens):
            found = _forward_chunk(where.scaled(flat, source), flat_targets[done], where)
            for stat, value in zip(stats, found, strict=True):
                stat[done] = value
        max_z, log_normaliser, logprobs, expected = stats
        ctx.save_for_backward(logits, flat_targets, rows, max_z, log_normaliser, expected)
        ctx.where, ctx.chunk_tokens = where, chunk_tokens
        entropy = log_normaliser - expected
        shape = targets.shape if rows is None else rows.shape
        return logprobs.view(shape), entropy.view(shape)

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        logits, flat_targets, rows, *saved = ctx.saved_tensors
        flat = logits.reshape(-1, logits.shape[-1])
        count = flat_targets.shape[0]
        zeros = torch.zeros(count, device=logits.device)
        grad_logp = zeros if grad_logprobs is None else grad_logprobs.reshape(-1).float()
        grad_h = zeros if grad_entropy is None else grad_entropy.reshape(-1).float()
        # rows not computed get no gradient
        grad = torch.empty_like(flat) if rows is None else torch.zeros_like(flat)
        for source, done in _spans(rows, count, ctx.chunk_tokens):
            upstream_args = ([s[done] for s in saved], grad_logp[done], grad_h[done], ctx.where)
            z = ctx.where.scaled(flat, source)
            _put(grad, source, _backward_chunk(z, flat_targets[done], *upstream_args))
            del z  # (the next chunk's tensors must not meet this one's)
        return grad.view(logits.shape), None, None, None, None


def vocab_parallel_logprobs_entropy(
    logits_local: torch.Tensor,
    targets: torch.Tensor,
    *,
    vocab_start: int,
    vocab_size: int,
    group=None,
    temperature: float = 1.0,
    chunk_tokens: int | None = None,
    rows: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of `targets` and the entropy of the next-token distribution at `temperature`.

    Args:
        logits_local: [..., V_local] logits of ids [vocab_start, vocab_start + V_local), in
            the model dtype (never copied whole).
        targets: [...] token ids (< vocab_size).
        vocab_start: first vocabulary id held by this rank.
        vocab_size: true vocabulary size; ids >= it are padding.
        group: the tensor-parallel process group (None for a single rank).
        temperature: the logits are divided by it (the rollout's sampling temperature).
        chunk_tokens: tokens per chunk; the same on every rank of `group` (default from
            CHUNK_BYTES and V_local, which TP ranks share).
        rows: only these positions of the flattened leading dimensions (a 1-D index, the
            same on every rank of `group`; the others are never read and get no gradient).
    Returns:
        fp32 logprobs [...] and entropy [...] (`rows`: [len(rows)] each), both
        differentiable w.r.t. `logits_local`.
    """
    local_vocab = logits_local.shape[-1]
    real = min(local_vocab, max(0, vocab_size - vocab_start))
    where = _Slice(vocab_start, real, temperature, group)
    chunk = chunk_tokens or default_chunk_tokens(local_vocab)
    return _VocabParallelLogprobEntropy.apply(logits_local, targets, rows, where, chunk)


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
        self,
        logits_local: torch.Tensor,
        targets: torch.Tensor,
        temperature: float = 1.0,
        rows: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`vocab_parallel_logprobs_entropy` of `targets` under this rank's logits."""
        return vocab_parallel_logprobs_entropy(
            logits_local,
            targets,
            vocab_start=self.start,
            vocab_size=self.vocab_size,
            group=self.group,
            temperature=temperature,
            rows=rows,
        )
