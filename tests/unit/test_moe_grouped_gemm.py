"""Mixture-of-experts experts as Transformer Engine's grouped GEMM on GPU (issue 51, slowdowns):
with TE's layers Megatron's `TEGroupedMLP` (parameters `mlp.experts.linear_fc1.weight{i}`),
on the local spec `SequentialMLP` (`mlp.experts.local_experts.{i}.linear_fc1.weight`).

Decided on the CPU with TE reported usable or not (`rlhf.models.gpt.transformer_engine_problem`
replaced); the grouped names are driven through the real model build, the HF loader, the
converter's export, the weight sync's gather and the optimizer checkpoint's names by a
stand-in module with TEGroupedMLP's parameter tree (TE itself does not run here), compared
with the SequentialMLP model built from the same HF checkpoint. Checkpoint keys: a MoE layer
on TE's spec (its modules stood in by local ones, its key map TE's) writes what the local
spec writes, and a CPU checkpoint loads where TE's modules ask for `_extra_state` it lacks."""

from __future__ import annotations

import pytest
import torch
from megatron.core.models.gpt import gpt_layer_specs
from megatron.core.transformer.moe.experts import GroupedMLP, SequentialMLP
from megatron.core.transformer.spec_utils import ModuleSpec
from safetensors.torch import load_file
from torch import nn

from rlhf.models import gpt
from rlhf.models.builder import build_model, load_hf_weights
from rlhf.models.chunks import ModelChunks
from rlhf.models.convert import export_hf_tensors
from rlhf.models.families import (
    arch_from_hf_config,
    check_transformer_overrides,
    load_arch,
    transformer_config,
)
from rlhf.models.hf_io import HFCheckpointReader
from rlhf.models.mapping import Placement, hf_names, resolve, sequential_expert_name
from rlhf.quickstart.tiny_model import TinyModelSpec, save_tiny_model
from rlhf.weight_sync.gather import SyncTopology, iter_stage_tensors
from tests.unit.test_model_families import hf_dict, moe_dict

NO_TE = "no CUDA device"


@pytest.fixture
def te(monkeypatch):
    """Report Transformer Engine usable (`te(True)`) or not, as on a GPU / the CPU."""

    def set_usable(usable: bool) -> None:
        problem = None if usable else NO_TE
        monkeypatch.setattr(gpt, "transformer_engine_problem", lambda: problem)

    return set_usable


class TEGroupedMLP(nn.Module):
    """Stand-in with Megatron's TEGroupedMLP's parameter tree: TE's grouped linear layers
    hold local expert i's weight as `weight{i}`, shaped as SequentialMLP's expert's (fc1
    [2 x moe_ffn / expert-TP, hidden], fc2 [hidden, moe_ffn / expert-TP]). No forward."""

    def __init__(self, num_local_experts, config, submodules=None, pg_collection=None):
        super().__init__()
        ffn = config.moe_ffn_hidden_size // config.expert_tensor_parallel_size
        hidden = config.hidden_size
        self.linear_fc1, self.linear_fc2 = nn.Module(), nn.Module()
        for i in range(num_local_experts):
            fc1, fc2 = torch.empty(2 * ffn, hidden), torch.empty(hidden, ffn)
            self.linear_fc1.register_parameter(f"weight{i}", nn.Parameter(fc1))
            self.linear_fc2.register_parameter(f"weight{i}", nn.Parameter(fc2))


def _te_spec(experts: type, calls: list):
    """A stand-in for Megatron's TE layer spec: the local spec's modules with TE's MoE layer
    layout (the input norm fused into linear_qkv, named `linear_qkv.layer_norm_weight`; the
    pre-MLP norm of a MoE layer a module of its own; TE's key map), `experts` as experts."""

    def build(num_experts=None, moe_grouped_gemm=False, qk_layernorm=False, **kwargs):
        calls.append((num_experts, moe_grouped_gemm))
        spec = gpt_layer_specs.get_gpt_layer_local_spec(
            num_experts=num_experts, normalization="RMSNorm", qk_layernorm=qk_layernorm
        )
        spec.submodules.sharded_state_dict_keys_map = {
            "input_layernorm.": "self_attention.linear_qkv.layer_norm_",  # TE's fused norm
            "mlp.0.weight": "mlp.linear_fc1.layer_norm_weight",  # TE's own map from here
            "mlp.1.basic_ops.0.weight": "mlp.linear_fc1.weight",
            "mlp.3.basic_ops.0.weight": "mlp.linear_fc2.weight",
        }
        if num_experts and experts is not SequentialMLP:  # the local spec's has its linears
            spec.submodules.mlp.submodules.experts = ModuleSpec(module=experts)
        return spec

    return build


def _moe_config(**overrides):
    return transformer_config(arch_from_hf_config(moe_dict("qwen3_moe")), overrides=overrides)


# --- the decision ---------------------------------------------------------------------------


@pytest.mark.parametrize("usable", [True, False], ids=["transformer-engine", "local-spec"])
def test_experts_are_grouped_exactly_when_transformer_engine_layers_are_used(te, usable):
    te(usable)
    assert _moe_config().moe_grouped_gemm is usable
    dense = transformer_config(arch_from_hf_config(hf_dict("qwen3")))
    assert dense.moe_grouped_gemm is False


def test_the_te_spec_is_asked_for_grouped_experts_in_moe_layers_only(te, monkeypatch):
    te(True)
    calls: list = []
    builder = _te_spec(TEGroupedMLP, calls)
    monkeypatch.setattr(gpt_layer_specs, "get_gpt_layer_with_transformer_engine_spec", builder)
    config = _moe_config()
    gpt.gpt_layer_spec(config, qk_layernorm=True)
    spec = gpt.gpt_layer_spec(config, qk_layernorm=True, num_experts=6)
    assert calls == [(None, False), (6, True)]
    assert spec.submodules.mlp.submodules.experts.module is TEGroupedMLP


def test_the_local_spec_keeps_sequential_experts(te):
    te(False)
    config = _moe_config()
    spec = gpt.gpt_layer_spec(config, num_experts=config.num_moe_experts)
    assert config.moe_grouped_gemm is False
    assert spec.submodules.mlp.submodules.experts.module is SequentialMLP


def test_an_override_to_sequential_experts_is_honoured_with_transformer_engine(te, monkeypatch):
    te(True)
    calls: list = []
    builder = _te_spec(SequentialMLP, calls)
    monkeypatch.setattr(gpt_layer_specs, "get_gpt_layer_with_transformer_engine_spec", builder)
    config = _moe_config(moe_grouped_gemm=False)
    gpt.gpt_layer_spec(config, num_experts=6)
    assert config.moe_grouped_gemm is False and calls == [(6, False)]


def test_an_override_to_grouped_experts_without_transformer_engine_is_refused_in_one_line(te):
    te(False)
    key = "actor_rollout_ref.actor.megatron.override_transformer_config"
    with pytest.raises(ValueError, match=rf"^{key}\.moe_grouped_gemm=true needs Transformer Eng"):
        check_transformer_overrides({"moe_grouped_gemm": True}, key)
    check_transformer_overrides({"moe_grouped_gemm": False}, key)
    with pytest.raises(ValueError, match=r"moe_grouped_gemm=true needs .*\(no CUDA device\)"):
        _moe_config(moe_grouped_gemm=True)
    with pytest.raises(ValueError, match=r"moe_use_legacy_grouped_gemm=True: .*legacy GroupedMLP"):
        check_transformer_overrides({"moe_use_legacy_grouped_gemm": True}, key)


def test_megatrons_legacy_grouped_experts_are_refused(te, monkeypatch):
    """Megatron falls back to GroupedMLP (fused weight1/weight2) when TE lacks its grouped
    linear layers: names the mapping does not know."""
    te(True)
    builder = _te_spec(GroupedMLP, [])
    monkeypatch.setattr(gpt_layer_specs, "get_gpt_layer_with_transformer_engine_spec", builder)
    with pytest.raises(ValueError, match=r"built the experts as GroupedMLP, not TEGroupedMLP"):
        gpt.gpt_layer_spec(_moe_config(), num_experts=6)


# --- the names of the grouped layout ----------------------------------------------------------


def test_grouped_expert_names_resolve_to_their_global_hf_experts():
    arch = arch_from_hf_config(moe_dict("qwen3_moe"))  # 6 experts, 4 layers
    second_ep_rank = Placement(ep_rank=1, ep_size=2, pp_rank=1, pp_size=2)
    rule, layer = resolve(arch, "decoder.layers.1.mlp.experts.linear_fc2.weight1", second_ep_rank)
    assert (layer, hf_names(rule, layer)) == (3, ["model.layers.3.mlp.experts.4.down_proj.weight"])
    rule, layer = resolve(arch, "decoder.layers.0.mlp.experts.linear_fc1.weight2", Placement())
    assert hf_names(rule, layer) == [
        f"model.layers.0.mlp.experts.2.{p}_proj.weight" for p in ("gate", "up")
    ]
    assert sequential_expert_name("decoder.layers.0.mlp.shared_experts.linear_fc1.weight") == (
        "decoder.layers.0.mlp.shared_experts.linear_fc1.weight"  # not a routed expert
    )


@pytest.fixture(scope="module")
def ctx(cpu_rank):
    return cpu_rank


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return save_tiny_model(
        tmp_path_factory.mktemp("moe") / "hf", TinyModelSpec.for_family("qwen3_moe")
    )


def _loaded(hf_dir, grouped: bool, monkeypatch):
    """The tiny Qwen3-MoE built on the local spec, its experts the TEGroupedMLP stand-in when
    `grouped`, loaded from the HF checkpoint."""
    if grouped:
        local_spec = gpt.gpt_layer_spec

        def with_grouped_experts(config, qk_layernorm=False, num_experts=None):
            spec = local_spec(config, qk_layernorm, num_experts)
            if num_experts:
                spec.submodules.mlp.submodules.experts = ModuleSpec(module=TEGroupedMLP)
            return spec

        monkeypatch.setattr(gpt, "gpt_layer_spec", with_grouped_experts)
    arch = load_arch(hf_dir)
    model = build_model(arch, Placement(), initialize=False)
    monkeypatch.undo()
    load_hf_weights(model, HFCheckpointReader(hf_dir), arch, Placement())
    return model, arch


def test_grouped_experts_load_the_same_hf_weights_as_sequential_ones(ctx, hf_dir, monkeypatch):
    grouped, _ = _loaded(hf_dir, True, monkeypatch)
    sequential, _ = _loaded(hf_dir, False, monkeypatch)
    names = dict(grouped.named_parameters())
    assert "decoder.layers.1.mlp.experts.linear_fc1.weight7" in names
    assert not any(".local_experts." in n for n in names)
    reference = dict(sequential.named_parameters())
    assert len(names) == len(reference)
    for name, param in names.items():
        torch.testing.assert_close(param, reference[sequential_expert_name(name)], rtol=0, atol=0)


def _hf_tensors(hf_dir) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(hf_dir.glob("*.safetensors")):
        tensors |= load_file(path)
    return tensors


def _assert_same_tensors(pairs, expected: dict[str, torch.Tensor]) -> None:
    got = dict(pairs)
    assert sorted(got) == sorted(expected)
    for name, tensor in got.items():
        torch.testing.assert_close(tensor, expected[name], rtol=0, atol=0)


def test_grouped_experts_export_and_sync_as_the_hf_checkpoint(ctx, hf_dir, monkeypatch):
    """Megatron -> HF: the converter's export and the weight sync's gather (one rank)."""
    model, arch = _loaded(hf_dir, True, monkeypatch)
    expected = _hf_tensors(hf_dir)
    assert any(".mlp.experts.7.down_proj.weight" in n for n in expected)
    _assert_same_tensors(export_hf_tensors(model, arch, Placement()), expected)
    topology = SyncTopology(Placement(), None, None, (0,), in_sync_replica=True)
    _assert_same_tensors(iter_stage_tensors(model, arch, topology), expected)


def test_optimizer_checkpoint_names_do_not_depend_on_the_expert_module(ctx, hf_dir, monkeypatch):
    grouped, _ = _loaded(hf_dir, True, monkeypatch)
    sequential, _ = _loaded(hf_dir, False, monkeypatch)
    names = ModelChunks.of(grouped, Placement()).global_names()
    reference = {n: p for p, n in ModelChunks.of(sequential, Placement()).global_names().items()}
    assert sorted(names.values()) == sorted(reference)
    for param, name in names.items():
        torch.testing.assert_close(param, reference[name], rtol=0, atol=0)


# --- checkpoint keys ---------------------------------------------------------------------------


def _sharded_keys(model) -> set[str]:
    return {v.key for v in model.sharded_state_dict().values() if hasattr(v, "key")}


def test_a_moe_layer_writes_the_same_checkpoint_keys_on_either_spec(ctx, hf_dir, te, monkeypatch):
    """Megatron's local spec stores a MoE layer's pre-MLP norm under the fused norm-linear's
    key, TE's spec under `pre_mlp_layernorm.weight`: `trainer.save_hf` (a CPU process) could
    not read a MoE checkpoint written on a GPU."""
    arch = load_arch(hf_dir)
    te(False)
    local = _sharded_keys(build_model(arch, Placement(), initialize=False))
    assert "decoder.layers.0.mlp.linear_fc1.layer_norm_weight" in local
    te(True)
    builder = _te_spec(SequentialMLP, [])
    monkeypatch.setattr(gpt_layer_specs, "get_gpt_layer_with_transformer_engine_spec", builder)
    sequential = {"moe_grouped_gemm": False}  # the stand-in's experts: SequentialMLP
    te_model = build_model(arch, Placement(), initialize=False, overrides=sequential)
    assert _sharded_keys(te_model) == local


def test_a_cpu_checkpoint_loads_into_modules_with_te_extra_states(ctx, hf_dir, tmp_path):
    """Transformer Engine's norms keep an `_extra_state` Megatron's local ones do not write:
    absent from a checkpoint, it loads as None (TE's "no state"); an absent weight does not."""
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.transformer.utils import make_sharded_object_for_checkpoint

    from rlhf.models.dist_ckpt import load_distributed, save_distributed
    from rlhf.models.hf_io import CheckpointFileError

    model = build_model(load_arch(hf_dir), Placement())  # the local spec's
    save_distributed(model.sharded_state_dict(), tmp_path)
    norm_state = "decoder.final_layernorm._extra_state"
    wanted = model.sharded_state_dict()
    wanted[norm_state] = make_sharded_object_for_checkpoint(torch.empty(0), norm_state)
    state = load_distributed(wanted, tmp_path)
    assert state[norm_state] is None
    weight = model.decoder.final_layernorm.weight
    torch.testing.assert_close(state["decoder.final_layernorm.weight"], weight, rtol=0, atol=0)
    wanted = model.sharded_state_dict()
    wanted["extra.weight"] = ShardedTensor.from_rank_offsets("extra.weight", torch.zeros(2))
    with pytest.raises(CheckpointFileError, match="cannot be read"):
        load_distributed(wanted, tmp_path)
