"""Stored rollouts (`rlhf.data.rollout_files`): what a run writes per step reads back as it
was written, and a bad file is refused with every problem's file, row and column."""

from __future__ import annotations

import dataclasses

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from rlhf.data.parquet import DataError
from rlhf.data.rollout_files import StoredSample, read_rollout_files, write_rollout_file
from rlhf.rollout.batch import RolloutBatch
from rlhf.rollout.generation import RolloutRecord, RolloutResult
from rlhf.trainer.reward_model import RewardModelScorer

SAMPLES = [
    StoredSample(
        uid="0:3",
        prompt_ids=[1, 2, 3],
        response_ids=[7, 8],
        rollout_logprobs=[-0.5, -1.25],
        data_source="arithmetic",
        ground_truth="12",
        extra_info={"split": "train", "index": 3},
        score=1.0,
        policy_version=4,
        step=5,
        prompt_index=3,
    ),
    StoredSample(
        uid="0:3",
        prompt_ids=[1, 2, 3],
        response_ids=[9, 10, 11],
        rollout_logprobs=[-2.0, 0.0, -0.1],
        data_source="arithmetic",
        response_mask=[1, 0, 1],
        reward_style="model",
        ground_truth=["a", "b"],
    ),
]


def test_samples_read_back_as_written(tmp_path):
    path = write_rollout_file(SAMPLES, tmp_path / "step_5.parquet")
    assert read_rollout_files([path], vocab_size=12) == SAMPLES


def test_a_records_stored_form_carries_what_training_needs():
    record = RolloutRecord(
        prompt_index=3,
        uid="0:3",
        prompt_ids=[1, 2, 3],
        response_ids=[7, 8],
        response_logprobs=[-0.5, -1.25],
        finish_reason="stop",
        response_text="12",
        score=1.0,
        policy_version=4,
        data_source="arithmetic",
        ground_truth="12",
        extra_info={"split": "train", "index": 3},
    )
    assert record.stored(step=5) == SAMPLES[0]


def bad_file(tmp_path, **changes) -> str:
    rows = [s.to_row() for s in SAMPLES]
    rows[1] |= changes
    path = tmp_path / "bad.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


@pytest.mark.parametrize(
    ("changes", "column", "message"),
    [
        ({"rollout_logprobs": [-1.0]}, "rollout_logprobs", "1 values for 3 response tokens"),
        ({"rollout_logprobs": [-1.0, 0.5, -1.0]}, "rollout_logprobs", "not a finite log-prob"),
        ({"response_ids": [9, 10, 99]}, "response_ids", "outside the vocabulary [0, 12)"),
        ({"prompt_ids": []}, "prompt_ids", "is empty"),
        ({"response_mask": [1, 2, 1]}, "response_mask", "not one 0/1 per response token"),
        ({"reward_style": "judge"}, "reward_style", "'judge', not 'rule' or 'model'"),
        ({"uid": None}, "uid", "is null"),
        ({"ground_truth": "{oops"}, "ground_truth", "is not JSON"),
        ({"score": float("nan")}, "score", "is nan"),
    ],
)
def test_a_bad_row_is_named_by_file_row_and_column(tmp_path, changes, column, message):
    path = bad_file(tmp_path, **changes)
    with pytest.raises(DataError) as e:
        read_rollout_files([path], vocab_size=12)
    assert f"{path}: row 1, column '{column}': " in str(e.value)
    assert message in str(e.value) and len(e.value.problems) == 1


def test_samples_longer_than_the_runs_limits_are_named(tmp_path):
    path = write_rollout_file(SAMPLES, tmp_path / "step_5.parquet")
    with pytest.raises(DataError) as e:
        read_rollout_files([path], max_lengths=(3, 2))
    assert str(e.value).endswith(
        f"{path}: row 1, column 'response_ids': 3 tokens, over data.max_response_length=2"
    )
    assert len(e.value.problems) == 1


def test_missing_columns_and_unreadable_files_are_named(tmp_path):
    no_logprobs = tmp_path / "no_logprobs.parquet"
    pq.write_table(pa.Table.from_pylist([{"uid": "u", "prompt_ids": [1]}]), no_logprobs)
    not_parquet = tmp_path / "notes.parquet"
    not_parquet.write_text("hello")
    with pytest.raises(DataError) as e:
        read_rollout_files([no_logprobs, not_parquet])
    text = str(e.value)
    assert f"{no_logprobs}: missing columns ['response_ids', 'rollout_logprobs'" in text
    assert f"{not_parquet}: not a readable Parquet file" in text


def test_the_reward_model_stage_keeps_the_results_versions():
    """Scoring the style=model rows replaces the scores only: the policy version and the
    per-sample versions of an async round stay (they decide its staleness)."""
    batch = RolloutBatch(
        [[1]] * 2,
        [[2]] * 2,
        torch.tensor([1.0, float("nan")]),
        ["t"] * 2,
        ["a", "a"],
        reward_styles=["rule", "model"],
    )
    result = RolloutResult(batch, [], 0.5, 7, None, [(6, 7), (7, 7)])
    scorer = RewardModelScorer.__new__(RewardModelScorer)
    scorer.scores = lambda result, rows: torch.tensor([0.25])  # type: ignore[method-assign]
    scored = scorer(result)
    assert scored.batch.scores_b.tolist() == [1.0, 0.25]
    assert dataclasses.replace(scored, batch=batch, reward_s=0.5) == result
