"""free_port hands out ports below the ephemeral range, free at the time, not tied to seeds."""

from __future__ import annotations

import random
import socket
from pathlib import Path

from rlhf import utils
from rlhf.utils import PORT_RANGE_LOW, free_port


def test_port_is_below_the_ephemeral_range_and_bindable():
    ephemeral_low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for _ in range(20):
        port = free_port()
        assert PORT_RANGE_LOW <= port < ephemeral_low
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


def test_seeding_the_global_rng_does_not_repeat_ports():
    random.seed(0)
    first = [free_port() for _ in range(5)]
    random.seed(0)
    second = [free_port() for _ in range(5)]
    assert first != second


def test_taken_ports_are_skipped(monkeypatch):
    taken = socket.socket()
    taken.bind(("0.0.0.0", 0))
    taken.listen()
    busy = taken.getsockname()[1]
    choices = iter([busy, busy, busy + 1 if busy + 1 < 65536 else busy - 1])
    monkeypatch.setattr(utils, "PORT_RANGE_LOW", 1024)
    monkeypatch.setattr(utils._port_rng, "randint", lambda lo, hi: next(choices))
    try:
        assert free_port() != busy
    finally:
        taken.close()


def test_falls_back_to_the_kernel_without_a_range_below_it(monkeypatch):
    monkeypatch.setattr(utils, "_ephemeral_low", lambda: PORT_RANGE_LOW + 10)
    port = free_port()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))
