"""Training from stored rollouts on the real CPU server: a run's own `rollouts/step_N.parquet`
feed another run (`data.rollout_files`, half of each batch stored, half generated).

Checked from the second run's records and metrics: each step trains exactly 8 stored prompt
groups (32 samples) and 8 generated ones; every stored sample it trained is a sample of the
first run, token ids and engine log-probs as written; importance weights against them are
computed (`rollout_corr/*`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlhf.data.rollout_files import read_rollout_files
from rlhf.quickstart.data import write_quickstart_data
from tests.e2e.test_ppo_training import run_train
from tests.helpers import metrics_by_step, ppo_overrides

QUIET = ["trainer.val_before_train=false", "trainer.test_freq=-1"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_quickstart_data(tmp_path_factory.mktemp("data"), num_train=32, num_val=8)


def records(run_dir: Path, step: int) -> list[dict]:
    lines = (run_dir / "rollouts" / f"step_{step}.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def test_half_of_each_batch_comes_from_another_runs_rollouts(
    tiny_qwen2_dir, data, sglang_server, tmp_path
):
    first = tmp_path / "first"
    run_train(ppo_overrides(tiny_qwen2_dir, data, first, 2, *QUIET, server=sglang_server), first)
    files = [first / "rollouts" / f"step_{s}.parquet" for s in (1, 2)]
    written: dict[tuple, list[list[float]]] = {}  # greedy: a group's samples share their ids
    for s in read_rollout_files(files):
        key = (s.uid, tuple(s.prompt_ids), tuple(s.response_ids))
        written.setdefault(key, []).append(s.rollout_logprobs)
    second = tmp_path / "second"
    stored = [
        f"data.rollout_files=[{','.join(map(str, files))}]",
        "data.stored_fraction=0.5",
        "algorithm.rollout_correction.rollout_is=token",
    ]
    args = ppo_overrides(tiny_qwen2_dir, data, second, 2, *QUIET, *stored, server=sglang_server)
    run_train(args, second)
    metrics = metrics_by_step(second)
    for step in (1, 2):
        got = records(second, step)
        from_files = [r for r in got if r["uid"].startswith("stored:")]
        assert len({r["uid"] for r in from_files}) == 8 and len(from_files) == 32
        assert len({r["uid"] for r in got}) == 16 and len(got) == 64
        for r in from_files:
            key = (
                r["uid"].removeprefix("stored:"),
                tuple(r["prompt_ids"]),
                tuple(r["response_ids"]),
            )
            assert r["response_logprobs"] in written[key]
        assert metrics[step]["stored/groups"] == 8 and metrics[step]["stored/samples"] == 32
        assert "rollout_corr/rollout_is_mean" in metrics[step]
