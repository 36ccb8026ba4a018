"""The quickstart recipes run for real: GRPO learns, DAPO's sampling and shaping are active.

Real runs of `rlhf-train` on the warm-started tiny model (as `make quickstart` builds it;
built once and kept in pytest's cache under the hash of the code that makes it), on the
session's shared SGLang server. `configs/quickstart_grpo_cpu.yaml` is GRPO with the KL as a
loss and no critic. Validation samples 4 answers per prompt, so the score is an average over
256 samples; measured here it rose by 0.29-0.41 in 30 steps (e.g. 0.33 -> 0.74, 0.41 ->
0.75; 0.82 by step 60, as docs/quickstart.md states), so a rise of 0.2 leaves room for SGLang's
unseeded sampling on CPU. `rlhf-eval` (mean@4, best@4, maj@4, on a server it starts) on the
run's checkpoints shows the same rise over the run's own validation before training
(measured: mean@4 0.38 -> 0.77, best@4 0.84 -> 1.00, maj@4 0.61 -> 0.91).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers

from tests.helpers import REPO, rlhf_train

pytestmark = pytest.mark.slow(reason="learning shows only over tens of PPO steps")
CONFIG = REPO / "configs" / "quickstart_grpo_cpu.yaml"
DAPO = REPO / "configs" / "quickstart_dapo_cpu.yaml"
ASYNC = REPO / "configs" / "quickstart_async_cpu.yaml"
STEPS = 30
MIN_RISE = 0.2


QUICKSTART_CODE = ("arithmetic.py", "data.py", "tiny_model.py", "tokenizer.py", "warm_start.py")


def code_hash() -> str:
    """What the quickstart assets are a function of: the code that builds them, torch and
    transformers (the tokenizer and the model's initialisation)."""
    digest = hashlib.sha256(f"{torch.__version__} {transformers.__version__}".encode())
    for name in QUICKSTART_CODE:
        digest.update((REPO / "rlhf" / "quickstart" / name).read_bytes())
    return digest.hexdigest()[:16]


@pytest.fixture(scope="module")
def quickstart_assets(request, tmp_path_factory):
    """The quickstart's warm-started model and its train/val Parquet files, from pytest's
    cache when the code that builds them is unchanged (the warm start takes ~60 s)."""
    from rlhf.quickstart.data import write_quickstart_data
    from rlhf.quickstart.tiny_model import save_tiny_model
    from rlhf.quickstart.warm_start import warm_start

    cache = getattr(request.config, "cache", None)  # None under -p no:cacheprovider
    root = cache.mkdir(f"quickstart-{code_hash()}") if cache else tmp_path_factory.mktemp("qs")
    data = root / "data" / "train.parquet", root / "data" / "val.parquet"
    if not (root / "COMPLETE").is_file():
        for stale in (root / "model", root / "data"):
            shutil.rmtree(stale, ignore_errors=True)
        warm_start(save_tiny_model(root / "model"))
        data = write_quickstart_data(root / "data")
        (root / "COMPLETE").write_text("model and data written\n")
    return root / "model", data


def train(config, assets, server, run_dir, steps: int, *extra: str, nproc: int = 1) -> list[dict]:
    """`rlhf-train --config config` (on `nproc` processes) on the quickstart assets (model,
    (train, val)) and `server` (external; None: the run launches its own), with `extra`
    overrides; its metrics.jsonl rows."""
    model, (train_file, val_file) = assets
    external = [f"actor_rollout_ref.rollout.server_urls=[{server.url}]"] if server else []
    overrides = [
        *external,
        f"actor_rollout_ref.model.path={model}",
        f"data.train_files={train_file}",
        f"data.val_files={val_file}",
        f"trainer.default_local_dir={run_dir}",
        f"trainer.total_training_steps={steps}",
        f"trainer.test_freq={steps}",
        f"trainer.save_freq={steps}",
        "trainer.logger=[console]",
        *extra,
    ]
    proc = rlhf_train(config, overrides, run_dir.parent / f"{run_dir.name}_logs", nproc=nproc)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def evaluate(model, val_file, out: Path) -> dict:
    """`rlhf-eval MODEL --data val_file --n 4` with the GRPO config; its JSON report."""
    cmd = [
        sys.executable,
        "-m",
        "rlhf.cli.eval",
        str(model),
        "--config",
        str(CONFIG),
        "--data",
        str(val_file),
        "--n",
        "4",
        "--output",
        str(out),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "arithmetic" in proc.stdout and "maj@4" in proc.stdout  # the table
    return json.loads(out.read_text())["per_source"]["arithmetic"]


FIXED_MICRO_BATCHES = (
    "actor_rollout_ref.actor.use_dynamic_bsz=false",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
    "data.use_sequence_packing=false",
)


def test_grpo_quickstart_raises_validation_reward_without_a_critic(
    quickstart_assets, sglang_server, tmp_path
):
    """With verl's fixed, padded micro-batches (4 samples each, in order): the packed
    token-budget ones give the same log-probs and gradients (tests/distributed/
    test_ppo_stages.py), so this run also shows the fixed mode learns (measured: 0.27 ->
    0.77 in 30 steps, in the packed runs' range above)."""
    run_dir = tmp_path / "run"
    rows = train(CONFIG, quickstart_assets, sglang_server, run_dir, STEPS, *FIXED_MICRO_BATCHES)
    val = {r["step"]: r["val/test_score/all"] for r in rows if "val/test_score/all" in r}
    assert val[STEPS] - val[0] >= MIN_RISE, val
    first, last = rows[0], rows[-1]
    before, core = val_core(first), val_core(last)
    assert set(core) == {"mean@4", "best@4", "maj@4"}
    assert core["mean@4"] == last["val/test_score/arithmetic"] <= core["best@4"]
    trained = [r for r in rows if r["step"] > 0]
    assert all("actor/kl_loss" in r and "critic/vf_loss" not in r for r in trained)
    checkpoint = run_dir / "checkpoints" / f"global_step_{STEPS}"
    assert (checkpoint / "actor").is_dir() and not (checkpoint / "critic").exists()
    assert "critic_scheduler" not in json.loads((checkpoint / "trainer_state.json").read_text())

    _, (_, val_file) = quickstart_assets
    after = evaluate(run_dir / "checkpoints", val_file, tmp_path / "after.json")  # the newest
    assert after["mean@4"] - before["mean@4"] >= MIN_RISE, (before, after)
    assert after["maj@4"] > before["maj@4"] and after["best@4"] >= before["best@4"]
    assert after["mean@4"] <= after["best@4"] and 0 <= after["maj@4"] <= 1


def val_core(row: dict) -> dict[str, float]:
    """A metrics row's validation of the arithmetic source: mean@4, best@4, maj@4."""
    prefix = "val-core/arithmetic/"
    return {k.rsplit("/", 1)[1]: v for k, v in row.items() if k.startswith(prefix)}


def test_dapo_quickstart_samples_dynamically_and_shapes_lengths(
    quickstart_assets, sglang_server, tmp_path
):
    """3 steps of configs/quickstart_dapo_cpu.yaml: every step reports its generation rounds
    (the warm-started model answers some prompts right 4 times out of 4, so groups are
    dropped), the overlong penalty, and no KL or critic."""
    run = train(DAPO, quickstart_assets, sglang_server, tmp_path / "run", 3)
    rows = [r for r in run if r["step"] > 0]
    assert len(rows) == 3
    for row in rows:
        assert row["dynamic_sampling/kept_groups"] >= 16  # data.train_batch_size
        assert row["dynamic_sampling/gen_rounds"] >= 1
        assert row["reward/overlong_penalty/mean"] <= 0
        assert not any(k.startswith(("critic/vf", "actor/kl_loss", "actor/reward_kl")) for k in row)
    assert sum(r["dynamic_sampling/dropped_groups"] for r in rows) > 0


def test_async_quickstart_raises_validation_reward(quickstart_assets, sglang_server, tmp_path):
    """configs/quickstart_async_cpu.yaml on the shared server (its `server_urls` replaced):
    generation runs up to 2 steps ahead and is paused around each weight sync, samples are
    1-2 policy versions old, truncated importance sampling corrects for it, and validation
    rises as the synchronous GRPO run's does (the same +0.2 in 30 steps)."""
    rows = train(ASYNC, quickstart_assets, sglang_server, tmp_path / "run", STEPS)
    val = {r["step"]: r["val/test_score/all"] for r in rows if "val/test_score/all" in r}
    assert val[STEPS] - val[0] >= MIN_RISE, val
    trained = [r for r in rows if "async/staleness_max" in r]
    assert len(trained) == STEPS
    assert all(r["async/staleness_max"] <= 2 and r["async/dropped_stale"] == 0 for r in trained)
    assert all(r["async/staleness_mean"] > 0 for r in trained[1:])  # generated ahead
    assert all("rollout_corr/rollout_is_mean" in r for r in trained)


def test_grpo_from_stored_rollouts_of_the_initial_policy_raises_validation_reward(
    quickstart_assets, sglang_server, tmp_path
):
    """Offline: a PPO run whose actor is frozen (`trainer.critic_warmup` = its 8 steps)
    stores 8 x 64 samples of the initial policy (`rollouts/step_N.parquet`); a GRPO run
    trained only from them (`data.rollout_files`, stored_fraction 1: nothing generated for
    training, truncated IS against their log-probs) raises validation reward (measured:
    0.367 -> 0.645 in 12 steps, 0.719 in 24)."""
    frozen = tmp_path / "frozen"
    ppo = REPO / "configs" / "quickstart_cpu.yaml"
    train(ppo, quickstart_assets, sglang_server, frozen, 8, "trainer.critic_warmup=8")
    files = sorted((frozen / "rollouts").glob("step_*.parquet"))
    assert len(files) == 8
    offline = [
        f"data.rollout_files=[{','.join(map(str, files))}]",
        "algorithm.rollout_correction.rollout_is=token",
    ]
    rows = train(CONFIG, quickstart_assets, sglang_server, tmp_path / "offline", 16, *offline)
    val = {r["step"]: r["val/test_score/all"] for r in rows if "val/test_score/all" in r}
    assert val[16] - val[0] >= 0.15, val
    trained = [r for r in rows if "stored/samples" in r]
    assert len(trained) == 16 and all(r["stored/samples"] == 64 for r in trained)
    assert all("rollout_corr/rollout_is_mean" in r for r in trained)
