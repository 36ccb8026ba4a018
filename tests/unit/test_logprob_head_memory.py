"""The chunked log-prob / entropy head (`rlhf.models.logprobs`) on one rank: bf16 logits give
the log-softmax of their fp32 values, and a training pass holds, beyond the logits, only
their gradient in bf16 and two fp32 chunks (torch.profiler's memory timeline,
`rlhf.memory.measure`), never a whole fp32 copy of the logits; of some rows only (the
response tokens), gathered in pieces: a sixteenth of a bf16 chunk more."""

from __future__ import annotations

import torch

from rlhf.memory.measure import peak_bytes_during
from rlhf.models.logprobs import vocab_parallel_logprobs_entropy

TOKENS, VOCAB, PADDED, CHUNK = 1024, 4000, 4096, 32


def bf16_case():
    gen = torch.Generator().manual_seed(3)
    logits = (torch.randn(TOKENS, PADDED, generator=gen) * 3).to(torch.bfloat16)
    targets = torch.randint(0, VOCAB, (TOKENS,), generator=gen)
    return logits, targets


def head(logits, targets, rows=None):
    return vocab_parallel_logprobs_entropy(
        logits,
        targets,
        vocab_start=0,
        vocab_size=VOCAB,
        temperature=0.8,
        chunk_tokens=CHUNK,
        rows=rows,
    )


def test_bf16_logits_give_the_fp64_log_softmax_of_their_values():
    logits, targets = bf16_case()
    logp, entropy = head(logits, targets)
    reference = torch.log_softmax(logits[:, :VOCAB].double() / 0.8, dim=-1)
    expected_logp = reference.gather(-1, targets[:, None])[:, 0]
    expected_entropy = -(reference.exp() * reference).sum(-1)
    assert logp.dtype == entropy.dtype == torch.float32
    torch.testing.assert_close(logp.double(), expected_logp, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(entropy.double(), expected_entropy, rtol=1e-6, atol=1e-5)


def test_training_pass_holds_the_gradient_and_two_fp32_chunks():
    logits, targets = bf16_case()
    weights = torch.randn(2, TOKENS, generator=torch.Generator().manual_seed(4))

    def train():
        leaf = logits.detach().requires_grad_()
        logp, entropy = head(leaf, targets)
        (weights[0] * logp + weights[1] * entropy).sum().backward()
        return leaf.grad

    train()
    grad, peak = peak_bytes_during(train, torch.device("cpu"))
    assert grad.dtype == torch.bfloat16 and grad[:, :VOCAB].abs().max() > 0
    assert torch.all(grad[:, VOCAB:] == 0)
    gradient, chunks, per_token = TOKENS * PADDED * 2, 2 * CHUNK * PADDED * 4, 64 * TOKENS
    assert peak <= gradient + chunks + per_token, peak / (TOKENS * PADDED)
    bytes_per_logit = (logits.numel() * logits.element_size() + peak) / logits.numel()
    assert bytes_per_logit <= 6, bytes_per_logit


def test_training_pass_over_some_rows_holds_no_bf16_chunk_more():
    logits, targets = bf16_case()
    rows = torch.arange(1, TOKENS, 2)  # every other token, as a response's tokens are
    weights = torch.randn(2, len(rows), generator=torch.Generator().manual_seed(4))

    def train():
        leaf = logits.detach().requires_grad_()
        logp, entropy = head(leaf, targets, rows)
        (weights[0] * logp + weights[1] * entropy).sum().backward()
        return leaf.grad

    train()
    grad, peak = peak_bytes_during(train, torch.device("cpu"))
    assert torch.all(grad[0::2] == 0) and grad[1::2, :VOCAB].abs().max() > 0
    gradient, chunks, per_token = TOKENS * PADDED * 2, 2 * CHUNK * PADDED * 4, 64 * TOKENS
    piece = CHUNK * PADDED * 2 // 16
    assert peak <= gradient + chunks + piece + per_token, peak / (TOKENS * PADDED)
