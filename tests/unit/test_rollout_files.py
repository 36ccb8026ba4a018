"""Stored rollouts (`rlhf.data.rollout_files`): what a run writes per step reads back as it
was written, and a bad file is refused with every problem's file, row and column."""

from __future__ import annotations

import dataclasses
import json
import re
import threading

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from rlhf.data.parquet import DataError, PromptRow
from rlhf.data.prompts import EncodedPrompt
from rlhf.data.rollout_files import (
    RolloutChecks,
    StoredSample,
    read_rollout_files,
    write_rollout_file,
)
from rlhf.engine.reward_model import RewardModelScorer
from rlhf.reward import check_ground_truth
from rlhf.rollout import batch as batch_module
from rlhf.rollout.batch import RolloutBatch, RolloutRecord, RolloutResult, StepRolloutWriter
from rlhf.rollout.offline import RolloutPlan, check_manifest, prompts_digest

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


def test_a_vision_language_policy_refuses_stored_prompts_with_image_tokens(tmp_path):
    """A stored prompt keeps its image tokens but not its pictures: training on it would
    embed the image tokens as words, so a run of a vision-language policy refuses it."""
    path = write_rollout_file(SAMPLES, tmp_path / "step_5.parquet")
    assert read_rollout_files([path], checks=RolloutChecks(image_token_id=9)) == SAMPLES
    with pytest.raises(DataError, match="row 0, column 'prompt_ids': holds image tokens"):
        read_rollout_files([path], checks=RolloutChecks(image_token_id=2))


def test_a_records_stored_form_carries_what_training_needs():
    assert _record().stored(step=5) == SAMPLES[0]


def _record() -> RolloutRecord:
    return RolloutRecord(
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


def test_a_steps_files_are_written_in_a_thread_the_step_does_not_wait_for(tmp_path, monkeypatch):
    """The step hands its records over and goes on; `wait` returns once they are on disk."""
    release, writers = threading.Event(), []
    write = batch_module.write_step_rollouts

    def held(records, rollouts_dir, step):
        writers.append(threading.current_thread() is threading.main_thread())
        release.wait(10)
        write(records, rollouts_dir, step)

    monkeypatch.setattr(batch_module, "write_step_rollouts", held)
    files = StepRolloutWriter(tmp_path / "rollouts")
    files.submit([_record()], 5)  # returns while the write is held
    assert not (tmp_path / "rollouts" / "step_5.parquet").exists()
    release.set()
    files.wait()
    assert writers == [False]
    assert read_rollout_files([str(tmp_path / "rollouts" / "step_5.parquet")]) == SAMPLES[:1]
    assert files.written_s > 0
    files.close()


def test_a_failed_write_is_raised_at_the_next_hand_over(tmp_path):
    (tmp_path / "rollouts").write_text("a file where the directory goes")
    files = StepRolloutWriter(tmp_path / "rollouts")
    files.submit([_record()], 1)
    with pytest.raises(FileExistsError):
        files.submit([_record()], 2)
    files.close()


def bad_file(tmp_path, **changes) -> str:
    rows = [s.to_row() for s in SAMPLES]
    rows[0] |= {column: None for column in changes if column not in rows[0]}
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
        ({"videos": [{"bytes": b"\x00"}] * 2}, "videos", "carries 2 videos; stored rollouts"),
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


def typed_file(tmp_path, name: str = "typed.parquet", **changes) -> str:
    """SAMPLES with `changes` made to every row (a column of another type)."""
    path = tmp_path / name
    pq.write_table(pa.Table.from_pylist([s.to_row() | changes for s in SAMPLES]), path)
    return str(path)


@pytest.mark.parametrize(
    ("changes", "column", "message"),
    [
        ({"prompt_ids": ["1", "2"]}, "prompt_ids", "has '1', not an integer token id"),
        ({"response_ids": [7.0, 259.5]}, "response_ids", "has 7.0, not an integer token id"),
        ({"rollout_logprobs": ["-1", "-2"]}, "rollout_logprobs", "has '-1', not a number"),
        ({"score": "high"}, "score", "is 'high', not a number"),
        ({"uid": 7}, "uid", "is 7, not a string"),
        ({"response_mask": [True, False]}, "response_mask", "has True, not 0 or 1"),
        ({"step": 2.5}, "step", "is 2.5, not an integer"),
    ],
)
def test_a_column_of_the_wrong_type_is_one_line_at_its_first_row(
    tmp_path, changes, column, message
):
    """Strings, floats and booleans where the schema has numbers or integer ids are named
    (not a TypeError in the checks, not a float id reaching the tokenizer)."""
    path = typed_file(tmp_path, **changes)
    with pytest.raises(DataError) as e:
        read_rollout_files([path], vocab_size=300)
    assert str(e.value).startswith("invalid stored rollouts:\n")
    line = f"{path}: row 0, column '{column}': {message} (and 1 more rows)"
    assert str(e.value).endswith(line) and len(e.value.problems) == 1


@pytest.mark.parametrize(
    ("changes", "column", "message"),
    [
        ({"response_ids": [9, None, 11]}, "response_ids", "has None, not an integer token id"),
        ({"extra_info": "[1, 2]"}, "extra_info", "is not a JSON object"),
        ({"prompt_ids": [1, 2, 12]}, "prompt_ids", "has token id 12, outside the vocabulary"),
    ],
)
def test_a_value_of_the_wrong_type_in_one_row_is_named(tmp_path, changes, column, message):
    path = bad_file(tmp_path, **changes)
    with pytest.raises(DataError) as e:
        read_rollout_files([path], vocab_size=12)
    assert f"{path}: row 1, column '{column}': {message}" in str(e.value)
    assert len(e.value.problems) == 1


def group_file(tmp_path, name: str, uid: str, prompt: list[int], size: int = 2) -> str:
    sample = dataclasses.replace(SAMPLES[0], uid=uid, prompt_ids=prompt)
    return str(write_rollout_file([sample] * size, tmp_path / name))


def test_a_uid_of_two_prompts_in_two_files_is_refused_naming_both(tmp_path):
    """Two outputs that number their groups alike (rollout-0, ...) are not merged into
    mixed groups; the same prompt's group may span files."""
    first = group_file(tmp_path, "a.parquet", "rollout-0", [1, 2, 3])
    other = group_file(tmp_path, "b.parquet", "rollout-0", [4, 5])
    with pytest.raises(DataError) as e:
        read_rollout_files([first, other])
    assert str(e.value).endswith(
        f"{other}: row 0, column 'uid': 'rollout-0' is also the uid of another prompt "
        f"({first}, row 0): a uid names one prompt's group, give each prompt its own"
    )
    assert len(e.value.problems) == 1
    same = group_file(tmp_path, "c.parquet", "rollout-0", [1, 2, 3])
    assert len(read_rollout_files([first, same], checks=RolloutChecks(group_size=4))) == 4


def test_a_group_of_another_size_than_rollout_n_is_refused(tmp_path):
    single = group_file(tmp_path, "single.parquet", "g", [1, 2, 3], size=1)
    with pytest.raises(DataError) as e:
        read_rollout_files([single], checks=RolloutChecks(group_size=2))
    assert str(e.value).endswith(
        f"{single}: row 0, column 'uid': group 'g' has 1 samples, not "
        "actor_rollout_ref.rollout.n=2: a step's prompt groups have n samples each (GRPO and "
        "RLOO compare them; mini-batches count n a prompt)"
    )
    spread = group_file(tmp_path, "more.parquet", "g", [1, 2, 3], size=2)
    with pytest.raises(DataError, match=r"'g' has 3 samples in 2 files \(.*single.parquet, "):
        read_rollout_files([single, spread], checks=RolloutChecks(group_size=2))
    assert len(read_rollout_files([spread], checks=RolloutChecks(group_size=2))) == 2


def test_an_unscored_row_the_run_cannot_score_is_named(tmp_path):
    """Unscored rule rows need a data source the reward knows (as prompt files at startup),
    unscored model rows a reward model; scored rows need neither."""
    path = bad_file(tmp_path, data_source="nosuch", reward_style="rule")
    checks = RolloutChecks(scorable=check_ground_truth, model_scorer=False)
    with pytest.raises(DataError) as e:
        read_rollout_files([path], checks=checks)
    assert f"{path}: row 1, column 'data_source': no rule reward for data_source 'nosuch'" in (
        str(e.value)
    )
    assert len(e.value.problems) == 1
    model_row = bad_file(tmp_path)  # row 1: style model, no score
    with pytest.raises(DataError) as e:
        read_rollout_files([model_row], checks=checks)
    assert str(e.value).endswith(
        f"{model_row}: row 1, column 'score': is null on a reward_style 'model' row and "
        "reward.model_path is unset"
    )
    scored = bad_file(tmp_path, data_source="nosuch", reward_style="rule", score=0.5)
    assert len(read_rollout_files([scored], checks=checks)) == 2


def prompt(ids: list[int], truth: str = "4") -> EncodedPrompt:
    row = PromptRow("arithmetic", "q", {"style": "rule", "ground_truth": truth})
    return EncodedPrompt(row, ids)


def plan(prompts: list[EncodedPrompt], data_file: str = "train.parquet") -> RolloutPlan:
    digest = prompts_digest(prompts)
    return RolloutPlan("model", [data_file], len(prompts), 4, 2, 1.0, 1.0, -1, 64, 8, 7, digest)


def test_rlhf_rollout_uids_differ_across_prompt_files_and_hold_on_resume(tmp_path):
    """Two outputs of `rlhf-rollout` from different prompt files (even under the same file
    name) never share a uid; a run resumed from the directory's `rollout.json` names its
    groups as the first run did."""
    first = plan([prompt([1, 2]), prompt([3])])
    uids = [first.uid(i) for i in range(2)]
    assert all(re.fullmatch(f"rollout-[0-9a-f]{{16}}-{i}", u) for i, u in enumerate(uids))
    check_manifest(first, tmp_path)
    resumed = RolloutPlan(**json.loads((tmp_path / "rollout.json").read_text()))
    assert [resumed.uid(i) for i in range(2)] == uids
    others = [plan([prompt([5, 6]), prompt([3])]), plan([prompt([1, 2], "5"), prompt([3])])]
    others.append(plan([prompt([1, 2]), prompt([3])], "other.parquet"))
    for other in others:
        assert other.uid(0) != uids[0] and other.uid(1) != uids[1]


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
