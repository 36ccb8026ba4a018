"""Mixture-of-experts models (Qwen3-MoE, Qwen2-MoE with its gated shared expert, GLM-4.5 with
its sigmoid router) built with transformers load into Megatron at 1 rank, EP2, EP2 x TP2
(expert-TP 1 and 2) and EP2 x PP2 and give transformers' logits (fp32, within 1e-5);
HF -> Megatron (EP2) -> HF is bitwise; `rlhf-convert verify` passes on the converted
checkpoint; an EP that does not divide the experts is one line before any process starts.

Odd shapes on purpose: 6 experts (3 per EP rank), top-3 of 6 and top-2, `norm_topk_prob`
true and false, dense layers among the MoE layers by `mlp_only_layers` (Qwen3-MoE) and
`decoder_sparse_step` (Qwen2-MoE), a shared expert with its sigmoid gate (Qwen2-MoE); GLM-4.5's
DeepSeek-style routing (sigmoid scores plus a random expert bias choosing the top 4 within the
best 2 of 2 groups, renormalised and scaled by 2.5; two ungated shared experts; the first layer
dense) with q/k norms, QKV bias and rotary embedding on half of each head; DeepSeek-V3's
multi-latent attention with YaRN and the same routing; and the Qwen3-MoE checkpoint rewritten
with its experts fused (transformers 5's in-memory form).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM

from rlhf.cli.convert import main as convert_main
from tests.helpers import run_torchrun

VOCAB = 96
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=40,  # the dense layers' MLP
    moe_intermediate_size=12,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_experts=6,
    max_position_embeddings=128,
    rms_norm_eps=1e-6,
    initializer_range=0.1,  # larger than the default 0.02: routing and experts matter
)
MODELS = {
    # layers 0, 2, 3 MoE, 1 dense; top-2 renormalised
    "qwen3_moe": dict(
        model_type="qwen3_moe",
        head_dim=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        mlp_only_layers=[1],
    ),
    # layers 1, 3 MoE, 0, 2 dense; top-3 not renormalised; shared expert with its gate
    "qwen2_moe": dict(
        model_type="qwen2_moe",
        num_experts_per_tok=3,
        norm_topk_prob=False,
        decoder_sparse_step=2,
        shared_expert_intermediate_size=20,
    ),
    # layer 0 dense, 1-3 MoE; sigmoid + expert bias, top-4 within the best 2 of 2 groups
    "glm4_moe": dict(
        model_type="glm4_moe",
        head_dim=16,
        n_routed_experts=6,
        num_experts_per_tok=4,
        n_group=2,
        topk_group=2,
        first_k_dense_replace=1,
        n_shared_experts=2,
        routed_scaling_factor=2.5,
        use_qk_norm=True,
        attention_bias=True,
        partial_rotary_factor=0.5,
        num_nextn_predict_layers=0,
    ),
    # DeepSeek-V3: multi-latent attention (q latent 24, kv latent 16 + a rotary key of 4
    # interleaved dimensions, heads of 8 + 4 for q/k and 6 for v) with YaRN (both attention
    # factors != 1), the same routing as GLM-4.5's with one shared expert
    "deepseek_v3": dict(
        model_type="deepseek_v3",
        num_key_value_heads=4,  # MLA: every head its own key (transformers repeats by this)
        n_routed_experts=6,
        num_experts_per_tok=4,
        n_group=2,
        topk_group=2,
        first_k_dense_replace=1,
        n_shared_experts=1,
        routed_scaling_factor=2.5,
        # as the published config.json has them (SGLang reads them; transformers does not)
        moe_layer_freq=1,
        topk_method="noaux_tc",
        scoring_func="sigmoid",
        q_lora_rank=24,
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=4,
        v_head_dim=6,
        rope_scaling={
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 32,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 0.9,
            "mscale_all_dim": 1.0,
        },
        num_nextn_predict_layers=0,
    ),
}
LAYOUTS = {  # name -> (ranks, worker arguments)
    "1rank": (1, []),
    "ep2": (2, ["--ep", "2"]),
    "ep2tp2etp1": (4, ["--tp", "2", "--ep", "2", "--etp", "1"]),
    "ep2tp2etp2": (4, ["--tp", "2", "--ep", "2", "--etp", "2"]),
    "ep2pp2": (4, ["--pp", "2", "--ep", "2"]),
}


def save_moe_model(out: Path, fields: dict, seed: int) -> Path:
    config = AutoConfig.for_model(**{**COMMON, **fields})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    for name, buffer in model.named_buffers():
        if name.endswith("e_score_correction_bias"):  # zeros as built: make the choice depend on it
            buffer.copy_(torch.randn_like(buffer) * 0.2)
    model.save_pretrained(out)
    return out


def save_fused_copy(src: Path, out: Path) -> Path:
    """`src` with each layer's experts stored fused, as transformers 5 holds them in memory:
    gate_up_proj [E, 2I, H] (gate rows, then up rows), down_proj [E, H, I]."""
    shutil.copytree(src, out)
    tensors, fused = read_all(src), {}
    for name, tensor in tensors.items():
        if ".mlp.experts." not in name:
            fused[name] = tensor
    experts = COMMON["num_experts"]
    for layer in range(COMMON["num_hidden_layers"]):
        prefix = f"model.layers.{layer}.mlp.experts."
        if f"{prefix}0.gate_proj.weight" not in tensors:
            continue  # a dense layer
        per = [
            [tensors[f"{prefix}{e}.{p}_proj.weight"] for e in range(experts)]
            for p in ("gate", "up", "down")
        ]
        gate_up = [torch.cat([g, u]) for g, u in zip(per[0], per[1], strict=True)]
        fused[prefix + "gate_up_proj"] = torch.stack(gate_up)
        fused[prefix + "down_proj"] = torch.stack(per[2])
    for file in out.glob("*.safetensors*"):
        file.unlink()
    save_file(fused, out / "model.safetensors")
    return out


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_models")
    dirs = {name: save_moe_model(root / name, f, i) for i, (name, f) in enumerate(MODELS.items())}
    # the same weights with experts stored fused: the same logits
    dirs["qwen3_moe_fused"] = save_fused_copy(dirs["qwen3_moe"], root / "qwen3_moe_fused")
    tokens = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(0))
    torch.save(tokens, root / "tokens.pt")
    reference = {}
    for name in MODELS:
        model = AutoModelForCausalLM.from_pretrained(dirs[name], dtype=torch.float32).eval()
        with torch.no_grad():
            reference[name] = model(tokens).logits
    reference["qwen3_moe_fused"] = reference["qwen3_moe"]
    return dirs, root / "tokens.pt", reference


def test_the_models_mix_dense_and_moe_layers(moe_models):
    from rlhf.models.families import load_arch

    dirs, _, _ = moe_models
    qwen3, qwen2 = load_arch(dirs["qwen3_moe"]), load_arch(dirs["qwen2_moe"])
    assert qwen3.moe is not None and qwen2.moe is not None
    assert qwen3.moe.layers == (True, False, True, True)
    assert qwen2.moe.layers == (False, True, False, True)
    assert (qwen3.moe.shared_expert_size, qwen2.moe.shared_expert_size) == (None, 20)
    glm = load_arch(dirs["glm4_moe"])
    assert glm.moe is not None and glm.moe.layers == (False, True, True, True)
    assert (glm.moe.shared_expert_size, glm.moe.shared_expert_gate) == (24, False)
    assert (glm.moe.num_groups, glm.moe.group_topk, glm.moe.scaling_factor) == (2, 2, 2.5)
    assert glm.rotary_dim == 8
    deepseek = load_arch(dirs["deepseek_v3"])
    assert deepseek.mla is not None and deepseek.mla.yarn is not None
    assert deepseek.moe is not None and deepseek.moe.layers == (False, True, True, True)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_moe_logits_match_transformers(moe_models, tmp_path, layout):
    dirs, tokens, reference = moe_models
    nproc, extra = LAYOUTS[layout]
    args = ["--tokens", str(tokens), "--out-dir", str(tmp_path), *extra]
    for name, path in dirs.items():
        args += ["--model", f"{name}={path}"]
    run_torchrun("hf_model_parity.py", nproc, args)
    for name, want in reference.items():
        got = torch.load(tmp_path / f"{name}.pt")
        assert got.shape == want.shape, name
        diff = (got - want).abs().max().item()
        print(f"{name} {layout}: max |logit diff| {diff:.2e} (logits up to {want.abs().max():.2f})")
        assert diff < 1e-5, f"{name} at {layout}: max |logit diff| = {diff}"


def read_all(model_dir: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors


def rlhf_convert(nproc: int, out: Path, *args) -> str:
    """`rlhf-convert ARGS` on `nproc` ranks started as its own torchrun relaunch would start
    them (but forked from the session's preloaded server: three real torchrun launches
    cost over a minute here); rank 0's output."""
    run_torchrun("convert_cli.py", nproc, [str(out), *map(str, args)])
    return out.read_text()


@pytest.mark.parametrize("family", ["qwen2_moe", "glm4_moe", "deepseek_v3"])
def test_round_trip_through_ep2_is_bitwise_and_verifies(moe_models, tmp_path, family):
    dirs, _, _ = moe_models
    hf_dir = dirs[family]
    mcore, back = tmp_path / "mcore", tmp_path / "hf_back"
    rlhf_convert(2, tmp_path / "to_mcore.out", "hf-to-mcore", hf_dir, mcore, "--ep", 2)
    meta = json.loads((mcore / "rlhf_checkpoint.json").read_text())
    assert meta["saved_expert_model_parallel_size"] == 2
    rlhf_convert(1, tmp_path / "to_hf.out", "mcore-to-hf", mcore, back)
    original, restored = read_all(hf_dir), read_all(back)
    assert sorted(original) == sorted(restored)
    for name, tensor in original.items():
        assert torch.equal(tensor, restored[name]), name
    # the EP2 checkpoint loaded at TP2 with experts split over the same 2 ranks (EP2, ETP1)
    verify = ["verify", hf_dir, mcore, "--ep", 2, "--tp", 2, "--etp", 1, "--tol", 1e-5]
    out = rlhf_convert(2, tmp_path / "verify.out", *verify)
    print(out.strip())
    assert "EP 2 ETP 1" in out and out.strip().endswith("OK"), out


def test_an_ep_that_does_not_divide_the_experts_is_one_line(moe_models, tmp_path, capsys):
    dirs, _, _ = moe_models
    code = convert_main(["hf-to-mcore", str(dirs["qwen3_moe"]), str(tmp_path / "out"), "--ep", "4"])
    err = capsys.readouterr().err
    (line,) = [x for x in err.splitlines() if x.startswith("rlhf-convert:")]
    assert code == 2 and "Traceback" not in err, err
    assert "num_experts (6) must be divisible by the expert parallel size (4)" in line
    assert "--ep 4" in line and not (tmp_path / "out").exists()
