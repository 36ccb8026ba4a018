"""Where rows are scored at generation time (rlhf.reward.scorer): rule rows in the process or
in a pool of processes (same scores), model rows by a remote endpoint (a local HTTP server
here, checked against the texts it received) or left NaN for the trainer's reward model; a
dead endpoint fails after bounded retries naming its URL."""

from __future__ import annotations

import math

import pytest

from rlhf.config import load_config
from rlhf.reward import RewardInput, RewardScorer
from rlhf.reward.remote import RemoteReward, RemoteRewardError
from rlhf.utils import free_port
from tests.helpers import length_judge

ROWS = [
    RewardInput("gsm8k", "#### 4", "4"),
    RewardInput("judge", "a long answer", None, {"k": 1}, style="model", prompt_text="Q1"),
    RewardInput("gsm8k", "#### 5", "4"),
    RewardInput("judge", "short", None, style="model", prompt_text="Q2"),
]


@pytest.fixture
def judge():
    with length_judge() as running:
        yield running


def scorer_for(*overrides: str) -> RewardScorer:
    return RewardScorer.from_config(load_config(None, list(overrides)).reward)


def test_rule_rows_scored_model_rows_left_for_the_reward_model():
    scores = scorer_for()(ROWS)
    assert scores[0] == 1.0 and scores[2] == 0.0
    assert math.isnan(scores[1]) and math.isnan(scores[3])


def test_a_process_pool_gives_the_same_rule_scores():
    rows = [RewardInput("gsm8k", f"#### {i % 7}", str(i % 3)) for i in range(40)]
    inline, pooled = scorer_for(), scorer_for("reward.num_workers=2")
    try:
        assert pooled.workers is not None and pooled.rule_fn is None
        assert pooled(rows) == inline(rows) == [float(i % 7 == i % 3) for i in range(40)]
    finally:
        pooled.close()


def test_model_rows_scored_by_the_endpoint(judge):
    url, received = judge
    scores = scorer_for(f"reward.url={url}")(ROWS)
    assert scores == [1.0, 13.0, 0.0, 5.0]
    (items,) = received  # one batch with the model rows only, in order
    assert [i["prompt"] for i in items] == ["Q1", "Q2"]
    assert items[0] == {
        "data_source": "judge",
        "prompt": "Q1",
        "response": "a long answer",
        "ground_truth": None,
        "extra_info": {"k": 1},
    }


def test_dead_endpoint_fails_after_bounded_retries_naming_the_url():
    url = f"http://127.0.0.1:{free_port()}/score"
    remote = RemoteReward(url, timeout_s=1.0, retries=2, backoff_s=0.01)
    with pytest.raises(RemoteRewardError) as err:
        remote([{"response": "x"}])
    assert url in str(err.value) and "after 3 attempts" in str(err.value)


def test_unknown_style_is_an_error():
    with pytest.raises(ValueError, match="style must be rule or model, got \\['human'\\]"):
        scorer_for()([RewardInput("gsm8k", "x", "1", style="human")])
