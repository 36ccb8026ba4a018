"""What the last pipeline stage computes from a micro-batch's output: the PPO-specific part.

A head is called by Megatron's schedule with the last stage's output ([1, T, V_local]
logits, or [1, T, 1] values) and the micro-batch, and returns (loss or None, detached
per-micro-batch outputs or metrics). Forward heads turn logits into per-response-token
log-probs (vocab-parallel, so TP never gathers the vocabulary) or outputs into values; loss
heads add the PPO policy or value loss, normalised by the global counts of the mini-batch.
A loss (`PolicyLoss`, `ValueLoss`) is built once per run from the config and makes the loss
head of each mini-batch from the step's experience and the mini-batch's counts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Protocol, TypedDict

import torch
from torch import Tensor

from rlhf.algo import entropy_loss, gspo_policy_loss, kl_loss, policy_loss, value_loss
from rlhf.algo.losses import BatchCounts, PolicyLossOutput, clip_range
from rlhf.algo.preference import bradley_terry_loss
from rlhf.config.schema import ActorConfig, CriticConfig
from rlhf.engine.micro_batch import MicroBatch
from rlhf.models.logprobs import VocabShard

PPO_KL = "actor/ppo_kl"  # the policy head's output that the epochs' KL bound reads


# (loss or None for forward-only passes, detached per-micro-batch outputs or metrics)
HeadOutput = tuple[Tensor | None, dict[str, Tensor]]


class Head(Protocol):
    """What the last pipeline stage computes from its output for one micro-batch."""

    def __call__(self, output: Tensor, mb: MicroBatch, /) -> HeadOutput: ...


def token_logprobs(
    logits: Tensor, mb: MicroBatch, vocab: VocabShard, temperature: float
) -> tuple[Tensor, Tensor]:
    """[n, R] log-probs of the response tokens and [n, R] entropies (differentiable), 0 where
    masked. Only the gathered positions go through the vocabulary's softmax (not the
    prompts'); under Ulysses SP, where a rank holds a slice of the row, all of its positions
    do, then are combined (`MicroBatch.gather`)."""
    if mb.local_positions is not None:
        logp_t, entropy_t = vocab.logprobs_entropy(logits[0], mb.labels[0], temperature)
        return mb.gather(logp_t[None]), mb.gather(entropy_t[None])
    logp, entropy = vocab.logprobs_entropy(logits[0], mb.labels[0], temperature, mb.rows)
    return mb.unmask(logp), mb.unmask(entropy)


class Targets(Protocol):
    """What the loss heads of a step read: [B, R] tensors per response token of its batch
    (the trainer's `Experience` is one; the engine never sees more of it)."""

    @property
    def old_logprobs_bt(self) -> Tensor: ...

    @property
    def advantages_bt(self) -> Tensor: ...

    @property
    def rollout_is_weights_bt(self) -> Tensor | None: ...

    @property
    def ref_logprobs_bt(self) -> Tensor | None: ...

    @property
    def values_bt(self) -> Tensor | None: ...

    @property
    def returns_bt(self) -> Tensor | None: ...


class Aggregation(TypedDict):
    """How a micro-batch's losses are normalised: the mini-batch's global counts."""

    global_num_tokens: int
    global_num_seqs: int
    norm_length: int


@dataclass(frozen=True)
class LogprobHead:
    """Log-probs and entropies of the response tokens under `temperature`."""

    vocab: VocabShard
    temperature: float = 1.0

    def __call__(self, logits: Tensor, mb: MicroBatch) -> HeadOutput:
        logp, entropy = token_logprobs(logits, mb, self.vocab, self.temperature)
        return None, {"logprobs": logp.detach(), "entropy": entropy.detach()}


@dataclass(frozen=True)
class CriticValueHead:
    """The critic's value of every response token."""

    def __call__(self, values: Tensor, mb: MicroBatch) -> HeadOutput:
        return None, {"values": mb.gather(values[..., 0].float()).detach()}


def sequence_scores(values: Tensor, mb: MicroBatch) -> Tensor:
    """[n] each sample's score (differentiable): the model's output at its last response
    token (what HF's `*ForSequenceClassification` pools for a right-padded sequence)."""
    per_token = mb.gather(values[..., 0].float(), shift=1)  # [n, R]
    last = (mb.mask.sum(dim=1) - 1).clamp(min=0)
    return per_token.gather(1, last[:, None].to(per_token.device))[:, 0]


@dataclass(frozen=True)
class SequenceScoreHead:
    """A reward model's score of each sample (`sequence_scores`); [n, 1]."""

    def __call__(self, values: Tensor, mb: MicroBatch) -> HeadOutput:
        return None, {"scores": sequence_scores(values, mb)[:, None].detach()}


@dataclass(frozen=True)
class PairLossHead:
    """The Bradley-Terry loss of a micro-batch of preference pairs: samples 2p and 2p + 1 of
    the batch are pair p's chosen and rejected sides, always in one micro-batch
    (`MicroBatchPlanner.plan_units`); `margins` [P] of the batch, `num_pairs` the global
    pair count of the mini-batch its losses and rm/* metrics are normalised by."""

    margins: Tensor
    num_pairs: int

    def __call__(self, values: Tensor, mb: MicroBatch) -> HeadOutput:
        scores = sequence_scores(values, mb)  # every rank gathers (a collective under SP)
        pairs = torch.tensor(mb.sample_ids[0::2], dtype=torch.long) // 2
        margin = self.margins[pairs] if len(pairs) else None
        loss, metrics = bradley_terry_loss(scores[0::2], scores[1::2], margin, self.num_pairs)
        return loss + values.sum() * 0.0, metrics  # an empty filler still reaches the output


@dataclass(frozen=True)
class PolicyLossHead:
    """PPO clipped surrogate (+ entropy bonus) of one micro-batch; verl's actor/* metrics."""

    vocab: VocabShard
    temperature: float
    settings: ActorConfig
    norm_length: int
    experience: Targets
    counts: BatchCounts

    def _aggregation(self) -> Aggregation:
        counts = self.counts
        return Aggregation(
            global_num_tokens=counts.num_tokens,
            global_num_seqs=counts.num_seqs,
            norm_length=self.norm_length,
        )

    def _surrogate(self, logp: Tensor, mb: MicroBatch) -> PolicyLossOutput:
        """The clipped surrogate of `policy_loss.loss_mode` (vanilla PPO or GSPO)."""
        cfg, exp, agg = self.settings, self.experience, self._aggregation()
        old, adv = mb.select(exp.old_logprobs_bt), mb.select(exp.advantages_bt)
        weights = exp.rollout_is_weights_bt
        w = None if weights is None else mb.select(weights)
        if cfg.policy_loss.loss_mode == "gspo":
            low, high = clip_range(cfg.clip_ratio, cfg.clip_ratio_low, cfg.clip_ratio_high)
            return gspo_policy_loss(
                logp, old, adv, mb.mask, low, high, cfg.loss_agg_mode, weights_bt=w, **agg
            )
        return policy_loss(
            logp,
            old,
            adv,
            mb.mask,
            cfg.clip_ratio,
            cfg.clip_ratio_low,
            cfg.clip_ratio_high,
            cfg.clip_ratio_c,
            cfg.loss_agg_mode,
            weights_bt=w,
            **agg,
        )

    def __call__(self, logits: Tensor, mb: MicroBatch) -> HeadOutput:
        cfg, exp, agg = self.settings, self.experience, self._aggregation()
        logp, entropy = token_logprobs(logits, mb, self.vocab, self.temperature)
        out = self._surrogate(logp, mb)
        ent = entropy_loss(entropy, mb.mask, cfg.loss_agg_mode, **agg)
        loss = out.loss - cfg.entropy_coeff * ent if cfg.entropy_coeff else out.loss
        metrics = {
            "actor/pg_loss": out.loss,
            "actor/pg_clipfrac": out.pg_clipfrac,
            "actor/pg_clipfrac_lower": out.pg_clipfrac_lower,
            PPO_KL: out.ppo_kl,
            "actor/entropy": ent,
        }
        if cfg.use_kl_loss:
            assert exp.ref_logprobs_bt is not None, "use_kl_loss builds the reference"
            ref = mb.select(exp.ref_logprobs_bt)
            kl = kl_loss(logp, ref, mb.mask, cfg.kl_loss_type, cfg.loss_agg_mode, **agg)
            loss = loss + cfg.kl_loss_coef * kl
            metrics["actor/kl_loss"] = kl
        return loss, {k: v.detach() for k, v in metrics.items()}


@dataclass(frozen=True)
class ValueLossHead:
    """Clipped value loss of one micro-batch; verl's critic/vf_* metrics."""

    settings: CriticConfig
    norm_length: int
    experience: Targets
    counts: BatchCounts

    def __call__(self, values: Tensor, mb: MicroBatch) -> HeadOutput:
        exp = self.experience
        assert exp.values_bt is not None and exp.returns_bt is not None, "the critic's targets"
        out = value_loss(
            mb.gather(values[..., 0].float()),
            mb.select(exp.values_bt),
            mb.select(exp.returns_bt),
            mb.mask,
            self.settings.cliprange_value,
            self.settings.loss_agg_mode,
            global_num_tokens=self.counts.num_tokens,
            global_num_seqs=self.counts.num_seqs,
            norm_length=self.norm_length,
        )
        detached: dict[str, Tensor] = {
            "critic/vf_loss": out.loss.detach(),
            "critic/vf_clipfrac": out.vf_clipfrac,
        }
        return out.loss, detached


class Loss(Protocol):
    """A trained model's loss: named, and turned into a head per mini-batch."""

    name: ClassVar[str]

    def head(self, experience: Targets, counts: BatchCounts) -> PolicyLossHead | ValueLossHead:
        """The loss head of one mini-batch (`counts`: its global token/sequence counts)."""
        ...

    def ppo_kl(self, outputs: dict[str, float]) -> float | None:
        """The KL between the rollout policy and the updated one on a mini-batch, from its
        summed head outputs (what `trainer.early_stop.ppo_kl_bound` bounds); None for a loss
        without a policy."""
        ...


@dataclass(frozen=True)
class PolicyLoss:
    """The actor's loss: the clipped surrogate of `policy_loss.loss_mode` (PPO or GSPO), minus
    the entropy bonus, plus the KL loss to the reference when `use_kl_loss`; log-probs at the
    rollout `temperature`, aggregated by `loss_agg_mode` with `norm_length` tokens."""

    name: ClassVar[str] = "policy_loss"
    vocab: VocabShard
    temperature: float
    settings: ActorConfig
    norm_length: int

    def head(self, experience: Targets, counts: BatchCounts) -> PolicyLossHead:
        return PolicyLossHead(
            self.vocab, self.temperature, self.settings, self.norm_length, experience, counts
        )

    def ppo_kl(self, outputs: dict[str, float]) -> float:
        return outputs[PPO_KL]


@dataclass(frozen=True)
class ValueLoss:
    """The critic's loss: the clipped value loss against the step's returns."""

    name: ClassVar[str] = "value_loss"
    settings: CriticConfig
    norm_length: int

    def head(self, experience: Targets, counts: BatchCounts) -> ValueLossHead:
        return ValueLossHead(self.settings, self.norm_length, experience, counts)

    def ppo_kl(self, outputs: dict[str, float]) -> None:
        return None
