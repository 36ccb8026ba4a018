"""The memory planner on mixture-of-experts models (rlhf.memory.moe) against hand
computations: per-rank parameters of a small Qwen3-MoE at TP2 x EP3 with the experts'
optimizer state sharded over expert-DP, what a MoE layer saves and holds in flight, SGLang's
share, the published parameter counts of the shipped model shapes, and rlhf-doctor's
expert line."""

from __future__ import annotations

import json

import pytest

from rlhf.cli.doctor import main as doctor_main
from rlhf.config import load_config
from rlhf.memory.activations import ActivationShape, forward_peak, training_peak
from rlhf.memory.moe import MoEShape
from rlhf.memory.planner import (
    GIB,
    PlanInputs,
    TrainedRole,
    hf_param_count,
    plan_memory,
    planned_kv_cache_tokens,
    sync_bytes,
    trained_memory,
)
from rlhf.models.families import NO_RECOMPUTE, Recompute, arch_from_hf_config
from tests.helpers import REPO

SHAPES = REPO / "configs" / "model_shapes"
ACTOR = "actor_rollout_ref.actor.megatron"

# Every tensor a multiple of 64 elements, so Megatron's buffer has no gaps between them.
SMALL_MOE = {
    "model_type": "qwen3_moe",
    "vocab_size": 1000,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 4,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
    "num_experts": 6,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [1],  # layer 1 is dense, layers 0, 2, 3 have experts
}
SMALL_ARCH = arch_from_hf_config(SMALL_MOE)


def planned(cfg, arch, world_size=None, *, device="cuda", gpu_bytes=None):
    """The plan of a config: `PlanInputs.from_config` (default world: the config's), then
    `plan_memory`."""
    return plan_memory(PlanInputs.from_config(cfg, arch, world_size, device), gpu_bytes)


def small_moe_cfg(*overrides: str):
    return load_config(
        None,
        [
            "actor_rollout_ref.model.path=m",
            "trainer.n_gpus_per_node=6",
            "algorithm.adv_estimator=grpo",
            f"{ACTOR}.tensor_model_parallel_size=2",
            f"{ACTOR}.expert_model_parallel_size=3",
            f"{ACTOR}.expert_tensor_parallel_size=1",
            f"{ACTOR}.dtype=bfloat16",
            *overrides,
        ],
    )


def test_expert_parameters_per_ep_rank_and_their_optimizer_shards_by_hand():
    # 6 ranks: dense TP2 x DP3; experts EP3 x expert-TP1 x expert-DP2. On one rank:
    #   embedding and output layer: vocab 1000 padded to 1024 (128 x TP2), 512 rows x 64
    #   attention per layer: input norm 64, proj 64 x (2 heads x 64 / 2), qkv (2 + 2 x 2) x
    #   64 / 2 = 192 rows x 64, q and k norms 64 each, pre-MLP norm 64
    #   MoE layers 0, 2, 3: router 6 x 64 (dense, on every rank); 6 / EP3 = 2 local
    #   experts, each fc1 2 x 32 x 64 and fc2 64 x 32 (expert parameters)
    #   dense layer 1: fc1 2 x 96 / 2 x 64, fc2 64 x 48; final norm 64
    attention = 64 + 64 * 64 + 192 * 64 + 64 + 64 + 64
    dense = 2 * 512 * 64 + 4 * attention + 3 * 6 * 64 + (2 * 48 * 64 + 64 * 48) + 64
    experts = 3 * 2 * (2 * 32 * 64 + 64 * 32)
    assert (dense, experts) == (142_528, 36_864)
    # distributed optimizer: the dense buffer ends at a multiple of lcm(DP3, 128) = 384 and
    # is split in 3; the expert buffer (a multiple of lcm(2, 128) already) in 2
    dense_buffer = -(-dense // 384) * 384
    dense_share, expert_share = dense_buffer // 3, experts // 2
    last_dense_share = dense_share - (dense_buffer - dense)  # the padding is rank 2's
    actor = planned(small_moe_cfg(), SMALL_ARCH, 6).row("actor")
    assert actor.weights == 2 * (dense_buffer + experts)  # bf16
    assert actor.gradients == 4 * (dense_buffer + experts)  # fp32
    assert actor.master_weights == 4 * (dense_share + expert_share)
    assert actor.optimizer_state == 8 * (dense_share + expert_share)
    assert actor.experts == experts * (2 + 4) + expert_share * (4 + 8)
    role = TrainedRole("actor", small_moe_cfg().actor_rollout_ref.actor.megatron, 1024)
    last = trained_memory(SMALL_ARCH, role, dp=3, sp=1, device="cuda", stage=0, dp_rank=2)
    assert last.master_weights == 4 * (last_dense_share + expert_share)


def test_expert_grid_that_does_not_divide_the_world_is_a_clear_error():
    """rlhf-doctor plans straight from the config (`PlanInputs.from_config`: the config's
    run plan, whose layout rule names the keys); the planner's own count refuses it too."""
    cfg = small_moe_cfg(f"{ACTOR}.expert_model_parallel_size=6")  # 6 x 1 x 1 ranks on 4
    with pytest.raises(ValueError, match=r"expert_model_parallel_size \(6\) x .* = 6 does not"):
        plan_memory(PlanInputs.from_config(cfg, SMALL_ARCH, 4, "cuda"), None)
    role = TrainedRole("actor", cfg.actor_rollout_ref.actor.megatron, 1024)
    with pytest.raises(ValueError, match=r"expert-TP \(1\) x EP \(6\) x PP \(1\) does not"):
        trained_memory(SMALL_ARCH, role, dp=2, sp=1, device="cuda", stage=0)  # 2 x TP 2


def moe_shape(moe_layers: int) -> ActivationShape:
    """1024 tokens on a rank of TP2 with sequence parallelism, bf16, 3 MoE layers of 4."""
    assert SMALL_ARCH.moe is not None
    routed = MoEShape.of(SMALL_ARCH.moe, 1024, tp=2, etp=1, seq_split=2, aux_loss=True)
    return ActivationShape.of(
        SMALL_ARCH,
        1024,
        1024,
        tp=2,
        pp=1,
        sp=1,
        element=2,
        sequence_parallel=True,
        moe=routed,
        moe_layers=moe_layers,
    )


def test_what_a_moe_layer_saves_and_holds_in_flight_by_hand():
    # 1024 tokens, TP2 with sequence parallelism: 512 reach the router; top-2 routing sends
    # 1024 rows to the experts (expert-TP 1); 6 experts of width 32; bf16; the aux loss on.
    router = 512 * 6 * (2 + 2 + 1 + 4)  # logits, probs (bf16), routing map, fp32 softmax
    experts = 1024 * 64 * 2 + (3 + 1) * 1024 * 32 * 2  # fc1's input; fused-MLP count + 1
    dense_mlp = 3 * 1024 * (96 // 2) * 2  # what a dense layer's MLP would keep instead
    in_flight = 2 * 1024 * 64 * 2  # a permutation's (or all-to-all's) input and output
    moe, dense = moe_shape(3), moe_shape(0)
    assert moe.moe is not None and moe.moe.saved_bytes(1024, 64, 2, 3) == router + experts
    value_model = {"flash": True, "last_stage": False, "lm_head": False, "first_stage": False}
    no_recompute = training_peak(moe, NO_RECOMPUTE, **value_model) - training_peak(
        dense, NO_RECOMPUTE, **value_model
    )
    assert no_recompute == 3 * (router + experts - dense_mlp) + in_flight
    full = Recompute(granularity="full", method="uniform", num_layers=1)
    # full recompute keeps the same layer inputs; the recomputed layer is a MoE one
    recomputed = training_peak(moe, full, **value_model) - training_peak(dense, full, **value_model)
    assert recomputed == router + experts - dense_mlp + in_flight
    forward = forward_peak(moe, flash=True, lm_head=False) - forward_peak(
        dense, flash=True, lm_head=False
    )
    assert forward == router + experts - dense_mlp + in_flight


def test_parameter_counts_match_the_published_ones():
    """Qwen3-30B-A3B: 30.5B parameters, 29.9B without embeddings; Qwen3-235B-A22B: 235B and
    234B (the model cards). By hand: embeddings and output layer 2 x 151,936 x h; per layer
    attention q (heads x 128 x h), k and v (4 x 128 x h each), o, q/k norms 2 x 128, two norms
    2 h, router 128 x h, 128 experts x 3 x moe_ffn x h; a final norm h."""

    def by_hand(h: int, layers: int, heads: int, moe_ffn: int) -> tuple[int, int]:
        attention = 2 * heads * 128 * h + 2 * 4 * 128 * h + 2 * 128 + 2 * h
        layer = attention + 128 * h + 128 * 3 * moe_ffn * h
        non_embedding = layers * layer + h
        return non_embedding + 2 * 151_936 * h, non_embedding

    for name, dims, digits, published in [
        ("Qwen3-30B-A3B", (2048, 48, 32, 768), 1, ("30.5", "29.9")),
        ("Qwen3-235B-A22B", (4096, 94, 64, 1536), 0, ("235", "234")),
    ]:
        total, non_embedding = by_hand(*dims)
        billions = tuple(f"{n / 1e9:.{digits}f}" for n in (total, non_embedding))
        assert billions == published, name
        arch = arch_from_hf_config(json.loads((SHAPES / f"{name}.json").read_text()))
        assert hf_param_count(arch) == total, name


def test_sglang_holds_the_experts_over_its_tp_and_every_router_whole_by_hand():
    # qwen3_30b_a3b_grpo_8gpu.yaml: SGLang TP4 in bf16, 0.6 of an 80 GiB GPU. The model's
    # 30,532,122,624 parameters split over 4 ranks but the 48 routers (128 x 2048) on each.
    cfg = load_config(REPO / "configs" / "qwen3_30b_a3b_grpo_8gpu.yaml")
    arch = arch_from_hf_config(json.loads((SHAPES / "Qwen3-30B-A3B.json").read_text()))
    routers = 48 * 128 * 2048
    weights = (30_532_122_624 - routers) * 2 // 4 + routers * 2
    rollout = planned(cfg, arch, gpu_bytes=80 * GIB).row("rollout")
    assert rollout.weights == weights
    assert rollout.experts == 48 * 128 * 3 * 768 * 2048 * 2 // 4
    per_token = 2 * 48 * 1 * 128 * 2  # K and V, 48 layers, 4 KV heads / TP4, bf16
    kv = planned_kv_cache_tokens(cfg.actor_rollout_ref.rollout, arch, 80 * GIB)
    assert kv == (int(0.6 * 80 * GIB) - weights) // per_token


def test_doctor_shows_the_expert_part_and_plans_a_moe_model_dir(tmp_path, capsys):
    config = REPO / "configs" / "qwen3_30b_a3b_grpo_8gpu.yaml"
    model = tmp_path / "Qwen3-30B-A3B"  # config.json only: the weights are not downloaded
    model.mkdir()
    (model / "config.json").write_text((SHAPES / "Qwen3-30B-A3B.json").read_text())
    args = ["--config", str(config), "--gpu-memory-gb", "80", "--host-memory-gb", "2048"]
    args += ["--requirements", "/nonexistent", f"actor_rollout_ref.model.path={model}"]
    assert doctor_main(args) == 1  # model/data: no weights (and MoE runs are refused)
    out = capsys.readouterr().out
    memory = next(line for line in out.splitlines() if line.startswith("memory "))
    assert "PASS" in memory and "fits in 80.00 GiB" in memory
    experts = next(line for line in out.splitlines() if line.startswith("routed experts"))
    assert "16 of 128 per MoE layer per GPU (EP 8 x expert-TP 1" in experts
    assert "expert-DP 1" in experts and "actor " in experts and "rollout " in experts


def test_the_weight_sync_counts_the_expert_gather_by_hand():
    """Qwen3-235B-A22B, TP1, bf16, 512 MiB buckets: the largest tensor is the embedding
    (151,936 x 4096 x 2 bytes), a bucket no larger; one expert's gate/up weight G is
    2 x 1536 x 4096 x 2 bytes. At EP 1 the four buckets of packing are the peak; at EP 64
    the leader's 129 G of one expert gather next to three buckets."""
    arch = arch_from_hf_config(json.loads((SHAPES / "Qwen3-235B-A22B.json").read_text()))
    full, expert_gate_up = 151_936 * 4096 * 2, 2 * 1536 * 4096 * 2
    assert sync_bytes(arch, 151_936, 1, 2, 512 << 20, ep=1) == 4 * full
    assert sync_bytes(arch, 151_936, 1, 2, 512 << 20, ep=64) == 3 * full + 129 * expert_gate_up
