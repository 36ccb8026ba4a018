"""A real SGLang server on CPU, launched from .venv: tokens and log-probs, parity with HF
transformers on the same weights, `engine_kwargs.sglang` in effect, and no process left
behind."""

from __future__ import annotations

import psutil
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlhf.config.rollout import EngineKwargs, RolloutConfig
from rlhf.rollout import sglang_api
from rlhf.rollout.client import generate
from rlhf.rollout.sglang_server import SGLangServer, build_server_args
from rlhf.utils import free_port

PROMPTS = [
    [{"role": "user", "content": "Sam has 3 apples and gets 4 more. How many apples now?"}],
    [{"role": "user", "content": "Zoe has 9 coins and loses 2. How many coins are left?"}],
]
MAX_NEW = 8


ENGINE_KWARGS = {"max_running_requests": 7, "chunked_prefill_size": 1024}


def launch(model_dir, log_path) -> SGLangServer:
    args = build_server_args(
        RolloutConfig(dtype="float32", engine_kwargs=EngineKwargs(sglang=dict(ENGINE_KWARGS))),
        model_dir,
        port=free_port(),
        device="cpu",
        max_total_tokens=2048,
    )
    return SGLangServer(args, log_path).start()


def descendants(server: SGLangServer) -> list[psutil.Process]:
    root = psutil.Process(server.proc.pid)
    return [root, *root.children(recursive=True)]


def hf_greedy(model_dir, prompt_ids: list[int]) -> tuple[list[int], list[float]]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt_ids]),
            max_new_tokens=MAX_NEW,
            do_sample=False,
            min_new_tokens=MAX_NEW,
        )
        new = out[0, len(prompt_ids) :]
        logits = model(out).logits[0, len(prompt_ids) - 1 : -1]
    logprobs = torch.log_softmax(logits.float(), -1).gather(-1, new[:, None])[:, 0]
    return new.tolist(), logprobs.tolist()


def test_server_generates_and_matches_transformers(tiny_qwen2_dir, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen2_dir)
    prompts = [
        tokenizer.apply_chat_template(
            p, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        for p in PROMPTS
    ]
    server = launch(tiny_qwen2_dir, tmp_path / "server.log")
    try:
        server.wait_healthy(300)
        procs = descendants(server)
        sampled = generate(
            server.url, prompts, {"n": 3, "temperature": 1.0, "max_new_tokens": MAX_NEW}
        )
        greedy = generate(
            server.url, prompts, {"temperature": 0.0, "max_new_tokens": MAX_NEW, "ignore_eos": True}
        )
        info = sglang_api.server_info(server.url)
    finally:
        server.stop()

    assert len(sampled) == len(prompts) * 3
    for g in sampled:
        assert 1 <= len(g.output_ids) <= MAX_NEW
        assert len(g.logprobs) == len(g.output_ids)
        assert all(lp <= 0.0 for lp in g.logprobs)
        assert g.finish_reason in ("length", "stop")
    for prompt_ids, g in zip(prompts, greedy):
        hf_tokens, hf_logprobs = hf_greedy(tiny_qwen2_dir, prompt_ids)
        assert g.output_ids == hf_tokens
        assert g.logprobs == pytest.approx(hf_logprobs, abs=1e-3)

    assert {k: info[k] for k in ENGINE_KWARGS} == ENGINE_KWARGS  # the server runs with them
    assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in procs)
    assert "sglang" in (tmp_path / "server.log").read_text().lower()


def test_server_that_cannot_start_fails_clearly(tmp_path):
    server = launch(tmp_path / "no_such_model", tmp_path / "bad.log")
    with pytest.raises(RuntimeError, match=r"SGLang server for http://127\.0\.0\.1:\d+ exited"):
        server.wait_healthy(300)
    pgid = server.proc.pid
    server.stop()
    with pytest.raises(ProcessLookupError):
        import os

        os.killpg(pgid, 0)
