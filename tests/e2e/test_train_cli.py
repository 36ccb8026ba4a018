"""`rlhf-train` as a user runs it: --print-config, one-line config errors, a real run."""

from __future__ import annotations

import json

import pytest
import yaml

from rlhf.config import load_config
from rlhf.quickstart.data import write_quickstart_data
from rlhf.rollout.sglang_server import sglang_shm_files
from tests.helpers import REPO, processes_on, rlhf_train

CONFIG = str(REPO / "configs" / "quickstart_cpu.yaml")


def test_print_config_prints_resolved_yaml(tmp_path):
    args = ["--print-config", "actor_rollout_ref.rollout.n=4", "trainer.experiment_name=x"]
    proc = rlhf_train(CONFIG, args, tmp_path, timeout_s=600)
    assert proc.returncode == 0, proc.stderr
    printed = yaml.safe_load(proc.stdout)
    assert printed["actor_rollout_ref"]["rollout"]["n"] == 4
    assert printed["trainer"]["experiment_name"] == "x"


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        (
            "actor_rollout_ref.rollout.temprature=0.5",
            "did you mean 'actor_rollout_ref.rollout.temperature'?",
        ),
        ("data.train_batch_size=eight", "data.train_batch_size: expected int, got 'eight'"),
        (
            "actor_rollout_ref.actor.ppo_mini_batch_size=3",
            "is not divisible by actor_rollout_ref.actor.ppo_mini_batch_size (3)",
        ),
    ],
)
def test_config_errors_are_one_line_without_traceback(override, expected, tmp_path):
    proc = rlhf_train(CONFIG, ["--print-config", override], tmp_path, timeout_s=600)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("rlhf-train: config error: ")
    assert expected in lines[0]
    assert "Traceback" not in proc.stderr


def test_missing_data_file_is_a_clear_error(tiny_qwen2_dir, tmp_path):
    args = [
        f"actor_rollout_ref.model.path={tiny_qwen2_dir}",
        f"trainer.default_local_dir={tmp_path / 'run'}",
        f"data.train_files={tmp_path / 'missing.parquet'}",
    ]
    proc = rlhf_train(CONFIG, args, tmp_path, timeout_s=600)
    assert proc.returncode == 2
    assert "missing.parquet" in proc.stderr and "Traceback" not in proc.stderr


def test_missing_model_is_a_clear_error(tmp_path):
    args = [
        f"actor_rollout_ref.model.path={tmp_path / 'nothing'}",
        f"trainer.default_local_dir={tmp_path / 'run'}",
    ]
    proc = rlhf_train(CONFIG, args, tmp_path, timeout_s=600)
    assert proc.returncode == 2
    assert "actor_rollout_ref.model.path=" in proc.stderr and "no config.json" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.slow(reason="a whole run that launches and stops its own SGLang server (~22 s)")
def test_one_step_run_writes_its_files_and_leaves_no_server(tiny_qwen2_dir, tmp_path):
    run_dir = tmp_path / "run"
    train, _ = write_quickstart_data(tmp_path / "data", num_train=20, num_val=4)
    overrides = [
        f"actor_rollout_ref.model.path={tiny_qwen2_dir}",
        f"trainer.default_local_dir={run_dir}",
        f"data.train_files={train}",
        "data.val_files=null",
        "trainer.total_training_steps=1",
    ]
    before = processes_on(tiny_qwen2_dir)
    shm_before = sglang_shm_files()
    proc = rlhf_train(CONFIG, overrides, tmp_path, timeout_s=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert sglang_shm_files() - shm_before == set()  # its /dev/shm files went with it
    assert f"checkpoints: {run_dir / 'checkpoints'}" in proc.stdout
    output = proc.stdout + proc.stderr
    assert "external SGLang servers" not in output
    assert "held since its imports" in output  # the launch held before the checks was taken
    # SGLang's model registry imported the served model's module alone (all of them log the
    # ones that fail to import on the CPU)
    server_log = (run_dir / "logs" / "sglang_server_0.log").read_text()
    assert "Load weight end" in server_log and "Ignore import error" not in server_log
    # the device ledger's phases (rlhf.memory.ledger), as a GPU run would hold them: the
    # launched servers slept while the models were built (free_cache_engine), were loaded
    # with the actor's weights, and held their memory while generating only
    phases = ("build", "gen", "old_log_prob", "update_critic", "update_actor")
    table = [line.split(maxsplit=1) for line in output.splitlines()]
    rows = {words[0]: words[1] for words in table if len(words) == 2 and words[0] in phases}
    assert "sglang" not in rows["build"] and "actor: grads optimizer params" in rows["build"]
    assert "sglang: cuda_graph kv_cache weights" in rows["gen"]
    for phase in ("old_log_prob", "update_critic", "update_actor"):
        assert "sglang" not in rows[phase], rows[phase]

    assert load_config(run_dir / "config.yaml") == load_config(CONFIG, overrides)
    lines = (run_dir / "rollouts" / "step_1.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    cfg = load_config(CONFIG)
    prompts, n = cfg.data.train_batch_size, cfg.actor_rollout_ref.rollout.n
    assert len(records) == prompts * n
    assert len({r["uid"] for r in records}) == prompts  # n samples of each sampled prompt
    assert all(0 <= r["prompt_index"] < 20 for r in records)
    for r in records:
        assert 1 <= len(r["response_ids"]) <= 16
        assert len(r["response_logprobs"]) == len(r["response_ids"])
        assert r["score"] in (0.0, 1.0)  # the arithmetic rule reward
        assert r["policy_version"] == 0  # launched servers hold model.path: version 0
    assert (run_dir / "logs" / "sglang_server_0.log").stat().st_size > 0
    (metrics,) = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert metrics["step"] == 1
    assert metrics["critic/score/mean"] == pytest.approx(
        sum(r["score"] for r in records) / len(records)
    )
    assert metrics["response_length/max"] == max(len(r["response_ids"]) for r in records)
    assert metrics["timing_s/gen"] > 0
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert (run_dir / "checkpoints" / "global_step_1" / "COMPLETE").is_file()
    assert processes_on(tiny_qwen2_dir) - before == set()  # none of the run's is left
