"""Model rewards in whole `rlhf-train` runs (CPU, the session's shared SGLang server).

- A batch mixing rule rows (the arithmetic rule) and model rows (a tiny local
  `*ForSequenceClassification` reward model, `reward.model_path`) logs rewards of both
  styles, and every model row's logged score is HF's pooled logit of its prompt + response.
- `trainer.save_hf` leaves HF copies of the actor and the critic in the checkpoint. The
  actor's transformers logits equal the checkpoint's Megatron forward (rlhf-convert verify,
  1e-5). The critic's is a `*ForTokenClassification` model: run by transformers on the
  next step's logged rollouts, its values average to the `critic/values/mean` the trainer
  logged for that step (computed with the checkpointed critic).
- `reward.url` with `reward.model_scores_every_row` (verl's `reward_model.enable`) sends
  every row, rule rows too, to an endpoint (a judge this test runs on 127.0.0.1, scoring by
  response length); a dead endpoint fails the run with one line naming it.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForSequenceClassification, AutoModelForTokenClassification

from rlhf.data.parquet import write_rows
from rlhf.quickstart.arithmetic import make_problems
from rlhf.quickstart.tiny_model import TinyModelSpec, tiny_hf_config
from rlhf.quickstart.tokenizer import build_tiny_tokenizer
from rlhf.utils import free_port
from tests.helpers import REPO, length_judge, metrics_by_step, ppo_overrides, rlhf_train

CONFIG = str(REPO / "configs" / "quickstart_cpu.yaml")


@pytest.fixture(scope="module")
def mixed_data(tmp_path_factory) -> tuple[Path, Path]:
    """Quickstart problems, every odd row scored by a model instead of the rule."""
    out = tmp_path_factory.mktemp("mixed_data")
    rows = make_problems(40, seed=0)
    for i, row in enumerate(rows):
        if i % 2:
            row["reward_model"] = {**row["reward_model"], "style": "model"}
            row["data_source"] = "judged"
    return write_rows(rows[:32], out / "train.parquet"), write_rows(rows[32:], out / "val.parquet")


@pytest.fixture(scope="module")
def reward_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("reward_model")
    tokenizer = build_tiny_tokenizer()
    config = tiny_hf_config(TinyModelSpec(), len(tokenizer), tokenizer.pad_token_id, 1)
    config.num_labels = 1
    torch.manual_seed(7)
    AutoModelForSequenceClassification.from_config(config).save_pretrained(out)
    return out


def train(args: list[str], log_dir: Path) -> subprocess.CompletedProcess:
    return rlhf_train(CONFIG, args, log_dir)


def records(run_dir: Path, step: int) -> list[dict]:
    lines = (run_dir / "rollouts" / f"step_{step}.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


@pytest.mark.slow(reason="a whole run scored by a reward model")
def test_mixed_rule_and_model_rows(tiny_qwen2_dir, mixed_data, reward_dir, sglang_server, tmp_path):
    run_dir = tmp_path / "run"
    args = ppo_overrides(
        tiny_qwen2_dir,
        mixed_data,
        run_dir,
        2,
        f"reward.model_path={reward_dir}",
        server=sglang_server,
    )
    proc = train([*args, "trainer.save_hf=true", "trainer.save_freq=1"], tmp_path / "logs")
    assert proc.returncode == 0, proc.stderr[-4000:]
    metrics = metrics_by_step(run_dir)
    step = metrics[1]
    assert step["reward/rule/count"] > 0 and step["reward/model/count"] > 0
    assert math.isfinite(step["reward/model/mean"]) and math.isfinite(step["critic/score/mean"])
    assert math.isfinite(metrics[0]["val/test_score/judged"])  # validation scores both too
    hf = AutoModelForSequenceClassification.from_pretrained(reward_dir).eval()
    judged = [r for r in records(run_dir, 1) if r["prompt_index"] % 2]
    assert judged
    for record in judged:
        ids = torch.tensor([record["prompt_ids"] + record["response_ids"]])
        with torch.no_grad():
            expected = hf(ids).logits[0, 0].item()
        assert record["score"] == pytest.approx(expected, abs=1e-4)
    ruled = [r for r in records(run_dir, 1) if r["prompt_index"] % 2 == 0]
    assert {r["score"] for r in ruled} <= {0.0, 1.0}
    # each step's samples come from the weights the previous step loaded (synchronous rollout)
    assert {r["policy_version"] for r in records(run_dir, 1)} == {0}
    assert {r["policy_version"] for r in records(run_dir, 2)} == {1}

    checkpoint = run_dir / "checkpoints" / "global_step_1"
    verify = [
        sys.executable,
        "-m",
        "rlhf.cli.convert",
        "verify",
        str(checkpoint / "actor_hf"),
        str(checkpoint / "actor"),
        "--tol",
        "1e-5",
    ]
    checked = subprocess.run(verify, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert checked.returncode == 0 and ": OK" in checked.stdout, checked.stderr[-3000:]
    assert critic_values_mean(checkpoint / "critic_hf", records(run_dir, 2)) == pytest.approx(
        metrics[2]["critic/values/mean"], abs=1e-5
    )


def critic_values_mean(critic_hf: Path, samples: list[dict]) -> float:
    """The mean over every response token of an exported critic's value, as transformers
    computes it: token t's value is the output at the position before t."""
    critic = AutoModelForTokenClassification.from_pretrained(critic_hf).eval()
    total, count = 0.0, 0
    for sample in samples:
        prompt, response = sample["prompt_ids"], sample["response_ids"]
        with torch.no_grad():
            values = critic(torch.tensor([prompt + response])).logits[0, :, 0]
        total += values[len(prompt) - 1 : len(prompt) - 1 + len(response)].sum().item()
        count += len(response)
    return total / count


@pytest.mark.slow(reason="a whole run scored by an endpoint")
def test_reward_endpoint_and_a_dead_one(tiny_qwen2_dir, mixed_data, sglang_server, tmp_path):
    run_dir = tmp_path / "remote"
    with length_judge() as (url, _):
        args = ppo_overrides(
            tiny_qwen2_dir, mixed_data, run_dir, 1, f"reward.url={url}", server=sglang_server
        )
        every_row = ["reward.model_scores_every_row=true", "trainer.val_before_train=false"]
        proc = train([*args, *every_row], tmp_path / "remote_logs")
    assert proc.returncode == 0, proc.stderr[-4000:]
    # verl's reward_model.enable: the judge scores the rule rows too (the rule would say 0/1)
    judged = records(run_dir, 1)
    assert {r["prompt_index"] % 2 for r in judged} == {0, 1}
    assert all(r["score"] == float(len(r["response_text"])) for r in judged)
    assert metrics_by_step(run_dir)[1]["reward/model/count"] == len(judged)

    dead = f"http://127.0.0.1:{free_port()}/score"
    args = ppo_overrides(
        tiny_qwen2_dir, mixed_data, tmp_path / "dead", 1, f"reward.url={dead}", server=sglang_server
    )
    proc = train(
        [*args, "reward.request_retries=1", "trainer.val_before_train=false"],
        tmp_path / "dead_logs",
    )
    assert proc.returncode == 1
    (line,) = [x for x in proc.stderr.splitlines() if x.startswith("rlhf-train:")]
    assert line.startswith(f"rlhf-train: reward failed: reward endpoint {dead}: unreachable")
    assert "after 2 attempts" in line
