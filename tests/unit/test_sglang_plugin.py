"""Job 9 of the project's SGLang plugin (rlhf/rollout/sglang_plugin.py): in a launched
server's processes Megatron-Core is not importable, so SGLang's debug dumper, which its
model runner imports, no longer imports it (about 1 s of each server's engine start here)."""

from __future__ import annotations

import pytest

from rlhf.config.schema import RolloutConfig
from rlhf.rollout.sglang_server import build_server_args
from tests.helpers import python_output

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
    out = python_output(DUMPER, launch.env)
    assert "megatron plugin available False" in out, out
    assert "megatron imported False" in out, out


@pytest.mark.slow(reason="the control: SGLang's model runner imported without the plugin, 13 s")
def test_without_the_plugin_sglang_imports_megatron():
    """The same import outside a launched server (the plugin does nothing there)."""
    out = python_output(DUMPER, {"RLHF_SGLANG_BOUND_STORES": ""})
    assert "megatron plugin available True" in out, out
