"""`python -m rlhf.cli.launch_servers`: standalone SGLang servers for disaggregated rollouts.

    python -m rlhf.cli.launch_servers --model DIR [--num-servers 2] [--tp 4]
        [--base-port 30000] [--host 0.0.0.0] [--device cuda|cpu] [--dtype bfloat16]
        [--router --router-port 30100] [--log-dir logs/sglang] [--startup-timeout 600]

Why a Python entry point rather than a shell loop: the servers must get exactly the command
line the trainer would give them (`build_server_args`, the one place that builds it), be
health-checked with the same probe, and be stopped as whole process groups, which
`ServerGroup` already does. `launch/sglang_servers.sh` wraps this with environment variables.

Once every server answers GET /health it prints, on stdout, each server URL on its own line,
then the override to paste into the training command,
`actor_rollout_ref.rollout.server_urls=[...]`, and with `--router` a line `router_url=URL`.
It then runs until SIGTERM or SIGINT and stops every server (and the router) before exiting 0.
A server that dies is restarted at most `--max-restarts` times (default 0: the launcher stops
the others and exits 1, naming the URL and its log); a restarted server serves the weights of
`--model` until the trainer's next weight sync. Startup failures exit 1, bad arguments 2.

The servers (and the router) require the key in `RLHF_SGLANG_API_KEY` when it is set; give
the trainer the same value. Binding an address other machines can reach without a key is
refused: SGLang's weight-update routes would take requests from anyone who reaches the port.
"""

from __future__ import annotations

import argparse
import logging
import signal
import socket
import sys
import time
from types import FrameType
from typing import Any

import yaml

from rlhf.config.engine_args import launched_rollout, server_argv
from rlhf.config.loader import build, load_config
from rlhf.config.placement import is_loopback_host
from rlhf.config.schema import RLHFConfig, RolloutConfig
from rlhf.errors import UserError, ends_in_one_line
from rlhf.rollout.server_group import KEY, ServerGroup
from rlhf.sglang_api import API_KEY_ENV, api_key

log = logging.getLogger("rlhf.launch_servers")

CPU_MAX_TOTAL_TOKENS = 4096  # KV-cache tokens of a CPU server unless --max-total-tokens
POLL_S = 2.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="launch_servers", description="Start SGLang servers for disaggregated rollouts."
    )
    p.add_argument("--model", required=True, help="HF model directory served by every server")
    p.add_argument("--num-servers", type=int, default=1, help="servers to start")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel GPUs per server")
    p.add_argument("--base-port", type=int, default=30000, help="server i listens on base + i")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0: all)")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument(
        "--dtype",
        choices=["float32", "bfloat16", "float16"],
        default=None,
        help="default: bfloat16 on cuda, float32 on cpu",
    )
    p.add_argument("--mem-fraction", type=float, default=0.85, help="GPU memory share for SGLang")
    p.add_argument(
        "--max-total-tokens",
        type=int,
        default=None,
        help=f"KV-cache tokens (default on cpu: {CPU_MAX_TOTAL_TOKENS})",
    )
    p.add_argument("--router", action="store_true", help="also start an sglang-router")
    p.add_argument("--router-port", type=int, default=30100)
    p.add_argument("--log-dir", default="logs/sglang", help="one log file per server")
    p.add_argument("--startup-timeout", type=float, default=600.0, help="seconds to get healthy")
    p.add_argument("--max-restarts", type=int, default=0, help="restarts per dead server")
    p.add_argument("--seed", type=int, default=0, help="sampling seed of server 0 (i: seed + i)")
    p.add_argument("--config", help="a run config: its rollout.engine_kwargs.sglang apply here")
    p.add_argument(
        "--engine-kwarg",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="an SGLang server argument (repeatable; after --config's)",
    )
    return p.parse_args(argv)


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The run config's `engine_kwargs.sglang` (as the trainer launches it), updated by
    --engine-kwarg NAME=VALUE."""
    kwargs = (
        dict(launched_rollout(load_config(args.config).actor_rollout_ref).engine_kwargs.sglang)
        if (args.config)
        else {}
    )
    for item in args.engine_kwarg:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise UserError(f"--engine-kwarg {item!r}: expected NAME=VALUE")
        kwargs[name.strip()] = yaml.safe_load(value)
    return kwargs


def rollout_config(args: argparse.Namespace) -> RolloutConfig:
    """The rollout section these flags stand for, range-checked like a run config."""
    dtype = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
    values = {
        "tensor_model_parallel_size": args.tp,
        "dtype": dtype,
        "gpu_memory_utilization": args.mem_fraction,
        "server_startup_timeout_s": args.startup_timeout,
        "num_servers": args.num_servers,
        "use_router": args.router,
        "max_server_restarts": args.max_restarts,
        "engine_kwargs": {"sglang": engine_kwargs(args)},
    }
    rollout = build(RolloutConfig, values, f"{KEY}.", RLHFConfig)
    server_argv(rollout.engine_kwargs.sglang)  # checked against SGLang's parser now
    return rollout


def check_exposure(host: str) -> None:
    """Refuse a reachable bind address without an API key (a `UserError`, one line)."""
    if not is_loopback_host(host) and api_key() is None:
        raise UserError(
            f"--host {host} lets other machines reach the servers, whose weight-update routes "
            f"need no key unless {API_KEY_ENV} is set: export {API_KEY_ENV}=<secret> here "
            "and for the trainer, or bind 127.0.0.1"
        )


def advertised(url: str, host: str) -> str:
    """The URL other machines use: a wildcard bind address is replaced by this host's name."""
    if host in ("0.0.0.0", "::", ""):
        return url.replace(f"//{host}:", f"//{socket.getfqdn()}:", 1)
    return url


def announce(group: ServerGroup, host: str) -> None:
    """Print the URLs and the ready-to-paste trainer override on stdout."""
    urls = [advertised(u, host) for u in group.server_urls]
    for url in urls:
        print(url)
    print(f"{KEY}.server_urls=[{','.join(urls)}]")
    if group.router is not None:
        print(f"router_url={advertised(group.router.url, host)}")
    sys.stdout.flush()


def supervise(group: ServerGroup) -> None:
    """Until a signal: restart a dead process (the group raises once restarts run out)."""
    while True:
        time.sleep(POLL_S)
        for process in (*group.servers, group.router):
            if process is not None and not process.is_alive():
                log.error("SGLang process at %s died; log %s", process.url, process.log_path)
                group.recover(process.url)


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    args = parse_args(argv)
    try:
        check_exposure(args.host)
        rollout = rollout_config(args)
    except UserError as e:
        print(f"launch_servers: error: {e}", file=sys.stderr)
        return 2
    # Installed first: the group's own SIGTERM handler stops the servers, then chains here.
    previous = signal.signal(signal.SIGTERM, _interrupt)
    group = ServerGroup(
        rollout,
        args.model,
        log_dir=args.log_dir,
        device=args.device,
        seed=args.seed,
        max_total_tokens=args.max_total_tokens
        or (CPU_MAX_TOTAL_TOKENS if args.device == "cpu" else None),
        host=args.host,
        base_port=args.base_port,
        router_port=args.router_port if args.router else None,
    )
    try:
        group.start()
        announce(group, args.host)
        supervise(group)
    except KeyboardInterrupt as e:
        log.info("%s: stopping SGLang servers %s", e or "SIGINT", group.server_urls)
        return 0
    except (RuntimeError, TimeoutError, OSError) as e:
        print(f"launch_servers: error: {e}", file=sys.stderr)
        return 1
    finally:
        group.stop()
        signal.signal(signal.SIGTERM, previous)
    return 0


main = ends_in_one_line("launch_servers")(main)  # rlhf.errors: one line, exit 2 or 1


if __name__ == "__main__":
    sys.exit(main())
