"""Test tiers by folder (unit, distributed, e2e, gpu) and shared fixtures."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

TESTS = Path(__file__).parent
TIERS = ("unit", "distributed", "e2e", "gpu")
pytest_plugins = ["tests.suite_budget"]

# Spawned ranks and servers share 2 cores: one thread each keeps them from thrashing.
os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_collection_modifyitems(config, items):
    for item in items:
        tier = Path(item.fspath).relative_to(TESTS).parts[0]
        if tier in TIERS:
            item.add_marker(getattr(pytest.mark, tier))
        if tier == "gpu" and not torch.cuda.is_available():
            item.add_marker(pytest.mark.skip(reason="needs CUDA"))
    # The tests on the shared SGLang server run last (in their order), so that the server,
    # started for the first of them, idles through no other test: its scheduler still
    # polls when idle (~0.15 of a core here).
    items.sort(key=lambda item: "sglang_server" in getattr(item, "fixturenames", ()))


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory) -> Path:
    """A tiny random Qwen2 model + tokenizer on disk (built once per session)."""
    from rlhf.quickstart.tiny_model import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("tiny_qwen2"))


# What the shared server is started with: the settings of test_sglang_cpu_server's check that
# engine_kwargs.sglang reach SGLang, chosen so that they change nothing a test measures.
SHARED_SERVER_KWARGS = {"chunked_prefill_size": 1024, "decode_log_interval": 20}


@pytest.fixture(scope="session")
def sglang_server(tiny_qwen2_dir, tmp_path_factory):
    """One SGLang CPU server on the tiny model (fp32) for the session's tests that neither
    kill nor reconfigure their server; each start costs ~30 s of the 2 cores.

    Tests leave their weights in it: a test loads the weights it needs first (`rlhf-train`
    does so itself with `rollout.server_urls`: see `tests.helpers.ppo_overrides`), and never
    leaves an update window open. Returns the `SGLangServer`.
    """
    from rlhf.config.rollout import EngineKwargs, RolloutConfig
    from rlhf.rollout.sglang_server import SGLangServer, build_server_args
    from rlhf.utils import free_port

    rollout = RolloutConfig(
        dtype="float32", engine_kwargs=EngineKwargs(sglang=dict(SHARED_SERVER_KWARGS))
    )
    launch = build_server_args(
        rollout, tiny_qwen2_dir, port=free_port(), device="cpu", max_total_tokens=32768
    )
    log = tmp_path_factory.mktemp("sglang_server") / "server.log"
    with SGLangServer(launch, log).start() as server:
        server.wait_healthy(300)
        yield server


@pytest.fixture(scope="module")
def cpu_rank():
    """A one-rank gloo world with Megatron's parallel state, seeded 0, for a test module
    that runs models in its own process (torn down after the module)."""
    from rlhf.distributed.bootstrap import init_parallel, seed_everything, teardown

    context = init_parallel("cpu")
    seed_everything(0)
    yield context
    teardown()
