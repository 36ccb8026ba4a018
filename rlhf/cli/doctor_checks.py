"""The checks of `rlhf-doctor` (rlhf/cli/doctor.py), one small function each.

Each returns a `Check` row instead of raising or printing, so that the CLI can show every
problem at once and each check can be tested alone with a hand-made situation (a busy port,
an unwritable directory, a URL with nothing behind it).
"""

from __future__ import annotations

import ipaddress
import os
import shutil
import socket
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import psutil
import torch
import torch.distributed as dist

from rlhf import sglang_api
from rlhf.cli.check_env import lock_problems, read_pins
from rlhf.config.placement import weight_sync_address_problem
from rlhf.config.schema import DataConfig
from rlhf.config.validate import ParallelLayout
from rlhf.data.files import resolve_files
from rlhf.models.families import ModelArch, load_arch
from rlhf.models.model_dir import check_model_dir, check_servable_policy

PASS, WARN, SKIP, FAIL = "PASS", "WARN", "SKIP", "FAIL"
CORE_PACKAGES = ("torch", "megatron-core", "sglang", "sglang-router", "transformers")
GIB = 1 << 30
MIN_FREE_BYTES = GIB
URLS_KEY = "actor_rollout_ref.rollout.server_urls"


@dataclass(frozen=True)
class Check:
    """One row of the report."""

    name: str
    status: str  # PASS, WARN, SKIP or FAIL
    detail: str
    fix: str = ""


def check_packages(lock: Path, gpu_requirements: Path | None = None) -> Check:
    """Installed versions against the lock; GPU pins too on a GPU machine.

    A differing training-stack package (or GPU package) fails; any other difference warns.
    """
    name = "packages"
    if not lock.is_file():
        return Check(name, SKIP, f"{lock} not found (pass --requirements DIR holding cpu.lock)")
    problems = lock_problems(lock)
    gpu = lock_problems(gpu_requirements) if gpu_requirements else []
    failing = [p for p in problems if p.split(":")[0] in CORE_PACKAGES] + gpu
    if failing:
        fix = "rebuild the environment: make clean setup"
        if gpu:
            fix += f"; pip install -r {gpu_requirements}"
        return Check(name, FAIL, _first(failing), fix)
    if problems:
        return Check(name, WARN, f"outside the training stack: {_first(problems)}", "make setup")
    where = lock.name + (f" + {gpu_requirements.name}" if gpu_requirements else "")
    return Check(name, PASS, f"{len(read_pins(lock))} pins match {where}")


def _first(items: list[str], num: int = 3) -> str:
    more = f" (+{len(items) - num} more)" if len(items) > num else ""
    return "; ".join(items[:num]) + more


def check_cuda(device: str, gpus_per_node: int) -> Check:
    """CUDA devices and NCCL for trainer.device / trainer.n_gpus_per_node."""
    name = "cuda/nccl"
    if device == "cpu":
        return Check(name, SKIP, "CPU run (trainer.device=cpu): gloo, no GPU needed")
    if not torch.cuda.is_available():
        fix = "check nvidia-smi, CUDA_VISIBLE_DEVICES and that torch is a CUDA build"
        if device == "cuda":
            return Check(name, FAIL, "trainer.device=cuda but torch sees no CUDA device", fix)
        return Check(name, WARN, "no CUDA device: trainer.device=auto will run on CPU", fix)
    count = torch.cuda.device_count()
    if count < gpus_per_node:
        return Check(
            name,
            FAIL,
            f"{count} GPU(s) visible, trainer.n_gpus_per_node={gpus_per_node}",
            "lower GPUS_PER_NODE / trainer.n_gpus_per_node or check CUDA_VISIBLE_DEVICES",
        )
    if not dist.is_nccl_available():
        return Check(name, FAIL, "torch was built without NCCL", "install a CUDA build of torch")
    return Check(name, PASS, f"{count} x {torch.cuda.get_device_name(0)}, NCCL available")


def check_master_port(port: int, node_rank: int) -> Check:
    """Node 0 must be able to open MASTER_PORT for the rendezvous."""
    name = "master port"
    if node_rank != 0:
        return Check(name, SKIP, f"node rank {node_rank}: node 0 opens MASTER_PORT {port}")
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as torch's store does
            sock.bind(("", port))
    except OSError as e:
        return Check(
            name,
            FAIL,
            f"MASTER_PORT {port} is in use on this host{_port_owner(port)} ({e.strerror})",
            "stop that process, or set MASTER_PORT to a free port",
        )
    return Check(name, PASS, f"MASTER_PORT {port} is free")


def _port_owner(port: int) -> str:
    """' by pid N (name)' for the process listening on `port`, when the OS tells us."""
    try:
        conns = psutil.net_connections("tcp")
    except (psutil.Error, OSError):
        return ""
    for conn in conns:
        if conn.laddr and conn.laddr.port == port and conn.status == psutil.CONN_LISTEN:
            if conn.pid is None:
                return ""
            try:
                return f" by pid {conn.pid} ({psutil.Process(conn.pid).name()})"
            except psutil.Error:
                return f" by pid {conn.pid}"
    return ""


def _local_addresses() -> set[str]:
    return {
        a.address.split("%")[0]
        for addrs in psutil.net_if_addrs().values()
        for a in addrs
        if a.family in (socket.AF_INET, socket.AF_INET6)
    }


def check_master_addr(
    addr: str, port: int, node_rank: int, nnodes: int, timeout_s: float = 3.0
) -> Check:
    """MASTER_ADDR resolves; it is this host on node 0, and reachable from the others."""
    name = "master addr"
    fix = "set MASTER_ADDR to node 0's hostname or IP address"
    try:
        infos = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)
        ips = {str(info[4][0]) for info in infos}
    except (socket.gaierror, UnicodeError) as e:
        return Check(name, FAIL, f"MASTER_ADDR {addr!r} does not resolve ({e})", fix)
    shown = f"{addr} -> {', '.join(sorted(ips))}"
    if node_rank == 0:
        if all(ipaddress.ip_address(ip).is_loopback for ip in ips):
            if nnodes > 1:
                detail = f"{shown} is loopback, unreachable from the other {nnodes - 1} node(s)"
                return Check(name, FAIL, detail, "set MASTER_ADDR to this node's hostname/IP")
            return Check(name, PASS, f"{shown} (this host)")
        if ips & _local_addresses():
            return Check(name, PASS, f"{shown} is an address of this host")
        detail = f"{shown} is not an address of this host, but this is node rank 0"
        return Check(name, FAIL, detail, "run node rank 0 on MASTER_ADDR, or fix NODE_RANK")
    try:
        socket.create_connection((addr, port), timeout=timeout_s).close()
    except ConnectionRefusedError:
        detail = f"{shown} answers, but nothing listens on port {port} yet"
        return Check(name, WARN, detail, "start node rank 0 first; check MASTER_PORT")
    except OSError as e:
        detail = f"cannot reach {addr}:{port} ({e})"
        return Check(name, FAIL, detail, "check the network and firewall between the nodes")
    return Check(name, PASS, f"connected to {addr}:{port}")


def _weights_bytes(model_dir: Path) -> int:
    files = [p for ext in ("*.safetensors", "*.bin", "*.pt") for p in model_dir.glob(ext)]
    return sum(p.stat().st_size for p in files if p.is_file())


def check_run_dir(run_dir: Path, model_dir: Path | None = None) -> Check:
    """trainer.default_local_dir can be created and written, with room for checkpoints."""
    name = "run dir"
    existing = run_dir
    while not os.path.exists(existing):  # never raises, unlike Path.exists on EACCES
        existing = existing.parent
    if not existing.is_dir():
        detail = f"{existing} is a file, so {run_dir} cannot be created"
        return Check(name, FAIL, detail, "set trainer.default_local_dir to a directory path")
    try:
        with tempfile.NamedTemporaryFile(dir=existing, prefix=".rlhf-doctor-"):
            pass
    except OSError as e:
        detail = f"cannot write in {existing} ({e.strerror}), so not in {run_dir}"
        return Check(name, FAIL, detail, "fix its permissions or set trainer.default_local_dir")
    weights = _weights_bytes(model_dir) if model_dir is not None and model_dir.is_dir() else 0
    need = max(MIN_FREE_BYTES, 3 * weights)
    basis = "3 x model weights" if 3 * weights > MIN_FREE_BYTES else "minimum"
    free = shutil.disk_usage(existing).free
    space = f"{free / GIB:.1f} GiB free, checkpoints need ~{need / GIB:.1f} GiB ({basis})"
    if free < need:
        return Check(name, FAIL, f"{existing}: {space}", "free space or use a larger volume")
    where = str(run_dir) if existing == run_dir else f"{run_dir} (to be created in {existing})"
    return Check(name, PASS, f"{where} writable; {space}")


def check_sglang_urls(urls: list[str] | None, num_servers: int) -> Check:
    """External SGLang servers answer GET /health."""
    name = "sglang servers"
    if not urls:
        return Check(name, SKIP, f"launched by the job (rollout.num_servers={num_servers})")
    down = [u for u in urls if not sglang_api.healthy(u.rstrip("/"))]
    if down:
        detail = f"no healthy answer to GET /health from {', '.join(down)}"
        return Check(name, FAIL, detail, f"start them (launch/sglang_servers.sh) or fix {URLS_KEY}")
    return Check(name, PASS, f"{len(urls)} server(s) healthy")


def _is_loopback(host: str) -> bool:
    """Whether `host` (a name or an address) resolves only to loopback addresses."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError):
        return False
    return all(ipaddress.ip_address(str(info[4][0])).is_loopback for info in infos)


def check_weight_sync_address(urls: list[str] | None, transport: str, address: str) -> Check:
    """Servers on other hosts reach the trainer's rank 0 for a distributed-transport weight
    sync at `rollout.weight_sync_master_address`: the trainer's own rule
    (`weight_sync_address_problem`), with names resolved here (a name for this machine's
    loopback counts as loopback)."""
    name = "weight sync address"
    if transport != "distributed":
        return Check(name, SKIP, f"weight_sync_transport={transport}: no process group")
    if problem := weight_sync_address_problem(urls, transport, address, _is_loopback):
        return Check(name, FAIL, problem, "set it to this node's address the servers can reach")
    remote = [u for u in urls or [] if not _is_loopback(urlsplit(u).hostname or "")]
    if not remote:
        return Check(name, PASS, f"{address} (servers on this host)")
    return Check(name, PASS, f"{address}, for {len(remote)} server(s) on other hosts")


ConfigValidation = Callable[[ModelArch | None], tuple[ParallelLayout, list[str]]]


def check_config(model_path: str | None, validated: ConfigValidation) -> Check:
    """The config's own validation of the run (`validated`, bound by `run_checks`: every
    cross-field rule for its world size, the multi-turn tools loaded; the layout and the
    notes on keys without effect), with the model's shape (heads, layers) when its
    config.json is at `model_path`."""
    model_dir = Path(model_path or ".")
    try:
        shape = load_arch(model_dir) if (model_dir / "config.json").is_file() else None
        layout, notes = validated(shape)
    except ValueError as e:  # ConfigError, or a model config this project cannot read
        return Check("config", FAIL, str(e), "fix the keys named, or launch that many processes")
    detail = f"world size {layout.world_size}: {layout.describe()}"
    if notes:
        return Check("config", WARN, f"{detail}; " + "; ".join(notes), "remove the keys named")
    return Check("config", PASS, detail)


def _model_problems(models: dict[str, str | None]) -> list[str]:
    """Each model directory (by its dotted key) as the trainer checks it before starting
    servers: config.json of a supported family, readable safetensors headers (each bad
    directory reported once)."""
    problems, seen = [], set()
    for key, path in models.items():
        if not path or path in seen:
            continue
        seen.add(path)
        if not (Path(path) / "config.json").is_file():
            problems.append(f"{key}: no config.json in {path!r}")
            continue
        try:
            arch = check_model_dir(path, key)
            if key == "actor_rollout_ref.model.path":  # the model SGLang serves
                check_servable_policy(arch, path, key)
        except (OSError, ValueError) as e:
            problems.append(str(e))
    return problems


def check_inputs(
    policy: str | None, critic: str | None, reward: str | None, data: DataConfig
) -> Check:
    """The model directories (the policy's, the critic's, the reward model's paths) are
    usable and the Parquet files of `data` exist."""
    problems = _model_problems(
        {
            "actor_rollout_ref.model.path": policy,
            "critic.model.path": critic,
            "reward.model_path": reward,
        }
    )
    specs = {"data.train_files": data.train_files, "data.val_files": data.val_files}
    for key, spec in specs.items():
        if spec is None and key == "data.val_files":
            continue
        try:
            resolve_files(spec, key)
        except (FileNotFoundError, ValueError) as e:
            problems.append(str(e))
    if problems:
        return Check("model/data", FAIL, "; ".join(problems), "fix the paths named")
    return Check("model/data", PASS, "models of supported families, weights and data files found")
