"""Weight sync of mixture-of-experts actors into a real SGLang CPU server (one per model
family), at EP2 with TP, expert-TP or PP, through every transport.

After each sync (the actor perturbed before it) the trainer's probe log-probs equal
SGLang's, the server reports the version, the exported tensors carry every HF per-expert
name of the checkpoint, and SGLang's greedy tokens and their log-probs equal transformers'
on the exported weights (transformers' greedy choice at every step of SGLang's tokens).
The models are the tiny ones of test_moe_parity with every layer a MoE layer: SGLang
0.5.23's qwen3_moe and qwen2_moe build every layer sparse, whatever `mlp_only_layers` /
`decoder_sparse_step` say. Qwen2-MoE's shared-expert gate runs on the CPU through the
project's SGLang plugin (rlhf/rollout/sglang_plugin.py). GLM-4.5's (SGLang's glm4_moe, its
first layer dense) shows that the sync carries the sigmoid router's expert bias: it is
perturbed with the weights, and SGLang's routes follow. DeepSeek-V3's (multi-latent attention
with YaRN) is served on the CPU as absorbed MLA through the plugin.
"""

from __future__ import annotations

import contextlib
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

pytestmark = pytest.mark.slow(reason="an SGLang server per MoE family, one layout x 3 transports")
ALL_SPARSE = {"mlp_only_layers": [], "decoder_sparse_step": 1}
TRANSPORTS = ("tensor", "distributed", "disk")
LAYOUTS = {  # name -> (ranks, worker arguments); every one at EP2
    "ep2tp2etp1": (4, ["--tp", "2", "--ep", "2", "--etp", "1"]),  # both inside the replica
    "ep2tp2etp2": (4, ["--tp", "2", "--ep", "2", "--etp", "2"]),  # split over expert-TP too
    "ep2pp2": (4, ["--pp", "2", "--ep", "2"]),  # on both pipeline stages
}
# One family after the other: one server start each (~35 s; a run costs ~6 s more), one
# layout each, so that together they cover expert-TP, PP and TP with latent attention. Plain
# EP2 over two DP replicas is the whole run's layout (tests/e2e/test_quickstart_moe_learning.py).
CASES = [("qwen3_moe", "ep2tp2etp2"), ("qwen2_moe", "ep2pp2")]
CASES += [("glm4_moe", "ep2pp2"), ("deepseek_v3", "ep2tp2etp1")]
VERSIONS = itertools.count(1, len(TRANSPORTS))  # first version of each run's syncs


class MoEServers:
    """One SGLang CPU server (fp32) at a time, on the tiny all-MoE model of the family asked
    for (with the quickstart tokenizer); asking for another family stops the running one."""

    def __init__(self, root: Path):
        self.root, self.family = root, None
        self.stack = contextlib.ExitStack()

    def serve(self, family: str):
        """(model dir, server) of `family`."""
        from rlhf.config.rollout import RolloutConfig
        from rlhf.quickstart.tokenizer import build_tiny_tokenizer
        from rlhf.rollout.sglang_server import SGLangServer, build_server_args
        from rlhf.utils import free_port

        model_dir = self.root / family
        if family != self.family:
            self.stack.close()
            save_moe_model(model_dir, {**MODELS[family], **ALL_SPARSE}, seed=3)
            build_tiny_tokenizer().save_pretrained(model_dir)
            launch = build_server_args(
                RolloutConfig(dtype="float32"),
                model_dir,
                port=free_port(),
                device="cpu",
                max_total_tokens=4096,
            )
            server = SGLangServer(launch, self.root / f"{family}_server.log").start()
            self.server = self.stack.enter_context(server)
            self.server.wait_healthy(300)
            self.family = family
        return model_dir, self.server


@pytest.fixture(scope="module")
def moe_servers(tmp_path_factory):
    servers = MoEServers(tmp_path_factory.mktemp("moe_servers"))
    with servers.stack:
        yield servers


def matches_transformers(model_dir: Path, greedy: list[dict]) -> float:
    """Max |SGLang - transformers| log-prob of SGLang's greedy tokens; asserts that they are
    transformers' greedy tokens too (fp32 on the same weights)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    worst = 0.0
    for prompt, sampled in zip(PROMPTS, greedy, strict=True):
        tokens = torch.tensor([prompt + sampled["tokens"]])
        with torch.no_grad():
            logp_sv = model(tokens).logits[0, len(prompt) - 1 : -1].log_softmax(-1)
        assert logp_sv.argmax(-1).tolist() == sampled["tokens"], (prompt, sampled)
        picked = logp_sv.gather(1, tokens[0, len(prompt) :, None])[:, 0]
        worst = max(worst, (picked - torch.tensor(sampled["logprobs"])).abs().max().item())
    return worst


@pytest.mark.parametrize(("family", "layout"), CASES, ids=[f"{f}-{x}" for f, x in CASES])
def test_moe_sync_makes_sglang_match_the_actor(moe_servers, tmp_path, family, layout):
    model_dir, server = moe_servers.serve(family)
    nproc, extra = LAYOUTS[layout]
    first = next(VERSIONS)
    args = ["--hf-dir", str(model_dir), "--server-url", server.url, "--out-dir", str(tmp_path)]
    args += ["--transports", ",".join(TRANSPORTS), "--version", str(first), *extra]
    run_torchrun("moe_weight_sync.py", nproc, args, timeout_s=240)  # a deadlock fails fast
    report = json.loads((tmp_path / "report.json").read_text())
    original = load_file(model_dir / "model.safetensors")
    for version, transport in enumerate(TRANSPORTS, start=first):
        synced = report[transport]
        assert synced["weight_version"] == str(version), (transport, synced)
        assert synced["probe_diff"] < 1e-4, (transport, synced)
        assert synced["num_buckets"] > 1, (transport, synced)
        exported = tmp_path / f"hf_{transport}"
        copy_hf_side_files(model_dir, exported)
        shutil.copy(tmp_path / f"{transport}.safetensors", exported / "model.safetensors")
        tensors = load_file(exported / "model.safetensors")
        assert sorted(tensors) == sorted(original), transport
        logprob_diff = matches_transformers(exported, synced["greedy"])
        print(
            f"{family} {layout} {transport}: probe diff {synced['probe_diff']:.1e}, "
            f"greedy log-prob diff to transformers {logprob_diff:.1e}"
        )
        assert logprob_diff < 1e-4, (transport, logprob_diff)
