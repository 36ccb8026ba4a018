"""The device ledger against the CUDA allocator (issue 51): what the ledger says is resident
between and during the step's phases is what CUDA holds. The CPU suite asserts the ledger's
rules (tests/unit/test_device_ledger.py); this checks that the ledger is the truth on a GPU.
Skipped without CUDA (tests/conftest.py)."""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch

from rlhf.memory import ledger as device
from tests.distributed.workers.trainer_step import COMMON, synthetic_batch
from tests.helpers import SEED_DEFAULTS
from tests.unit.test_device_ledger import OFFLOAD

SLACK = 16 * 1024**2  # what the ledger does not count: rotary tables, small buffers


@pytest.fixture(scope="module")
def ctx():
    from rlhf.distributed.bootstrap import init_parallel, seed_everything, teardown

    context = init_parallel("cuda")
    seed_everything(0)
    yield context
    teardown()


def test_between_phases_cuda_holds_what_the_ledger_says(ctx, tiny_qwen2_dir, monkeypatch):
    from rlhf.algo import build_kl_controller
    from rlhf.config import load_config, validate_config
    from rlhf.engine.build import build_engine
    from rlhf.logging import Timer
    from rlhf.trainer import step as ppo_step
    from rlhf.trainer.preflight import load_policy_arch
    from rlhf.trainer.step import Learning

    model = f"actor_rollout_ref.model.path={tiny_qwen2_dir}"
    args = [*SEED_DEFAULTS, model, *COMMON, *OFFLOAD]
    args += [f"{r}.megatron.dtype=bfloat16" for r in ("actor_rollout_ref.actor", "critic")]
    cfg = load_config(None, args)
    arch = load_policy_arch(cfg)
    validate_config(cfg, ctx.world_size, arch)
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    book = device.reset()
    models = build_engine(cfg, arch, ctx, total_steps=1)
    seen = []
    stage = ppo_step.stage

    @contextmanager
    def measured(timer, name):  # every stage: the allocator's view at its start and peak
        torch.cuda.reset_peak_memory_stats()
        seen.append((name, "start", torch.cuda.memory_allocated() - base, book.nbytes))
        with stage(timer, name):
            yield
        peak = torch.cuda.max_memory_allocated() - base
        seen.append((name, "peak", peak, book.records(name)[-1].peak_bytes))

    monkeypatch.setattr(ppo_step, "stage", measured)
    kl = build_kl_controller(cfg.algorithm.kl_ctrl)
    ppo_step.learn_from_batch(
        models,
        synthetic_batch(arch.vocab_size),
        Learning.of(cfg.algorithm, cfg.actor_rollout_ref.actor, cfg.trainer),
        kl,
        Timer(),
    )
    assert book.nbytes == 0 and torch.cuda.memory_allocated() - base < SLACK
    for name, edge, cuda_bytes, ledger_bytes in seen:
        if edge == "start":
            assert abs(cuda_bytes - ledger_bytes) < SLACK, (name, cuda_bytes, ledger_bytes)
        else:  # a phase's peak: the ledger's state plus the phase's activations
            assert cuda_bytes >= ledger_bytes - SLACK, (name, cuda_bytes, ledger_bytes)
