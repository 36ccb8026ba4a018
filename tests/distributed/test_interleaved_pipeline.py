"""Megatron's interleaved (virtual) pipeline: PP2 x VP2 takes the one-rank steps.

A 4-layer tiny model (two chunks of one layer on each of two stages) goes through two full
trainer steps (`workers/trainer_step.py`: actor, critic and reference; GAE, and GRPO with the
KL as a loss) at one rank, at PP2 x VP2, and at PP2 x VP2 with Ulysses SP2 (whose DP x SP
group of 2 turns the distributed optimizer on). Every metric (grad norms included), the
updated log-probs and the weight-sync probe's log-probs (one sample per DP rank: fewer
micro-batches than stages, so the planner pads the count to a multiple of PP with empty
micro-batches) must equal the one-rank
run's; the interleaved runs' actor checkpoints, converted to HF at one rank, must hold the
one-rank run's weights, and what the weight sync gathers from the chunks must be exactly
the run's own converted checkpoint.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from rlhf.quickstart.tiny_model import TinyModelSpec, save_tiny_model
from rlhf.trainer.export import export_hf
from tests.helpers import run_worker_layouts

VARIANTS = "gae,grpo_kl_loss"
LAYOUTS = {
    "one": (1, []),
    "pp2_vp2": (2, ["--pp", "2", "--vp", "2"]),
    "pp2_vp2_sp2": (4, ["--pp", "2", "--vp", "2", "--sp", "2"]),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    work = tmp_path_factory.mktemp("interleaved")
    model = save_tiny_model(work / "model", TinyModelSpec(num_hidden_layers=4))
    layouts = {
        name: (n, [*args, "--variants", VARIANTS, "--save", str(work / "ckpt" / name)])
        for name, (n, args) in LAYOUTS.items()
    }
    (work / "out").mkdir()
    return work, run_worker_layouts("trainer_step.py", layouts, model, work / "out")


@pytest.mark.parametrize("layout", ["pp2_vp2", "pp2_vp2_sp2"])
@pytest.mark.parametrize("name", VARIANTS.split(","))
def test_interleaved_pipeline_takes_the_one_rank_steps(runs, layout, name):
    _, results = runs
    one, other = results["one"][name], results[layout][name]
    assert (one["chunks"], other["chunks"]) == (1, 2)
    assert sorted(other["metrics"]) == sorted(one["metrics"])
    for key, value in one["metrics"].items():
        assert other["metrics"][key] == pytest.approx(value, rel=2e-4, abs=1e-6), key
    for key in ("logprobs_after", "probe_logprobs", "advantages"):
        torch.testing.assert_close(other[key], one[key], rtol=0, atol=2e-5, msg=key)


@pytest.mark.parametrize("layout", ["pp2_vp2", "pp2_vp2_sp2"])
def test_interleaved_checkpoint_converts_to_the_one_rank_weights(runs, layout):
    work, _ = runs
    weights = {}
    for run in ("one", layout):
        out = work / "hf" / run
        if not out.exists():  # the one-rank run's is converted once
            export_hf(work / "ckpt" / run / "gae", out)
        weights[run] = {k: v for f in out.glob("*.safetensors") for k, v in load_file(f).items()}
    assert sorted(weights[layout]) == sorted(weights["one"])
    assert any(".layers.3." in key for key in weights["one"])
    # Adam turns the runs' ~1e-7 gradient differences into up to ~3e-5 in weights where a
    # gradient is near 0 (8 updates at lr 2e-3); a misplaced layer is off by ~1e-1.
    for key, value in weights["one"].items():
        torch.testing.assert_close(weights[layout][key], value, rtol=0, atol=1e-4, msg=key)


@pytest.mark.parametrize("layout", ["one", "pp2_vp2", "pp2_vp2_sp2"])
def test_weight_sync_gathers_the_checkpoints_hf_weights(runs, layout):
    """What the weight sync would send from the chunks (gathered over stages and chunks on
    rank 0) is the run's own checkpoint converted to HF, tensor for tensor."""
    work, results = runs
    synced = results[layout]["gae"]["synced"]
    out = work / "hf" / layout
    if not out.exists():
        export_hf(work / "ckpt" / layout / "gae", out)
    exported = {k: v for f in out.glob("*.safetensors") for k, v in load_file(f).items()}
    assert sorted(synced) == sorted(exported)
    for key, value in exported.items():
        assert torch.equal(synced[key], value), key
