"""The compute stages of a PPO step between rollout and weight sync.

old log-probs (actor), reference log-probs, values -> KL-penalised token rewards ->
advantages -> critic and actor updates over `ppo_epochs` x mini-batches. Every rank runs
these on the whole batch's bookkeeping but computes only its DP share of the samples
(token-budget micro-batches balanced over DP by `rlhf.data.packing`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from rlhf.algo import compute_advantages, kl_penalty, masked_mean, token_level_rewards
from rlhf.algo.losses import BatchCounts, global_batch_counts
from rlhf.config.schema import RLHFConfig
from rlhf.data.packing import plan_micro_batches
from rlhf.distributed.bootstrap import ParallelGroups
from rlhf.parallel.ulysses import SequenceShard
from rlhf.trainer.batch import RolloutBatch
from rlhf.trainer.early_stop import should_stop_epochs
from rlhf.trainer.heads import (
    VocabShard,
    logprob_head,
    policy_loss_head,
    value_head,
    value_loss_head,
)
from rlhf.trainer.megatron_model import MegatronModel, TrainableMegatronModel, gather_per_sample
from rlhf.trainer.micro_batch import MicroBatch, build_micro_batch

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StageContext:
    """What every stage needs besides the batch: config, groups, vocab shard, THD or mask."""

    cfg: RLHFConfig
    groups: ParallelGroups
    vocab: VocabShard
    thd: bool


def plan(
    batch: RolloutBatch, ctx: StageContext, budget: int, mini_batch_size: int | None
) -> list[list[MicroBatch]]:
    """This rank's micro-batches per mini-batch (`mini_batch_size` in samples; None: one)."""
    groups = ctx.groups
    sp = SequenceShard(groups.cp_group, groups.cp_rank, groups.cp_size)
    micro = plan_micro_batches(
        batch.sequence_lengths,
        max_tokens_per_micro_batch=budget * sp.size,  # a row is spread over the SP ranks
        dp_size=groups.dp_size,
        mini_batch_size=mini_batch_size,
        pad_to_multiple_of=2 * sp.size if sp.size > 1 else 1,
    )
    return [
        [build_micro_batch(batch, ids, ctx.thd, sp).to(groups.device) for ids in mini]
        for mini in micro.for_rank(groups.dp_rank)
    ]


def forward_stage(model: MegatronModel, batch, ctx, budget: int, head, keys) -> list:
    """[B, R] tensors `keys` from a forward-only pass over the whole batch."""
    (micro_batches,) = plan(batch, ctx, budget, None)
    outputs = model.forward(micro_batches, head)
    shape = (batch.size, batch.response_width)
    return [gather_per_sample(outputs, micro_batches, k, shape, ctx.groups) for k in keys]


def compute_old_logprobs(actor, batch, ctx, budget: int) -> None:
    old, entropy = forward_stage(
        actor, batch, ctx, budget, logprob_head(ctx.vocab), ("logprobs", "entropy")
    )
    batch.tensors["old_logprobs"], batch.tensors["old_entropy"] = old, entropy


def compute_ref_logprobs(ref, batch, ctx, budget: int) -> None:
    (batch.tensors["ref_logprobs"],) = forward_stage(
        ref, batch, ctx, budget, logprob_head(ctx.vocab), ("logprobs",)
    )


def compute_values(critic, batch, ctx, budget: int) -> None:
    (batch.tensors["values"],) = forward_stage(
        critic, batch, ctx, budget, value_head(), ("values",)
    )


def compute_rewards_and_advantages(batch: RolloutBatch, cfg: RLHFConfig, kl_coef: float) -> dict:
    """Token rewards (score - beta * KL), advantages, returns; the step's KL and reward metrics.

    The KL reported (and fed to the controller) is the mean over responses of each
    response's mean per-token KL, as in verl.
    """
    algo = cfg.algorithm
    mask = batch.mask_bt()
    t = batch.tensors
    kl_bt = torch.where(mask, kl_penalty(t["old_logprobs"], t["ref_logprobs"], algo.kl_penalty), 0)
    beta = kl_coef if algo.use_kl_in_reward else 0.0
    rewards = token_level_rewards(batch.scores_b, mask, kl_bt, beta)
    out = compute_advantages(
        algo.adv_estimator,
        rewards,
        mask,
        values_bt=t.get("values"),
        uids=batch.uids,
        gamma=algo.gamma,
        lam=algo.lam,
    )
    t["token_rewards"], t["advantages"] = rewards, out.advantages_bt
    if out.returns_bt is not None:
        t["returns"] = out.returns_bt
    lengths = mask.sum(dim=1).clamp(min=1)
    current_kl = float((kl_bt.sum(dim=1) / lengths).mean())
    metrics = {
        "actor/reward_kl_penalty": current_kl,
        "actor/reward_kl_penalty_coeff": beta,
        "critic/score/mean": float(batch.scores_b.mean()),
        "critic/rewards/mean": float(rewards.sum(dim=1).mean()),
        "critic/advantages/mean": float(masked_mean(out.advantages_bt, mask)),
    }
    if out.returns_bt is not None:
        metrics["critic/returns/mean"] = float(masked_mean(out.returns_bt, mask))
    if "values" in t:
        metrics["critic/values/mean"] = float(masked_mean(t["values"], mask))
    return metrics


def counts_of(micro_plan: list[MicroBatch], ctx) -> BatchCounts:
    """Response tokens / responses of a whole mini-batch (this rank's micro-batches, all DP)."""
    group = ctx.groups.dp_group if ctx.groups.dp_size > 1 else None
    return global_batch_counts([mb.mask for mb in micro_plan], group)


def run_updates(
    model: TrainableMegatronModel, batch, ctx, budget: int, mini_samples: int, epochs: int,
    make_head, kl_bound: float | None = None,
) -> dict[str, float]:  # fmt: skip
    """`epochs` passes of one optimizer step per mini-batch; metrics averaged over steps.

    With `kl_bound`, the epochs stop early once a mini-batch's `actor/ppo_kl` exceeds it.
    """
    minis = plan(batch, ctx, budget, mini_samples)
    totals: dict[str, float] = {}
    steps = 0
    for epoch in range(epochs):
        for micro_batches in minis:
            head = make_head(counts_of(micro_batches, ctx))
            metrics = model.train_mini_batch(micro_batches, head)
            steps += 1
            for k, v in metrics.items():
                totals[k] = totals.get(k, 0.0) + v
            kl = metrics.get("actor/ppo_kl", 0.0)
            if should_stop_epochs(kl, kl_bound):
                log.warning(
                    "early stop of PPO epochs: ppo_kl %.4f > bound %.4f at epoch %d",
                    kl, kl_bound, epoch,
                )  # fmt: skip
                return {k: v / steps for k, v in totals.items()} | {
                    "actor/ppo_kl_stop_after_updates": float(steps)
                }
    return {k: v / steps for k, v in totals.items()}


def with_optimizer_prefix(metrics: dict[str, float], role: str) -> dict[str, float]:
    """`grad_norm` / `lr` from the optimizer step as `<role>/grad_norm`, `<role>/lr`."""
    return {(f"{role}/{k}" if k in ("grad_norm", "lr") else k): v for k, v in metrics.items()}


def update_critic(critic, batch, ctx, budget: int) -> dict[str, float]:
    cfg = ctx.cfg.critic
    n = ctx.cfg.actor_rollout_ref.rollout.n
    norm = ctx.cfg.data.max_response_length

    def make_head(counts):
        return value_loss_head(cfg, batch.tensors, counts, norm)

    metrics = run_updates(
        critic, batch, ctx, budget, cfg.ppo_mini_batch_size * n, cfg.ppo_epochs, make_head
    )
    return with_optimizer_prefix(metrics, "critic")


def update_actor(actor, batch, ctx, budget: int) -> dict[str, float]:
    cfg = ctx.cfg.actor_rollout_ref.actor
    n = ctx.cfg.actor_rollout_ref.rollout.n
    norm = ctx.cfg.data.max_response_length

    def make_head(counts):
        return policy_loss_head(ctx.vocab, cfg, batch.tensors, counts, norm)

    metrics = run_updates(
        actor, batch, ctx, budget, cfg.ppo_mini_batch_size * n, cfg.ppo_epochs, make_head,
        ctx.cfg.trainer.early_stop.ppo_kl_bound,
    )  # fmt: skip
    return with_optimizer_prefix(metrics, "actor")
