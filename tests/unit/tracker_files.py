"""Offline set-up of W&B, MLflow and SwanLab for tests, and readers of what they wrote.

No library is asked what it holds: each reader opens the files the library left on disk
(W&B's offline `run-<id>.wandb` transaction logs, MLflow's file store through its client,
SwanLab's offline `run-<id>.swanlab` record logs), so a test sees what a later
`wandb sync` / `swanlab sync` would upload.
"""

from __future__ import annotations

import json
import socket
import struct
from dataclasses import dataclass, field
from pathlib import Path

import pytest

LEVELDB_BLOCK = 32768  # both logs are LevelDB journals: 32 KiB blocks, 7-byte chunk headers
LEVELDB_HEADER = 7
FULL, LAST = 1, 4


def offline_trackers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Every tracker offline, writing under `tmp_path/trackers` only; the MLflow store is a
    local file store. Returns that folder."""
    root = tmp_path / "trackers"
    for name in ("wandb", "wandb_config", "wandb_cache", "swanlab_root"):
        (root / name).mkdir(parents=True)
    env = {
        "WANDB_MODE": "offline",
        "WANDB_DIR": root / "wandb",
        "WANDB_CONFIG_DIR": root / "wandb_config",
        "WANDB_CACHE_DIR": root / "wandb_cache",
        "WANDB_DATA_DIR": root / "wandb_cache",
        "WANDB_SILENT": "true",
        "MLFLOW_TRACKING_URI": f"file:{root / 'mlruns'}",
        "MLFLOW_ALLOW_FILE_STORE": "true",  # MLflow 3 keeps its file store for such uses
        "SWANLAB_MODE": "offline",
        "SWANLAB_ROOT": root / "swanlab_root",
        # its start-up survey of the machine (hardware, pip packages) costs ~1 s a run
        "SWANLAB_PROBE_HARDWARE": "false",
        "SWANLAB_PROBE_REQUIREMENTS": "false",
    }
    for key, value in env.items():
        monkeypatch.setenv(key, str(value))
    monkeypatch.delenv("SWANLAB_LOG_DIR", raising=False)
    monkeypatch.delenv("SWANLAB_LOGDIR", raising=False)
    return root


def reset_wandb() -> None:
    """Forget the settings W&B read from the environment at its first run in this process
    (its directory among them), so the next test's environment counts."""
    import wandb

    wandb.teardown()


def forbid_remote_connections(monkeypatch: pytest.MonkeyPatch) -> list:
    """Make this process's connections to anything but loopback and local sockets fail;
    returns the list of the refused addresses."""
    refused: list = []
    connect = socket.socket.connect

    def local_only(sock, address):
        host = address[0] if isinstance(address, tuple) else None
        if host is not None and host not in ("127.0.0.1", "::1", "localhost"):
            refused.append(address)
            raise OSError(f"test: no connection to {address}")
        return connect(sock, address)

    monkeypatch.setattr(socket.socket, "connect", local_only)
    return refused


@dataclass
class OfflineRun:
    """One offline run folder's content: the run id, steps and values of one metric."""

    run_id: str
    points: list[tuple[int, float]] = field(default_factory=list)
    resumed: bool = False
    branch_point: dict | None = None  # W&B's rewind target (`resume_from`)


def _journal(path: Path, magic: bytes) -> list[bytes]:
    """The records of a LevelDB journal file (a 7-byte file header, then chunks)."""
    data = path.read_bytes()
    assert data[:4] == magic, f"{path}: not a {magic!r} log"
    records, parts, pos = [], [], LEVELDB_HEADER
    while pos + LEVELDB_HEADER <= len(data):
        if LEVELDB_BLOCK - pos % LEVELDB_BLOCK < LEVELDB_HEADER:  # the block's zero trailer
            pos += LEVELDB_BLOCK - pos % LEVELDB_BLOCK
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + LEVELDB_HEADER])
        parts.append(data[pos + LEVELDB_HEADER : pos + LEVELDB_HEADER + length])
        pos += LEVELDB_HEADER + length
        if kind in (FULL, LAST):
            records.append(b"".join(parts))
            parts = []
    return records


def _key(item) -> str:
    """A W&B history item's name (one with a "/" comes as its parts)."""
    return item.key or "/".join(item.nested_key)


def wandb_runs(wandb_dir: Path, key: str) -> list[OfflineRun]:
    """The offline W&B runs under `wandb_dir` (oldest first) with metric `key`.

    W&B's service process writes a run's file after `finish()` has returned (under load, the
    file still held only its 7-byte header when read right after it, 17 times in 20); it has
    written everything once it is shut down (`reset_wandb`, as at a process's exit), so that
    comes first."""
    from wandb.proto.wandb_internal_pb2 import Record

    reset_wandb()
    runs = []
    for path in sorted(wandb_dir.glob("wandb/offline-run-*/run-*.wandb")):
        run = None
        for raw in _journal(path, b":W&B"):
            record = Record()
            record.ParseFromString(raw)
            if record.WhichOneof("record_type") == "run":
                run = OfflineRun(record.run.run_id, resumed=record.run.resume)
                items = {_key(i): json.loads(i.value_json) for i in record.run.config.update}
                run.branch_point = items.get("_wandb", {}).get("branch_point")
            elif record.WhichOneof("record_type") == "history" and run is not None:
                row = {_key(i): json.loads(i.value_json) for i in record.history.item}
                if key in row:
                    run.points.append((row["_step"], row[key]))
        assert run is not None, f"{path}: no run record"
        runs.append(run)
    return runs


def swanlab_runs(log_dir: Path, key: str) -> list[OfflineRun]:
    """The offline SwanLab runs under `log_dir` (oldest first) with metric `key`."""
    from swanlab.proto.swanlab.record.v1.record_pb2 import Record

    runs = []
    for path in sorted(log_dir.glob("run-*/run-*.swanlab")):
        run = None
        for raw in _journal(path, b":SWL"):
            record = Record()
            record.ParseFromString(raw)
            kind = record.WhichOneof("record_type")
            if kind == "start":
                run = OfflineRun(record.start.id, resumed=bool(record.start.resume))
            elif kind == "scalar" and record.scalar.key == key and run is not None:
                run.points.append((record.scalar.step, record.scalar.value.number))
        assert run is not None, f"{path}: no start record"
        runs.append(run)
    return runs


def mlflow_runs(experiment: str, key: str) -> list[OfflineRun]:
    """The MLflow runs of `experiment` in the store MLFLOW_TRACKING_URI names."""
    from mlflow import MlflowClient

    client = MlflowClient()
    found = client.get_experiment_by_name(experiment)
    assert found is not None, f"no MLflow experiment {experiment!r}"
    runs = []
    for run in client.search_runs([found.experiment_id]):
        history = client.get_metric_history(run.info.run_id, key)
        points = [(m.step, m.value) for m in sorted(history, key=lambda m: m.timestamp)]
        runs.append(OfflineRun(run.info.run_id, points))
    return runs
