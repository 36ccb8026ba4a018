"""CPU processes keep freed memory mapped (`rlhf.utils.MALLOC_KEPT`): the trainer by
`mallopt` as it starts, its servers by glibc's tunables in their environment. Measured by
the page faults of a loop that allocates, fills and frees ten 512 kB blocks, in a fresh
interpreter, against the same loop with glibc's defaults (after a 1 MB block freed, its
dynamic thresholds: blocks below 1 MB from the heap, and a free top over 2 MB trimmed, so
every round faults the blocks in again: ~990 faults)."""

from __future__ import annotations

import pytest

from rlhf.config.schema import RolloutConfig
from rlhf.rollout.sglang_server import server_env
from rlhf.utils import malloc_kept_env
from tests.helpers import REPO, python_output

# prints the minor page faults of one round of the loop (after a warm-up round)
FAULTS = (
    "def faults():\n"
    "    import ctypes, resource\n"
    "    libc = ctypes.CDLL(None)\n"
    "    libc.malloc.restype = ctypes.c_void_p\n"
    "    libc.free.argtypes = [ctypes.c_void_p]\n"
    "    def round():\n"
    "        blocks = [libc.malloc(512 << 10) for _ in range(10)]\n"
    "        for block in blocks:\n"
    "            ctypes.memset(block, 1, 512 << 10)\n"
    "        for block in reversed(blocks):\n"
    "            libc.free(block)\n"
    "    libc.free(libc.malloc(1 << 20))\n"
    "    round()\n"
    "    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt\n"
    "    for _ in range(8):\n"
    "        round()\n"
    "    print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) // 8)\n"
)
KEPT = 50  # faults of a round at most with memory kept (0 measured; ~990 without)


@pytest.fixture
def defaults(monkeypatch) -> None:
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)


def faults(code: str, env: dict[str, str] | None = None) -> int:
    return int(python_output(FAULTS + code, env).split()[-1])


def test_kept_memory_spares_the_page_faults_of_freed_tensors(defaults):
    assert faults("faults()\n") > 10 * KEPT  # glibc's defaults
    kept = faults("from rlhf.utils import keep_freed_memory\nkeep_freed_memory()\nfaults()\n")
    assert kept <= KEPT


def test_a_cpu_server_starts_with_memory_kept_unless_its_environment_sets_tunables(
    defaults, monkeypatch
):
    rollout = RolloutConfig()
    env = server_env(rollout, "cpu", 2)
    assert env["GLIBC_TUNABLES"] == malloc_kept_env()["GLIBC_TUNABLES"]
    assert faults("faults()\n", env) <= KEPT
    assert "GLIBC_TUNABLES" not in server_env(rollout, "cuda", 2)
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.perturb=0")  # the user's
    assert "GLIBC_TUNABLES" not in server_env(rollout, "cpu", 2)


def test_a_cpu_trainer_keeps_freed_memory_from_its_start(defaults):
    code = (
        "from rlhf.cli import train\n"
        f"args = train.parse_args(['--config', '{REPO / 'configs' / 'quickstart_cpu.yaml'}'])\n"
        "cfg, _ = train.resolve(args)\n"
        "def held(*args):\n"
        "    faults()\n"
        "    raise SystemExit(0)\n"
        "train.held_servers = held\n"
        "train.run(cfg)\n"
    )
    assert faults(code) <= KEPT
