"""Test tiers by folder (unit, distributed, e2e, gpu) and shared fixtures."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

TESTS = Path(__file__).parent
TIERS = ("unit", "distributed", "e2e", "gpu")

# Spawned ranks and servers share 2 cores: one thread each keeps them from thrashing.
os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_collection_modifyitems(config, items):
    for item in items:
        tier = Path(item.fspath).relative_to(TESTS).parts[0]
        if tier in TIERS:
            item.add_marker(getattr(pytest.mark, tier))
        if tier == "gpu" and not torch.cuda.is_available():
            item.add_marker(pytest.mark.skip(reason="needs CUDA"))


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory) -> Path:
    """A tiny random Qwen2 model + tokenizer on disk (built once per session)."""
    from rlhf.quickstart.tiny_model import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("tiny_qwen2"))
