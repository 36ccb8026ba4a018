"""Where a step's scored batch comes from: the rollout strategy (docs/architecture.md).

`SynchronousRollout` generates the batch at the start of the step with the weights the
servers hold (the previous step's policy: no lag). This is the seam the asynchronous
strategies (`rlhf.trainer.async_rollout`, `trainer.rollout_mode`) replace: `next_batch(step)`
returns a `StepBatch` whose rounds carry the policy version that generated them, and
`publish(policy, version)` is how the step's new weights reach the servers.

The synchronous batch includes DAPO's two changes to it:

- Dynamic sampling (`algorithm.filter_groups`): a prompt whose samples all score the same
  (`metric`: the reward functions' score, or the shaped `seq_reward`) gives every sample the
  same group advantage, i.e. no signal. Such groups are dropped and
  more prompts are generated, round after round, until the step has
  `data.train_batch_size` informative groups (the first ones, in order), or the run fails
  after `max_num_gen_batches` rounds.
- Overlong shaping (`reward.overlong_buffer`): a response of L tokens, with limit
  L_max = `data.max_response_length` and buffer B, gets
  min(0, (L_max - B - L) / B) x penalty_factor added to its score: nothing up to L_max - B
  tokens, then a penalty growing linearly to -penalty_factor at the limit.

Every rank runs this identically (same sampler, same broadcast results), so every rank
takes the same decisions.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from rlhf.config.schema import OverlongBufferConfig, RLHFConfig
from rlhf.data.prompts import PromptDataset
from rlhf.data.sampler import PromptSampler
from rlhf.engine.reward_model import RewardModelScorer, score_model_rows
from rlhf.rollout.batch import RolloutBatch
from rlhf.rollout.generation import RolloutResult, sampling_params
from rlhf.rollout.multi_turn import ToolStats
from rlhf.rollout.policy_servers import PolicyServers, PolicyWeights, WeightLoad
from rlhf.trainer.metrics import reward_style_metrics


@dataclass(frozen=True)
class StepBatch:
    """The batch a step learns from, every generation round that made it (records on the
    main rank, the policy version that generated it), and the metrics of dynamic sampling
    and overlong shaping (when enabled)."""

    batch: RolloutBatch
    rounds: list[RolloutResult]
    metrics: dict[str, float]

    @property
    def reward_s(self) -> float:
        """Seconds spent scoring (rules and reward model), over all rounds."""
        return sum(r.reward_s for r in self.rounds)


class RolloutStrategy(Protocol):
    """How a step gets its scored batch and how new weights reach the servers (collective:
    every rank calls, every rank gets the same)."""

    def next_batch(self, step: int) -> StepBatch: ...

    def publish(self, policy: PolicyWeights, version: int) -> WeightLoad: ...

    def sampler_state(self) -> dict[str, Any]:
        """Where the prompts of the next step not yet generated begin (for checkpoints)."""
        ...

    def load_sampler_state(self, state: dict[str, Any]) -> None:
        """Continue from a checkpoint's `sampler_state`."""
        ...

    def close(self) -> None: ...


@dataclass
class SynchronousRollout:
    """Generate and score the step's batch now, from the policy the servers serve."""

    servers: PolicyServers
    sampler: PromptSampler
    data: PromptDataset
    cfg: RLHFConfig
    reward_model: RewardModelScorer | None  # scores the reward_model.style=model rows

    def next_batch(self, step: int) -> StepBatch:
        return collect_step_batch(self.generate_round, self.cfg)

    def generate_round(self) -> RolloutResult:
        """The next prompts of the sampler, generated and scored now."""
        sampled = self.sampler.next_batch()  # every rank advances its sampler identically
        prompts = [self.data[i] for i in sampled.prompt_indices]
        params = sampling_params(self.cfg)
        generated = self.servers.generate(prompts, sampled.uids, sampled.prompt_indices, params)
        return score_model_rows(generated, self.reward_model)

    def publish(self, policy: PolicyWeights, version: int) -> WeightLoad:
        """The servers are idle between steps: load the weights."""
        return self.servers.load_weights(policy, version)

    def sampler_state(self) -> dict[str, Any]:
        return self.sampler.state_dict()

    def load_sampler_state(self, state: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state)

    def close(self) -> None:
        pass


def prompt_groups(batch: RolloutBatch) -> list[list[int]]:
    """The sample indices of each prompt (uid), in order of first appearance."""
    groups: dict[str, list[int]] = {}
    for i, uid in enumerate(batch.uids):
        groups.setdefault(uid, []).append(i)
    return list(groups.values())


def informative_groups(batch: RolloutBatch, values_b: torch.Tensor) -> list[list[int]]:
    """The prompt groups whose samples do not all have the same value (`values_b`, [B])."""
    values = values_b.tolist()
    return [g for g in prompt_groups(batch) if len({values[i] for i in g}) > 1]


def filter_metric(batch: RolloutBatch, cfg: RLHFConfig) -> torch.Tensor:
    """[B] what dynamic sampling compares (`algorithm.filter_groups.metric`): the reward
    functions' score, or (seq_reward) the score after overlong shaping."""
    overlong = cfg.reward.overlong_buffer
    if cfg.algorithm.filter_groups.metric == "seq_reward" and overlong.enable:
        return batch.scores_b + overlong_penalties(batch, cfg.data.max_response_length, overlong)
    return batch.scores_b


def overlong_penalties(batch: RolloutBatch, max_length: int, cfg: OverlongBufferConfig):
    """[B] penalty (<= 0) of each response's length under `reward.overlong_buffer`."""
    start = max_length - cfg.len
    lengths = torch.tensor([len(r) for r in batch.response_ids], dtype=torch.float32)
    return ((start - lengths) / cfg.len).clamp(max=0) * cfg.penalty_factor


def collect_step_batch(next_round: Callable[[], RolloutResult], cfg: RLHFConfig) -> StepBatch:
    """Take scored rounds of prompts from `next_round` until the step has
    `data.train_batch_size` prompt groups."""
    wanted = cfg.data.train_batch_size
    filtering = cfg.algorithm.filter_groups
    results: list[RolloutResult] = []
    kept: list[list[int]] = []  # groups, as indices into the concatenation of the rounds
    offset = dropped = 0
    while len(kept) < wanted:
        if filtering.max_num_gen_batches and len(results) == filtering.max_num_gen_batches:
            raise RuntimeError(
                f"dynamic sampling found {len(kept)} of {wanted} prompt groups whose samples "
                f"score differently in {len(results)} generation rounds "
                "(algorithm.filter_groups.max_num_gen_batches): raise it, or disable "
                "algorithm.filter_groups"
            )
        results.append(next_round())
        batch = results[-1].batch
        if filtering.enable:
            groups = informative_groups(batch, filter_metric(batch, cfg))
        else:
            groups = prompt_groups(batch)
        kept += [[offset + i for i in g] for g in groups]
        dropped += len(prompt_groups(batch)) - len(groups)
        offset += batch.size
    batch = RolloutBatch.concat([r.batch for r in results])
    batch = batch.select([i for g in kept[:wanted] for i in g])
    metrics = reward_style_metrics(batch)
    tool_stats = [r.tool_stats for r in results if r.tool_stats is not None]
    if tool_stats:  # every round's conversations, dropped groups' included
        metrics |= sum(tool_stats, ToolStats()).metrics()
    if filtering.enable:
        metrics |= {
            "dynamic_sampling/gen_rounds": float(len(results)),
            "dynamic_sampling/dropped_groups": float(dropped),
            "dynamic_sampling/kept_groups": float(len(kept)),
        }
    if cfg.reward.overlong_buffer.enable:
        penalty = overlong_penalties(
            batch, cfg.data.max_response_length, cfg.reward.overlong_buffer
        )
        batch = dataclasses.replace(batch, scores_b=batch.scores_b + penalty)
        metrics["reward/overlong_penalty/mean"] = float(penalty.mean())
    return StepBatch(batch, results, metrics)
