"""Adapter-only weight sync (`rlhf.weight_sync.adapters`) into a real SGLang CPU server
started with LoRA on: a TP=2 or PP=2 actor with rank-4 adapters sends only the adapters,
twice, through each delivery; SGLang serving base + adapter agrees with the trainer's
base + adapters (the probe) and with transformers + peft on the adapters sent."""

from __future__ import annotations

import json
import math

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from rlhf.config.schema import ModelConfig
from tests.distributed.workers.adapter_sync import ALPHA, RANK
from tests.helpers import run_torchrun


@pytest.fixture(scope="module")
def lora_server(tiny_qwen2_dir, tmp_path_factory):
    """An SGLang CPU server on the tiny model with LoRA on, as a LoRA run launches it."""
    from rlhf.config.engine_args import lora_server_kwargs
    from rlhf.config.rollout import EngineKwargs, RolloutConfig
    from rlhf.rollout.sglang_server import SGLangServer, build_server_args
    from rlhf.utils import free_port

    model = ModelConfig(path=str(tiny_qwen2_dir), lora_rank=RANK, lora_alpha=ALPHA)
    kwargs = EngineKwargs(sglang=lora_server_kwargs(model))
    rollout = RolloutConfig(dtype="float32", engine_kwargs=kwargs)
    launch = build_server_args(rollout, tiny_qwen2_dir, port=free_port(), device="cpu")
    assert "--lora-backend" in launch.argv  # the CPU's one backend
    log = tmp_path_factory.mktemp("lora_server") / "server.log"
    with SGLangServer(launch, log).start() as server:
        server.wait_healthy(300)
        yield server


def peft_logprobs(base_dir, adapter_dir, tokens: list[int]) -> torch.Tensor:
    """transformers + peft: log p(token_t | tokens_<t), t >= 1, of base + the adapter."""
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, adapter_dir).eval()
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0, :-1].float()
    return logits.log_softmax(-1).gather(1, torch.tensor(tokens[1:])[:, None])[:, 0]


@pytest.mark.parametrize(
    ("delivery", "tp", "pp"),
    [("tensor", 2, 1), ("distributed", 1, 2), ("disk", 2, 1)],
    ids=["tensor-tp2", "distributed-pp2", "disk-tp2"],
)
def test_adapters_alone_make_sglang_serve_the_policy(
    lora_server, tiny_qwen2_dir, tmp_path, delivery, tp, pp
):
    version = 100 * tp + 10 * pp
    args = ["--hf-dir", str(tiny_qwen2_dir), "--server-url", lora_server.url]
    args += ["--delivery", delivery, "--out-dir", str(tmp_path), "--tp", str(tp)]
    args += ["--pp", str(pp), "--version", str(version)]
    run_torchrun("adapter_sync.py", tp * pp, args)
    report = json.loads((tmp_path / "report.json").read_text())

    # each sync: SGLang's base + the adapter = the trainer's base + adapters
    assert all(sync["probe_diff"] < 1e-4 for sync in report["syncs"]), report
    assert report["reload_diff"] < 1e-4, report  # a restarted server given them again
    assert report["weight_version"] == str(version + 1)
    # what travels: the adapters alone (PEFT A and B of the 7 projections in each layer)
    assert all(sync["num_bytes"] == report["adapter_bytes"] for sync in report["syncs"])
    assert report["adapter_bytes"] < report["full_bytes"] / 4
    # transformers + peft on the adapters sent = SGLang (an independent forward)
    reference = peft_logprobs(tiny_qwen2_dir, tmp_path / "peft", report["probe_tokens"])
    sglang = torch.tensor(report["sglang_logprobs"])
    assert (reference - sglang).abs().max().item() < 1e-4
    assert not math.isclose(float(sglang.sum()), 0.0)
