"""A single-process run's torch.distributed store listens on 127.0.0.1 only.

torch's TCPStore binds every interface whatever host it is given; `bound_store` hands it a
socket bound to the host (127.0.0.1 here). Checked on the kernel's own table of listening sockets.
"""

from __future__ import annotations

import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from rlhf.distributed.stores import bound_store

pytestmark = pytest.mark.reliability

LISTEN = "0A"  # TCP state code in /proc/net/tcp*
PRIVATE_WORLD = """
import torch, torch.distributed as dist
from rlhf.distributed.bootstrap import _init_process_group
_init_process_group(torch.device("cpu"), 1)
print("PORT", dist.distributed_c10d._get_default_store().underlying_store.port, flush=True)
input()  # the parent reads the socket table meanwhile
"""


def listening_addresses(port: int) -> set[str]:
    """Local addresses (hex, as the kernel writes them) of the sockets listening on `port`."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            address, hex_port = fields[1].rsplit(":", 1)
            if fields[3] == LISTEN and int(hex_port, 16) == port:
                found.add(address)
    return found


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="needs Linux /proc/net/tcp")
def test_store_listens_on_loopback_only_and_serves():
    store = bound_store("127.0.0.1", 2, timedelta(seconds=30))
    assert listening_addresses(store.port) == {"0100007F"}  # 127.0.0.1, nothing on :: / 0.0.0.0
    client = dist.TCPStore("127.0.0.1", store.port, 2, False, timeout=timedelta(seconds=30))
    client.set("written_by", "client")
    assert store.get("written_by") == b"client"


def test_default_tcp_store_binds_every_interface():
    """Why `bound_store` exists; if torch ever binds the host it is given, this fails and
    the workaround can go."""
    plain = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=30))
    assert listening_addresses(plain.port) & {"00000000000000000000000000000000", "00000000"}


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="needs Linux /proc/net/tcp")
def test_a_single_process_run_uses_a_loopback_store():
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    proc = subprocess.Popen(
        [sys.executable, "-c", PRIVATE_WORLD],
        env=env,
        text=True,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    try:
        assert proc.stdout is not None and proc.stdin is not None
        line = next(x for x in proc.stdout if x.startswith("PORT"))
        assert listening_addresses(int(line.split()[1])) == {"0100007F"}
        proc.stdin.write("\n")
        proc.stdin.close()
        assert proc.wait(timeout=60) == 0
    finally:
        proc.kill()


def test_listen_host_keeps_addresses_and_opens_up_names_that_resolve_to_loopback(monkeypatch):
    """A hosts file mapping the machine's own name to 127.0.1.1 would make a store bound to
    "the name" unreachable for the servers on other machines that resolve it correctly."""
    from rlhf.distributed import stores

    names = {"head-node": "127.0.1.1", "gpu-7": "10.1.2.3"}
    monkeypatch.setattr(stores.socket, "gethostbyname", names.__getitem__)
    assert stores.listen_host("127.0.0.1") == "127.0.0.1"
    assert stores.listen_host("10.0.0.5") == "10.0.0.5"
    assert stores.listen_host("::1") == "::1"
    assert stores.listen_host("localhost") == "localhost"
    assert stores.listen_host("head-node") == ""  # every interface
    assert stores.listen_host("gpu-7") == "10.1.2.3"
