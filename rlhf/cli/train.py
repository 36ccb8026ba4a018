"""`rlhf-train` / `python -m rlhf.cli.train`: load and check the config, bootstrap, run.

    rlhf-train --config configs/quickstart_cpu.yaml [key=value ...] [--print-config]
    rlhf-train --config-path DIR --config-name NAME [key=value ...]   (Hydra's, as verl's scripts)

Works as a single process or under torchrun. Config errors print one line and exit 2.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NoReturn

from rlhf.config import ConfigError, RLHFConfig, dump_yaml, validate_config
from rlhf.config.hydra_load import grouped, load_command_line
from rlhf.config.schema import ActorRolloutRefConfig
from rlhf.config.validate import config_notes
from rlhf.distributed import launch_env
from rlhf.errors import ends_in_one_line
from rlhf.rollout.multi_turn_config import load_configured_tools
from rlhf.trainer.stopping import Preempted
from rlhf.utils import collection_deferred, keep_freed_memory, omp_spin_env

log = logging.getLogger("rlhf.cli.train")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="rlhf-train", description="KL-regularised PPO with Megatron-Core and SGLang."
    )
    parser.add_argument("--config", help="YAML run config (see configs/)")
    parser.add_argument(
        "--config-path",
        "--config-dir",
        dest="config_path",
        help="directory of Hydra configs (with --config-name; verl's scripts pass it)",
    )
    parser.add_argument("--config-name", help="Hydra config in --config-path, composed")
    parser.add_argument(
        "--print-config",
        action="store_true",
        help="print the resolved config as YAML (then the ignored keys, as comments) and exit",
    )
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. data.seed=3")
    return parser.parse_intermixed_args(argv)  # overrides before and after the options


def resolve(args: argparse.Namespace) -> tuple[RLHFConfig, list[str]]:
    """Load + validate (and load the multi-turn tools, which the config layer cannot); the
    world size comes from torchrun when launched by it. The config and its ignored keys."""
    loaded = load_command_line(args.config, args.config_path, args.config_name, args.overrides)
    cfg = loaded.config
    world, local = launch_env.launched_world_size(), launch_env.launched_local_world_size()
    validate_config(cfg, world, local_world_size=local)
    load_configured_tools(cfg.actor_rollout_ref.rollout.multi_turn)
    return cfg, loaded.ignored


@contextmanager
def locked(run_dir: Path) -> Iterator[None]:
    """Inside: the run directory locked by the main rank (one run at a time writes into it:
    `rlhf.checkpoint.run_lock`)."""
    from rlhf.checkpoint.run_lock import RunDirLock  # imports torch (rlhf.checkpoint)

    lock = RunDirLock(run_dir).acquire() if int(os.environ.get("RANK", "0")) == 0 else None
    try:
        yield
    finally:
        if lock is not None:
            lock.release()


@contextmanager
def held_servers(aro: ActorRolloutRefConfig, requested_device: str) -> Iterator[None]:
    """Inside: the launches of this process's servers held while the run imports, checks
    and builds (`rlhf.rollout.sglang_server.hold_run_servers`: SGLang's ~4 s of imports
    overlap that work, and no server starts before the checks pass); on the way out, any
    still held are let go. Entered before torch is imported on the CPU
    (`trainer.device=cpu`): torch's import is 1 s of the servers' start."""
    from rlhf.rollout import sglang_server

    device = requested_device
    if device != "cpu":  # auto, cuda: torch says whether there is a GPU
        from rlhf.distributed.bootstrap import pick_device

        device = pick_device(requested_device).type
    sglang_server.hold_run_servers(aro, device, int(os.environ.get("LOCAL_RANK", "0")))
    try:
        yield
    finally:
        sglang_server.release_held()


def bootstrap_layout(device: str, layout: Any, world: int) -> Any:
    """This rank's `ParallelContext` for a checked `ParallelLayout` (`device`: the config's
    trainer.device); CPU ranks share the node's cores first (`rlhf.utils.cpu_threads`)."""
    from rlhf.distributed import bootstrap
    from rlhf.utils import share_cpu_cores

    if bootstrap.pick_device(device).type == "cpu":
        share_cpu_cores(int(os.environ.get("LOCAL_WORLD_SIZE", world)))
    return bootstrap.init_layout(device, layout)


def run(cfg: RLHFConfig) -> Path:
    """Hold the servers' launches (`held_servers`), lock the run directory (main rank), check
    the config against the launched world and the model (`rlhf.trainer.preflight`),
    bootstrap, then train. Python's garbage collector waits until the trainer is built,
    then leaves what the start created out of its scans (`collection_deferred`)."""
    run_dir = Path(cfg.trainer.default_local_dir)
    if cfg.trainer.device == "cpu":  # before torch loads OpenMP (the servers inherit it)
        os.environ.update(omp_spin_env())
        keep_freed_memory()
    with (
        collection_deferred() as built,  # the start's objects: never scanned (rlhf.utils)
        held_servers(cfg.actor_rollout_ref, cfg.trainer.device),
        locked(run_dir),
    ):
        from rlhf.distributed import bootstrap, cpu_compat

        device = bootstrap.pick_device(cfg.trainer.device).type
        if device == "cpu":  # before Megatron-Core's import (0.5 s of the start-up)
            cpu_compat.plain_megatron_fusers()
        from rlhf.trainer.loop import PPOTrainer
        from rlhf.trainer.preflight import preflight

        world = launch_env.launched_world_size() or 1
        local = launch_env.launched_local_world_size() or 1
        is_main = int(os.environ.get("RANK", "0")) == 0
        checked = preflight(cfg, world, local, device, is_main)  # before any server starts
        ctx = bootstrap_layout(cfg.trainer.device, checked.layout, world)
        trainer = None
        try:
            bootstrap.seed_everything(cfg.actor_rollout_ref.actor.megatron.seed)
            if ctx.is_main:
                run_dir.mkdir(parents=True, exist_ok=True)
                log.info("world %d: %s; run dir %s", ctx.world_size, ctx.describe(), run_dir)
                for note in config_notes(cfg):
                    log.warning("config: %s", note)
            trainer = PPOTrainer(cfg, ctx, run_dir, checked)
            built()
            last = trainer.fit()
            if ctx.is_main:
                report(run_dir, last)
        finally:
            if trainer is not None:
                trainer.close()
            bootstrap.teardown()
        return run_dir


def report(run_dir: Path, step: int) -> None:
    """Where the results are, and how validation moved."""
    print(f"rlhf-train: finished at step {step}", flush=True)
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    val = [(r["step"], r["val/test_score/all"]) for r in rows if "val/test_score/all" in r]
    if len(val) >= 2:
        (s0, v0), (s1, v1) = val[0], val[-1]
        print(f"  validation:  {v0:.3f} (step {s0}) -> {v1:.3f} (step {s1})", flush=True)
    print(f"  metrics:     {run_dir / 'metrics.jsonl'}", flush=True)
    print(f"  tensorboard: tensorboard --logdir {run_dir}", flush=True)
    print(f"  checkpoints: {run_dir / 'checkpoints'}", flush=True)
    print(f"  plot:        rlhf-plot {run_dir}  (writes {run_dir / 'metrics.png'})", flush=True)


@ends_in_one_line("rlhf-train")  # rlhf.errors: one line, exit 2 or 1
def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    args = parse_args(argv)
    try:
        cfg, ignored = resolve(args)
    except ConfigError as e:
        print(f"rlhf-train: config error: {e}", file=sys.stderr)
        return 2
    if args.print_config:
        sys.stdout.write(dump_yaml(cfg))
        sys.stdout.write("".join(f"# ignored: {line}\n" for line in grouped(ignored)))
        return 0
    for line in grouped(ignored):
        log.warning("config: ignored: %s", line)
    try:
        run(cfg)
    except Preempted as e:  # SIGTERM: ended after a step (rlhf.trainer.stopping)
        if int(os.environ.get("RANK", "0")) == 0:  # every rank ends alike: one line, not N
            print(f"rlhf-train: {e}", file=sys.stderr)
        return 128 + signal.SIGTERM
    except KeyboardInterrupt:  # the servers were stopped on the way out
        print(
            "rlhf-train: interrupted (Ctrl-C); the steps since the latest checkpoint are "
            "lost and the same command resumes from it",
            file=sys.stderr,
        )
        return 128 + signal.SIGINT
    return 0


def entry() -> NoReturn:
    """The `rlhf-train` command: `main`, then the process ends without Python's teardown
    (`rlhf.utils.exit_process`)."""
    from rlhf.utils import exit_process

    exit_process(main())


if __name__ == "__main__":
    entry()
