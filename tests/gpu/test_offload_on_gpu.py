"""Offload on CUDA: a trainer step with every model offloaded between its uses
(tests/distributed/workers/optimizer_state.py --offload) gives bit-identical metrics and
weights to the same step without offloading, and the GPU memory of the offloaded
parameters, gradient buffers, master weights and Adam state is released in between.
Skipped without CUDA (tests/conftest.py)."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import run_worker_layouts

COMMON = ["--device", "cuda", "--dtype", "bfloat16", "--steps", "2"]
RUNS = {"plain": (1, COMMON), "offloaded": (1, [*COMMON, "--offload"])}


@pytest.fixture(scope="module")
def runs(tiny_qwen2_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_offload")
    return run_worker_layouts("optimizer_state.py", RUNS, tiny_qwen2_dir, out)


def test_offload_round_trip_is_bit_exact_on_cuda(runs):
    plain, offloaded = runs["plain"], runs["offloaded"]
    assert offloaded["metrics"][2] == plain["metrics"][2]
    for role in ("actor", "critic"):
        for name, value in plain["weights"][2][role].items():
            assert torch.equal(offloaded["weights"][2][role][name], value), (role, name)


def test_offloaded_state_leaves_the_gpu(runs):
    (rank,) = runs["offloaded"]["resident_while_offloaded"]
    for role in ("actor", "critic"):
        assert rank[role] == {"params": 0, "grads": 0, "optimizer": 0}
    assert rank["ref"] == {"params": 0}
    state = sum(sum(b.values()) for b in runs["plain"]["bytes"][0].values())  # actor + critic
    memory = rank["device_bytes"]
    assert memory["loaded"] - memory["offloaded"] >= state
