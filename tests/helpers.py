"""Launching worker scripts under torchrun from tests."""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import ClassVar

import pytest

from rlhf.utils import free_port
from tests.rank_launcher import launch_ranks

REPO = Path(__file__).resolve().parents[1]
WORKERS = REPO / "tests" / "distributed" / "workers"
# What the schema's defaults were before they became verl's (docs/from-verl.md): tests that
# build a config from the defaults and measured their values with these keep them
SEED_DEFAULTS = [
    "algorithm.kl_ctrl.type=adaptive",
    "algorithm.use_kl_in_reward=null",
    "actor_rollout_ref.rollout.n=2",
    "data.max_response_length=32",
    "actor_rollout_ref.rollout.val_kwargs.temperature=1.0",
    "trainer.early_stop.rollback_val_ratio=0.9",
]


def torchrun_command(nproc: int, port: int) -> list[str]:
    """`python -m torch.distributed.run` for `nproc` local ranks meeting on `port`; the
    script (or `-m module`) and its arguments follow."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(nproc),
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(port),
    ]


def run_torchrun(
    script: str, nproc: int, args: list[str], timeout_s: float = 600, torchrun: bool = False
) -> None:
    """Run `tests/distributed/workers/<script>` on `nproc` gloo ranks; raise with its log.

    The ranks are forked from the session's preloaded fork server (tests/rank_launcher.py);
    `torchrun=True` starts them with real torchrun instead (the bootstrap tests).
    """
    port = free_port()
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    # Output goes to a file, not a pipe: helper daemons a worker leaves behind (e.g. torch's
    # shared-memory manager, which lives as long as an SGLang server uses its tensors)
    # would keep a pipe open and make the wait hang.
    with tempfile.NamedTemporaryFile(mode="w+", suffix=".log") as log:
        if torchrun:
            cmd = [*torchrun_command(nproc, port), str(WORKERS / script), *args]
            proc = subprocess.run(
                cmd, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s
            )
            code = proc.returncode
        else:
            try:
                code = launch_ranks(
                    WORKERS / script, nproc, args, env, Path(log.name), port, timeout_s
                )
            except TimeoutError as hung:
                log.seek(0)
                raise TimeoutError(
                    f"{hung}; the ranks' log and stacks:\n{log.read()[-8000:]}"
                ) from None
        log.seek(0)
        output = log.read()
    if code != 0:
        raise AssertionError(f"{script} on {nproc} ranks exited {code}:\n{output[-8000:]}")


def run_worker_layouts(
    script: str, layouts: dict[str, tuple[int, list[str]]], model_dir: Path, out_dir: Path
) -> dict[str, dict]:
    """Run worker `script` on `model_dir` once per layout, name -> (ranks, extra arguments).

    Each run writes `<out_dir>/<name>.pt` (its `--out`); returns them loaded, by name.
    """
    import torch

    found = {}
    for name, (nproc, extra) in layouts.items():
        path = out_dir / f"{name}.pt"
        run_torchrun(script, nproc, ["--model", str(model_dir), "--out", str(path), *extra])
        found[name] = torch.load(path, weights_only=False)
    return found


def rlhf_train(
    config: str | Path, args: list[str], log_dir: Path, timeout_s: float = 900, nproc: int = 1
) -> subprocess.CompletedProcess:
    """`rlhf-train --config config ARGS` from the repository (under torchrun with `nproc`
    processes when more than one); its exit code and output.

    stdout and stderr go to files in `log_dir` (train.out, train.err), not to pipes: a run
    that fed an SGLang server through the tensor transport leaves torch's shared-memory
    manager behind until its reaper stops it (rlhf.weight_sync.shm_reaper: once no server
    maps the run's files), and the manager holds the run's stdout and stderr open.
    """
    launcher = torchrun_command(nproc, free_port()) if nproc > 1 else [sys.executable]
    cmd = [*launcher, "-m", "rlhf.cli.train", "--config", str(config), *args]
    log_dir.mkdir(parents=True, exist_ok=True)
    out, err = log_dir / "train.out", log_dir / "train.err"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    with out.open("w") as stdout, err.open("w") as stderr:
        proc = subprocess.run(
            cmd, cwd=REPO, env=env, stdout=stdout, stderr=stderr, timeout=timeout_s
        )
    return subprocess.CompletedProcess(cmd, proc.returncode, out.read_text(), err.read_text())


def ppo_overrides(
    model_dir, data, run_dir: Path, steps: int, *extra: str, server=None
) -> list[str]:
    """A short, deterministic (greedy) quickstart PPO run on `data` = (train, val) Parquet.

    `server`: an `SGLangServer` the run uses as an external server (`rollout.server_urls`;
    the run loads its weights into it first) instead of launching its own.
    """
    train, val = data
    external = [f"actor_rollout_ref.rollout.server_urls=[{server.url}]"] if server else []
    return [
        f"actor_rollout_ref.model.path={model_dir}",
        f"data.train_files={train}",
        f"data.val_files={val}",
        f"trainer.default_local_dir={run_dir}",
        f"trainer.total_training_steps={steps}",
        "trainer.save_freq=2",
        "trainer.test_freq=2",
        "trainer.logger=[console]",
        "actor_rollout_ref.rollout.temperature=0",  # greedy: deterministic rollouts
        "actor_rollout_ref.actor.optim.lr=1e-3",  # large enough that every step matters
        *external,
        *extra,
    ]


def python_output(code: str, env: dict[str, str] | None = None) -> str:
    """Stdout of `python -c code` in a fresh interpreter, with `env` over this process's
    environment (a launched server's, `ServerLaunch.env`); fails the test on a non-zero exit."""
    done = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def processes_on(model_dir) -> set[int]:
    """Live processes whose command line names `model_dir` (SGLang servers launched on it)."""
    import psutil

    found = set()
    for proc in psutil.process_iter(["cmdline", "status"]):
        if proc.info["status"] != psutil.STATUS_ZOMBIE and str(model_dir) in " ".join(
            proc.info["cmdline"] or []
        ):
            found.add(proc.pid)
    return found


def metrics_by_step(run_dir: Path) -> dict[int, dict]:
    """The last logged metrics of every step (a resumed run re-logs the steps it redoes)."""
    import json

    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {row["step"]: row for row in rows}


class _LengthJudge(http.server.BaseHTTPRequestHandler):
    """A reward endpoint (`reward.url` protocol) scoring each item by its response's length;
    every batch it received is kept in `received`."""

    received: ClassVar[list] = []

    def do_POST(self):
        items = json.loads(self.rfile.read(int(self.headers["Content-Length"])))["items"]
        _LengthJudge.received.append(items)
        body = json.dumps({"scores": [float(len(i["response"])) for i in items]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@contextlib.contextmanager
def length_judge() -> Iterator[tuple[str, list]]:
    """A running length judge on 127.0.0.1: (its URL, the batches it receives)."""
    _LengthJudge.received = []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _LengthJudge)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_port}/score", _LengthJudge.received
    finally:
        server.shutdown()


@contextlib.contextmanager
def small_filesystem(path: Path, size_kib: int, read_only: bool = False):
    """A real file system of `size_kib` KiB (tmpfs) mounted at `path`, for full-disk and
    read-only faults; the test is skipped where mounting is not permitted (not root)."""
    path.mkdir(parents=True, exist_ok=True)
    options = f"size={size_kib}k" + (",ro" if read_only else "")
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True, text=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=True)


def torch_shm_state() -> tuple[set[int], set[Path]]:
    """The torch_shm_manager processes on this machine and torch's files in /dev/shm."""
    import psutil

    managers = {
        p.pid for p in psutil.process_iter(["name"]) if p.info["name"] == "torch_shm_manager"
    }
    return managers, set(Path("/dev/shm").glob("torch_*"))


def shm_left_since(before: tuple[set[int], set[Path]], timeout_s: float = 30.0):
    """What appeared since `before` and is still there `timeout_s` later (the reaper stops
    a run's manager once no server maps its files): (managers, files)."""
    deadline = time.monotonic() + timeout_s
    while True:
        managers, files = torch_shm_state()
        left = managers - before[0], files - before[1]
        if not any(left) or time.monotonic() > deadline:
            return left
        time.sleep(0.5)
