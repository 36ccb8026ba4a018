"""Log-probability parity between the trainer's actor and an SGLang server after a sync.

A fixed probe sequence is scored twice: by SGLang (input-token log-probs of a prefill) and
by the Megatron actor (vocab-parallel log-probs on the last pipeline stage). The largest
absolute difference is `rollout/logprob_diff_max`; above the configured threshold the
step fails loudly instead of training on mismatched rollouts.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from rlhf.models.families import ModelArch
from rlhf.models.forward import forward_logits
from rlhf.models.logprobs import vocab_parallel_logprobs_entropy
from rlhf.weight_sync.gather import SyncTopology
from rlhf.weight_sync.http import post


class LogprobMismatchError(RuntimeError):
    """SGLang's and the trainer's log-probs of the probe differ by more than allowed."""


def probe_tokens(vocab_size: int, length: int = 32, seed: int = 1234) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (length,), generator=gen).tolist()


def sglang_prompt_logprobs(url: str, tokens: list[int]) -> torch.Tensor:
    """log p(token_t | tokens_<t) for t >= 1, from one prefill on the server."""
    request = {
        "input_ids": tokens,
        "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
        "return_logprob": True,
        "logprob_start_len": 0,
    }
    meta = post(url, "generate", request)["meta_info"]
    values = [lp for lp, _token, *_ in meta["input_token_logprobs"]][1:]
    return torch.tensor(values, dtype=torch.float32)


@torch.no_grad()
def actor_prompt_logprobs(
    model, arch: ModelArch, topo: SyncTopology, tokens: list[int]
) -> torch.Tensor:
    """The same log-probs from the Megatron actor, available on every rank."""
    ids = torch.tensor([tokens])
    logits = forward_logits(model, ids, sp=topo.sp)
    result = torch.zeros(len(tokens) - 1)
    probe_replica = topo.in_sync_replica if topo.in_probe_replica is None else topo.in_probe_replica
    if logits is not None and probe_replica:
        local_vocab = logits.shape[-1]
        logp, _ = vocab_parallel_logprobs_entropy(
            logits[0, :-1],
            ids[0, 1:],
            vocab_start=topo.placement.tp_rank * local_vocab,
            vocab_size=arch.vocab_size,
            group=topo.tp_group,
        )
        if topo.is_prober:
            result = logp.float()
    if dist.is_initialized():
        dist.all_reduce(result)  # exactly one rank contributed
    return result


def logprob_diff_max(
    model, arch: ModelArch, topo: SyncTopology, url: str, tokens: list[int]
) -> float:
    """Max |SGLang - actor| over the probe (every rank calls; each sender queries its `url`)."""
    actor = actor_prompt_logprobs(model, arch, topo, tokens)
    diff = torch.zeros(1)
    if topo.is_sender:
        diff[0] = (sglang_prompt_logprobs(url, tokens) - actor).abs().max()
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
