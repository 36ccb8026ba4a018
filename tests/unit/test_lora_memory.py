"""The memory planner's LoRA accounting: the adapters it counts are the ones `add_lora` puts
on a real Megatron model (its parameters needing gradients), only they fill DDP's gradient
buffer and the optimizer, and a LoRA run's reference holds no weights of its own. For the
GRPO Qwen2.5-7B config at rank 64 the actor's gradients, master weights and Adam state
shrink to the adapters' and the reference's weights vanish."""

from __future__ import annotations

import json

from rlhf.config import load_config
from rlhf.memory.params import lora_params
from rlhf.memory.planner import PlanInputs, adapter_sync_bytes, plan_memory
from rlhf.models.families import arch_from_hf_config
from rlhf.models.lora import LoraSpec, add_lora, megatron_targets
from rlhf.models.model_dir import check_model_dir
from tests.helpers import REPO


def test_planned_adapters_are_the_built_ones(cpu_rank, tiny_qwen2_dir):
    from rlhf.models.builder import build_model
    from rlhf.models.chunks import ModelChunks
    from rlhf.models.mapping import Placement

    arch = check_model_dir(tiny_qwen2_dir)
    for targets in ("all-linear", ["q_proj", "k_proj", "v_proj", "down_proj"]):
        spec = LoraSpec(8, 16.0, megatron_targets(targets))
        model = build_model(arch, Placement())
        add_lora(ModelChunks.of(model, Placement()), spec, model.config, tp_rank=0)
        built = sorted(p.numel() for p in model.parameters() if p.requires_grad)
        planned = sorted(p.numel for p in lora_params(arch, spec, tp=1, pp=1, stage=0))
        assert built == planned, targets


def test_planned_expert_adapters_are_the_built_ones(cpu_rank, tmp_path):
    """A Qwen2-MoE (dense and MoE layers, a shared expert) with every linear layer adapted:
    the planner counts each routed expert's adapters, in the expert buffer, the shared
    expert's and the dense layers' beside the attention's."""
    from rlhf.models.builder import build_model
    from rlhf.models.chunks import ModelChunks
    from rlhf.models.mapping import Placement
    from tests.distributed.test_moe_parity import MODELS, save_moe_model

    arch = check_model_dir(save_moe_model(tmp_path / "moe", MODELS["qwen2_moe"], seed=0))
    spec = LoraSpec(4, 8.0, megatron_targets("all-linear"))
    model = build_model(arch, Placement())
    add_lora(ModelChunks.of(model, Placement()), spec, model.config, tp_rank=0)
    trained = [(n, p.numel()) for n, p in model.named_parameters() if p.requires_grad]
    planned = lora_params(arch, spec, tp=1, pp=1, stage=0)
    assert sorted(n for _, n in trained) == sorted(p.numel for p in planned)
    built_experts = sorted(n for name, n in trained if ".local_experts." in name)
    assert built_experts == sorted(p.numel for p in planned if p.expert)
    assert len(built_experts) == 2 * 2 * 2 * 6  # MoE layers x (fc1, fc2) x (A, B) x experts


def test_lora_shrinks_the_actor_and_drops_the_reference():
    path = REPO / "configs" / "gsm8k_grpo_8gpu.yaml"
    shape = json.loads((REPO / "configs" / "model_shapes" / "Qwen2.5-7B.json").read_text())
    arch = arch_from_hf_config(shape)
    rows = {}
    for rank in (0, 64):
        cfg = load_config(path, [f"actor_rollout_ref.model.lora_rank={rank}"])
        inputs = PlanInputs.from_config(cfg, arch, 8, "cuda")
        plan = plan_memory(inputs, gpu_bytes=80 * 1024**3)
        rows[rank] = {r.role: r for r in plan.rows}
    full, lora = rows[0], rows[64]
    # rank 64 on every linear layer of 28 layers: ~161M adapters (~2% of 7.6B), TP 2
    assert lora["actor"].gradients < full["actor"].gradients / 30
    assert lora["actor"].optimizer_state < full["actor"].optimizer_state / 30
    assert lora["actor"].weights < full["actor"].weights * 1.05
    assert full["reference"].weights > 7e9 and lora["reference"].weights == 0


def test_an_adapter_sync_plans_the_adapters_it_sends(tmp_path, tiny_qwen2_dir, cpu_rank):
    """The planned adapter-only sync is twice the PEFT tensors the sync sends (counted from
    the real export of a tiny model), and for the 7B config at rank 64 it replaces the
    full sync's buckets: the sync phase's peak falls by them."""
    from rlhf.models.builder import build_model
    from rlhf.models.chunks import ModelChunks
    from rlhf.models.convert import peft_tensors
    from rlhf.models.mapping import Placement

    arch = check_model_dir(tiny_qwen2_dir)
    for targets in ("all-linear", ["o_proj", "down_proj"]):
        spec = LoraSpec(8, 16.0, megatron_targets(targets))
        model = build_model(arch, Placement())
        add_lora(ModelChunks.of(model, Placement()), spec, model.config, tp_rank=0)
        sent = sum(t.numel() * 4 for _, t in peft_tensors(model, arch, Placement()))
        assert adapter_sync_bytes(arch, spec, 4) == 2 * sent, targets
    path = REPO / "configs" / "gsm8k_grpo_8gpu.yaml"
    shape = json.loads((REPO / "configs" / "model_shapes" / "Qwen2.5-7B.json").read_text())
    phases = {}
    for merge in (True, False):
        overrides = [
            "actor_rollout_ref.model.lora_rank=64",
            f"actor_rollout_ref.model.lora_merge={merge}",
        ]
        inputs = PlanInputs.from_config(load_config(path, overrides), arch_from_hf_config(shape), 8)
        phases[merge] = plan_memory(inputs, gpu_bytes=80 * 1024**3).phases["weight_sync"]
    assert phases[False] < phases[True] - 1024**3
