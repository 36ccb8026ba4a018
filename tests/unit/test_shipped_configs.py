"""Every config under configs/ loads, resolves and passes the cross-field rules."""

from __future__ import annotations

import pytest

from rlhf.config import ConfigError, load_config, validate_config
from tests.helpers import REPO

CONFIGS = sorted((REPO / "configs").glob("*.yaml"))


def test_configs_exist():
    names = {p.name for p in CONFIGS}
    assert {"quickstart_cpu.yaml", "gsm8k_qwen2.5-0.5b_1gpu.yaml", "gsm8k_8gpu.yaml"} <= names
    assert "gsm8k_2node.yaml" in names


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_config_validates_for_its_world(path):
    cfg = load_config(path)
    layout = validate_config(cfg)
    assert layout.world_size == cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node


@pytest.mark.parametrize("name", ["gsm8k_qwen2.5-0.5b_1gpu", "gsm8k_8gpu", "gsm8k_2node"])
def test_gpu_configs_train_in_bf16(name):
    cfg = load_config(REPO / "configs" / f"{name}.yaml")
    assert cfg.actor_rollout_ref.actor.megatron.dtype == "bfloat16"
    assert cfg.critic.megatron.dtype == "bfloat16"


def test_recommended_gsm8k_8gpu_values():
    cfg = load_config(REPO / "configs" / "gsm8k_8gpu.yaml")
    aro = cfg.actor_rollout_ref
    assert cfg.data.train_batch_size == 1024
    assert (cfg.data.max_prompt_length, cfg.data.max_response_length) == (512, 256)
    assert 4 <= aro.rollout.n <= 8
    assert cfg.algorithm.kl_ctrl.kl_coef == 0.001 and cfg.algorithm.kl_ctrl.target_kl == 0.1
    assert cfg.algorithm.kl_ctrl.horizon == 10000 and aro.actor.clip_ratio == 0.2
    assert aro.actor.ppo_max_token_len_per_gpu == 16384
    assert aro.rollout.tensor_model_parallel_size == 2
    assert aro.rollout.gpu_memory_utilization == 0.6


def test_critic_layout_must_match_actor():
    cfg = load_config(
        None,
        ["actor_rollout_ref.model.path=m", "trainer.n_gpus_per_node=2",
         "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2"],
    )  # fmt: skip
    with pytest.raises(ConfigError, match="share one Megatron parallel layout"):
        validate_config(cfg)
