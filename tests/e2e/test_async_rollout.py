"""Generation overlapping training on a real SGLang CPU server (`trainer.rollout_mode`).

The tiny random model rarely ends a response before its 256-token budget, so the rounds
ahead are still generating when a step's weights are synced: under async the server is
paused (abort) with requests in flight, and the samples it cut go on under the new weights.
Read back from the runs' records (`rollouts/step_N.jsonl`) and metrics:

- exactly once: every step trains the prompts an independent `PromptSampler` draws next, in
  order, none repeated or skipped, also across a resume from a checkpoint taken while
  rounds were ahead (they are drawn again and regenerated);
- versions: every sample's token spans cover its response, contiguous, and the first is no
  more than `max_staleness` versions behind the step's policy; samples cut by a sync carry
  two versions and the step's `async/partial_samples` counts them;
- one_step_off never pauses: each round comes wholly from the version one behind;
- each step's samples are also stored for training again (`step_N.parquet`).
"""

from __future__ import annotations

import itertools
import json
import shutil
from pathlib import Path

import pytest

from rlhf.data.rollout_files import read_rollout_files
from rlhf.data.sampler import PromptSampler
from rlhf.quickstart.data import write_quickstart_data
from tests.e2e.test_ppo_training import run_train
from tests.helpers import metrics_by_step, ppo_overrides

BATCH, N, TRAIN_PROMPTS, SEED = 16, 4, 32, 1  # configs/quickstart_cpu.yaml's, data below
LONG = "data.max_response_length=256"
QUIET = ["trainer.val_before_train=false", "trainer.test_freq=-1"]
TIS = "algorithm.rollout_correction.rollout_is=token"


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_quickstart_data(
        tmp_path_factory.mktemp("data"), num_train=TRAIN_PROMPTS, num_val=8
    )


def records(run_dir: Path, step: int) -> list[dict]:
    lines = (run_dir / "rollouts" / f"step_{step}.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def drawn_uids(steps: int) -> list[list[str]]:
    """What each step must train: the sampler's draws, in order (one round per step)."""
    sampler = PromptSampler(TRAIN_PROMPTS, BATCH, N, SEED)
    return [sampler.next_batch().sample_uids for _ in range(steps)]


def check_stored(run_dir: Path, step: int, got: list[dict]) -> None:
    """The step's stored rollouts (step_N.parquet) hold the samples of its records."""
    stored = read_rollout_files([run_dir / "rollouts" / f"step_{step}.parquet"])
    assert [s.step for s in stored] == [step] * len(got)
    for sample, record in zip(stored, got, strict=True):
        assert sample.uid == record["uid"] and sample.prompt_ids == record["prompt_ids"]
        assert sample.response_ids == record["response_ids"]
        assert sample.rollout_logprobs == record["response_logprobs"]
        assert sample.score == record["score"] and sample.data_source == "arithmetic"
        assert sample.policy_version == record["policy_version"]


def check_versions(record: dict, step: int, max_staleness: int) -> list[int]:
    """The record's spans cover its response contiguously; its versions, in order."""
    spans = record["weight_versions"]
    assert spans[0][1] == 0 and spans[-1][2] == len(record["response_ids"]), spans
    assert all(a[2] == b[1] for a, b in itertools.pairwise(spans)), spans
    versions = [int(v) for v, _, _ in spans]
    assert versions == sorted(versions) and (step - 1) - versions[0] <= max_staleness
    return versions


@pytest.mark.slow(reason="a 4-step async run with partial rollouts, then its resume: ~80 s")
def test_async_run_trains_every_prompt_once_with_partial_rollouts(
    tiny_qwen2_dir, data, sglang_server, tmp_path
):
    run_dir = tmp_path / "async"
    mode = ["trainer.rollout_mode=async", "trainer.async_rollout.max_staleness=1", TIS]
    # a step must train faster than the server generates a round, or no round is still in
    # flight at a sync: GRPO's step (no values, no critic update) is, at ~0.6 s against
    # ~1.5 s for a round of 64 long responses; PPO's (~1 s) no longer is on this CPU once
    # SGLang's decode attention is batched (rlhf/rollout/batched_attention.py)
    mode += ["algorithm.adv_estimator=grpo"]
    args = ppo_overrides(
        tiny_qwen2_dir, data, run_dir, 4, LONG, *QUIET, *mode, server=sglang_server
    )
    run_train(args, run_dir)
    metrics = metrics_by_step(run_dir)
    draws = drawn_uids(4)
    partial = 0
    for step in range(1, 5):
        got = records(run_dir, step)
        assert [r["uid"] for r in got] == draws[step - 1]
        check_stored(run_dir, step, got)
        cut = sum(len(set(check_versions(r, step, 1))) > 1 for r in got)
        assert metrics[step]["async/partial_samples"] == cut
        assert metrics[step]["async/staleness_max"] <= 1
        assert metrics[step]["async/dropped_stale"] == 0
        partial += cut
    assert partial > 0, "no sample was cut by a weight sync: nothing continued"

    # resumed from step 2's checkpoint (rounds 3 and 4 were ahead then): steps 3 and 4
    # train the same prompts as the uninterrupted run
    resumed = tmp_path / "resumed"
    checkpoint = resumed / "from_step_2"
    shutil.copytree(run_dir / "checkpoints" / "global_step_2", checkpoint)
    again = [*args, f"trainer.default_local_dir={resumed}", f"trainer.resume_mode={checkpoint}"]
    run_train(again, resumed)
    assert sorted(p.name for p in (resumed / "rollouts").glob("*.jsonl")) == [
        "step_3.jsonl",
        "step_4.jsonl",
    ]
    for step in (3, 4):
        assert [r["uid"] for r in records(resumed, step)] == draws[step - 1]


def test_one_step_off_rounds_come_from_one_version_behind(
    tiny_qwen2_dir, data, sglang_server, tmp_path
):
    run_dir = tmp_path / "one_step_off"
    mode = ["trainer.rollout_mode=one_step_off", TIS]
    args = ppo_overrides(
        tiny_qwen2_dir, data, run_dir, 3, LONG, *QUIET, *mode, server=sglang_server
    )
    run_train(args, run_dir)
    metrics = metrics_by_step(run_dir)
    draws = drawn_uids(3)
    for step in range(1, 4):
        got = records(run_dir, step)
        assert [r["uid"] for r in got] == draws[step - 1]
        behind = max(0, step - 2)  # step 1 trains version 0's round, as synchronously
        assert {r["policy_version"] for r in got} == {behind}
        assert metrics[step]["async/staleness_max"] == (step - 1) - behind
        assert metrics[step]["async/partial_samples"] == 0
