"""Every request to SGLang carries the run's API key, and launched servers require it, given
by environment and never on their command line (a real keyed SGLang server and router:
tests/e2e/test_disaggregated_servers.py).

A real HTTP server on 127.0.0.1 stands in for SGLang: like SGLang started with `--api-key`,
it answers 401 to any route but /health without `Authorization: Bearer <key>`, and it
records the header of every request, so each call path is seen sending it.
"""

from __future__ import annotations

import http.server
import inspect
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import ClassVar

import pytest

from rlhf import sglang_api
from rlhf.cli import launch_servers
from rlhf.config.engine_args import server_argv
from rlhf.config.loader import ConfigError
from rlhf.config.schema import RolloutConfig
from rlhf.errors import UserError
from rlhf.rollout import engine, keyed_launch
from rlhf.rollout.client import GenerateClient, GenerateError, generate, generate_payload
from rlhf.rollout.sglang_server import (
    ServerLaunch,
    SGLangServer,
    build_router_args,
    build_server_args,
)
from tests.helpers import REPO

pytestmark = pytest.mark.reliability

KEY = "test-key-0123"
NOT_ROUTES = {"api_key", "ensure_api_key", "auth_headers"}  # helpers, not SGLang routes


class _KeyedSGLang(http.server.BaseHTTPRequestHandler):
    """SGLang's auth rule (sglang/srt/utils/auth.py) with canned answers; keeps every
    (path, Authorization header) in `seen`."""

    seen: ClassVar[list[tuple[str, str | None]]] = []
    key: ClassVar[str] = KEY

    def _answer(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        request = json.loads(self.rfile.read(length) or b"{}")
        auth = self.headers.get("Authorization")
        _KeyedSGLang.seen.append((self.path, auth))
        if not self.path.startswith("/health") and auth != f"Bearer {self.key}":
            return self._send(401, {"error": "Unauthorized"})
        self._send(200, _canned(self.path, request))

    def _send(self, status: int, body: object) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST = _answer

    def log_message(self, *args: object) -> None:
        pass


def _canned(path: str, request: dict) -> object:
    """A plausible answer for each route the client reads."""
    if path == "/generate":
        n = request.get("sampling_params", {}).get("n", 1)
        meta = {
            "output_token_logprobs": [[-0.5, 7, None]],
            "finish_reason": {"type": "length"},
            "input_token_logprobs": [[None, 1, None], [-0.25, 2, None]],
        }
        items = [{"output_ids": [7], "meta_info": meta} for _ in range(n)]
        return items if n > 1 else items[0]
    if path == "/workers":
        return {"workers": [{"url": "http://w", "is_healthy": True}]}
    return {"success": True, "weight_version": "3"}


@pytest.fixture
def keyed_server() -> Iterator[str]:
    _KeyedSGLang.seen = []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _KeyedSGLang)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        server.server_close()


def call_every_route(url: str) -> set[str]:
    """Each public function of `sglang_api` (every SGLang route but the batched /generate),
    called once; returns their names."""
    calls = {
        "healthy": lambda: sglang_api.healthy(url),
        "router_healthy_workers": lambda: sglang_api.router_healthy_workers(url),
        "server_info": lambda: sglang_api.server_info(url),
        "weight_version": lambda: sglang_api.weight_version(url),
        "generate": lambda: sglang_api.generate(url, {"input_ids": [1]}),
        "generates": lambda: sglang_api.generates(url),
        "prompt_logprobs": lambda: sglang_api.prompt_logprobs(url, [1, 2]),
        "begin_weight_update": lambda: sglang_api.begin_weight_update(url),
        "end_weight_update": lambda: sglang_api.end_weight_update(url),
        "update_weights_from_tensor": lambda: sglang_api.update_weights_from_tensor(
            url, ["blob"], True, 1
        ),
        "init_weights_update_group": lambda: sglang_api.init_weights_update_group(url, {}),
        "update_weights_from_distributed": lambda: sglang_api.update_weights_from_distributed(
            url, ["w"], ["float32"], [[1]], "g", True, 1
        ),
        "destroy_weights_update_group": lambda: sglang_api.destroy_weights_update_group(url, "g"),
        "update_weights_from_disk": lambda: sglang_api.update_weights_from_disk(url, "/m", 1),
        "release_memory_occupation": lambda: sglang_api.release_memory_occupation(url, ["w"]),
        "resume_memory_occupation": lambda: sglang_api.resume_memory_occupation(url, ["w"]),
        "pause_generation": lambda: sglang_api.pause_generation(url),
        "continue_generation": lambda: sglang_api.continue_generation(url),
        "update_weight_version": lambda: sglang_api.update_weight_version(url, "4"),
        "abort_all_requests": lambda: sglang_api.abort_all_requests(url),
        "load_lora_adapter_from_tensors": lambda: sglang_api.load_lora_adapter_from_tensors(
            url, "policy", {"r": 8}, ["blob"]
        ),
        "load_lora_adapter": lambda: sglang_api.load_lora_adapter(url, "policy", "/a"),
        "unload_lora_adapter": lambda: sglang_api.unload_lora_adapter(url, "policy"),
    }
    for call in calls.values():
        call()
    return set(calls)


def test_every_call_path_sends_the_key(keyed_server, monkeypatch):
    monkeypatch.setenv(sglang_api.API_KEY_ENV, KEY)
    called = call_every_route(keyed_server)
    routes = {
        name
        for name, f in inspect.getmembers(sglang_api, inspect.isfunction)
        if f.__module__ == sglang_api.__name__ and not name.startswith("_")
    }
    assert called == routes - NOT_ROUTES  # a new route must be added here (and send the key)
    payloads = [generate_payload([1, 2], {"n": 2}), generate_payload([3], {"n": 1})]
    results = GenerateClient([keyed_server]).generate(payloads)
    assert [len(r.generations) for r in results] == [2, 1]
    assert len(generate(keyed_server, [[1], [2]], {"n": 1})) == 2
    assert len(_KeyedSGLang.seen) >= len(called) + 4
    assert {auth for _, auth in _KeyedSGLang.seen} == {f"Bearer {KEY}"}


def test_without_the_key_only_health_answers(keyed_server, monkeypatch, caplog):
    monkeypatch.delenv(sglang_api.API_KEY_ENV, raising=False)
    assert sglang_api.healthy(keyed_server)
    with pytest.raises(sglang_api.SGLangAPIError, match="answered 401"):
        sglang_api.update_weights_from_disk(keyed_server, "/m", 1)
    assert sglang_api.router_healthy_workers(keyed_server) == set()
    with pytest.raises(GenerateError, match=f"HTTP 401.*set {sglang_api.API_KEY_ENV}"):
        GenerateClient([keyed_server]).generate([generate_payload([1], {"n": 1})])
    assert {auth for _, auth in _KeyedSGLang.seen} == {None}


def test_a_wrong_key_is_refused(keyed_server, monkeypatch):
    monkeypatch.setenv(sglang_api.API_KEY_ENV, "not-the-key")
    with pytest.raises(sglang_api.SGLangAPIError, match="answered 401"):
        sglang_api.weight_version(keyed_server)


def test_launched_command_lines_hold_no_key(monkeypatch):
    """Servers and the router get the key from the environment: `keyed_launch` adds
    `--api-key=KEY` inside their process; their command lines (`ps`) never hold it."""
    monkeypatch.setenv(sglang_api.API_KEY_ENV, KEY)
    server = build_server_args(RolloutConfig(), "/m", port=1, device="cpu").argv
    router = build_router_args(["http://127.0.0.1:1"], port=2, metrics_port=3).argv
    for argv in (server, router):
        assert not any(KEY in a or a.startswith("--api-key") for a in argv)
        assert argv[1:3] == ["-m", "rlhf.rollout.keyed_launch"]
        assert keyed_launch.module_argv(argv[3:]) == (argv[3], [*argv[4:], f"--api-key={KEY}"])
    monkeypatch.delenv(sglang_api.API_KEY_ENV)
    assert keyed_launch.module_argv(server[3:]) == (server[3], server[4:])  # no key: none


def test_keyed_launch_runs_the_module_with_the_key_off_its_command_line(tmp_path):
    """A real process: the module runs as `__main__` and sees `--api-key=KEY` in `sys.argv`,
    while the command line the kernel shows other users has no key."""
    probe = tmp_path / "argv_probe.py"
    probe.write_text(
        "import json, sys\n"
        "cmdline = open('/proc/self/cmdline').read().split('\\0')\n"
        "print(json.dumps([__name__, sys.argv[1:], cmdline]))\n"
    )
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{REPO}"}
    command = [sys.executable, "-m", "rlhf.rollout.keyed_launch", "argv_probe", "--x", "1"]
    for key, added in ((KEY, [f"--api-key={KEY}"]), ("", [])):
        out = subprocess.run(
            command, env={**env, sglang_api.API_KEY_ENV: key}, capture_output=True, text=True
        )
        assert out.returncode == 0, out.stderr
        name, argv, cmdline = json.loads(out.stdout)
        assert (name, argv) == ("__main__", ["--x", "1", *added])
        assert cmdline[1:6] == command[1:] and not any(KEY in a for a in cmdline)


def test_a_run_that_launches_servers_makes_a_key_once(monkeypatch):
    monkeypatch.setenv(sglang_api.API_KEY_ENV, "")  # unset; and the made key goes afterwards
    keys = []

    class Group:  # stands in for the server processes: records the key they would get
        def __init__(self, rollout, *args, **kwargs):
            keys.append(sglang_api.api_key())

        def start(self, wait: bool):
            return self

    monkeypatch.setattr(engine, "ServerGroup", Group)
    engine.SGLangEngine(RolloutConfig(), "/m", log_dir="logs", device="cpu", wait=False)
    engine.SGLangEngine(RolloutConfig(), "/m", log_dir="logs", device="cpu", wait=False)
    assert keys[0] is not None and len(keys[0]) >= 32 and keys == [keys[0]] * 2
    monkeypatch.setenv(sglang_api.API_KEY_ENV, KEY)
    assert sglang_api.ensure_api_key() == KEY  # a given key is used as it is
    monkeypatch.setenv(sglang_api.API_KEY_ENV, "")
    external = RolloutConfig(server_urls=["http://other:30000"])
    engine.SGLangEngine(external, log_dir="logs", device="cpu", wait=False)
    assert keys[-1] is None  # external servers: only a key the user gives


def test_reachable_host_without_a_key_is_refused(monkeypatch, capsys):
    monkeypatch.delenv(sglang_api.API_KEY_ENV, raising=False)
    assert launch_servers.main(["--model", "/m", "--host", "0.0.0.0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and f"export {sglang_api.API_KEY_ENV}=" in err
    for host in ("127.0.0.1", "localhost", "::1", "127.0.1.1"):
        launch_servers.check_exposure(host)
    for host in ("0.0.0.0", "::", "10.1.2.3", "node07"):
        with pytest.raises(UserError, match=host):
            launch_servers.check_exposure(host)
    monkeypatch.setenv(sglang_api.API_KEY_ENV, KEY)
    launch_servers.check_exposure("0.0.0.0")


def test_a_key_starting_with_a_dash_reaches_sglang_and_the_router(monkeypatch):
    """A random key (`ensure_api_key`) starts with '-' about once in 64 runs: SGLang's and
    the router's own parsers read it back whole (as two arguments argparse refused it; so
    does SGLang's `--config FILE`, which is why the key does not go through one)."""
    from sglang_router.launch_router import parse_router_args

    from rlhf.config.engine_args import _sglang_parser

    key = "-dash-first-" + KEY
    monkeypatch.setenv(sglang_api.API_KEY_ENV, key)
    server = build_server_args(RolloutConfig(), "/m", port=1, device="cpu").argv
    _, args = keyed_launch.module_argv(server[3:])
    parsed, _ = _sglang_parser().parse_known_args(args)
    assert parsed.api_key == key
    router = build_router_args(["http://127.0.0.1:1"], port=2, metrics_port=3).argv
    assert parse_router_args(keyed_launch.module_argv(router[3:])[1]).api_key == key


def test_the_key_cannot_be_set_as_an_engine_kwarg():
    for name in ("api_key", "admin_api_key"):
        with pytest.raises(ConfigError, match=f"sglang.{name}: set by the RLHF_SGLANG_API_KEY"):
            server_argv({name: "x"})


def test_a_keyed_server_log_is_private(tmp_path, monkeypatch):
    """SGLang logs its arguments, the key among them: only the run's user may read the log
    of a server that gets a key (from the environment, or on a command line built
    elsewhere)."""
    monkeypatch.delenv(sglang_api.API_KEY_ENV, raising=False)
    sleep = [sys.executable, "-c", "import time; time.sleep(30)"]
    keyed_env = {sglang_api.API_KEY_ENV: KEY}
    cases = [
        (sleep, {}, 0o644),
        (sleep, keyed_env, 0o600),
        ([*sleep, f"--api-key={KEY}"], {}, 0o600),
    ]
    for i, (argv, env, mode) in enumerate(cases):
        log = tmp_path / f"{i}.log"
        log.write_text("an earlier start\n")
        log.chmod(0o644)
        with SGLangServer(ServerLaunch(argv, env, "http://127.0.0.1:1"), log).start():
            assert log.stat().st_mode & 0o777 == mode
