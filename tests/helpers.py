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
from collections.abc import Iterator
from pathlib import Path
from typing import ClassVar

import pytest

from rlhf.utils import free_port

REPO = Path(__file__).resolve().parents[1]
WORKERS = REPO / "tests" / "distributed" / "workers"


def run_torchrun(script: str, nproc: int, args: list[str], timeout_s: float = 600) -> None:
    """Run `tests/distributed/workers/<script>` on `nproc` gloo ranks; raise with its log."""
    cmd = [
        sys.executable, "-m", "torch.distributed.run",
        "--nproc-per-node", str(nproc),
        "--master-addr", "127.0.0.1",
        "--master-port", str(free_port()),
        str(WORKERS / script), *args,
    ]  # fmt: skip
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    # Output goes to a file, not a pipe: helper daemons a worker leaves behind (e.g. torch's
    # shared-memory manager, which lives as long as an SGLang server uses its tensors)
    # would keep a pipe open and make the wait hang.
    with tempfile.TemporaryFile(mode="w+") as log:
        proc = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s)
        log.seek(0)
        output = log.read()
    if proc.returncode != 0:
        raise AssertionError(
            f"{script} on {nproc} ranks exited {proc.returncode}:\n{output[-8000:]}"
        )


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


def ppo_overrides(model_dir, data, run_dir: Path, steps: int, *extra: str) -> list[str]:
    """A short, deterministic (greedy) quickstart PPO run on `data` = (train, val) Parquet."""
    train, val = data
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
        *extra,
    ]


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
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)],
                             capture_output=True, text=True)  # fmt: skip
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=True)
