"""Every rank gathers the sender's buckets when the tensor transport's handles come from
every GPU (`SyncTopology.everywhere`): DP replicas with their own TP groups, routed experts
all-gathered over EP (and expert-TP), pipeline stages by broadcast. A tiny Qwen3-MoE with a
dense layer among its MoE layers, on 4 gloo ranks."""

from __future__ import annotations

import json

import pytest

from tests.distributed.test_moe_parity import MODELS, save_moe_model
from tests.helpers import run_torchrun

LAYOUTS = {  # 4 ranks each
    "tp2dp2ep2": ["--tp", "2", "--ep", "2", "--etp", "1"],  # EP over the DP replicas
    "tp2ep2etp2": ["--tp", "2", "--ep", "2", "--etp", "2"],  # experts split over expert-TP
    "pp2dp2ep2": ["--pp", "2", "--ep", "2"],  # stages broadcast their buckets
}


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return save_moe_model(tmp_path_factory.mktemp("moe") / "qwen3_moe", MODELS["qwen3_moe"], 0)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_rank_gathers_the_senders_buckets(moe_dir, tmp_path, layout):
    args = ["--hf-dir", str(moe_dir), "--out-dir", str(tmp_path), *LAYOUTS[layout]]
    run_torchrun("gather_everywhere.py", 4, args)
    report = json.loads((tmp_path / "report.json").read_text())
    assert [rank["equal"] for rank in report] == [True] * 4, report
    assert report[0]["num_buckets"] > 3
