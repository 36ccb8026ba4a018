"""The tiny Qwen3-MoE of `make quickstart-moe` converts to Megatron with its 8 experts split
over 2 expert-parallel ranks, and `rlhf-convert verify` finds Megatron's logits equal to
transformers' there (fp32, within 1e-5): the layout `quickstart_moe_cpu.yaml` names for 2
processes."""

from __future__ import annotations

import json

from rlhf.quickstart.tiny_model import TinyModelSpec, save_tiny_model
from tests.distributed.test_moe_parity import rlhf_convert


def test_the_quickstart_moe_model_converts_and_verifies_at_ep2(tmp_path):
    hf_dir = save_tiny_model(tmp_path / "hf", TinyModelSpec.for_family("qwen3_moe"))
    mcore = tmp_path / "mcore"
    rlhf_convert(2, tmp_path / "to_mcore.out", "hf-to-mcore", hf_dir, mcore, "--ep", 2)
    meta = json.loads((mcore / "rlhf_checkpoint.json").read_text())
    assert meta["saved_expert_model_parallel_size"] == 2
    out = rlhf_convert(
        2, tmp_path / "verify.out", "verify", hf_dir, mcore, "--ep", 2, "--tol", 1e-5
    )
    print(out.strip())
    assert "EP 2 ETP 1" in out and out.strip().endswith("OK"), out
