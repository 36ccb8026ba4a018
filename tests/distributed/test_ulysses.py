"""Ulysses sequence parallelism equals the SP=1 run (fp32, 1e-5).

SP=2 (2 ranks) and TP2 x SP2 (4 ranks) on the tiny Qwen2 model, whose 2 KV heads are fewer
than TP x SP requires (at TP2 each rank has 1 KV head for 2 SP ranks: heads are repeated).
Padded rows (causal) and a packed row whose samples straddle the SP slices (block mask).
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers import run_worker_layouts

LAYOUTS = {"sp1": (1, []), "sp2": (2, ["--sp", "2"]), "tp2sp2": (4, ["--sp", "2", "--tp", "2"])}


@pytest.fixture(scope="module")
def results(tiny_qwen2_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("ulysses")
    return run_worker_layouts("ulysses_parity.py", LAYOUTS, tiny_qwen2_dir, out)


def test_tiny_model_needs_kv_head_repeats(tiny_qwen2_dir):
    from rlhf.models.families import load_arch
    from rlhf.parallel.ulysses import kv_repeats

    arch = load_arch(tiny_qwen2_dir)
    tp, sp = 2, 2
    assert arch.num_query_groups < tp * sp
    assert kv_repeats(arch.num_attention_heads // tp, arch.num_query_groups // tp, sp) == 2


@pytest.mark.parametrize("layout", ["sp2", "tp2sp2"])
@pytest.mark.parametrize("batch", ["padded", "packed"])
def test_matches_sp1(results, layout, batch):
    ref, got = results["sp1"][batch], results[layout][batch]
    torch.testing.assert_close(got["logits"], ref["logits"], atol=1e-5, rtol=0)
    torch.testing.assert_close(got["logprobs"], ref["logprobs"], atol=1e-5, rtol=0)
    assert got["loss"] == pytest.approx(ref["loss"], abs=1e-5)
    assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5)
