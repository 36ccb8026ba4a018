"""The memory planner (rlhf.memory) against hand computations and published numbers; the
exact per-rank comparison with real tensors is tests/distributed/test_distributed_optimizer.py
and the activation measurement tests/distributed/test_recompute_and_activations.py."""

from __future__ import annotations

import json

import pytest
import torch

from rlhf.cli.doctor import main as doctor_main
from rlhf.config import load_config
from rlhf.engine.offload import StorageOffloader
from rlhf.memory.params import GradBuffer, Param
from rlhf.memory.planner import (
    GIB,
    PlanInputs,
    hf_param_count,
    plan_memory,
    planned_kv_cache_tokens,
)
from rlhf.memory.report import describe, suggestions
from rlhf.models.families import arch_from_hf_config
from tests.helpers import REPO

SHAPES = REPO / "configs" / "model_shapes"
CONFIG_8GPU = REPO / "configs" / "gsm8k_8gpu.yaml"
AR = "actor_rollout_ref"


def planned(cfg, arch, world_size=None, *, device="cuda", gpu_bytes=None):
    """The plan of a config: `PlanInputs.from_config` (default world: the config's), then
    `plan_memory`."""
    return plan_memory(PlanInputs.from_config(cfg, arch, world_size, device), gpu_bytes)


def shape(name: str):
    return arch_from_hf_config(json.loads((SHAPES / f"{name}.json").read_text()))


@pytest.mark.parametrize(
    ("name", "published"),
    [("Qwen2.5-0.5B", 494_032_768), ("Qwen2.5-7B", 7_615_616_512), ("Qwen2.5-72B", 72_706_203_648)],
)
def test_parameter_count_matches_the_published_one(name, published):
    assert hf_param_count(shape(name)) == published


def test_distributed_optimizer_buffer_layout_by_hand():
    # Reversed order: the 30-element parameter at [0, 30); the 100-element one starts at the
    # next multiple of 64, [64, 164); the buffer ends at the next multiple of lcm(2, 128).
    layout = GradBuffer.layout([Param(100), Param(30)], dp=2, distributed=True)
    assert layout.numel == 256
    assert layout.owned == (30 + 64, 164 - 128)  # rank 0: [0, 128), rank 1: [128, 256)
    assert GradBuffer.layout([Param(100), Param(30)], 2, False) == GradBuffer(130, (130, 130))


def test_tp2_bf16_actor_bytes_by_hand():
    arch = shape("Qwen2.5-7B")
    cfg = load_config(CONFIG_8GPU, [f"{AR}.actor.megatron.use_distributed_optimizer=false"])
    actor = planned(cfg, arch, device="cuda").row("actor")
    h, f, layers, d, vocab = 3584, 18944, 28, 128, 152064  # vocab: a multiple of 128 x TP2
    qkv = (28 + 2 * 4) * d  # query heads and key/value groups, x head_dim
    sharded = h * 28 * d + qkv * h + qkv + 3 * f * h  # proj, qkv (+ bias), fc1 (2f), fc2
    numel = 2 * (vocab // 2) * h + layers * (2 * h + sharded // 2) + h  # norms replicated
    assert actor.weights == 2 * numel
    assert actor.gradients == 4 * numel and actor.master_weights == 4 * numel
    assert actor.optimizer_state == 8 * numel


def test_offload_moves_exactly_the_offloaded_kinds_out_of_the_other_phases():
    arch = shape("Qwen2.5-7B")
    base = [f"{AR}.actor.megatron.{k}=false" for k in ("param_offload", "grad_offload")]
    base += [f"critic.megatron.{k}=false" for k in ("param_offload", "grad_offload")]
    base += [f"{AR}.ref.param_offload=false"]
    off = [
        f"{AR}.actor.megatron.optimizer_offload=false",
        "critic.megatron.optimizer_offload=false",
    ]
    kept = planned(load_config(CONFIG_8GPU, base + off), arch, gpu_bytes=80 * GIB)
    offloaded = planned(load_config(CONFIG_8GPU, base), arch, gpu_bytes=80 * GIB)
    moved = sum(
        r.master_weights + r.optimizer_state for r in kept.rows if r.role in ("actor", "critic")
    )
    assert kept.phases["rollout"] - offloaded.phases["rollout"] == moved
    critic = kept.row("critic")  # in the actor's phase only the critic's state left
    assert (
        kept.phases["actor"] - offloaded.phases["actor"]
        == critic.master_weights + critic.optimizer_state
    )


def test_a_config_that_does_not_fit_gets_suggestions_that_are_real_config_changes():
    arch = shape("Qwen2.5-7B")
    budgets = [
        f"{AR}.actor.ppo_max_token_len_per_gpu=32768",
        "critic.ppo_max_token_len_per_gpu=32768",
    ]
    no_recompute = [
        f"{AR}.actor.megatron.recompute_granularity=null",
        "critic.megatron.recompute_granularity=null",
    ]
    inputs = PlanInputs.from_config(
        load_config(CONFIG_8GPU, budgets + no_recompute), arch, 8, "cuda"
    )
    plan = plan_memory(inputs, 80 * GIB)
    assert plan.fits is False
    found = suggestions(inputs, plan)
    assert found and [s.peak for s in found] == sorted(s.peak for s in found)
    assert all(s.peak < plan.peak for s in found)
    recompute = next(s for s in found if "recompute_granularity=full" in s.change)
    with_recompute = planned(load_config(CONFIG_8GPU, budgets), arch, gpu_bytes=80 * GIB)
    assert recompute.peak == with_recompute.peak  # the same change made in the config
    _, report = describe(inputs, 80 * GIB)
    assert "does NOT fit" in report and "try megatron.recompute_granularity=full" in report


def test_doctor_prints_the_plan_and_fails_a_config_that_does_not_fit(capsys):
    args = [
        "--config",
        str(CONFIG_8GPU),
        "--model-config",
        str(SHAPES / "Qwen2.5-7B.json"),
        "--gpu-memory-gb",
        "80",
        "--requirements",
        "/nonexistent",
    ]
    doctor_main(args)
    out = capsys.readouterr().out
    assert "memory per GPU (GiB), by role and kind" in out
    memory = next(line for line in out.splitlines() if line.startswith("memory "))
    assert "PASS" in memory and "fits in 80.00 GiB" in memory
    assert doctor_main([*args, "--gpu-memory-gb", "32"]) == 1
    out = capsys.readouterr().out
    assert "does NOT fit in 32.00 GiB" in out and "  try " in out


def test_storage_offloader_round_trip_is_exact_and_frees_the_storage():
    buffer = torch.randn(1000)
    views = [buffer[:300].view(10, 30), buffer[300:]]
    other = torch.randn(7, 3)
    before = [v.clone() for v in views] + [other.clone()]
    offloader = StorageOffloader.of([*views, other, buffer])
    assert len(offloader.held) == 2 and offloader.nbytes == 4 * (1000 + 21)
    offloader.offload()
    assert buffer.untyped_storage().nbytes() == 0 and other.untyped_storage().nbytes() == 0
    offloader.reload()
    for got, want in zip([*views, other], before):
        assert torch.equal(got, want)
    views[0].add_(1.0)  # the views still alias the buffer
    assert torch.equal(buffer[:300], before[0].reshape(-1) + 1.0)


def test_a_host_storage_is_set_aside_not_copied_and_gradients_come_back_zeroed():
    """On the CPU the bytes stay in place while offloaded (the same address comes back:
    no copy), the storage is empty in between as on a GPU; a discarded kind's comes back
    zeroed."""
    state, grads = torch.randn(64), torch.randn(32)
    address, kept = state.data_ptr(), state.clone()
    offloaders = [StorageOffloader.of([state]), StorageOffloader.of([grads], keep_bytes=False)]
    for offloader in offloaders:
        offloader.offload()
    assert state.untyped_storage().nbytes() == 0 == grads.untyped_storage().nbytes()
    for offloader in offloaders:
        offloader.reload()
    assert state.data_ptr() == address and torch.equal(state, kept)
    assert torch.equal(grads, torch.zeros(32))


def test_colocated_servers_get_the_plans_kv_cache_by_hand():
    # gsm8k_8gpu.yaml: Qwen2.5-7B (7,615,616,512 parameters, published), SGLang TP 2 in bf16
    # with 0.6 of an 80 GiB GPU. Each rollout rank holds half the weights; the rest of its
    # share is KV cache: K and V of 28 layers for 4 / 2 KV heads of 128 dims, in bf16.
    cfg = load_config(CONFIG_8GPU, [])
    share = int(0.6 * 80 * GIB) - 7_615_616_512 * 2 // 2
    per_token = 2 * 28 * (4 // 2) * 128 * 2
    kv = planned_kv_cache_tokens(cfg.actor_rollout_ref.rollout, shape("Qwen2.5-7B"), 80 * GIB)
    assert kv == share // per_token
    rollout = planned(cfg, shape("Qwen2.5-7B"), gpu_bytes=80 * GIB).row("rollout")
    assert kv == rollout.activations // per_token  # the plan's rollout row


def test_colocated_weight_sync_holds_only_the_actors_weights_next_to_sglangs():
    cfg = load_config(CONFIG_8GPU, [])
    plan = planned(cfg, shape("Qwen2.5-7B"), gpu_bytes=80 * GIB)
    actor, rollout = plan.row("actor"), plan.row("rollout")
    others = sum(r.resident for r in plan.rows if r.role not in ("actor", "rollout"))
    runtime = 2 * GIB
    weights_only = others + actor.weights + runtime
    assert plan.phases["weight_sync"] == weights_only + rollout.weights + actor.communication
    assert plan.phases["kv_cache_wake"] == weights_only + rollout.total
    # the sync's extra: the embedding (152,064 rows padded to 152,064 = 1188 x 128, x 3584
    # bf16) is its own bucket (> 512 MB): while it is gathered over TP 2 (shards + HF copy)
    # the current bucket is being filled, the previous one waits to be packed and the one
    # before is still being delivered
    embedding = 152_064 * 3584 * 2
    assert actor.communication == 5 * embedding


def test_host_memory_of_a_node_by_hand_and_the_doctors_verdict(capsys):
    # gsm8k_8gpu.yaml offloads actor and critic (weights, gradients, master weights, Adam
    # state) and the reference's weights: every rank keeps pinned copies of all but the
    # gradients (freed, not copied) in the rollout phase, and a checkpoint copies one trained
    # model's weights, master weights and Adam state to the host; 4 GiB for the process.
    plan = planned(load_config(CONFIG_8GPU, []), shape("Qwen2.5-7B"), gpu_bytes=80 * GIB)
    actor, critic, ref = plan.row("actor"), plan.row("critic"), plan.row("reference")
    copied = [actor.weights, actor.master_weights, actor.optimizer_state]
    copied += [critic.weights, critic.master_weights, critic.optimizer_state, ref.weights]
    checkpoint = max(
        actor.weights + actor.master_weights + actor.optimizer_state,
        critic.weights + critic.master_weights + critic.optimizer_state,
    )
    assert plan.host_bytes == 8 * (4 * GIB + sum(copied) + checkpoint)
    # a background save's writer holds both models' snapshots until it is done
    cfg = load_config(CONFIG_8GPU, ["trainer.async_save=true"])
    both = planned(cfg, shape("Qwen2.5-7B"), gpu_bytes=80 * GIB).host_bytes
    snapshot = sum(copied[:3]) + sum(copied[3:6])
    assert both == 8 * (4 * GIB + sum(copied) + snapshot)
    args = ["--config", str(CONFIG_8GPU), "--model-config", str(SHAPES / "Qwen2.5-7B.json")]
    args += ["--gpu-memory-gb", "80", "--requirements", "/nonexistent"]
    doctor_main([*args, "--host-memory-gb", "2048"])
    host = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("host"))
    assert "PASS" in host and f"{plan.host_bytes / GIB:.1f} GiB per node" in host
    assert doctor_main([*args, "--host-memory-gb", "256"]) == 1
    host = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("host"))
    assert "FAIL" in host and "of 256.0 GiB" in host


@pytest.mark.parametrize("pp,vp", [(2, 1), (4, 1), (2, 2), (4, 2), (4, 3), (8, 4)])
def test_micro_batches_in_flight_are_megatrons_warmup_plus_one(pp, vp):
    """The planner's in-flight count per stage against Megatron's own schedule arithmetic
    (`get_pp_rank_microbatches`, the warmup forwards before the first backward)."""
    from types import SimpleNamespace

    from megatron.core.pipeline_parallel.schedules import get_pp_rank_microbatches

    from rlhf.memory.activations import pipeline_in_flight

    for stage in range(pp):
        group = SimpleNamespace(size=lambda: pp, rank=lambda s=stage: s)
        comm = SimpleNamespace(
            pp_group=group, virtual_pipeline_model_parallel_size=vp if vp > 1 else None
        )
        _, _, warmup, _ = get_pp_rank_microbatches(64, vp, pp, p2p_communicator=comm)
        assert pipeline_in_flight(pp, stage, vp) == warmup + 1, (stage, warmup)
