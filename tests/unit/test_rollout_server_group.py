"""Server group process handling with stand-in servers (a small HTTP script that, like SGLang,
runs a child process in its group): stop on exit/exception/SIGTERM, restart + on_restart,
the restart limit, external servers, re-issue after a kill. Real SGLang: tests/e2e."""

from __future__ import annotations

import http.server
import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import ClassVar

import psutil
import pytest

from rlhf.config.schema import RolloutConfig
from rlhf.rollout import server_group
from rlhf.rollout.engine import SamplingParams, SGLangEngine
from rlhf.rollout.server_group import ServerGroup
from rlhf.rollout.sglang_server import ServerLaunch, SGLangServer, live_group
from rlhf.utils import free_port
from tests.helpers import REPO

STAND_IN = textwrap.dedent(
    """
    import http.server, json, pathlib, subprocess, sys, time

    port, seen, delay_s = int(sys.argv[1]), pathlib.Path(sys.argv[2]), float(sys.argv[3])
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])

    def sample(ids, sampling, j):  # sample j of a prompt: [its first token, j]
        out = [ids[0], j] if sampling.get("max_new_tokens", 1) else []
        logprobs = [[-1.0 - k, t, None] for k, t in enumerate(out)]
        return {"output_ids": out, "meta_info": {
            "finish_reason": {"type": "length"}, "output_token_logprobs": logprobs}}

    def answer(body):  # one request carrying n, or SGLang's batch form (one sample an item)
        ids, sampling = body["input_ids"], body["sampling_params"]
        if isinstance(ids[0], list):
            samplings = sampling if isinstance(sampling, list) else [sampling] * len(ids)
            return [sample(x, p, ids[:k].count(x)) for k, (x, p) in enumerate(zip(ids, samplings))]
        n = sampling.get("n", 1)
        items = [sample(ids, sampling, j) for j in range(n)]
        return items if n > 1 else items[0]

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            with seen.open("a") as f:
                f.write(f"{port}\\n")
            time.sleep(delay_s)
            data = json.dumps(answer(body)).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()
    """
)


@pytest.fixture
def stand_in(tmp_path, monkeypatch) -> Path:
    """Make the group launch the stand-in script; returns the file logging POSTs."""
    script = tmp_path / "stand_in_server.py"
    script.write_text(STAND_IN)
    seen = tmp_path / "posts.txt"
    monkeypatch.setattr(server_group, "build_server_args", stand_in_launcher(script, seen, 0.0))
    return seen


def stand_in_launcher(script: Path, seen: Path, delay_s: float):
    def build(rollout, model_path, *, port, device, host="127.0.0.1", **kwargs) -> ServerLaunch:
        argv = [sys.executable, str(script), str(port), str(seen), str(delay_s)]
        return ServerLaunch(argv=argv, env={}, url=f"http://{host}:{port}")

    return build


def rollout(**kwargs) -> RolloutConfig:
    defaults = {"server_startup_timeout_s": 30.0, "request_retries": 2, "retry_backoff_s": 0.05}
    return RolloutConfig(**{**defaults, **kwargs})


def group_pids(group: ServerGroup) -> list[int]:
    pids = []
    for server in group.servers:
        root = psutil.Process(server.proc.pid)
        pids += [root.pid, *(c.pid for c in root.children(recursive=True))]
    return pids


def assert_gone(pids: list[int]) -> None:
    alive = [p for p in pids if psutil.pid_exists(p) and _not_zombie(p)]
    assert alive == [], f"processes left behind: {alive}"


def _not_zombie(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_normal_exit_stops_every_process_and_restores_sigterm(stand_in, tmp_path):
    before = signal.getsignal(signal.SIGTERM)
    with ServerGroup(rollout(num_servers=2), "m", log_dir=tmp_path / "logs") as group:
        group.start()
        assert len(set(group.server_urls)) == 2 and group.generate_urls == group.server_urls
        assert group.health() == dict.fromkeys(group.server_urls, True)
        assert signal.getsignal(signal.SIGTERM) != before
        pids = group_pids(group)
        assert len(pids) == 4  # each server and its child
    assert_gone(pids)
    assert signal.getsignal(signal.SIGTERM) == before
    assert sorted(p.name for p in (tmp_path / "logs").iterdir()) == [
        "sglang_server_0.log",
        "sglang_server_1.log",
    ]


def test_exception_inside_the_engine_stops_every_process(stand_in, tmp_path):
    engine = SGLangEngine(rollout(), "m", log_dir=tmp_path, device="cpu")
    with pytest.raises(KeyError, match="boom"), engine:
        pids = group_pids(engine.group)
        raise KeyError("boom")
    assert_gone(pids)


def test_restart_calls_on_restart_then_stops_at_the_limit(stand_in, tmp_path, caplog):
    restarted: list[str] = []
    group = ServerGroup(
        rollout(max_server_restarts=1), "m", log_dir=tmp_path, on_restart=restarted.append
    )
    with group.start(), caplog.at_level(logging.WARNING, logger="rlhf.rollout.server_group"):
        (url,) = group.server_urls
        kill_group(group)
        assert group.recover(url) == url
        assert restarted == [url] and group.health() == {url: True}
        assert any(url in r.getMessage() and "restarting" in r.getMessage() for r in caplog.records)
        kill_group(group)
        with pytest.raises(RuntimeError, match="max_server_restarts=1") as info:
            group.recover(url)
    assert url in str(info.value) and "sglang_server_0.log" in str(info.value)
    assert restarted == [url]


def kill_group(group: ServerGroup, index: int = 0) -> None:
    proc = group.servers[index].proc
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)


def test_killed_server_mid_batch_is_restarted_and_requests_reissued(tmp_path, monkeypatch):
    script = tmp_path / "stand_in_server.py"
    script.write_text(STAND_IN)
    seen = tmp_path / "posts.txt"
    monkeypatch.setattr(server_group, "build_server_args", stand_in_launcher(script, seen, 1.0))
    restarted: list[str] = []
    with SGLangEngine(
        rollout(num_servers=2), "m", log_dir=tmp_path, on_restart=restarted.append
    ) as engine:
        prompts, params, out = [[10 + i] for i in range(6)], SamplingParams(n=2), []
        batch = threading.Thread(target=lambda: out.append(engine.generate(prompts, params)))
        batch.start()
        wait_for(lambda: seen.exists())
        kill_group(engine.group, 0)
        batch.join(timeout=120)
        assert not batch.is_alive()
    (samples,) = out
    assert restarted == [engine.server_urls[0]]
    assert [s.prompt_index for s in samples] == [i // 2 for i in range(12)]
    assert [s.response_ids for s in samples] == [[10 + i // 2, i % 2] for i in range(12)]
    assert engine.last_stats.retried_requests >= 1


def test_the_engine_sends_each_server_its_samples_in_one_call(stand_in, tmp_path):
    with SGLangEngine(rollout(num_servers=2), "m", log_dir=tmp_path, device="cpu") as engine:
        stand_in.write_text("")  # the start's readiness checks
        samples = engine.generate([[10 + i] for i in range(6)], SamplingParams(n=2))
    assert [s.response_ids for s in samples] == [[10 + i // 2, i % 2] for i in range(12)]
    posts = stand_in.read_text().split()  # each server: its prompts' prefill, its samples
    assert len(posts) == 4 and len(set(posts)) == 2


def wait_for(condition, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met"
        time.sleep(0.05)


def test_unreachable_external_url_fails_naming_it(tmp_path):
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(ConnectionError, match="after 3 attempts") as info:
        SGLangEngine(rollout(server_urls=[url]), log_dir=tmp_path)
    assert url in str(info.value) and "server_urls" in str(info.value)


def test_external_servers_are_used_but_never_stopped_or_restarted(stand_in, tmp_path):
    build = stand_in_launcher(tmp_path / "stand_in_server.py", stand_in, 0.0)
    launch = build(None, None, port=free_port(), device="cpu")
    url = launch.url
    external = subprocess.Popen(launch.argv, start_new_session=True)
    try:
        wait_for(lambda: server_group.sglang_api.healthy(url, timeout_s=1.0))
        with ServerGroup(rollout(server_urls=[url]), log_dir=tmp_path) as group:
            group.start()
            assert group.server_urls == group.generate_urls == [url]
            assert group.servers == []
        assert external.poll() is None  # stop() leaves it running
        with ServerGroup(rollout(server_urls=[url]), log_dir=tmp_path) as group:
            group.start()
            os.killpg(external.pid, signal.SIGKILL)
            external.wait(timeout=10)
            with pytest.raises(RuntimeError, match="never restarted") as info:
                group.recover(url)
            assert url in str(info.value)
            assert group.health() == {url: False}
    finally:
        _kill_quietly(external.pid)


def _kill_quietly(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        return


def test_sigterm_handler_stops_servers_and_chains_to_previous_handler(stand_in, tmp_path):
    received: list[int] = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: received.append(signum))
    try:
        group = ServerGroup(rollout(), "m", log_dir=tmp_path).start()
        pids = group_pids(group)
        signal.raise_signal(signal.SIGTERM)
        assert received == [signal.SIGTERM]
        assert_gone(pids)
        assert signal.getsignal(signal.SIGTERM) != group._on_sigterm
    finally:
        signal.signal(signal.SIGTERM, previous)


SIGTERM_SCRIPT = """
import json, sys, time
from pathlib import Path
sys.path.insert(0, {repo!r})
from rlhf.rollout import server_group
from rlhf.rollout.engine import SGLangEngine
from tests.unit.test_rollout_server_group import rollout, stand_in_launcher
tmp = Path({tmp!r})
server_group.build_server_args = stand_in_launcher(tmp / "stand_in_server.py", tmp / "p", 0.0)
engine = SGLangEngine(rollout(num_servers=2), "m", log_dir=tmp)
print(json.dumps([s.proc.pid for s in engine.group.servers]), flush=True)
time.sleep(600)
"""


def test_sigterm_in_a_child_process_stops_servers_and_exits_143(tmp_path):
    (tmp_path / "stand_in_server.py").write_text(STAND_IN)
    script = SIGTERM_SCRIPT.format(repo=str(REPO), tmp=str(tmp_path))
    stderr = tmp_path / "stderr.txt"
    with stderr.open("w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=err, text=True
        )
    try:
        pgids = json.loads(proc.stdout.readline())
        children = [c.pid for pid in pgids for c in psutil.Process(pid).children(recursive=True)]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == -signal.SIGTERM, stderr.read_text()[-3000:]
    finally:
        proc.kill()
    assert_gone(pgids + children)
    for pgid in pgids:  # zombies waiting for init to reap them run nothing: not counted
        assert live_group(pgid) == set()


def test_a_server_that_fails_but_still_runs_is_waited_for_then_restarted(
    stand_in, tmp_path, monkeypatch
):
    """A crashed SGLang server's process can run for seconds more: recovery waits for it to
    die (or for SETTLE_S) and restarts it, instead of taking it for alive and calling it
    again at once (the flaky "Connection refused" of the distributed transport)."""
    monkeypatch.setattr(server_group, "SETTLE_S", 3.0)
    restarted: list[str] = []
    group = ServerGroup(
        rollout(max_server_restarts=2), "m", log_dir=tmp_path, on_restart=restarted.append
    )
    with group.start():
        (url,) = group.server_urls
        dying = group.servers[0].proc
        os.kill(dying.pid, signal.SIGSTOP)  # no answers, still a live process
        threading.Timer(1.5, os.killpg, (dying.pid, signal.SIGKILL)).start()
        assert group.recover(url) == url
        assert restarted == [url] and group.health() == {url: True}
        hung = group.servers[0].proc
        os.kill(hung.pid, signal.SIGSTOP)  # never answers again, never dies by itself
        start = time.monotonic()
        assert group.recover(url) == url
        assert time.monotonic() - start >= 3.0
        assert restarted == [url, url] and group.health() == {url: True}


class _Starting(http.server.BaseHTTPRequestHandler):
    """A server whose /health answers at once but whose scheduler serves only from the
    fourth /generate on (SGLang's /health, by contrast, answers a second late)."""

    generates: ClassVar[list[int]] = []

    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        self.generates.append(1)
        ready = len(self.generates) > 3
        self.send_response(200 if ready else 503)
        body = b'{"text": "x"}' if ready else b"{}"
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.mark.parametrize("router", [False, True])
def test_a_starting_server_is_ready_when_it_generates(tmp_path, router):
    """`wait_healthy` returns once a one-token /generate answers (a router: once its /health
    answers), polling every `HEALTH_POLL_S`."""
    _Starting.generates = []
    fake = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Starting)
    threading.Thread(target=fake.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{fake.server_port}"
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    server = SGLangServer(ServerLaunch(argv=sleeper, env={}, url=url), tmp_path / "log")
    try:
        server.start().wait_healthy(30, router=router)
    finally:
        server.stop()
        fake.shutdown()
    assert len(_Starting.generates) == (0 if router else 4)
