"""SIGTERM (a preemption) ends a real `rlhf-train` run (CPU, the session's shared SGLang
server) after the step in flight: with a checkpoint of that step when one fits in
trainer.preemption_grace_s, which the same command then resumes from; with no time left, no
checkpoint is started and the one line says which steps are lost. Both runs are two
processes under launch/torchrun.sh (DP 2), every process signalled together as SLURM does."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlhf.checkpoint import complete_steps_in
from rlhf.config import load_config
from rlhf.config.validate import trained_megatron
from rlhf.memory.checkpoint_size import checkpoint_bytes
from rlhf.models.families import load_arch
from rlhf.quickstart.data import write_quickstart_data
from rlhf.utils import free_port
from tests.helpers import REPO, ppo_overrides

pytestmark = [
    pytest.mark.reliability,
    pytest.mark.slow(reason="a run and its resume, each stopped by SIGTERM"),
]
CONFIG = str(REPO / "configs" / "quickstart_cpu.yaml")


def logged_steps(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line)["step"] for line in path.read_text().splitlines() if line.strip()]


def sigterm_after_a_step(
    args: list[str], run_dir: Path, nproc: int = 1
) -> tuple[subprocess.CompletedProcess, str]:
    """Start rlhf-train (nproc > 1: under launch/torchrun.sh), SIGTERM every process of it, as
    SLURM does, once it logged a step it had not logged before; its exit and the one
    `rlhf-train:` line its ranks printed. (Output in files: see tests.helpers.rlhf_train.)"""
    before = set(logged_steps(run_dir))
    cmd = [sys.executable, "-m", "rlhf.cli.train", "--config", CONFIG, *args]
    env = dict(os.environ)
    if nproc > 1:
        cmd = ["bash", str(REPO / "launch" / "torchrun.sh"), "--config", CONFIG, *args]
        env |= {"GPUS_PER_NODE": str(nproc), "MASTER_PORT": str(free_port())}
        env |= {"PYTHON": sys.executable, "PYTHONPATH": str(REPO)}
    name = f"{run_dir.name}_{len(before)}"  # one pair of files per launch
    logs = run_dir.parent / f"{name}.out", run_dir.parent / f"{name}.err"
    with logs[0].open("w") as out, logs[1].open("w") as err:
        proc = subprocess.Popen(
            cmd, cwd=REPO, stdout=out, stderr=err, text=True, env=env, start_new_session=True
        )
        deadline = time.monotonic() + 600
        while not set(logged_steps(run_dir)) - before and time.monotonic() < deadline:
            assert proc.poll() is None, logs[1].read_text()[-3000:]
            time.sleep(0.2)
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=300)
    stderr = logs[1].read_text()
    done = subprocess.CompletedProcess(cmd, proc.returncode, logs[0].read_text(), stderr)
    lines = {x for x in stderr.splitlines() if x.startswith("rlhf-train:")}
    assert len(lines) == 1, stderr[-3000:]  # every rank says the same
    return done, lines.pop()


def test_sigterm_checkpoints_the_step_then_the_run_resumes(tiny_qwen2_dir, sglang_server, tmp_path):
    data = write_quickstart_data(tmp_path / "data", num_train=64, num_val=8)
    run_dir = tmp_path / "run"
    args = ppo_overrides(
        tiny_qwen2_dir,
        data,
        run_dir,
        8,
        "trainer.save_freq=-1",
        "trainer.test_freq=-1",
        "trainer.val_before_train=false",
        server=sglang_server,
    )
    first, line = sigterm_after_a_step(args, run_dir, nproc=2)
    assert first.returncode == 128 + signal.SIGTERM, first.stderr[-3000:]
    step = logged_steps(run_dir)[-1]
    assert 1 <= step < 8
    checkpoint = run_dir / "checkpoints" / f"global_step_{step}"
    assert line == (
        f"rlhf-train: stopped by SIGTERM after step {step}: checkpoint {checkpoint} "
        f"holds step {step}; the same command resumes from it"
    )
    assert complete_steps_in(run_dir / "checkpoints") == [step]
    on_disk = sum(f.stat().st_size for f in checkpoint.rglob("*") if f.is_file())
    cfg = load_config(CONFIG, args)
    trained = trained_megatron(cfg.actor_rollout_ref, cfg.critic, cfg.algorithm).values()
    planned = checkpoint_bytes(trained, load_arch(tiny_qwen2_dir), cfg.trainer.save_hf, 2)
    assert 0.8 * planned < on_disk < 1.25 * planned, (on_disk, planned)

    second, line = sigterm_after_a_step([*args, "trainer.preemption_grace_s=0"], run_dir, nproc=2)
    assert second.returncode == 128 + signal.SIGTERM, second.stderr[-3000:]
    assert f"resumed from {checkpoint} (step {step})" in second.stderr
    last = logged_steps(run_dir)[-1]
    assert last > step
    lost = f"step {last} is" if last == step + 1 else f"steps {step + 1}-{last} are"
    pattern = (
        rf"rlhf-train: stopped by SIGTERM after step {last}: no checkpoint written "
        rf"\(one takes about \d+ s, 0 s of trainer.preemption_grace_s were left\); "
        rf"{lost} lost \(the latest checkpoint is {checkpoint}\)"
    )
    assert re.fullmatch(pattern, line), line
    assert complete_steps_in(run_dir / "checkpoints") == [step]
