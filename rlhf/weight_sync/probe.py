"""Log-probability parity between the trainer's actor and the SGLang servers after a sync.

A fixed probe sequence is scored twice: by each server (input-token log-probs of one
prefill) and by the actor, through the same packed forward the trainer trains with (the
trainer computes that side and passes it in). The largest absolute difference is
`rollout/logprob_diff_max`; above the configured threshold the step fails loudly instead of
training on mismatched rollouts.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist


class LogprobMismatchError(RuntimeError):
    """SGLang's and the trainer's log-probs of the probe differ by more than allowed."""


def probe_tokens(
    vocab_size: int, length: int = 32, seed: int = 1234, avoid: tuple[int, ...] = ()
) -> list[int]:
    """Random token ids, none of `avoid` (a vision-language model's image tokens: SGLang
    would look for an image for each)."""
    gen = torch.Generator().manual_seed(seed)
    allowed = torch.tensor([t for t in range(vocab_size) if t not in set(avoid)])
    return allowed[torch.randint(0, len(allowed), (length,), generator=gen)].tolist()


def logprob_diff_max(
    actor_logprobs: torch.Tensor,
    server_logprobs: Callable[[str], list[float]],
    server_urls: list[str],
    is_sender: bool,
    device: torch.device,
) -> float:
    """Max |SGLang - actor| over the probe and `server_urls` (queried by the senders only),
    the same on every rank. `actor_logprobs`: log p(token_t | tokens_<t) for t >= 1;
    `server_logprobs(url)`: the same from a server (`sglang_api.prompt_logprobs` of the
    probe tokens); `device`: where this rank's collectives run."""
    diff = torch.zeros((), dtype=torch.float32)
    if is_sender:
        for url in server_urls:
            sglang = torch.tensor(server_logprobs(url), dtype=torch.float32)
            diff = torch.maximum(diff, (sglang - actor_logprobs.float().cpu()).abs().max())
    diff = diff.to(device)
    if dist.is_initialized():
        dist.all_reduce(diff, op=dist.ReduceOp.MAX)
    return diff.item()


def check_parity(diff: float, threshold: float | None) -> None:
    if threshold is not None and diff > threshold:
        raise LogprobMismatchError(
            f"rollout/logprob_diff_max = {diff:.3e} exceeds "
            f"actor_rollout_ref.rollout.logprob_diff_threshold = {threshold:.1e}: SGLang and the "
            "trainer disagree on the synced weights"
        )
