"""`rlhf-rollout` on the real CPU server: stored rollouts from an HF model, batch by batch,
resumable, refused onto a directory generated with other settings.

The engine log-probs written are checked against transformers' log-probs of the same
tokens (an independent forward of the model the server holds)."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlhf.data.rollout_files import read_rollout_files
from rlhf.quickstart.data import write_quickstart_data
from rlhf.sglang_api import update_weights_from_disk
from tests.helpers import REPO


def rollout(model, prompts, out, url, *extra: str) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable,
        "-m",
        "rlhf.cli.rollout",
        str(model),
        "--data",
        str(prompts),
        "--out",
        str(out),
        "--server-url",
        url,
        "--batch-size",
        "4",
        "--max-response-length",
        "8",
        "data.max_prompt_length=64",
        *extra,
    ]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)


def hf_logprobs(model_dir, prompt: list[int], response: list[int]) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
    positions = torch.arange(len(prompt) - 1, len(prompt) + len(response) - 1)
    return logp[positions, torch.tensor(response)]


def test_stored_rollouts_from_a_model_resume_and_refuse_other_settings(
    tiny_qwen2_dir, sglang_server, tmp_path
):
    train, _ = write_quickstart_data(tmp_path / "data", num_train=6, num_val=1)
    update_weights_from_disk(sglang_server.url, str(tiny_qwen2_dir), 0)  # the model given
    out = tmp_path / "stored"
    proc = rollout(tiny_qwen2_dir, train, out, sglang_server.url, "--n", "2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    parts = sorted(out.glob("part_*.parquet"))
    assert [p.name for p in parts] == ["part_00000.parquet", "part_00001.parquet"]
    assert json.loads((out / "rollout.json").read_text())["n"] == 2
    samples = read_rollout_files(
        parts, vocab_size=len(AutoTokenizer.from_pretrained(tiny_qwen2_dir))
    )
    assert len(samples) == 12 and len({s.uid for s in samples}) == 6
    assert all(re.fullmatch(r"rollout-[0-9a-f]{16}-\d", s.uid) for s in samples)
    assert {s.policy_version for s in samples} == {0} and {s.score for s in samples} <= {0.0, 1.0}
    for s in samples[:4]:
        assert len(s.rollout_logprobs) == len(s.response_ids) > 0
        expected = hf_logprobs(tiny_qwen2_dir, s.prompt_ids, s.response_ids)
        torch.testing.assert_close(
            torch.tensor(s.rollout_logprobs, dtype=torch.float64),
            expected.double(),
            atol=1e-3,
            rtol=0,
        )

    first_written = parts[0].stat().st_mtime_ns
    parts[1].unlink()  # as if killed during the second batch
    proc = rollout(tiny_qwen2_dir, train, out, sglang_server.url, "--n", "2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert parts[0].stat().st_mtime_ns == first_written  # stored batches are not redone
    resumed = read_rollout_files(sorted(out.glob("part_*.parquet")))
    assert [s.uid for s in resumed] == [s.uid for s in samples]  # the groups named alike

    # another prompt file's output shares no uid with this one: the two train together
    other = write_quickstart_data(tmp_path / "other", num_train=2, num_val=1, seed=5)[0]
    proc = rollout(tiny_qwen2_dir, other, tmp_path / "other_out", sglang_server.url, "--n", "2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    both = read_rollout_files([*parts, *sorted((tmp_path / "other_out").glob("part_*"))])
    assert len({s.uid for s in both}) == 8

    proc = rollout(tiny_qwen2_dir, train, out, sglang_server.url, "--n", "3")
    assert proc.returncode == 2
    assert "generated with other settings (n: 2 -> 3)" in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("rlhf-rollout: error: ")
