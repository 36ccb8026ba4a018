"""Which GPUs each SGLang server gets, computed for simulated 8-GPU nodes and 2-node layouts
without a GPU (issue 51, item 1): the placement rule (`rlhf.config.placement`), the config
rule num_servers x rollout TP <= GPUs per node, the `--base-gpu-id` each launched server of
the trainer's engine is given (stand-in servers record it), and rlhf-doctor's table."""

from __future__ import annotations

import sys

import pytest

from rlhf.cli import doctor
from rlhf.cli.doctor_checks import FAIL, PASS, SKIP, WARN
from rlhf.cli.doctor_placement import LaunchEnvError, check_placement, node_gpus
from rlhf.config import ConfigError, load_config, validate_config
from rlhf.config.placement import rollout_placement, server_gpus
from rlhf.config.schema import RolloutConfig
from rlhf.rollout import server_group
from rlhf.rollout.engine import SGLangEngine
from rlhf.rollout.server_group import ServerGroup
from rlhf.rollout.sglang_server import ServerLaunch
from tests.helpers import REPO
from tests.unit.test_rollout_server_group import STAND_IN

AR = "actor_rollout_ref.rollout"
CONFIGS = REPO / "configs"


@pytest.mark.parametrize("num_servers, tp", [(8, 1), (4, 2), (2, 4), (1, 8), (3, 2)])
def test_servers_of_an_8_gpu_node_get_disjoint_gpus(num_servers, tp):
    gpus = server_gpus(num_servers, tp, 8)
    assert [g[0] for g in gpus] == [i * tp for i in range(num_servers)]  # base_gpu_id
    used = [gpu for server in gpus for gpu in server]
    assert all(len(server) == tp for server in gpus)
    assert len(set(used)) == len(used) == num_servers * tp and set(used) <= set(range(8))


@pytest.mark.parametrize("num_servers, tp", [(9, 1), (5, 2), (3, 4), (2, 8)])
def test_servers_that_would_share_a_gpu_are_refused(num_servers, tp):
    with pytest.raises(ConfigError) as e:
        server_gpus(num_servers, tp, 8)
    message = str(e.value)
    assert "\n" not in message and f"{AR}.num_servers ({num_servers})" in message
    assert f"{AR}.tensor_model_parallel_size ({tp})" in message
    assert "a node has 8 (trainer.n_gpus_per_node)" in message


def test_two_colocated_nodes_each_run_their_servers_on_their_own_gpus():
    placement = rollout_placement(RolloutConfig(num_servers=4, tensor_model_parallel_size=2), 2, 8)
    assert placement.colocated
    assert [n.node for n in placement.nodes] == ["node 0", "node 1"]
    for node in placement.nodes:
        assert node.gpus == [(0, 1), (2, 3), (4, 5), (6, 7)] and node.urls == []


def test_external_servers_are_placed_by_host_and_port_as_the_launch_script_starts_them():
    urls = ["http://b:30001", "http://a:30000", "http://b:30000", "http://a:30001"]
    rollout = RolloutConfig(server_urls=urls, tensor_model_parallel_size=4)
    placement = rollout_placement(rollout, 2, 8)
    assert not placement.colocated
    by_host = {n.node: (n.urls, n.gpus) for n in placement.nodes}
    assert by_host == {
        "b": (["http://b:30000", "http://b:30001"], [(0, 1, 2, 3), (4, 5, 6, 7)]),
        "a": (["http://a:30000", "http://a:30001"], [(0, 1, 2, 3), (4, 5, 6, 7)]),
    }


def test_config_rule_num_servers_times_rollout_tp_fits_the_gpus_per_node():
    path = CONFIGS / "gsm8k_8gpu.yaml"  # 4 servers x TP 2 on 8 GPUs
    validate_config(load_config(path))
    with pytest.raises(ConfigError, match=rf"{AR}.num_servers \(8\) x {AR}.tensor_model"):
        validate_config(load_config(path, [f"{AR}.num_servers=8"]))
    two_nodes = ["trainer.nnodes=2", f"{AR}.num_servers=3"]  # 3 x TP 2 on each node of 8
    validate_config(load_config(path, two_nodes))
    with pytest.raises(ConfigError, match="would share GPUs"):
        validate_config(load_config(path, [*two_nodes, f"{AR}.tensor_model_parallel_size=4"]))
    cpu = [f"{AR}.num_servers=8", "trainer.device=cpu"]  # CPU servers take no GPU
    validate_config(load_config(path, cpu))


@pytest.fixture
def launched(tmp_path, monkeypatch) -> list[dict]:
    """Servers become stand-ins; returns the keyword arguments each was built with."""
    script = tmp_path / "stand_in_server.py"
    script.write_text(STAND_IN)

    def build(rollout, model_path, *, port, device, host="127.0.0.1", **kwargs) -> ServerLaunch:
        launched.append({"port": port, "device": device, **kwargs})
        argv = [sys.executable, str(script), str(port), str(tmp_path / "posts"), "0"]
        return ServerLaunch(argv=argv, env={}, url=f"http://{host}:{port}")

    launched: list[dict] = []
    monkeypatch.setattr(server_group, "build_server_args", build)
    return launched


def _rollout(num_servers: int, tp: int) -> RolloutConfig:
    return RolloutConfig(
        num_servers=num_servers, tensor_model_parallel_size=tp, server_startup_timeout_s=30.0
    )


@pytest.mark.parametrize("num_servers, tp", [(8, 1), (4, 2), (2, 4), (1, 8)])
def test_the_trainers_engine_starts_each_server_on_its_own_gpus(
    launched, tmp_path, num_servers, tp
):
    """What `PolicyServers.launch` builds on a GPU node (local world size 8): server i is
    told --base-gpu-id i x TP (it was None, so every server took GPU 0)."""
    rollout = _rollout(num_servers, tp)
    engine = SGLangEngine(rollout, "m", log_dir=tmp_path, device="cuda", gpus_per_node=8)
    engine.shutdown()
    assert [c["base_gpu_id"] for c in launched] == [i * tp for i in range(num_servers)]


def test_cpu_servers_get_no_gpu(launched, tmp_path):
    SGLangEngine(_rollout(2, 1), "m", log_dir=tmp_path, device="cpu", gpus_per_node=1).shutdown()
    assert [c["base_gpu_id"] for c in launched] == [None, None]


def test_servers_too_many_for_the_nodes_processes_are_refused_before_any_starts(launched, tmp_path):
    with pytest.raises(ConfigError, match=r"a node has 4 \(processes of the node"):
        ServerGroup(_rollout(4, 2), "m", log_dir=tmp_path, gpus_per_node=4)
    assert launched == []


# ---- rlhf-doctor --------------------------------------------------------------------------


def test_doctor_gpus_per_node_from_the_flag_the_launch_environment_or_the_config():
    cfg = load_config(CONFIGS / "gsm8k_8gpu.yaml")
    assert node_gpus(4, {"GPUS_PER_NODE": "2"}, cfg.trainer) == (4, "--gpus-per-node")
    assert node_gpus(None, {"GPUS_PER_NODE": "2"}, cfg.trainer) == (2, "GPUS_PER_NODE")
    assert node_gpus(None, {}, cfg.trainer) == (8, "trainer.n_gpus_per_node")
    with pytest.raises(LaunchEnvError, match="GPUS_PER_NODE='x'"):
        node_gpus(None, {"GPUS_PER_NODE": "x"}, cfg.trainer)


@pytest.mark.parametrize(
    "name, rows",
    [
        ("gsm8k_8gpu", ["node 0 | 0      | 0-1", "node 0 | 3      | 6-7"]),
        ("qwen3_30b_a3b_grpo_8gpu", ["node 0 | 0      | 0-3", "node 0 | 1      | 4-7"]),
        ("gsm8k_qwen2.5-0.5b_1gpu", ["node 0 | 0      | 0"]),
        ("gsm8k_2node", ["rollout-0 | 0      | 0-3  | http://rollout-0:30000"]),
    ],
)
def test_doctor_places_the_servers_of_the_shipped_gpu_configs(name, rows):
    cfg = load_config(CONFIGS / f"{name}.yaml")
    check, report = check_placement(
        cfg.trainer,
        cfg.actor_rollout_ref.rollout,
        cfg.trainer.n_gpus_per_node,
        "trainer.n_gpus_per_node",
    )
    assert check.status == PASS, check
    assert all(row in report.splitlines() for row in rows), report
    assert report.startswith("disaggregated" if name == "gsm8k_2node" else "colocated")


def test_doctor_fails_an_overlap_warns_crowded_hosts_and_skips_cpu_runs():
    cfg = load_config(CONFIGS / "gsm8k_8gpu.yaml")
    check, report = check_placement(cfg.trainer, cfg.actor_rollout_ref.rollout, 4, "GPUS_PER_NODE")
    assert check.status == FAIL and "a node has 4 (GPUS_PER_NODE)" in check.detail
    assert report == ""
    crowded = load_config(CONFIGS / "gsm8k_2node.yaml")
    assert (
        check_placement(crowded.trainer, crowded.actor_rollout_ref.rollout, 2, "--gpus-per-node")[
            0
        ].status
        == WARN
    )  # TP 4 on 2 GPUs
    cpu = load_config(CONFIGS / "quickstart_cpu.yaml")
    check, report = check_placement(
        cpu.trainer, cpu.actor_rollout_ref.rollout, 1, "trainer.n_gpus_per_node"
    )
    assert check.status == SKIP and report == ""


def test_doctor_prints_the_placement_per_node(capsys, monkeypatch):
    monkeypatch.delenv("GPUS_PER_NODE", raising=False)
    doctor.main(["--config", str(CONFIGS / "gsm8k_8gpu.yaml"), "--gpu-memory-gb", "80"])
    out = capsys.readouterr().out
    assert "SGLang servers, GPU ids per server:" in out
    assert "node 0 | 2      | 4-5" in out.splitlines()
