"""Exact resume of a sampled run: temperature 1 with `rollout.sampling_seed`, killed as it
publishes its step-2 checkpoint and resumed, logs the step-3 rollouts and metrics of the
uninterrupted run.

Each request carries a seed derived from (sampling_seed, the prompt's uid epoch:row, sample
index) and the CPU server samples with it whatever else shares its batch
(`rlhf.rollout.seeded_sampling`); the engine's log-probs of a token depend on its batch only
through float rounding (measured up to 5e-7), so they are compared within 1e-5 and
everything else exactly as the greedy resume test does."""

from __future__ import annotations

import pytest

from rlhf.data.rollout_files import read_rollout_files
from rlhf.quickstart.data import write_quickstart_data
from tests.e2e.test_ppo_training import VOLATILE, kill_after_publishing, run_train
from tests.helpers import metrics_by_step, ppo_overrides

SAMPLED = [
    "actor_rollout_ref.rollout.temperature=1.0",
    "actor_rollout_ref.rollout.sampling_seed=11",
    "actor_rollout_ref.rollout.val_kwargs.do_sample=true",
    "actor_rollout_ref.rollout.val_kwargs.n=2",
]


def stored(run_dir, step: int) -> list[tuple]:
    files = [run_dir / "rollouts" / f"step_{step}.parquet"]
    return [(s.uid, s.response_ids, s.score, s.rollout_logprobs) for s in read_rollout_files(files)]


@pytest.mark.slow(reason="a sampled run, the same run killed at its checkpoint, its resume")
def test_sampled_run_resumed_after_a_kill_logs_the_uninterrupted_run(
    tiny_qwen2_dir, sglang_server, tmp_path
):
    data = write_quickstart_data(tmp_path / "data", num_train=32, num_val=8)
    whole = tmp_path / "uninterrupted"
    run_train(ppo_overrides(tiny_qwen2_dir, data, whole, 3, *SAMPLED, server=sglang_server), whole)
    resumed = tmp_path / "resumed"
    args = ppo_overrides(tiny_qwen2_dir, data, resumed, 3, *SAMPLED, server=sglang_server)
    kill_after_publishing(args, resumed, step=2)
    assert "resumed from" in run_train(args, resumed)

    expected, got = stored(whole, 3), stored(resumed, 3)
    assert [s[:3] for s in got] == [s[:3] for s in expected]  # uids, tokens, scores
    for (*_, lp_got), (*_, lp_expected) in zip(got, expected):
        assert lp_got == pytest.approx(lp_expected, abs=1e-5)
    groups: dict[str, set] = {}
    for uid, tokens, *_ in expected:
        groups.setdefault(uid, set()).add(tuple(tokens))
    assert max(len(g) for g in groups.values()) > 1  # sampled: a prompt's answers differ

    rows, reference = metrics_by_step(resumed), metrics_by_step(whole)
    assert sorted(rows) == sorted(reference) == [0, 1, 2, 3]
    for key, value in reference[3].items():
        if not key.startswith(VOLATILE):
            assert rows[3][key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    assert "val/test_score/all" in rows[3]  # sampled validation (at the end), seeded too
