"""Where a run's SGLang servers sit: the GPUs of each server, node by node, and the address
servers on other hosts reach the trainer at for a weight sync.

Plain functions of the config, so that the decision is computed, and tested, for an 8-GPU
node or several nodes on a machine without a GPU; only SGLang's own CUDA calls are GPU-only.

GPU ids: SGLang puts TP rank r of a server on GPU `base_gpu_id + r` (`gpu_id_step` 1,
`sglang.srt.entrypoints.engine`), counted among the devices the server process sees. A
server launched by the trainer inherits its environment, CUDA_VISIBLE_DEVICES included, so
the ids are those of the trainer's local ranks (local rank k computes on cuda:k): server i
of a node takes GPUs i x TP .. i x TP + TP - 1, disjoint from the node's other servers.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from rlhf.config.loader import ConfigError
from rlhf.config.rollout import RolloutConfig

ROLLOUT = "actor_rollout_ref.rollout"
GPUS_KEY = "trainer.n_gpus_per_node"
DEFAULT_ADDRESS = RolloutConfig.weight_sync_master_address


def server_gpus(
    num_servers: int, tp_size: int, gpus_per_node: int | None = None, source: str = GPUS_KEY
) -> list[tuple[int, ...]]:
    """The GPU ids of each of a node's `num_servers` servers of `tp_size` GPUs (server i
    from GPU i x tp_size on). ConfigError, naming the keys, when they need more than the
    node's `gpus_per_node` GPUs (`source` says where that count comes from; None: unknown,
    not checked), since servers would then share GPUs."""
    need = num_servers * tp_size
    if gpus_per_node is not None and need > gpus_per_node:
        raise ConfigError(
            f"{ROLLOUT}.num_servers ({num_servers}) x {ROLLOUT}.tensor_model_parallel_size "
            f"({tp_size}) = {need} GPUs per node, but a node has {gpus_per_node} ({source}): "
            "the servers would share GPUs; launch fewer or smaller servers"
        )
    return [tuple(range(i * tp_size, (i + 1) * tp_size)) for i in range(num_servers)]


@dataclass(frozen=True)
class NodeServers:
    """One node's servers: `gpus[i]` the GPU ids of its server i, `urls[i]` its URL when the
    servers are external (empty for servers the run launches)."""

    node: str
    gpus: list[tuple[int, ...]]
    urls: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class RolloutPlacement:
    """The servers of a run, node by node; `colocated`: launched by the run on its trainer
    nodes (sharing their GPUs), else external servers on hosts of their own."""

    colocated: bool
    nodes: list[NodeServers]


def rollout_placement(
    rollout: RolloutConfig, nnodes: int, gpus_per_node: int | None, source: str = GPUS_KEY
) -> RolloutPlacement:
    """Colocated (`rollout.server_urls` unset): every trainer node runs `num_servers` servers
    on its GPUs (on one node rank 0 launches them, on several each node's local rank 0 its
    own), refused when they overlap. External servers: grouped by the host of their URL,
    each host's servers by port placed as `launch/sglang_servers.sh` starts them (the
    server on BASE_PORT + k on GPUs k x TP onwards); their hosts' GPUs are not checked."""
    tp = rollout.tensor_model_parallel_size
    if not rollout.server_urls:
        gpus = server_gpus(rollout.num_servers, tp, gpus_per_node, source)
        return RolloutPlacement(True, [NodeServers(f"node {n}", gpus) for n in range(nnodes)])
    hosts: dict[str, list[tuple[int, str]]] = {}
    for url in rollout.server_urls:
        parts = urlsplit(url)
        hosts.setdefault(parts.hostname or url, []).append((parts.port or 0, url))
    nodes = []
    for host, servers in hosts.items():
        urls = [url for _, url in sorted(servers)]
        nodes.append(NodeServers(host, server_gpus(len(urls), tp), urls))
    return RolloutPlacement(False, nodes)


def gpu_ids_text(gpus: tuple[int, ...]) -> str:
    """'3' for one GPU, '0-3' for a range."""
    return str(gpus[0]) if len(gpus) == 1 else f"{gpus[0]}-{gpus[-1]}"


def is_loopback_host(host: str) -> bool:
    """Whether `host` can only mean this machine: localhost, 127.0.0.0/8 or ::1 (any other
    name is taken as reachable from elsewhere; nothing is resolved here)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def weight_sync_address_problem(
    server_urls: list[str] | None,
    transport: str,
    address: str,
    is_loopback: Callable[[str], bool] = is_loopback_host,
) -> str | None:
    """Why servers could not rendezvous with training rank 0 at `address`
    (`rollout.weight_sync_master_address`, 127.0.0.1 when the config leaves it unset) for a
    distributed-transport weight sync, or None. Servers on another host (a URL whose host
    `is_loopback` denies) would dial their own loopback and time out after minutes."""
    if transport != "distributed":
        return None
    remote = [u for u in server_urls or [] if not is_loopback(urlsplit(u).hostname or "")]
    if not remote:
        return None
    if address and not is_loopback(address):
        return None
    what = f"is {address}, a loopback address" if address else "is empty"
    if address == DEFAULT_ADDRESS:
        what += " (the default when unset)"
    return (
        f"{ROLLOUT}.weight_sync_master_address {what}, unreachable from the servers at "
        f"{', '.join(remote)} for the distributed weight sync: set it to the address of training "
        "rank 0's node (launch/slurm.sbatch and slurm_disaggregated.sbatch pass the first node's)"
    )
