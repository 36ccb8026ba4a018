"""The update's guard against non-finite gradients (`TrainableMegatronModel.gradients_finite`,
`rlhf.engine.nonfinite`) reads DDP's gradient buffers whole: an inf or NaN in any element of
any trained parameter's gradient stops the optimizer step. (The expert-parallel buffers of a
mixture-of-experts model: tests/distributed/test_moe_stages.py.)"""

from __future__ import annotations

import math

import pytest
import torch

from tests.helpers import SEED_DEFAULTS


@pytest.fixture(scope="module")
def actor(cpu_rank, tiny_qwen2_dir):
    from rlhf.config import load_config
    from rlhf.engine.build import build_engine
    from rlhf.trainer.preflight import load_policy_arch

    cfg = load_config(None, [*SEED_DEFAULTS, f"actor_rollout_ref.model.path={tiny_qwen2_dir}"])
    return build_engine(cfg, load_policy_arch(cfg), cpu_rank, total_steps=1).actor


@pytest.mark.parametrize("bad", [math.inf, math.nan])
def test_one_bad_gradient_element_of_any_parameter_stops_the_step(actor, bad):
    trained = [p for p in actor.module.parameters() if p.requires_grad]
    for p in trained:
        p.main_grad.copy_(torch.randn_like(p.main_grad))
    assert actor.gradients_finite()
    for p in (trained[0], trained[len(trained) // 2], trained[-1]):
        kept = p.main_grad.view(-1)[-1].item()
        p.main_grad.view(-1)[-1] = bad
        assert not actor.gradients_finite()
        p.main_grad.view(-1)[-1] = kept
    assert actor.gradients_finite()
