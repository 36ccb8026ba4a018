"""Held launches (`rlhf.rollout.keyed_launch --held`, `rlhf.rollout.sglang_server.hold_servers`):
a server's process imports before its command line is known (the garbage collector off),
then runs the order it gets, or is let go having started nothing; and the trainer holds its
servers before it imports torch (`rlhf.cli.train.held_servers`)."""

from __future__ import annotations

import json
import os
import stat
import time
from pathlib import Path

import pytest

from rlhf import sglang_api
from rlhf.config.engine_args import launched_rollout
from rlhf.config.loader import load_config
from rlhf.config.schema import RolloutConfig
from rlhf.rollout import sglang_server
from rlhf.rollout.server_group import ServerGroup
from rlhf.rollout.sglang_server import (
    KEYED_LAUNCH,
    ServerLaunch,
    SGLangServer,
    build_server_args,
    hold_run_servers,
    hold_servers,
    release_held,
    server_env,
)
from rlhf.utils import OMP_SPIN, cpu_threads
from tests.helpers import REPO, python_output

KEY = "held-launch-test-key"
PROBE = """\
import gc, json, os, sys
from pathlib import Path
if __name__ != "__main__":  # the held import (it runs again as __main__)
    Path(os.environ["PROBE_DIR"], "collector").write_text(str(gc.isenabled()))
    Path(os.environ["PROBE_DIR"], "imported").write_text(str(os.getpid()))
    print("printed while importing", flush=True)
else:
    Path(os.environ["PROBE_DIR"], "collector").write_text(
        f"{gc.isenabled()} {gc.get_freeze_count() > 0}"
    )
    title = open("/proc/self/cmdline").read().replace("\\0", " ").split()
    ordered = os.environ.get("PROBE_ORDERED")
    print(json.dumps([os.getpid(), sys.argv[1:], ordered, title]), flush=True)
    Path(os.environ["PROBE_DIR"], "ran").write_text(str(os.getpid()))
"""


@pytest.fixture
def probe(tmp_path, monkeypatch) -> dict[str, str]:
    """A module `held_probe` that marks its import and its run in `tmp_path`; the environment
    a launch of it adds."""
    (tmp_path / "held_probe.py").write_text(PROBE)
    yield {"PYTHONPATH": f"{tmp_path}{os.pathsep}{REPO}", "PROBE_DIR": str(tmp_path)}
    release_held()


def wait_for(path: Path, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.02)


def test_a_held_launch_imports_first_then_runs_its_order(probe, tmp_path, monkeypatch):
    hold_servers(probe, 1, module="held_probe")
    held = sglang_server._HELD[0].proc
    wait_for(tmp_path / "imported")  # imported, and waiting for its order
    time.sleep(0.2)
    assert held.poll() is None and not (tmp_path / "ran").exists()
    # it imported with the garbage collector off (rlhf.utils.collection_deferred)
    assert (tmp_path / "collector").read_text() == "False"
    # what the run's environment holds when the server starts is what the module sees
    monkeypatch.setenv(sglang_api.API_KEY_ENV, KEY)
    monkeypatch.setenv("PROBE_ORDERED", "yes")
    launch = ServerLaunch([*KEYED_LAUNCH, "held_probe", "--x", "1"], probe, "http://unused")
    server = SGLangServer(launch, tmp_path / "logs" / "probe.log").start()
    assert server.proc is held and not sglang_server._HELD
    assert held.wait(timeout=60) == 0
    lines = server.log_path.read_text().splitlines()
    assert lines[0] == "printed while importing"  # the imports' output, copied in first
    pid, argv, ordered, title = json.loads(lines[-1])
    assert (pid, argv, ordered) == (held.pid, ["--x", "1", f"--api-key={KEY}"], "yes")
    # and runs with it on, what the imports made frozen out of its scans
    assert (tmp_path / "collector").read_text() == "True True"
    # `ps` shows what a launch that was not held would show: its module and arguments
    assert title[-4:] == ["rlhf.rollout.keyed_launch", "held_probe", "--x", "1"]
    assert not any(KEY in word for word in title)
    assert stat.S_IMODE(server.log_path.stat().st_mode) == 0o600  # the key is in its log
    server.stop()


def test_a_held_launch_let_go_starts_nothing(probe, tmp_path):
    hold_servers(probe, 2, module="held_probe")
    first, second = (h.proc for h in sglang_server._HELD)
    wait_for(tmp_path / "imported")
    assert first.stdin is not None
    first.stdin.close()  # end of file instead of an order: it exits
    assert first.wait(timeout=60) == 0
    release_held()  # killed, whether still importing or waiting
    assert second.poll() is not None and not sglang_server._HELD
    assert not (tmp_path / "ran").exists()


def test_only_a_launch_of_the_same_module_and_environment_takes_a_held_one(probe, tmp_path):
    hold_servers(probe, 1, module="held_probe")
    held = sglang_server._HELD[0].proc
    other_env = ServerLaunch([*KEYED_LAUNCH, "held_probe"], {**probe, "X": "1"}, "http://a")
    other_module = ServerLaunch([*KEYED_LAUNCH, "json.tool", "--help"], probe, "http://b")
    for launch in (other_env, other_module):
        server = SGLangServer(launch, tmp_path / "other.log").start()
        assert server.proc is not held and server.proc is not None
        server.proc.wait(timeout=60)
        server.stop()
    assert [h.proc for h in sglang_server._HELD] == [held]


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_the_run_holds_the_launches_its_node_makes(monkeypatch, device):
    """What `hold_run_servers` holds is what the server group then launches, to the
    environment: the first process of a node holds its `num_servers` servers' launches."""
    held: list[tuple[dict[str, str], int]] = []
    monkeypatch.setattr(sglang_server, "hold_servers", lambda env, n: held.append((env, n)))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    aro = load_config(REPO / "configs" / "quickstart_cpu.yaml").actor_rollout_ref
    aro.rollout.num_servers = 2
    assert hold_run_servers(aro, device, local_rank=0) == 2
    rollout, model = launched_rollout(aro), aro.model.path
    launch = build_server_args(rollout, model, port=1, device=device, cpu_threads=cpu_threads(2))
    assert held == [(launch.env, 2)]
    if device == "cpu":
        assert launch.env["OMP_NUM_THREADS"] == str(cpu_threads(2))
    group = ServerGroup(rollout, model, log_dir="logs", device=device, gpus_per_node=2)
    started: list[ServerLaunch] = []
    monkeypatch.setattr(SGLangServer, "start", lambda self: started.append(self.launch))
    group._launch_servers()
    assert [s.env for s in started] == [launch.env] * 2
    assert hold_run_servers(aro, device, local_rank=1) == 0  # another process's node
    aro.rollout.server_urls = ["http://127.0.0.1:1"]
    assert hold_run_servers(aro, device, local_rank=0) == 0  # nothing launched
    assert len(held) == 1


def test_the_trainer_holds_its_servers_before_it_imports_torch():
    """`rlhf-train` reads and checks its config and holds its servers' launches without
    torch: its import is a second of the servers' start."""
    code = (
        "import sys\n"
        "from rlhf.cli import train\n"
        f"args = train.parse_args(['--config', '{REPO / 'configs' / 'quickstart_cpu.yaml'}'])\n"
        "cfg, _ = train.resolve(args)\n"
        "from rlhf.rollout import sglang_server\n"
        "sglang_server.hold_servers = lambda env, n: print('held', n)\n"
        "with train.held_servers(cfg.actor_rollout_ref, cfg.trainer.device):\n"
        "    print('torch' in sys.modules)\n"
    )
    assert python_output(code).split() == ["held", "1", "False"]


def test_a_cpu_trainer_shortens_the_openmp_spin_before_it_loads_torch(monkeypatch):
    """Idle OpenMP threads spin ~1 ms, not torch's default ~6 ms, before they sleep: set in
    the trainer's environment before torch loads OpenMP, and its servers inherit it."""
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    code = (
        "import os, sys\n"
        "from rlhf.cli import train\n"
        f"args = train.parse_args(['--config', '{REPO / 'configs' / 'quickstart_cpu.yaml'}'])\n"
        "cfg, _ = train.resolve(args)\n"
        "def held(*args):\n"
        "    print(os.environ.get('GOMP_SPINCOUNT'), 'torch' in sys.modules)\n"
        "    raise SystemExit(0)\n"
        "train.held_servers = held\n"
        "train.run(cfg)\n"
    )
    assert python_output(code).split() == [OMP_SPIN["GOMP_SPINCOUNT"], "False"]


def test_a_cpu_server_gets_the_short_openmp_spin_unless_its_environment_has_one(monkeypatch):
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    rollout = RolloutConfig()
    assert server_env(rollout, "cpu", 2)["GOMP_SPINCOUNT"] == OMP_SPIN["GOMP_SPINCOUNT"]
    assert "GOMP_SPINCOUNT" not in server_env(rollout, "cuda", 2)
    monkeypatch.setenv("GOMP_SPINCOUNT", "7")  # the user's, or the trainer's: inherited
    assert "GOMP_SPINCOUNT" not in server_env(rollout, "cpu", 2)


def test_server_env_is_the_launch_environment():
    rollout = RolloutConfig()
    launch = build_server_args(rollout, "/m", port=1, device="cpu", cpu_threads=3)
    assert launch.env == server_env(rollout, "cpu", 3)
