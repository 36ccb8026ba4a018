"""SGLangEngine on real SGLang CPU servers: n samples per prompt with log-probs and
generation through sglang-router (on the session's shared server, as external servers); a
launched server killed mid-batch is restarted and its requests re-issued, and an exception
inside the engine then leaves no process of either server's tree behind (a process ended by
SIGTERM stops its servers too: tests/unit/test_rollout_server_group.py, with stand-in
servers, as SGLangEngine's group is the same code).
"""

from __future__ import annotations

import logging
import os
import re
import signal
import threading
import time
from pathlib import Path

import psutil
import pytest

from rlhf.config.schema import RolloutConfig
from rlhf.rollout.engine import SamplingParams, SGLangEngine

PROMPTS = [[1, 5, 9, 20 + i] for i in range(4)]
MAX_TOTAL_TOKENS = 8192


def config(**kwargs) -> RolloutConfig:
    fast_retries = {"request_retries": 3, "retry_backoff_s": 0.2}
    return RolloutConfig(dtype="float32", server_startup_timeout_s=300, **fast_retries, **kwargs)


def start_engine(model_dir: Path, log_dir: Path, **kwargs) -> SGLangEngine:
    return SGLangEngine(
        config(),
        model_dir,
        log_dir=log_dir,
        device="cpu",
        max_total_tokens=MAX_TOTAL_TOKENS,
        **kwargs,
    )


def process_tree(pids: list[int]) -> list[int]:
    tree = []
    for pid in pids:
        root = psutil.Process(pid)
        tree += [pid, *(c.pid for c in root.children(recursive=True))]
    return tree


def engine_processes(engine: SGLangEngine) -> list[int]:
    return process_tree([s.proc.pid for s in engine.group.servers])


def assert_gone(pids: list[int]) -> None:
    def running(pid: int) -> bool:
        try:
            return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    assert [p for p in pids if running(p)] == [], "SGLang processes left behind"


def test_n_samples_per_prompt_adjacent_with_logprobs(sglang_server, tmp_path):
    with SGLangEngine(config(server_urls=[sglang_server.url]), log_dir=tmp_path) as engine:
        assert engine.health() == {sglang_server.url: True}
        samples = engine.generate(PROMPTS[:3], SamplingParams(n=3, max_new_tokens=8))
        stats = engine.last_stats
    assert [s.prompt_index for s in samples] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    for s in samples:
        assert 1 <= len(s.response_ids) <= 8
        assert len(s.logprobs) == len(s.response_ids)
        assert all(lp <= 0.0 for lp in s.logprobs)
        assert s.finish_reason in ("length", "stop")
    for i in range(3):
        responses = {tuple(s.response_ids) for s in samples[3 * i : 3 * i + 3]}
        assert len(responses) > 1  # n independent samples, not one sample repeated
    assert (stats.requests, stats.samples) == (3, 9)
    assert stats.engine_s is not None and stats.engine_s > 0


@pytest.mark.slow(reason="starts an SGLang server twice (the kill and its restart), ~22 s each")
def test_server_killed_mid_batch_is_restarted_then_an_exception_stops_both(
    tiny_qwen2_dir, tmp_path, caplog
):
    restarted: list[str] = []
    with (
        pytest.raises(ZeroDivisionError),
        start_engine(tiny_qwen2_dir, tmp_path, on_restart=restarted.append) as engine,
    ):
        (url,) = engine.server_urls
        first = engine_processes(engine)
        pgid = engine.group.servers[0].proc.pid
        samples = kill_mid_batch(engine, tmp_path / "sglang_server_0.log", caplog)
        assert engine.health() == {url: True}
        second = engine_processes(engine)
        _ = 1 / 0
    assert_gone(first + second)
    with pytest.raises(ProcessLookupError):
        os.killpg(pgid, 0)
    assert [s.prompt_index for s in samples] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert all(len(s.logprobs) == len(s.response_ids) >= 1 for s in samples)
    assert restarted == [url]
    messages = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("restarting" in m and url in m for m in messages)
    assert any("re-issuing" in m and url in m for m in messages)
    assert engine.last_stats.retried_requests >= 1


def kill_mid_batch(engine: SGLangEngine, server_log: Path, caplog) -> list:
    """SIGKILL the engine's server once it generates a batch; the batch's samples."""
    offset = server_log.stat().st_size
    params = SamplingParams(n=2, max_new_tokens=400)
    out: list = []
    batch = threading.Thread(target=lambda: out.append(engine.generate(PROMPTS, params)))
    with caplog.at_level(logging.WARNING):
        batch.start()
        wait_for_log(server_log, offset, r"Prefill batch|Decode batch")
        os.killpg(engine.group.servers[0].proc.pid, signal.SIGKILL)
        batch.join(timeout=600)
    assert not batch.is_alive()
    (samples,) = out
    return samples


def wait_for_log(path: Path, offset: int, pattern: str, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with path.open("rb") as f:
            f.seek(offset)
            if re.search(pattern, f.read().decode(errors="replace")):
                return
        time.sleep(0.05)
    raise AssertionError(f"no {pattern!r} in {path} within {timeout_s} s")


def test_generate_through_router(sglang_server, tmp_path):
    routed = config(server_urls=[sglang_server.url], use_router=True)
    with SGLangEngine(routed, log_dir=tmp_path) as engine:
        (router_url,) = engine.generate_urls
        assert router_url not in engine.server_urls
        assert engine.server_urls == [sglang_server.url]
        router_pids = process_tree([engine.group.router.proc.pid])
        samples = engine.generate(PROMPTS[:2], SamplingParams(n=2, max_new_tokens=4))
        assert engine.health()[router_url] is True
    assert [s.prompt_index for s in samples] == [0, 0, 1, 1]
    assert all(len(s.logprobs) == len(s.response_ids) >= 1 for s in samples)
    assert (tmp_path / "sglang_router.log").stat().st_size > 0
    assert_gone(router_pids)
    assert sglang_server.healthy()  # an external server outlives the engine
