"""`data.rollout_files` checked whole at load (`load_stored_groups`, before any server or
model starts) under the run's config: group sizes against `rollout.n`, unscored rows
against the run's reward, every problem one line by file, row and column."""

from __future__ import annotations

import dataclasses

import pytest

from rlhf.config import load_config
from rlhf.data.parquet import DataError
from rlhf.data.rollout_files import StoredSample, write_rollout_file
from rlhf.trainer.rollouts import load_stored_groups

SAMPLE = StoredSample(
    uid="g0",
    prompt_ids=[1, 2],
    response_ids=[3],
    rollout_logprobs=[-0.5],
    data_source="arithmetic",
    ground_truth="12",
)


def run_config(path, *overrides: str):
    return load_config(
        None,
        [
            f"data.rollout_files=[{path}]",
            "data.train_batch_size=1",
            "algorithm.rollout_correction.rollout_is=token",
            *overrides,
        ],
    )


def groups_of(tmp_path, size: int, groups: int = 2, **changes) -> str:
    samples = [
        dataclasses.replace(SAMPLE, uid=f"g{g}", prompt_ids=[1, g], **changes)
        for g in range(groups)
        for _ in range(size)
    ]
    return str(write_rollout_file(samples, tmp_path / "stored.parquet"))


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "gae"])
def test_groups_of_one_sample_are_refused_under_rollout_n(tmp_path, estimator):
    """A group of one compares nothing under GRPO/RLOO (zero advantages) and breaks the
    mini-batches (n samples a prompt) under any estimator: one line, not a traceback."""
    path = groups_of(tmp_path, size=1)
    cfg = run_config(path, "actor_rollout_ref.rollout.n=4", f"algorithm.adv_estimator={estimator}")
    with pytest.raises(DataError) as e:
        stored_groups(cfg)
    assert f"{path}: row 0, column 'uid': group 'g0' has 1 samples, not " in str(e.value)
    assert "actor_rollout_ref.rollout.n=4" in str(e.value) and len(e.value.problems) == 2


def test_groups_of_rollout_n_samples_load(tmp_path):
    cfg = run_config(groups_of(tmp_path, size=4), "actor_rollout_ref.rollout.n=4")
    groups = stored_groups(cfg)
    assert groups is not None and [len(g) for g in groups] == [4, 4]


def test_an_unscored_row_of_an_unknown_data_source_is_refused_at_load(tmp_path):
    """As prompt files are at startup (not a traceback from the reward function at step 1);
    a `reward.custom_fn` scores every source, and a scored row needs no reward."""
    path = groups_of(tmp_path, size=2, data_source="gsm8k_typo")
    cfg = run_config(path, "actor_rollout_ref.rollout.n=2")
    with pytest.raises(DataError) as e:
        stored_groups(cfg)
    assert f"{path}: row 0, column 'data_source': no rule reward for data_source 'gsm8k_typo'" in (
        str(e.value)
    )
    custom = tmp_path / "reward.py"
    custom.write_text(
        "def score(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.0\n"
    )
    with_custom = run_config(
        path, "actor_rollout_ref.rollout.n=2", f"reward.custom_fn={custom}:score"
    )
    assert stored_groups(with_custom) is not None
    scored = groups_of(tmp_path, size=2, data_source="gsm8k_typo", score=1.0)
    assert stored_groups(run_config(scored, "actor_rollout_ref.rollout.n=2")) is not None


def test_an_unscored_model_row_needs_a_reward_model(tmp_path):
    path = groups_of(tmp_path, size=2, reward_style="model")
    cfg = run_config(path, "actor_rollout_ref.rollout.n=2")
    with pytest.raises(DataError, match=r"row 0, column 'score': is null on a reward_style"):
        stored_groups(cfg)


def stored_groups(cfg):
    """`data.rollout_files` grouped as the run loads them (a 16-token vocabulary)."""
    return load_stored_groups(cfg.data, cfg.reward, cfg.actor_rollout_ref.rollout.n, 16)
