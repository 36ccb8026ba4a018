"""The compute stages of a PPO step between rollout and weight sync.

old log-probs (actor), reference log-probs, values -> `Experience` (KL-penalised token
rewards, advantages, returns) -> critic and actor updates over `ppo_epochs` x mini-batches.
Every rank holds the whole batch but computes only its DP share of the samples (token-budget
micro-batches balanced over DP by `MicroBatchPlanner`); per-sample outputs are summed back
into [B, R] tensors that are identical on every rank.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from rlhf.algo import compute_advantages, kl_penalty, masked_mean, token_level_rewards
from rlhf.algo.losses import BatchCounts, global_batch_counts
from rlhf.algo.rollout_correction import mismatch_metrics, truncated_is_weights
from rlhf.config.algorithm import AlgorithmConfig, RolloutCorrectionConfig
from rlhf.rollout.batch import RolloutBatch
from rlhf.trainer.early_stop import should_stop_epochs
from rlhf.trainer.experience import Experience
from rlhf.trainer.heads import CriticValueHead, LogprobHead
from rlhf.trainer.megatron_model import (
    Head,
    MegatronModel,
    TrainableMegatronModel,
    gather_per_sample,
)
from rlhf.trainer.micro_batch import MicroBatch, MicroBatchPlanner
from rlhf.trainer.nonfinite import NonFiniteError, nonfinite_marks, nonfinite_metrics

log = logging.getLogger(__name__)

# The loss head of one mini-batch update: (the step's experience, the mini-batch's counts).
LossHeadFactory = Callable[[Experience, BatchCounts], Head]


@dataclass(frozen=True)
class UpdateSpec:
    """How one trained model is updated every step (built once by `rlhf.trainer.setup`).

    role: 'actor' or 'critic' (the prefix of its grad_norm and lr metrics); token_budget:
    tokens per micro-batch; mini_batch_samples: samples per optimizer step; kl_bound: end
    the step's epochs once a mini-batch's actor/ppo_kl exceeds it (None: never);
    on_nonfinite: `trainer.on_nonfinite` for a mini-batch whose gradients are not finite.
    """

    role: str
    model: TrainableMegatronModel
    token_budget: int
    mini_batch_samples: int
    epochs: int
    loss_head: LossHeadFactory
    kl_bound: float | None = None
    on_nonfinite: str = "stop"  # trainer.on_nonfinite (rlhf.trainer.nonfinite)


def forward_outputs(
    model: MegatronModel,
    batch: RolloutBatch,
    planner: MicroBatchPlanner,
    budget: int,
    head: Head,
    keys: Sequence[str],
) -> list[Tensor]:
    """[B, R] tensors `keys` from a forward-only pass over the whole batch."""
    (micro_batches,) = planner.plan(batch, budget)
    outputs = model.forward(micro_batches, head)
    shape = (batch.size, batch.response_width)
    return [gather_per_sample(outputs, micro_batches, k, shape, planner.ctx) for k in keys]


def compute_logprobs(
    model: MegatronModel,
    batch: RolloutBatch,
    planner: MicroBatchPlanner,
    budget: int,
    head: LogprobHead,
) -> tuple[Tensor, Tensor]:
    """[B, R] log-probs and entropies of the response tokens (actor or reference)."""
    logp, entropy = forward_outputs(model, batch, planner, budget, head, ("logprobs", "entropy"))
    return logp, entropy


def compute_values(
    critic: MegatronModel, batch: RolloutBatch, planner: MicroBatchPlanner, budget: int
) -> Tensor:
    """[B, R] values of the response tokens."""
    (values,) = forward_outputs(critic, batch, planner, budget, CriticValueHead(), ("values",))
    return values


def probe_logprobs(
    actor: MegatronModel, tokens: list[int], planner: MicroBatchPlanner, head: LogprobHead
) -> Tensor:
    """log p(token_t | tokens_<t), t >= 1, through the same packed forward as training.

    The probe goes in as one sample per DP rank (every rank's plan needs one).
    """
    copies = planner.ctx.dp_size
    batch = RolloutBatch(
        prompt_ids=[tokens[:1]] * copies,
        response_ids=[tokens[1:]] * copies,
        scores_b=torch.zeros(copies),
        data_sources=["probe"] * copies,
        uids=[f"probe-{i}" for i in range(copies)],
    )
    logp, _ = compute_logprobs(actor, batch, planner, len(tokens), head)
    return logp[0]


def build_experience(
    batch: RolloutBatch,
    old: tuple[Tensor, Tensor | None],
    ref_logprobs_bt: Tensor | None,
    values_bt: Tensor | None,
    algo: AlgorithmConfig,
    kl_coef: float,
) -> tuple[Experience, dict[str, float]]:
    """Token rewards (score - beta * KL), advantages, returns; the step's KL and reward metrics.

    `old` is the actor's (log-probs, entropies), or the engine's log-probs and None
    (`rollout_correction.bypass_mode`: no mismatch to measure). With a reference, the KL
    reported (and fed to the controller) is the mean over responses of each response's mean
    per-token KL, as in verl; beta is `kl_coef` when `algo.use_kl_in_reward`, else 0.
    """
    old_logprobs_bt, old_entropy_bt = old
    mask = batch.mask_bt()
    metrics: dict[str, float] = {}
    kl_bt = torch.zeros_like(old_logprobs_bt)
    beta = kl_coef if algo.use_kl_in_reward else 0.0
    if ref_logprobs_bt is not None:
        kl = kl_penalty(old_logprobs_bt, ref_logprobs_bt, algo.kl_penalty)
        kl_bt = torch.where(mask, kl, 0)
        lengths = mask.sum(dim=1).clamp(min=1)
        metrics["actor/reward_kl_penalty"] = float((kl_bt.sum(dim=1) / lengths).mean())
        metrics["actor/reward_kl_penalty_coeff"] = beta
    rewards = token_level_rewards(batch.scores_b, mask, kl_bt, beta)
    out = compute_advantages(
        algo.adv_estimator,
        rewards,
        mask,
        values_bt=values_bt,
        uids=batch.uids,
        gamma=algo.gamma,
        lam=algo.lam,
        norm_by_std=algo.norm_adv_by_std_in_grpo,
    )
    weights, metrics_is = None, dict[str, float]()
    if not algo.rollout_correction.bypass_mode:
        weights, metrics_is = rollout_correction(batch, old_logprobs_bt, algo.rollout_correction)
    experience = Experience(
        batch,
        old_logprobs_bt,
        old_entropy_bt,
        ref_logprobs_bt,
        values_bt,
        rewards,
        out.advantages_bt,
        out.returns_bt,
        weights,
    )
    metrics |= metrics_is
    metrics |= {
        "critic/score/mean": float(batch.scores_b.mean()),
        "critic/rewards/mean": float(rewards.sum(dim=1).mean()),
        "critic/advantages/mean": float(masked_mean(out.advantages_bt, mask)),
    }
    if out.returns_bt is not None:
        metrics["critic/returns/mean"] = float(masked_mean(out.returns_bt, mask))
    if values_bt is not None:
        metrics["critic/values/mean"] = float(masked_mean(values_bt, mask))
    return experience, metrics


def rollout_correction(
    batch: RolloutBatch, old_logprobs_bt: Tensor, settings: RolloutCorrectionConfig
) -> tuple[Tensor | None, dict[str, float]]:
    """Truncated importance weights (when `settings.rollout_is`) and the mismatch metrics
    `rollout_corr/*` of a batch that carries the engine's log-probs."""
    rollout_bt = batch.rollout_logprobs_bt()
    if rollout_bt is None:
        return None, {}
    mask = batch.mask_bt()
    metrics = mismatch_metrics(old_logprobs_bt, rollout_bt, mask)
    weights = None
    if settings.rollout_is is not None:
        weights, is_metrics = truncated_is_weights(
            old_logprobs_bt, rollout_bt, mask, settings.rollout_is, settings.rollout_is_threshold
        )
        metrics |= is_metrics
    return weights, {f"rollout_corr/{k}": v for k, v in metrics.items()}


def _nonfinite_update(spec: UpdateSpec, metrics: dict[str, float]) -> list[str]:
    """What a mini-batch whose gradients were not finite (no step was taken) found; raises
    under `trainer.on_nonfinite=stop`."""
    names = [f"{spec.role}/{n}" if "/" not in n else n for n in nonfinite_metrics(metrics)]
    names = names or [f"{spec.role}/gradients"]
    if spec.on_nonfinite == "stop":
        raise NonFiniteError(
            f"{spec.role} update: not finite: {', '.join(names)} (trainer.on_nonfinite=stop; "
            "skip would skip such updates)"
        )
    return names


def mini_batch_counts(micro_batches: list[MicroBatch], planner: MicroBatchPlanner) -> BatchCounts:
    """Response tokens / responses of a whole mini-batch (this rank's micro-batches, all DP)."""
    ctx = planner.ctx
    return global_batch_counts(
        [mb.mask for mb in micro_batches], ctx.dp_group if ctx.dp_size > 1 else None
    )


def run_updates(spec: UpdateSpec, exp: Experience, planner: MicroBatchPlanner) -> dict[str, float]:
    """`spec.epochs` passes of one optimizer step per mini-batch; metrics averaged over steps.

    grad_norm, lr and the count of skipped updates come back as `<role>/grad_norm`,
    `<role>/lr` and `<role>/skipped_updates` (the means are over the updates taken).
    """
    with spec.model.on_device():  # one reload for all mini-batches of an offloaded model
        return _run_updates(spec, exp, planner)


def _run_updates(spec: UpdateSpec, exp: Experience, planner: MicroBatchPlanner) -> dict[str, float]:
    minis = planner.plan(exp.batch, spec.token_budget, spec.mini_batch_samples)
    totals: dict[str, float] = {}
    steps = skipped = 0
    stop_note: dict[str, float] = {}
    found: list[str] = []
    for epoch in range(spec.epochs):
        for micro_batches in minis:
            head = spec.loss_head(exp, mini_batch_counts(micro_batches, planner))
            metrics = spec.model.train_mini_batch(micro_batches, head)
            if metrics.pop("skipped_updates"):
                skipped += 1
                found += _nonfinite_update(spec, metrics)
                continue
            steps += 1
            for k, v in metrics.items():
                totals[k] = totals.get(k, 0.0) + v
            kl = metrics.get("actor/ppo_kl", 0.0)
            if should_stop_epochs(kl, spec.kl_bound):
                log.warning(
                    "early stop of PPO epochs: ppo_kl %.4f > bound %.4f at epoch %d",
                    kl,
                    spec.kl_bound,
                    epoch,
                )
                stop_note = {"actor/ppo_kl_stop_after_updates": float(steps)}
                break
        if stop_note:
            break
    averaged = {k: v / steps for k, v in totals.items()} | stop_note
    averaged["skipped_updates"] = float(skipped)
    prefixed = ("grad_norm", "lr", "skipped_updates")
    named = {(f"{spec.role}/{k}" if k in prefixed else k): v for k, v in averaged.items()}
    return named | nonfinite_marks(sorted(set(found)))
