"""No SGLang process outlives an engine that exits by exception or by SIGTERM (real servers).

Kept apart from test_rollout_engine.py so that its shared server (whose idle scheduler
keeps a core busy) is stopped before these start theirs.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from tests.e2e.test_rollout_engine import assert_gone, engine_processes, start_engine
from tests.helpers import REPO


def test_exception_inside_engine_stops_servers(tiny_qwen2_dir, tmp_path):
    with pytest.raises(ZeroDivisionError), start_engine(tiny_qwen2_dir, tmp_path) as engine:
        pids = engine_processes(engine)
        pgid = engine.group.servers[0].proc.pid
        _ = 1 / 0
    assert_gone(pids)
    with pytest.raises(ProcessLookupError):
        os.killpg(pgid, 0)


SIGTERM_SCRIPT = """
import json, sys, time
sys.path.insert(0, {repo!r})
from tests.e2e.test_rollout_engine import engine_processes, start_engine
engine = start_engine({model!r}, {logs!r})
print(json.dumps([engine.group.servers[0].proc.pid, engine_processes(engine)]), flush=True)
time.sleep(600)
"""


def test_sigterm_stops_servers_and_exits_143(tiny_qwen2_dir, tmp_path):
    script = SIGTERM_SCRIPT.format(repo=str(REPO), model=str(tiny_qwen2_dir), logs=str(tmp_path))
    stderr = tmp_path / "stderr.txt"
    with stderr.open("w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=err, text=True
        )
    try:
        line = proc.stdout.readline()
        assert line, stderr.read_text()
        pgid, pids = json.loads(line)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == -signal.SIGTERM, stderr.read_text()[-3000:]
    finally:
        proc.kill()
    assert_gone(pids)
    with pytest.raises(ProcessLookupError):
        os.killpg(pgid, 0)
