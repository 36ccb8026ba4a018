"""`make quickstart-moe` learns: GRPO on the warm-started tiny Qwen3-MoE (8 experts, top-2)
with SGLang rollouts of it, rollout routing replay (R3) and the expert weight sync after
every step; an EP 2 run with GAE and routing replay R2.

A real `rlhf-train` run of configs/quickstart_moe_cpu.yaml that starts its own SGLang CPU
server for the MoE model; the model comes from pytest's cache (tests/e2e/
test_quickstart_moe_start.py builds it). Validation samples 4 answers for each of 64 prompts.
"""

from __future__ import annotations

import pytest

from rlhf.quickstart.data import write_quickstart_data
from tests.e2e.test_learning import train as train_quickstart
from tests.e2e.test_quickstart_moe_start import moe_model  # noqa: F401 (a fixture)
from tests.helpers import REPO

pytestmark = pytest.mark.slow(reason="learning shows only over tens of GRPO steps")
CONFIG = REPO / "configs" / "quickstart_moe_cpu.yaml"
STEPS = 30
MIN_RISE = 0.2


def train(model, tmp_path, steps: int, *extra: str, nproc: int = 1) -> list[dict]:
    """`rlhf-train` on configs/quickstart_moe_cpu.yaml for `steps`, launching its own SGLang
    server; its metrics rows."""
    assets = model, write_quickstart_data(tmp_path / "data")
    return train_quickstart(CONFIG, assets, None, tmp_path / "run", steps, *extra, nproc=nproc)


def test_grpo_on_the_tiny_moe_raises_validation_reward(moe_model, tmp_path):  # noqa: F811
    """The quickstart replays SGLang's routes (router_replay.mode=R3): the launched server
    returns each token's experts (`--enable-return-routed-experts`, allocated by the
    plugin's CPU shim) and the trainer's old-log-prob, reference and update passes replay
    them, so the old log-probs stay as close to SGLang's as the weights allow; the probe
    after each sync (which routes anew) agrees."""
    rows = train(moe_model, tmp_path, STEPS)
    val = {r["step"]: r["val/test_score/all"] for r in rows if "val/test_score/all" in r}
    print(f"validation reward: {val}")
    assert val[STEPS] - val[0] >= MIN_RISE, val
    server_log = (tmp_path / "run" / "logs" / "sglang_server_0.log").read_text()
    assert "'enable_return_routed_experts': True" in server_log
    trained = [r for r in rows if r["step"] > 0]
    assert all(0 < r["actor/moe/max_expert_share"] < 1 for r in trained)
    assert all(abs(r["rollout_corr/kl"]) < 1e-5 for r in trained)
    assert all(r["rollout/logprob_diff_max"] < 1e-4 for r in trained)  # the probe after syncs


def test_an_expert_parallel_run_with_r2_syncs_every_step(moe_model, tmp_path):  # noqa: F811
    """Two processes at EP 2 (each holds 4 of the 8 experts) with GAE, so a critic built from
    the MoE checkpoint trains at EP 2 too: the weight sync gathers both halves of the
    actor's experts for SGLang every step (the probe agrees; measured 2e-6 to 1e-5) and the
    router metrics of both models cover both ranks' tokens. Routing replay R2: two
    mini-batches a step (16 prompts x 4 samples, 8 prompts each), so the second one's
    forward replays the routes the old-log-prob pass recorded on its rank (a micro-batch
    without recorded routes would stop the run)."""
    ep2 = [
        "trainer.n_gpus_per_node=2",
        "actor_rollout_ref.actor.megatron.expert_model_parallel_size=2",
        "critic.megatron.expert_model_parallel_size=2",
        "algorithm.adv_estimator=gae",
        "actor_rollout_ref.actor.router_replay.mode=R2",
    ]
    rows = train(moe_model, tmp_path, 3, *ep2, nproc=2)
    trained = [r for r in rows if r["step"] > 0]
    assert len(trained) == 3
    assert all(r["rollout/logprob_diff_max"] < 1e-4 for r in trained)
    for role in ("actor", "critic"):
        assert all(0.125 <= r[f"{role}/moe/max_expert_share"] < 0.5 for r in trained), role
    assert all(r["critic/vf_loss"] > 0 for r in trained)
    assert all(abs(r["actor/pg_loss"]) > 0 for r in trained)
