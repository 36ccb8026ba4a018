"""Whole PPO runs of `rlhf-train` on CPU with a real SGLang server (the session's shared one,
as an external server: each run loads its own weights into it first).

- A run killed (SIGKILL) the moment a checkpoint is published keeps that step's metrics row
  (written before the checkpoint), resumes from it and then logs exactly the per-step
  metrics of an uninterrupted run (greedy rollouts make SGLang's sampling deterministic):
  losses, grad norms, LR, KL coefficient, rewards. (A kill while a checkpoint is being
  written: tests/unit/test_checkpoint_manager.py, in a real process.)
- 2-process torchrun runs (DP=2, TP=2, PP=2, Ulysses SP=2) log the metric values of that
  uninterrupted 1-process run (a constant learning rate: its first steps are those of a
  shorter run); so does a 1-process run with `algorithm.rollout_correction.bypass_mode`
  (the engine's fp32 log-probs as the old ones, no old-log-prob pass). The disaggregated
  SLURM recipe (`launch/slurm_disaggregated.sbatch`), started from only what sbatch gives
  a batch script, on three simulated nodes of this machine (two trainer nodes, rendezvous
  over the first; an SGLang server on the third, synced by broadcast from rank 0) logs
  exactly the values of the DP=2 run.
- A trainer checkpoint's actor (TP2, PP2; 1 process: tests/e2e/test_model_rewards.py)
  exports with `rlhf-convert mcore-to-hf` to an HF directory whose transformers logits equal
  the trainer's Megatron forward at the checkpoint's own layout within 1e-5
  (`rlhf-convert verify`); so does the PP2 critic (its value head is on the last stage), as
  a `*ForTokenClassification` model.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from rlhf.quickstart.data import write_quickstart_data
from rlhf.utils import free_port, free_ports
from tests.fake_slurm import sbatch_environment, write_stand_ins
from tests.helpers import (
    REPO,
    metrics_by_step,
    ppo_overrides,
    processes_on,
    shm_left_since,
    torch_shm_state,
    torchrun_command,
)

CONFIG = str(REPO / "configs" / "quickstart_cpu.yaml")
ROLES = ("actor_rollout_ref.actor", "critic")
# Timing and throughput differ between runs; everything else must not.
VOLATILE = ("timing_s/", "perf/throughput", "perf/mfu")
# Measured from the engine's log-probs, which SGLang computes in batched matrix products whose
# float rounding depends on what shares the batch (up to ~5e-7 a token, measured; the
# mismatch KL is a mean of such differences, ~1e-8): equal to 1e-7, not bit for bit.
ENGINE_LOGPROB = ("rollout_corr/", "rollout/logprob_diff")
REQUIRED = [
    "actor/pg_loss",
    "actor/pg_clipfrac",
    "actor/ppo_kl",
    "actor/entropy",
    "actor/grad_norm",
    "actor/lr",
    "critic/vf_loss",
    "critic/vf_clipfrac",
    "critic/score/mean",
    "critic/rewards/mean",
    "critic/advantages/mean",
    "critic/returns/mean",
    "critic/values/mean",
    "actor/reward_kl_penalty",
    "actor/reward_kl_penalty_coeff",
    "response_length/mean",
    "response_length/max",
    "response_length/clip_ratio",
    "prompt_length/mean",
    "timing_s/gen",
    "timing_s/reward",
    "timing_s/old_log_prob",
    "timing_s/ref",
    "timing_s/values",
    "timing_s/adv",
    "timing_s/update_critic",
    "timing_s/update_actor",
    "timing_s/update_weights",
    "timing_s/write_rollouts",
    "timing_s/write_rollouts_thread",
    "timing_s/other",
    "timing_s/step",
    "timing_s/log",
    "timing_s/testing",
    "perf/throughput",
    "perf/total_num_tokens",
    "perf/mfu",
    "rollout/logprob_diff_max",
    "rollout_corr/kl",
    "rollout_corr/k3_kl",
    "rollout_corr/log_ppl_diff",
]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_quickstart_data(tmp_path_factory.mktemp("data"), num_train=32, num_val=8)


def train_command(args: list[str], nproc: int = 1) -> list[str]:
    train = ["-m", "rlhf.cli.train", "--config", CONFIG, *args]
    if nproc == 1:
        return [sys.executable, *train]
    return [*torchrun_command(nproc, free_port()), *train]


def run_train(args: list[str], run_dir: Path, nproc: int = 1) -> str:
    run_dir.mkdir(parents=True, exist_ok=True)
    log = run_dir.parent / f"{run_dir.name}.log"
    with open(log, "w") as out:
        proc = subprocess.run(
            train_command(args, nproc),
            cwd=REPO,
            stdout=out,
            stderr=subprocess.STDOUT,
            timeout=900,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )
    text = log.read_text()
    assert proc.returncode == 0, text[-6000:]
    return text


def export_and_verify(run_dir: Path, step: int, tp: int = 1, pp: int = 1, role="actor") -> None:
    """rlhf-convert mcore-to-hf on checkpoint `step`'s actor (or critic), then verify at TP x
    PP."""
    actor = run_dir / "checkpoints" / f"global_step_{step}" / role
    out = run_dir / f"{role}_hf_step_{step}"
    convert = [sys.executable, "-m", "rlhf.cli.convert"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    exported = subprocess.run(
        [*convert, "mcore-to-hf", str(actor), str(out)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert exported.returncode == 0, exported.stderr[-3000:]
    layout = ["--tp", str(tp), "--pp", str(pp)]
    checked = subprocess.run(
        [*convert, "verify", str(out), str(actor), "--tol", "1e-5", *layout],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert checked.returncode == 0 and ": OK" in checked.stdout, (
        checked.stdout + checked.stderr[-3000:]
    )


def kill_after_publishing(args: list[str], run_dir: Path, step: int) -> None:
    """Run until checkpoint `step` is published, then SIGKILL (kill_after_publish_driver.py)."""
    run_dir.mkdir(parents=True)
    driver = [sys.executable, str(Path(__file__).with_name("kill_after_publish_driver.py"))]
    with open(run_dir.parent / f"{run_dir.name}.killed.log", "w") as log:
        proc = subprocess.run(
            [*driver, str(step), "--config", CONFIG, *args],
            cwd=REPO,
            stdout=log,
            stderr=subprocess.STDOUT,
            timeout=600,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )
    assert proc.returncode == -signal.SIGKILL, (
        run_dir.parent / f"{run_dir.name}.killed.log"
    ).read_text()[-3000:]


@pytest.fixture(scope="module")
def reference_run(tiny_qwen2_dir, data, sglang_server, tmp_path_factory) -> dict[int, dict]:
    """The uninterrupted 4-step 1-process run: what the resumed run and every layout (its
    first two steps) must log."""
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    text = run_train(ppo_overrides(tiny_qwen2_dir, data, run_dir, 4, server=sglang_server), run_dir)
    assert "memory per GPU (GiB), by role and kind" in text  # the planner, at startup
    assert "loaded the actor's weights into the external SGLang servers" in text
    rows = metrics_by_step(run_dir)
    assert sorted(rows) == [0, 1, 2, 3, 4]
    # what the loop does after a step's record is timed in the next one (step 2 saved)
    assert [s for s in rows if "timing_s/log" in rows[s]] == [2, 3, 4]
    assert [s for s in rows if "timing_s/save_checkpoint" in rows[s]] == [3]
    assert rows[3]["timing_s/save_checkpoint"] > 0 and rows[3]["timing_s/log"] > 0
    assert [s for s in rows if "timing_s/testing" in rows[s]] == [0, 2, 4]
    return rows


@pytest.mark.slow(reason="a run killed as it publishes a checkpoint, then its resume")
def test_killed_run_keeps_its_rows_resumes_and_matches_uninterrupted(
    tiny_qwen2_dir, data, sglang_server, tmp_path, reference_run
):
    """Its checkpoints are written in the background (`trainer.async_save`): checkpoint 2 is
    published a step or two later, when its writer is done, and holds step 2's state (the
    uninterrupted run saves synchronously)."""
    resumed = tmp_path / "resumed"
    args = ppo_overrides(
        tiny_qwen2_dir, data, resumed, 4, "trainer.async_save=true", server=sglang_server
    )
    kill_after_publishing(args, resumed, step=2)
    killed_log = (tmp_path / "resumed.killed.log").read_text()
    assert "checkpoint of step 2: the step was held" in killed_log  # a background save
    assert {0, 1, 2} <= set(metrics_by_step(resumed))  # step 2's row came before the kill
    text = run_train(args, resumed)
    assert "resumed from" in text and "(step 2)" in text

    got = metrics_by_step(resumed)
    assert sorted(got) == [0, 1, 2, 3, 4]
    for step in (3, 4):
        for key, value in reference_run[step].items():
            if key.startswith(VOLATILE):
                continue
            tolerance = 1e-7 if key.startswith(ENGINE_LOGPROB) else 1e-9
            assert got[step][key] == pytest.approx(value, rel=1e-6, abs=tolerance), (step, key)
    assert (
        reference_run[4]["actor/reward_kl_penalty_coeff"]
        != reference_run[1]["actor/reward_kl_penalty_coeff"]
    )  # the adaptive controller moved, and the resumed run continued from its state


BYPASS_EQUAL = (
    "actor/pg_loss",
    "actor/grad_norm",
    "critic/vf_loss",
    "critic/grad_norm",
    "actor/reward_kl_penalty",
    "critic/score/mean",
    "response_length/mean",
)


@pytest.mark.slow(reason="a whole run against the 1-process run")
def test_bypass_mode_skips_the_old_log_prob_pass_and_trains_the_same(
    tiny_qwen2_dir, data, sglang_server, tmp_path, reference_run
):
    """SGLang's fp32 log-probs of its greedy samples equal the trainer's within ~1e-7, so the
    losses, grad norms and the next step's rollouts are those of the run that recomputes them."""
    run_dir = tmp_path / "bypass"
    extra = "algorithm.rollout_correction.bypass_mode=true"
    run_train(ppo_overrides(tiny_qwen2_dir, data, run_dir, 2, extra, server=sglang_server), run_dir)
    rows = metrics_by_step(run_dir)
    for step in (1, 2):
        assert "timing_s/old_log_prob" not in rows[step] and "actor/entropy_old" not in rows[step]
        for key in BYPASS_EQUAL:
            assert rows[step][key] == pytest.approx(reference_run[step][key], rel=1e-4, abs=1e-6)


LAYOUT_KEYS = {
    "dp2": [],
    "tp2": ["megatron.tensor_model_parallel_size=2"],
    "pp2": ["megatron.pipeline_model_parallel_size=2"],
    "sp2": ["ulysses_sequence_parallel_size=2"],  # Ulysses
}


@pytest.fixture(scope="module")
def layout_runs(tiny_qwen2_dir, data, sglang_server, tmp_path_factory):
    """`run(layout)`: the metrics of the 2-step 2-process run at `layout` (each run once)."""
    root, done = tmp_path_factory.mktemp("layouts"), {}

    def run(layout: str) -> tuple[Path, dict[int, dict]]:
        if layout not in done:
            run_dir = root / layout
            extra = ["trainer.n_gpus_per_node=2"]
            extra += [f"{role}.{key}" for key in LAYOUT_KEYS[layout] for role in ROLES]
            args = ppo_overrides(tiny_qwen2_dir, data, run_dir, 2, *extra, server=sglang_server)
            run_train(args, run_dir, nproc=2)
            done[layout] = run_dir, metrics_by_step(run_dir)
        return done[layout]

    return run


@pytest.mark.slow(reason="a whole 2-process run against the 1-process run")
@pytest.mark.parametrize("layout", sorted(LAYOUT_KEYS))
def test_two_process_run_logs_the_metrics_of_one_process(layout, layout_runs, reference_run):
    """Same greedy rollouts, so step 0's validation and step 1 (generated from the same
    weights) must match the 1-process run in value, critic metrics and grad norms included;
    step 2 is generated from weights that differ in the last bits, so only its names are
    compared (a near-tie could flip a greedy token)."""
    run_dir, rows = layout_runs(layout)
    assert sorted(rows) == [0, 1, 2]
    missing = [k for k in REQUIRED if k not in rows[2]]
    assert not missing
    assert sorted(rows[2]) == sorted(reference_run[2])
    for step in (0, 1):
        assert sorted(rows[step]) == sorted(reference_run[step])
        for key, value in reference_run[step].items():
            if key.startswith(VOLATILE) or key == "rollout/logprob_diff_max":
                continue  # the probe's gap is float noise (~1e-6) of each layout
            assert rows[step][key] == pytest.approx(value, rel=1e-4, abs=1e-6), (step, key)
    assert "val/test_score/arithmetic" in rows[2]
    assert (run_dir / "checkpoints" / "global_step_2" / "COMPLETE").is_file()
    if layout in ("tp2", "pp2"):  # the trained actor leaves the system at its own layout
        export_and_verify(
            run_dir, 2, tp=2 if layout == "tp2" else 1, pp=2 if layout == "pp2" else 1
        )
    if layout == "pp2":
        export_and_verify(run_dir, 2, pp=2, role="critic")
    # SGLang's own log-probs of its fp32 greedy samples agree with the trainer's
    assert abs(rows[1]["rollout_corr/kl"]) < 1e-4 and rows[1]["rollout_corr/k3_kl"] < 1e-6


def launch_node(args: list[str], log: Path, **env: str) -> subprocess.Popen:
    """One node's `launch/torchrun.sh --config CONFIG ARGS` with `env` (NNODES, ...)."""
    full_env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHON": sys.executable, **env}
    with open(log, "w") as out:
        return subprocess.Popen(
            ["bash", "launch/torchrun.sh", "--config", CONFIG, *args],
            cwd=REPO,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=full_env,
            start_new_session=True,
        )


def wait_all(procs: list[subprocess.Popen], logs: list[Path], timeout_s: float = 900) -> None:
    deadline = time.monotonic() + timeout_s
    for proc, log in zip(procs, logs):
        try:
            code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for p in procs:
                os.killpg(p.pid, signal.SIGKILL)
            raise
        assert code == 0, log.read_text()[-6000:]


@pytest.mark.slow(reason="two nodes of one process, each launching its own SGLang server")
def test_colocated_servers_on_two_nodes_at_pp2_log_the_values_of_one_process(
    tiny_qwen2_dir, data, tmp_path, reference_run
):
    """verl's large-model scripts colocate their servers on every node at PP > 1. Here two
    "nodes" of one rank each (pipeline stage 0 on node 0, stage 1 on node 1, through
    launch/torchrun.sh): each node's rank launches its own server, generates half of each
    step's prompts, and syncs its server with every rank taking part (neither node holds
    the whole model). Greedy rollouts from the same weights: step 0's validation and step
    1 log the 1-process run's values; every sync's probe holds."""
    run_dir, port = tmp_path / "run", str(free_port())
    pp2 = [f"{role}.megatron.pipeline_model_parallel_size=2" for role in ROLES]
    args = ppo_overrides(tiny_qwen2_dir, data, run_dir, 1, *pp2)
    env = {"NNODES": "2", "GPUS_PER_NODE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
    logs = [tmp_path / f"node{k}.log" for k in range(2)]
    before = processes_on(tiny_qwen2_dir)
    nodes = [launch_node(args, log, NODE_RANK=str(k), **env) for k, log in enumerate(logs)]
    wait_all(nodes, logs)
    assert processes_on(tiny_qwen2_dir) - before == set()
    assert all((run_dir / f"node{k}" / "logs" / "sglang_server_0.log").is_file() for k in (0, 1))
    rows = metrics_by_step(run_dir)
    for step in (0, 1):
        for key, value in reference_run[step].items():
            if key.startswith(VOLATILE) or key == "rollout/logprob_diff_max":
                continue
            assert rows[step][key] == pytest.approx(value, rel=1e-4, abs=1e-6), (step, key)
    assert rows[1]["rollout/logprob_diff_max"] < 1e-3


def run_batch_script(argv: list[str], env: dict[str, str], log: Path, model_dir: Path) -> None:
    """`bash <sbatch script> ARGV` in `env` as SLURM runs a batch script (from the submit
    directory); on a timeout, SIGTERM as `scancel` sends, then everything it left."""
    before = processes_on(model_dir)
    with open(log, "w") as out:
        batch = subprocess.Popen(
            argv,
            cwd=env["SLURM_SUBMIT_DIR"],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    try:
        code = batch.wait(timeout=900)
    except subprocess.TimeoutExpired:
        batch.terminate()  # the script stops its trainers and servers
        with contextlib.suppress(subprocess.TimeoutExpired):
            batch.wait(timeout=120)
        os.killpg(batch.pid, signal.SIGKILL)
        for pid in processes_on(model_dir) - before:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
        raise
    assert code == 0, log.read_text()[-6000:]
    assert processes_on(model_dir) - before == set()  # the script stopped its servers


@pytest.mark.slow(reason="the disaggregated SLURM recipe: two trainer nodes and a server node")
def test_sbatch_recipe_on_two_trainer_nodes_logs_the_values_of_one_node(
    tiny_qwen2_dir, data, tmp_path, layout_runs
):
    """launch/slurm_disaggregated.sbatch from what sbatch gives a batch script and nothing
    per node (tests/fake_slurm.py: stand-in srun/scontrol, nodes 127.0.0.2-4 on this
    machine): it starts an SGLang server on the third node, and trainers on the first two
    (NODE_RANK from srun, MASTER_ADDR the first node), tells them the server's URL and the
    weight-sync address, and the run logs the DP=2 run's values."""
    nodes = ["127.0.0.2", "127.0.0.3", "127.0.0.4"]
    submit_dir = tmp_path / "submit"
    stand_ins = write_stand_ins(submit_dir / "bin")
    master, server = free_ports(2)  # two free_port() calls drew the same port once: a hang
    ports = {"MASTER_PORT": str(master), "SERVER_PORT": str(server)}
    env = sbatch_environment(stand_ins, nodes, submit_dir, 4242, RLHF_REPO=str(REPO), **ports)
    run_dir = tmp_path / "run"
    argv = ["bash", str(REPO / "launch" / "slurm_disaggregated.sbatch"), "--config", CONFIG]
    argv += ppo_overrides(tiny_qwen2_dir, data, run_dir, 2)
    run_batch_script(argv, env, submit_dir / "rlhf-4242.out", tiny_qwen2_dir)

    told = yaml.safe_load((run_dir / "config.yaml").read_text())
    rollout = told["actor_rollout_ref"]["rollout"]
    assert rollout["server_urls"] == [f"http://127.0.0.4:{ports['SERVER_PORT']}"]
    assert rollout["weight_sync_master_address"] == "127.0.0.2"  # where rank 0 listens
    assert rollout["weight_sync_transport"] == "distributed"
    assert told["trainer"]["nnodes"] == 2
    assert (submit_dir / "logs" / "sglang-4242" / "127.0.0.4" / "sglang_server_0.log").is_file()
    assert not (run_dir / "logs").exists() and not (run_dir / "node0").exists()
    _, reference = layout_runs("dp2")  # one node, 2 processes, one (external) server
    got = metrics_by_step(run_dir)
    assert sorted(got) == sorted(reference) == [0, 1, 2]
    for step, row in reference.items():
        assert set(got[step]) == set(row)
        for key, value in row.items():
            if key.startswith(VOLATILE):
                continue
            # the engine's log-probs come from another server there, batching its prompts
            # its own way: their gap to the actor's (~1e-8) is float noise
            noise = 1e-7 if key.startswith("rollout_corr/") else 1e-9
            assert got[step][key] == pytest.approx(value, rel=1e-6, abs=noise), (step, key)


def test_the_loop_stops_on_the_kl_its_steps_report(tiny_qwen2_dir, data, sglang_server, tmp_path):
    """`trainer.early_stop` through the trainer's loop: the KL rule is fed each step's KL to
    the reference (the one logged as actor/reward_kl_penalty) and stops the run at the second
    consecutive step above the threshold, with a last checkpoint there.

    The run fed the external server through the CPU tensor transport: its torch_shm_manager
    and /dev/shm files must end with it though the server stays (they did not, issue 50)."""
    run_dir, threshold = tmp_path / "kl_stop", 1e-12
    stop = ["trainer.early_stop.kl_threshold=1e-12", "trainer.early_stop.kl_patience=2"]
    args = ppo_overrides(tiny_qwen2_dir, data, run_dir, 6, *stop, server=sglang_server)
    shm_before = torch_shm_state()
    text = run_train(args, run_dir)
    assert shm_left_since(shm_before) == (set(), set())
    rows = metrics_by_step(run_dir)
    kl = {step: row["actor/reward_kl_penalty"] for step, row in rows.items() if step > 0}
    high = [step for step in sorted(kl) if kl[step] > threshold]
    expected = next(s for s in high if s - 1 in high)  # written out from the logged KLs
    assert max(rows) == expected < 6
    assert rows[expected]["early_stop/stop"] == 1.0
    assert f"early stop at step {expected}: mean KL {kl[expected]:.4g} above 1e-12" in text
    assert (run_dir / "checkpoints" / f"global_step_{expected}").is_dir()
