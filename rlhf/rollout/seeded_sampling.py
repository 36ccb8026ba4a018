"""Per-request seeded sampling on SGLang's CPU engine, installed by `rlhf.rollout.sglang_plugin`.

SGLang 0.5.23 honours a request's `sampling_seed` only with `--enable-deterministic-inference`
(`SamplingBatchInfo.from_schedule_batch` builds the seed tensor only then), which refuses the
CPU attention backends; without it every token is drawn from the process-wide generator, so
a sampled run cannot be replayed. Its seeded sampler is the Gumbel-max trick with hashed
noise: token t of a request is `argmax(logprob + g)`, g = -log(-log u), u the MurmurHash3
(x86, 32-bit) of (seed, position, token id) over 2^32 - 1, an exact sample of the
distribution that depends on nothing but those three numbers. Here, on the CPU engine:

- `add_request_seeds` (SGLang's `adjusted_from_schedule_batch` override point) gives every
  batch a [B, 2] tensor (seed, seeded): the request's `sampling_seed`, or 0 and 0 for a
  request without one. It is always set, so that SGLang's merge and filter of running
  batches (which keep the tensor only when both sides have one) keep it row for row;
- `seeded_argmax` replaces SGLang's `multinomial_with_seed` (a `torch.compile`d function
  whose hash is a `sgl_kernel` op the CPU build lacks): the same formula in eager torch, the
  hash in `murmur_hash32`, computed for the seeded rows only; rows without a seed get
  uniform noise from the generator, which is the same distribution (hashing them too, to
  throw the result away, was 0.24 s of the sampler's 0.30 s for a decode step of 32
  unseeded requests at a 152k-token vocabulary);
- `seeded_top_k_top_p` wraps SGLang's top-k / top-p sampler: with seeds it masks the
  probabilities as SGLang does, then samples with the noise of the token ids, not of the
  ranks in the sorted order (so a request's draw does not depend on whether another request
  of its batch asked for top-k or greedy decoding); min-p needs no renormalisation for the
  Gumbel-max trick and is applied too.

A seeded request's tokens then depend only on its seed and its log-probs; those depend on
the batch only through the float rounding of the batched matrix products (measured in
docs/sglang-seeded-sampling.md).
"""

from __future__ import annotations

import torch

MASK32 = 0xFFFFFFFF
C1, C2 = 0xCC9E2D51, 0x1B873593


def _mix(h: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """One 4-byte block of MurmurHash3_x86_32 (int64 tensors holding uint32 values)."""
    k = (k * C1) & MASK32
    k = ((k << 15) | (k >> 17)) & MASK32
    k = (k * C2) & MASK32
    h = h ^ k
    h = ((h << 13) | (h >> 19)) & MASK32
    return (h * 5 + 0xE6546B64) & MASK32


def murmur_hash32(seed: torch.Tensor, positions: torch.Tensor, columns: torch.Tensor):
    """[n, m] int64 in [0, 2^32): MurmurHash3_x86_32 (hash seed 0) of the 16 bytes
    (seed low, seed high, position, column), little-endian words, for n (seed, position)
    rows and m columns: the value SGLang's `murmur_hash32` kernels give."""
    s = seed.to(torch.int64)
    p = positions.to(torch.int64)
    h = _mix(torch.zeros_like(s), s & MASK32)
    h = _mix(h, (s >> 32) & MASK32)
    h = _mix(h, p & MASK32)
    h = _mix(h[:, None], (columns.to(torch.int64) & MASK32)[None, :])
    h = h ^ 16  # the key's length in bytes
    h = ((h ^ (h >> 16)) * 0x85EBCA6B) & MASK32
    h = ((h ^ (h >> 13)) * 0xC2B2AE35) & MASK32
    return h ^ (h >> 16)


def split_seeds(seed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(seeds [n], seeded [n] bool or None): the [n, 2] tensor of `add_request_seeds`, or
    SGLang's own [n] one (every row seeded)."""
    if seed.dim() == 2:
        return seed[:, 0], seed[:, 1].bool()
    return seed, None


def seeded_argmax(logprobs: torch.Tensor, seed: torch.Tensor, positions: torch.Tensor):
    """[n, 1] sampled columns of [n, m] `logprobs` (SGLang's `multinomial_with_seed`). The
    hash is computed for the seeded rows only: the others' noise comes from the generator."""
    seeds, seeded = split_seeds(seed)
    columns = torch.arange(logprobs.shape[1], device=logprobs.device)
    if seeded is None or bool(seeded.all()):
        u = murmur_hash32(seeds, positions, columns).to(torch.float64) / MASK32
    else:
        u = torch.rand(logprobs.shape, dtype=torch.float64, device=logprobs.device)
        rows = seeded.nonzero().flatten()
        if len(rows):
            u[rows] = murmur_hash32(seeds[rows], positions[rows], columns).double() / MASK32
    # Gumbel noise -log(-log u), in float64 and clamped at both ends as SGLang does
    u.log_().clamp_(min=torch.finfo(u.dtype).min, max=-(2.0**-32)).neg_()
    u.log_().neg_()
    return torch.argmax(u.add_(logprobs.to(torch.float64)), dim=1, keepdim=True)


def seeded_top_k_top_p(original, probs, top_ks, top_ps, min_ps, need_min_p, seed, positions, **kw):
    """SGLang's `top_k_top_p_min_p_sampling_from_probs_torch`, sampling seeded batches with
    the noise of the token ids (unseeded ones, and mask captures, go to `original`)."""
    if seed is None or kw.get("return_filtered_probs"):
        return original(probs, top_ks, top_ps, min_ps, need_min_p, seed, positions, **kw)
    probs_sort, probs_idx = probs.sort(dim=-1, descending=True)
    probs_sum = torch.cumsum(probs_sort, dim=-1)
    ranks = torch.arange(probs_sort.shape[-1], device=probs.device)[None, :]
    probs_sort[ranks >= top_ks[:, None]] = 0.0
    probs_sort[(probs_sum - probs_sort) > top_ps[:, None]] = 0.0
    if need_min_p:
        probs_sort[probs_sort < (probs_sort[:, 0] * min_ps)[:, None]] = 0.0
    kept = torch.zeros_like(probs).scatter_(1, probs_idx, probs_sort)  # in token-id order
    return seeded_argmax(kept.to(torch.float64).log_(), seed, positions).view(-1).to(torch.int32)


def add_request_seeds(self, batch, vocab_size: int) -> None:
    """SGLang's `SamplingBatchInfo.adjusted_from_schedule_batch`: the [B, 2] (seed, seeded)
    tensor of the batch's requests (left alone when deterministic inference built one)."""
    if self.sampling_seed is not None:
        return
    seeds = [r.sampling_params.sampling_seed for r in batch.reqs]
    rows = [(0, 0) if s is None else (int(s), 1) for s in seeds]
    self.sampling_seed = torch.tensor(rows, dtype=torch.int64, device=self.device).view(-1, 2)
