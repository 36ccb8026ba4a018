"""Every config under configs/ loads, resolves and passes the cross-field rules; the GPU
configs fit every phase of a step on an 80 GB GPU with at least 8% headroom according to
the memory planner, for the model each is made for, and docs/memory.md's per-phase table says
what the planner says."""

from __future__ import annotations

import json

import pytest
import yaml

from rlhf.config import ConfigError, load_config, validate_config
from rlhf.config.reward_training import RewardModelRunConfig, validate_reward_training
from rlhf.memory.planner import (
    DTYPE_BYTES,
    GIB,
    PlanInputs,
    kv_cache_bytes_per_token,
    plan_memory,
    rollout_weight_bytes,
)
from rlhf.models.families import arch_from_hf_config
from tests.helpers import REPO

# rlhf-train-rm's configs (their own tree, rlhf.config.reward_training); the rest are rlhf-train's
REWARD_MODEL_CONFIGS = ["quickstart_rm_cpu"]
CONFIGS = [
    p for p in sorted((REPO / "configs").glob("*.yaml")) if p.stem not in REWARD_MODEL_CONFIGS
]


def test_configs_exist():
    names = {p.name for p in CONFIGS}
    assert {"quickstart_cpu.yaml", "gsm8k_qwen2.5-0.5b_1gpu.yaml", "gsm8k_8gpu.yaml"} <= names
    assert "gsm8k_2node.yaml" in names


ADDRESS_KEY = "actor_rollout_ref.rollout.weight_sync_master_address"


def launcher_overrides(path) -> list[str]:
    """What launch/slurm.sbatch and slurm_disaggregated.sbatch add to a config whose servers
    are external: the first node as the weight-sync rendezvous."""
    return (
        [f"{ADDRESS_KEY}=train-0"]
        if load_config(path).actor_rollout_ref.rollout.server_urls
        else []
    )


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_config_validates_for_its_world(path):
    cfg = load_config(path, launcher_overrides(path))
    layout = validate_config(cfg)
    assert layout.world_size == cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node


@pytest.mark.parametrize(
    "name", ["gsm8k_2node", "gsm8k_72b_grpo_4node", "qwen3_235b_a22b_grpo_16node"]
)
def test_multi_node_configs_refuse_a_loopback_rendezvous_for_their_remote_servers(name):
    """(issue 51, item 7) They set weight_sync_master_address to 127.0.0.1, which the servers
    on their own nodes would dial on themselves (a 5-minute timeout at the first sync): now
    left unset, they need the launcher's address and are refused without it."""
    path = REPO / "configs" / f"{name}.yaml"
    assert (
        "weight_sync_master_address"
        not in yaml.safe_load(path.read_text())["actor_rollout_ref"]["rollout"]
    )
    with pytest.raises(ConfigError, match=rf"^{ADDRESS_KEY} is 127\.0\.0\.1, a loopback"):
        validate_config(load_config(path))


@pytest.mark.parametrize("name", REWARD_MODEL_CONFIGS)
def test_reward_model_config_validates(name):
    cfg = load_config(REPO / "configs" / f"{name}.yaml", schema=RewardModelRunConfig)
    assert validate_reward_training(cfg).world_size == cfg.trainer.n_gpus_per_node


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
    assert aro.actor.ppo_max_token_len_per_gpu == 8192  # 16384 did not fit (memory planner)
    assert aro.rollout.tensor_model_parallel_size == 2
    assert aro.rollout.gpu_memory_utilization == 0.6


def test_critic_layout_is_the_actors_unless_set_and_must_match_it():
    actor_tp2 = [
        "actor_rollout_ref.model.path=m",
        "trainer.n_gpus_per_node=2",
        "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
    ]
    assert validate_config(load_config(None, actor_tp2)).tp_size == 2  # inherited (verl's)
    cfg = load_config(None, [*actor_tp2, "critic.megatron.tensor_model_parallel_size=1"])
    with pytest.raises(ConfigError, match="share one Megatron parallel layout"):
        validate_config(cfg)


# Each GPU config and the model (configs/model_shapes) it is sized for.
GPU_CONFIGS = {
    "gsm8k_qwen2.5-0.5b_1gpu": "Qwen2.5-0.5B",
    "gsm8k_8gpu": "Qwen2.5-7B",
    "gsm8k_grpo_8gpu": "Qwen2.5-7B",
    "gsm8k_2node": "Qwen2.5-14B",
    "gsm8k_72b_grpo_4node": "Qwen2.5-72B",
    "qwen3_30b_a3b_grpo_8gpu": "Qwen3-30B-A3B",
    "qwen3_235b_a22b_grpo_16node": "Qwen3-235B-A22B",
    "geo3k_qwen2_5_vl_7b_grpo_8gpu": "Qwen2.5-VL-7B",
}


def test_every_gpu_config_names_its_model_shape():
    gpu = {p.stem for p in CONFIGS if load_config(p).trainer.device != "cpu"}
    assert gpu == set(GPU_CONFIGS)


PHASES = ("rollout", "reference", "critic", "actor", "weight_sync", "kv_cache_wake")
HEADROOM = 0.08


def model_shape(name: str):
    path = REPO / "configs" / "model_shapes" / f"{GPU_CONFIGS[name]}.json"
    return arch_from_hf_config(json.loads(path.read_text()))


def gpu_plan(name: str):
    cfg = load_config(REPO / "configs" / f"{name}.yaml")
    world = cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node
    return plan_memory(PlanInputs.from_config(cfg, model_shape(name), world, "cuda"), 80 * GIB)


@pytest.mark.parametrize("name", sorted(GPU_CONFIGS))
def test_gpu_config_fits_every_phase_with_headroom_by_the_planner(name):
    plan = gpu_plan(name)
    for phase, peak in plan.phases.items():
        assert peak <= (1 - HEADROOM) * 80 * GIB, (name, phase, peak / GIB)


DISAGGREGATED = sorted(
    n
    for n in GPU_CONFIGS
    if load_config(REPO / "configs" / f"{n}.yaml").actor_rollout_ref.rollout.server_urls
)


@pytest.mark.parametrize("name", DISAGGREGATED)
def test_disaggregated_servers_hold_their_weights_and_a_group_of_rollouts(name):
    """Servers on their own GPUs are outside the plan: at `gpu_memory_utilization` of an
    80 GiB GPU, one TP rank's weights and the KV cache of one prompt's `n` full-length
    samples must fit (SGLang refuses to start without room for a KV cache)."""
    rollout = load_config(REPO / "configs" / f"{name}.yaml").actor_rollout_ref.rollout
    data = load_config(REPO / "configs" / f"{name}.yaml").data
    arch, tp = model_shape(name), rollout.tensor_model_parallel_size
    weights = rollout_weight_bytes(arch, tp, DTYPE_BYTES[rollout.dtype])
    group = rollout.n * (data.max_prompt_length + data.max_response_length)
    kv = group * kv_cache_bytes_per_token(arch, tp, rollout.dtype)
    assert weights + kv <= rollout.gpu_memory_utilization * 80 * GIB, (name, weights / GIB)


@pytest.mark.parametrize("name", sorted(GPU_CONFIGS))
def test_the_memory_doc_shows_the_planners_phases(name):
    plan = gpu_plan(name)
    cells = [f"{plan.phases[p] / GIB:.1f}" if p in plan.phases else "-" for p in PHASES]
    headroom = f"{100 * (1 - plan.peak / (80 * GIB)):.0f}%"
    row = f"| {GPU_CONFIGS[name]} | `{name}.yaml` | {' | '.join(cells)} | {headroom} |"
    assert row in (REPO / "docs" / "memory.md").read_text()


def test_sequence_parallel_is_on_at_tp2_and_must_match_between_actor_and_critic():
    tp2 = ["actor_rollout_ref.model.path=m", "trainer.n_gpus_per_node=2"]
    tp2 += [
        f"{r}.megatron.tensor_model_parallel_size=2" for r in ("actor_rollout_ref.actor", "critic")
    ]
    assert validate_config(load_config(None, tp2)).sequence_parallel
    off = [f"{r}.megatron.sequence_parallel=false" for r in ("actor_rollout_ref.actor", "critic")]
    assert not validate_config(load_config(None, [*tp2, *off])).sequence_parallel
    with pytest.raises(ConfigError, match="share one Megatron parallel layout"):
        validate_config(load_config(None, [*tp2, "critic.megatron.sequence_parallel=false"]))
    one_gpu = [
        "actor_rollout_ref.model.path=m",
        "actor_rollout_ref.actor.megatron.sequence_parallel=true",
    ]
    assert not validate_config(load_config(None, one_gpu)).sequence_parallel  # needs TP > 1
