"""A real SGLang server on CPU, launched from .venv (the session's shared one): tokens and
log-probs, parity with HF transformers on the same weights, `engine_kwargs.sglang` in effect.
(A server that cannot start: tests/e2e/test_launch_servers.py; the lifecycle of servers
that run: tests/e2e/test_rollout_engine.py.)"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlhf import sglang_api
from rlhf.rollout.client import generate
from tests.conftest import SHARED_SERVER_KWARGS

PROMPTS = [
    [{"role": "user", "content": "Sam has 3 apples and gets 4 more. How many apples now?"}],
    [{"role": "user", "content": "Zoe has 9 coins and loses 2. How many coins are left?"}],
]
MAX_NEW = 8


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


def test_server_generates_and_matches_transformers(tiny_qwen2_dir, sglang_server):
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen2_dir)
    prompts = [
        tokenizer.apply_chat_template(
            p, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        for p in PROMPTS
    ]
    url = sglang_server.url
    sglang_api.update_weights_from_disk(url, str(tiny_qwen2_dir), version=0)  # others synced
    sampled = generate(url, prompts, {"n": 3, "temperature": 1.0, "max_new_tokens": MAX_NEW})
    greedy = generate(
        url, prompts, {"temperature": 0.0, "max_new_tokens": MAX_NEW, "ignore_eos": True}
    )
    info = sglang_api.server_info(url)

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
    # the server runs with the engine_kwargs.sglang it was launched with
    assert {k: info[k] for k in SHARED_SERVER_KWARGS} == SHARED_SERVER_KWARGS
    assert "sglang" in sglang_server.log_path.read_text().lower()


@pytest.mark.reliability
def test_no_process_of_a_launched_server_listens_beyond_loopback(sglang_server):
    """SGLang's scheduler hosts a torch.distributed store for its process group; torch binds
    such stores to every interface, unless the project's SGLang plugin
    (rlhf/rollout/sglang_plugin.py) binds it to its host. Every listening socket of the
    server's processes (HTTP server, scheduler store, ...) is on a loopback address."""
    import ipaddress

    import psutil

    root = psutil.Process(sglang_server.proc.pid)
    listening = [
        (proc.pid, " ".join(proc.cmdline())[:60], conn.laddr)
        for proc in [root, *root.children(recursive=True)]
        for conn in proc.net_connections(kind="inet")
        if conn.status == psutil.CONN_LISTEN
    ]
    assert len(listening) >= 2, listening  # the HTTP server and the scheduler's store
    exposed = [item for item in listening if not ipaddress.ip_address(item[2].ip).is_loopback]
    assert not exposed, exposed


def test_the_cpu_servers_processes_are_forked_and_share_its_imports(sglang_server):
    """The project's SGLang plugin has a CPU server fork its scheduler and detokenizer
    (job 8 of rlhf/rollout/sglang_plugin.py) instead of spawning fresh interpreters that
    import SGLang again: each shares anonymous pages (the imported modules) with the
    server's first process, so its proportional share of them is well below their size.
    Spawned, each held its own (Pss_Anon = Anonymous)."""
    from pathlib import Path

    import psutil

    root = psutil.Process(sglang_server.proc.pid)
    server = next(p for p in [root, *root.children(recursive=True)] if p.children())
    shares = {}
    for child in server.children():
        rollup = Path(f"/proc/{child.pid}/smaps_rollup").read_text().splitlines()[1:]
        fields = dict(line.split(":")[0:2] for line in rollup)
        anonymous, share = (int(fields[k].split()[0]) for k in ("Anonymous", "Pss_Anon"))
        shares[child.name()] = share / anonymous
    assert len(shares) == 2, shares  # the scheduler and the detokenizer
    assert all(share < 0.8 for share in shares.values()), shares


@pytest.mark.slow(reason="a server of its own, held as the trainer holds them, imports traced")
def test_a_held_server_imports_its_start_before_its_order(tiny_qwen2_dir, tmp_path):
    """A held launch of SGLang's server (`rlhf.rollout.keyed_launch`) imports, besides its
    module, what the server's run imports next (`PRELOADS`), its plugins loaded first: once
    its order comes, its processes import little more (traced by PYTHONPROFILEIMPORTTIME;
    everything before launch_server's own warning was imported while held), and never
    Megatron-Core (the plugin's guard in place before SGLang's debug dumper tries it)."""
    from rlhf.config.rollout import RolloutConfig
    from rlhf.rollout.sglang_server import (
        ServerLaunch,
        SGLangServer,
        build_server_args,
        hold_servers,
        release_held,
    )
    from rlhf.utils import free_port

    built = build_server_args(
        RolloutConfig(dtype="float32"),
        tiny_qwen2_dir,
        port=free_port(),
        device="cpu",
        max_total_tokens=4096,
    )
    launch = ServerLaunch(built.argv, {**built.env, "PYTHONPROFILEIMPORTTIME": "1"}, built.url)
    hold_servers(launch.env, 1)
    try:
        with SGLangServer(launch, tmp_path / "server.log").start() as server:
            server.wait_healthy(300)
            assert generate(server.url, [[1, 2, 3]], {"max_new_tokens": 2})
            lines = server.log_path.read_text().splitlines()
    finally:
        release_held()
    run = next(i for i, line in enumerate(lines) if "launch_server' is still supported" in line)
    held = [line for line in lines[:run] if line.startswith("import time:")]
    after = [line for line in lines[run:] if line.startswith("import time:")]
    print(f"imported while held: {len(held)}; after the order: {len(after)}")
    assert len(held) > 3000
    assert len(after) < len(held) / 10
    names = [line.split("|")[-1].strip() for line in held + after]
    assert not [name for name in names if name.startswith("megatron.core.")]  # tried, refused
