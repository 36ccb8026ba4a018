"""What the last pipeline stage computes from a micro-batch's output: the PPO-specific part.

Forward heads turn logits into per-response-token log-probs (vocab-parallel, so TP never
gathers the vocabulary) or value outputs into values; loss heads add the PPO policy or
value loss normalised by the global counts of the mini-batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlhf.algo import entropy_loss, policy_loss, value_loss
from rlhf.algo.losses import BatchCounts
from rlhf.config.schema import ActorConfig, CriticConfig
from rlhf.models.logprobs import vocab_parallel_logprobs_entropy
from rlhf.trainer.micro_batch import MicroBatch


@dataclass(frozen=True)
class VocabShard:
    """This TP rank's slice of the (padded) vocabulary and the true vocabulary size."""

    start: int
    vocab_size: int
    group: object | None
    temperature: float = 1.0


def token_logprobs(logits: torch.Tensor, mb: MicroBatch, vocab: VocabShard):
    """[n, R] log-probs of the response tokens and [n, R] entropies (differentiable)."""
    logits = logits.float()
    if vocab.temperature != 1.0:
        logits = logits / vocab.temperature
    logp_t, entropy_t = vocab_parallel_logprobs_entropy(
        logits[0], mb.labels[0], vocab_start=vocab.start, vocab_size=vocab.vocab_size,
        group=vocab.group,
    )  # fmt: skip
    return mb.gather(logp_t[None]), mb.gather(entropy_t[None])


def logprob_head(vocab: VocabShard):
    def head(logits, mb):
        logp, entropy = token_logprobs(logits, mb, vocab)
        return None, {"logprobs": logp.detach(), "entropy": entropy.detach()}

    return head


def value_head():
    def head(values, mb):
        return None, {"values": mb.gather(values[..., 0].float()).detach()}

    return head


def policy_loss_head(
    vocab: VocabShard,
    cfg: ActorConfig,
    step_tensors: dict[str, torch.Tensor],
    counts: BatchCounts,
    norm_length: int,
):
    """PPO clipped surrogate (+ entropy bonus) of one micro-batch; verl's actor/* metrics."""
    agg = {
        "global_num_tokens": counts.num_tokens,
        "global_num_seqs": counts.num_seqs,
        "norm_length": norm_length,
    }

    def head(logits, mb):
        logp, entropy = token_logprobs(logits, mb, vocab)
        out = policy_loss(
            logp,
            mb.select(step_tensors["old_logprobs"]),
            mb.select(step_tensors["advantages"]),
            mb.mask,
            cfg.clip_ratio,
            cfg.clip_ratio_low,
            cfg.clip_ratio_high,
            cfg.clip_ratio_c,
            cfg.loss_agg_mode,
            **agg,
        )
        ent = entropy_loss(entropy, mb.mask, cfg.loss_agg_mode, **agg)
        loss = out.loss - cfg.entropy_coeff * ent if cfg.entropy_coeff else out.loss
        metrics = {
            "actor/pg_loss": out.loss,
            "actor/pg_clipfrac": out.pg_clipfrac,
            "actor/pg_clipfrac_lower": out.pg_clipfrac_lower,
            "actor/ppo_kl": out.ppo_kl,
            "actor/entropy": ent,
        }
        return loss, {k: v.detach() for k, v in metrics.items()}

    return head


def value_loss_head(
    cfg: CriticConfig, step_tensors: dict[str, torch.Tensor], counts: BatchCounts, norm_length: int
):
    """Clipped value loss of one micro-batch; verl's critic/vf_* metrics."""

    def head(values, mb):
        v = mb.gather(values[..., 0].float())
        out = value_loss(
            v,
            mb.select(step_tensors["values"]),
            mb.select(step_tensors["returns"]),
            mb.mask,
            cfg.cliprange_value,
            cfg.loss_agg_mode,
            global_num_tokens=counts.num_tokens,
            global_num_seqs=counts.num_seqs,
            norm_length=norm_length,
        )
        return out.loss, {
            "critic/vf_loss": out.loss.detach(),
            "critic/vf_clipfrac": out.vf_clipfrac,
        }

    return head
