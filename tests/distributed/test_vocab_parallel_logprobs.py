"""Vocab-parallel log-probs and entropy at TP2 equal the full-vocabulary computation,
values and gradients, for padded [b, s] and packed [t] token layouts, whole and in token
chunks, at temperature 1 and 0.7, of every token or of some rows only (the others get no
gradient)."""

from __future__ import annotations

import torch

from tests.distributed.workers.vocab_parallel_logprobs import CASES, VOCAB, case
from tests.helpers import run_torchrun


def full_vocab_reference(logits, targets, weights, temperature, rows):
    logits = logits.clone().requires_grad_()
    logp_all = torch.log_softmax(logits[..., :VOCAB] / temperature, dim=-1)
    logp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    if rows is not None:
        logp, entropy = logp.reshape(-1)[rows], entropy.reshape(-1)[rows]
    (weights[0] * logp + weights[1] * entropy).sum().backward()
    return logp.detach(), entropy.detach(), logits.grad


def test_tp2_equals_full_vocabulary(tmp_path):
    out = tmp_path / "tp2.pt"
    run_torchrun("vocab_parallel_logprobs.py", 2, ["--out", str(out)])
    results = torch.load(out)
    for name, (shape, _chunk_tokens, temperature, rows) in CASES.items():
        inputs = case(shape, rows, seed=len(name))
        logp, entropy, grad = full_vocab_reference(*inputs, temperature, rows)
        got = results[name]
        torch.testing.assert_close(got["logp"], logp, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(got["entropy"], entropy, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(got["grad"], grad, rtol=1e-6, atol=1e-6)
        assert torch.all(got["grad"][..., VOCAB:] == 0)  # padding never gets gradient
