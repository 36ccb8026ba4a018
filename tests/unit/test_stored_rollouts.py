"""Training from stored rollouts (`data.rollout_files`, `MixedRollout`) on scripted servers.

The servers here are `test_step_batch`'s stand-in (scripted scores, every call recorded);
the stored groups are hand-made. What is checked: each step takes exactly
`stored_fraction` x `train_batch_size` stored groups (in its own sampler's order) and
generates the rest, stored samples keep their ids, log-probs and response masks (tool
tokens of multi-turn samples stay out of the policy's tokens), missing rule scores are
computed by the reward function on the decoded text, the sampler state resumes both
orders, and the config rules refuse what cannot run.
"""

from __future__ import annotations

import pytest
import torch

from rlhf.config import load_config
from rlhf.config.loader import ConfigError
from rlhf.config.validate import validate_config
from rlhf.data.rollout_files import StoredSample
from rlhf.data.sampler import PromptSampler
from rlhf.reward.scorer import RewardScorer
from rlhf.rollout.batch import RolloutBatch, RolloutResult
from rlhf.trainer.rollouts import BatchShaping, MixedRollout

N, BATCH, PROMPTS, GROUPS = 2, 4, 12, 6
TIS = "algorithm.rollout_correction.rollout_is=token"
FILES = "data.rollout_files=[stored.parquet]"


class Fleet:
    """Generates N samples per prompt, scores 0/1 alternating; records the prompts."""

    def __init__(self):
        self.drawn: list[list[int]] = []
        self.scorer = RewardScorer.from_config(load_config(None).reward)  # the engine rank's

    def generate(self, prompts, uids, indices, params) -> RolloutResult:
        self.drawn.append(list(indices))
        size = len(uids) * N
        batch = RolloutBatch(
            prompt_ids=[[7]] * size,
            response_ids=[[5, 6]] * size,
            scores_b=torch.tensor([float(j % 2) for j in range(size)]),
            data_sources=["arithmetic"] * size,
            uids=[u for u in uids for _ in range(N)],
            rollout_logprobs=[[-0.1, -0.2]] * size,
        )
        return RolloutResult(batch, [], 0.0, 3)


class Tokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return f"#### {ids[-1]}"  # the arithmetic rule reads the number after ####


def group(g: int) -> list[StoredSample]:
    """Group g: a scored sample and one the reward function must score (right iff g even)."""
    answer = 12 if g % 2 == 0 else 13
    base = dict(uid=f"0:{g}", prompt_ids=[1, g], data_source="arithmetic", ground_truth="12")
    return [
        StoredSample(response_ids=[4, 5], rollout_logprobs=[-1.0, -2.0], score=0.5, **base),
        StoredSample(response_ids=[4, answer], rollout_logprobs=[-0.5, -0.25], **base),
    ]


def tool_group(g: int) -> list[StoredSample]:
    """Group g of a multi-turn file: a sample with 1 + g % 3 tool tokens (mask 0) between
    its two turns, and a single-turn one written without a mask."""
    tools = 1 + g % 3
    base = dict(uid=f"0:{g}", prompt_ids=[1, g], data_source="arithmetic", score=1.0)
    return [
        StoredSample(
            response_ids=[4, *[9] * tools, 12],
            rollout_logprobs=[-1.0, *[0.0] * tools, -2.0],
            response_mask=[1, *[0] * tools, 1],
            **base,
        ),
        StoredSample(response_ids=[4, 12], rollout_logprobs=[-0.5, -0.25], **base),
    ]


def strategy(*overrides: str, fleet=None, make_group=group) -> MixedRollout:
    base = [f"data.train_batch_size={BATCH}", f"actor_rollout_ref.rollout.n={N}", FILES, TIS]
    cfg = load_config(None, [*base, *overrides])
    fresh = BATCH - round(cfg.data.stored_fraction * BATCH) or BATCH
    sampler = PromptSampler(PROMPTS, fresh, N, seed=cfg.data.seed)
    groups = [make_group(g) for g in range(GROUPS)]
    data = list(range(PROMPTS))
    shaping = BatchShaping.of(cfg.actor_rollout_ref, cfg.data, cfg.algorithm, cfg.reward)
    fleet = fleet or Fleet()
    return MixedRollout(fleet, sampler, data, shaping, None, groups, Tokenizer(), True)  # type: ignore[arg-type]


def test_each_step_takes_exactly_its_share_of_stored_groups():
    fleet = Fleet()
    rollout = strategy("data.stored_fraction=0.5", fleet=fleet)
    stored_order = PromptSampler(GROUPS, 2, 1, seed=1)
    fresh_order = PromptSampler(PROMPTS, 2, N, seed=1)
    for step in (1, 2, 3):
        got = rollout.next_batch(step)
        groups = stored_order.next_batch().prompt_indices
        uids = [f"stored:0:{g}" for g in groups for _ in range(2)]
        assert got.batch.uids[:4] == uids
        assert fleet.drawn[-1] == fresh_order.next_batch().prompt_indices
        assert got.batch.size == 4 + 2 * N
        assert got.metrics["stored/groups"] == 2 and got.metrics["stored/samples"] == 4
        # stored ids and log-probs as written; scores: 0.5 stored, the rule's where missing
        assert got.batch.prompt_ids[:4] == [[1, g] for g in groups for _ in range(2)]
        assert got.batch.rollout_logprobs[:2] == [[-1.0, -2.0], [-0.5, -0.25]]
        expected = [s for g in groups for s in (0.5, 1.0 if g % 2 == 0 else 0.0)]
        assert got.batch.scores_b[:4].tolist() == expected
    rollout.close()


def test_all_stored_generates_nothing_and_the_state_resumes_both_orders():
    fleet = Fleet()
    rollout = strategy(fleet=fleet)  # stored_fraction 1: 4 stored groups per step
    first = rollout.next_batch(1)
    assert fleet.drawn == [] and first.batch.size == 8
    state = rollout.sampler_state()
    expected = rollout.next_batch(2).batch.uids
    resumed = strategy()
    resumed.load_sampler_state(state)
    assert resumed.next_batch(2).batch.uids == expected
    rollout.close()
    resumed.close()


@pytest.mark.parametrize("fraction", ["0.5", "1.0"])
def test_stored_response_masks_reach_the_training_batch(fraction):
    """Multi-turn stored samples keep their tool tokens out of the policy's tokens: the
    batch's masks are the stored ones (all ones for a sample stored without one, and for
    the generated samples), and the per-token log-probs skip the tool tokens."""
    rollout = strategy(f"data.stored_fraction={fraction}", make_group=tool_group)
    stored = round(float(fraction) * BATCH)
    order = PromptSampler(GROUPS, stored, 1, seed=1).next_batch().prompt_indices
    got = rollout.next_batch(1).batch
    masks = [m for g in order for m in ([1, *[0] * (1 + g % 3), 1], [1, 1])]
    assert got.response_masks == masks + [[1, 1]] * (got.size - len(masks))
    assert got.policy_lengths[: len(masks)] == [2] * len(masks)
    logprobs = got.rollout_logprobs_bt()
    assert logprobs is not None
    assert logprobs[: len(masks)].tolist() == [[-1.0, -2.0], [-0.5, -0.25]] * stored
    rollout.close()


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["data.stored_fraction=0.5"], "without data.rollout_files"),
        ([FILES, TIS, "data.stored_fraction=0.3"], "must be a whole number"),
        ([FILES], "rollout_is=token"),
        ([FILES, TIS, "algorithm.filter_groups.enable=true"], "filter_groups.enable"),
    ],
)
def test_stored_settings_that_cannot_run_are_refused(overrides, message):
    cfg = load_config(
        None, ["actor_rollout_ref.model.path=m", "data.train_batch_size=4", *overrides]
    )
    with pytest.raises(ConfigError, match=message):
        validate_config(cfg)
