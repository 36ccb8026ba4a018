"""torch.distributed stores that listen where they are told, not on every interface.

Kept free of Megatron and the trainer so that SGLang's processes can import it
(`rlhf.rollout.sglang_plugin`).
"""

from __future__ import annotations

import ipaddress
import logging
import socket
from datetime import timedelta

import torch.distributed as dist

log = logging.getLogger(__name__)


def listen_host(address: str) -> str:
    """Where to listen so that peers told `address` reach us: `address` itself, unless it
    is a host name that resolves to a loopback address here (hosts files often map the
    machine's own name to 127.0.1.1) while peers elsewhere resolve it to a real address:
    then every interface, with a warning naming the name."""
    try:
        if ipaddress.ip_address(address):
            return address
    except ValueError:
        pass
    if address == "localhost":
        return address
    try:
        resolved = socket.gethostbyname(address)
    except OSError:
        return address  # binding fails with a message naming it
    if ipaddress.ip_address(resolved).is_loopback:
        log.warning(
            "%s resolves to %s (loopback) on this machine; listening on every interface so "
            "that other machines can reach it; give an IP address to listen on one",
            address,
            resolved,
        )
        return ""
    return resolved


def bound_store(
    host: str, world_size: int, timeout: timedelta, port: int = 0, use_libuv: bool = True
) -> dist.TCPStore:
    """A master TCPStore listening on `host` only (127.0.0.1: only this machine reaches it),
    on `port` (0: a free one; the store's port is `.port`).

    `TCPStore(host, port, is_master=True)` and `init_method="tcp://host:port"` listen on every
    interface whatever the host says: torch's libuv store binds "::" (else "0.0.0.0") in
    `UvTcpServer::makeWithPort` (torch/csrc/distributed/c10d/TCPStoreLibUvBackend.cpp) and
    uses no address of ours. It listens on a socket it is handed instead (`master_listen_fd`,
    used by `LibUVStoreDaemon::init`), so we bind one ourselves; the store takes the
    descriptor over and closes it. Bound before the store exists, the port cannot be taken.
    """
    listen = listen_host(host)
    family = socket.AF_INET6 if ":" in listen else socket.AF_INET
    sock = socket.create_server((listen, port), family=family)
    return dist.TCPStore(
        host,
        sock.getsockname()[1],
        world_size,
        True,
        timeout=timeout,
        wait_for_workers=False,
        master_listen_fd=sock.detach(),
        use_libuv=use_libuv,
    )
