"""`rlhf-ray-train`: `rlhf-train` on an existing Ray cluster, one Ray actor per rank.

    rlhf-ray-train [--address ADDR] [launcher options] --config FILE [key=value ...]
    ray job submit --address http://HEAD:8265 --working-dir . -- rlhf-ray-train --config FILE ...

Why plain placement groups and actors, not Ray Train's TorchTrainer: the trainer already is an
SPMD program that initialises torch.distributed from torchrun's variables, starts its own SGLang
servers, handles SIGTERM with a checkpoint and ends with an exit code that means something
(`rlhf.cli.train`). TorchTrainer would run it as a function inside its own workers, set up the
process group itself and report through its own session and checkpoint API, none of which
this system uses. Here each actor only starts `python -m rlhf.cli.train ...` with the
variables torchrun would have given it (`rlhf.cli.ray_plan`), so a rank runs exactly as it runs
under `launch/torchrun.sh`. The driver plays torchrun's part: it waits for every rank; when
one fails it names it in one line, stops the others (SIGTERM, then SIGKILL after
`--grace-s`) and exits with that rank's code; a SIGTERM or Ctrl-C of the driver (`ray job
stop`) reaches every rank, which end after their step as under a scheduler's signal.

Each rank's output goes to `<run dir>/logs/rank_<R>.log` on its node and to the driver
(Ray forwards it, prefixed with `(rank<R> pid=...)`).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any, Protocol

from rlhf.cli.ray_plan import (
    LaunchError,
    LaunchPlan,
    RankSlot,
    exit_code,
    failure_line,
    master_address,
    node_visible_devices,
    plan_launch,
    rank_env,
    trainer_command,
)
from rlhf.errors import ends_in_one_line

log = logging.getLogger("rlhf.cli.ray_train")
PROG = "rlhf-ray-train"


class RankProcess:
    """One trainer rank inside a Ray actor: its `python -m rlhf.cli.train` process (its own
    process group, so that a stop reaches the servers it started too) and the end of its output."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.proc: subprocess.Popen | None = None
        self.tail: collections.deque[str] = collections.deque(maxlen=20)
        self.pump: threading.Thread | None = None

    def __repr__(self) -> str:  # Ray prefixes the lines it forwards to the driver with this
        return f"rank{self.rank}"

    def node(self) -> tuple[str, list[str]]:
        """This actor's node IP and the GPU ids Ray gave it."""
        import ray

        ids = ray.get_runtime_context().get_accelerator_ids().get("GPU", [])
        return ray.util.get_node_ip_address(), [str(i) for i in ids]

    def free_port(self) -> int:
        """A free port on this node (rank 0's: the rendezvous)."""
        from rlhf.utils import free_port

        return free_port()

    def start(self, trainer_args: list[str], env: dict[str, str], log_path: str) -> int:
        """Start the rank's process with this node's Python (it dies with this actor); its
        pid."""
        from rlhf.utils import die_with_parent

        Path(log_path).parent.mkdir(parents=True, exist_ok=True)
        actor_pid = os.getpid()
        self.proc = subprocess.Popen(
            trainer_command(sys.executable, trainer_args),
            env={**os.environ, **env},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=lambda: die_with_parent(actor_pid),
        )
        assert self.proc.stdout is not None
        sink = open(log_path, "ab", buffering=0)  # noqa: SIM115 (closed by the pump)
        self.pump = threading.Thread(target=_pump, args=(self.proc.stdout, sink, self.tail))
        self.pump.daemon = True
        self.pump.start()
        return self.proc.pid

    def poll(self) -> tuple[int, str] | None:
        """None while running; else (return code, its last output line)."""
        assert self.proc is not None, "start() first"
        code = self.proc.poll()
        if code is None:
            return None
        if self.pump is not None:
            self.pump.join(timeout=5)  # the last lines
        return code, self.tail[-1] if self.tail else ""

    def stop(self, sig: int) -> None:
        """Signal the rank's process group (SIGTERM: end after the step, SIGKILL: now)."""
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):  # ended since the poll
                os.killpg(self.proc.pid, sig)


def _pump(stream: IO[bytes], sink: IO[bytes], tail: collections.deque[str]) -> None:
    """Copy a rank's output to its log file and to the actor's stdout (forwarded by Ray)."""
    with stream, sink:
        for raw in stream:
            sink.write(raw)
            line = raw.decode(errors="replace").rstrip("\n")
            print(line, flush=True)
            if line.strip():
                tail.append(line)


class RankHandle(Protocol):
    """What the supervisor needs of a running rank (a Ray actor, or a stand-in in tests)."""

    slot: RankSlot
    node_ip: str

    def poll(self) -> tuple[int, str] | None: ...

    def stop(self, sig: int) -> None: ...


class Supervisor:
    """torchrun's part: wait for every rank; the first failure stops the others."""

    def __init__(
        self, ranks: Sequence[RankHandle], grace_s: float, clock: Callable[[], float]
    ) -> None:
        self.pending = {rank.slot.rank: rank for rank in ranks}
        self.grace_s, self.clock = grace_s, clock
        self.code, self.failure = 0, ""
        self.stopping_since: float | None = None
        self.killed = False
        self.signals: list[int] = []  # received by the driver, handled in `step`

    def step(self) -> bool:
        """One round of polls and decisions; True while a rank still runs."""
        for rank, handle in list(self.pending.items()):
            status = handle.poll()
            if status is None:
                continue
            del self.pending[rank]
            if status[0] != 0 and self.stopping_since is None:
                self.code = exit_code(status[0])
                self.failure = failure_line(handle.slot, handle.node_ip, *status)
                self._stop_all(signal.SIGTERM)
        if self.signals and self.stopping_since is None:
            self.code = 128 + self.signals[0]
            self._stop_all(self.signals[0])
        since = self.stopping_since
        if since is not None and not self.killed and self.clock() - since > self.grace_s:
            self.killed = True
            for handle in self.pending.values():
                handle.stop(signal.SIGKILL)
        return bool(self.pending)

    def _stop_all(self, sig: int) -> None:
        self.stopping_since = self.clock()
        for handle in self.pending.values():
            handle.stop(sig)


def supervise(
    ranks: Sequence[RankHandle],
    grace_s: float,
    poll_s: float = 1.0,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> Supervisor:
    """Run a `Supervisor` until every rank has ended; the driver's signals (SIGTERM, SIGINT)
    are forwarded to the ranks, whose own handling ends them."""
    supervisor = Supervisor(ranks, grace_s, clock)

    def forward(sig: int, _frame: Any) -> None:
        supervisor.signals.append(sig)

    main_thread = threading.current_thread() is threading.main_thread()
    previous = {s: signal.signal(s, forward) for s in _SIGNALS} if main_thread else {}
    try:
        while supervisor.step():
            sleep(poll_s)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return supervisor


_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class ActorRank:
    """A `RankHandle` over a `RankProcess` actor; an actor lost with its node counts as a
    rank killed by SIGKILL."""

    def __init__(self, actor: Any, slot: RankSlot, node_ip: str) -> None:
        self.actor, self.slot, self.node_ip = actor, slot, node_ip

    def poll(self) -> tuple[int, str] | None:
        import ray

        try:
            return ray.get(self.actor.poll.remote(), timeout=60)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as e:
            return -signal.SIGKILL, f"its Ray actor is lost ({type(e).__name__})"

    def stop(self, sig: int) -> None:
        self.actor.stop.remote(sig)


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    """The launcher's options; everything else is rlhf-train's (--config, overrides, ...)."""
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Run rlhf-train on an existing Ray cluster: trainer.nnodes x "
        "trainer.n_gpus_per_node ranks, one Ray actor each. Other arguments go to rlhf-train.",
    )
    parser.add_argument(
        "--address", help="Ray cluster to join (default: RAY_ADDRESS, else a local cluster)"
    )
    parser.add_argument(
        "--cpus-per-rank", type=float, default=1.0, help="CPUs each rank reserves [1]"
    )
    parser.add_argument(
        "--placement-timeout-s",
        type=float,
        default=300.0,
        help="how long to wait for the cluster to hold every rank [300]",
    )
    parser.add_argument(
        "--grace-s",
        type=float,
        default=600.0,
        help="after a rank failed or the driver was signalled, how long the other ranks have "
        "to end before SIGKILL [600, as launch/torchrun.sh]",
    )
    parser.add_argument("--log-dir", help="per-rank logs (default: <run dir>/logs)")
    return parser.parse_known_args(argv)


def load_run(trainer_args: list[str]) -> Any:
    """The trainer's config, checked for the world the launch will start (one line on error)."""
    from rlhf.cli import train
    from rlhf.config import validate_config
    from rlhf.config.hydra_load import load_command_line

    args = train.parse_args(trainer_args)
    cfg = load_command_line(args.config, args.config_path, args.config_name, args.overrides).config
    t = cfg.trainer
    validate_config(cfg, t.nnodes * t.n_gpus_per_node, local_world_size=t.n_gpus_per_node)
    return cfg


def launch(opts: argparse.Namespace, trainer_args: list[str], cfg: Any) -> int:
    """Reserve the placement group, start one actor per rank, supervise; the exit code."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    os.environ.setdefault("RAY_DEDUP_LOGS", "0")  # every rank's lines, not "repeated 2x"
    if not ray.is_initialized():
        ray.init(address=opts.address, log_to_driver=True)
    t = cfg.trainer
    gpus = ray.cluster_resources().get("GPU", 0.0)
    plan = plan_launch(t.nnodes, t.n_gpus_per_node, t.device, gpus, opts.cpus_per_rank)
    group = placement_group(plan.bundles(), strategy=plan.strategy, name="rlhf-train")
    actors: list[Any] = []
    try:
        if not group.wait(timeout_seconds=opts.placement_timeout_s):
            raise LaunchError(
                f"the Ray cluster did not hold {plan.nnodes} node(s) of {plan.bundles()[0]} "
                f"({plan.strategy}) within {opts.placement_timeout_s:g} s; it has "
                f"{ray.available_resources()} free"
            )
        actors = start_actors(plan, group)
        log_dir = Path(opts.log_dir or Path(t.default_local_dir) / "logs")
        ranks = start_ranks(plan, actors, trainer_args, log_dir)
        print(f"{PROG}: {plan.world_size} ranks started; logs in {log_dir}/rank_*.log", flush=True)
        result = supervise(ranks, opts.grace_s)
    finally:
        for actor in actors:
            ray.kill(actor)
        remove_placement_group(group)
    if result.failure:
        print(f"{PROG}: {result.failure}", file=sys.stderr, flush=True)
    elif result.code:
        print(f"{PROG}: stopped by a signal; the ranks ended as their lines say", file=sys.stderr)
    return result.code


def start_actors(plan: LaunchPlan, group: Any) -> list[Any]:
    """One `RankProcess` actor per rank, in the bundle of its node."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    remote = ray.remote(RankProcess)
    return [
        remote.options(
            **plan.rank_resources(),
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                group, placement_group_bundle_index=slot.node_rank
            ),
        ).remote(slot.rank)
        for slot in plan.slots()
    ]


def start_ranks(
    plan: LaunchPlan, actors: list[Any], trainer_args: list[str], log_dir: Path
) -> list[ActorRank]:
    """Ask every actor where it runs, pick rank 0's port, start each rank's process with its
    torchrun environment."""
    import ray

    nodes = ray.get([actor.node.remote() for actor in actors])
    ips = [ip for ip, _ in nodes]
    devices = node_visible_devices(plan, [ids for _, ids in nodes])
    master, port = master_address(ips), ray.get(actors[0].free_port.remote())
    started = [
        actor.start.remote(
            trainer_args,
            rank_env(plan, slot, master, port, devices[slot.rank]),
            str(log_dir / f"rank_{slot.rank}.log"),
        )
        for slot, actor in zip(plan.slots(), actors)
    ]
    ray.get(started)
    return [ActorRank(a, slot, ips[slot.rank]) for slot, a in zip(plan.slots(), actors)]


@ends_in_one_line(PROG)  # rlhf.errors: one line, exit 2 or 1 (a LaunchError: 1)
def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    opts, trainer_args = parse_args(argv)
    from rlhf.cli import train
    from rlhf.config import ConfigError

    if "--print-config" in trainer_args:  # nothing to launch
        return train.main(trainer_args)
    try:
        cfg = load_run(trainer_args)
    except ConfigError as e:
        print(f"{PROG}: config error: {e}", file=sys.stderr)
        return 2
    try:
        return launch(opts, trainer_args, cfg)
    except ConnectionError as e:  # ray.init: no cluster at --address / RAY_ADDRESS
        print(f"{PROG}: cannot reach the Ray cluster: {str(e).splitlines()[0]}", file=sys.stderr)
        return 1


def entry() -> None:
    """The `rlhf-ray-train` command."""
    sys.exit(main())


if __name__ == "__main__":
    entry()
