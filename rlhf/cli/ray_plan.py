"""What `rlhf-ray-train` asks of a Ray cluster, and what each rank is told: plain data.

The launcher (`rlhf.cli.ray_train`) only carries these decisions out, so every one of them is
tested without Ray running:

- the placement group: one bundle per node, holding that node's ranks whole (`n_gpus_per_node`
  GPUs and `cpus_per_rank` CPUs each; CPUs only when the ranks run on the CPU), spread over
  distinct nodes (STRICT_SPREAD; STRICT_PACK for one node). One bundle per rank in a group per
  node (STRICT_PACK each) would also keep a node's ranks together, but two such groups may land
  on one host, which then runs two "nodes" that torchrun's variables describe wrongly;
- which rank runs where: node rank = bundle index, rank = node rank x ranks per node + local
  rank, as torchrun numbers them;
- each rank's torchrun environment (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
  GROUP_RANK/NODE_RANK, MASTER_ADDR/PORT), and on GPUs CUDA_VISIBLE_DEVICES: every rank of a
  node sees the node's GPUs that Ray gave its ranks, in local-rank order, so that `cuda:LOCAL_RANK`
  is the rank's own GPU and the SGLang servers a node's first rank starts see the node's GPUs,
  as under torchrun;
- the exit code and the one line that name a failed rank.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass

from rlhf.errors import ExternalError

TRAINER_MODULE = "rlhf.cli.train"


class LaunchError(ValueError, ExternalError):
    """A launch the cluster or the config cannot give; the message is one line, which
    rlhf-ray-train prints after its name alone (exit 1)."""

    kind = ""


@dataclass(frozen=True)
class RankSlot:
    """Where one trainer rank runs: its placement-group bundle is its node rank."""

    rank: int
    node_rank: int
    local_rank: int


@dataclass(frozen=True)
class LaunchPlan:
    """`nnodes` x `ranks_per_node` trainer processes (trainer.nnodes x trainer.n_gpus_per_node),
    one GPU each when `use_gpus`, `cpus_per_rank` CPUs each."""

    nnodes: int
    ranks_per_node: int
    use_gpus: bool
    cpus_per_rank: float = 1.0

    @property
    def world_size(self) -> int:
        return self.nnodes * self.ranks_per_node

    def bundles(self) -> list[dict[str, float]]:
        """One bundle per node, holding all of its ranks (see the module docstring)."""
        bundle = {"CPU": self.cpus_per_rank * self.ranks_per_node}
        if self.use_gpus:
            bundle["GPU"] = float(self.ranks_per_node)
        return [dict(bundle) for _ in range(self.nnodes)]

    @property
    def strategy(self) -> str:
        """Distinct nodes for distinct bundles; one node's bundle is packed anyway."""
        return "STRICT_SPREAD" if self.nnodes > 1 else "STRICT_PACK"

    def rank_resources(self) -> dict[str, float]:
        """What each rank's Ray actor reserves inside its node's bundle."""
        return {"num_cpus": self.cpus_per_rank, "num_gpus": 1.0 if self.use_gpus else 0.0}

    def slots(self) -> list[RankSlot]:
        """Every rank in rank order, numbered as torchrun numbers them."""
        return [
            RankSlot(node * self.ranks_per_node + local, node, local)
            for node in range(self.nnodes)
            for local in range(self.ranks_per_node)
        ]


def plan_launch(
    nnodes: int, ranks_per_node: int, device: str, cluster_gpus: float, cpus_per_rank: float = 1.0
) -> LaunchPlan:
    """The launch for a config's trainer.nnodes / n_gpus_per_node / device on a cluster with
    `cluster_gpus` GPUs in all: 'auto' uses GPUs when the cluster has any, as the trainer
    does on its node; 'cuda' without any is refused here rather than after a wait."""
    if cpus_per_rank <= 0:
        raise LaunchError(f"--cpus-per-rank {cpus_per_rank}: must be > 0")
    if device == "cuda" and cluster_gpus <= 0:
        raise LaunchError(
            "trainer.device=cuda, but the Ray cluster has no GPUs; use trainer.device=cpu for "
            "CPU ranks"
        )
    use_gpus = device == "cuda" or (device == "auto" and cluster_gpus > 0)
    return LaunchPlan(nnodes, ranks_per_node, use_gpus, cpus_per_rank)


def master_address(node_ips: list[str]) -> str:
    """MASTER_ADDR: the node of rank 0 (`node_ips[i]`: the IP of rank i's actor)."""
    return node_ips[0]


def node_visible_devices(plan: LaunchPlan, gpu_ids: list[list[str]]) -> list[str | None]:
    """CUDA_VISIBLE_DEVICES for each rank (`gpu_ids[rank]`: the GPU ids Ray gave its actor):
    its node's GPUs in local-rank order, so local rank k's own GPU is device k. None for
    every rank without GPUs (the variable is then left as the node has it)."""
    if not plan.use_gpus:
        return [None] * plan.world_size
    for rank, ids in enumerate(gpu_ids):
        if len(ids) != 1:
            raise LaunchError(f"Ray gave rank {rank} the GPUs {ids}; it reserved exactly one")
    per_node = plan.ranks_per_node
    nodes = [
        ",".join(ids[0] for ids in gpu_ids[n * per_node : (n + 1) * per_node])
        for n in range(plan.nnodes)
    ]
    return [nodes[slot.node_rank] for slot in plan.slots()]


def rank_env(
    plan: LaunchPlan, slot: RankSlot, master_addr: str, master_port: int, devices: str | None
) -> dict[str, str]:
    """The torchrun variables of rank `slot` (what `rlhf.distributed.bootstrap` and
    `rlhf.config.validate.check_launch` read), plus CUDA_VISIBLE_DEVICES on GPUs."""
    env = {
        "RANK": str(slot.rank),
        "LOCAL_RANK": str(slot.local_rank),
        "WORLD_SIZE": str(plan.world_size),
        "LOCAL_WORLD_SIZE": str(plan.ranks_per_node),
        "GROUP_RANK": str(slot.node_rank),
        "NODE_RANK": str(slot.node_rank),
        "GROUP_WORLD_SIZE": str(plan.nnodes),
        "ROLE_RANK": str(slot.rank),
        "ROLE_WORLD_SIZE": str(plan.world_size),
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(master_port),
    }
    if devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = devices
    return env


def trainer_command(python: str, trainer_args: list[str]) -> list[str]:
    """Each rank's process: the same entry point as `rlhf-train` under torchrun."""
    return [python, "-m", TRAINER_MODULE, *trainer_args]


def exit_code(returncode: int) -> int:
    """A rank's process status as a shell reports it: 128 + N for death by signal N."""
    return 128 - returncode if returncode < 0 else returncode


def failure_line(slot: RankSlot, node_ip: str, returncode: int, last_line: str) -> str:
    """The one line naming the first rank that failed and how."""
    code = exit_code(returncode)
    how = f"exited with {code}"
    if returncode < 0:
        how = f"was killed by {signal.Signals(-returncode).name} ({code})"
    said = f": {last_line.strip()}" if last_line.strip() else ""
    return f"rank {slot.rank} (node {slot.node_rank}, {node_ip}) {how}{said}"
