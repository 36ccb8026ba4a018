"""rlhf-doctor's server placement: the GPUs each SGLang server of the run takes, node by node
(`rlhf.config.placement`, the rule the trainer's servers are launched by), and whether a GPU
would hold two servers."""

from __future__ import annotations

from collections.abc import Mapping

from rlhf.cli.doctor_checks import FAIL, PASS, SKIP, WARN, Check
from rlhf.config import ConfigError
from rlhf.config.placement import GPUS_KEY, RolloutPlacement, gpu_ids_text, rollout_placement
from rlhf.config.schema import RolloutConfig, TrainerConfig
from rlhf.errors import UserError

NAME = "server placement"


class LaunchEnvError(ValueError, UserError):
    """A launch variable (GPUS_PER_NODE, WORLD_SIZE, MASTER_PORT, ...) that is no integer."""


def node_gpus(
    flag: int | None, environ: Mapping[str, str], trainer: TrainerConfig
) -> tuple[int, str]:
    """The GPUs of one node and where that number comes from: --gpus-per-node, else
    GPUS_PER_NODE (as launch/torchrun.sh reads it), else trainer.n_gpus_per_node."""
    if flag is not None:
        return flag, "--gpus-per-node"
    value = environ.get("GPUS_PER_NODE")
    if value:
        try:
            return int(value), "GPUS_PER_NODE"
        except ValueError:
            raise LaunchEnvError(f"GPUS_PER_NODE={value!r} is not an integer") from None
    return trainer.n_gpus_per_node, GPUS_KEY


def placement_table(placement: RolloutPlacement) -> str:
    """One row per server: its node (or host), its index there, its GPU ids (and URL)."""
    rows: list[tuple[str, ...]] = [
        ("node", "server", "GPUs") if placement.colocated else ("host", "server", "GPUs", "url")
    ]
    for node in placement.nodes:
        for i, gpus in enumerate(node.gpus):
            rows.append((node.node, str(i), gpu_ids_text(gpus), *node.urls[i : i + 1]))
    widths = [max(len(row[c]) for row in rows) for c in range(len(rows[0]))]
    lines = [" | ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(lines)


def check_placement(
    trainer: TrainerConfig, rollout: RolloutConfig, gpus: int, source: str
) -> tuple[Check, str]:
    """(the verdict, the report: a heading line and one row per server, or '')."""
    if trainer.device == "cpu":
        return Check(NAME, SKIP, "CPU run (trainer.device=cpu): the servers use no GPU"), ""
    try:
        placement = rollout_placement(rollout, trainer.nnodes, gpus, source)
    except ConfigError as e:
        return Check(NAME, FAIL, str(e), "fewer servers or a smaller rollout TP"), ""
    tp = rollout.tensor_model_parallel_size
    if placement.colocated:
        used = rollout.num_servers * tp
        detail = (
            f"colocated: {rollout.num_servers} server(s) x TP {tp} on GPUs "
            f"{gpu_ids_text(tuple(range(used)))} of each node's {gpus} ({source}), disjoint"
        )
        heading = (
            f"colocated ({trainer.nnodes} node(s) x {gpus} GPUs, shared with the trainer ranks):"
        )
        return Check(NAME, PASS, detail), f"{heading}\n{placement_table(placement)}"
    heading = (
        f"disaggregated (no server on the {trainer.nnodes} trainer node(s)); on their hosts as "
        "launch/sglang_servers.sh places them:"
    )
    report = f"{heading}\n{placement_table(placement)}"
    crowded = [n.node for n in placement.nodes if len(n.gpus) * tp > gpus]
    if crowded:
        detail = (
            f"{', '.join(crowded)} serve(s) more than {gpus} GPUs' worth of TP {tp} servers "
            f"({source}): they share GPUs if the host has {gpus}"
        )
        return Check(NAME, WARN, detail, "spread the servers over more hosts"), report
    detail = f"disaggregated: {len(placement.nodes)} server host(s), TP {tp}; none on the trainers"
    return Check(NAME, PASS, detail), report
