"""A step's training batch: DAPO's dynamic sampling and overlong shaping, on hand-made rounds.

The fleet here is a stand-in that returns scripted scores round after round, so that which
groups are kept, how many rounds run and when the run gives up are fixed by the test; the
real fleet (SGLang) runs in tests/e2e/test_learning.py with the same code path.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from rlhf.config import load_config
from rlhf.data.sampler import PromptSampler
from rlhf.rollout.batch import RolloutBatch, RolloutResult
from rlhf.trainer.rollouts import (
    BatchShaping,
    SynchronousRollout,
    informative_groups,
    overlong_penalties,
    prompt_groups,
)


@dataclass
class ScriptedFleet:
    """Generates 2 samples per prompt whose scores come from `rounds`, one list per call."""

    rounds: list[list[float]]
    lengths: tuple[int, int] = (3, 16)

    def generate(self, prompts, uids, indices, params) -> RolloutResult:
        scores = self.rounds.pop(0)
        n = params.n
        batch = RolloutBatch(
            prompt_ids=[[7]] * (len(uids) * n),
            response_ids=[[5] * self.lengths[j % 2] for j in range(len(uids) * n)],
            scores_b=torch.tensor(scores),
            data_sources=["t"] * (len(uids) * n),
            uids=[u for u in uids for _ in range(n)],
        )
        return RolloutResult(batch, [], 0.0)


def config(*overrides: str):
    return load_config(
        None,
        [
            "data.train_batch_size=2",
            "data.max_response_length=16",
            "actor_rollout_ref.rollout.n=2",
            *overrides,
        ],
    )


def collect(fleet: ScriptedFleet, *overrides: str):
    cfg = config(*overrides)
    sampler = PromptSampler(8, cfg.data.train_batch_size, 2, seed=0)
    shaping = BatchShaping.of(cfg.actor_rollout_ref, cfg.data, cfg.algorithm, cfg.reward)
    strategy = SynchronousRollout(fleet, sampler, list(range(8)), shaping, None)  # type: ignore[arg-type]
    got = strategy.next_batch(1)
    return got.batch, got.rounds, got.metrics


def test_groups():
    batch = RolloutBatch(
        [[1]] * 6,
        [[2]] * 6,
        torch.tensor([1.0, 1, 0, 1, 2, 2]),
        ["t"] * 6,
        ["a", "a", "b", "b", "c", "c"],
    )
    assert prompt_groups(batch) == [[0, 1], [2, 3], [4, 5]]
    assert informative_groups(batch, batch.scores_b) == [[2, 3]]


def test_dynamic_sampling_keeps_informative_groups_over_rounds():
    # round 1: group 0 all 1.0 (dropped), group 1 informative; round 2: dropped, kept
    fleet = ScriptedFleet([[1.0, 1.0, 0.0, 1.0], [0.0, 0.0, 1.0, 0.0]])
    batch, results, metrics = collect(fleet, "algorithm.filter_groups.enable=true")
    assert len(results) == 2
    assert batch.scores_b.tolist() == [0.0, 1.0, 1.0, 0.0]
    assert batch.uids[0] == results[0].batch.uids[2] and batch.uids[2] == results[1].batch.uids[2]
    assert metrics == {
        "dynamic_sampling/gen_rounds": 2.0,
        "dynamic_sampling/dropped_groups": 2.0,
        "dynamic_sampling/kept_groups": 2.0,
    }


@pytest.mark.parametrize(("metric", "rounds", "dropped"), [("score", 2, 2), ("seq_reward", 1, 0)])
def test_dynamic_sampling_compares_the_metric_it_is_given(metric, rounds, dropped):
    """Group 0 scores 1.0 twice but its second response (16 tokens) is shaped down by the
    overlong buffer: the same by `score`, different by `seq_reward`."""
    fleet = ScriptedFleet([[1.0, 1.0, 0.0, 0.5], [0.0, 1.0, 1.0, 1.0]])
    _, results, metrics = collect(
        fleet,
        "algorithm.filter_groups.enable=true",
        f"algorithm.filter_groups.metric={metric}",
        "reward.overlong_buffer.enable=true",
        "reward.overlong_buffer.len=4",
    )
    assert len(results) == rounds
    assert metrics["dynamic_sampling/dropped_groups"] == dropped


def test_dynamic_sampling_gives_up_after_max_rounds():
    fleet = ScriptedFleet([[1.0, 1.0, 0.0, 0.0]])
    with pytest.raises(RuntimeError, match=r"found 0 of 2 prompt groups .* in 1 generation"):
        collect(
            fleet,
            "algorithm.filter_groups.enable=true",
            "algorithm.filter_groups.max_num_gen_batches=1",
        )


def test_without_filtering_one_round_is_the_batch():
    fleet = ScriptedFleet([[1.0, 1.0, 0.0, 0.0]])
    batch, results, metrics = collect(fleet)
    assert len(results) == 1 and metrics == {}
    assert batch.scores_b.tolist() == [1.0, 1.0, 0.0, 0.0]


def test_overlong_penalty():
    batch = RolloutBatch(
        [[1]] * 4, [[2] * n for n in (10, 12, 13, 16)], torch.zeros(4), ["t"] * 4, ["a"] * 4
    )
    cfg = config("reward.overlong_buffer.enable=true", "reward.overlong_buffer.len=4").reward
    penalties = overlong_penalties(batch, 16, cfg.overlong_buffer)
    torch.testing.assert_close(penalties, torch.tensor([0.0, 0.0, -0.25, -1.0]))


def test_overlong_shaping_is_added_to_the_training_scores():
    fleet = ScriptedFleet([[1.0, 1.0, 0.0, 1.0]])  # responses of 3 and 16 tokens
    shaping = ["reward.overlong_buffer.enable=true", "reward.overlong_buffer.len=4"]
    batch, _, metrics = collect(fleet, *shaping, "reward.overlong_buffer.penalty_factor=0.5")
    assert batch.scores_b.tolist() == [1.0, 0.5, 0.0, 0.5]
    assert metrics["reward/overlong_penalty/mean"] == pytest.approx(-0.25)
