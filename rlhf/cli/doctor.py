"""`rlhf-doctor`: preflight checks of one run, on the node that will run it.

    rlhf-doctor --config configs/gsm8k_2node.yaml [key=value ...] [--world-size N]
                [--gpu-memory-gb 80] [--host-memory-gb 2048] [--gpus-per-node 8]
                [--model-config configs/model_shapes/Qwen2.5-7B.json] [--simulate]
    rlhf-doctor --simulate          (every shipped GPU config, with its model's shape)

Why: a job that dies minutes into its allocation on a busy port, an unreachable master, a
full disk, a dead SGLang server or a bad parallel layout wastes the queue wait; each of these
can be seen from the node in seconds. Give it the config and overrides of the run, under the
environment of the launch (NODE_RANK, MASTER_ADDR, MASTER_PORT, WORLD_SIZE, GPUS_PER_NODE
as read by launch/torchrun.sh). Every check is a small function returning a `Check`;
the CLI prints a table (check | status | detail | fix), then the SGLang servers' GPUs per
node (rlhf.config.placement) and the memory planner's per-GPU table (rlhf.memory), and exits
1 if any check FAILs (a config that does not fit the GPU included), 0 otherwise, and 2 with
one line when the config cannot be loaded (as rlhf-train does). `--simulate` adds the
memory simulation: one rank's real build and step at the real shapes under fake tensors,
phase by phase next to the planner (minutes on a CPU; `rlhf.cli.doctor_simulate`); a
shipped config as shipped gets its stored simulation next to the planner without it.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import textwrap
from collections.abc import Mapping
from pathlib import Path

import torch

from rlhf.cli.doctor_checks import (
    FAIL,
    Check,
    check_config,
    check_cuda,
    check_inputs,
    check_master_addr,
    check_master_port,
    check_packages,
    check_run_dir,
    check_sglang_urls,
    check_weight_sync_address,
)
from rlhf.cli.doctor_memory import check_memory
from rlhf.cli.doctor_placement import LaunchEnvError, check_placement, node_gpus
from rlhf.cli.doctor_simulate import SHIPPED, check_simulation, check_stored, simulate_shipped
from rlhf.config import ConfigError, RLHFConfig, load_config
from rlhf.config.validate import ParallelLayout, config_notes, validate_config
from rlhf.errors import ends_in_one_line
from rlhf.memory.planner import PlanInputs
from rlhf.models.families import ModelArch
from rlhf.rollout.multi_turn_config import load_configured_tools

DEFAULT_REQUIREMENTS = Path("requirements")  # a checkout's, when run from its root


def _env_int(environ: Mapping[str, str], key: str, default: int) -> int:
    value = environ.get(key) or str(default)
    try:
        return int(value)
    except ValueError:
        raise LaunchEnvError(f"{key}={value!r} is not an integer") from None


def run_checks(
    cfg: RLHFConfig,
    world_size: int | None,
    environ: Mapping[str, str] = os.environ,
    requirements: Path = DEFAULT_REQUIREMENTS,
) -> list[Check]:
    """Every check for `cfg`, under the launch environment `environ`; installed packages
    are compared with `requirements`/cpu.lock (and gpu.txt on a GPU machine). The doctor's
    one reader of the whole config: each check gets its sections."""
    node_rank = _env_int(environ, "NODE_RANK", 0)
    port = _env_int(environ, "MASTER_PORT", 29500)
    addr = environ.get("MASTER_ADDR") or "127.0.0.1"
    trainer, rollout = cfg.trainer, cfg.actor_rollout_ref.rollout
    gpu_txt = requirements / "gpu.txt" if torch.cuda.is_available() else None
    model_path = cfg.actor_rollout_ref.model.path
    model_dir = Path(model_path) if model_path else None

    def validated(shape: ModelArch | None) -> tuple[ParallelLayout, list[str]]:
        layout = validate_config(cfg, world_size, shape)
        load_configured_tools(cfg.actor_rollout_ref.rollout.multi_turn)
        return layout, config_notes(cfg)

    return [
        check_packages(requirements / "cpu.lock", gpu_txt),
        check_cuda(trainer.device, trainer.n_gpus_per_node),
        check_master_port(port, node_rank),
        check_master_addr(addr, port, node_rank, trainer.nnodes),
        check_run_dir(Path(trainer.default_local_dir), model_dir),
        check_sglang_urls(rollout.server_urls, rollout.num_servers),
        check_weight_sync_address(
            rollout.server_urls,
            rollout.weight_sync_transport,
            rollout.weight_sync_master_address,
        ),
        check_config(model_path, validated),
        check_inputs(model_path, cfg.critic.model.path, cfg.reward.model_path, cfg.data),
    ]


def _wrap(text: str, width: int) -> list[str]:
    return textwrap.wrap(text, width, break_on_hyphens=False)


def format_table(checks: list[Check], detail_width: int = 72, fix_width: int = 56) -> str:
    """Rows `check | status | detail | fix` under a header; long texts wrap inside their column."""
    rows = [("check", "status", "detail", "fix")]
    rows += [(c.name, c.status, c.detail, c.fix) for c in checks]
    limits = (None, None, detail_width, fix_width)
    cells = [[_wrap(v, lim) if lim else [v] for v, lim in zip(row, limits)] for row in rows]
    widths = [max(len(line) for row in cells for line in row[i]) for i in range(4)]
    lines = []
    for row in cells:
        for parts in itertools.zip_longest(*row, fillvalue=""):
            lines.append(" | ".join(v.ljust(w) for v, w in zip(parts, widths)).rstrip())
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rlhf-doctor", description=__doc__.splitlines()[0])
    parser.add_argument("--config", help="YAML run config (see configs/)")
    parser.add_argument("--world-size", type=int, help="processes of the run (default: launch)")
    parser.add_argument(
        "--requirements",
        type=Path,
        default=DEFAULT_REQUIREMENTS,
        help="directory with cpu.lock and gpu.txt to check installed versions against "
        "(default: ./requirements; the check is skipped when it is absent)",
    )
    parser.add_argument(
        "--gpu-memory-gb", type=float, help="GPU memory to plan for (default: this GPU's)"
    )
    parser.add_argument(
        "--host-memory-gb",
        type=float,
        help="RAM of one node to plan for (default: this machine's)",
    )
    parser.add_argument(
        "--gpus-per-node",
        type=int,
        help="GPUs of a node to place the SGLang servers on (default: GPUS_PER_NODE as "
        "launch/torchrun.sh reads it, else trainer.n_gpus_per_node)",
    )
    parser.add_argument(
        "--model-config",
        type=Path,
        help="an HF config.json to plan memory with when the model is not downloaded",
    )
    parser.add_argument(
        "--simulate",
        action="store_true",
        help="also run the memory simulation (one rank's step at the real shapes under fake "
        "tensors; minutes) and compare the planner with it; without --config: every shipped "
        "GPU config",
    )
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. data.seed=3")
    args = parser.parse_args(argv)
    if args.simulate and args.config is None:
        return simulate_shipped(args.gpu_memory_gb)
    try:
        cfg = load_config(args.config, args.overrides)
        world_size = args.world_size or _env_int(os.environ, "WORLD_SIZE", 0) or None
        checks = run_checks(cfg, world_size, requirements=args.requirements)
        gpus = node_gpus(args.gpus_per_node, os.environ, cfg.trainer)
        placement, servers = check_placement(cfg.trainer, cfg.actor_rollout_ref.rollout, *gpus)
        device = "cpu" if cfg.trainer.device == "cpu" else "cuda"
        memory, report = check_memory(
            cfg.actor_rollout_ref.model.path,
            lambda arch: PlanInputs.from_config(cfg, arch, world_size, device),
            args.model_config,
            args.gpu_memory_gb,
            args.host_memory_gb,
        )
        simulation, simulated = _simulation(args)
    except (ConfigError, LaunchEnvError) as e:
        print(f"rlhf-doctor: config error: {e}", file=sys.stderr)
        return 2
    checks.extend([placement, *memory])
    if simulation is not None:
        checks.append(simulation)
    print(format_table(checks))
    if servers:
        print(f"\nSGLang servers, GPU ids per server:\n{servers}")
    if report:
        print(f"\nmemory per GPU (GiB), by role and kind:\n{report}")
    if simulated:
        print(f"\nmemory per phase, planned vs simulated:\n{simulated}")
    failed = [c.name for c in checks if c.status == FAIL]
    if failed:
        print(f"rlhf-doctor: {len(failed)} check(s) failed: {', '.join(failed)}")
        return 1
    print("rlhf-doctor: no check failed")
    return 0


def _simulation(args: argparse.Namespace) -> tuple[Check | None, str]:
    """`--simulate`: run the simulation; else a shipped config as shipped (no overrides, its
    own model shape): the stored simulation; else none."""
    if args.simulate:
        return check_simulation(args.config, args.model_config, args.overrides, args.gpu_memory_gb)
    if args.config is None or args.overrides:
        return None, ""
    config = os.path.relpath(Path(args.config).resolve())
    shape = SHIPPED.get(config)
    if shape is None:
        return None, ""
    if args.model_config is not None and Path(args.model_config).resolve() != Path(shape).resolve():
        return None, ""
    return check_stored(config, args.gpu_memory_gb)


main = ends_in_one_line("rlhf-doctor")(main)  # rlhf.errors: one line, exit 2 or 1


if __name__ == "__main__":
    sys.exit(main())
