"""Job 9 of the project's SGLang plugin (rlhf/rollout/sglang_plugin.py): in a launched
server's processes Megatron-Core is not importable, so SGLang's debug dumper, which its
model runner imports, no longer imports it (about 1 s of each server's engine start here)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from rlhf.config.schema import RolloutConfig
from rlhf.rollout.sglang_server import build_server_args

pytest.importorskip("sglang")
pytest.importorskip("megatron.core")

DUMPER = """
import sys
from rlhf.rollout import sglang_plugin
sglang_plugin.register()
from sglang.srt.debug_utils import dumper
print("megatron plugin available", dumper._MegatronPlugin._available)
print("megatron imported", any(name.startswith("megatron") for name in sys.modules
                               if sys.modules[name] is not None))
"""


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_a_servers_processes_do_not_import_megatron(device):
    """What a server's process does at start (`load_plugins`), with the launcher's
    environment, then the import SGLang's model runner makes."""
    launch = build_server_args(RolloutConfig(), "model", port=1, device=device)
    env = {**os.environ, **launch.env}
    done = subprocess.run(
        [sys.executable, "-c", DUMPER], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "megatron plugin available False" in done.stdout, done.stdout
    assert "megatron imported False" in done.stdout, done.stdout


def test_without_the_plugin_sglang_imports_megatron():
    """The same import outside a launched server (the plugin does nothing there)."""
    env = {k: v for k, v in os.environ.items() if k != "RLHF_SGLANG_BOUND_STORES"}
    done = subprocess.run(
        [sys.executable, "-c", DUMPER], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "megatron plugin available True" in done.stdout, done.stdout
