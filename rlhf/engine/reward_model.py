"""Model rewards in the loop: rows with `reward_model.style=model` scored by a reward model.

Generation scores rule rows on the engine rank and leaves model rows as NaN
(`rlhf.rollout.policy_servers.generate_and_score`); every rank then holds the same batch,
and this scorer runs the reward model (an HF `*ForSequenceClassification` checkpoint,
built like the critic and sharded like the actor, frozen) over those rows through
Megatron's schedule on packed micro-batches: the score of a sample is the model's output
at its last response token, which is what HF pools for a right-padded sequence. An empty
response scores 0.
"""

from __future__ import annotations

import dataclasses
import math
import time
from pathlib import Path

import torch

from rlhf.config.budgets import MicroBatching
from rlhf.config.schema import RewardConfig
from rlhf.distributed.context import ParallelContext
from rlhf.engine.engine import MegatronModel
from rlhf.engine.heads import SequenceScoreHead
from rlhf.engine.micro_batch import MicroBatchPlanner
from rlhf.models.builder import value_model_from_hf
from rlhf.models.hf_io import HFCheckpointReader
from rlhf.models.mapping import Placement
from rlhf.rollout.batch import RolloutResult
from rlhf.utils import torch_dtype


def pending_rows(result: RolloutResult) -> list[int]:
    """The samples generation left for the reward model (style model, score NaN)."""
    scores, styles = result.batch.scores_b.tolist(), result.batch.styles()
    return [
        i for i, (s, style) in enumerate(zip(scores, styles)) if style == "model" and math.isnan(s)
    ]


def require_scored(result: RolloutResult) -> RolloutResult:
    """Without a reward model: model rows must have been scored by `reward.url`."""
    if pending_rows(result):
        raise ValueError(
            "rows with reward_model.style=model need a reward model: set reward.model_path "
            "(an HF *ForSequenceClassification directory) or reward.url (a reward endpoint)"
        )
    return result


class RewardModelScorer:
    """`scorer(result)`: the result with its model rows scored (collective: every rank)."""

    def __init__(
        self, model: MegatronModel, planner: MicroBatchPlanner, token_budget: int | MicroBatching
    ):
        self.model, self.planner, self.token_budget = model, planner, token_budget

    @classmethod
    def from_config(
        cls,
        reward: RewardConfig,
        dtype_name: str,
        ctx: ParallelContext,
        planner: MicroBatchPlanner,
        token_budget: int | MicroBatching,
    ) -> RewardModelScorer | None:
        """The reward model of `reward.model_path` (None without one), in the policy's
        training dtype (`dtype_name`), scoring with `planner` at `token_budget`."""
        path = reward.model_path
        if not path:
            return None
        if not (Path(path) / "config.json").is_file():
            raise FileNotFoundError(f"reward.model_path: no config.json in {path!r}")
        if "score.weight" not in HFCheckpointReader(path):
            raise ValueError(
                f"reward.model_path: {path} has no 'score.weight'; a reward model must be an "
                "HF *ForSequenceClassification checkpoint with num_labels=1"
            )
        dtype = torch_dtype(dtype_name)
        module, _ = value_model_from_hf(
            path,
            Placement.of(ctx),
            params_dtype=dtype,
            sp=ctx.sp_size,
            sequence_parallel=ctx.sequence_parallel,
        )
        model = MegatronModel.frozen(module.to(ctx.device), ctx, "reward_model")
        return cls(model, planner, token_budget)

    def scores(self, result: RolloutResult, rows: list[int]) -> torch.Tensor:
        """[len(rows)] scores of those samples."""
        batch = result.batch.select(rows)
        head = SequenceScoreHead()
        (scores,) = self.planner.per_sample(
            self.model, batch, self.token_budget, head, ("scores",), width=1
        )
        return scores[:, 0]

    def __call__(self, result: RolloutResult) -> RolloutResult:
        rows = pending_rows(result)
        if not rows:
            return result
        start = time.perf_counter()
        scores = result.batch.scores_b.clone()
        scores[rows] = self.scores(result, rows)
        records = list(result.records)
        if records:  # the main rank's records are in batch order
            for i in rows:
                records[i] = dataclasses.replace(records[i], score=float(scores[i]))
        batch = dataclasses.replace(result.batch, scores_b=scores)
        reward_s = result.reward_s + time.perf_counter() - start
        # the rest (policy version, tool stats, sample versions) stays the result's
        return dataclasses.replace(result, batch=batch, records=records, reward_s=reward_s)


def score_model_rows(result: RolloutResult, scorer: RewardModelScorer | None) -> RolloutResult:
    """The step's reward-model stage: `result` with its reward_model.style=model rows scored
    by the reward model (collective), or checked to have none left without one."""
    return require_scored(result) if scorer is None else scorer(result)
