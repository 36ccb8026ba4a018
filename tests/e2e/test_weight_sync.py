"""Weight sync into a real SGLang CPU server from a TP=2 and a PP=2 Megatron actor, for each
transport: after perturbing the actor, SGLang's greedy tokens equal HF transformers' greedy
tokens on the exported weights, the log-prob probe agrees, and the server reports the version."""

from __future__ import annotations

import itertools
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from rlhf import sglang_api
from rlhf.models.convert import copy_hf_side_files
from tests.helpers import run_torchrun

PROMPTS = [[5, 17, 33, 2, 90, 41], [120, 7, 7, 64, 11]]
VERSIONS = itertools.count(1001)  # the shared server: versions no run of the session uses


def sglang_greedy(url: str) -> list[list[int]]:
    params = {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True}
    out = sglang_api.generate(url, {"input_ids": PROMPTS, "sampling_params": params})
    return [item["output_ids"] for item in out]


def hf_greedy(model_dir) -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    result = []
    for prompt in PROMPTS:
        with torch.no_grad():
            out = model.generate(
                torch.tensor([prompt]), max_new_tokens=8, min_new_tokens=8, do_sample=False
            )
        result.append(out[0, len(prompt) :].tolist())
    return result


@pytest.mark.parametrize("transport", ["tensor", "tensor-from-rank1", "distributed", "disk"])
@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_sync_makes_sglang_match_exported_weights(
    sglang_server, tiny_qwen2_dir, tmp_path, transport, tp, pp
):
    """`tensor-from-rank1`: the server's handle is packed by rank 1, as a server TP rank's
    is by the trainer rank on its GPU (`rlhf.weight_sync.handle_plan`): every rank then
    gathers every bucket (the TP group each its own, the stages by broadcast) and the
    handle reaches the sender by a gather."""
    version = next(VERSIONS)
    url = sglang_server.url
    kind, _, from_rank = transport.partition("-from-rank")
    args = ["--hf-dir", str(tiny_qwen2_dir), "--server-url", url, "--transport", kind]
    if from_rank:
        args += ["--handles-from", from_rank]
    args += [
        "--out-dir",
        str(tmp_path),
        "--tp",
        str(tp),
        "--pp",
        str(pp),
        "--version",
        str(version),
    ]
    if transport == "tensor" and tp == 2:
        args.append("--check-sampling")
    run_torchrun("weight_sync_parity.py", tp * pp, args)
    report = json.loads((tmp_path / "report.json").read_text())

    assert report["weight_version"] == str(version)
    assert report["handles_from"] == (int(from_rank) if from_rank else None)
    if kind == "tensor":
        assert report["packed_on_ranks"] == [int(from_rank or 0)]
    assert report["probe_diff"] < 1e-3, report
    assert report["num_buckets"] > 1 and report["max_bucket_bytes"] <= 64 * 1024 * 2
    assert report["open_groups_after_close"] == 0  # the distributed transport's, destroyed
    if "sampled_logprob_diff" in report:
        assert report["sampled_logprob_diff"] < 1e-3, report

    exported = tmp_path / "hf_exported"
    copy_hf_side_files(tiny_qwen2_dir, exported)
    shutil.copy(tmp_path / "exported.safetensors", exported / "model.safetensors")
    original = load_file(tiny_qwen2_dir / "model.safetensors")
    synced = load_file(exported / "model.safetensors")
    assert sorted(original) == sorted(synced)
    assert not torch.equal(
        original["model.layers.0.mlp.up_proj.weight"], synced["model.layers.0.mlp.up_proj.weight"]
    )
    assert sglang_greedy(url) == hf_greedy(exported)


@pytest.mark.slow(reason="starts an SGLang server twice (the restart)")
def test_restarted_server_gets_the_synced_weights_back(tiny_qwen2_dir, tmp_path):
    """Killed after the sync of version 7, the server is restarted by the next call and
    reloaded from the tensor transport's disk snapshot (the disk transport's own directory
    is read by the same `DiskTransport.load_into`; the distributed transport:
    tests/e2e/test_reliability.py)."""
    args = ["--hf-dir", str(tiny_qwen2_dir), "--out-dir", str(tmp_path)]
    run_torchrun("weight_sync_restart.py", 1, args)
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["samples"] == 4
    assert report["before"] < 1e-3 and report["after"] < 1e-3, report
    assert report["version"] == "7"
    assert list(report["restarts"].values()) == [1], report
    assert (tmp_path / "weights_snapshot" / "v000007" / "model.safetensors.index.json").is_file()


def test_a_bucket_the_server_refuses_fails_with_its_answer_at_once(sglang_server, monkeypatch):
    """A server that answers `update_weights_from_distributed` with an error before it joins
    the broadcast (here: no update window is open) fails the delivery with that answer as
    it comes. The sender's broadcast, which no one will join, used to hold the sync until
    the group's timeout and then report the server unreachable (to be restarted)."""
    from datetime import timedelta

    from rlhf.weight_sync import transports

    monkeypatch.setattr(transports, "STORE_TIMEOUT", timedelta(seconds=20))  # the old wait
    url = sglang_server.url
    transport = transports.DistributedTransport([url], 1, "127.0.0.1")
    group = "rlhf_weight_sync_refused"  # this process's own: no other test's group name
    transport.group_names[url] = group
    bucket = [("model.norm.weight", torch.ones(64))]
    version = next(VERSIONS)
    packed = transport.pack(bucket, last=True, version=version)
    try:
        with pytest.raises(sglang_api.SGLangAPIError) as refused:
            transport.deliver(url, packed, last=True, version=version)
    finally:
        sglang_api.destroy_weights_update_group(url, group)
    assert not refused.value.unreachable
    assert "begin_weight_update" in str(refused.value), refused.value
