"""Step metrics that no stage produces: rollout lengths, validation scores, throughput and MFU."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from rlhf.config.schema import RLHFConfig
from rlhf.config.validate import uses_critic, uses_reference
from rlhf.models.families import ModelArch
from rlhf.rollout.batch import RolloutBatch
from rlhf.trainer.perf import ppo_step_flops


def reward_style_metrics(batch: RolloutBatch) -> dict[str, float]:
    """`reward/<style>/mean` and the count of each reward style, when a batch mixes rule and
    model rows (before overlong shaping: the rewards as the scorers gave them)."""
    styles = batch.styles()
    if set(styles) == {"rule"}:
        return {}
    groups: dict[str, list[float]] = defaultdict(list)
    for style, score in zip(styles, batch.scores_b.tolist()):
        groups[style].append(score)
    metrics = {f"reward/{s}/mean": sum(v) / len(v) for s, v in groups.items()}
    return metrics | {f"reward/{s}/count": float(len(v)) for s, v in groups.items()}


def rollout_metrics(batch: RolloutBatch, max_response_length: int) -> dict[str, float]:
    """verl-named length metrics of one rollout batch."""
    lengths = [len(r) for r in batch.response_ids]
    return {
        "response_length/mean": sum(lengths) / len(lengths),
        "response_length/max": max(lengths),
        "response_length/min": min(lengths),
        "response_length/clip_ratio": sum(n >= max_response_length for n in lengths) / len(lengths),
        "prompt_length/mean": sum(len(p) for p in batch.prompt_ids) / batch.size,
    }


def model_passes(cfg: RLHFConfig) -> tuple[int, int]:
    """(forward-only passes, update epochs) of one step over its batch, all models."""
    critic = uses_critic(cfg)
    forwards = 1 + int(uses_reference(cfg)) + int(critic)
    epochs = cfg.actor_rollout_ref.actor.ppo_epochs + (cfg.critic.ppo_epochs if critic else 0)
    return forwards, epochs


@dataclass(frozen=True)
class StepMeter:
    """A step's performance yardsticks: tokens, tokens/s per rank, and MFU against
    `peak_flops` (measured per rank) for `passes` = `model_passes(cfg)`."""

    arch: ModelArch
    world_size: int
    peak_flops: float
    passes: tuple[int, int]

    def metrics(self, batch: RolloutBatch, step_s: float) -> dict[str, float]:
        tokens = sum(batch.sequence_lengths)
        flops = ppo_step_flops(self.arch, tokens, tokens / batch.size, *self.passes)
        return {
            "perf/total_num_tokens": float(tokens),
            "perf/throughput": tokens / step_s / self.world_size,
            "perf/mfu": flops / step_s / (self.peak_flops * self.world_size),
        }
