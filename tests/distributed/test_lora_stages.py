"""A LoRA actor (`actor_rollout_ref.model.lora_rank`) on the trainer's stages, every linear
layer of the decoder adapted (rank 4, alpha 8):

- only the adapters are trained: they are the parameters needing gradients (what
  Megatron's DDP and optimizer take), and after an update every base weight is bitwise
  what it was;
- the reference is the base model with the adapters off (no second copy of the weights):
  before the update it equals the adapted actor exactly (B starts at zero), after it it is
  still the base model exactly, while the actor has moved;
- TP2, TP2 with sequence parallelism, PP2 and DP2 give one rank's log-probs after the
  update and its pg_loss and grad norm (the adapters are split over TP as their layers,
  drawn the same at every layout);
- the weights the sync serves are the base weights with each adapter's update merged;
- a saved actor loads back equal at every layout (adapters split over TP included); a TP2
  or PP2 checkpoint exports merged for transformers and as a PEFT adapter for peft, each
  giving the trainer's log-probs.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.test_moe_parity import rlhf_convert
from tests.helpers import run_worker_layouts

LAYOUTS = {  # --critic: a LoRA critic beside the actor (GAE)
    "1rank": (1, ["--critic"]),
    "tp2": (2, ["--tp", "2", "--critic"]),
    "tp2sp": (2, ["--tp", "2", "--sp"]),
    "pp2": (2, ["--pp", "2", "--critic"]),
    "dp2": (2, []),
}


@pytest.fixture(scope="module")
def results(tiny_qwen2_dir, tmp_path_factory):
    return run_worker_layouts(
        "lora_stages.py", LAYOUTS, tiny_qwen2_dir, tmp_path_factory.mktemp("lora")
    )


def test_only_the_adapters_train(results):
    for name, result in results.items():
        assert result["base_unchanged"], name
        assert result["trained"] and all(".lora." in n for n in result["trained"]), name
    one = results["1rank"]["trained"]
    kinds = {n.split(".lora.")[0].rsplit(".", 1)[-1] for n in one}
    assert kinds == {"linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"}


def test_the_checkpoint_holds_the_adapters_and_round_trips_exactly(results):
    """Saved and loaded into a fresh actor (built from the HF model): weights, adapters and
    their Adam state equal; the checkpoint holds the adapters alone and their optimizer
    state (every tensor it lists is an adapter's)."""
    from pathlib import Path

    from torch.distributed.checkpoint import FileSystemReader

    assert all(r["checkpoint_round_trip"] for r in results.values())
    for name in ("1rank", "tp2", "pp2"):
        saved = Path(results[name]["checkpoint"]) / "model"
        keys = list(FileSystemReader(str(saved)).read_metadata().state_dict_metadata)
        assert keys and all(".lora." in k for k in keys), [k for k in keys if ".lora." not in k]


def test_the_reference_is_the_base_model_with_adapters_off(results):
    for name, result in results.items():
        assert torch.equal(result["ref_before"], result["logprobs_before"]), name
        assert torch.equal(result["ref_after"], result["ref_before"]), name
        moved = (result["logprobs_after"] - result["logprobs_before"]).abs().max()
        assert moved > 1e-3, name


@pytest.mark.parametrize("layout", [k for k in LAYOUTS if k != "1rank"])
def test_layouts_update_as_one_rank(results, layout):
    one, other = results["1rank"], results[layout]
    diff = (one["logprobs_after"] - other["logprobs_after"]).abs().max()
    print(f"{layout}: log-probs after the update within {diff:.2e} of one rank")
    assert diff < 2e-5
    for key in ("actor/pg_loss", "actor/grad_norm"):
        assert other["metrics"][key] == pytest.approx(one["metrics"][key], rel=1e-5), key


def test_the_served_weights_merge_each_adapter(results, tiny_qwen2_dir):
    from safetensors.torch import load_file

    one = results["1rank"]
    hf = load_file(tiny_qwen2_dir / "model.safetensors")
    down = one["merged"]["decoder.layers.1.mlp.linear_fc2.weight"]
    a = one["adapters"]["decoder.layers.1.mlp.linear_fc2.lora.lora_A.weight"]
    b = one["adapters"]["decoder.layers.1.mlp.linear_fc2.lora.lora_B.weight"]
    base = hf["model.layers.1.mlp.down_proj.weight"]
    assert torch.allclose(down, base + 2.0 * b @ a, atol=1e-6)  # alpha / rank = 2
    assert not torch.allclose(down, base)


@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_a_checkpoint_exports_the_merged_policy_at_any_layout(results, layout, tmp_path):
    """The updated actor saved at TP2 (the adapters split as their layers, fc1's B as
    Megatron saves fc1) or PP2, read by `rlhf-convert mcore-to-hf` in one process and
    exported with the adapters merged: transformers on the export gives the trainer's
    log-probs after the update (an independent forward of the same policy)."""
    from transformers import AutoModelForCausalLM

    out = tmp_path / "hf"
    rlhf_convert(1, tmp_path / "export.out", "mcore-to-hf", results[layout]["checkpoint"], out)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    worst = logprob_gap(model, results, layout)
    print(f"{layout}: transformers on the merged export within {worst:.2e} of the trainer")
    assert worst < 2e-5


def test_the_adapters_export_for_peft(results, tiny_qwen2_dir, tmp_path):
    """`rlhf-convert mcore-to-hf --peft` of the TP2 checkpoint: PEFT loads the adapters onto
    the HF base model and gives the trainer's log-probs after the update (q/k/v and
    gate/up adapters split from Megatron's fused ones)."""
    import json

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    out = tmp_path / "peft"
    rlhf_convert(
        1, tmp_path / "peft.out", "mcore-to-hf", results["tp2"]["checkpoint"], out, "--peft"
    )
    config = json.loads((out / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"]) == (4, 8.0)
    base = AutoModelForCausalLM.from_pretrained(tiny_qwen2_dir, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, out).eval()
    worst = logprob_gap(model, results, "tp2")
    print(f"peft on the exported adapters within {worst:.2e} of the trainer")
    assert worst < 2e-5
    with model.disable_adapter():  # adapters off: the base model, as the reference
        assert logprob_gap(model, results, "tp2", "ref_after") < 2e-5


def logprob_gap(model, results, layout: str, key: str = "logprobs_after") -> float:
    """Max |transformers' log-prob - the trainer's `key`| over the worker's batch."""
    from rlhf.rollout.batch import RolloutBatch

    batch = RolloutBatch.from_objects(results["1rank"]["batch"])
    want, worst = results[layout][key], 0.0
    for i, (prompt, response) in enumerate(zip(batch.prompt_ids, batch.response_ids)):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + response])).logits[0].float()
        logp = torch.log_softmax(logits[len(prompt) - 1 : -1], -1)
        got = logp.gather(1, torch.tensor(response)[:, None])[:, 0]
        worst = max(worst, float((got - want[i, : len(response)]).abs().max()))
    return worst


def test_a_lora_critic_checkpoint_exports_the_merged_value_model(results, tmp_path):
    """The updated LoRA critic saved at PP2 (its head on the second stage), exported by
    `rlhf-convert mcore-to-hf` with its adapters merged: transformers' token classifier on
    it gives the trainer's values after the update."""
    from transformers import AutoModelForTokenClassification

    from rlhf.rollout.batch import RolloutBatch

    out = tmp_path / "critic_hf"
    rlhf_convert(
        1, tmp_path / "export.out", "mcore-to-hf", results["pp2"]["critic"]["checkpoint"], out
    )
    model = AutoModelForTokenClassification.from_pretrained(out, dtype=torch.float32).eval()
    batch = RolloutBatch.from_objects(results["1rank"]["batch"])
    want, worst = results["pp2"]["critic"]["values_after"], 0.0
    for i, (prompt, response) in enumerate(zip(batch.prompt_ids, batch.response_ids)):
        with torch.no_grad():
            values = model(torch.tensor([prompt + response])).logits[0, :, 0]
        got = values[len(prompt) - 1 : len(prompt) - 1 + len(response)]
        worst = max(worst, float((got - want[i, : len(response)]).abs().max()))
    print(f"transformers on the merged critic within {worst:.2e} of the trainer")
    assert worst < 2e-5


MOE_LAYOUTS = {  # every linear layer adapted, the routed experts' included
    "1rank": (1, ["--merge"]),
    "ep2": (2, ["--merge", "--ep", "2"]),
    "tp2sp": (2, ["--merge", "--tp", "2", "--sp"]),  # experts split over expert-TP = TP
}


def test_the_experts_of_a_mixture_of_experts_model_take_adapters_at_ep2_and_tp2(
    tmp_path_factory,
):
    """A Qwen3-MoE with every linear layer adapted, its routed experts' included: at EP2
    the experts (and their adapters) split over the ranks, at TP2 each expert's layers
    (and their adapters) over expert-TP; both update as one rank does, only the adapters
    train, every expert's adapters among them, and the checkpoint round-trips."""
    from tests.distributed.test_moe_parity import MODELS, save_moe_model

    root = tmp_path_factory.mktemp("lora_moe")
    model = save_moe_model(root / "moe", {**MODELS["qwen3_moe"], "mlp_only_layers": []}, seed=0)
    found = run_worker_layouts("lora_stages.py", MOE_LAYOUTS, model, root)
    one = found["1rank"]
    experts = {n.split(".lora.")[0] for n in one["trained"] if ".local_experts." in n}
    assert len(experts) == 4 * 2 * 6  # layers x (fc1, fc2) x experts
    for name, result in found.items():
        assert result["base_unchanged"] and result["checkpoint_round_trip"], name
        assert {n.split(".lora.")[0].rsplit(".", 1)[-1] for n in result["trained"]} == {
            "linear_qkv",
            "linear_proj",
            "linear_fc1",
            "linear_fc2",
        }, name
        diff = (one["logprobs_after"] - result["logprobs_after"]).abs().max()
        print(f"MoE LoRA (experts adapted) at {name} within {diff:.2e} of one rank")
        assert diff < 2e-5, name
        assert result["metrics"]["actor/grad_norm"] == pytest.approx(
            one["metrics"]["actor/grad_norm"], rel=1e-4
        ), name
    moved = (one["logprobs_after"] - one["logprobs_before"]).abs().max()
    assert moved > 1e-3
    assert any(".local_experts." in n for n in one["merged"])
    check_moe_exports(found, model, root)


def check_moe_exports(found: dict, model, root) -> None:
    """The EP2 checkpoint through `rlhf-convert mcore-to-hf`, merged and as a PEFT adapter:
    transformers and peft on them give the trainer's log-probs after the update."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    rlhf_convert(1, root / "merged.out", "mcore-to-hf", found["ep2"]["checkpoint"], root / "hf")
    merged = AutoModelForCausalLM.from_pretrained(root / "hf", dtype=torch.float32).eval()
    worst = logprob_gap(merged, found, "ep2")
    print(f"transformers on the merged MoE export within {worst:.2e} of the trainer")
    assert worst < 2e-5
    out = root / "peft"
    rlhf_convert(1, root / "peft.out", "mcore-to-hf", found["ep2"]["checkpoint"], out, "--peft")
    base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    adapted = PeftModel.from_pretrained(base, out).eval()
    worst = logprob_gap(adapted, found, "ep2")
    print(f"peft on the exported MoE adapters within {worst:.2e} of the trainer")
    assert worst < 2e-5


def test_a_lora_critic_trains_its_adapters_and_its_head(results):
    """`critic.model.lora_rank`: the critic trains adapters on its trunk and its new value
    head whole; its trunk's weights stay bitwise, its checkpoint holds the adapters and the
    head alone and loads back exactly, and TP2 and PP2 give one rank's values."""
    one = results["1rank"]["critic"]
    for name in ("1rank", "tp2", "pp2"):
        critic = results[name]["critic"]
        adapters = [n for n in critic["trained"] if ".lora." in n]
        assert adapters and set(critic["trained"]) - set(adapters) == {"output_layer.weight"}
        assert critic["trunk_unchanged"] and critic["round_trip"], name
        keys = critic["checkpoint_keys"]
        other = [k for k in keys if ".lora." not in k and "output_layer." not in k]
        assert keys and not other, (name, other)
        moved = (critic["values_after"] - critic["values_before"]).abs().max()
        assert moved > 1e-3, name
        diff = (critic["values_after"] - one["values_after"]).abs().max()
        assert diff < 2e-5, (name, diff)
    assert one["head_moved"]
