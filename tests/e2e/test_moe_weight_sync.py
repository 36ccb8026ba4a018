"""Weight sync of mixture-of-experts actors into a real SGLang CPU server (one per model
family and module), at EP2 with and without TP, expert-TP and PP, through every transport.

After each sync (the actor perturbed before it) the trainer's probe log-probs equal
SGLang's, the server reports the version, the exported tensors carry every HF per-expert
name of the checkpoint, and SGLang's greedy tokens equal transformers' on the exported
weights. The models are the tiny ones of test_moe_parity with every layer a MoE layer:
SGLang 0.5.23's qwen3_moe and qwen2_moe build every layer sparse, whatever
`mlp_only_layers` / `decoder_sparse_step` say.
"""

from __future__ import annotations

import itertools
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from rlhf.models.convert import copy_hf_side_files
from tests.distributed.test_moe_parity import MODELS, save_moe_model
from tests.distributed.workers.moe_weight_sync import PROMPTS
from tests.helpers import run_torchrun

ALL_SPARSE = {"mlp_only_layers": [], "decoder_sparse_step": 1}
TRANSPORTS = ("tensor", "distributed", "disk")
LAYOUTS = {  # name -> (ranks, worker arguments); every one at EP2
    "ep2": (2, ["--ep", "2"]),
    "ep2tp2etp1": (4, ["--tp", "2", "--ep", "2", "--etp", "1"]),
    "ep2tp2etp2": (4, ["--tp", "2", "--ep", "2", "--etp", "2"]),
    "ep2pp2": (4, ["--pp", "2", "--ep", "2"]),
}
CASES = [("qwen3_moe", layout) for layout in LAYOUTS] + [("qwen2_moe", "ep2tp2etp1")]
VERSIONS = itertools.count(1, len(TRANSPORTS))  # first version of each run's syncs


@pytest.fixture(scope="module")
def moe_server(request, tmp_path_factory):
    """(model dir, server) of one family: the tiny MoE model with the quickstart tokenizer,
    served by SGLang on the CPU (fp32)."""
    from rlhf.config.rollout import RolloutConfig
    from rlhf.quickstart.tokenizer import build_tiny_tokenizer
    from rlhf.rollout.sglang_server import SGLangServer, build_server_args
    from rlhf.utils import free_port

    family = request.param
    model_dir = save_moe_model(
        tmp_path_factory.mktemp(family) / "hf", {**MODELS[family], **ALL_SPARSE}, seed=3
    )
    build_tiny_tokenizer().save_pretrained(model_dir)
    rollout = RolloutConfig(dtype="float32")
    launch = build_server_args(
        rollout, model_dir, port=free_port(), device="cpu", max_total_tokens=4096
    )
    log = tmp_path_factory.mktemp(f"{family}_server") / "server.log"
    with SGLangServer(launch, log).start() as server:
        server.wait_healthy(300)
        yield model_dir, server


def hf_greedy(model_dir: Path) -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    result = []
    for prompt in PROMPTS:
        with torch.no_grad():
            out = model.generate(
                torch.tensor([prompt]), max_new_tokens=8, min_new_tokens=8, do_sample=False
            )
        result.append(out[0, len(prompt) :].tolist())
    return result


@pytest.mark.parametrize(
    ("moe_server", "layout"), CASES, ids=[f"{f}-{x}" for f, x in CASES], indirect=["moe_server"]
)
def test_moe_sync_makes_sglang_match_the_actor(moe_server, tmp_path, layout):
    model_dir, server = moe_server
    nproc, extra = LAYOUTS[layout]
    first = next(VERSIONS)
    args = ["--hf-dir", str(model_dir), "--server-url", server.url, "--out-dir", str(tmp_path)]
    args += ["--transports", ",".join(TRANSPORTS), "--version", str(first), *extra]
    run_torchrun("moe_weight_sync.py", nproc, args)
    report = json.loads((tmp_path / "report.json").read_text())
    original = load_file(model_dir / "model.safetensors")
    for version, transport in enumerate(TRANSPORTS, start=first):
        synced = report[transport]
        print(f"{layout} {transport}: probe diff {synced['probe_diff']:.2e}")
        assert synced["weight_version"] == str(version), (transport, synced)
        assert synced["probe_diff"] < 1e-3, (transport, synced)
        assert synced["num_buckets"] > 1, (transport, synced)
        exported = tmp_path / f"hf_{transport}"
        copy_hf_side_files(model_dir, exported)
        shutil.copy(tmp_path / f"{transport}.safetensors", exported / "model.safetensors")
        tensors = load_file(exported / "model.safetensors")
        assert sorted(tensors) == sorted(original), transport
        assert synced["greedy"] == hf_greedy(exported), transport
