"""The suite's time budget, made visible in every run (CONTRIBUTING.md, "Test budget").

- Each test's time is setup + call + teardown (a module fixture's cost lands on the first
  test that uses it). The terminal summary lists the 20 slowest tests and the tier's total:
  wall time, and the sum of the tests' times (larger than the wall time under xdist).
- A test over `SLOW_TEST_S` that is not marked slow is listed as over budget; the slow marker
  itself must say why its test cannot be smaller: `pytest.mark.slow(reason="...")`.

Nothing here fails a test on time (tests never assert on wall time); the lists are for the
reader of the CI log.
"""

from __future__ import annotations

import time
from collections import defaultdict

import pytest

SLOW_TEST_S = 60.0
SHOWN = 20

_seconds: dict[str, float] = defaultdict(float)
_slow: set[str] = set()
_started = time.monotonic()


def pytest_collection_modifyitems(config, items):
    unexplained = []
    for item in items:
        marker = item.get_closest_marker("slow")
        if marker is None:
            continue
        _slow.add(item.nodeid)
        if not str(marker.kwargs.get("reason", "")).strip():
            unexplained.append(item.nodeid)
    if unexplained:
        raise pytest.UsageError(
            "slow tests must say why they cannot be smaller, pytest.mark.slow(reason=...): "
            + ", ".join(unexplained[:5])
        )


def pytest_sessionstart(session):
    global _started
    _started = time.monotonic()


def pytest_runtest_logreport(report):
    _seconds[report.nodeid] += report.duration
    if "slow" in report.keywords:
        _slow.add(report.nodeid)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if not _seconds:
        return
    tier = config.option.markexpr or "all"
    wall = time.monotonic() - _started
    write = terminalreporter.write_line
    terminalreporter.section(f"time budget: tier '{tier}'")
    write(f"{SHOWN} slowest tests (setup + call + teardown):")
    ranked = sorted(_seconds.items(), key=lambda kv: kv[1], reverse=True)
    for nodeid, seconds in ranked[:SHOWN]:
        write(f"  {seconds:7.1f} s  {nodeid}")
    over = [(n, s) for n, s in ranked if s > SLOW_TEST_S and n not in _slow]
    for nodeid, seconds in over:
        write(f"  over {SLOW_TEST_S:.0f} s without the slow marker: {nodeid} ({seconds:.1f} s)")
    total = sum(_seconds.values())
    write(
        f"tier '{tier}': {len(_seconds)} tests, {wall / 60:.1f} min wall "
        f"({wall:.0f} s; the tests' own times add up to {total:.0f} s)"
    )
